"""Repeated runs of bench-serve's six Redis link scenarios, for docs/benchmarks.md.

Runs ``lmprefetch bench-serve --quick --in-order --side-by-side`` N times, alternating the
order of the scenarios (odd runs: slow then fast, always, recompute, cost; even runs: the
reverse, so that no policy always goes first or last), prints the load average
before and after each run, and
writes a Markdown table (one row per run and link: the TTFT p50 of always, recompute and
cost, cost ÷ the better of the other two, and the cost policy's decisions) to
``OUT/table.md``, beside each run's ``--json`` and text report.  The goal (issue 31): cost ÷
better ≤ 1.1 in every run, on both links::

    python tools/link_runs.py --runs 5 --out link-runs -- --model random

Side by side (the default): the three policies of a link share one measured server, each
request naming its policy, and each round's questions go to every policy in turn, so every
policy runs at one process's pace and what the machine does over minutes falls on all three
alike.  One server per policy, one after the other (``--one-at-a-time``, bench-serve's
default), two servers doing identical work differed by up to ±20 % on the 2-vCPU machine of
docs/benchmarks.md, each keeping its pace from its first question to its last; started at once
and sent every question in turn, still by 5-15 %.

Run it with the Python that has vLLM (the servers run under it); bench-serve enters its
private network namespace itself.  Extra arguments after ``--`` go to bench-serve
(``--model random``: the random-weight Llama the link scenarios were sized for).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

LINKS = ("slow", "fast")
POLICIES = (("always", "always"), ("recompute", "recompute"), ("cost", "cost"))
#: The goal: cost's TTFT p50 over the better of always's and recompute's, at most this.
GOAL = 1.1


def scenario_order(run: int) -> list[str]:
    """The scenarios of run ``run`` (from 1), in the order they run."""
    names = [f"{link}_remote_{word}" for link in LINKS for _, word in POLICIES]
    return names if run % 2 else names[::-1]


def _load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} {five:.2f} {fifteen:.2f}"


def bench_serve_argv(
    run: int, json_path: Path, python: str, extra: Sequence[str], *, side_by_side: bool = True
) -> list[str]:
    """The bench-serve command of run ``run`` (from 1)."""
    argv = [
        python, "-m", "lmprefetch", "bench-serve", "--quick", "--in-order", "--no-progress",
        "--scenarios", ",".join(scenario_order(run)), "--json", str(json_path),
    ]  # fmt: skip
    if side_by_side:
        argv.append("--side-by-side")
    return [*argv, *extra]


def run_once(
    run: int, out: Path, python: str, extra: Sequence[str], *, side_by_side: bool = True
) -> tuple[Path, str, str, int, float]:
    """One bench-serve run: its JSON, the load average before and after, its exit status and
    its duration."""
    order = scenario_order(run)
    json_path = out / f"run-{run}.json"
    argv = bench_serve_argv(run, json_path, python, extra, side_by_side=side_by_side)
    before = _load()
    print(f"run {run}: load average {before} before; order {', '.join(order)}", flush=True)
    t0 = time.monotonic()
    with (out / f"run-{run}.txt").open("w") as log:
        status = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, check=False)
    elapsed = time.monotonic() - t0
    after = _load()
    print(f"run {run}: load average {after} after; exit {status.returncode}, {elapsed:.0f} s",
          flush=True)  # fmt: skip
    return json_path, before, after, status.returncode, elapsed


def _p50(summary: dict[str, Any], name: str) -> float:
    entry = summary.get("scenarios", {}).get(name) or {}
    value = entry.get("ttft_p50_ms")
    return math.nan if value is None else float(value)


def _counts(summary: dict[str, Any], name: str) -> str:
    entry = summary.get("scenarios", {}).get(name) or {}
    counts = entry.get("decision_counts")
    if not counts:
        return "-"
    return " / ".join(
        str(counts.get(k, 0)) for k in ("loaded", "truncated", "skipped", "not probed")
    )


def rows(run: int, summary: dict[str, Any], before: str, after: str) -> list[dict[str, Any]]:
    """One row per link of a run's summary (bench-serve's ``--json``)."""
    out = []
    for link in LINKS:
        p50 = {word: _p50(summary, f"{link}_remote_{word}") for _, word in POLICIES}
        others = [p50["always"], p50["recompute"]]
        best = math.nan if any(math.isnan(x) for x in others) else min(others)
        ratio = p50["cost"] / best if best and not math.isnan(best) else math.nan
        out.append(
            {
                "run": run,
                "link": link,
                "load_before": before,
                "load_after": after,
                **p50,
                "ratio": ratio,
                "met": None if math.isnan(ratio) else ratio <= GOAL,
                "decisions": _counts(summary, f"{link}_remote_cost"),
            }
        )
    return out


def _ms(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:,.0f} ms".replace(",", " ")


def table(all_rows: Sequence[dict[str, Any]]) -> str:
    """The Markdown table for docs/benchmarks.md."""
    lines = [
        "| run | link | load average (1, 5, 15 min) before → after | always | recompute | cost "
        "| cost ÷ better | cost's decisions: loaded / truncated / skipped / not probed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in all_rows:
        ratio = "-" if math.isnan(r["ratio"]) else f"{r['ratio']:.2f}"
        mark = {True: "", False: " (**missed**)", None: ""}[r["met"]]
        lines.append(
            f"| {r['run']} | {r['link']} | {r['load_before']} → {r['load_after']} | "
            f"{_ms(r['always'])} | {_ms(r['recompute'])} | {_ms(r['cost'])} | "
            f"{ratio}{mark} | {r['decisions']} |"
        )
    met = [r["met"] for r in all_rows]
    verdict = (
        "met in every run"
        if met and all(m is True for m in met)
        else f"missed or not measured in {sum(1 for m in met if m is not True)} of {len(met)}"
    )
    lines += ["", f"Goal: cost ÷ the better of always and recompute ≤ {GOAL:g}: {verdict}."]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--runs", type=int, default=5, help="runs (default 5)")
    p.add_argument("--out", type=Path, default=Path("link-runs"), help="output directory")
    p.add_argument("--python", default=sys.executable, help="the Python with vLLM")
    p.add_argument(
        "--one-at-a-time",
        action="store_true",
        help="run the scenarios one after the other, not side by side",
    )
    p.add_argument("extra", nargs="*", help="more bench-serve arguments (after --)")
    args = p.parse_args(argv)
    if args.runs < 1:
        print("link_runs: --runs must be at least 1", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    all_rows: list[dict[str, Any]] = []
    status = 0
    for run in range(1, args.runs + 1):
        json_path, before, after, code, _ = run_once(
            run, args.out, args.python, args.extra, side_by_side=not args.one_at_a_time
        )
        status = status or code
        summary = json.loads(json_path.read_text()) if json_path.exists() else {}
        all_rows.extend(rows(run, summary, before, after))
        (args.out / "table.md").write_text(table(all_rows) + "\n")
    print()
    print(table(all_rows))
    print(f"\n(written to {args.out / 'table.md'}; each run's report and JSON beside it)")
    return status


if __name__ == "__main__":
    sys.exit(main())
