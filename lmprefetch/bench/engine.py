"""``lmprefetch bench-engine``: the prefetch engine alone, 16 chunks × 2 MiB per lookup.

Measures lookup + prefetch + release latency for a CPU hit, a disk hit (files in the page
cache), a full miss, and 8 concurrent disk lookups of 8 different prompts, each beside the
physical limit measured in the same run: the time a plain ``preadv`` of the same files takes
(a file verified once and unchanged since is read without hashing it again), ``preadv`` + xxh3
for the ``_hashed`` cases that check every byte, and for the CPU hit and the miss an empty Trio
checkpoint round.

It also opens a *fresh* engine on a disk tier written earlier (the files in the page cache) and
times its first disk lookup against the steady state, and how long opening the engine took.

LMCache: when ``lmcache`` is importable (``--lmcache auto``, the default) the same workload runs
on a real LMCache 0.5.6 engine in this process (:mod:`.lmcache_peer`), one LMCache sample beside
each lmprefetch sample, so both see the same machine; the ratios are per pair.  Without it no
LMCache figure is printed: a peer's figure from another run is no comparison.

Every figure that has a goal is printed with it and marked ``✓`` or ``✗ MISSED`` (and
``--json`` carries ``goals``); a missed one says whether this machine could have met it, from
the case's limit measured in the same run (:data:`LIMITS`) and the load average.  Timings are
medians over ``--repeats``; the ratios are medians of per-sample ratios, with their
interquartile range.

The ``Dnn`` codes are LMCache's defects, the rows of the defect table in
``docs/cancellation.md`` ("The defects"), each with its ``test_dNN_`` regression tests.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import mmap
import os
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import trio
import xxhash

from .. import _stopping
from ..config import PrefetchConfig
from ..prefetch import Engine
from ..tiers.disk import DiskTier
from ..wiring import open_engine
from .goals import Goal, Limit, load_text
from .measure import load_avg

__all__ = ["CASES", "DISK_CASES", "LMCACHE_GOALS", "main", "run"]

MiB = 1024 * 1024

#: The cases, in the order they are measured and printed.  The ``_hashed`` ones are the disk
#: cases with every chunk's checksum computed on every read (``DiskTier.verify_once`` off);
#: the others read a file verified once, unchanged since, without hashing it again.
CASES = (
    ("cpu_hit", "CPU hit"),
    ("miss", "full miss"),
    ("disk_hit", "disk hit (page cache)"),
    ("disk_hit_hashed", "… every byte hashed again"),
    ("disk_x8", "8 concurrent disk lookups"),
    ("disk_x8_hashed", "… every byte hashed again"),
)
#: The cases of ``--disk-only``.
DISK_CASES = tuple(c for c in CASES if c[0].startswith("disk"))
#: lmprefetch ÷ LMCache (same run, per pair) must be at most this.
LMCACHE_GOALS = {"cpu_hit": 0.3, "miss": 0.3, "disk_hit": 0.6, "disk_x8": 0.6}
#: A fresh engine's first disk lookup ÷ the steady-state disk lookup must be at most this.
COLD_GOAL = 2.0
#: Fresh engines opened for the cold-start figure (the median of their first lookups).
COLD_ENGINES = 3
CHUNK_TOKENS = 256


def arena_bytes(chunks: int, chunk_bytes: int) -> int:
    """The CPU tier / arena size of the benchmark (LMCache's CPU backend gets the same): room
    for 20 prompts, at least 64 MiB."""
    return max(64 * MiB, 20 * chunks * chunk_bytes)


def _prompt(i: int, n_chunks: int, chunk_size: int) -> list[int]:
    return [i * 10_000_000 + t for t in range(n_chunks * chunk_size)]


async def _lookup_and_release(engine: Engine, lid: str, hashes: list[int], offs: list[int]) -> int:
    n = await engine.lookup_and_prefetch(lid, hashes, offs)
    with engine.claim(lid):
        pass
    return n


def _raw_read_s(files: Sequence[Path], slots: list[memoryview], verify: bool = False) -> float:
    """Read whole files with ``preadv``, file ``i`` into page-aligned slot ``i`` (a prefetch
    needs one destination per chunk; a misaligned destination such as a ``bytearray`` reads
    several times slower here).  With ``verify``, also hash each one with xxh3, the check
    the disk tier must make before handing a chunk out (D17)."""
    t0 = time.perf_counter()
    for p, slot in zip(files, slots):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.preadv(fd, [slot], 0)
        finally:
            os.close(fd)
        if verify:
            xxhash.xxh3_64_intdigest(slot)
    return time.perf_counter() - t0


def _median_us(xs: Sequence[float]) -> float:
    return statistics.median(xs) * 1e6


def _ratio_stats(num: Sequence[float], den: Sequence[float]) -> dict[str, float]:
    """Median and interquartile range of per-pair ratios ``num[i] / den[i]``."""
    ratios = sorted(a / b for a, b in zip(num, den) if b > 0)
    if len(ratios) < 2:
        r = ratios[0] if ratios else float("nan")
        return {"median": r, "p25": r, "p75": r}
    q = statistics.quantiles(ratios, n=4, method="inclusive")
    return {"median": statistics.median(ratios), "p25": q[0], "p75": q[2]}


async def _store_prompts(config: PrefetchConfig, prompts: list[list[int]], payload: bytes) -> None:
    """Write the prompts' chunks to the disk tier (and flush), with an engine of its own."""
    async with open_engine(config) as engine:
        for hashes in prompts:
            await engine.store_hashes(hashes, [h.to_bytes(8, "big") + payload[8:] for h in hashes])
        await engine.flush()


async def _run(
    chunks: int,
    chunk_bytes: int,
    repeats: int,
    tmp: str,
    peer: Any | None,
    *,
    disk_only: bool = False,
) -> dict[str, Any]:
    chunk_size = CHUNK_TOKENS
    config = PrefetchConfig(
        chunk_size=chunk_size,
        chunk_bytes=chunk_bytes,
        cpu_bytes=arena_bytes(chunks, chunk_bytes),
        disk_path=tmp,
        disk_bytes=64 * chunks * chunk_bytes,
        disk_read_threads=4,
    )
    offs = [chunk_size] * chunks
    payload = os.urandom(chunk_bytes)
    x8_repeats = max(3, repeats // 5)
    cases = DISK_CASES if disk_only else CASES
    out: dict[str, Any] = {
        "chunks": chunks,
        "chunk_bytes": chunk_bytes,
        "repeats": repeats,
        "x8_repeats": x8_repeats,
        "arena_prefault_bytes": min(config.arena_prefault_bytes, config.cpu_bytes),
        "cpu_bytes": config.cpu_bytes,
        "cpus": os.cpu_count() or 0,
        "load_avg_before": load_avg(),
        "cases": [case for case, _ in cases],
        # The 1-minute load average before and after each case's samples (``load_avg``, the
        # machine's at the end of the run, is the one the goals are printed with).
        "load_avg_per_case": {},
    }
    from ..hashing import ChunkHasher
    from ..tiers.chunkfile import RACY_NS

    hasher = ChunkHasher.from_config(config)
    prompts = [hasher.hash(_prompt(i, chunks, chunk_size)) for i in range(9)]
    await _store_prompts(config, prompts, payload)
    written_at = time.monotonic()
    ours: dict[str, list[float]] = {case: [] for case, _ in cases}
    theirs: dict[str, list[float]] = {case: [] for case, _ in cases}
    # CPU time of the whole process (every thread) during each sample: what a lookup costs,
    # which the machine's load changes far less than the wall time.
    ours_cpu: dict[str, list[float]] = {case: [] for case, _ in cases}
    theirs_cpu: dict[str, list[float]] = {case: [] for case, _ in cases}

    async def peer_sample(case: str) -> None:
        if peer is not None:
            # LMCache reads without verifying, so both our disk cases pair with its one.
            their_case = case.removesuffix("_hashed")
            c0 = time.process_time()
            theirs[case].append(await trio.to_thread.run_sync(peer.sample, their_case))
            theirs_cpu[case].append(time.process_time() - c0)

    async def timed(fn: Callable[..., Awaitable[Any]], *args: Any) -> float:
        t0 = time.perf_counter()
        await fn(*args)
        return time.perf_counter() - t0

    async def ours_sample(case: str, fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
        c0 = time.process_time()
        ours[case].append(await timed(fn, *args))
        ours_cpu[case].append(time.process_time() - c0)

    async def pair(case: str, i: int, fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
        # Alternate who goes first, so neither always runs right after the other.
        if i % 2:
            await peer_sample(case)
        await ours_sample(case, fn, *args)
        if not i % 2:
            await peer_sample(case)

    def note_load(case: str, start: float) -> None:
        out["load_avg_per_case"][case] = [start, load_avg()]

    if not disk_only:
        # Fresh engines on the disk tier written above: how long one takes to open (arena
        # pre-faulting included), and its first disk lookup (the arena and the read threads
        # never used) against the steady state.  A single first lookup is one sample, so
        # three engines.
        opens, colds = [], []
        for k in range(COLD_ENGINES):
            t0 = time.perf_counter()
            async with open_engine(config) as engine:
                opens.append(time.perf_counter() - t0)
                colds.append(
                    await timed(_lookup_and_release, engine, f"cold{k}", prompts[1], offs)
                )
        out["engine_open_ms"] = statistics.median(opens) * 1e3
        out["cold_first_disk_us"] = _median_us(colds)
        out["cold_first_disk_all_us"] = [c * 1e6 for c in colds]
    async with open_engine(config) as engine:
        disk = next(t for t in engine.tiers if t.name == "disk")
        assert isinstance(disk, DiskTier)
        if not disk_only:
            # Prompt 0 goes to the CPU tier; 1..8 stay on disk only.
            await engine.store_hashes(
                prompts[0], [h.to_bytes(8, "big") + payload[8:] for h in prompts[0]]
            )
            load0 = load_avg()
            for i in range(repeats):
                await pair("cpu_hit", i, _lookup_and_release, engine, f"c{i}", prompts[0], offs)
            note_load("cpu_hit", load0)

            async def checkpoint_round() -> None:
                await trio.lowlevel.checkpoint()

            out["trio_checkpoint_us"] = _median_us(
                [await timed(checkpoint_round) for _ in range(repeats)]
            )

            miss = hasher.hash(_prompt(99, chunks, chunk_size))
            load0 = load_avg()
            for i in range(repeats):
                await pair("miss", i, _lookup_and_release, engine, f"m{i}", miss, offs)
            note_load("miss", load0)

        files = {
            i: [Path(tmp) / f"{k.to_string()}.kv" for k in engine.keys.keys(prompts[i])]
            for i in range(1, 9)
        }
        slot_bytes = chunk_bytes + 8192
        aligned = mmap.mmap(-1, slot_bytes * chunks)
        whole = memoryview(aligned)
        slots = [whole[i * slot_bytes : (i + 1) * slot_bytes] for i in range(chunks)]
        try:
            for i in range(1, 9):  # warm the page cache
                _raw_read_s(files[i], slots)
            # Steady state: every file older than the racy window (a file written a moment
            # ago is hashed on every read, see chunkfile.may_trust) and read once, verified.
            await trio.sleep(max(0.0, written_at + RACY_NS / 1e9 - time.monotonic()))
            for i in range(1, 9):
                await _lookup_and_release(engine, f"warm{i}", prompts[i], offs)
            verified0, trusted0 = disk.verified_reads, disk.trusted_reads

            async def hashed(fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
                disk.verify_once = False
                try:
                    await fn(*args)
                finally:
                    disk.verify_once = True

            raw, verified = [], []
            load0 = load_avg()
            for i in range(repeats):
                await pair("disk_hit", i, _lookup_and_release, engine, f"d{i}", prompts[1], offs)
                await pair(
                    "disk_hit_hashed", i, hashed, _lookup_and_release, engine, f"h{i}",
                    prompts[1], offs,
                )
                raw.append(_raw_read_s(files[1], slots))
                verified.append(_raw_read_s(files[1], slots, verify=True))
            note_load("disk_hit", load0)
            note_load("disk_hit_hashed", load0)
            out["raw_read_16_us"] = _median_us(raw)
            out["raw_read_verified_16_us"] = _median_us(verified)
            out["disk_hit_vs_verified"] = _ratio_stats(ours["disk_hit"], verified)
            out["disk_hit_vs_raw"] = _ratio_stats(ours["disk_hit"], raw)

            async def eight(tag: str) -> None:
                async with trio.open_nursery() as nursery:
                    for i in range(1, 9):
                        nursery.start_soon(
                            _lookup_and_release, engine, f"x{tag}-{i}", prompts[i], offs
                        )

            raw, verified = [], []
            load0 = load_avg()
            for i in range(x8_repeats):
                await pair("disk_x8", i, eight, str(i))
                await pair("disk_x8_hashed", i, hashed, eight, f"h{i}")
                raw.append(sum(_raw_read_s(files[j], slots) for j in range(1, 9)))
                verified.append(sum(_raw_read_s(files[j], slots, verify=True) for j in range(1, 9)))
            note_load("disk_x8", load0)
            note_load("disk_x8_hashed", load0)
            out["raw_read_x8_us"] = _median_us(raw)
            out["raw_read_verified_x8_us"] = _median_us(verified)
            out["disk_x8_vs_verified"] = _ratio_stats(ours["disk_x8"], verified)
            out["disk_x8_vs_raw"] = _ratio_stats(ours["disk_x8"], raw)
        finally:
            for slot in slots:
                slot.release()
            whole.release()
            aligned.close()
        out["disk_chunks_loaded"] = disk.stats.chunks_loaded
        out["disk_reads_verified"] = disk.verified_reads - verified0
        out["disk_reads_trusted"] = disk.trusted_reads - trusted0
        await engine.wait_quiet()
        out["idle_after"] = engine.is_idle()
    for case, _ in cases:
        out[f"{case}_us"] = _median_us(ours[case])
        out[f"{case}_cpu_us"] = _median_us(ours_cpu[case])
    if not disk_only:
        out["cold_ratio"] = out["cold_first_disk_us"] / out["disk_hit_us"]
    out["load_avg"] = load_avg()
    if peer is not None:
        out["lmcache"] = {
            "version": _lmcache_version(),
            **{f"{case}_us": _median_us(theirs[case]) for case, _ in cases},
            **{f"{case}_cpu_us": _median_us(theirs_cpu[case]) for case, _ in cases},
            "ratios": {case: _ratio_stats(ours[case], theirs[case]) for case, _ in cases},
            "answers_ok": peer.answers_ok,
            "hit_tokens": {c: sorted(v) for c, v in peer.hit_tokens.items()},
            "disk_metadata_pins_after": peer.disk_metadata_pins,
        }
    else:
        out["lmcache"] = None
    out["goals"] = [g.as_dict() for g in goals(out)]
    return out


def _lmcache_version() -> str:
    from importlib.metadata import version

    return version("lmcache")


#: The physical limit of each case (same run): its name, and its key in :func:`run`'s result.
#: A file verified once and unchanged since is read without hashing it again, so the limit of
#: the plain disk cases is the plain read; the ``_hashed`` ones hash every byte, as xxh3 does.
LIMITS = {
    "cpu_hit": ("one trio checkpoint", "trio_checkpoint_us"),
    "miss": ("one trio checkpoint", "trio_checkpoint_us"),
    "disk_hit": ("raw read", "raw_read_16_us"),
    "disk_hit_hashed": ("raw read + xxh3", "raw_read_verified_16_us"),
    "disk_x8": ("raw read", "raw_read_x8_us"),
    "disk_x8_hashed": ("raw read + xxh3", "raw_read_verified_x8_us"),
}


def _cases(r: dict[str, Any]) -> list[tuple[str, str]]:
    """The cases ``r`` has figures for, in order."""
    return [(case, name) for case, name in CASES if f"{case}_us" in r]


def goals(r: dict[str, Any]) -> list[Goal]:
    """The goals of a :func:`run` result (the LMCache ones only when LMCache was measured).

    A ratio to LMCache has a limit: the case's physical limit (:data:`LIMITS`) ÷ LMCache's
    time, what lmprefetch would reach if it cost nothing over that limit."""
    machine = {
        "load_avg": r.get("load_avg", math.nan),
        "load_avg_before": r.get("load_avg_before", math.nan),
        "cpus": r.get("cpus", 0),
    }
    out: list[Goal] = []
    lmc = r.get("lmcache")
    if lmc:
        for case, name in _cases(r):
            if case not in LMCACHE_GOALS:
                continue
            limit_name, limit_key = LIMITS[case]
            theirs = lmc.get(f"{case}_us", math.nan)
            out.append(
                Goal(
                    f"{case}_vs_lmcache",
                    f"{name}, lmprefetch ÷ LMCache",
                    lmc["ratios"][case]["median"],
                    "<=",
                    LMCACHE_GOALS[case],
                    "×",
                    limit=Limit(
                        f"{limit_name} ÷ LMCache's time",
                        r.get(limit_key, math.nan) / theirs if theirs else math.nan,
                    ),
                    **machine,
                )
            )
    if "cold_ratio" in r:
        # No limit: nothing measured here bounds a first lookup against later ones.
        out.append(
            Goal(
                "cold_first_disk_vs_steady",
                "a fresh engine's first disk lookup ÷ steady state",
                r["cold_ratio"],
                "<=",
                COLD_GOAL,
                "×",
                **machine,
            )
        )
    return out


def run(
    chunks: int = 16,
    chunk_bytes: int = 2 * MiB,
    repeats: int = 50,
    *,
    lmcache: str = "auto",
    disk_only: bool = False,
    peer: Any | None = None,
) -> dict[str, Any]:
    """Run the benchmark.  ``lmcache``: ``auto`` (measure LMCache when importable), ``on``
    (it must be; else ``ValueError``) or ``off``.  ``disk_only``: only the disk cases (no
    fresh engines, CPU hits or misses).  ``peer``: an open :class:`LMCachePeer` to measure
    (with the same ``chunks`` and ``chunk_bytes``) instead of opening one."""
    from .lmcache_peer import LMCachePeer, lmcache_available

    run_ = functools.partial(_run, disk_only=disk_only)
    if peer is not None:
        with _stopping.temporary_directory(prefix="lmprefetch-bench-engine-") as tmp:
            return _stopping.run_trio(run_, chunks, chunk_bytes, repeats, tmp, peer)
    use_peer = lmcache != "off" and lmcache_available()
    if lmcache == "on" and not use_peer:
        raise ValueError("--lmcache on: lmcache is not importable (pip install lmcache==0.5.6)")
    if use_peer and chunk_bytes % LMCachePeer.CHUNK_BYTES_MULTIPLE:
        if lmcache == "on":
            raise ValueError(
                f"--chunk-bytes: LMCache needs a multiple of {LMCachePeer.CHUNK_BYTES_MULTIPLE}"
            )
        use_peer = False
    with contextlib.ExitStack() as stack:
        tmp = _stopping.enter(
            stack, lambda: _stopping.temporary_directory(prefix="lmprefetch-bench-engine-")
        )
        opened_peer = None
        if use_peer:
            size = arena_bytes(chunks, chunk_bytes)
            opened_peer = _stopping.enter(stack, lambda: LMCachePeer(chunks, chunk_bytes, size))
        return _stopping.run_trio(run_, chunks, chunk_bytes, repeats, tmp, opened_peer)


def format_report(r: dict[str, Any]) -> str:
    mb = r["chunks"] * r["chunk_bytes"] / MiB
    lmc = r.get("lmcache")
    limits = {case: (name, r.get(key, math.nan)) for case, (name, key) in LIMITS.items()}
    head = f"  {'case':<27}{'lmprefetch':>12}   {'limit (same run)':>27}{'ratio':>8}"
    if lmc:
        head += f"   {'LMCache ' + lmc['version']:>14}{'lmp ÷ LMCache (IQR)':>27}"
    head += "   load avg"
    lines = [
        f"lmprefetch bench-engine — {r['chunks']} chunks × {r['chunk_bytes'] / MiB:g} MiB "
        f"({mb:g} MiB) per lookup, lookup + prefetch + release, median of {r['repeats']} "
        f"({r['x8_repeats']} for the 8-way case)",
        "",
        head,
    ]
    for case, name in _cases(r):
        ours = r[f"{case}_us"]
        limit_name, limit = limits[case]
        line = (
            f"  {name:<27}{ours:10.1f}µs   {limit_name:>19} {limit:7.1f}µs{ours / limit:7.2f}×"
        )
        if lmc:
            q = lmc["ratios"][case]
            line += (
                f"   {lmc[f'{case}_us']:12.1f}µs"
                f"   {q['median']:5.2f}× ({q['p25']:.2f}–{q['p75']:.2f})"
            )
        load = r.get("load_avg_per_case", {}).get(case)
        if load:
            line += f"   {load[0]:.1f}→{load[1]:.1f}"
        lines.append(line)
    if "disk_reads_trusted" in r:
        lines.append(
            f"  (disk reads after the warm-up: {r['disk_reads_trusted']} unchanged since "
            f"verified, read unhashed; {r['disk_reads_verified']} hashed)"
        )
    cpu = [(case, name) for case, name in _cases(r) if f"{case}_cpu_us" in r]
    if cpu:
        lines.append(
            "  CPU time per sample (all threads; the load changes it less than the wall time): "
            + "; ".join(
                f"{name.removeprefix('… ')} {r[f'{case}_cpu_us']:.0f} µs"
                + (f" (LMCache {lmc[f'{case}_cpu_us']:.0f} µs)" if lmc else "")
                for case, name in cpu
            )
        )
    if "cold_first_disk_us" in r:
        lines.append(
            f"  fresh engine (median of {len(r.get('cold_first_disk_all_us', [0]))}): opened in "
            f"{r['engine_open_ms']:.1f} ms (arena "
            f"{r['cpu_bytes'] / MiB:g} MiB, {r['arena_prefault_bytes'] / MiB:g} MiB of it "
            "pre-faulted), "
            f"first disk lookup {r['cold_first_disk_us']:.0f} µs, steady state "
            f"{r['disk_hit_us']:.0f} µs"
        )
    if not lmc:
        lines.append("  LMCache: not installed here, so not measured (no figure from another run)")
    machine = load_text(
        r.get("load_avg", math.nan), r.get("cpus", 0), r.get("load_avg_before", math.nan)
    )
    lines += ["", f"  goals (this run; {machine}):"]
    for g in goals(r):
        lines += g.lines(52)
    lines.append("")
    if lmc:
        lines.append(
            f"  answers correct: LMCache {'OK' if lmc['answers_ok'] else 'WRONG'}; "
            f"lmprefetch leak check {'OK' if r['idle_after'] else 'LEAK'}; "
            f"LMCache disk-metadata pins left: {lmc['disk_metadata_pins_after']}"
        )
    lines.append(f"  leak check after the run: {'OK' if r['idle_after'] else 'LEAK'}")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from .workload import int_at_least

    p.add_argument(
        "--chunks",
        type=int_at_least(1),
        default=16,
        help="chunks per lookup (default: 16)",
    )
    p.add_argument(
        "--chunk-bytes",
        type=int_at_least(1),
        default=2 * MiB,
        help=f"bytes per chunk (default: {2 * MiB}, 2 MiB)",
    )
    p.add_argument(
        "--repeats",
        type=int_at_least(1),
        default=50,
        help="lookups per case; medians are printed (default: 50)",
    )
    p.add_argument(
        "--lmcache",
        choices=["auto", "on", "off"],
        default="auto",
        help="measure LMCache 0.5.6 beside lmprefetch in this run: auto (when importable), "
        "on (required), off (default: auto)",
    )
    p.add_argument(
        "--disk-only",
        action="store_true",
        help="only the disk cases (no fresh engines, CPU hits or misses)",
    )
    p.add_argument("--json", action="store_true", help="print the results as JSON")


def main(args: argparse.Namespace) -> int:
    r = run(
        args.chunks, args.chunk_bytes, args.repeats, lmcache=args.lmcache,
        disk_only=args.disk_only,
    )
    print(json.dumps(r, indent=2) if args.json else format_report(r))
    lmc = r.get("lmcache")
    ok = r["idle_after"] and (lmc is None or lmc["answers_ok"])
    return 0 if ok else 1
