"""The report of ``lmprefetch bench``: the goals, the text table and the plot.

Every figure with a goal is printed with it and marked ``✓`` or ``✗ MISSED`` (see
:class:`~lmprefetch.bench.goals.Goal`); ``--json`` carries the same list under ``goals``.  The
disk figures compare with the same baseline everywhere, text and plot: a plain read of the same
files *plus* the xxh3 check a verified read must make, by as many threads as there are lookups,
in the same run (the disk probe, see :func:`~lmprefetch.bench.system.summarize_disk_probe`).
"""

from __future__ import annotations

import math
import os
import textwrap
from typing import Any, Literal

from .goals import Goal, Limit, load_text

__all__ = [
    "check_plot",
    "format_report",
    "goals",
    "missed_goals_text",
    "plot",
    "throughput_bars",
    "wrap",
]


def _disk_ratio(r: dict[str, Any]) -> float:
    """Disk prefetch ÷ the verified read of the same files at the same concurrency."""
    return float(r.get("disk_probe", {}).get("vs_verified_read", math.nan))


def _ratio(a: float | None, b: float | None) -> float:
    if a is None or b is None or not b or math.isnan(a) or math.isnan(b):
        return math.nan
    return float(a / b)


def goals(r: dict[str, Any]) -> list[Goal]:
    """The goals of a :func:`~lmprefetch.bench.system.run_bench` result, each with the limit
    the same run measured for it (see :class:`~lmprefetch.bench.goals.Limit`) and the load
    average taken with its figure."""
    load = r.get("load_avg", {})
    machine = {"cpus": r.get("cpus", 0), "load_avg_before": r.get("load_avg_before", math.nan)}

    def goal(
        key: str,
        label: str,
        op: Literal["<=", ">="],
        target: float,
        unit: str,
        phase: str,
        limit: Limit | None,
        value: float | None = None,
    ) -> Goal:
        return Goal(
            key,
            label,
            r[key] if value is None else value,
            op,
            target,
            unit,
            limit=limit,
            load_avg=load.get(phase, math.nan),
            **machine,
        )

    return [
        goal(
            "miss_rtt_ratio",
            "full-miss round trip ÷ raw pyzmq round trip",
            "<=", 1.5, "×", "transport",
            Limit(
                "the same echo on Trio-native sockets ÷ raw pyzmq",
                _ratio(r.get("trio_echo_rtt_us"), r["raw_rtt_us"]),
            ),
        ),
        goal(
            "first_lookup_ratio",
            "first lookup after a worker starts ÷ a later one",
            "<=", 2.0, "×", "transport",
            Limit(
                "a raw pyzmq echo's first round trip on a new connection ÷ a later one",
                _ratio(r.get("raw_rtt_first_us"), r["raw_rtt_us"]),
            ),
        ),
        goal(
            "submit_us",
            "scheduler submit (128 chunks)",
            "<=", 50.0, "µs", "scheduler",
            Limit(
                "a bare submit in Python (a lock, a dict insert, a queue append)",
                r.get("floor_submit_us", math.nan),
            ),
        ),
        goal(
            "poll_us",
            "scheduler pending poll",
            "<=", 1.0, "µs", "scheduler",
            Limit(
                "a bare poll in Python (a method call, a dict lookup, a clock read)",
                r.get("floor_poll_us", math.nan),
            ),
        ),
        goal(
            "miss_lookups_per_s_per_worker",
            "full-miss lookups per worker",
            ">=", 20_000.0, "/s", "transport",
            Limit(
                "messages a raw pyzmq echo process returns, pipelined the same way",
                r.get("raw_echo_per_s", math.nan),
            ),
        ),
        goal(
            "disk_prefetch_vs_verified_read",
            "disk prefetch ÷ verified read, same files, same concurrency",
            ">=", 0.8, "×", "disk",
            # The ratio is to the verified read, but a file verified once and unchanged since
            # is read without hashing it again, and a lookup holds each chunk in a buffer of
            # its own: the plain read of the same files into such buffers is its limit.
            Limit(
                "a plain read of the same files into a buffer per chunk (as a lookup holds "
                "them), same concurrency, ÷ the verified read",
                r.get("disk_probe", {}).get(
                    "held_vs_verified_read",
                    r.get("disk_probe", {}).get("raw_vs_verified_read", math.nan),
                ),
            ),
            value=_disk_ratio(r),
        ),
        goal(
            "cancel_release_ms_p99",
            f"cancel in-flight disk prefetch → released, p99 of {r['cancel_samples']}",
            "<=", 1.0, "ms", "cancel",
            Limit(
                "the p99 of bare hops to a worker thread and back, same workers",
                r.get("thread_hop_ms_p99", math.nan),
            ),
        ),
    ]  # fmt: skip


