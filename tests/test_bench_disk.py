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
    r = {"summary": summary, "runs": 3, "burners": 2, "chunks": 16, "chunk_bytes": 2 << 20,
         "seconds": 1.0, "lmcache": True, "ok": True}  # fmt: skip
    by_key = {g.key: g for g in bench_disk.goals(r)}
    assert by_key["disk_hit_vs_lmcache:alone"].met  # 0.55 <= 0.6
    assert not by_key["disk_hit_vs_lmcache:burners"].met
    assert by_key["cancel_release_ms_p99:alone"].met and not by_key[
        "cancel_release_ms_p99:burners"
    ].met
    text = bench_disk.format_report(r)
    assert text.count("✗ MISSED") == 2 and text.count("✓") == 2
    assert "load avg 0.5–3.0, run queue 0.2–1.0" in text  # the load beside each figure



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
    keys = {g["key"] for g in r["goals"]}
    assert keys == {
        f"{k}:{c}" for k in ("disk_prefetch_vs_verified_read", "cancel_release_ms_p99")
        for c in ("alone", "burners")
    }  # fmt: skip


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
        "disk_hit_vs_lmcache", "disk_x8_vs_lmcache", "disk_prefetch_vs_verified_read",
        "cancel_release_ms_p99",
    }  # fmt: skip
