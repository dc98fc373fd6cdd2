"""Where a disk hit's time goes: the phase budget ``lmprefetch bench-disk`` prints.

One engine with a disk tier (and a CPU tier too small to matter: the hits come from disk), the
chunk files in the page cache and verified once, as in :mod:`lmprefetch.bench.engine`.  Two
cases: *one* disk hit (a prompt of ``chunks`` chunks) and *eight* concurrent lookups (eight
such prompts).  For each sample the disk tier records the intervals of every phase
(:class:`lmprefetch._phases.Phases`: system calls, hashing, codec, read-thread time, the read
limiter, thread hand-offs, the probe) and a Trio instrument records when the Trio thread waits
for I/O, the rest of the time being Trio's own run time.

Those intervals overlap (two read threads and the Trio thread run at once), so each instant
of the sample's wall time is given to one phase, the first active one in :data:`PHASES`'
order: reading first (a system call, then hashing, then decoding, then the rest of a read
thread's time), then the Trio side (the probe, Trio's run time), then waits (the read
limiter, hand-offs); an instant where none is active is ``idle`` (nothing recorded ran).
The phases of a sample therefore add up to its wall time exactly, and what is not ``syscalls``
is time during which no read was in progress: the distance from the floor.  Beside each
phase: its *busy* time (the sum of its intervals: thread-seconds, which parallel threads make
larger than the wall) and how many intervals it had (for ``handoff``: two per thread call).

The floor, measured in the same run, alternating with the samples: the same chunk files read
with ``preadv`` into a reused page-aligned buffer per thread, by one thread and by two (the
faster is the floor of one hit), and by eight threads, one prompt each (the floor of eight).
Beside it, what a prefetch can reach (``distinct``): the same plain reads, each chunk into a
slot of its own, as a load must put them (a reused buffer stays in the CPU's caches; 16 slots
of 2 MiB do not, and every byte written then costs a fetch of its cache line first).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio
import trio.testing

from .. import _stopping
from .._phases import Phases, perf_counter

if TYPE_CHECKING:
    from ..config import PrefetchConfig

__all__ = ["PHASES", "attribute", "format_budget", "measure"]

MiB = 1024 * 1024

#: Every phase, in the order an instant is given to one (see the module docstring): name, label.
PHASES: tuple[tuple[str, str], ...] = (
    ("syscalls", "the reads' system calls (open, fstat, preadv, close; GIL re-take)"),
    ("hash", "hashing (xxh3, a file not verified yet or changed)"),
    ("codec", "codec stage (decode, and its copy out of scratch; 0: passthrough)"),
    ("thread", "read threads' other time (Python between calls, GIL waits)"),
    ("probe", "probe (the disk tier's index walk; its checkpoint is Trio's)"),
    ("trio", "Trio's own run time (task steps, the scheduler)"),
    ("limiter", "read-limiter waits"),
    ("handoff", "thread hand-offs (token → thread runs, thread done → task runs)"),
    ("idle", "nothing recorded (unattributed)"),
)
_RANK = {name: i for i, (name, _) in enumerate(PHASES)}


def attribute(
    intervals: Sequence[tuple[str, float, float]], start: float, end: float
) -> dict[str, float]:
    """Seconds of ``[start, end]`` given to each phase of :data:`PHASES` (every phase a key;
    the values add up to ``end - start``): each instant to the first active phase in the
    order of :data:`PHASES`, ``idle`` where none is."""
    events: list[tuple[float, int, int]] = []
    for phase, a, b in intervals:
        a, b = max(a, start), min(b, end)
        if b > a:
            rank = _RANK[phase]
            events.append((a, 1, rank))
            events.append((b, -1, rank))
    events.sort()
    active = [0] * len(PHASES)
    out = dict.fromkeys(_RANK, 0.0)
    idle = _RANK["idle"]
    t = start
    for when, delta, rank in events:
        if when > t:
            first = next((i for i, n in enumerate(active) if n), idle)
            out[PHASES[first][0]] += when - t
            t = when
        active[rank] += delta
    out["idle"] += max(0.0, end - t)
    return out


class _TrioRunTime(trio.abc.Instrument):
    """A Trio instrument: the intervals the Trio thread is not waiting for I/O (``trio``),
    and the number of task steps and of I/O waits (wake-ups) while it is installed."""

    def __init__(self, phases: Phases) -> None:
        self.phases = phases
        self.running_since = perf_counter()
        self.steps = 0
        self.wakeups = 0

    def before_io_wait(self, timeout: float) -> None:
        if timeout > 0:  # (a poll between batches of runnable tasks is the scheduler's run)
            self.phases.add("trio", self.running_since, perf_counter())

    def after_io_wait(self, timeout: float) -> None:
        if timeout > 0:
            self.running_since = perf_counter()
            self.wakeups += 1

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self.steps += 1

    def close(self) -> None:
        self.phases.add("trio", self.running_since, perf_counter())


@contextlib.contextmanager
def _recording(disk: Any) -> Iterator[tuple[Phases, _TrioRunTime]]:
    phases = Phases()
    instrument = _TrioRunTime(phases)
    trio.lowlevel.add_instrument(instrument)
    disk.phases = phases
    try:
        yield phases, instrument
    finally:
        disk.phases = None
        trio.lowlevel.remove_instrument(instrument)
        instrument.close()


def _plain_read_s(
    groups: Sequence[Sequence[Path]],
    pool: ThreadPoolExecutor,
    buffers: Sequence[Sequence[memoryview]],
) -> float:
    """Seconds for ``len(groups)`` threads of ``pool`` to read group ``i``'s files, one after
    the other, file ``j`` into ``buffers[i][j % len(buffers[i])]`` (``preadv`` of the whole
    file, as the floor)."""
    t0 = time.perf_counter()
    futures = [pool.submit(_read_files, g, b) for g, b in zip(groups, buffers)]
    for f in futures:
        f.result()
    return time.perf_counter() - t0


def _read_files(files: Sequence[Path], bufs: Sequence[memoryview]) -> None:
    """Read file ``j`` of ``files`` into ``bufs[j % len(bufs)]`` with ``preadv`` of the whole
    file, one after the other, in the calling thread."""
    for j, path in enumerate(files):
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.preadv(fd, [bufs[j % len(bufs)]], 0)
        finally:
            os.close(fd)


def _checked_read_s(files: Sequence[Path], bufs: Sequence[memoryview], piece: int) -> float:
    """Seconds to read file ``j`` of ``files`` into ``bufs[j]`` with the system calls a load
    makes for a file verified once (no hashing): ``open``, ``fstat`` (its identity), ``preadv``
    in pieces of ``piece`` bytes (between which a cancel is noticed), ``fstat`` again (changed
    while read?), ``close``; in the calling thread."""
    t0 = time.perf_counter()
    for path, buf in zip(files, bufs):
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            size = min(buf.nbytes, os.fstat(fd).st_size)
            for pos in range(0, size, piece):
                with buf[pos : pos + piece] as dst:
                    os.preadv(fd, [dst], pos)
            os.fstat(fd)
        finally:
            os.close(fd)
    return time.perf_counter() - t0


async def _trio_hop(
    nursery: trio.Nursery, fn: Callable[..., None], *args: object
) -> tuple[float, float]:
    """The least a Trio design pays for a lookup that reads in a thread: a task spawned, one
    thread hop running ``fn(*args)``, an event the caller waits on.  ``(wall seconds, the Trio
    thread's CPU seconds)``."""
    done = trio.Event()

    async def task() -> None:
        await trio.to_thread.run_sync(fn, *args)
        done.set()

    c0, t0 = time.thread_time(), perf_counter()
    nursery.start_soon(task)
    await done.wait()
    return perf_counter() - t0, time.thread_time() - c0


def _summary(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Per phase: the mean over the samples of the wall time given to it, of its busy time and
    of its interval count (means, so that the phases still add up to the mean wall time)."""
    n = len(samples)
    walls = [s["wall_s"] for s in samples]
    return {
        "samples": n,
        "wall_s_mean": statistics.fmean(walls),
        "wall_s_median": statistics.median(walls),
        "phases": {
            name: {
                "wall_s": statistics.fmean(s["phases"][name] for s in samples),
                "busy_s": statistics.fmean(s["busy"].get(name, 0.0) for s in samples),
                "count": statistics.fmean(s["counts"].get(name, 0) for s in samples),
            }
            for name, _ in PHASES
        },
        "trio_steps": statistics.fmean(s["trio_steps"] for s in samples),
        "trio_wakeups": statistics.fmean(s["trio_wakeups"] for s in samples),
    }


def _sample(phases: Phases, instrument: _TrioRunTime, t0: float, t1: float) -> dict[str, Any]:
    busy: dict[str, float] = {}
    counts: dict[str, int] = {}
    for phase, a, b in phases.intervals:
        if b > t0 and a < t1:
            busy[phase] = busy.get(phase, 0.0) + min(b, t1) - max(a, t0)
            counts[phase] = counts.get(phase, 0) + 1
    return {
        "wall_s": t1 - t0,
        "phases": attribute(phases.intervals, t0, t1),
        "busy": busy,
        "counts": counts,
        "trio_steps": instrument.steps,
        "trio_wakeups": instrument.wakeups,
    }


async def stored_prompts(
    tmp: str, chunks: int, chunk_bytes: int, n: int
) -> tuple[PrefetchConfig, list[int], list[list[int]]]:
    """The disk benchmarks' set-up: an engine configuration with its disk tier in ``tmp`` (and
    a CPU tier too small to matter), and ``n`` prompts of ``chunks`` chunks of
    ``chunk_bytes`` written there (flushed, by an engine of their own); ``(config, the chunk
    token counts, the prompts' hashes)``."""
    from ..config import PrefetchConfig
    from ..hashing import ChunkHasher
    from .engine import CHUNK_TOKENS, _prompt, _store_prompts, arena_bytes

    config = PrefetchConfig(
        chunk_size=CHUNK_TOKENS, chunk_bytes=chunk_bytes,
        cpu_bytes=arena_bytes(chunks, chunk_bytes), disk_path=tmp,
        disk_bytes=64 * chunks * chunk_bytes, disk_read_threads=4,
    )  # fmt: skip
    hasher = ChunkHasher.from_config(config)
    prompts = [hasher.hash(_prompt(i, chunks, CHUNK_TOKENS)) for i in range(n)]
    await _store_prompts(config, prompts, os.urandom(chunk_bytes))
    return config, [CHUNK_TOKENS] * chunks, prompts


async def _measure(
    chunks: int, chunk_bytes: int, repeats: int, x8_repeats: int, cancel_repeats: int, tmp: str
) -> dict[str, Any]:
    from ..tiers.chunkfile import PIECE_BYTES, RACY_NS
    from ..tiers.disk import DiskTier
    from ..wiring import open_engine
    from .engine import _lookup_and_release

    config, offs, prompts = await stored_prompts(tmp, chunks, chunk_bytes, 9)
    written_at = time.monotonic()
    out: dict[str, Any] = {"chunks": chunks, "chunk_bytes": chunk_bytes, "cpus": os.cpu_count()}
    step = chunk_bytes + mmap.PAGESIZE
    # One reused buffer per thread, then two sets of distinct slots for 8 prompts (used in
    # turn: the set read last is still partly in the caches), written once to fault them in.
    region = mmap.mmap(-1, (8 + 2 * 8 * chunks) * step)
    region.write(b"\1" * len(region))
    whole = memoryview(region)
    slots = [whole[i * step : (i + 1) * step] for i in range(len(region) // step)]
    reused = [[s] for s in slots[:8]]

    def distinct(turn: int, threads: int) -> list[list[memoryview]]:
        base = 8 + (turn % 2) * 8 * chunks
        return [slots[base + t * chunks : base + (t + 1) * chunks] for t in range(threads)]

    pool = ThreadPoolExecutor(8, thread_name_prefix="floor")
    try:
        async with open_engine(config) as engine:
            disk = next(t for t in engine.tiers if t.name == "disk")
            assert isinstance(disk, DiskTier)
            files = {
                i: [Path(tmp) / f"{k.to_string()}.kv" for k in engine.keys.keys(prompts[i])]
                for i in range(1, 9)
            }
            for i in range(1, 9):  # the page cache, and the pool's threads, warm
                _plain_read_s([files[i]] * 8, pool, reused)
            # Steady state: every file older than the racy window, read once and verified.
            await trio.sleep(max(0.0, written_at + RACY_NS / 1e9 - time.monotonic()))
            for i in range(1, 9):
                await _lookup_and_release(engine, f"warm{i}", prompts[i], offs)
            one: list[dict[str, Any]] = []
            floor1: list[float] = []
            floor2: list[float] = []
            floor_distinct: list[float] = []
            checked: list[float] = []
            hop_read: list[tuple[float, float]] = []
            half = -(-chunks // 2)
            load0 = os.getloadavg()[0]
            async with trio.open_nursery() as hops:
                for r in range(repeats):
                    floor1.append(_plain_read_s([files[1]], pool, reused))
                    floor2.append(_plain_read_s([files[1][:half], files[1][half:]], pool, reused))
                    floor_distinct.append(_plain_read_s([files[1]], pool, distinct(r, 1)))
                    checked.append(
                        pool.submit(
                            _checked_read_s, files[1], distinct(r, 1)[0], PIECE_BYTES
                        ).result()
                    )
                    hop_read.append(await _trio_hop(hops, _read_files, files[1], distinct(r, 1)[0]))
                    with _recording(disk) as (phases, instrument):
                        c0, t0 = time.thread_time(), perf_counter()
                        await _lookup_and_release(engine, f"b{r}", prompts[1], offs)
                        t1, c1 = perf_counter(), time.thread_time()
                    one.append(_sample(phases, instrument, t0, t1))
                    one[-1]["trio_cpu_s"] = c1 - c0
            out["one"] = _summary(one)
            out["one"]["trio_cpu_s"] = statistics.median(x["trio_cpu_s"] for x in one)
            # The least a Trio design can take for this hit, measured alike: a task, one hop
            # whose thread reads the same files into distinct slots, an event (and that
            # design's Trio CPU).
            out["one"]["design_floor_s"] = statistics.median(w for w, _ in hop_read)
            out["one"]["design_floor_trio_cpu_s"] = statistics.median(c for _, c in hop_read)
            out["one"]["floor_1_thread_s"] = statistics.median(floor1)
            out["one"]["floor_2_threads_s"] = statistics.median(floor2)
            out["one"]["floor_s"] = min(statistics.median(floor1), statistics.median(floor2))
            out["one"]["distinct_s"] = statistics.median(floor_distinct)
            out["one"]["checked_s"] = statistics.median(checked)
            out["one"]["checked_piece_bytes"] = PIECE_BYTES
            out["one"]["load_avg"] = [load0, os.getloadavg()[0]]

            async def eight(tag: str) -> None:
                async with trio.open_nursery() as nursery:
                    for i in range(1, 9):
                        nursery.start_soon(
                            _lookup_and_release, engine, f"x{tag}-{i}", prompts[i], offs
                        )

            many: list[dict[str, Any]] = []
            floor8: list[float] = []
            floor8_distinct: list[float] = []
            load0 = os.getloadavg()[0]
            for r in range(x8_repeats):
                groups = [files[i] for i in range(1, 9)]
                floor8.append(_plain_read_s(groups, pool, reused))
                floor8_distinct.append(_plain_read_s(groups, pool, distinct(r, 8)))
                with _recording(disk) as (phases, instrument):
                    t0 = perf_counter()
                    await eight(str(r))
                    t1 = perf_counter()
                many.append(_sample(phases, instrument, t0, t1))
            out["eight"] = _summary(many)
            out["eight"]["floor_s"] = out["eight"]["floor_8_threads_s"] = statistics.median(floor8)
            out["eight"]["distinct_s"] = statistics.median(floor8_distinct)
            out["eight"]["load_avg"] = [load0, os.getloadavg()[0]]

            # Cancel → released: a disk hit cancelled while its task waits for the read
            # thread (at once, or a quarter, a half, three quarters of a hit's time later),
            # timed until the engine holds nothing: what the cancel waits for.
            cancels: list[dict[str, Any]] = []
            load0 = os.getloadavg()[0]
            hit_s = out["one"]["wall_s_median"]
            answered_first = 0
            for r in range(cancel_repeats):
                answers: list[int] = []
                with _recording(disk) as (phases, instrument):
                    engine.start_lookup(f"c{r}", prompts[1], offs, on_answer=answers.append)
                    await trio.testing.wait_all_tasks_blocked()
                    if r % 4:
                        await trio.sleep(hit_s * (r % 4) / 4)
                    t0 = perf_counter()
                    engine.cancel(f"c{r}")
                    await engine.wait_quiet()
                    t1 = perf_counter()
                cancels.append(_sample(phases, instrument, t0, t1))
                answered_first += bool(answers and answers[0])
            out["cancel"] = _summary(cancels)
            walls = sorted(c["wall_s"] for c in cancels)
            out["cancel"]["p99_s"] = walls[min(len(walls) - 1, round(0.99 * (len(walls) - 1)))]
            out["cancel"]["max_s"] = walls[-1]
            out["cancel"]["load_avg"] = [load0, os.getloadavg()[0]]
            # (Those the read had finished before the cancel: a held result released.)
            out["cancel"]["answered_first"] = answered_first
            await engine.wait_quiet()
            out["idle_after"] = engine.is_idle()
    finally:
        pool.shutdown()
        for s in slots:
            s.release()
        whole.release()
        region.close()
    out["one"]["vs_design_floor"] = out["one"]["wall_s_median"] / out["one"]["design_floor_s"]
    for case in ("one", "eight"):
        c = out[case]
        c["vs_floor"] = c["wall_s_median"] / c["floor_s"]
        c["distinct_vs_floor"] = c["distinct_s"] / c["floor_s"]
        c["vs_distinct"] = c["wall_s_median"] / c["distinct_s"]
    return out


def measure(
    chunks: int = 16,
    chunk_bytes: int = 2 * MiB,
    repeats: int = 30,
    x8_repeats: int = 6,
    cancel_repeats: int = 30,
) -> dict[str, Any]:
    """The phase budget of one disk hit, of eight concurrent ones and of a cancelled one, with
    the floors (see the module docstring), in a fresh Trio run over a temporary directory."""
    with _stopping.temporary_directory(prefix="lmprefetch-budget-") as tmp:
        # Through _stopping: a SIGINT or SIGTERM cancels the run (one line, nothing left),
        # instead of being raised somewhere inside Trio's loop.
        return _stopping.run_trio(
            _measure, chunks, chunk_bytes, repeats, x8_repeats, cancel_repeats, tmp
        )


def _phase_rows(c: dict[str, Any]) -> list[str]:
    wall = c["wall_s_mean"]
    lines = [f"      {'phase':<70} {'wall ms':>8} {'%':>5} {'busy ms':>8} {'count':>6}"]
    for name, label in PHASES:
        p = c["phases"][name]
        share = p["wall_s"] / wall * 100 if wall else 0.0
        lines.append(
            f"      {label:<70} {p['wall_s'] * 1e3:8.3f} {share:5.1f} "
            f"{p['busy_s'] * 1e3:8.3f} {p['count']:6.1f}"
        )
    total = sum(p["wall_s"] for p in c["phases"].values())
    lines.append(
        f"      {'sum (= the mean wall time)':<70} {total * 1e3:8.3f} {total / wall * 100:5.1f}"
        f"   Trio task steps {c['trio_steps']:.0f}, wake-ups {c['trio_wakeups']:.0f}"
    )
    return lines


def format_budget(r: dict[str, Any]) -> str:
    """The budget as tables: per case, each phase's share of the wall time (mean over the
    samples, in ms and %), its busy time and interval count, and the floor beside it."""
    lines = [
        f"  phase budget of a disk hit ({r['chunks']} chunks × {r['chunk_bytes'] / MiB:g} MiB, "
        "page cache, verified once; means over the samples, each instant of the wall time "
        "given to one phase):"
    ]
    titles = {
        "one": ("one disk hit", "faster of 1 / 2 plain reading threads",
                f"{r['one']['floor_1_thread_s'] * 1e3:.3g} / "
                f"{r['one']['floor_2_threads_s'] * 1e3:.3g} ms"),
        "eight": ("8 concurrent disk lookups", "8 plain reading threads",
                  f"{r['eight']['floor_8_threads_s'] * 1e3:.3g} ms"),
    }  # fmt: skip
    for case, (title, floor_label, floor_text) in titles.items():
        c = r[case]
        lines += [
            "",
            f"    {title}: {c['samples']} samples, wall {c['wall_s_median'] * 1e3:.3g} ms median "
            f"(mean {c['wall_s_mean'] * 1e3:.3g}); floor ({floor_label}) {floor_text} → "
            f"{c['vs_floor']:.2f}× the floor (goal ≤ 1.15); load avg "
            f"{c['load_avg'][0]:.1f}→{c['load_avg'][1]:.1f}",
            f"      the same plain reads into distinct slots, as a load must: "
            f"{c['distinct_s'] * 1e3:.3g} ms = {c['distinct_vs_floor']:.2f}× the floor; "
            f"the engine {c['vs_distinct']:.2f}× that",
            *_phase_rows(c),
        ]
        if case == "one" and "design_floor_s" in c:
            lines += [
                f"      the Trio thread's CPU per hit {c['trio_cpu_s'] * 1e6:.0f} µs. The least a "
                "Trio design takes (a task, one thread hop reading the same files into distinct",
                f"      slots, an event): {c['design_floor_s'] * 1e3:.3g} ms, its Trio CPU "
                f"{c['design_floor_trio_cpu_s'] * 1e6:.0f} µs; the engine "
                f"{c['vs_design_floor']:.2f}× that. The plain reads with a load's checks "
                f"(identity before and after, {c['checked_piece_bytes'] // 1024} KiB pieces): "
                f"{c['checked_s'] * 1e3:.3g} ms",
            ]
    if "cancel" in r:
        c = r["cancel"]
        lines += [
            "",
            f"    cancel of a disk hit in its read thread → released: {c['samples']} samples, "
            f"median {c['wall_s_median'] * 1e3:.3g} ms, p99 {c['p99_s'] * 1e3:.3g} ms, max "
            f"{c['max_s'] * 1e3:.3g} ms (goal p99 ≤ 1 ms; {c['answered_first']} had answered "
            "before the cancel); load avg "
            f"{c['load_avg'][0]:.1f}→{c['load_avg'][1]:.1f}",
            *_phase_rows(c),
        ]
    return "\n".join(lines)
