"""The connector class vLLM instantiates: it builds the scheduler side (:mod:`.scheduler`, one
:class:`~.request.ConnectorRequest` per request) or the worker side (:mod:`.worker`) and
delegates every call to it.  How one request travels through them: the package docstring
(:mod:`lmprefetch.integration.vllm`)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import msgspec
import torch
from vllm.distributed import kv_events as vllm_kv_events
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
)

from ...events import KVEvent
from . import compat
from .compat import CacheHitSource, KVConnectorTransferResults, SupportsHMA
from .config import load_prefetch_config
from .groups import read_groups, resolve_chunk_size
from .metadata import LMPrefetchConnectorMetadata, LMPrefetchKVEvents
from .scheduler import _SchedulerSide
from .stats import LMPrefetchConnectorStats, build_prom_metrics
from .worker import _WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorTransferResults as TransferResults,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("lmprefetch.integration.vllm")


def _tier_sources() -> tuple[dict[str, Any], Any]:
    """vLLM's name for where each lmprefetch tier keeps chunks (``get_external_cache_hit_sources``):
    the CPU tier is host memory, the disk tier a disk; Redis, Mooncake and custom tiers are
    remote stores, which vLLM has no name for.  Tokens no split covers count as host memory.
    Empty on a vLLM without ``CacheHitSource`` (it never asks)."""
    if CacheHitSource is None:
        return {}, None
    host = CacheHitSource.HOST
    sources = {"": host, "cpu": host, "disk": getattr(CacheHitSource, "DISK", host)}
    return sources, getattr(CacheHitSource, "EXTERNAL_UNSPECIFIED", host)


_TIER_SOURCES, _REMOTE_SOURCE = _tier_sources()


# -- the connector ------------------------------------------------------------------------------
class LMPrefetchConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
    """lmprefetch as a vLLM v1 KV connector (how a request travels through it:
    :mod:`lmprefetch.integration.vllm`).

    It supports vLLM's hybrid KV cache manager (``SupportsHMA``), so vLLM keeps HMA on with it:
    sliding-window, mixed-head-size and Mamba / GDN hybrid models keep their per-group KV cache
    (see ``docs/vllm.md``, "Hybrid models").
    """

    if CacheHitSource is not None:
        _cache_hit_source = CacheHitSource.HOST

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        compat.require_supported()
        super().__init__(vllm_config, role, kv_cache_config)
        if role == KVConnectorRole.SCHEDULER:
            compat.log_degradations(log)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        config, explicit = load_prefetch_config(extra)
        # The block size comes from the KV cache groups: vLLM has rewritten
        # cache_config.block_size by now (32 on the CPU backend, 640 for Qwen3-Next, and
        # hybrid groups may differ from each other).
        groups = read_groups(kv_cache_config, int(vllm_config.cache_config.block_size))
        config = resolve_chunk_size(config, explicit, groups)
        if groups.unsupported is not None and role == KVConnectorRole.SCHEDULER:
            log.warning(
                "LMPrefetchConnector: lmprefetch cannot restore this model's KV cache (%s); "
                "it neither looks up nor saves.  See docs/vllm.md, Hybrid models",
                groups.unsupported,
            )
        policy = getattr(self._kv_transfer_config, "kv_load_failure_policy", "recompute")
        if role == KVConnectorRole.SCHEDULER and policy != "recompute":
            log.warning(
                "kv_load_failure_policy is %r: a request whose prefetched KV is lost before "
                "its step (e.g. released after claim_ttl_s) ends with an error; set "
                '"kv_load_failure_policy": "recompute" to recompute it instead',
                policy,
            )
        self._scheduler: _SchedulerSide | None = None
        self._worker: _WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = _SchedulerSide(vllm_config, kv_cache_config, config, groups)
        else:
            self._worker = _WorkerSide(vllm_config, kv_cache_config, config, explicit, groups)

    @property
    def requires_kv_delivery(self) -> bool:
        """False: a best-effort cache; a dropped save only costs a later miss."""
        return False

    @classmethod
    def supports_lookahead_block_hashes(cls, kv_transfer_config: object = None) -> bool:
        """False (vLLM 0.34): lmprefetch keys a chunk by its own tokens only, never by the
        tokens after it, so it cannot keep one copy per continuation the way vLLM's lookahead
        block hashes (for EAGLE drafters) need; vLLM then keeps its EAGLE block drop.  See
        docs/vllm.md, "Speculative decoding"."""
        return False

    @property
    def scheduler_side(self) -> _SchedulerSide:
        if self._scheduler is None:
            raise RuntimeError("not the scheduler-side connector")
        return self._scheduler

    @property
    def worker_side(self) -> _WorkerSide:
        if self._worker is None:
            raise RuntimeError("not the worker-side connector")
        return self._worker

    # -- scheduler side ---------------------------------------------------------------------
    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self.scheduler_side.bind_kv_cache_manager(kv_cache_manager)

    def on_new_request(self, request: Request) -> None:
        self.scheduler_side.on_new_request(request)

    def may_load_async(self, request: Request) -> bool:
        """vLLM 0.34 (``--max-num-inflight-kv-loads``): True when lmprefetch has a hit for the
        request that it will load; vLLM then starts the load while the running batch is full
        (see :meth:`.request.ConnectorRequest.may_load_async`)."""
        return self.scheduler_side.may_load_async(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self.scheduler_side.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self.scheduler_side.update_state_after_alloc(request, blocks, num_external_tokens)

    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[Any, int]:
        """The planned load's tokens by the tier that served them (so vLLM's prompt tokens
        by source tell the CPU tier from disk and remote tiers); they sum to
        ``num_external_tokens``.  The keys are ``CacheHitSource`` members (vLLM 0.32 and
        later; an older vLLM never asks), hence ``Any``."""
        if num_external_tokens <= 0 or CacheHitSource is None:
            return {}
        out: dict[Any, int] = {}
        for tier, n in self.scheduler_side.hit_sources(request, num_external_tokens).items():
            source = _TIER_SOURCES.get(tier, _REMOTE_SOURCE)
            out[source] = out.get(source, 0) + n
        return out

    def build_connector_meta(
        self, scheduler_output: SchedulerOutput
    ) -> LMPrefetchConnectorMetadata:
        return self.scheduler_side.build_connector_meta(scheduler_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Cancel whatever is still outstanding for the request (aborted requests release
        worker memory at once).  ``False``: saves complete inside their step (``wait_for_save``),
        so no block outlives the request."""
        self.scheduler_side.request_finished(request)
        return False, None

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """``SupportsHMA``: vLLM calls this instead of :meth:`request_finished` (with one
        block list per KV cache group); the same."""
        self.scheduler_side.request_finished(request)
        return False, None

    # -- worker side ----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker_side.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: LMPrefetchConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:
            self._worker.step_began()  # the step's forward follows: its time is measured

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: object) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, LMPrefetchConnectorMetadata)
        self.worker_side.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete inside start_load_kv, before the forward

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: object,
    ) -> None:
        return  # whole chunks are saved in wait_for_save, after every layer ran

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, LMPrefetchConnectorMetadata)
        self.worker_side.wait_for_save(meta)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker_side.get_block_ids_with_load_errors()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Asynchronous loads this step ran, failed or not (a vLLM that calls this instead of
        :meth:`get_transfer_results` takes no request-level failures)."""
        done, _ = self.worker_side.take_finished_recving()
        return None, done or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> TransferResults:
        """:meth:`get_finished`, and the hybrid loads that failed (``failed_recving``: with
        more than one KV cache group vLLM takes load failures only by request)."""
        done, failed = self.worker_side.take_finished_recving()
        assert KVConnectorTransferResults is not None  # only such a vLLM calls this
        return KVConnectorTransferResults(
            finished_sending=set(), finished_recving=done, failed_recving=failed
        )

    def get_kv_connector_kv_cache_events(self) -> LMPrefetchKVEvents | None:
        """The rank's KV events since the last step (lmprefetch's tiers: stores, evictions)."""
        return self.worker_side.kv_cache_events()

    # -- KV events, scheduler side -----------------------------------------------------------
    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        super().update_connector_output(connector_output)
        self.scheduler_side.update_connector_output(connector_output)

    def take_events(self) -> Iterator[KVCacheEvent]:
        """lmprefetch's KV events for vLLM's publisher (as vLLM's own event classes)."""
        for event in self.scheduler_side.take_events():
            yield _to_vllm_event(event)

    # -- both -------------------------------------------------------------------------------
    def get_kv_connector_stats(self) -> LMPrefetchConnectorStats | None:
        side = self._scheduler if self._scheduler is not None else self._worker
        return side.take_stats() if side is not None else None

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> LMPrefetchConnectorStats:
        return LMPrefetchConnectorStats(data=dict(data) if data else {})

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        """vLLM's Prometheus hook: the connector's counters as ``vllm:lmprefetch_*``
        counters on vLLM's own endpoint (``None`` on a vLLM without the hook's classes)."""
        return build_prom_metrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._scheduler is not None:
            self._scheduler.shutdown()
        if self._worker is not None:
            self._worker.shutdown()


def _to_vllm_event(event: KVEvent) -> KVCacheEvent:
    """The same event as vLLM's own class (lmprefetch's schema mirrors it; fields a vLLM
    version lacks are left out)."""
    cls = getattr(vllm_kv_events, type(event).__name__)
    known = set(cls.__struct_fields__)
    fields = {k: v for k, v in msgspec.structs.asdict(event).items() if k in known}
    return cls(**fields)
