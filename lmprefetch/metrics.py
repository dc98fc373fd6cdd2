"""Prometheus metrics for a worker (prometheus-client).

Gauges and counters are read from the worker's own statistics
(:meth:`~lmprefetch.runtime.WorkerRuntime.statistics`) at scrape time, so they can never drift
from what the engine knows (LMCache's async path reported zeros, D18).  Lookup latency is a
histogram fed by the engine after every answer.  Each worker gets its own
:class:`~prometheus_client.CollectorRegistry`, so several engines in one process (tests,
benchmarks) do not collide.

The HTTP server runs in prometheus-client's own thread; a scrape reads the engine's stats
through :meth:`WorkerRuntime.statistics`, so it never touches engine state from another
thread.

The ``Dnn`` codes are LMCache's defects, the rows of the defect table in
``docs/cancellation.md`` ("The defects"), each with its ``test_dNN_`` regression tests.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from .prefetch import Engine
    from .worker_statistics import WorkerStatistics

__all__ = [
    "LATENCY_BUCKETS_S",
    "RANK_LABELS",
    "MetricsServer",
    "MetricsSource",
    "WorkerMetrics",
    "start_metrics_server",
]

#: Lookup latency buckets, from 20 µs (a CPU hit) to 5 s (past any sane timeout).
LATENCY_BUCKETS_S = (
    2e-5,
    5e-5,
    1e-4,
    2e-4,
    5e-4,
    1e-3,
    2e-3,
    5e-3,
    1e-2,
    2e-2,
    5e-2,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
)

#: The labels every family carries.
RANK_LABELS = ["rank", "world_size"]


def _gauges(s: WorkerStatistics) -> dict[str, tuple[float, str]]:
    e = s.engine
    return {
        "inflight_lookups": (e.lookups.inflight, "Lookups probing or loading now"),
        "held_lookups": (e.lookups.held, "Answered lookups holding buffers for a claim"),
        "pinned_chunks": (e.pinned_chunks, "Pins held on all tiers"),
        "limiter_used": (e.limiter.used, "Prefetch limiter weight in use (chunks)"),
        "limiter_total": (e.limiter.total, "Prefetch limiter capacity (chunks)"),
        "limiter_waiting": (e.limiter.tasks_waiting, "Loads waiting for the prefetch limiter"),
        "arena_total_bytes": (e.arena.total_bytes, "Host-memory arena size"),
        "arena_used_bytes": (e.arena.used_bytes, "Host-memory arena bytes in use"),
        "cpu_resident_bytes": (e.cpu_resident_bytes, "Arena bytes held by the CPU tier"),
    }


#: ``lmprefetch_lookups{result=…}``: the label and the field of :class:`LookupStatistics`.
_LOOKUP_RESULTS = {
    "hit": "hits",
    "miss": "misses",
    "claimed": "claimed",
    "cancelled": "cancelled",
    "expired": "expired",
    "failed": "failed",
}
_TIER_COUNTERS = {
    "bytes_loaded": ("lmprefetch_tier_loaded_bytes", "Bytes prefetched from a tier"),
    "chunks_loaded": ("lmprefetch_tier_loaded_chunks", "Chunks prefetched from a tier"),
    "bytes_stored": ("lmprefetch_tier_stored_bytes", "Bytes stored into a tier"),
    "errors": ("lmprefetch_tier_errors", "Tier operations that failed or timed out"),
    "writes_dropped": ("lmprefetch_tier_writes_dropped", "Write-behind chunks dropped"),
    "writes_skipped": (
        "lmprefetch_tier_writes_skipped",
        "Write-behind chunks a tier held already, not written again",
    ),
    "evictions": ("lmprefetch_tier_evictions", "Entries evicted from a tier"),
    "encoded_bytes_loaded": (
        "lmprefetch_tier_encoded_loaded_bytes",
        "Bytes a tier's loads read, before its codec stage decoded them",
    ),
    "encoded_bytes_stored": (
        "lmprefetch_tier_encoded_stored_bytes",
        "Bytes a tier stored, after its codec stage encoded them",
    ),
    "decode_seconds": (
        "lmprefetch_tier_decode_seconds",
        "Thread seconds a tier's codec stage spent decoding",
    ),
    "codec_misses": (
        "lmprefetch_tier_codec_misses",
        "Stored chunks a tier's codec stage refused (damaged, unknown, another tenant's)",
    ),
}
#: ``lmprefetch_load_decisions{decision=…}``: the load policy's decisions (docs/policy.md).
_DECISIONS = {
    "loaded": "policy_loaded",
    "truncated": "policy_truncated",
    "skipped": "policy_skipped",
    "unprobed": "policy_unprobed",
    "deadline_cut": "deadline_cut",
}
#: Per-tier cost estimates (gauges; absent until measured).
_TIER_COSTS = {
    "latency_s_ewma": (
        "lmprefetch_tier_latency_seconds",
        "Moving average of a tier call's latency",
    ),
    "load_bytes_per_s_ewma": (
        "lmprefetch_tier_load_bytes_per_second",
        "Moving average of a tier's load throughput",
    ),
    "store_bytes_per_s_ewma": (
        "lmprefetch_tier_store_bytes_per_second",
        "Moving average of a tier's write-behind throughput (Redis, Mooncake)",
    ),
    "decode_bytes_per_s_ewma": (
        "lmprefetch_tier_decode_bytes_per_second",
        "Moving average of a tier's decoding rate (payload bytes per thread second)",
    ),
}
#: ``lmprefetch_messages_dropped{reason=…}``: the field of :class:`ServerStatistics`, and
#: the label.
_MESSAGE_COUNTERS = {
    "messages_malformed": "malformed",
    "requests_stale": "stale",
    "answers_dropped": "answer_dropped",
}


class _StatsCollector(Collector):
    def __init__(self, statistics: Callable[[], WorkerStatistics], rank: str, world_size: str):
        self._statistics = statistics
        self._ident = [rank, world_size]

    def collect(self) -> Iterator[Metric]:
        s = self._statistics()
        ident = self._ident
        for key, (value, doc) in _gauges(s).items():
            gauge = GaugeMetricFamily(f"lmprefetch_{key}", doc, labels=RANK_LABELS)
            gauge.add_metric(ident, value)
            yield gauge
        lookups = CounterMetricFamily(
            "lmprefetch_lookups",
            "Lookups by result (async path included)",
            labels=[*RANK_LABELS, "result"],
        )
        for label, name in _LOOKUP_RESULTS.items():
            lookups.add_metric([*ident, label], getattr(s.engine.lookups, name))
        yield lookups
        hit_tokens = CounterMetricFamily(
            "lmprefetch_hit_tokens", "Tokens answered as cached", labels=RANK_LABELS
        )
        hit_tokens.add_metric(ident, s.engine.lookups.hit_tokens)
        yield hit_tokens
        decisions = CounterMetricFamily(
            "lmprefetch_load_decisions",
            "Load policy decisions on lookups that found a hit (and deadline cuts)",
            labels=[*RANK_LABELS, "decision"],
        )
        for label, name in _DECISIONS.items():
            decisions.add_metric([*ident, label], getattr(s.engine.lookups, name))
        yield decisions
        for name, (family_name, doc) in _TIER_COSTS.items():
            gauge = GaugeMetricFamily(family_name, doc, labels=[*RANK_LABELS, "tier"])
            for tier, counters in s.engine.tiers:
                value = getattr(counters, name)
                if value is not None:
                    gauge.add_metric([*ident, tier], value)
            yield gauge
        for name, (family_name, doc) in _TIER_COUNTERS.items():
            family = CounterMetricFamily(family_name, doc, labels=[*RANK_LABELS, "tier"])
            for tier, counters in s.engine.tiers:
                family.add_metric([*ident, tier], getattr(counters, name))
            yield family
        dropped = CounterMetricFamily(
            "lmprefetch_messages_dropped",
            "Wire messages counted and dropped",
            labels=[*RANK_LABELS, "reason"],
        )
        for name, label in _MESSAGE_COUNTERS.items():
            dropped.add_metric([*ident, label], getattr(s.server, name) if s.server else 0)
        yield dropped


class WorkerMetrics:
    """The metrics of one worker, in their own registry.

    Every family carries the labels ``rank`` and ``world_size``, so one Prometheus can scrape
    every rank of a deployment and tell them apart (and sum or take the minimum over them).

    Args:
        statistics: returns the worker's statistics (thread-safe: called from the scrape
            thread; :meth:`WorkerRuntime.statistics <lmprefetch.runtime.WorkerRuntime.statistics>`).
        rank: this worker's rank.
        world_size: the number of ranks.
    """

    def __init__(
        self, statistics: Callable[[], WorkerStatistics], *, rank: int = 0, world_size: int = 1
    ) -> None:
        self.registry = CollectorRegistry()
        self.latency = Histogram(
            "lmprefetch_lookup_latency_seconds",
            "Time from a request's arrival to its answer",
            labelnames=RANK_LABELS,
            buckets=LATENCY_BUCKETS_S,
            registry=self.registry,
        ).labels(str(rank), str(world_size))
        self.registry.register(_StatsCollector(statistics, str(rank), str(world_size)))

    def observe(self, hit_tokens: int, seconds: float) -> None:
        """The engine's ``on_lookup_done`` hook."""
        self.latency.observe(seconds)


