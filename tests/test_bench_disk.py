"""``lmprefetch bench-disk``: its summary of the runs, and a short run of the whole command."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from typing import Any

import pytest

CLI = [sys.executable, "-m", "lmprefetch"]


def test_bench_disk_summarizes_each_condition_over_its_runs() -> None:
    from lmprefetch.bench import disk as bench_disk

    def sample(condition: str, run: int, ratio: float, p99: float, load: float) -> Any:
        s = bench_disk.Sample(condition, run)
        s.figures = {"disk_hit_vs_lmcache": ratio, "cancel_release_ms_p99": p99}
        s.loads = {k: bench_disk.Load(load, load + 1, load / 2) for k in s.figures}
        # The limits measured beside them: a plain read at 0.7x the ratio; a thread hop at a
        # quarter of the cancel (one run measured none).
        s.limits = {"disk_hit_vs_lmcache": 0.7 * ratio, "cancel_release_ms_p99": p99 / 4}
        return s

    samples = [
        sample("alone", 0, 0.5, 0.4, 1.0), sample("burners", 0, 0.9, 5.0, 3.0),
        sample("burners", 1, 0.7, 7.0, 4.0), sample("alone", 1, 0.55, math.nan, 0.5),
        sample("alone", 2, 0.9, 0.8, 2.0),
    ]  # fmt: skip
    summary = bench_disk.summarize(samples)
    alone, busy = summary["alone"], summary["burners"]
    assert alone["disk_hit_vs_lmcache"]["median"] == 0.55
    assert (alone["disk_hit_vs_lmcache"]["min"], alone["disk_hit_vs_lmcache"]["max"]) == (0.5, 0.9)
    assert alone["disk_hit_vs_lmcache"]["load_avg"] == [0.5, 3.0]  # lowest start, highest end
    assert alone["disk_hit_vs_lmcache"]["run_queue"] == [0.25, 1.0]
    assert alone["cancel_release_ms_p99"]["n"] == 2  # a run without the figure is left out
    assert busy["disk_hit_vs_lmcache"]["median"] == 0.8
    assert busy["disk_hit_vs_lmcache"]["limit"] == pytest.approx(0.56)  # median of the limits
    assert alone["cancel_release_ms_p99"]["limit"] == pytest.approx(0.15)  # the NaN left out
    r = {"summary": summary, "runs": 3, "burners": 2, "chunks": 16, "chunk_bytes": 2 << 20,
         "seconds": 1.0, "lmcache": True, "ok": True}  # fmt: skip
    by_key = {g.key: g for g in bench_disk.goals(r)}
    assert by_key["disk_hit_vs_lmcache:alone"].met  # 0.55 <= 0.6
    assert not by_key["disk_hit_vs_lmcache:burners"].met
    assert by_key["cancel_release_ms_p99:alone"].met and not by_key[
        "cancel_release_ms_p99:burners"
    ].met
    # Each goal carries its limit from the same runs and the highest load average beside it.
    busy_disk = by_key["disk_hit_vs_lmcache:burners"]
    assert busy_disk.limit is not None and busy_disk.limit.value == pytest.approx(0.56)
    assert busy_disk.load_avg == 5.0
    text = bench_disk.format_report(r)
    assert text.count("✗ MISSED") == 2 and text.count("✓") == 2
    # Under each missed goal (and only there), whether this machine could have met it.
    assert text.count("↳ ") == 2
    assert "↳ within this machine's reach: raw read of the same files ÷ LMCache's time: 0.56×" in (
        text
    )
    assert "↳ out of reach on this machine: the p99 of bare hops" in text  # 1.5 ms > 1 ms
    assert "load avg 0.5–3.0, run queue 0.2–1.0" in text  # the load beside each figure


def test_bench_disk_measures_each_goals_limit_beside_its_figure() -> None:
    """The limits come from the same engine and bench runs as the figures: the plain read of
    the same files ÷ LMCache's time (a file verified once is read unhashed), the plain read ÷
    the verified read of the probe, and the p99 of the bare thread hops."""
    from lmprefetch.bench import disk as bench_disk

    def q(m: float) -> dict[str, float]:
        return {"median": m, "p25": m, "p75": m}

    cases = ("disk_hit", "disk_x8", "disk_hit_hashed", "disk_x8_hashed")
    engine = {
        "disk_hit_us": 4000.0, "disk_hit_cpu_us": 3000.0, "idle_after": True,
        "raw_read_16_us": 2500.0, "raw_read_verified_16_us": 3500.0,
        "raw_read_x8_us": 30000.0, "raw_read_verified_x8_us": 35000.0,
        "load_avg_per_case": {c: [1.0, 2.0] for c in cases},
        "lmcache": {
            "disk_hit_us": 5000.0, "disk_x8_us": 40000.0, "disk_hit_cpu_us": 3500.0,
            "ratios": {c: q(0.8) for c in cases}, "answers_ok": True,
        },
    }  # fmt: skip
    system = {
        "disk_probe": {"vs_verified_read": 0.5, "vs_raw_read": 0.25, "raw_vs_verified_read": 2.0},
        "cancel_release_ms_p99": 3.0, "cancel_release_ms_max": 9.0, "thread_hop_ms_p99": 2.0,
        "leak_free": True,
    }  # fmt: skip
    sample = bench_disk.Sample("alone", 0)
    load = bench_disk.Load(1.0, 2.0, 0.5)
    budget = {
        "one": {
            "vs_floor": 2.0,
            "vs_distinct": 1.25,
            "distinct_vs_floor": 1.6,
            "vs_design_floor": 1.2,
            "trio_cpu_s": 450e-6,
        },
        "eight": {"vs_floor": 1.8, "vs_distinct": 1.2, "distinct_vs_floor": 1.5},
        "idle_after": True,
    }
    bench_disk._budget_figures(budget, load, sample)
    bench_disk._engine_figures(engine, load, sample)
    bench_disk._system_figures(system, load, sample)
    assert sample.limits == {
        "disk_hit_vs_floor": 1.6,  # plain reads into distinct slots ÷ the floor
        "disk_x8_vs_floor": 1.5,
        "disk_hit_vs_lmcache": 2500.0 / 5000.0,
        "disk_x8_vs_lmcache": 30000.0 / 40000.0,
        "disk_prefetch_vs_verified_read": 2.0,
        "cancel_release_ms_p99": 2.0,
    }
    assert set(sample.limits) == set(bench_disk.LIMITS)  # every goal has one
    assert sample.figures["disk_hit_vs_design_floor"] == 1.2
    assert sample.figures["disk_hit_trio_cpu_us"] == pytest.approx(450.0)
    assert sample.loads["disk_x8_vs_lmcache"] == load  # its case's load, before → after
    assert sample.ok


@pytest.mark.slow
def test_bench_disk_quick_runs_every_condition() -> None:
    out = subprocess.run(
        [*CLI, "bench-disk", "--quick", "--runs", "1", "--repeats", "2", "--lmcache", "off",
         "--burners", "1", "--json", "-"],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    r = json.loads(out.stdout)
    assert r["ok"] is True and r["lmcache"] is False
    assert [s["condition"] for s in r["samples"]] == ["alone", "burners"]
    for condition in ("alone", "burners"):
        figures = r["summary"][condition]
        # Without LMCache: the bench figures, no LMCache ratio (none from another run).
        assert figures["disk_prefetch_vs_verified_read"]["median"] > 0
        assert figures["cancel_release_ms_p99"]["median"] > 0
        assert not any("lmcache" in key for key in figures)
        assert all(f["load_avg"][0] >= 0 for f in figures.values())
    for goal in r["goals"]:
        assert goal["limit"] is not None and goal["limit"]["value"] > 0, goal["key"]
    keys = {g["key"] for g in r["goals"]}
    assert keys == {
        f"{k}:{c}" for k in ("disk_hit_vs_floor", "disk_x8_vs_floor",
                             "disk_prefetch_vs_verified_read", "cancel_release_ms_p99")
        for c in ("alone", "burners")
    }  # fmt: skip
    # The phase budget of each condition is in the report.
    assert all("budget" in s["raw"] for s in r["samples"])


@pytest.mark.lmcache
def test_bench_disk_quick_measures_lmcache_beside_each_figure() -> None:
    pytest.importorskip("lmcache")
    out = subprocess.run(
        [*CLI, "bench-disk", "--quick", "--runs", "1", "--repeats", "2", "--lmcache", "on",
         "--burners", "1", "--json", "-"],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    r = json.loads(out.stdout)
    assert r["ok"] is True and r["lmcache"] is True  # LMCache's answers were right too
    for condition in ("alone", "burners"):
        figures = r["summary"][condition]
        for key in ("disk_hit_vs_lmcache", "disk_x8_vs_lmcache", "disk_hit_hashed_vs_lmcache",
                    "disk_hit_cpu_vs_lmcache"):  # fmt: skip
            assert figures[key]["median"] > 0, key
    assert {g["key"].split(":")[0] for g in r["goals"]} == {
        "disk_hit_vs_floor", "disk_x8_vs_floor", "disk_hit_vs_lmcache", "disk_x8_vs_lmcache",
        "disk_prefetch_vs_verified_read", "cancel_release_ms_p99",
    }  # fmt: skip


def test_the_budget_gives_each_instant_to_the_first_active_phase() -> None:
    from lmprefetch.bench.disk_budget import PHASES, attribute

    intervals = [
        ("trio", 0.0, 10.0),  # the Trio thread runs throughout ...
        ("syscalls", 2.0, 4.0),  # ... but a read in progress comes first
        ("thread", 1.0, 5.0),
        ("hash", 3.0, 6.0),  # overlaps the read: only 4-6 is hashing's
        ("handoff", 9.0, 12.0),  # clipped at the end
        ("limiter", -5.0, 0.5),  # clipped at the start, and under trio
    ]
    got = attribute(intervals, 0.0, 12.0)
    assert set(got) == {name for name, _ in PHASES}
    assert got["syscalls"] == 2.0 and got["hash"] == 2.0
    assert got["thread"] == 1.0  # 1-2 (2-4 is the read's, 4-5 hashing's)
    assert got["trio"] == 10.0 - 5.0  # 0-1 and 6-10
    assert got["handoff"] == 2.0 and got["limiter"] == 0.0
    assert got["idle"] == 0.0
    assert sum(got.values()) == 12.0
    # Where nothing is recorded, the time is idle.
    assert attribute([("probe", 1.0, 2.0)], 0.0, 4.0)["idle"] == 3.0


@pytest.mark.slow
def test_the_phase_budget_accounts_for_the_wall_time_of_each_disk_hit() -> None:
    """Every phase is reported, the ones a disk hit must have are there, and the phases the
    disk tier and Trio recorded cover the measured wall time: what nothing recorded is a
    small share of it (a missing hook would show here as idle time)."""
    from lmprefetch.bench import disk_budget

    r = disk_budget.measure(
        chunks=4, chunk_bytes=256 * 1024, repeats=4, x8_repeats=2, cancel_repeats=4
    )
    assert r["idle_after"]
    for case in ("one", "eight"):
        c = r[case]
        phases = c["phases"]
        assert set(phases) == {name for name, _ in disk_budget.PHASES}
        total = sum(p["wall_s"] for p in phases.values())
        assert total == pytest.approx(c["wall_s_mean"], rel=1e-6)
        assert phases["idle"]["wall_s"] <= 0.2 * c["wall_s_mean"], phases
        for name in ("syscalls", "thread", "probe", "trio", "handoff", "limiter"):
            assert phases[name]["count"] > 0, name
        assert phases["syscalls"]["wall_s"] > 0 and phases["trio"]["wall_s"] > 0
        assert c["floor_s"] > 0 and c["distinct_s"] > 0 and c["vs_floor"] > 0
    cancel = r["cancel"]
    assert sum(p["wall_s"] for p in cancel["phases"].values()) == pytest.approx(
        cancel["wall_s_mean"], rel=1e-6
    )
    assert cancel["phases"]["trio"]["count"] > 0  # the unwinding runs on the Trio thread
    assert 0 < cancel["wall_s_median"] <= cancel["p99_s"] <= cancel["max_s"]
    # Beside it, the least a Trio design takes: a task, one hop reading the same files.
    one = r["one"]
    assert one["design_floor_trio_cpu_s"] > 0
    assert one["checked_s"] > 0  # ... and the plain reads with a load's checks
    assert one["trio_cpu_s"] > 0
    assert one["vs_design_floor"] == one["wall_s_median"] / one["design_floor_s"] > 0
    # One disk hit of page-cache chunks: one thread call, so two hand-offs.
    assert r["one"]["phases"]["handoff"]["count"] == 2
    assert r["eight"]["phases"]["handoff"]["count"] == 16
    text = disk_budget.format_budget(r)
    assert text.count("sum (= the mean wall time)") == 3
    assert "cancel of a disk hit in its read thread → released" in text
    assert "The least a Trio design takes" in text
    assert "The plain reads with a load's checks" in text
    assert all(label in text for _, label in disk_budget.PHASES)
