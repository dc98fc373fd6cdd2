"""The scheduler side of the connector: lookups started on arrival, polled without blocking,
loads and saves planned per step."""

from __future__ import annotations

import logging
import time
from typing import Any

from ...config import PrefetchConfig
from ...events import ChunkBlocks, KVEvent, RankEventMerger
from ...hashing import ChunkHasher
from .config import _world_size, endpoint_names, kv_events_wanted
from .metadata import (
    LMPrefetchConnectorMetadata,
    LMPrefetchConnectorStats,
    LMPrefetchKVEvents,
    LoadSpec,
    SaveSpec,
    _Counters,
)
from .tenancy import LoraIdentities, chunk_blocks, request_salt

log = logging.getLogger("lmprefetch.integration.vllm")

#: A held answer whose lookup started longer ago than this fraction of ``claim_ttl_s`` is
#: looked up again rather than used: the workers may release it before the step claims it.
_STALE_ANSWER_FRACTION = 0.5
#: The scheduler side's clock (a module attribute so tests can move it).
_now = time.monotonic


# -- scheduler side ---------------------------------------------------------------------------
class _RequestState:
    """What the scheduler side knows about one request (from ``on_new_request`` to
    ``request_finished``)."""

    __slots__ = (
        "consumed",
        "hashed_tokens",
        "hashes",
        "held",
        "last_num_computed",
        "live",
        "lookup_ok",
        "request",
        "result",
        "salt",
        "save_ok",
        "saved_tokens",
        "skip_tokens",
        "started_at",
    )

    def __init__(
        self, request: Any, lookup_ok: bool, save_ok: bool, salt: bytes | None = None
    ) -> None:
        self.request = request
        self.lookup_ok = lookup_ok
        self.save_ok = save_ok
        #: The request's name space (cache_salt, LoRA adapter): its chunks are hashed under it.
        self.salt = salt
        #: A lookup of this id is registered in the client (not yet forgotten or cancelled).
        self.live = False
        #: The answer (tokens from 0, skipped chunks included), once known.
        self.result: int | None = None
        #: When the current lookup was sent (a lower bound of the workers' answer time, from
        #: which their ``claim_ttl_s`` runs).
        self.started_at = 0.0
        #: Workers may hold a prefetch for this id (answered past the skipped prefix).
        self.held = False
        self.skip_tokens = 0
        #: The scheduler admitted the request with the current answer.
        self.consumed = False
        self.last_num_computed = 0
        #: Prompt tokens whose chunks are stored (or known to be): saves start there.
        self.saved_tokens = 0
        #: Chunk hashes of the request's first ``hashed_tokens`` tokens.
        self.hashes: list[int] = []
        self.hashed_tokens = 0


