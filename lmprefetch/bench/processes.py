"""The processes a benchmark run starts: worker ranks, and the echo peers that measure the
transport's physical limit; and how they are started and stopped.

Every child is started with :func:`start_process` and ended with :func:`stop_processes`, and
its entry point is wrapped in :func:`child_main`, so that stopping the command at any moment
(:mod:`lmprefetch._stopping`) leaves no child behind and prints nothing from the children:
they start with the stop signals blocked, then ignore SIGINT (the terminal's Ctrl-C reaches
them too; the command stops them) and end on SIGTERM.
"""

from __future__ import annotations

import functools
import multiprocessing as mp
import os
import sys
import time
from collections.abc import Callable, Sequence
from multiprocessing import resource_tracker
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any, ParamSpec

import zmq

from .. import _stopping
from ..config import PrefetchConfig
from ..hashing import ChunkHasher
from .workload import BenchOptions, Workload, make_workload, payload_block

__all__ = [
    "child_main",
    "echo_main",
    "start_process",
    "stop_processes",
    "trio_echo_main",
    "worker_main",
]

_P = ParamSpec("_P")


def child_main(main: Callable[_P, None]) -> Callable[_P, None]:
    """``main`` as a child process's entry point: :func:`lmprefetch._stopping.child_signals`
    first, and no traceback when the parent went away (its pipe closed under a receive or a
    send: the command is stopping, and says so once for all) or on Ctrl-C (status 130)."""

    @functools.wraps(main)
    def run(*args: _P.args, **kwargs: _P.kwargs) -> None:
        _stopping.child_signals()
        try:
            main(*args, **kwargs)
        except KeyboardInterrupt:
            sys.exit(130)
        except (EOFError, BrokenPipeError):
            sys.exit(1)

    return run


def start_process(
    ctx: mp.context.SpawnContext,
    target: Callable[..., None],
    args: Sequence[Any],
    procs: list[BaseProcess],
) -> BaseProcess:
    """Start ``target(*args)`` (a :func:`child_main`) in a child process, appended to ``procs``
    (before it starts: :func:`stop_processes` skips one that never did), under
    :func:`lmprefetch._stopping.spawning`: a stop signal takes effect once it has started, and
    it starts with the stop signals blocked."""
    proc = ctx.Process(target=target, args=tuple(args), daemon=True)
    procs.append(proc)
    with _stopping.deferred():
        # The spawn method starts multiprocessing's resource tracker on first use, and that
        # unblocks the stop signals when it is done: it must not happen inside spawning().
        resource_tracker.ensure_running()
    with _stopping.spawning():
        proc.start()
    return proc


def stop_processes(procs: Sequence[BaseProcess], grace_s: float) -> None:
    """End every process of ``procs`` that was started, and reap it.

    Each is given ``grace_s`` to exit on its own (the caller asked it to), a wait that a stop
    signal ends at once (then there is no grace at all); then SIGTERM, then SIGKILL to any
    still there a moment later.  Returns when none is left.
    """
    started = [p for p in procs if p.pid is not None]
    wake = _stopping.wakeup_fd()
    grace_s = 0.0 if _stopping.received() is not None else grace_s
    _wait_for_exit(started, grace_s, wake)
    alive = [p for p in started if p.exitcode is None]
    for p in alive:
        p.terminate()
    # A child still starting has SIGTERM blocked until its entry point runs: do not wait long.
    _wait_for_exit(alive, 0.2 if _stopping.received() is not None else 2.0, None)
    for p in alive:
        if p.exitcode is None:
            p.kill()
    for p in started:
        p.join()


