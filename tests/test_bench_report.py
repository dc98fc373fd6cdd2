"""The benchmarks' reports: every figure with a goal is marked, the plot and the text use one
baseline, and no peer figure appears unless it was measured in the same run."""

from __future__ import annotations

import io
import json
import math
import subprocess
import sys
from typing import Any

import pytest

from lmprefetch.bench import engine as bench_engine
from lmprefetch.bench.goals import Goal, Limit
from lmprefetch.bench.report import format_report, goals, throughput_bars, wrap


def test_goal_at_most_and_at_least() -> None:
    assert Goal("a", "a", 1.5, "<=", 1.5, "×").met
    assert not Goal("a", "a", 1.51, "<=", 1.5, "×").met
    assert Goal("b", "b", 0.8, ">=", 0.8, "×").met
    assert not Goal("b", "b", 0.79, ">=", 0.8, "×").met
    missed = Goal("c", "cancel", 3.0, "<=", 1.0, "ms", load_avg=2.5, cpus=2)
    assert missed.mark() == "✗ MISSED" and "✗ MISSED" in missed.line()
    assert missed.as_dict() == {
        "key": "c", "label": "cancel", "value": 3.0, "goal": "≤ 1.00ms", "met": False,
        "limit": None, "load_avg": 2.5,
        "why_missed": "no limit for it measured in this run (load average 2.5 on 2 CPUs)",
    }  # fmt: skip


def test_a_missed_goal_says_whether_its_limit_misses_it_too() -> None:
    """The verdict comes from the limit measured in the same run, compared with the same
    target the same way; the load average taken with the figure is printed beside it."""
    machine = {"load_avg": 3.25, "load_avg_before": 0.5, "cpus": 2}
    slow_echo = Limit("a raw echo", 1.8)
    expected = Goal("a", "round trip ratio", 2.0, "<=", 1.5, "×", limit=slow_echo, **machine)
    why = expected.why_missed()
    assert why == (
        "out of reach on this machine: a raw echo: 1.80× in this run, past the goal; the "
        "figure is 1.1× that (load average 3.2 on 2 CPUs, 0.5 before the run)"
    )
    lines = expected.lines()
    assert lines[0] == expected.line() and lines[1].startswith("      ↳ out of reach")
    assert " ".join(x.strip() for x in lines[1:]) == f"↳ {why}"
    assert all(len(x) <= 100 for x in lines[1:])
    fast_echo = Limit("a raw echo", 1.2)
    ours = Goal("a", "round trip ratio", 2.0, "<=", 1.5, "×", limit=fast_echo, **machine)
    assert (ours.why_missed() or "").startswith(
        "within this machine's reach: a raw echo: 1.20× in this run; the figure is 1.7× that"
    )
    # ">=" goals compare the limit the same way: an echo slower than the goal explains it.
    per_s = Goal("t", "lookups", 9000.0, ">=", 20_000.0, "/s", limit=Limit("echo", 15_000.0))
    assert (per_s.why_missed() or "").startswith(
        "out of reach on this machine: echo: 15000/s in this run, past the goal; the figure "
        "is 1.7× that"
    )
    per_s = Goal("t", "lookups", 9000.0, ">=", 20_000.0, "/s", limit=Limit("echo", 50_000.0))
    assert (per_s.why_missed() or "").startswith("within this machine's reach")
    nothing = Goal("t", "lookups", 0.0, ">=", 20_000.0, "/s", limit=Limit("echo", 15_000.0))
    assert "the figure is" not in (nothing.why_missed() or "")  # no ratio to a zero
    # A limit that was not measured says so, and a met goal says nothing.
    unmeasured = Goal("a", "x", 2.0, "<=", 1.5, "×", limit=Limit("echo", math.nan))
    assert (unmeasured.why_missed() or "").startswith("no limit for it measured in this run")
    met = Goal("a", "x", 1.0, "<=", 1.5, "×", limit=slow_echo, **machine)
    assert met.why_missed() is None and met.lines() == [met.line()]
    assert met.as_dict()["why_missed"] is None
    assert met.as_dict()["limit"] == {"label": "a raw echo", "value": 1.8}


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
            "vs_verified_read": 0.5, "vs_raw_read": 0.25, "raw_vs_verified_read": 2.0,
            "reads_trusted": 10, "reads_hashed": 2,
        },
        "cancel_samples": 40,
        "cancel_release_ms_p50": 0.2,
        "cancel_release_ms_p99": 3.0,
        "cancel_release_ms_max": 9.0,
        "leak_free": True,
        "workers": [],
        # The limits this run measured, and the machine.
        "raw_echo_per_s": 40_000.0,
        "floor_submit_us": 1.0,
        "floor_poll_us": 0.3,
        "thread_hop_ms_p99": 2.0,
        "thread_hop_ms_max": 4.0,
        "cpus": 2,
        "load_avg_before": 0.5,
        "load_avg": {"transport": 1.0, "scheduler": 1.25, "replay": 3.5, "disk": 3.0,
                     "cancel": 2.75},
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
    lines = text.splitlines()
    goal_lines = [line for line in lines if line.startswith("  ") and "  goal " in line]
    assert len(goal_lines) == len(by_key)
    missed = [line for line in goal_lines if line.endswith("✗ MISSED")]
    assert len(missed) == 3  # round trip, disk prefetch, cancel
    assert all(line.endswith("✓") for line in goal_lines if line not in missed)
    # Under each missed goal, and only there, what limits it here, from this run's numbers.
    why = _why_lines(lines)
    assert set(why) == set(missed)
    rtt, disk, cancel = (why[line] for line in missed)
    # The Trio-native echo is 70 / 50 = 1.4x raw pyzmq: within 1.5x, so within reach.
    assert "within this machine's reach" in rtt and "1.40×" in rtt and "load average 1.0" in rtt
    # The plain read of the same files is 2x the verified one: the 0.8x goal is within reach,
    # and the lookups' 0.5x is 4x short of that limit.
    assert disk.startswith("↳ within this machine's reach: a plain read of the same files")
    assert "2.00× in this run; the figure is 4.0× that" in disk
    assert "load average 3.0 on 2 CPUs" in disk
    # The p99 of the thread hops took 2 ms: a 1 ms p99 release cannot be had here.
    assert cancel.startswith("↳ out of reach on this machine") and "2.00ms" in cancel
    assert "load average 0.5 on 2 CPUs before the run, 1.0–3.5 during it" in text


