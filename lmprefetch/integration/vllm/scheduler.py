"""The scheduler side of the connector: one :class:`~.request.ConnectorRequest` per request,
built when vLLM hands the request over and asked every question vLLM asks about it; the
step's metadata gathered from them; the workers' KV events merged.

What a request does, phase by phase, reads in :mod:`.request`; this module holds what the
requests share (the lookup client, the model's groups, the counters) and what is per step.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

from ...config import PrefetchConfig
from ...config_checks import LOAD_POLICIES
from ...events import KVEvent, RankEventMerger
from ...hashing import ChunkHasher
from .config import _world_size, endpoint_names, kv_events_wanted
from .groups import KVGroups
from .known import KnownChunks
from .metadata import LMPrefetchConnectorMetadata, LMPrefetchKVEvents, LoadSpec
from .request import ConnectorRequest, RequestContext
from .stats import ConnectorStatistics, LMPrefetchConnectorStats
from .tenancy import LoraIdentities, request_salt

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from ...client import LookupClient

log = logging.getLogger("lmprefetch.integration.vllm")

#: ``kv_transfer_params`` keys a request (or a router) sets to cap or skip its load.
MAX_LOAD_TOKENS = "max_load_tokens"
SKIP_LOAD = "skip_load"
LOAD_POLICY = "load_policy"
SKIP_SAVE = "skip_save"


def _params(request: Request) -> dict[str, object]:
    """The request's ``kv_transfer_params`` (empty when it has none)."""
    params = getattr(request, "kv_transfer_params", None)
    return params if isinstance(params, dict) else {}


def _flag(request: Request, params: dict[str, object], key: str) -> bool:
    """A bool key of ``params`` (absent: false); another value is ignored, with a warning."""
    value = params.get(key, False)
    if type(value) is not bool:
        log.warning("request %s: %s must be true or false, got %r; ignoring it",
                    request.request_id, key, value)  # fmt: skip
        return False
    return value


def load_limits(request: Request) -> tuple[bool, int | None]:
    """A request's own load limits from its ``kv_transfer_params``: ``skip_load`` (``true``:
    load nothing) and ``max_load_tokens`` (vLLM's key: an int >= 0 caps the tokens loaded
    beyond what vLLM computed or holds itself; 0 loads nothing).  A value of the wrong type
    is ignored, with a warning."""
    params = _params(request)
    skip = _flag(request, params, SKIP_LOAD)
    raw = params.get(MAX_LOAD_TOKENS)
    if raw is None:
        return skip, None
    if type(raw) is not int or raw < 0:
        log.warning("request %s: %s must be an int >= 0, got %r; ignoring it",
                    request.request_id, MAX_LOAD_TOKENS, raw)  # fmt: skip
        return skip, None
    return skip, raw


def skips_save(request: Request) -> bool:
    """Whether a request's ``kv_transfer_params`` say ``skip_save``: ``true``, none of its
    chunks are saved (a prompt not worth keeping, or one its sender wants kept nowhere).  A
    value that is not a bool is ignored, with a warning."""
    return _flag(request, _params(request), SKIP_SAVE)


def request_load_policy(request: Request) -> str:
    """A request's own load policy from its ``kv_transfer_params`` (``load_policy``: a
    built-in policy's name, ``"always"``, ``"never"`` or ``"cost"``), or ``""``: the
    configured one.  Anything else is ignored, with a warning (a request never makes a worker
    import code)."""
    name = _params(request).get(LOAD_POLICY)
    if name is None:
        return ""
    if name not in LOAD_POLICIES:
        log.warning("request %s: %s must be one of %s, got %r; ignoring it",
                    request.request_id, LOAD_POLICY, LOAD_POLICIES, name)  # fmt: skip
        return ""
    return str(name)