def format_report(r: dict[str, Any]) -> str:
    rep = r["replay"]
    lines = [
        "lmprefetch bench — synthetic multi-turn chat, "
        f"{r['options']['workers']} workers over {r['options']['transport']}, CPU + disk tiers",
        "",
        f"  lookup round trip (full miss)   {r['miss_rtt_us']:9.1f} µs   raw pyzmq round trip "
        f"{r['raw_rtt_us']:.1f} µs   ratio {r['miss_rtt_ratio']:.2f}×",
        "    where it goes (medians, same run): raw pyzmq echo "
        f"{r['raw_rtt_us']:.1f} µs → the same echo on Trio-native sockets "
        f"{r['trio_echo_rtt_us']:.1f} µs → the lmprefetch worker, blocking pyzmq client "
        f"{r['worker_rtt_us']:.1f} µs → through LookupClient {r['miss_rtt_us']:.1f} µs "
        f"(a thread blocked in wait() wakes after {r['miss_rtt_woken_us']:.1f} µs)",
        f"  first lookup after a worker starts {r['first_lookup_us']:9.1f} µs "
        f"(a later one {r['miss_rtt_us']:.1f} µs; a raw pyzmq echo's first round trip on a "
        f"new connection {r['raw_rtt_first_us']:.1f} µs, "
        f"{r['raw_rtt_first_us'] / r['raw_rtt_us']:.1f}× its later ones)",
        f"  scheduler submit (128 chunks)   {r['submit_us']:9.2f} µs   (LMCache sleeps 10 000 µs)",
        f"  scheduler pending poll          {r['poll_us']:9.3f} µs   (LMCache sleeps 10 000 µs)",
        f"  full-miss lookups per worker    {r['miss_lookups_per_s_per_worker']:9.0f} /s",
        f"  chat replay: {rep['lookups']} lookups, {r['options']['concurrency']} in flight, "
        f"{rep['aborted']} aborted",
        f"    lookup latency p50 / p99      {rep['latency_p50_ms']:9.3f} / "
        f"{rep['latency_p99_ms']:.3f} ms",
        f"    hit ratio                     {rep['hit_ratio']:9.1%}",
    ]
    for name, gbps in r["tier_gbps"].items():
        moved = r["tier_bytes_loaded"][name] / 1e6
        if name == "cpu":
            lines.append(f"    prefetch from cpu             zero-copy ({moved:.0f} MB handed out)")
        elif gbps is not None:
            lines.append(
                f"    prefetch from {name:<15} {gbps:9.2f} GB/s ({moved:.0f} MB, while its loads "
                "were in flight)"
            )
    probe = r.get("disk_probe") or {}
    if probe:
        lines += [
            f"  disk prefetch, {probe['workers']} workers × {probe['concurrency_per_worker']} "
            f"lookups of {probe['chunks_per_lookup']} chunks at once, {probe['rounds']} "
            "alternating rounds per worker:",
            f"    lookups {probe['prefetch_gbps']:.2f} GB/s   the same files read by as many "
            f"threads, preadv + xxh3 {probe['verified_read_gbps']:.2f} GB/s (preadv alone "
            f"{probe['raw_read_gbps']:.2f}; preadv into a buffer per chunk, as a lookup holds "
            f"them, {probe.get('held_read_gbps', math.nan):.2f})",
            f"    ratio (median of the rounds' ratios) {probe['vs_verified_read']:.2f}× the "
            f"verified read, {probe['vs_raw_read']:.2f}× the plain read; the lookups' reads: "
            f"{probe['reads_trusted']} of files unchanged since verified (unhashed), "
            f"{probe['reads_hashed']} hashed",
        ]
    lines += [
        f"  cancel in-flight disk prefetch → released ({r['cancel_samples']} cancels)   "
        f"p50 {r['cancel_release_ms_p50']:.3f} ms, p99 {r['cancel_release_ms_p99']:.3f} ms, "
        f"max {r['cancel_release_ms_max']:.3f} ms",
        f"  leak check: {'OK' if r['leak_free'] else 'LEAK'} — "
        + ", ".join(
            f"rank {w['rank']}: pinned {w['pinned_chunks']}, held {w['held_lookups']}, "
            f"limiter {w['limiter_used']}"
            for w in r["workers"]
        ),
        "",
        f"  goals (this run; {_machine_text(r)}):",
    ]
    marked = goals(r)
    for g in marked:
        lines += g.lines(58)
    lines += ["", *missed_goals_text(marked)]
    return "\n".join(line for text in lines for line in wrap(text))


