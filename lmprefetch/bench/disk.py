"""``lmprefetch bench-disk``: every disk figure that has a goal, alone and beside busy CPUs.

One command for the disk goals, so that they are always taken the same way:

* engine disk hit ÷ LMCache 0.5.6, and 8 concurrent disk lookups ÷ LMCache
  (:func:`lmprefetch.bench.engine.run` with ``disk_only``: one LMCache sample beside each
  lmprefetch sample, the ratio per pair; also with every byte hashed again, for reference);
* ``lmprefetch bench``'s disk prefetch ÷ a verified read of the same files at the same
  concurrency, and cancel of an in-flight disk prefetch → released, p99 and max
  (:func:`lmprefetch.bench.system.run_bench`, with a small workload);

* the phase budget of one disk hit and of eight concurrent ones, against the physical floor
  measured in the same run: engine disk hit ÷ the same chunk files read plainly by the faster
  of one or two threads, 8 concurrent lookups ÷ 8 plainly reading threads, and where the time
  goes (:mod:`lmprefetch.bench.disk_budget`: system calls, hashing, codec, read threads,
  the probe, Trio's run time, limiter waits, thread hand-offs);

each under two conditions: *alone* (nothing started beside it: on a quiet machine, the machine
to itself) and *burners* (``--burners`` CPU-bound processes, two by default, running beside the
whole measurement, so that both sides of every ratio meet them alike).  A run measures both
conditions, in alternating order from run to run; the figure printed is the median over
``--runs`` runs, with its range.  Beside each figure: the 1-minute load average at the start
and end of its measurements, and the mean number of runnable tasks sampled from ``/proc/stat``
meanwhile (the load average lags by a minute; the run queue does not).  Under a missed goal, as
in the other benchmarks, whether this machine could have met it: the goal's limit (:data:`LIMITS`),
measured in the same runs beside the figure, median over the runs.

LMCache is measured in this process when it can be imported (``--lmcache auto``), one
:class:`~lmprefetch.bench.lmcache_peer.LMCachePeer` for the whole command; run the command with
the Python of an environment that has ``lmcache==0.5.6`` (and lmprefetch importable) to get
its figures.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import multiprocessing as mp
import os
import statistics
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from typing import Any, Literal

from .. import _stopping
from .goals import Goal, Limit
from .processes import child_main, start_process, stop_processes
from .workload import BenchOptions, int_at_least

__all__ = ["add_arguments", "main", "run", "summarize"]

MiB = 1024 * 1024
#: ``alone``: nothing started beside the benchmark (a quiet machine, if nothing else runs);
#: ``burners``: ``--burners`` CPU-bound processes beside it.
CONDITIONS = ("alone", "burners")


@child_main
def _burn() -> None:  # pragma: no cover - runs in a child process until terminated
    while True:
        pass


@contextlib.contextmanager
def burners(n: int) -> Iterator[None]:
    """``n`` CPU-bound processes (a Python busy loop each) while the block runs."""
    ctx = mp.get_context("spawn")
    procs: list[BaseProcess] = []
    try:
        for _ in range(n):
            start_process(ctx, _burn, (), procs)
        yield
    finally:
        stop_processes(procs, grace_s=0.0)


class RunQueue:
    """Samples the number of runnable tasks (``procs_running`` in ``/proc/stat``, minus the
    sampling thread itself) every ``interval_s`` while open; :attr:`mean` afterwards (NaN
    where ``/proc/stat`` cannot be read)."""

    def __init__(self, interval_s: float = 0.1) -> None:
        self.interval_s = interval_s
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                with open("/proc/stat") as f:
                    for line in f:
                        if line.startswith("procs_running "):
                            self.samples.append(max(0, int(line.split()[1]) - 1))
                            break
            except OSError:
                return

    def __enter__(self) -> RunQueue:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def mean(self) -> float:
        return statistics.fmean(self.samples) if self.samples else math.nan


@dataclass
class Load:
    """The load during one measurement: 1-minute load average at its start and end, and the
    mean run queue."""

    start: float
    end: float = math.nan
    runnable: float = math.nan

    def text(self) -> str:
        return f"load {self.start:.1f}→{self.end:.1f}, run queue {self.runnable:.1f}"


@contextlib.contextmanager
def measured_load() -> Iterator[Load]:
    load = Load(os.getloadavg()[0])
    with RunQueue() as queue:
        yield load
    load.end = os.getloadavg()[0]
    load.runnable = queue.mean


#: The figures with a goal: key, label, goal operator, target, unit.
FIGURES: tuple[tuple[str, str, Literal["<=", ">="], float, str], ...] = (
    ("disk_hit_vs_floor", "engine disk hit ÷ the floor (faster of 1 or 2 plain reading threads)",
     "<=", 1.15, "×"),
    ("disk_x8_vs_floor", "8 concurrent disk lookups ÷ the same files read by 8 plain threads",
     "<=", 1.15, "×"),
    ("disk_hit_vs_lmcache", "engine disk hit ÷ LMCache", "<=", 0.6, "×"),
    ("disk_x8_vs_lmcache", "8 concurrent disk lookups ÷ LMCache", "<=", 0.6, "×"),
    ("disk_prefetch_vs_verified_read",
     "bench: disk prefetch ÷ verified read, same files, same concurrency", ">=", 0.8, "×"),
    ("cancel_release_ms_p99", "cancel of an in-flight disk prefetch → released, p99", "<=", 1.0,
     "ms"),
)  # fmt: skip
#: What bounds each goal's figure on this machine, measured beside it in the same run (see
#: :class:`~lmprefetch.bench.goals.Limit`).  A file verified once and unchanged since is read
#: without hashing it again, so the disk figures' limit is the plain read of the same files.
LIMITS = {
    "disk_hit_vs_floor": "plain reads into distinct slots (as a load must put them) ÷ the floor",
    "disk_x8_vs_floor": "plain reads into distinct slots (as a load must put them) ÷ the floor",
    "disk_hit_vs_lmcache": "raw read of the same files ÷ LMCache's time",
    "disk_x8_vs_lmcache": "raw read of the same files ÷ LMCache's time",
    "disk_prefetch_vs_verified_read":
        "a plain read of the same files into a buffer per chunk (as a lookup holds them), "
        "same concurrency, ÷ the verified read",
    "cancel_release_ms_p99": "the p99 of bare hops to a worker thread and back, same workers",
}  # fmt: skip
#: Figures printed for reference beside them (no goal).
REFERENCE: tuple[tuple[str, str, str], ...] = (
    ("disk_hit_vs_distinct", "… engine disk hit ÷ plain reads into distinct slots", "×"),
    ("disk_x8_vs_distinct", "… 8 concurrent ÷ 8 threads' plain reads into distinct slots", "×"),
    (
        "disk_hit_vs_design_floor",
        "… engine disk hit ÷ a Trio task whose one thread hop reads the same into distinct slots",
        "×",
    ),
    ("disk_hit_trio_cpu_us", "… engine disk hit: the Trio thread's CPU time", "µs"),
    ("disk_hit_hashed_vs_lmcache", "… engine disk hit, every byte hashed again, ÷ LMCache", "×"),
    ("disk_x8_hashed_vs_lmcache", "… 8 concurrent, every byte hashed again, ÷ LMCache", "×"),
    ("disk_hit_cpu_vs_lmcache", "… engine disk hit, CPU time ÷ LMCache's", "×"),
    ("disk_prefetch_vs_raw_read", "… bench: disk prefetch ÷ plain read (no hash)", "×"),
    ("cancel_release_ms_max", "… cancel → released, max", "ms"),
    ("disk_hit_us", "… engine disk hit (lmprefetch)", "µs"),
    ("lmcache_disk_hit_us", "… engine disk hit (LMCache)", "µs"),
)


@dataclass
class Sample:
    """One condition of one run: its figures, the load beside each, and the limits of those
    with a goal (:data:`LIMITS`)."""

    condition: str
    run: int
    figures: dict[str, float] = field(default_factory=dict)
    loads: dict[str, Load] = field(default_factory=dict)
    limits: dict[str, float] = field(default_factory=dict)
    ok: bool = True
    raw: dict[str, Any] = field(default_factory=dict)


def _engine_figures(r: dict[str, Any], load: Load, sample: Sample) -> None:
    from .engine import LIMITS as ENGINE_LIMITS

    lmc = r.get("lmcache")
    engine_keys = ("disk_hit_us",)
    for key in engine_keys:
        sample.figures[key] = r[key]
        sample.loads[key] = load
    if lmc:
        for case in ("disk_hit", "disk_x8", "disk_hit_hashed", "disk_x8_hashed"):
            key = f"{case}_vs_lmcache"
            sample.figures[key] = lmc["ratios"][case]["median"]
            avg = r["load_avg_per_case"][case]
            sample.loads[key] = Load(avg[0], avg[1], load.runnable)
            if key in LIMITS:
                theirs = lmc[f"{case}_us"]
                limit = r.get(ENGINE_LIMITS[case][1], math.nan)
                sample.limits[key] = limit / theirs if theirs else math.nan
        sample.figures["disk_hit_cpu_vs_lmcache"] = r["disk_hit_cpu_us"] / lmc["disk_hit_cpu_us"]
        sample.loads["disk_hit_cpu_vs_lmcache"] = sample.loads["disk_hit_vs_lmcache"]
        sample.figures["lmcache_disk_hit_us"] = lmc["disk_hit_us"]
        sample.loads["lmcache_disk_hit_us"] = sample.loads["disk_hit_vs_lmcache"]
        sample.ok = sample.ok and bool(lmc["answers_ok"])
    sample.ok = sample.ok and bool(r["idle_after"])


def _system_figures(r: dict[str, Any], load: Load, sample: Sample) -> None:
    probe = r.get("disk_probe") or {}
    sample.figures["disk_prefetch_vs_verified_read"] = probe.get("vs_verified_read", math.nan)
    sample.figures["disk_prefetch_vs_raw_read"] = probe.get("vs_raw_read", math.nan)
    sample.figures["cancel_release_ms_p99"] = r["cancel_release_ms_p99"]
    sample.figures["cancel_release_ms_max"] = r["cancel_release_ms_max"]
    sample.limits["disk_prefetch_vs_verified_read"] = probe.get(
        "held_vs_verified_read", probe.get("raw_vs_verified_read", math.nan)
    )
    sample.limits["cancel_release_ms_p99"] = r.get("thread_hop_ms_p99", math.nan)
    for key in ("disk_prefetch_vs_verified_read", "disk_prefetch_vs_raw_read",
                "cancel_release_ms_p99", "cancel_release_ms_max"):  # fmt: skip
        sample.loads[key] = load
    sample.ok = sample.ok and bool(r["leak_free"])


def _budget_figures(r: dict[str, Any], load: Load, sample: Sample) -> None:
    for case, name in (("one", "disk_hit"), ("eight", "disk_x8")):
        c = r[case]
        sample.figures[f"{name}_vs_floor"] = c["vs_floor"]
        sample.figures[f"{name}_vs_distinct"] = c["vs_distinct"]
        sample.limits[f"{name}_vs_floor"] = c["distinct_vs_floor"]
        sample.loads[f"{name}_vs_floor"] = sample.loads[f"{name}_vs_distinct"] = load
    one = r["one"]
    sample.figures["disk_hit_vs_design_floor"] = one["vs_design_floor"]
    sample.figures["disk_hit_trio_cpu_us"] = one["trio_cpu_s"] * 1e6
    sample.loads["disk_hit_vs_design_floor"] = sample.loads["disk_hit_trio_cpu_us"] = load
    sample.ok = sample.ok and bool(r["idle_after"])


def system_options(quick: bool) -> BenchOptions:
    """The ``lmprefetch bench`` run of each condition: the default chat workload replayed
    once, fewer round-trip samples (not disk figures), the disk and cancel probes as usual."""
    if quick:
        return BenchOptions(
            conversations=8, turns=2, repeats=1, miss_lookups=400, rtt_samples=50,
            cancel_samples=20, disk_probe_rounds=2, chunk_bytes=256 * 1024, cpu_bytes=16 * MiB,
            progress=False,
        )  # fmt: skip
    return BenchOptions(repeats=1, miss_lookups=2000, rtt_samples=200, progress=False)


def _engine_and_system(
    sample: Sample, chunks: int, chunk_bytes: int, repeats: int, peer: Any, quick: bool
) -> None:
    """The engine's disk cases (against LMCache where ``peer`` is one) and ``lmprefetch
    bench``'s disk and cancel probes, into ``sample``."""
    from . import engine as bench_engine
    from .system import run_bench

    with measured_load() as load:
        r = bench_engine.run(
            chunks, chunk_bytes, repeats, lmcache="off" if peer is None else "on",
            disk_only=True, peer=peer,
        )  # fmt: skip
    _engine_figures(r, load, sample)
    sample.raw["engine"] = r
    with measured_load() as load:
        s = run_bench(system_options(quick))
    _system_figures(s, load, sample)
    s["replay"] = {k: v for k, v in s["replay"].items() if k != "latencies_ms"}
    sample.raw["system"] = s