def test_the_report_says_what_a_missed_goal_means_and_fits_100_columns() -> None:
    """``lmprefetch bench`` exited 0 under four ``✗ MISSED`` with no word on what that means,
    and one of its lines was about 260 characters long."""
    r = _system_result(
        # Long figures make long lines: every one is wrapped under its own indentation.
        miss_rtt_us=123456.789, raw_rtt_us=98765.4321, trio_echo_rtt_us=87654.321,
        worker_rtt_us=76543.21, miss_rtt_woken_us=123456.789, first_lookup_us=1234567.89,
        raw_rtt_first_us=7654321.0,
    )  # fmt: skip
    text = format_report(r)
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 100, max(lines, key=len)
    # The breakdown line (once ~260 columns) is all there, wrapped.
    joined = " ".join(line.strip() for line in lines)
    assert "through LookupClient 123456.8 µs (a thread blocked in wait() wakes after" in joined
    summary = joined[joined.index("3 of 7 goals missed."):]
    assert "a missed goal is not an error" in summary
    assert "docs/benchmarks.md" in summary
    assert "goals missed" not in format_report(_system_result(
        miss_rtt_ratio=1.0, disk_probe={**r["disk_probe"], "vs_verified_read": 1.0},
        cancel_release_ms_p99=0.5,
    ))  # fmt: skip
    assert wrap("  " + "word " * 40) == [
        line for line in wrap("  " + "word " * 40) if len(line) <= 100
    ]
    assert wrap("") == [""] and wrap("  short") == ["  short"]


def _why_lines(lines: list[str]) -> dict[str, str]:
    """goal line -> the sentence under it (its wrapped lines joined)."""
    out: dict[str, str] = {}
    goal = ""
    for line in lines:
        if line.startswith("      ↳ "):
            out[goal] = line.strip()
        elif line.startswith("        ") and goal in out:
            out[goal] += " " + line.strip()
        else:
            goal = line
    return out