T = TypeVar("T")


class MetricsSource(Protocol):
    """What the metrics server needs of a worker (a
    :class:`~lmprefetch.runtime.WorkerRuntime` is one): its engine, its statistics from any
    thread, and a way to run a function on the engine's loop."""

    @property
    def engine(self) -> Engine: ...

    def statistics(self) -> WorkerStatistics: ...

    def call(self, func: Callable[..., T], *args: object) -> T: ...


class MetricsServer:
    """A running metrics endpoint (see :func:`start_metrics_server`); :meth:`close` stops it."""

    def __init__(self, metrics: WorkerMetrics, http: Any) -> None:
        self.metrics = metrics
        self._http = http
        #: The port actually bound.
        self.port = int(http.server_port)

    def close(self) -> None:
        """Stop serving and close the listening socket (idempotent)."""
        http, self._http = self._http, None
        if http is not None:
            http.shutdown()
            http.server_close()


def start_metrics_server(
    runtime: MetricsSource, port: int, addr: str = "127.0.0.1"
) -> MetricsServer:
    """Serve ``runtime``'s metrics over HTTP on ``addr:port`` (0 = any free port).

    Args:
        runtime: the worker (its ``statistics`` and ``call``).
        port: the TCP port, 0 … 65535.
        addr: the address to bind (loopback by default).

    Raises:
        ValueError: ``port`` is out of range.
        OSError: the address cannot be bound (e.g. the port is in use).
    """
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"metrics port: must be 0 … 65535, got {port!r}")
    engine = runtime.engine
    metrics = WorkerMetrics(runtime.statistics, rank=engine.rank, world_size=engine.world_size)
    runtime.call(_install_hook, engine, metrics)
    http, _thread = start_http_server(port, addr=addr, registry=metrics.registry)
    return MetricsServer(metrics, http)


def _install_hook(engine: Engine, metrics: WorkerMetrics) -> None:
    engine.on_lookup_done = metrics.observe
