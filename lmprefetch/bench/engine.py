"""``lmprefetch bench-engine``: the prefetch engine alone, 16 chunks × 2 MiB per lookup.

Measures lookup + prefetch latency (median over repeats) for a CPU hit, a disk hit (files in
the page cache), a full miss, and 8 concurrent disk lookups, each printed beside the physical
limit measured in the same run: the time plain ``readinto`` takes to read the same files, and
for the CPU hit and the miss the time of an empty Trio checkpoint round.  LMCache 0.5.6's
figures for the same workload, measured on this kind of machine, are printed for reference
(``nox -s lmcache`` runs ``examples/bench_lmcache_peer.py``, which measures both side by side).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import trio
import xxhash

from ..config import PrefetchConfig
from ..prefetch import Engine, open_engine

__all__ = ["main", "run"]

MiB = 1024 * 1024

#: LMCache 0.5.6 measured on this kind of machine (2 cores) by ``examples/bench_lmcache_peer.py``
#: (``nox -s lmcache``): a real ``LMCacheEngine`` with async loading, CPU and disk backends,
#: the same 16 × 2 MiB workload, median of 50 (µs).  That script measures both engines in one
#: run; these figures only put a single-engine run in context.
LMCACHE_REFERENCE_US = {"cpu_hit": 470.0, "disk_hit": 9383.0, "miss": 152.0, "disk_x8": 79168.0}


def _prompt(i: int, n_chunks: int, chunk_size: int) -> list[int]:
    return [i * 10_000_000 + t for t in range(n_chunks * chunk_size)]


async def _lookup_and_release(engine: Engine, lid: str, hashes: list[int], offs: list[int]) -> int:
    n = await engine.lookup_and_prefetch(lid, hashes, offs)
    with engine.claim(lid):
        pass
    return n


def _raw_read_s(files: list[Path], slots: list[memoryview], verify: bool = False) -> float:
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


async def _run(chunks: int, chunk_bytes: int, repeats: int, tmp: str) -> dict[str, Any]:
    chunk_size = 256
    config = PrefetchConfig(
        chunk_size=chunk_size,
        chunk_bytes=chunk_bytes,
        cpu_bytes=max(1024 * MiB, 20 * chunks * chunk_bytes),
        disk_path=tmp,
        disk_bytes=64 * chunks * chunk_bytes,
        disk_read_threads=4,
    )
    offs = [chunk_size] * chunks
    payload = os.urandom(chunk_bytes)
    out: dict[str, Any] = {"chunks": chunks, "chunk_bytes": chunk_bytes, "repeats": repeats}
    async with open_engine(config) as engine:
        prompts = [engine.hasher.hash(_prompt(i, chunks, chunk_size)) for i in range(9)]
        for hashes in prompts:
            await engine.store_hashes(hashes, [h.to_bytes(8, "big") + payload[8:] for h in hashes])
        await engine.flush()

        async def timed(fn: Any, *args: Any) -> float:
            t0 = time.perf_counter()
            await fn(*args)
            return time.perf_counter() - t0

        # CPU hit (prompt 0 stays in the CPU tier)
        samples = [
            await timed(_lookup_and_release, engine, f"c{i}", prompts[0], offs)
            for i in range(repeats)
        ]
        out["cpu_hit_us"] = statistics.median(samples) * 1e6

        async def checkpoint_round() -> None:
            await trio.lowlevel.checkpoint()

        out["trio_checkpoint_us"] = (
            statistics.median([await timed(checkpoint_round) for _ in range(repeats)]) * 1e6
        )

        # Miss
        miss = engine.hasher.hash(_prompt(99, chunks, chunk_size))
        samples = [
            await timed(_lookup_and_release, engine, f"m{i}", miss, offs) for i in range(repeats)
        ]
        out["miss_us"] = statistics.median(samples) * 1e6

        # Disk hits: drop prompts 1..8 from the CPU tier; the disk tier has them.
        for hashes in prompts[1:]:
            for key in engine.keys.keys(hashes):
                engine.cpu.discard(key)
        disk = next(t for t in engine.tiers if t.name == "disk")
        files = {
            i: [Path(tmp) / f"{k.to_string()}.kv" for k in engine.keys.keys(prompts[i])]
            for i in range(1, 9)
        }
        slot_bytes = chunk_bytes + 8192
        aligned = mmap.mmap(-1, slot_bytes * chunks)
        whole = memoryview(aligned)
        slots = [whole[i * slot_bytes : (i + 1) * slot_bytes] for i in range(chunks)]
        for i in range(1, 9):  # warm the page cache
            _raw_read_s(files[i], slots)
        samples, raw, verified = [], [], []
        for i in range(repeats):
            samples.append(await timed(_lookup_and_release, engine, f"d{i}", prompts[1], offs))
            raw.append(_raw_read_s(files[1], slots))
            verified.append(_raw_read_s(files[1], slots, verify=True))
        out["disk_hit_us"] = statistics.median(samples) * 1e6
        out["raw_read_16_us"] = statistics.median(raw) * 1e6
        out["raw_read_verified_16_us"] = statistics.median(verified) * 1e6

        async def eight() -> None:
            async with trio.open_nursery() as nursery:
                for i in range(1, 9):
                    nursery.start_soon(_lookup_and_release, engine, f"x{i}", prompts[i], offs)

        samples, raw, verified = [], [], []
        for _ in range(max(3, repeats // 5)):
            samples.append(await timed(eight))
            raw.append(sum(_raw_read_s(files[i], slots) for i in range(1, 9)))
            verified.append(sum(_raw_read_s(files[i], slots, verify=True) for i in range(1, 9)))
        out["disk_x8_us"] = statistics.median(samples) * 1e6
        out["raw_read_x8_us"] = statistics.median(raw) * 1e6
        out["raw_read_verified_x8_us"] = statistics.median(verified) * 1e6
        out["disk_chunks_loaded"] = disk.stats.chunks_loaded
        for slot in slots:
            slot.release()
        whole.release()
        aligned.close()
        await engine.wait_quiet()
        out["idle_after"] = engine.is_idle()
    return out


def run(chunks: int = 16, chunk_bytes: int = 2 * MiB, repeats: int = 50) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="lmprefetch-bench-engine-") as tmp:
        return trio.run(_run, chunks, chunk_bytes, repeats, tmp)


def format_report(r: dict[str, Any]) -> str:
    ref = LMCACHE_REFERENCE_US
    mb = r["chunks"] * r["chunk_bytes"] / MiB
    rows = [
        (
            "CPU hit",
            r["cpu_hit_us"],
            "zero-copy; one trio checkpoint",
            r["trio_checkpoint_us"],
            ref["cpu_hit"],
        ),
        (
            "disk hit (page cache)",
            r["disk_hit_us"],
            "raw read + xxh3 of the files",
            r["raw_read_verified_16_us"],
            ref["disk_hit"],
        ),
        ("full miss", r["miss_us"], "one trio checkpoint", r["trio_checkpoint_us"], ref["miss"]),
        (
            "8 concurrent disk lookups",
            r["disk_x8_us"],
            "raw read + xxh3 of the files",
            r["raw_read_verified_x8_us"],
            ref["disk_x8"],
        ),
    ]
    lines = [
        f"lmprefetch bench-engine — {r['chunks']} chunks × {r['chunk_bytes'] // MiB} MiB "
        f"({mb:.0f} MiB) per lookup, median of {r['repeats']}",
        "",
        f"  {'case':<27}{'lmprefetch':>12}   {'limit (same run)':>30}{'ratio':>8}"
        f"   {'LMCache 0.5.6 (ref.)':>20}{'speed-up':>10}",
    ]
    for name, ours, limit_name, limit, peer in rows:
        lines.append(
            f"  {name:<27}{ours:10.1f}µs   {limit_name:>22} {limit:7.1f}µs{ours / limit:7.2f}×"
            f"   {peer:18.0f}µs{peer / ours:9.1f}×"
        )
    lines.append(
        f"  (raw read alone, unverified: {r['raw_read_16_us']:.0f} µs for one lookup's files, "
        f"{r['raw_read_x8_us']:.0f} µs for eight)"
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
    p.add_argument("--json", action="store_true", help="print the results as JSON")


def main(args: argparse.Namespace) -> int:
    r = run(args.chunks, args.chunk_bytes, args.repeats)
    print(json.dumps(r, indent=2) if args.json else format_report(r))
    return 0 if r["idle_after"] else 1
