"""The connector class vLLM instantiates: it builds the scheduler side or the worker side
and delegates every call to it."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import msgspec
import torch
from vllm.distributed import kv_events as vllm_kv_events
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from ...events import KVEvent
from .config import load_prefetch_config
from .metadata import LMPrefetchConnectorMetadata, LMPrefetchConnectorStats, LMPrefetchKVEvents
from .scheduler import _SchedulerSide
from .worker import _WorkerSide

log = logging.getLogger("lmprefetch.integration.vllm")


# -- the connector ------------------------------------------------------------------------------
class LMPrefetchConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """lmprefetch as a vLLM v1 KV connector (see the module docstring)."""

    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        config, explicit = load_prefetch_config(extra)
        block_size = int(vllm_config.cache_config.block_size)
        if config.chunk_size % block_size:
            raise ValueError(
                f"chunk_size: {config.chunk_size} is not a multiple of vLLM's block size "
                f"({block_size}); set chunk_size in kv_connector_extra_config to a multiple of it"
            )
        groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
        if len(groups) > 1:
            raise ValueError(
                "LMPrefetchConnector supports one KV cache group (no hybrid models); "
                f"got {len(groups)}"
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
            self._scheduler = _SchedulerSide(vllm_config, kv_cache_config, config)
        else:
            self._worker = _WorkerSide(vllm_config, kv_cache_config, config, explicit)

    @property
    def requires_kv_delivery(self) -> bool:
        """False: a best-effort cache; a dropped save only costs a later miss."""
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
    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self.scheduler_side.bind_kv_cache_manager(kv_cache_manager)

    def on_new_request(self, request: Any) -> None:
        self.scheduler_side.on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self.scheduler_side.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self.scheduler_side.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> LMPrefetchConnectorMetadata:
        return self.scheduler_side.build_connector_meta(scheduler_output)

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler_side.request_finished(request, block_ids)

    # -- worker side ----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker_side.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, LMPrefetchConnectorMetadata)
        self.worker_side.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete inside start_load_kv, before the forward

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # whole chunks are saved in wait_for_save, after every layer ran

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, LMPrefetchConnectorMetadata)
        self.worker_side.wait_for_save(meta)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker_side.get_block_ids_with_load_errors()

    def get_kv_connector_kv_cache_events(self) -> LMPrefetchKVEvents | None:
        """The rank's KV events since the last step (lmprefetch's tiers: stores, evictions)."""
        return self.worker_side.kv_cache_events()

    # -- KV events, scheduler side -----------------------------------------------------------
    def update_connector_output(self, connector_output: Any) -> None:
        super().update_connector_output(connector_output)
        self.scheduler_side.update_connector_output(connector_output)

    def take_events(self) -> Iterable[Any]:
        """lmprefetch's KV events for vLLM's publisher (as vLLM's own event classes)."""
        for event in self.scheduler_side.take_events():
            yield _to_vllm_event(event)

    # -- both -------------------------------------------------------------------------------
    def get_kv_connector_stats(self) -> LMPrefetchConnectorStats | None:
        side = self._scheduler if self._scheduler is not None else self._worker
        return side.stats() if side is not None else None

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> LMPrefetchConnectorStats:
        return LMPrefetchConnectorStats(data=dict(data) if data else {})

    def shutdown(self) -> None:
        if self._scheduler is not None:
            self._scheduler.shutdown()
        if self._worker is not None:
            self._worker.shutdown()


def _to_vllm_event(event: KVEvent) -> Any:
    """The same event as vLLM's own class (lmprefetch's schema mirrors it; fields a vLLM
    version lacks are left out)."""
    cls = getattr(vllm_kv_events, type(event).__name__)
    known = set(cls.__struct_fields__)
    fields = {k: v for k, v in msgspec.structs.asdict(event).items() if k in known}
    return cls(**fields)
