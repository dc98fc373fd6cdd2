"""Where the Trio thread's time in a disk hit comes from: chunk count and chunk size swept.

A disk hit's phase budget (``lmprefetch bench-disk``) shows the Trio thread running for
0.6-0.8 ms of a 16 x 2 MiB hit, the largest part of what lmprefetch adds to the reads.  This
splits it, for docs/benchmarks.md: the Trio thread's CPU time per hit (``time.thread_time``,
median of ``--hits`` hits; the same engine set-up as the budget, files in the page cache and
verified once) for

* 1, 4, 16 and 64 chunks of 64 KiB: the slope is the per-chunk bookkeeping (pins, arena slots,
  paths, outcomes), the intercept the per-lookup cost, on caches the small reads leave warm;
* 16 chunks of 64 KiB, 512 KiB, 2 MiB and 4 MiB: the same Python, run after its read thread
  copied more bytes through the caches;

and beside them the least any Trio design pays, measured in the same process: a task spawned,
one ``trio.to_thread.run_sync`` of nothing, an event waited on::

    python tools/trio_cpu_sweep.py [--hits 400]

Run it alone on the machine (it prints the load average before and after).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import trio

from lmprefetch.bench.disk_budget import stored_prompts
from lmprefetch.bench.engine import _lookup_and_release
from lmprefetch.tiers.chunkfile import RACY_NS

KiB = 1024


async def _hits(chunks: int, chunk_bytes: int, hits: int) -> tuple[float, float]:
    """Median Trio-thread CPU and wall seconds of ``hits`` disk hits of ``chunks`` chunks."""
    from lmprefetch.wiring import open_engine

    with tempfile.TemporaryDirectory(prefix="lmprefetch-sweep-") as tmp:
        config, offs, prompts = await stored_prompts(tmp, chunks, chunk_bytes, 3)
        await trio.sleep(RACY_NS / 1e9 + 0.1)  # old enough to be verified once
        async with open_engine(config) as engine:
            for i in range(30):
                await _lookup_and_release(engine, f"warm{i}", prompts[1], offs)
            cpu: list[float] = []
            wall: list[float] = []
            for i in range(hits):
                c0, w0 = time.thread_time(), time.perf_counter()
                await _lookup_and_release(engine, f"hit{i}", prompts[1], offs)
                wall.append(time.perf_counter() - w0)
                cpu.append(time.thread_time() - c0)
    return statistics.median(cpu), statistics.median(wall)


def _nothing() -> None:
    pass


async def _bare_hops(n: int) -> tuple[float, float]:
    """Median Trio-thread CPU and wall seconds of a task + one empty thread hop + an event."""
    cpu: list[float] = []
    wall: list[float] = []
    async with trio.open_nursery() as nursery:
        for _ in range(n):
            done = trio.Event()

            async def task(done: trio.Event = done) -> None:
                await trio.to_thread.run_sync(_nothing)
                done.set()

            c0, w0 = time.thread_time(), time.perf_counter()
            nursery.start_soon(task)
            await done.wait()
            wall.append(time.perf_counter() - w0)
            cpu.append(time.thread_time() - c0)
    return statistics.median(cpu), statistics.median(wall)


async def _main(hits: int) -> None:
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    cpu, wall = await _bare_hops(2000)
    print(f"a task, one empty thread hop, an event: Trio CPU {cpu * 1e6:.0f} µs, "
          f"wall {wall * 1e6:.0f} µs")  # fmt: skip
    print("chunks x size: the Trio thread's CPU per hit (wall per hit)")
    for chunks, size in [(1, 64), (4, 64), (16, 64), (64, 64), (16, 512), (16, 2048),
                         (16, 4096)]:  # fmt: skip
        cpu, wall = await _hits(chunks, size * KiB, hits)
        print(f"  {chunks:3d} x {size:5d} KiB: {cpu * 1e6:5.0f} µs ({wall * 1e3:.3f} ms)")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hits", type=int, default=400, help="disk hits per case (default 400)")
    trio.run(_main, p.parse_args().hits)


if __name__ == "__main__":
    main()