class _SchedulerSide:
    def __init__(self, vllm_config: Any, kv_cache_config: Any, config: PrefetchConfig) -> None:
        from ...client import LookupClient

        ktc = vllm_config.kv_transfer_config
        self._config = config
        self._block_size = int(vllm_config.cache_config.block_size)
        self._chunk_size = config.chunk_size
        self._hasher = ChunkHasher.from_config(config)
        self._do_load = bool(ktc.is_kv_consumer)
        self._do_save = bool(ktc.is_kv_producer)
        self._stale_after_s = config.claim_ttl_s * _STALE_ANSWER_FRACTION
        world_size = _world_size(vllm_config)
        workers, response = endpoint_names(str(ktc.engine_id), world_size)
        self._client = LookupClient(config, workers, response)
        self._loras = LoraIdentities()
        #: KV events (vLLM's ``--kv-events-config`` and ``kv_events``): the ranks' streams
        #: merged into one, published by vLLM's scheduler through :meth:`take_events`.
        self._events: RankEventMerger | None = (
            RankEventMerger(world_size) if kv_events_wanted(vllm_config, config) else None
        )
        self._reqs: dict[str, _RequestState] = {}
        self._pending_loads: dict[str, LoadSpec] = {}
        self._kv_cache_manager: Any = None
        self.counters = _Counters()

    @property
    def client(self) -> Any:
        return self._client

    def bind_kv_cache_manager(self, manager: Any) -> None:
        self._kv_cache_manager = manager

    # -- lookups ----------------------------------------------------------------------
    def on_new_request(self, request: Any) -> None:
        lookup_ok, save_ok = self._eligibility(request)
        salt = request_salt(request, self._loras) if (lookup_ok or save_ok) else None
        st = _RequestState(request, lookup_ok, save_ok, salt)
        self._reqs[request.request_id] = st
        if lookup_ok:
            self._start_lookup(st, self._local_hit(request))

    def _eligibility(self, request: Any) -> tuple[bool, bool]:
        # cache_salt and LoRA requests are keyed in their own name space (their salt);
        # multimodal and prompt-embedding requests depend on more than the token ids.
        keyable = (
            getattr(request, "prompt_token_ids", None) is not None
            and not getattr(request, "mm_features", None)
            and getattr(request, "prompt_embeds", None) is None
        )
        lookup_ok = (
            self._do_load and keyable and not getattr(request, "skip_reading_prefix_cache", False)
        )
        return lookup_ok, self._do_save and keyable

    def _local_hit(self, request: Any) -> int:
        """vLLM's own prefix-cache hit now (side-effect free; 0 if unknown)."""
        manager = self._kv_cache_manager
        if manager is None:
            return 0
        try:
            return int(manager.get_computed_blocks(request)[1])
        except (AttributeError, TypeError, ValueError, IndexError):
            return 0

    def _start_lookup(self, st: _RequestState, local_tokens: int) -> None:
        """Start a fresh lookup of ``st``'s tokens, skipping the chunks vLLM holds."""
        req = st.request
        req_id = req.request_id
        cs = self._chunk_size
        tokens = req.all_token_ids
        n_chunks = self._hasher.num_chunks(len(tokens))
        skip = min(local_tokens // cs, n_chunks) * cs
        st.consumed = False
        st.held = False
        st.skip_tokens = skip
        st.started_at = _now()
        if st.live:
            self._client.forget(req_id)
            st.live = False
        if n_chunks == 0 or skip >= n_chunks * cs:
            # Nothing to look up past what vLLM holds: answer at once, no round trip.
            st.result = skip
            return
        st.result = None
        st.live = True
        self.counters.add("lookups")
        # Hash here, once: the same hashes check the claimed chunks and name the saved ones,
        # and with hashes given the client sends at once instead of hashing on its thread.
        n_tokens = len(tokens)
        hashes = self._chunk_hashes(st, n_tokens)
        answer = self._client.lookup(
            req_id,
            tokens,
            skip_tokens=skip,
            hashes=hashes,
            offsets=self._hasher.offsets(n_tokens),
        )
        if answer is not None:
            self._record_answer(st, answer)

    def _record_answer(self, st: _RequestState, answer: int) -> None:
        st.result = answer
        st.held = answer > st.skip_tokens

    def _poll(self, st: _RequestState) -> int | None:
        if st.result is None and st.live:
            answer = self._client.lookup(st.request.request_id, st.request.all_token_ids)
            if answer is not None:
                self._record_answer(st, answer)
        return st.result

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        st = self._reqs.get(request.request_id)
        if st is None:  # not seen by on_new_request (should not happen): treat it as new
            self.on_new_request(request)
            st = self._reqs[request.request_id]
        if not st.lookup_ok:
            return 0, False
        st.last_num_computed = num_computed_tokens
        if st.consumed:
            # Back in the waiting queue after its answer was used: preempted (or a failed
            # load reset it).  The old answer is gone: forget it and look up afresh.
            self.counters.add("lookup_restarts")
            self._client.forget(request.request_id)
            st.live = False
            self._start_lookup(st, num_computed_tokens)
        hit = self._poll(st)
        if hit is None:
            return None, False
        if num_computed_tokens < st.skip_tokens or (
            st.held and _now() - st.started_at > self._stale_after_s
        ):
            # vLLM's hit shrank below the skipped chunks (the answer has a gap), or the
            # prefetch may expire before the step claims it: look up again.
            self.counters.add("lookup_restarts")
            if st.held:
                self._client.cancel(request.request_id)
                st.live = False
            self._start_lookup(st, num_computed_tokens)
            hit = self._poll(st)
            if hit is None:
                return None, False
        # Keep at least one token to compute (vLLM needs its logits).
        external = min(hit - num_computed_tokens, request.num_tokens - 1 - num_computed_tokens)
        return max(external, 0), False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        st = self._reqs.get(request.request_id)
        if st is None or not st.lookup_ok or st.consumed:
            return
        st.consumed = True
        req_id = request.request_id
        hit = st.result or 0
        if st.save_ok:
            st.saved_tokens = max(st.saved_tokens, hit // self._chunk_size * self._chunk_size)
        if num_external_tokens > 0:
            start = st.last_num_computed
            end = start + num_external_tokens
            if end > hit:  # vLLM never raises the count; be safe if it ever does
                log.warning("request %s: vLLM asked for %d tokens, %d are cached", req_id, end, hit)
                end = hit
            cs = self._chunk_size
            first_chunk = st.skip_tokens // cs
            last_chunk = -(-end // cs)
            hashes = self._chunk_hashes(st, min(last_chunk * cs, request.num_tokens))
            block_ids = list(blocks.get_block_ids()[0])
            self._pending_loads[req_id] = LoadSpec(
                req_id=req_id,
                lookup_id=req_id,
                first_chunk=first_chunk,
                start_token=start,
                end_token=end,
                chunk_hashes=hashes[first_chunk:last_chunk],
                block_ids=block_ids[: -(-end // self._block_size)],
                # Names for chunks the workers hold unannounced (from before a restart).
                blocks=self._blocks_of(request, first_chunk, len(hashes[first_chunk:last_chunk])),
            )
            # The workers keep the prefetch for the step's claim.
            self._client.forget(req_id)
            self.counters.add("lookup_hits")
            self.counters.add("hit_tokens", end - start)
        elif st.held:
            # Answered with a prefetch that will not be used: release it on every worker.
            self._client.cancel(req_id)
        elif st.live:
            self._client.forget(req_id)
        st.live = False
        st.held = False

    def _chunk_hashes(self, st: _RequestState, num_tokens: int) -> list[int]:
        """Hashes of the chunks of the request's first ``num_tokens`` tokens (cached: a
        request's tokens only grow, and a whole chunk's hash never changes; a trailing partial
        chunk's hash is reused only for the same token count)."""
        want = self._hasher.num_chunks(num_tokens)
        whole = num_tokens // self._chunk_size
        if num_tokens == st.hashed_tokens or (
            want == whole and whole <= st.hashed_tokens // self._chunk_size
        ):
            return st.hashes[:want]
        st.hashes = self._hasher.hash(list(st.request.all_token_ids[:num_tokens]), st.salt)
        st.hashed_tokens = num_tokens
        return st.hashes

    # -- per step -----------------------------------------------------------------------
    def build_connector_meta(self, scheduler_output: Any) -> LMPrefetchConnectorMetadata:
        meta = LMPrefetchConnectorMetadata(loads=list(self._pending_loads.values()))
        self._pending_loads.clear()
        if self._do_save:
            for req_id, n_scheduled in scheduler_output.num_scheduled_tokens.items():
                st = self._reqs.get(req_id)
                if st is not None and st.save_ok:
                    spec = self._plan_save(st, int(n_scheduled))
                    if spec is not None:
                        meta.saves.append(spec)
        return meta

    def _plan_save(self, st: _RequestState, n_scheduled: int) -> SaveSpec | None:
        """The prompt chunks whose KV this step completes (``request.num_computed_tokens`` is
        still the pre-step count here)."""
        req = st.request
        cs, bs = self._chunk_size, self._block_size
        prompt = int(req.num_prompt_tokens)
        done = min(int(req.num_computed_tokens) + n_scheduled, prompt)
        end = done if (done == prompt and self._config.save_partial_chunks) else done // cs * cs
        if end <= st.saved_tokens or self._kv_cache_manager is None:
            return None
        first_chunk = st.saved_tokens // cs
        hashes = self._chunk_hashes(st, end)
        if len(hashes) * cs < end and not self._config.save_partial_chunks:
            return None
        block_ids = list(self._kv_cache_manager.get_block_ids(req.request_id)[0])
        rows = []
        for c in range(first_chunk, len(hashes)):
            rows.append(-(-(min((c + 1) * cs, end) - c * cs) // bs))
        first_block = first_chunk * (cs // bs)
        ids = block_ids[first_block : first_block + sum(rows)]
        if len(ids) < sum(rows):
            log.warning(
                "request %s: %d blocks for %d rows; not saved", req.request_id, len(ids), sum(rows)
            )
            return None
        st.saved_tokens = end
        self.counters.add("save_chunks_planned", len(rows))
        return SaveSpec(
            req.request_id,
            first_chunk,
            hashes[first_chunk:],
            rows,
            ids,
            blocks=self._blocks_of(req, first_chunk, len(rows)),
        )

    def _blocks_of(self, request: Any, first_chunk: int, n_chunks: int) -> list[ChunkBlocks] | None:
        """vLLM's names of chunks ``first_chunk …`` for KV events (``None`` when events are
        off): the workers announce the chunks under them."""
        if self._events is None:
            return None
        cs, bs = self._chunk_size, self._block_size
        return [
            chunk_blocks(request, c, cs, bs) for c in range(first_chunk, first_chunk + n_chunks)
        ]

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        st = self._reqs.pop(req_id, None)
        planned = self._pending_loads.pop(req_id, None)
        if st is not None and (st.live or st.held):
            # A pending lookup, or a prefetch the request will never claim (it never ran:
            # block_ids is empty): release it on every worker now.
            self._client.cancel(req_id)
        elif planned is not None:
            self._client.cancel(req_id)
        # Saves complete inside the step (wait_for_save): no block outlives the request.
        return False, None

    # -- KV events ---------------------------------------------------------------------
    def update_connector_output(self, connector_output: Any) -> None:
        """Take the workers' KV events of the step (each tagged with its rank)."""
        events = getattr(connector_output, "kv_cache_events", None)
        if self._events is None or not isinstance(events, LMPrefetchKVEvents):
            return
        for rank, event in events.get_all_events():
            self._events.add(rank, event)

    def take_events(self) -> list[KVEvent]:
        """Events every rank agrees on since the last call (see
        :class:`~lmprefetch.events.RankEventMerger`)."""
        if self._events is None:
            return []
        events = self._events.take()
        if events:
            self.counters.add("kv_events", len(events))
        return events

    def stats(self) -> LMPrefetchConnectorStats | None:
        return self.counters.take()

    def shutdown(self) -> None:
        self._client.close()
