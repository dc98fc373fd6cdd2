"""The benchmarks' reports: every figure with a goal is marked, the plot and the text use one
baseline, and no peer figure appears unless it was measured in the same run."""

from __future__ import annotations

import math
from typing import Any

from lmprefetch.bench import engine as bench_engine
from lmprefetch.bench.goals import Goal
from lmprefetch.bench.report import format_report, goals, throughput_bars


def test_goal_at_most_and_at_least() -> None:
    assert Goal("a", "a", 1.5, "<=", 1.5, "×").met
    assert not Goal("a", "a", 1.51, "<=", 1.5, "×").met
    assert Goal("b", "b", 0.8, ">=", 0.8, "×").met
    assert not Goal("b", "b", 0.79, ">=", 0.8, "×").met
    missed = Goal("c", "cancel", 3.0, "<=", 1.0, "ms")
    assert missed.mark() == "✗ MISSED" and "✗ MISSED" in missed.line()
    assert missed.as_dict() == {
        "key": "c", "label": "cancel", "value": 3.0, "goal": "≤ 1.00ms", "met": False
    }  # fmt: skip


def test_a_figure_that_is_not_a_number_never_meets_its_goal() -> None:
    assert not Goal("a", "a", math.nan, "<=", 1.0, "×").met
    assert not Goal("a", "a", math.nan, ">=", 1.0, "×").met


def _system_result(**changes: Any) -> dict[str, Any]:
    r: dict[str, Any] = {
        "options": {"workers": 2, "transport": "ipc", "concurrency": 16},
        "miss_rtt_us": 100.0,
        "raw_rtt_us": 50.0,
        "raw_rtt_first_us": 400.0,
        "miss_rtt_ratio": 2.0,
        "trio_echo_rtt_us": 70.0,
        "worker_rtt_us": 80.0,
        "miss_rtt_woken_us": 110.0,
        "first_lookup_us": 150.0,
        "first_lookup_ratio": 1.5,
        "submit_us": 3.0,
        "poll_us": 0.5,
        "miss_lookups_per_s_per_worker": 30_000.0,
        "replay": {
            "lookups": 10, "aborted": 1, "latency_p50_ms": 1.0, "latency_p99_ms": 2.0,
            "hit_ratio": 0.9, "latencies_ms": [1.0, 2.0],
        },
        "tier_gbps": {"cpu": None, "disk": 2.0},
        "tier_bytes_loaded": {"cpu": 1e6, "disk": 1e6},
        "disk_probe": {
            "workers": 2, "concurrency_per_worker": 8, "chunks_per_lookup": 16, "rounds": 4,
            "prefetch_gbps": 2.0, "verified_read_gbps": 4.0, "raw_read_gbps": 8.0,
            "vs_verified_read": 0.5, "vs_raw_read": 0.25, "reads_trusted": 10,
            "reads_hashed": 2,
        },
        "cancel_samples": 40,
        "cancel_release_ms_p50": 0.2,
        "cancel_release_ms_p99": 3.0,
        "cancel_release_ms_max": 9.0,
        "leak_free": True,
        "workers": [],
    }
    r.update(changes)
    return r


def test_bench_marks_each_missed_figure() -> None:
    r = _system_result()
    by_key = {g.key: g for g in goals(r)}
    assert not by_key["miss_rtt_ratio"].met  # 2.0 > 1.5
    assert by_key["first_lookup_ratio"].met
    assert not by_key["cancel_release_ms_p99"].met  # 3 ms > 1 ms
    # The disk ratio is against the *verified* read at the same concurrency, not the plain one.
    assert by_key["disk_prefetch_vs_verified_read"].value == 0.5
    text = format_report(r)
    goal_lines = [line for line in text.splitlines() if " goal " in line]
    assert len(goal_lines) == len(by_key)
    missed = [line for line in goal_lines if line.endswith("✗ MISSED")]
    assert len(missed) == 3  # round trip, disk prefetch, cancel
    assert all(line.endswith("✓") for line in goal_lines if line not in missed)


def test_the_plot_uses_the_texts_baseline() -> None:
    names, values = throughput_bars(_system_result())
    assert names == ["disk prefetch", "raw read + xxh3"]
    assert values == [2.0, 4.0]  # the verified read (4 GB/s), not the plain one (8 GB/s)


