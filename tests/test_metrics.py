"""Prometheus metrics: every family carries the rank and the world size."""

from __future__ import annotations

import re
from typing import TypeVar

from msgspec.structs import replace
from prometheus_client import generate_latest

from lmprefetch.limiter import LimiterStatistics
from lmprefetch.lookup import LookupStatistics
from lmprefetch.memory import ArenaStatistics
from lmprefetch.metrics import WorkerMetrics
from lmprefetch.prefetch import EngineStatistics
from lmprefetch.runtime import WorkerStatistics
from lmprefetch.server import ServerStatistics
from lmprefetch.store import StoreStatistics
from lmprefetch.tiers.base import TierStatistics

T = TypeVar("T")


def zeros(cls: type[T]) -> T:
    """A statistics value of ``cls`` (a frozen msgspec Struct) with every field 0."""
    return cls(**dict.fromkeys(cls.__struct_fields__, 0))  # type: ignore[attr-defined]


def fake_statistics() -> WorkerStatistics:
    tiers = (
        ("cpu", replace(zeros(TierStatistics), bytes_loaded=100)),
        (
            "disk",
            replace(
                zeros(TierStatistics),
                bytes_loaded=7,
                latency_s_ewma=0.02,
                load_bytes_per_s_ewma=5e6,
            ),
        ),
    )
    engine = EngineStatistics(
        rank=3, world_size=4,
        lookups=replace(zeros(LookupStatistics), inflight=2, hits=5, hit_tokens=40,
                        policy_truncated=2, deadline_cut=1),
        store=zeros(StoreStatistics), limiter=zeros(LimiterStatistics),
        arena=zeros(ArenaStatistics), pinned_chunks=0, cpu_resident_bytes=0,
        cpu_resident_chunks=0, tiers=tiers, kv_events=None,
    )  # fmt: skip
    server = replace(zeros(ServerStatistics), messages_malformed=3)
    return WorkerStatistics(engine=engine, server=server, publisher=None)


def test_every_sample_names_its_rank_and_world_size() -> None:
    metrics = WorkerMetrics(fake_statistics, rank=3, world_size=4)
    metrics.observe(8, 0.001)
    text = generate_latest(metrics.registry).decode()
    samples = [line for line in text.splitlines() if line.startswith("lmprefetch_")]
    assert len(samples) > 30
    for line in samples:
        labels = dict(re.findall(r'(\w+)="([^"]*)"', line.partition(" ")[0]))
        assert labels.get("rank") == "3" and labels.get("world_size") == "4", line
    assert 'lmprefetch_inflight_lookups{rank="3",world_size="4"} 2.0' in samples
    assert 'lmprefetch_tier_loaded_bytes_total{rank="3",tier="disk",world_size="4"} 7.0' in samples
    assert 'lmprefetch_lookup_latency_seconds_count{rank="3",world_size="4"} 1.0' in samples
    assert 'lmprefetch_lookups_total{rank="3",result="hit",world_size="4"} 5.0' in samples
    assert 'lmprefetch_hit_tokens_total{rank="3",world_size="4"} 40.0' in samples
    decision = 'lmprefetch_load_decisions_total{decision="%s",rank="3",world_size="4"} %s'
    assert decision % ("truncated", "2.0") in samples
    assert decision % ("deadline_cut", "1.0") in samples
    assert 'lmprefetch_tier_latency_seconds{rank="3",tier="disk",world_size="4"} 0.02' in samples
    assert (
        'lmprefetch_tier_load_bytes_per_second{rank="3",tier="disk",world_size="4"} 5e+06'
        in samples
    )
    assert (
        'lmprefetch_messages_dropped_total{rank="3",reason="malformed",world_size="4"} 3.0'
        in samples
    )