def run(
    runs: int = 3,
    repeats: int = 30,
    n_burners: int = 2,
    *,
    lmcache: str = "auto",
    quick: bool = False,
    log: Any = None,
    budget_only: bool = False,
) -> dict[str, Any]:
    """Measure every condition ``runs`` times (see the module docstring); the samples and
    :func:`summarize`'s summary.  ``budget_only``: only the phase budget and its floors."""
    from . import disk_budget
    from . import engine as bench_engine
    from .lmcache_peer import LMCachePeer, lmcache_available

    chunks, chunk_bytes = (4, 256 * 1024) if quick else (16, 2 * MiB)
    use_peer = not budget_only and lmcache != "off" and lmcache_available()
    if lmcache == "on" and not use_peer:
        raise ValueError("--lmcache on: lmcache is not importable (pip install lmcache==0.5.6)")
    samples: list[Sample] = []
    t0 = time.monotonic()
    with contextlib.ExitStack() as stack:
        size = bench_engine.arena_bytes(chunks, chunk_bytes)
        peer = (
            _stopping.enter(stack, lambda: LMCachePeer(chunks, chunk_bytes, size))
            if use_peer
            else None
        )
        for i in range(runs):
            order = CONDITIONS if i % 2 == 0 else CONDITIONS[::-1]
            for condition in order:
                sample = Sample(condition, i)
                with burners(n_burners if condition == "burners" else 0):
                    with measured_load() as load:
                        b = disk_budget.measure(chunks, chunk_bytes, repeats, max(3, repeats // 5))
                    _budget_figures(b, load, sample)
                    sample.raw["budget"] = b
                    if not budget_only:
                        _engine_and_system(sample, chunks, chunk_bytes, repeats, peer, quick)
                samples.append(sample)
                if log is not None:
                    log(f"run {i + 1}/{runs} {condition}: "
                        + ", ".join(f"{k} {v:.3g}" for k, v in sample.figures.items())
                        + f" ({time.monotonic() - t0:.0f} s)")
    return {
        "runs": runs,
        "repeats": repeats,
        "burners": n_burners,
        "chunks": chunks,
        "chunk_bytes": chunk_bytes,
        "lmcache": peer is not None,
        "cpus": os.cpu_count() or 0,
        "seconds": time.monotonic() - t0,
        "summary": summarize(samples),
        "ok": all(s.ok for s in samples),
        "samples": [
            {
                "condition": s.condition, "run": s.run, "figures": s.figures, "ok": s.ok,
                "loads": {k: vars(v) for k, v in s.loads.items()}, "limits": s.limits,
                "raw": s.raw,
            }
            for s in samples
        ],
    }  # fmt: skip


def summarize(samples: list[Sample]) -> dict[str, dict[str, Any]]:
    """Per condition and figure: the median over the runs, its range, and the load range of
    the measurements (lowest start or end load average, highest; mean run queue range); for a
    figure with a limit, ``limit``: the median of the limits measured beside it (NaN if none
    was)."""
    out: dict[str, dict[str, Any]] = {}
    for condition in CONDITIONS:
        mine = [s for s in samples if s.condition == condition]
        figures: dict[str, Any] = {}
        for key in dict.fromkeys(k for s in mine for k in s.figures):
            values = [s.figures[key] for s in mine if key in s.figures]
            values = [v for v in values if not math.isnan(v)]
            loads = [s.loads[key] for s in mine if key in s.loads]
            averages = [x for ld in loads for x in (ld.start, ld.end)]
            figures[key] = {
                "median": statistics.median(values) if values else math.nan,
                "min": min(values, default=math.nan),
                "max": max(values, default=math.nan),
                "n": len(values),
                "load_avg": [min(averages, default=math.nan), max(averages, default=math.nan)],
                "run_queue": [min((ld.runnable for ld in loads), default=math.nan),
                              max((ld.runnable for ld in loads), default=math.nan)],
            }  # fmt: skip
            limits = [s.limits[key] for s in mine if key in s.limits]
            if limits:
                limits = [x for x in limits if not math.isnan(x)]
                figures[key]["limit"] = statistics.median(limits) if limits else math.nan
        if mine:
            out[condition] = figures
    return out


def goals(r: dict[str, Any]) -> list[Goal]:
    """The goal of every figure under every condition (the medians over the runs), each with
    its limit from the same runs (:data:`LIMITS`) and the highest load average taken with it."""
    out = []
    for condition, figures in r["summary"].items():
        for key, label, op, target, unit in FIGURES:
            if key in figures:
                f = figures[key]
                limit = Limit(LIMITS[key], f["limit"]) if "limit" in f else None
                out.append(Goal(f"{key}:{condition}", f"{label} ({condition})", f["median"], op,
                                target, unit, limit=limit, load_avg=f["load_avg"][1],
                                cpus=r.get("cpus", 0)))
    return out


def _num(x: float) -> str:
    if math.isnan(x):
        return "n/a"
    return f"{x:.3g}" if abs(x) < 1000 else f"{x:.0f}"


def format_report(r: dict[str, Any]) -> str:
    from . import disk_budget

    lines = [
        f"lmprefetch bench-disk — {r['runs']} runs × ({', '.join(CONDITIONS)}: "
        f"{r['burners']} CPU-bound processes beside the benchmark), {r['chunks']} chunks × "
        f"{r['chunk_bytes'] / MiB:g} MiB per lookup; medians over the runs (min–max); "
        f"{r['seconds']:.0f} s",
    ]
    if not r["lmcache"]:
        lines.append("  LMCache is not importable here: no LMCache figure (run with the Python "
                     "of an environment with lmcache==0.5.6)")
    rows = [(k, label, unit, goal) for k, label, _, _, unit in FIGURES
            for goal in [True]] + [(k, label, unit, False) for k, label, unit in REFERENCE]
    summary = r["summary"]
    by_key = {g.key: g for g in goals(r)}
    for condition in CONDITIONS:
        if condition not in summary:
            continue
        lines += ["", f"  {condition}:"]
        for key, label, unit, has_goal in rows:
            f = summary[condition].get(key)
            if f is None:
                continue
            spread = f"({_num(f['min'])}–{_num(f['max'])})"
            text = f"    {label:<68} {_num(f['median']):>6}{unit:<2} {spread:<15}"
            if has_goal:
                g = by_key[f"{key}:{condition}"]
                text += f" goal {g.goal_text():<8} {g.mark():<9}"
            else:
                text += " " * 24
            text += (f"  load avg {f['load_avg'][0]:.1f}–{f['load_avg'][1]:.1f}, run queue "
                     f"{f['run_queue'][0]:.1f}–{f['run_queue'][1]:.1f}")
            lines.append(text)
            if has_goal:
                lines += [f"  {x}" for x in by_key[f"{key}:{condition}"].lines()[1:]]
    for condition in CONDITIONS:
        first = next((s for s in r.get("samples", ()) if s["condition"] == condition
                      and "budget" in s["raw"]), None)  # fmt: skip
        if first is not None:
            lines += ["", f"  {condition}, run {first['run'] + 1}'s "
                      + disk_budget.format_budget(first["raw"]["budget"]).lstrip()]
    lines += ["", f"  leak checks and LMCache's answers: {'OK' if r['ok'] else 'FAILED'}"]
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--runs", type=int_at_least(1), default=3,
                   help="runs, each measuring every condition (default: 3)")
    p.add_argument("--repeats", type=int_at_least(1), default=30,
                   help="engine lookups per case per run (default: 30)")
    p.add_argument("--burners", type=int_at_least(1), default=2,
                   help="CPU-bound processes of the busy condition (default: 2)")
    p.add_argument("--lmcache", choices=["auto", "on", "off"], default="auto",
                   help="measure LMCache 0.5.6 in this process: auto (when importable), on "
                   "(required), off (default: auto)")
    p.add_argument("--budget-only", action="store_true",
                   help="only the phase budget of a disk hit and its floors, alone and beside "
                   "the burners (a minute, not LMCache's figures nor lmprefetch bench's)")
    p.add_argument("--quick", action="store_true",
                   help="small chunks and a small workload: checks that it runs, no figures")
    p.add_argument("--json", metavar="FILE",
                   help="also write every sample and the summary as JSON to FILE ('-': print "
                   "the JSON instead of the table)")


def main(args: argparse.Namespace) -> int:
    import sys

    def log(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    r = run(args.runs, args.repeats, args.burners, lmcache=args.lmcache, quick=args.quick,
            log=log, budget_only=args.budget_only)
    r["goals"] = [g.as_dict() for g in goals(r)]
    if args.json == "-":
        print(json.dumps(r, indent=2, default=str))
    else:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(r, f, indent=2, default=str)
        print(format_report(r))
    return 0 if r["ok"] else 1