def _engine_result(lmcache: dict[str, Any] | None) -> dict[str, Any]:
    r: dict[str, Any] = {
        "chunks": 16, "chunk_bytes": 2 << 20, "repeats": 5, "x8_repeats": 3,
        "cpu_hit_us": 40.0, "miss_us": 10.0, "disk_hit_us": 4000.0, "disk_x8_us": 40000.0,
        "trio_checkpoint_us": 4.0, "raw_read_16_us": 2500.0, "raw_read_verified_16_us": 3500.0,
        "raw_read_x8_us": 30000.0, "raw_read_verified_x8_us": 35000.0,
        "engine_open_ms": 5.0, "arena_prefault_bytes": 1 << 30, "cpu_bytes": 1 << 30,
        "cold_first_disk_us": 12000.0, "cold_ratio": 3.0, "idle_after": True,
        "lmcache": lmcache,
    }  # fmt: skip
    return r


def test_bench_engine_prints_no_lmcache_figure_it_did_not_measure() -> None:
    r = _engine_result(None)
    keys = [g.key for g in bench_engine.goals(r)]
    assert keys == ["cold_first_disk_vs_steady"]
    text = bench_engine.format_report(r)
    assert "LMCache: not installed here, so not measured" in text
    # No LMCache column, and no figure borrowed from elsewhere.
    assert "(ref.)" not in text and "lmp ÷ LMCache" not in text
    assert not hasattr(bench_engine, "LMCACHE_REFERENCE_US")
    assert text.count("✗ MISSED") == 1  # the cold start: 3× > 2×


def test_bench_engine_marks_the_lmcache_ratios_it_measured() -> None:
    def q(m: float) -> dict[str, float]:
        return {"median": m, "p25": m, "p75": m}

    lmc = {
        "version": "0.5.6",
        "cpu_hit_us": 200.0, "miss_us": 50.0, "disk_hit_us": 5000.0, "disk_x8_us": 50000.0,
        "ratios": {"cpu_hit": q(0.2), "miss": q(0.2), "disk_hit": q(0.8), "disk_x8": q(0.8)},
        "answers_ok": True, "hit_tokens": {}, "disk_metadata_pins_after": 0,
    }  # fmt: skip
    r = _engine_result(lmc)
    by_key = {g.key: g for g in bench_engine.goals(r)}
    assert by_key["cpu_hit_vs_lmcache"].met and by_key["miss_vs_lmcache"].met
    assert not by_key["disk_hit_vs_lmcache"].met and not by_key["disk_x8_vs_lmcache"].met
    text = bench_engine.format_report(r)
    assert "LMCache 0.5.6" in text and text.count("✗ MISSED") == 3


def test_the_disk_figure_is_the_median_of_the_rounds_ratios() -> None:
    from lmprefetch.bench.system import summarize_disk_probe

    def probe(prefetch: list[float], verified: list[float]) -> dict[str, Any]:
        return {
            "concurrency": 8, "chunks_per_lookup": 16, "prefetch_gbps": prefetch,
            "verified_read_gbps": verified, "raw_read_gbps": [2 * v for v in verified],
            "reads_trusted": 5, "reads_hashed": 1,
        }  # fmt: skip

    # Round by round: the load of one round hits both sides of it, so the ratio is per round.
    s = summarize_disk_probe([probe([1.0, 4.0, 2.0], [2.0, 4.0, 1.0]), probe([3.0], [1.0])])
    assert s["vs_verified_read"] == 1.5  # median of 0.5, 1, 2, 3
    assert s["vs_raw_read"] == 0.75
    assert s["prefetch_gbps"] == 2.0 + 3.0  # each worker's median, summed
    assert s["verified_read_gbps"] == 2.0 + 1.0
    assert (s["workers"], s["rounds"], s["reads_trusted"], s["reads_hashed"]) == (2, 3, 10, 2)
    assert summarize_disk_probe([{}, {}]) == {}  # no disk tier: no figure
    r = _system_result(disk_probe={})
    assert math.isnan(next(g for g in goals(r) if g.key == "disk_prefetch_vs_verified_read").value)

