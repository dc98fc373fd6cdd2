"""Prometheus metrics: every family carries the rank and the world size."""

from __future__ import annotations

import re
from typing import Any

from prometheus_client import generate_latest

from lmprefetch.metrics import WorkerMetrics


def fake_stats() -> dict[str, Any]:
    return {
        "inflight_lookups": 2,
        "lookup_hits": 5,
        "hit_tokens": 40,
        "tiers": {"cpu": {"bytes_loaded": 100}, "disk": {"bytes_loaded": 7}},
        "messages_malformed": 3,
    }


def test_every_sample_names_its_rank_and_world_size() -> None:
    metrics = WorkerMetrics(fake_stats, rank=3, world_size=4)
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