class _SchedulerSide:
    def __init__(
        self,
        vllm_config: VllmConfig,
        kv_cache_config: KVCacheConfig,
        config: PrefetchConfig,
        groups: KVGroups,
    ) -> None:
        from ...client import LookupClient

        ktc = vllm_config.kv_transfer_config
        cache_config = vllm_config.cache_config
        self._groups = groups
        # A model with a KV cache group lmprefetch cannot restore is neither looked up nor
        # saved (the connector logged why when it was built).
        active = groups.unsupported is None
        # load_policy "never": recompute everything, look nothing up (workers hold nothing).
        self._do_load = bool(ktc.is_kv_consumer) and active and config.load_policy != "never"
        self._do_save = bool(ktc.is_kv_producer) and active
        world_size = _world_size(vllm_config)
        workers, response = endpoint_names(str(ktc.engine_id), world_size)
        self._client = LookupClient(config, workers, response)
        self._loras = LoraIdentities()
        #: KV events (vLLM's ``--kv-events-config`` and ``kv_events``): the ranks' streams
        #: merged into one, published by vLLM's scheduler through :meth:`take_events`.
        self._events: RankEventMerger | None = (
            RankEventMerger(world_size) if kv_events_wanted(vllm_config, config) else None
        )
        # KV events name chunks by vLLM's block hashes, of this many tokens.
        hash_block_size = int(
            getattr(kv_cache_config, "hash_block_size", None)
            or getattr(cache_config, "hash_block_size", None)
            or cache_config.block_size
        )
        self._statistics = ConnectorStatistics()
        self._reported = ConnectorStatistics()
        self._ctx = RequestContext(
            client=self._client,
            groups=groups,
            hasher=ChunkHasher.from_config(config),
            statistics=self._statistics,
            known=KnownChunks(),
            claim_ttl_s=config.claim_ttl_s,
            hash_block_size=None if self._events is None else hash_block_size,
        )
        self._requests: dict[str, ConnectorRequest] = {}
        #: Loads planned since the last step's metadata, by request id.
        self._pending_loads: dict[str, LoadSpec] = {}
        self._kv_cache_manager: KVCacheManager | None = None

    @property
    def client(self) -> LookupClient:
        return self._client

    @property
    def groups(self) -> KVGroups:
        return self._groups

    def request(self, req_id: str) -> ConnectorRequest | None:
        """The connector's record of a request vLLM has not finished, if any."""
        return self._requests.get(req_id)

    def bind_kv_cache_manager(self, manager: KVCacheManager) -> None:
        self._kv_cache_manager = manager

    # -- a request's arrival --------------------------------------------------------------
    def on_new_request(self, request: Request) -> ConnectorRequest:
        """Build the request's record and start its lookups at once (before vLLM can
        schedule it), skipping vLLM's own prefix-cache hit at this moment."""
        load_ok, save_ok = self._eligibility(request)
        if save_ok and skips_save(request):
            save_ok = False
            self._statistics.save_skipped += 1
        salt = request_salt(request, self._loras) if (load_ok or save_ok) else None
        max_load_tokens = None
        load_policy = ""
        if load_ok:
            skip, cap = load_limits(request)
            load_policy = request_load_policy(request)
            if load_policy == "never":  # (as the workers would answer: without a probe)
                skip = True
            if skip or cap == 0:
                # The request (or its router) wants no load: nothing is looked up or held.
                load_ok = False
                self._statistics.load_skipped += 1
            elif cap is not None:
                bs = self._groups.block_size
                max_load_tokens = cap // bs * bs  # vLLM's KV boundary
                self._statistics.load_capped += 1
        r = ConnectorRequest(
            request,
            self._ctx,
            load_ok=load_ok,
            save_ok=save_ok,
            salt=salt,
            max_load_tokens=max_load_tokens,
            load_policy=load_policy,
        )
        self._requests[request.request_id] = r
        if load_ok:
            r.start(self._local_hit(request))
        return r

    def _eligibility(self, request: Request) -> tuple[bool, bool]:
        """Whether the request is looked up, and whether it is saved.  cache_salt and LoRA
        requests are keyed in their own name space (their salt); multimodal and
        prompt-embedding requests depend on more than the token ids: neither."""
        keyable = (
            getattr(request, "prompt_token_ids", None) is not None
            and not getattr(request, "mm_features", None)
            and getattr(request, "prompt_embeds", None) is None
        )
        lookup_ok = (
            self._do_load and keyable and not getattr(request, "skip_reading_prefix_cache", False)
        )
        return lookup_ok, self._do_save and keyable

    def _local_hit(self, request: Request) -> int:
        """vLLM's own prefix-cache hit now (side-effect free; 0 if unknown)."""
        manager = self._kv_cache_manager
        if manager is None:
            return 0
        try:
            return int(manager.get_computed_blocks(request)[1])
        except (AttributeError, TypeError, ValueError, IndexError):
            return 0

    def _of(self, request: Request) -> ConnectorRequest:
        r = self._requests.get(request.request_id)
        if r is None:  # not seen by on_new_request (should not happen): treat it as new
            r = self.on_new_request(request)
        return r

    # -- vLLM's questions about a request ---------------------------------------------------
    def may_load_async(self, request: Request) -> bool:
        r = self._requests.get(request.request_id)
        return r is not None and r.may_load_async()

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._of(request).matched(num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        r = self._requests.get(request.request_id)
        spec = r.plan_load(blocks, num_external_tokens) if r is not None else None
        if spec is not None:
            self._pending_loads[request.request_id] = spec

    def hit_sources(self, request: Request, num_external_tokens: int) -> dict[str, int]:
        """The tokens of the load just planned for ``request`` by the tier that served them
        (see :meth:`~.request.ConnectorRequest.hit_sources`)."""
        r = self._requests.get(request.request_id)
        return r.hit_sources(num_external_tokens) if r is not None else {"": num_external_tokens}

    def request_finished(self, request: Request) -> None:
        """Release whatever is still outstanding for the request: pending lookups, a held
        prefetch it never claimed.  A load planned for it is already in a step's metadata
        (loads are planned and sent within one ``schedule()``, and vLLM finishes requests
        between its calls); the step that runs an asynchronous one reports it in
        ``finished_recving``, which frees the blocks vLLM holds for it."""
        r = self._requests.pop(request.request_id, None)
        if r is not None:
            r.release()

    # -- per step -----------------------------------------------------------------------
    def build_connector_meta(self, so: SchedulerOutput) -> LMPrefetchConnectorMetadata:
        """The step's loads (planned at allocation) and saves (planned now), and its work for
        the workers' prefill model."""
        meta = LMPrefetchConnectorMetadata(loads=list(self._pending_loads.values()))
        self._pending_loads.clear()
        scheduled = {req_id: int(n) for req_id, n in so.num_scheduled_tokens.items()}
        # The prefill model (the ``cost`` load policy): the step's tokens and attention work;
        # ``request.num_computed_tokens`` is still the pre-step count here.
        for req_id, n in scheduled.items():
            r = self._requests.get(req_id)
            c = int(r.request.num_computed_tokens) if r is not None else 0
            meta.scheduled_tokens += n
            meta.scheduled_attention += (c + n) * (c + n) - c * c
        manager = self._kv_cache_manager
        if not self._do_save or manager is None:
            return meta
        # Mamba states vLLM hands over this step (hybrid models), by request.
        block_state = getattr(so, "kv_connector_block_state", None)
        offers: dict[str, list[tuple[int, int, int]]] = dict(
            getattr(block_state, "boundary_state_offloads", None) or {}
        )
        for req_id in [*scheduled, *(r for r in offers if r not in scheduled)]:
            r = self._requests.get(req_id)
            if r is not None and r.save_ok:
                spec = r.plan_save(scheduled.get(req_id, 0), offers.get(req_id, ()), manager)
                if spec is not None:
                    meta.saves.append(spec)
        return meta

    # -- KV events ---------------------------------------------------------------------
    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
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
        self._statistics.kv_events += len(events)
        return events

    # -- statistics ----------------------------------------------------------------------
    def statistics(self) -> ConnectorStatistics:
        """The scheduler side's counters since start (a snapshot)."""
        return dataclasses.replace(self._statistics)

    def take_stats(self) -> LMPrefetchConnectorStats | None:
        """What grew since the last call (``get_kv_connector_stats``)."""
        now = self.statistics()
        grown, self._reported = LMPrefetchConnectorStats.between(self._reported, now), now
        return grown

    def shutdown(self) -> None:
        self._client.close()