def test_a_bench_result_from_before_the_limits_still_reports() -> None:
    """A result without the limit figures (an older ``--json``) prints, saying no limit."""
    r = _system_result()
    for key in ("raw_echo_per_s", "floor_submit_us", "floor_poll_us", "thread_hop_ms_p99",
                "thread_hop_ms_max", "cpus", "load_avg_before", "load_avg"):  # fmt: skip
        del r[key]
    del r["disk_probe"]["raw_vs_verified_read"]
    text = format_report(r)
    assert text.count("no limit for it measured in this run (load average unknown)") == 2


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
    # A file verified once is read unhashed, so a perfect lmprefetch would take the plain
    # read: 2500 µs against LMCache's 5000 µs is 0.50x, within the 0.6x goal.
    disk = by_key["disk_hit_vs_lmcache"]
    assert disk.limit is not None and disk.limit.value == 2500.0 / 5000.0
    assert "↳ within this machine's reach: raw read ÷ LMCache's time: 0.50×" in text
    # With every byte hashed the limit would be the read + xxh3, 3500 / 5000 = 0.70x: out of
    # reach.  That case has no goal (LMCache does not hash), only its row and its limit.
    r.update(disk_hit_hashed_us=4500.0, disk_x8_hashed_us=45000.0)
    lmc["ratios"].update(disk_hit_hashed=q(0.9), disk_x8_hashed=q(0.9))
    lmc.update(disk_hit_hashed_us=5000.0, disk_x8_hashed_us=50000.0)
    assert [g.key for g in bench_engine.goals(r)] == list(by_key)
    hashed = [line for line in bench_engine.format_report(r).splitlines()
              if line.startswith("  … every byte hashed again")]  # fmt: skip
    assert "raw read + xxh3  3500.0µs" in hashed[0] and "raw read + xxh3 35000.0µs" in hashed[1]


def test_bench_engine_disk_only_keeps_the_limits_and_the_load_per_case() -> None:
    """``--disk-only``: the disk cases alone, each LMCache goal with its limit line, and the
    load average before → after each case beside its row (the machine's one on the goals)."""

    def q(m: float) -> dict[str, float]:
        return {"median": m, "p25": m, "p75": m}

    r = _engine_result({
        "version": "0.5.6",
        "disk_hit_us": 5000.0, "disk_x8_us": 40000.0,
        "disk_hit_hashed_us": 5000.0, "disk_x8_hashed_us": 40000.0,
        "ratios": {c: q(0.9) for c in bench_engine.LIMITS if c.startswith("disk")},
        "answers_ok": True, "hit_tokens": {}, "disk_metadata_pins_after": 0,
    })  # fmt: skip
    for key in ("cpu_hit_us", "miss_us", "trio_checkpoint_us", "engine_open_ms",
                "cold_first_disk_us", "cold_ratio"):  # fmt: skip
        del r[key]
    r.update(
        disk_hit_hashed_us=4500.0, disk_x8_hashed_us=45000.0, cpus=2, load_avg=1.5,
        load_avg_before=0.25,
        load_avg_per_case={c: [0.5, 1.25] for c, _ in bench_engine.DISK_CASES},
    )
    by_key = {g.key: g for g in bench_engine.goals(r)}
    assert list(by_key) == ["disk_hit_vs_lmcache", "disk_x8_vs_lmcache"]
    assert by_key["disk_x8_vs_lmcache"].limit == Limit(
        "raw read ÷ LMCache's time", 30000.0 / 40000.0
    )
    assert by_key["disk_x8_vs_lmcache"].load_avg == 1.5
    text = bench_engine.format_report(r)
    assert "CPU hit" not in text and "fresh engine" not in text
    assert text.count("0.5→1.2") == len(bench_engine.DISK_CASES)
    assert "goals (this run; load average 1.5 on 2 CPUs, 0.2 before the run)" in text
    assert text.count("✗ MISSED") == 2
    assert "↳ within this machine's reach: raw read ÷ LMCache's time: 0.50×" in text
    assert "↳ out of reach on this machine: raw read ÷ LMCache's time: 0.75×" in text