def _wait_for_exit(procs: Sequence[BaseProcess], timeout_s: float, wake: int | None) -> None:
    """Until every one of ``procs`` has exited, ``timeout_s`` passed, or ``wake`` (a stop
    signal's file descriptor) is readable."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = [p for p in procs if p.exitcode is None]
        left = deadline - time.monotonic()
        if not alive or left <= 0:
            return
        watched: list[Any] = [p.sentinel for p in alive]
        if wake is not None:
            watched.append(wake)
        if wake is not None and wake in wait(watched, left):
            return


# -- worker processes -------------------------------------------------------------------
@child_main
def worker_main(
    conn: Connection,
    config_dict: dict[str, Any],
    rank: int,
    world_size: int,
    request_endpoint: str,
    response_endpoint: str,
    opts_dict: dict[str, Any],
    preload: bool = True,
) -> None:
    from ..runtime import WorkerRuntime

    config = PrefetchConfig.from_dict(config_dict)
    opts = BenchOptions(**opts_dict)
    runtime = WorkerRuntime.start(
        config,
        rank=rank,
        world_size=world_size,
        request_endpoint=request_endpoint,
        response_endpoint=response_endpoint,
    )
    try:
        workload = make_workload(opts) if preload else Workload()
        block = payload_block(config.chunk_bytes, rank)
        hasher = ChunkHasher.from_config(config)
        t0 = time.perf_counter()
        stored = 0
        # The parent's progress bar moves as the histories are stored (about 50 messages).
        every = max(1, len(workload.stored) // 50)
        for i, history in enumerate(workload.stored, 1):
            hashes = hasher.hash(history)
            # Each chunk's payload starts with its hash, so a mixed-up chunk would show.
            payloads = [h.to_bytes(8, "big") + block[8:] for h in hashes]
            stored += runtime.store_hashes(hashes, payloads)
            if opts.progress and i % every == 0:
                conn.send(("stored", i))
        runtime.call(runtime.engine.flush)
        conn.send(("ready", {"stored_chunks": stored, "store_s": time.perf_counter() - t0}))
        while True:
            cmd, arg = conn.recv()
            if cmd == "stats":
                conn.send(runtime.stats())
            elif cmd == "wait_idle":
                conn.send(_wait_idle(runtime, float(arg)))
            elif cmd == "cancel_probe":
                conn.send(_measure_cancel(runtime, int(arg)))
            elif cmd == "disk_probe":
                conn.send(_measure_disk(runtime, *arg))
            elif cmd == "stop":
                break
    finally:
        runtime.close()
    conn.send(("closed", None))


def _wait_idle(runtime: Any, timeout_s: float) -> dict[str, Any]:
    import trio

    async def wait() -> bool:
        with trio.move_on_after(timeout_s):
            await runtime.engine.wait_quiet()
        return bool(runtime.engine.is_idle())

    idle = runtime.call(wait)
    return {"idle": idle, **runtime.stats()}


def _measure_cancel(runtime: Any, n: int) -> dict[str, list[float]]:
    """Start a disk prefetch of 8 chunks, cancel it while its reads run, and time until
    everything is released (``released``); ``n`` times (the disk tier's keys are used in
    turn).  After each, time a bare hop to a worker thread and back on the same Trio thread
    (``thread_hop``): a release waits for the reads in flight to come back from their threads,
    so no release is faster than that hop on this machine at that moment."""
    import trio
    import trio.testing

    engine = runtime.engine
    disk = next((t for t in engine.tiers if t.name == "disk"), None)
    if disk is None:
        return {"released": [], "thread_hop": []}
    keys = disk.keys()
    groups = len(keys) // 8

    async def once(i: int) -> float:
        chunk_keys = keys[(i % groups) * 8 : (i % groups + 1) * 8]
        hashes = [k.chunk_hash for k in chunk_keys]
        for k in chunk_keys:  # make the disk tier the one that answers
            engine.cpu.discard(k)
        # Different hashes that are not a chain still load as a "prefix" per tier:
        # the probe walks keys in order, which is all this measurement needs.
        done: list[int] = []
        engine.start_lookup(f"cancel-probe-{i}", hashes, [1] * len(hashes), on_answer=done.append)
        await trio.testing.wait_all_tasks_blocked()  # the load is in flight (in its threads)
        t0 = time.perf_counter()
        engine.cancel(f"cancel-probe-{i}")
        await engine.wait_quiet()
        released = time.perf_counter() - t0
        assert engine.stats()["pinned_chunks"] == 0 and engine.limiter.used == 0
        return released

    async def hop() -> float:
        t0 = time.perf_counter()
        await trio.to_thread.run_sync(_nothing)
        return time.perf_counter() - t0

    async def run() -> dict[str, list[float]]:
        released, hops = [], []
        for i in range(n if groups else 0):
            released.append(await once(i))
            hops.append(await hop())
        return {"released": released, "thread_hop": hops}

    result: dict[str, list[float]] = runtime.call(run)
    return result


def _nothing() -> None:
    pass


#: Chunks per lookup of the disk probe (the engine benchmark's 16 x 2 MiB lookups).
DISK_PROBE_CHUNKS = 16


def _measure_disk(runtime: Any, concurrency: int, rounds: int) -> dict[str, Any]:
    """The disk figure, like with like: ``concurrency`` disk-only lookups at once (of
    :data:`DISK_PROBE_CHUNKS` chunks each, claimed and released), against a read of the very
    same files by ``concurrency`` threads at once, each ``preadv`` of a whole file into its own
    page-aligned buffer plus the xxh3 check a verified read makes (and without the check), and
    a plain read that puts each chunk in a buffer of its own, as a lookup must (it holds its
    chunks until they are claimed): ``held_read_gbps``, the limit of a lookup that reads a
    file verified once without hashing it again.  The four alternate, ``rounds`` times after
    one unmeasured round (which also faults in the held buffers, as the arena is); GB/s of
    payload bytes of each sample.  The lookups run on the worker's Trio loop, the plain reads
    in this thread's pool, in the same process."""
    import mmap
    from concurrent.futures import ThreadPoolExecutor

    import trio
    import xxhash

    from ..tiers.chunkfile import FILE_SUFFIX, HEADER_BYTES

    engine = runtime.engine
    disk = next((t for t in engine.tiers if t.name == "disk"), None)
    if disk is None:
        return {}
    keys = disk.keys()
    # At most DISK_PROBE_CHUNKS per lookup, fewer when the tier or the limiter (the chunks
    # that may load at once) has less room: every lookup must load all its chunks.
    room = min(len(keys), int(engine.stats()["limiter"]["total"]))
    concurrency = min(concurrency, room)
    n = min(DISK_PROBE_CHUNKS, room // concurrency) if concurrency else 0
    if n < 1:
        return {}
    groups = [keys[i * n : (i + 1) * n] for i in range(concurrency)]
    paths = [[os.path.join(disk.path, k.to_string() + FILE_SUFFIX) for k in g] for g in groups]
    slot_bytes = -(-(HEADER_BYTES + engine.config.chunk_bytes) // mmap.PAGESIZE) * mmap.PAGESIZE
    area = mmap.mmap(-1, slot_bytes * len(groups))
    whole = memoryview(area)
    slots = [whole[j * slot_bytes : (j + 1) * slot_bytes] for j in range(len(groups))]
    held_area = mmap.mmap(-1, slot_bytes * len(groups) * n)
    held_whole = memoryview(held_area)
    held = [
        [held_whole[(j * n + i) * slot_bytes : (j * n + i + 1) * slot_bytes] for i in range(n)]
        for j in range(len(groups))
    ]

    def read_group(j: int, how: str) -> int:
        payload = 0
        for i, path in enumerate(paths[j]):
            slot = held[j][i] if how == "held" else slots[j]
            fd = os.open(path, os.O_RDONLY)
            try:
                got = os.preadv(fd, [slot], 0)
            finally:
                os.close(fd)
            if how == "verified":
                with slot[HEADER_BYTES:got] as data:
                    xxhash.xxh3_64_intdigest(data)
            payload += got - HEADER_BYTES
        return payload

    def plain_round(pool: ThreadPoolExecutor, how: str) -> float:
        t0 = time.perf_counter()
        payload = sum(pool.map(read_group, range(len(groups)), [how] * len(groups)))
        return payload / (time.perf_counter() - t0) / 1e9

    async def prefetch_round(tag: str) -> float:
        for group in groups:  # disk only: nothing of these in the CPU tier
            for key in group:
                engine.cpu.discard(key)
        loaded: list[int] = []

        async def one(j: int) -> None:
            lookup_id = f"disk-probe-{tag}-{j}"
            hashes = [k.chunk_hash for k in groups[j]]
            # Hashes that are not a chain still load as a "prefix" per tier (see
            # _measure_cancel); offsets of 1 token per chunk.
            await engine.lookup_and_prefetch(lookup_id, hashes, [1] * len(hashes))
            with engine.claim(lookup_id) as items:
                loaded.append(sum(buf.length for _, buf in items))

        t0 = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for j in range(len(groups)):
                nursery.start_soon(one, j)
        dt = time.perf_counter() - t0
        return sum(loaded) / dt / 1e9

    out: dict[str, Any] = {
        "concurrency": len(groups),
        "chunks_per_lookup": n,
        "prefetch_gbps": [],
        "verified_read_gbps": [],
        "raw_read_gbps": [],
        "held_read_gbps": [],
    }
    trusted0, verified0 = disk.trusted_reads, disk.verified_reads
    try:
        with ThreadPoolExecutor(len(groups)) as pool:
            for r in range(rounds + 1):  # round 0 warms up and is not kept
                order = ["prefetch_gbps", "verified_read_gbps", "raw_read_gbps", "held_read_gbps"]
                if r % 2:  # alternate who goes first
                    order.reverse()
                for name in order:
                    if name == "prefetch_gbps":
                        gbps = float(runtime.call(prefetch_round, str(r)))
                    else:
                        gbps = plain_round(pool, name.removesuffix("_read_gbps"))
                    if r:
                        out[name].append(gbps)
    finally:
        for slot in slots:
            slot.release()
        for group_slots in held:
            for slot in group_slots:
                slot.release()
        whole.release()
        held_whole.release()
        area.close()
        held_area.close()
    out["reads_trusted"] = disk.trusted_reads - trusted0
    out["reads_hashed"] = disk.verified_reads - verified0
    return out


@child_main
def echo_main(pull_endpoint: str, push_endpoint: str, ready: Connection | None = None) -> None:
    """Echo every message from ``pull_endpoint`` (bound) to ``push_endpoint`` until
    ``b"stop"``; ``"ready"`` is sent on ``ready`` (a pipe's end) once both sockets are set
    up."""
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind(pull_endpoint)
    push = ctx.socket(zmq.PUSH)
    push.connect(push_endpoint)
    if ready is not None:
        ready.send("ready")
    try:
        while True:
            msg = pull.recv()
            if msg == b"stop":
                break
            push.send(msg)
    finally:
        pull.close(0)
        push.close(0)
        ctx.term()


@child_main
def trio_echo_main(pull_endpoint: str, push_endpoint: str, ready: Connection | None = None) -> None:
    """The same echo on lmprefetch's Trio-native sockets: the floor for any Trio worker."""
    import trio

    from ..transport import TrioZmqSocket, close_context, make_pull, make_push, open_context

    async def main() -> None:
        ctx = open_context()
        pull = TrioZmqSocket(make_pull(ctx, pull_endpoint, bind=True, hwm=1000))
        push = TrioZmqSocket(make_push(ctx, push_endpoint, bind=False, hwm=1000))
        if ready is not None:
            ready.send("ready")
        try:
            while True:
                for msg in await pull.recv_batch(64):
                    if msg == b"stop":
                        return
                    push.send_nowait(msg)
        finally:
            close_context(ctx, [pull, push])

    trio.run(main)
