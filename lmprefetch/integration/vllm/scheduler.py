"""The scheduler side of the connector: lookups started on arrival, polled without blocking,
loads and saves planned per step.

Two kinds of model (:mod:`.groups`): a *legacy* one (one full-attention KV cache group) is
looked up with one prefix lookup and loaded synchronously, a failed load reported by block; a
*hybrid* one (sliding-window or Mamba groups, or several groups) is looked up by
:class:`~.hits.HybridLookup` and loaded asynchronously, a failed load reported by request
(vLLM cannot map a block id back to a request when block ids are per group).  Where the hit of
a request is decided: :meth:`_SchedulerSide._hit`.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from ...codec import tenant_id
from ...config import PrefetchConfig
from ...events import ChunkBlocks, KVEvent, RankEventMerger
from ...hashing import ChunkHasher
from .config import _world_size, endpoint_names, kv_events_wanted
from .groups import KVGroups, read_groups
from .hits import HybridLookup
from .known import KnownChunks
from .metadata import (
    HybridLoadSpec,
    HybridSaveSpec,
    LMPrefetchConnectorMetadata,
    LMPrefetchConnectorStats,
    LMPrefetchKVEvents,
    LoadSpec,
    SaveSpec,
    _Counters,
)
from .plans import plan_hybrid_load, plan_hybrid_saves
from .tenancy import LoraIdentities, chunk_blocks, request_salt

if TYPE_CHECKING:
    from ...client import LookupClient

log = logging.getLogger("lmprefetch.integration.vllm")

#: A held answer whose lookup started longer ago than this fraction of ``claim_ttl_s`` is
#: looked up again rather than used: the workers may release it before the step claims it.
_STALE_ANSWER_FRACTION = 0.5
#: The scheduler side's clock (a module attribute so tests can move it).
_now = time.monotonic

#: ``kv_transfer_params`` keys a request (or a router) sets to cap or skip its load.
MAX_LOAD_TOKENS = "max_load_tokens"
SKIP_LOAD = "skip_load"


def load_limits(request: Any) -> tuple[bool, int | None]:
    """A request's own load limits from its ``kv_transfer_params``: ``skip_load`` (``true``:
    load nothing) and ``max_load_tokens`` (vLLM's key: an int >= 0 caps the tokens loaded
    beyond what vLLM computed or holds itself; 0 loads nothing).  A value of the wrong type
    is ignored, with a warning."""
    params = getattr(request, "kv_transfer_params", None)
    if not isinstance(params, dict):
        return False, None
    skip = params.get(SKIP_LOAD, False)
    if type(skip) is not bool:
        log.warning("request %s: %s must be true or false, got %r; ignoring it",
                    getattr(request, "request_id", "?"), SKIP_LOAD, skip)  # fmt: skip
        skip = False
    raw = params.get(MAX_LOAD_TOKENS)
    if raw is None:
        return skip, None
    if type(raw) is not int or raw < 0:
        log.warning("request %s: %s must be an int >= 0, got %r; ignoring it",
                    getattr(request, "request_id", "?"), MAX_LOAD_TOKENS, raw)  # fmt: skip
        return skip, None
    return skip, raw


def split_sources(
    tier_tokens: list[tuple[str, int]], first_token: int, start: int, end: int
) -> dict[str, int]:
    """Tokens ``[start, end)`` by the tier that served them, from a lookup's split
    (``tier_tokens`` covers the tokens from ``first_token`` on, in order).  Tokens the split
    does not cover are left out (the caller counts them as it must)."""
    out: dict[str, int] = {}
    lo = first_token
    for tier, n in tier_tokens:
        hi = lo + n
        got = min(hi, end) - max(lo, start)
        if got > 0:
            out[tier] = out.get(tier, 0) + got
        lo = hi
    return out


# -- scheduler side ---------------------------------------------------------------------------
class _RequestState:
    """What the scheduler side knows about one request (from ``on_new_request`` to
    ``request_finished``)."""

    __slots__ = (
        "consumed",
        "hashed_tokens",
        "hashes",
        "held",
        "hybrid",
        "last_num_computed",
        "live",
        "load_async",
        "loaded_to",
        "lookup_ok",
        "max_load_tokens",
        "request",
        "result",
        "salt",
        "save_ok",
        "saved_tokens",
        "skip_tokens",
        "sources",
        "started_at",
        "tier_tokens",
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
        #: Hybrid models: the current lookups of the request (replaces ``live``/``held``).
        self.hybrid: HybridLookup | None = None
        #: Tokens loaded from lmprefetch (hybrid: Mamba states up to there are not saved again).
        self.loaded_to = 0
        #: The request's cap on loaded tokens (``kv_transfer_params["max_load_tokens"]``,
        #: rounded down to vLLM's blocks), or ``None``.
        self.max_load_tokens: int | None = None
        #: Which tiers served the answer (from ``skip_tokens`` on), and the planned load's
        #: tokens by tier (for ``get_external_cache_hit_sources``).
        self.tier_tokens: list[tuple[str, int]] = []
        self.sources: dict[str, int] = {}
        #: vLLM queued the request for asynchronous loads (``may_load_async`` said True): its
        #: hit is loaded asynchronously, whatever the model.
        self.load_async = False


class _SchedulerSide:
    def __init__(
        self,
        vllm_config: Any,
        kv_cache_config: Any,
        config: PrefetchConfig,
        groups: KVGroups | None = None,
    ) -> None:
        from ...client import LookupClient

        ktc = vllm_config.kv_transfer_config
        cache_config = vllm_config.cache_config
        if groups is None:
            groups = read_groups(kv_cache_config, int(cache_config.block_size))
        self._groups = groups
        self._config = config
        self._block_size = groups.block_size
        #: The block size of vLLM's block hashes (what KV events name blocks by).
        self._hash_block_size = int(
            getattr(kv_cache_config, "hash_block_size", None)
            or getattr(cache_config, "hash_block_size", None)
            or cache_config.block_size
        )
        self._chunk_size = config.chunk_size
        self._hasher = ChunkHasher.from_config(config)
        # A model with a KV cache group lmprefetch cannot restore is neither looked up nor
        # saved (the connector logged why when it was built).
        active = groups.unsupported is None
        # load_policy "never": recompute everything, look nothing up (workers hold nothing).
        self._do_load = bool(ktc.is_kv_consumer) and active and config.load_policy != "never"
        self._do_save = bool(ktc.is_kv_producer) and active
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
        self._pending_hybrid_loads: dict[str, HybridLoadSpec] = {}
        self._kv_cache_manager: Any = None
        #: Chunks the workers were last known to hold (``may_load_async``'s answer).
        self._known = KnownChunks()
        self.counters = _Counters()

    @property
    def client(self) -> LookupClient:
        return self._client

    @property
    def groups(self) -> KVGroups:
        return self._groups

    def bind_kv_cache_manager(self, manager: Any) -> None:
        self._kv_cache_manager = manager

    # -- lookups ----------------------------------------------------------------------
    def on_new_request(self, request: Any) -> None:
        lookup_ok, save_ok = self._eligibility(request)
        salt = request_salt(request, self._loras) if (lookup_ok or save_ok) else None
        st = _RequestState(request, lookup_ok, save_ok, salt)
        self._reqs[request.request_id] = st
        if lookup_ok:
            skip, cap = load_limits(request)
            if cap is not None:
                cap = cap // self._block_size * self._block_size  # vLLM's KV boundary
                st.max_load_tokens = cap
            if skip or cap == 0:
                # The request (or its router) wants no load: nothing is looked up or held.
                st.lookup_ok = False
                self.counters.add("load_skipped")
                return
            if cap is not None:
                self.counters.add("load_capped")
        if st.lookup_ok:
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
        if self._groups.hybrid:
            self._start_hybrid_lookup(st, local_tokens)
            return
        if st.max_load_tokens is not None:
            # Look up (and load, on the workers) only the chunks under the cap.
            n_chunks = min(n_chunks, -(-(local_tokens + st.max_load_tokens) // cs))
        st.tier_tokens = []
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
            hashes=hashes[:n_chunks],
            offsets=self._hasher.offsets(n_tokens)[:n_chunks],
            salt=st.salt,  # (hashed already: it names the tenant, for encryption)
        )
        if answer is not None:
            self._record_answer(st, answer)

    def _start_hybrid_lookup(self, st: _RequestState, local_tokens: int) -> None:
        """Start the lookups of a request on a hybrid model (see :mod:`.hits`)."""
        req = st.request
        if st.hybrid is not None:
            st.hybrid.cancel()
        n_tokens = len(req.all_token_ids)
        lookup = HybridLookup(
            req.request_id,
            self._client,
            self._groups,
            self._chunk_size,
            self._chunk_hashes(st, n_tokens),
            n_tokens,
            local_tokens,
            on_lookup=lambda: self.counters.add("group_lookups"),
            max_tokens=st.max_load_tokens,
            salt=st.salt,
        )
        self.counters.add("lookups")
        st.hybrid = lookup
        lookup.start()
        st.result = lookup.result
        st.held = lookup.held

    def _record_answer(self, st: _RequestState, answer: int) -> None:
        st.result = answer
        st.held = answer > st.skip_tokens
        if st.held:
            st.tier_tokens = self._client.tier_tokens(st.request.request_id)
        self._note_answer(st, answer)

    def _note_answer(self, st: _RequestState, answer: int) -> None:
        """Remember which of the looked-up chunks every rank holds (``may_load_async``)."""
        cs = self._chunk_size
        first, found = st.skip_tokens // cs, answer // cs
        self._known.held(st.hashes[first:found])
        if st.max_load_tokens is None:  # (a capped lookup probed only the chunks under its cap)
            self._known.gone(st.hashes[max(found, first) :])

    # -- loads while the running batch is full (vLLM 0.34) ------------------------------
    def may_load_async(self, request: Any) -> bool:
        """True when lmprefetch has a hit for ``request`` that it will load: its lookup
        answered one, or (still pending: vLLM asks right after :meth:`on_new_request`) the
        first chunk past vLLM's own hit is one the workers were last known to hold
        (:mod:`.known`).  vLLM then queues the request for asynchronous loads, which start
        while the running batch is full, and its hit is loaded asynchronously.  A dict read:
        no I/O, no lock."""
        st = self._reqs.get(request.request_id)
        if st is None or not st.lookup_ok or st.consumed:
            return False
        if st.result is not None:
            likely = st.held
        else:
            first = st.skip_tokens // self._chunk_size
            likely = first < len(st.hashes) and st.hashes[first] in self._known
        st.load_async = likely
        return likely

    def _poll(self, st: _RequestState) -> int | None:
        if st.hybrid is not None:
            if st.result is None:
                st.result = st.hybrid.poll()
                st.held = st.hybrid.held
                if st.result is not None:
                    self._note_answer(st, st.result)
            return st.result
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
            st.load_async = False  # vLLM put it back in its ordinary waiting queue
            self._start_lookup(st, num_computed_tokens)
        hit = self._hit(st, num_computed_tokens)
        if hit is None:
            return None, False
        # Keep at least one token to compute (vLLM needs its logits).
        external = max(
            min(hit - num_computed_tokens, request.num_tokens - 1 - num_computed_tokens), 0
        )
        if st.max_load_tokens is not None and external > st.max_load_tokens:
            external = st.max_load_tokens  # hybrid lookups are capped at a chunk boundary
            self.counters.add("load_cap_cut")
        # Hybrid loads are asynchronous: only then can a failed one be reported by request.
        # So is any load vLLM queued as one (may_load_async): it starts while the batch is full.
        return external, (self._groups.hybrid or st.load_async) and external > 0

    def _hit(self, st: _RequestState, num_computed_tokens: int) -> int | None:
        """The request's hit in tokens from token 0 (``None`` while pending): the one place
        the connector decides how much it serves.

        A legacy model's hit is its prefix lookup's answer; a hybrid model's is what its
        groups converge to (:class:`~.hits.HybridLookup`, a chunk boundary below the last
        token).  A hit is looked up again when vLLM's own hit has shrunk below the chunks the
        lookup skipped (the answer has a gap) or when the answer is too old to trust (the
        workers may release it before the step claims it)."""
        hit = self._poll(st)
        if hit is None:
            return None
        if num_computed_tokens < st.skip_tokens or (
            st.held and _now() - st.started_at > self._stale_after_s
        ):
            self.counters.add("lookup_restarts")
            if st.hybrid is not None:
                st.hybrid.cancel()
            elif st.held:
                self._client.cancel(st.request.request_id)
                st.live = False
            self._start_lookup(st, num_computed_tokens)
            hit = self._poll(st)
        return hit

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        st = self._reqs.get(request.request_id)
        if st is None or not st.lookup_ok or st.consumed:
            return
        st.consumed = True
        req_id = request.request_id
        hit = st.result or 0
        if st.save_ok:
            st.saved_tokens = max(st.saved_tokens, hit // self._chunk_size * self._chunk_size)
        if st.hybrid is not None:
            self._plan_hybrid_load(st, blocks, num_external_tokens)
            return
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
                asynchronous=st.load_async,
            )
            st.sources = split_sources(st.tier_tokens, st.skip_tokens, start, end)
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

    def _plan_hybrid_load(self, st: _RequestState, blocks: Any, num_external_tokens: int) -> None:
        """Plan a hybrid request's load (or release its lookups when nothing is loaded)."""
        lookup = st.hybrid
        assert lookup is not None
        request = st.request
        req_id = request.request_id
        if num_external_tokens <= 0:
            lookup.cancel()
            st.held = False
            return
        start = st.last_num_computed
        end = start + num_external_tokens
        claims = None
        if end == lookup.result:
            claims = plan_hybrid_load(lookup, self._chunk_size, blocks.get_block_ids(), start, end)
        if claims is None:
            # vLLM's blocks (or token count) do not match the lookups: load nothing and
            # report the request as failed (vLLM recomputes it under "recompute").
            log.warning(
                "request %s: cannot load tokens [%d, %d) into vLLM's blocks as looked up "
                "(hit %s); reporting the load as failed", req_id, start, end, lookup.result,
            )  # fmt: skip
            lookup.cancel()
            claims = []
        else:
            st.sources = lookup.sources(start, end)
            lookup.keep_used()
            st.loaded_to = end
            self.counters.add("lookup_hits")
            self.counters.add("hit_tokens", end - start)
        st.held = False
        described = None
        if claims and self._events is not None and lookup.used:
            described = self._described_chunks(st, lookup, start, end)
        self._pending_hybrid_loads[req_id] = HybridLoadSpec(req_id, start, end, claims, described)

    def _described_chunks(
        self, st: _RequestState, lookup: HybridLookup, start: int, end: int
    ) -> list[tuple[int, ChunkBlocks]] | None:
        """Names of the announced full-attention chunks a hybrid load brings (KV events)."""
        from .groups import group_hash

        full = self._groups.of_kind("full")
        if not full:
            return None
        cs = self._chunk_size
        first, last = start // cs, end // cs
        hashes = self._chunk_hashes(st, last * cs)
        return [
            (group_hash(full[0].identity, hashes[c]), self._chunk_blocks(st.request, c))
            for c in range(first, last)
        ]

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
        meta = LMPrefetchConnectorMetadata(
            loads=list(self._pending_loads.values()),
            hybrid_loads=list(self._pending_hybrid_loads.values()),
        )
        self._note_step_work(scheduler_output, meta)
        self._pending_loads.clear()
        self._pending_hybrid_loads.clear()
        if not self._do_save:
            return meta
        if self._groups.hybrid:
            self._plan_hybrid_saves(scheduler_output, meta)
            return meta
        for req_id, n_scheduled in scheduler_output.num_scheduled_tokens.items():
            st = self._reqs.get(req_id)
            if st is not None and st.save_ok:
                spec = self._plan_save(st, int(n_scheduled))
                if spec is not None:
                    meta.saves.append(spec)
        return meta

    def _note_step_work(self, so: Any, meta: LMPrefetchConnectorMetadata) -> None:
        """The step's tokens and attention work, for the workers' prefill model (the ``cost``
        load policy): ``request.num_computed_tokens`` is still the pre-step count here."""
        tokens = attention = 0
        for req_id, n_scheduled in so.num_scheduled_tokens.items():
            n = int(n_scheduled)
            st = self._reqs.get(req_id)
            c = int(st.request.num_computed_tokens) if st is not None else 0
            tokens += n
            attention += (c + n) * (c + n) - c * c
        meta.scheduled_tokens = tokens
        meta.scheduled_attention = attention

    def _plan_hybrid_saves(self, so: Any, meta: LMPrefetchConnectorMetadata) -> None:
        """Hybrid saves of the step: the prompt chunks the step completes in every attention
        group, and the Mamba states vLLM hands over (``kv_connector_block_state``)."""
        block_state = getattr(so, "kv_connector_block_state", None)
        offers: dict[str, list[tuple[int, int, int]]] = dict(
            getattr(block_state, "boundary_state_offloads", None) or {}
        )
        scheduled: dict[str, int] = {k: int(v) for k, v in so.num_scheduled_tokens.items()}
        for req_id in [*scheduled, *(r for r in offers if r not in scheduled)]:
            st = self._reqs.get(req_id)
            if st is None or not st.save_ok or self._kv_cache_manager is None:
                continue
            spec = self._plan_hybrid_save(st, scheduled.get(req_id, 0), offers.get(req_id, ()))
            if spec is not None:
                meta.hybrid_saves.append(spec)

    def _plan_hybrid_save(
        self, st: _RequestState, n_scheduled: int, offers: Any
    ) -> HybridSaveSpec | None:
        req = st.request
        cs = self._chunk_size
        prompt = int(req.num_prompt_tokens)
        done = min(int(req.num_computed_tokens) + n_scheduled, prompt)
        end = max(done // cs * cs, st.saved_tokens)
        if end <= st.saved_tokens and not offers:
            return None
        prompt_chunks = prompt // cs
        hashes = self._chunk_hashes(st, prompt_chunks * cs)
        block_ids = self._kv_cache_manager.get_block_ids(req.request_id)
        items = plan_hybrid_saves(
            self._groups,
            cs,
            hashes,
            block_ids,
            st.saved_tokens // cs,
            end // cs,
            list(offers),
            min_state_boundary=st.loaded_to,
        )
        self._known.held(hashes[st.saved_tokens // cs : end // cs])
        st.saved_tokens = end
        if not items:
            return None
        self.counters.add("save_chunks_planned", len(items))
        blocks = None
        if self._events is not None:
            blocks = [self._chunk_blocks(req, it.chunk) if it.announce else None for it in items]
        return HybridSaveSpec(
            req.request_id,
            [it.chunk_hash for it in items],
            [it.group for it in items],
            [it.block_ids for it in items],
            blocks,
            tenant=tenant_id(st.salt),
        )

    def _chunk_blocks(self, request: Any, chunk: int) -> ChunkBlocks:
        return chunk_blocks(request, chunk, self._chunk_size, self._hash_block_size)

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
        self._known.held(hashes[first_chunk:])
        self.counters.add("save_chunks_planned", len(rows))
        return SaveSpec(
            req.request_id,
            first_chunk,
            hashes[first_chunk:],
            rows,
            ids,
            blocks=self._blocks_of(req, first_chunk, len(rows)),
            tenant=tenant_id(st.salt),
        )

    def _blocks_of(self, request: Any, first_chunk: int, n_chunks: int) -> list[ChunkBlocks] | None:
        """vLLM's names of chunks ``first_chunk …`` for KV events (``None`` when events are
        off): the workers announce the chunks under them."""
        if self._events is None:
            return None
        return [self._chunk_blocks(request, c) for c in range(first_chunk, first_chunk + n_chunks)]

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        st = self._reqs.pop(req_id, None)
        planned = self._pending_loads.get(req_id)
        if planned is not None and not planned.asynchronous:
            del self._pending_loads[req_id]
        else:
            planned = None
        # A planned asynchronous load (hybrid, or queued by may_load_async) stays planned:
        # vLLM holds the request's blocks until a worker reports it in finished_recving,
        # which only the load's step does.
        if st is not None and st.hybrid is not None:
            st.hybrid.cancel()
        elif st is not None and (st.live or st.held):
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

    def hit_sources(self, request: Any, num_external_tokens: int) -> dict[str, int]:
        """The tokens of the load just planned for ``request``, by the tier that served them
        (tier names; what the split does not cover is under ``""``).  They sum to
        ``num_external_tokens``."""
        st = self._reqs.get(request.request_id)
        sources = dict(st.sources) if st is not None else {}
        known = sum(sources.values())
        if known > num_external_tokens:  # never expected: trust the count vLLM has
            return {"": num_external_tokens}
        if known < num_external_tokens:
            sources[""] = num_external_tokens - known
        return {k: v for k, v in sources.items() if v > 0}

    def stats(self) -> LMPrefetchConnectorStats | None:
        return self.counters.take()

    def shutdown(self) -> None:
        self._client.close()