#: The widest line a report prints (a long line is wrapped under its own indentation).
WIDTH = 100


def wrap(line: str, width: int = WIDTH) -> list[str]:
    """``line`` as lines of at most ``width`` columns, each continuation indented two columns
    past the line's own indentation (an empty line stays one empty line)."""
    if len(line) <= width:
        return [line]
    indent = " " * (len(line) - len(line.lstrip()) + 2)
    return textwrap.wrap(line, width, subsequent_indent=indent, break_on_hyphens=False)


def missed_goals_text(marked: list[Goal]) -> list[str]:
    """What the goal marks mean, under the goals: how many were missed, that a miss is not an
    error, and where to read more."""
    missed = sum(not g.met for g in marked)
    count = f"{missed} of {len(marked)} goals missed." if missed else "Every goal met."
    text = (
        count + " A goal is what lmprefetch aims for on a quiet machine; a missed goal is not an "
        "error (the exit status reports the leak check only), and the line under it says "
        "whether this machine could have met it: the same thing measured on something that "
        "does strictly less (its limit), in this run. How to read each figure, and a quiet "
        "machine's: docs/benchmarks.md (the Benchmarks page of the documentation)."
    )
    return textwrap.wrap(text, WIDTH, initial_indent="  ", subsequent_indent="  ")


def _machine_text(r: dict[str, Any]) -> str:
    """The CPUs and the 1-minute load average before and during the run."""
    during = [x for x in r.get("load_avg", {}).values() if not math.isnan(x)]
    text = load_text(r.get("load_avg_before", math.nan), r.get("cpus", 0)) + " before the run"
    if during:
        low, high = min(during), max(during)
        text += f", {low:.1f}" + (f"–{high:.1f}" if high - low >= 0.05 else "") + " during it"
    return text


def throughput_bars(r: dict[str, Any]) -> tuple[list[str], list[float]]:
    """The plot's throughput bars: the disk probe's lookups, then the baseline the text's
    ratio uses (a plain read of the same files plus the xxh3 check, same concurrency)."""
    probe = r.get("disk_probe") or {}
    if not probe:
        return [], []
    return (
        ["disk prefetch", "raw read + xxh3"],
        [float(probe["prefetch_gbps"]), float(probe["verified_read_gbps"])],
    )


def check_plot(path: str) -> None:
    """Before a run: ``--plot FILE.png`` can be written (matplotlib is installed, the directory
    exists).  Raises ``ValueError`` (one line, exit 2) naming what to fix."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError(
            "--plot needs matplotlib: python -m pip install 'lmprefetch[plot]'"
        ) from None
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"--plot: {folder} is not a directory")


def plot(r: dict[str, Any], path: str) -> None:
    check_plot(path)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    lat = sorted(r["replay"]["latencies_ms"])
    if lat:
        a.plot(lat, [i / len(lat) for i in range(1, len(lat) + 1)])
    a.set_xscale("log")
    a.set_xlabel("lookup latency (ms)")
    a.set_ylabel("fraction of lookups")
    a.set_title("Chat replay: lookup latency CDF")
    names, values = throughput_bars(r)
    b.bar(names, values)
    b.set_ylabel("GB/s")
    b.set_title("Disk prefetch vs a verified raw read of the same files")
    fig.tight_layout()
    try:
        fig.savefig(path)
    except OSError as exc:
        raise ValueError(f"--plot: cannot write {path} ({exc.strerror or exc})") from None
    finally:
        plt.close(fig)
