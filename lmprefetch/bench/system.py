"""``lmprefetch bench``: the whole system under a synthetic multi-turn chat workload.

What it does, in one run:

1. Starts ``--workers`` worker processes (one per rank), each a :class:`WorkerRuntime` with CPU
   and disk tiers (the disk tier in a temporary directory), serving lookups over ipc.
2. Each rank stores the chunks of the "warm" conversations (their history so far), as a model
   step would after computing them, and waits for its disk write-behind to finish.  The
   workload is larger than the CPU tier, so older chunks are only on disk.
3. Measures, against the same processes and transport:

   * the raw pyzmq round trip to as many echo processes as there are workers (the physical
     limit of the transport), and the full-miss lookup round trip, as a ratio;
   * the scheduler's submit cost (a 128-chunk prompt) and pending-poll cost;
   * full-miss lookups per second per worker (pipelined);
   * the chat replay: concurrent lookups with random aborts; lookup latency p50/p99, hit
     ratio, and per-tier prefetch GB/s while loads were in flight;
   * the disk figure, like with like: in every worker at once, its share of the replay's
     concurrency in disk-only lookups against a verified read (``preadv`` + xxh3) of the very
     same files by as many threads, alternating round by round (:func:`summarize_disk_probe`);
   * cancel of an in-flight disk prefetch → everything released (p50, p99, max);
   * a final leak check: every worker idle, with zero pins, zero held lookups and the
     arena holding exactly the CPU tier.

``--json`` prints the results as JSON; ``--plot FILE.png`` draws latency and throughput.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import multiprocessing as mp
import os
import random
import statistics
import time
from dataclasses import asdict
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from .. import _stopping
from ..client import LookupClient
from ..config import PrefetchConfig
from .measure import (
    TRANSPORT_STEPS,
    Progress,
    endpoint_for,
    free_tcp_endpoint,
    load_avg,
    measure_submit_and_poll,
    measure_transport,
    percentile,
    replay,
)
from .processes import start_process, stop_processes, worker_main
from .report import check_plot, format_report, goals, plot
from .workload import BenchOptions, fraction, int_at_least, make_workload

__all__ = ["BenchOptions", "add_arguments", "main", "run_bench", "summarize_disk_probe"]

# -- the whole run ----------------------------------------------------------------------
def summarize_disk_probe(probes: list[dict[str, Any]]) -> dict[str, Any]:
    """The workers' disk probes (see ``processes._measure_disk``) as one figure: the median
    over every round of every worker of (prefetch GB/s ÷ verified-read GB/s) of that round,
    and the same against the unverified read; GB/s summed over the workers (the medians of
    each).  ``raw_vs_verified_read``, the same median of (plain-read GB/s ÷ verified-read GB/s),
    is what a lookup could reach if it read as fast as a plain read into one reused buffer;
    ``held_vs_verified_read``, the same of (held-read GB/s ÷ verified-read GB/s), is the
    ratio's limit: a file verified once and unchanged since is read without hashing it again,
    and a lookup puts each chunk in a buffer of its own (it holds them until the claim), as the
    held read does."""
    probes = [p for p in probes if p.get("prefetch_gbps")]
    if not probes:
        return {}

    def ratios(base: str) -> list[float]:
        return [
            a / b
            for p in probes
            for a, b in zip(p["prefetch_gbps"], p[base], strict=True)
            if b > 0
        ]

    def total(name: str) -> float:
        return float(sum(statistics.median(p[name]) for p in probes))

    vs_verified, vs_raw = ratios("verified_read_gbps"), ratios("raw_read_gbps")

    def against_verified(name: str) -> list[float]:
        return [
            a / b
            for p in probes
            for a, b in zip(p.get(name, []), p["verified_read_gbps"], strict=False)
            if b > 0
        ]

    raw_vs_verified = against_verified("raw_read_gbps")
    held_vs_verified = against_verified("held_read_gbps")
    return {
        "workers": len(probes),
        "concurrency_per_worker": probes[0]["concurrency"],
        "chunks_per_lookup": probes[0]["chunks_per_lookup"],
        "rounds": len(probes[0]["prefetch_gbps"]),
        "prefetch_gbps": total("prefetch_gbps"),
        "verified_read_gbps": total("verified_read_gbps"),
        "raw_read_gbps": total("raw_read_gbps"),
        "vs_verified_read": statistics.median(vs_verified) if vs_verified else math.nan,
        "vs_raw_read": statistics.median(vs_raw) if vs_raw else math.nan,
        "raw_vs_verified_read": (
            statistics.median(raw_vs_verified) if raw_vs_verified else math.nan
        ),
        "held_read_gbps": total("held_read_gbps") if held_vs_verified else math.nan,
        "held_vs_verified_read": (
            statistics.median(held_vs_verified) if held_vs_verified else math.nan
        ),
        "reads_trusted": sum(p["reads_trusted"] for p in probes),
        "reads_hashed": sum(p["reads_hashed"] for p in probes),
    }


#: The phases of a run with their expected share of its time (as measured on two cores), for
#: the progress bar.
PHASES = {
    "start": 25, "transport": 35, "scheduler": 28, "replay": 4, "disk": 4, "cancel": 2, "leak": 2,
}  # fmt: skip


def run_bench(opts: BenchOptions) -> dict[str, Any]:
    """One run (see the module docstring); the results, as ``--json`` prints them.

    Stopped by a signal (:mod:`lmprefetch._stopping`) at any moment, it stops every process it
    started and removes its temporary directory before the exception leaves it.
    """
    ctx = mp.get_context("spawn")
    rng = random.Random(opts.seed + 1)
    results: dict[str, Any] = {"options": {k: v for k, v in asdict(opts).items()}}
    # The machine's load: before the run (other jobs), and after each measurement (each goal
    # is printed with the one taken with its figure).
    results["cpus"] = os.cpu_count() or 0
    results["load_avg_before"] = load_avg()
    load = results["load_avg"] = {}
    base = PrefetchConfig(
        chunk_size=opts.chunk_size,
        chunk_bytes=opts.chunk_bytes,
        cpu_bytes=opts.cpu_bytes,
        lookup_timeout_s=10.0,
        claim_ttl_s=30.0,
    )
    if opts.transport == "tcp":
        resp = free_tcp_endpoint()
        worker_eps = [free_tcp_endpoint() for _ in range(opts.workers)]
    else:
        resp = endpoint_for(opts, "scheduler")
        worker_eps = [endpoint_for(opts, f"w{r}") for r in range(opts.workers)]
    workload = make_workload(opts)
    procs: list[BaseProcess] = []
    conns: list[Connection] = []
    with contextlib.ExitStack() as stack:
        progress = stack.enter_context(Progress(PHASES, opts.progress))
        progress.phase("start", f"starting {opts.workers} workers, storing the warm chats",
                       steps=opts.workers * len(workload.stored) or 1)  # fmt: skip
        tmp = _stopping.enter(
            stack, lambda: _stopping.temporary_directory(prefix="lmprefetch-bench-")
        )
        stack.callback(_stop_workers, procs, conns)  # before the directory goes
        client = _stopping.enter(stack, lambda: LookupClient(base, worker_eps, resp))
        for r in range(opts.workers):
            cfg = base.replace(disk_path=str(Path(tmp) / f"rank{r}"), disk_bytes=4 << 30)
            parent, child = ctx.Pipe()
            conns.append(parent)
            with child:
                args = (child, cfg.to_dict(), r, opts.workers, worker_eps[r], resp, asdict(opts))
                start_process(ctx, worker_main, args, procs)
        results["workers_ready"] = _wait_ready(conns, progress)
        progress.phase("transport", "round trips: a lookup against a raw pyzmq echo",
                       steps=TRANSPORT_STEPS)  # fmt: skip
        results.update(measure_transport(base, opts, ctx, rng, progress))
        load["transport"] = load_avg()
        progress.phase("scheduler", "the scheduler's submit and poll, against bare Python",
                       steps=2)  # fmt: skip
        results.update(measure_submit_and_poll(base, opts, progress))
        load["scheduler"] = load_avg()
        progress.phase("replay", "chat replay", steps=len(workload.lookups))
        results["replay"] = replay(client, workload, opts, rng, progress)
        load["replay"] = load_avg()
        # The disk figure: every worker at once, each with its share of the replay's
        # concurrency, its loads against a verified read of the same files.
        progress.phase("disk", "disk prefetch against a verified read", steps=len(conns))
        per_worker = max(1, opts.concurrency // opts.workers)
        probes = _ask_all(conns, "disk_probe", (per_worker, opts.disk_probe_rounds), progress)
        results["disk_probe"] = summarize_disk_probe(probes)
        load["disk"] = load_avg()
        progress.phase("cancel", "cancel of in-flight disk prefetches", steps=len(conns))
        probes = _ask_all(conns, "cancel_probe", opts.cancel_samples, progress)
        load["cancel"] = load_avg()
        cancel_samples = sorted(x for p in probes for x in p["released"])
        hops = sorted(x for p in probes for x in p["thread_hop"])
        results["cancel_samples"] = len(cancel_samples)
        results["cancel_release_ms_p50"] = percentile(cancel_samples, 50) * 1e3
        results["cancel_release_ms_p99"] = percentile(cancel_samples, 99) * 1e3
        results["cancel_release_ms_max"] = max(cancel_samples, default=math.nan) * 1e3
        # The cancel goal's limit: a release waits for the reads in flight to come back
        # from their threads, so no release beats a bare hop there and back.
        results["thread_hop_ms_p99"] = percentile(hops, 99) * 1e3
        results["thread_hop_ms_max"] = max(hops, default=math.nan) * 1e3
        # Leak check: every worker idle, nothing pinned or held.
        progress.phase("leak", "leak check", steps=len(conns))
        finals = results["workers"] = _ask_all(conns, "wait_idle", 30.0, progress)
        results["leak_free"] = all(
            f["idle"]
            and f["pinned_chunks"] == 0
            and f["held_lookups"] == 0
            and f["limiter_used"] == 0
            and f["arena_used_bytes"] == f["cpu_resident_bytes"]
            for f in finals
        )
        tiers: dict[str, dict[str, float]] = {}
        for f in finals:
            for name, t in f["tiers"].items():
                agg = tiers.setdefault(name, {"bytes_loaded": 0.0, "busy_seconds": 0.0})
                agg["bytes_loaded"] += t["bytes_loaded"]
                agg["busy_seconds"] += t.get("busy_seconds", 0.0)
        # Throughput while the tier was loading (wall time with at least one load in
        # flight, per worker, summed over workers).
        results["tier_gbps"] = {
            name: (t["bytes_loaded"] / t["busy_seconds"] / 1e9 if t["busy_seconds"] else None)
            for name, t in tiers.items()
        }
        results["tier_bytes_loaded"] = {n: t["bytes_loaded"] for n, t in tiers.items()}
    return results


def _wait_ready(conns: list[Connection], progress: Progress) -> list[dict[str, Any]]:
    """Each worker's ``ready`` message, in rank order, moving ``progress`` by the histories
    the workers report stored meanwhile."""
    ready: dict[int, dict[str, Any]] = {}
    stored = [0] * len(conns)
    deadline = time.monotonic() + 600
    while len(ready) < len(conns):
        waiting = [c for i, c in enumerate(conns) if i not in ready]
        left = deadline - time.monotonic()
        readable = wait(waiting, left) if left > 0 else []
        if not readable:
            raise RuntimeError("a worker did not get ready within 600 s")
        for rank, conn in enumerate(conns):
            if rank in ready or conn not in readable:
                continue
            tag, info = conn.recv()
            if tag == "stored":
                progress.step(info - stored[rank])
                stored[rank] = info
            else:
                ready[rank] = info
    return [ready[r] for r in range(len(conns))]


def _ask_all(conns: list[Connection], command: str, arg: Any, progress: Progress) -> list[Any]:
    """Send ``command`` to every worker at once, then collect their answers in rank order
    (one ``progress`` step each)."""
    for conn in conns:
        conn.send((command, arg))
    answers = []
    for conn in conns:
        answers.append(conn.recv())
        progress.step()
    return answers


def _stop_workers(procs: list[BaseProcess], conns: list[Connection]) -> None:
    """Ask every worker to stop (each flushes and closes its runtime), then end them
    (:func:`stop_processes`: at once after a stop signal)."""
    if _stopping.received() is None:
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.send(("stop", None))
    stop_processes(procs, grace_s=60.0)
    for conn in conns:
        conn.close()


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = BenchOptions()
    p.add_argument(
        "--workers",
        type=int_at_least(1),
        default=d.workers,
        help=f"worker processes, one per rank (default: {d.workers})",
    )
    p.add_argument(
        "--conversations",
        type=int_at_least(1),
        default=d.conversations,
        help=f"chat sessions in the workload (default: {d.conversations})",
    )
    p.add_argument(
        "--turns",
        type=int_at_least(1),
        default=d.turns,
        help=f"turns per session; each turn is one lookup (default: {d.turns})",
    )
    p.add_argument(
        "--repeats",
        type=int_at_least(1),
        default=d.repeats,
        help=f"times the replay is run; figures are over all of them (default: {d.repeats})",
    )
    p.add_argument(
        "--concurrency",
        type=int_at_least(1),
        default=d.concurrency,
        help=f"lookups in flight at once during the replay (default: {d.concurrency})",
    )
    p.add_argument(
        "--abort-ratio",
        type=fraction,
        default=d.abort_ratio,
        help=f"fraction of replayed lookups aborted mid-flight, 0 to 1 (default: {d.abort_ratio})",
    )
    p.add_argument(
        "--chunk-bytes",
        type=int_at_least(1),
        default=d.chunk_bytes,
        help=f"bytes of one chunk's KV payload (default: {d.chunk_bytes}, 2 MiB)",
    )
    p.add_argument(
        "--cpu-bytes",
        type=int_at_least(1),
        default=d.cpu_bytes,
        help=f"bytes of each worker's CPU tier and arena (default: {d.cpu_bytes}, 256 MiB)",
    )
    p.add_argument(
        "--miss-lookups",
        type=int_at_least(1),
        default=d.miss_lookups,
        help=f"full-miss lookups for the throughput figure (default: {d.miss_lookups})",
    )
    p.add_argument(
        "--rtt-samples",
        type=int_at_least(1),
        default=d.rtt_samples,
        help=f"round trips measured for each latency figure (default: {d.rtt_samples})",
    )
    p.add_argument(
        "--cancel-samples",
        type=int_at_least(1),
        default=d.cancel_samples,
        help="in-flight disk prefetches cancelled per worker for the cancel figure "
        f"(default: {d.cancel_samples})",
    )
    p.add_argument(
        "--disk-probe-rounds",
        type=int_at_least(1),
        default=d.disk_probe_rounds,
        help="rounds of the disk figure per worker, each its lookups and the verified read of "
        f"the same files (default: {d.disk_probe_rounds})",
    )
    p.add_argument(
        "--transport",
        choices=["ipc", "tcp"],
        default=d.transport,
        help=f"lookup endpoints: ipc (abstract names) or tcp on loopback (default: {d.transport})",
    )
    p.add_argument(
        "--seed", type=int, default=d.seed, help=f"workload random seed (default: {d.seed})"
    )
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="write a latency/throughput figure")
    p.add_argument("--no-progress", action="store_true", help="no progress line on stderr")


def main(args: argparse.Namespace) -> int:
    opts = BenchOptions(
        workers=args.workers,
        conversations=args.conversations,
        turns=args.turns,
        repeats=args.repeats,
        concurrency=args.concurrency,
        abort_ratio=args.abort_ratio,
        chunk_bytes=args.chunk_bytes,
        cpu_bytes=args.cpu_bytes,
        miss_lookups=args.miss_lookups,
        rtt_samples=args.rtt_samples,
        cancel_samples=args.cancel_samples,
        disk_probe_rounds=args.disk_probe_rounds,
        transport=args.transport,
        seed=args.seed,
        json=args.json,
        plot=args.plot,
        progress=not args.no_progress and not args.json,
    )
    if opts.plot:
        check_plot(opts.plot)  # before the run, not after it
    results = run_bench(opts)
    results["goals"] = [g.as_dict() for g in goals(results)]
    if opts.plot:
        plot(results, opts.plot)
    if opts.json:
        out = dict(results)
        out["replay"] = {k: v for k, v in results["replay"].items() if k != "latencies_ms"}
        print(json.dumps(out, indent=2, default=str))
    else:
        print(format_report(results))
        if opts.plot:
            print(f"  figure written to {opts.plot}")
    return 0 if results["leak_free"] else 1