def test_a_real_run_measures_each_limit_and_the_load() -> None:
    """``lmprefetch bench`` (tiny) measures the limits its goals cite in the same run."""
    cli = [sys.executable, "-m", "lmprefetch", "bench"]
    small = [
        *("--conversations", "4", "--turns", "2", "--repeats", "1", "--miss-lookups", "400"),
        *("--rtt-samples", "50", "--cancel-samples", "3", "--chunk-bytes", "65536"),
        *("--cpu-bytes", str(4 << 20), "--json"),
    ]
    out = subprocess.run(
        [*cli, *small], capture_output=True, text=True, timeout=600, check=False
    )
    assert out.returncode == 0, out.stdout + out.stderr
    r = json.loads(out.stdout)
    for key in ("raw_echo_per_s", "floor_submit_us", "floor_poll_us", "thread_hop_ms_p99",
                "thread_hop_ms_max"):  # fmt: skip
        assert r[key] > 0, key
    assert r["disk_probe"]["raw_vs_verified_read"] > 0
    assert r["disk_probe"]["held_vs_verified_read"] > 0
    assert r["cpus"] >= 1
    assert set(r["load_avg"]) == {"transport", "scheduler", "replay", "disk", "cancel"}
    by_key = {g["key"]: g for g in r["goals"]}
    for key, goal in by_key.items():
        assert goal["limit"] is not None and goal["limit"]["value"] > 0, key
        assert (goal["why_missed"] is None) == goal["met"], key


def test_the_disk_figure_is_the_median_of_the_rounds_ratios() -> None:
    from lmprefetch.bench.system import summarize_disk_probe

    def probe(prefetch: list[float], verified: list[float]) -> dict[str, Any]:
        return {
            "concurrency": 8, "chunks_per_lookup": 16, "prefetch_gbps": prefetch,
            "verified_read_gbps": verified, "raw_read_gbps": [2 * v for v in verified],
            "held_read_gbps": [1.5 * v for v in verified], "reads_trusted": 5, "reads_hashed": 1,
        }  # fmt: skip

    # Round by round: the load of one round hits both sides of it, so the ratio is per round.
    s = summarize_disk_probe([probe([1.0, 4.0, 2.0], [2.0, 4.0, 1.0]), probe([3.0], [1.0])])
    assert s["vs_verified_read"] == 1.5  # median of 0.5, 1, 2, 3
    assert s["vs_raw_read"] == 0.75
    assert s["raw_vs_verified_read"] == 2.0  # a plain read into one reused buffer
    # the ratio's limit: a plain read into a buffer per chunk, as a lookup holds them
    assert s["held_vs_verified_read"] == 1.5
    assert s["held_read_gbps"] == 1.5 * (2.0 + 1.0)
    r = _system_result(disk_probe=s)
    limit = next(g for g in goals(r) if g.key == "disk_prefetch_vs_verified_read").limit
    assert limit is not None and limit.value == 1.5
    assert s["prefetch_gbps"] == 2.0 + 3.0  # each worker's median, summed
    assert s["verified_read_gbps"] == 2.0 + 1.0
    assert (s["workers"], s["rounds"], s["reads_trusted"], s["reads_hashed"]) == (2, 3, 10, 2)
    assert summarize_disk_probe([{}, {}]) == {}  # no disk tier: no figure
    r = _system_result(disk_probe={})
    assert math.isnan(next(g for g in goals(r) if g.key == "disk_prefetch_vs_verified_read").value)


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_progress_bar_moves_through_every_phase_and_is_erased() -> None:
    """It sat at "start 100 %" for seconds while the run went on: one bar for the whole run,
    each phase its share, each step moving it; erased at the end whatever the end."""
    from lmprefetch.bench.measure import Progress
    from lmprefetch.bench.system import PHASES

    out = _Terminal()
    seen = []
    with Progress(PHASES, enabled=True, stream=out) as progress:
        for name in PHASES:
            progress.phase(name, f"phase {name}", steps=4)
            seen.append(progress.fraction)
            for _ in range(4):
                progress.step()
                seen.append(progress.fraction)
        assert progress.fraction == pytest.approx(1.0)
    assert seen == sorted(seen) and len(set(seen)) == len(seen) - (len(PHASES) - 1)
    text = out.getvalue()
    for name in PHASES:  # each phase was drawn, with its label
        assert f"phase {name}" in text
    assert text.endswith("\r\x1b[2K")  # erased
    line = Progress(PHASES, enabled=True, stream=_Terminal()).line(40)
    assert len(line) < 40
    # Not a terminal (a pipe, --json): nothing is drawn.
    piped = io.StringIO()
    with Progress(PHASES, enabled=True, stream=piped) as quiet:
        quiet.phase("start", "x", steps=1)
        quiet.step()
    assert piped.getvalue() == ""
