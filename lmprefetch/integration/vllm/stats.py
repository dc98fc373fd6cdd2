"""The connector's counters, declared once (:class:`ConnectorStatistics`), and the two forms
vLLM takes them in, both derived from that declaration: the stats object it aggregates and
logs (:class:`LMPrefetchConnectorStats`, through ``get_kv_connector_stats``) and the
``vllm:lmprefetch_<name>`` Prometheus counters (:func:`build_prom_metrics`).

Each side keeps one :class:`ConnectorStatistics` of counts since it started and changes it on
its own thread only (the scheduler's, a worker's model runner's); its ``statistics()`` is a
snapshot, and ``get_kv_connector_stats`` reports what grew since the last report.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics

__all__ = ["ConnectorStatistics", "LMPrefetchConnectorStats", "build_prom_metrics"]


def _counter(help_text: str) -> Any:
    """A counter field: starts at 0; ``help_text`` is its Prometheus help."""
    return dataclasses.field(default=0, metadata={"help": help_text})


@dataclass
class ConnectorStatistics:
    """The connector's counters: counts since start, summed over the scheduler side and every
    worker rank where vLLM aggregates them.

    Hybrid models count keys (one per group and chunk, or Mamba state) where the others count
    chunks (``save_chunks_planned``, ``loaded_chunks``, ``saved_chunks``).  Load or recompute
    (``docs/policy.md``): the scheduler side counts the requests' own limits, the workers the
    load policy's decisions (read from the engine).
    """

    # The scheduler side.
    lookups: int = _counter("Requests looked up in lmprefetch")
    group_lookups: int = _counter("Lookups sent (hybrid models: several per request)")
    lookup_hits: int = _counter("Requests that loaded tokens from lmprefetch")
    hit_tokens: int = _counter("Tokens loaded from lmprefetch instead of computed")
    lookup_restarts: int = _counter(
        "Lookups started again (preempted, vLLM's hit shrank, or an answer too old to trust)"
    )
    save_chunks_planned: int = _counter("Chunks planned to be saved")
    kv_events: int = _counter("KV events handed to vLLM's publisher")
    load_skipped: int = _counter(
        "Requests that asked to load nothing (skip_load, max_load_tokens 0)"
    )
    load_capped: int = _counter("Requests with a max_load_tokens cap")
    load_cap_cut: int = _counter("Hits shortened by a request's max_load_tokens")
    save_skipped: int = _counter("Requests that asked not to be saved (skip_save)")
    # The workers.
    loaded_chunks: int = _counter("Chunks copied into vLLM's KV cache")
    loaded_bytes: int = _counter("Bytes copied into vLLM's KV cache")
    load_failures: int = _counter("Requests whose load came back short")
    failed_blocks: int = _counter("Blocks reported lost to vLLM (it recomputes them)")
    saved_chunks: int = _counter("Chunks saved to lmprefetch")
    saved_bytes: int = _counter("Bytes saved to lmprefetch")
    save_errors: int = _counter("Saves that failed (the rest of the request's keys not saved)")
    policy_loaded: int = _counter("Lookups whose whole hit the load policy loaded")
    policy_truncated: int = _counter("Lookups whose hit the load policy truncated")
    policy_skipped: int = _counter("Lookups whose hit the load policy skipped (recomputed)")
    policy_unprobed: int = _counter(
        "Lookups for which the load policy ruled a tier out before probing it"
    )
    deadline_cut: int = _counter("Lookups whose loads the load deadline cut short")

    @classmethod
    def counters(cls) -> list[tuple[str, str]]:
        """Every counter's name and help, in declaration order."""
        return [(f.name, f.metadata["help"]) for f in dataclasses.fields(cls)]

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ConnectorStatistics:
        """The counters in ``data`` (vLLM's stats dict); other keys (``hit_rate``, a newer
        connector's counters) are left out."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: int(v) for k, v in data.items() if k in names})

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    def since(self, earlier: ConnectorStatistics) -> dict[str, int]:
        """The counters that grew since ``earlier``, by how much."""
        old = earlier.as_dict()
        return {k: v - old[k] for k, v in self.as_dict().items() if v != old[k]}


class LMPrefetchConnectorStats(KVConnectorStats):  # type: ignore[misc]
    """What vLLM aggregates and logs: the :class:`ConnectorStatistics` counters that grew since
    the last collection, as ``data`` (a dict, summed over the scheduler side and every worker
    rank).  vLLM rebuilds it by name in its logging process (``build_kv_connector_stats``);
    :meth:`statistics` reads it back typed.
    """

    @classmethod
    def between(
        cls, earlier: ConnectorStatistics, now: ConnectorStatistics
    ) -> LMPrefetchConnectorStats | None:
        """What grew from ``earlier`` to ``now`` (``None`` when nothing did)."""
        grown = now.since(earlier)
        return cls(data=grown) if grown else None

    def statistics(self) -> ConnectorStatistics:
        return ConnectorStatistics.from_dict(self.data)

    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    def aggregate(self, other: KVConnectorStats) -> LMPrefetchConnectorStats:
        for key, value in other.data.items():
            self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = dict(self.data)
        lookups = self.data.get("lookups", 0)
        if lookups:
            out["hit_rate"] = round(self.data.get("lookup_hits", 0) / lookups, 4)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())


def build_prom_metrics(
    vllm_config: VllmConfig,
    metric_types: dict[type, type],
    labelnames: list[str],
    per_engine_labelvalues: dict[int, list[object]],
) -> KVConnectorPromMetrics | None:
    """An instance of vLLM's ``KVConnectorPromMetrics`` exporting every counter of
    :class:`ConnectorStatistics` as ``vllm:lmprefetch_<name>``, or ``None`` where the installed
    vLLM lacks the classes."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics
        from vllm.v1.metrics.utils import create_metric_per_engine
    except ImportError:  # pragma: no cover - an older vLLM
        return None

    class LMPrefetchPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
            self.counters = {
                name: create_metric_per_engine(
                    self._counter_cls(
                        name=f"vllm:lmprefetch_{name}", documentation=doc, labelnames=labelnames
                    ),
                    self.per_engine_labelvalues,
                )
                for name, doc in ConnectorStatistics.counters()
            }

        def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
            for key, value in transfer_stats_data.items():
                per_engine = self.counters.get(key)
                if per_engine is not None and value and engine_idx in per_engine:
                    per_engine[engine_idx].inc(value)

    return LMPrefetchPromMetrics()
