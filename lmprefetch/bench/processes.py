"""The processes a benchmark run starts: worker ranks, and the echo peers that measure the
transport's physical limit."""

from __future__ import annotations

import time
from multiprocessing.connection import Connection
from typing import Any

import zmq

from ..config import PrefetchConfig
from ..hashing import ChunkHasher
from .workload import BenchOptions, Workload, make_workload, payload_block

__all__ = ["echo_main", "trio_echo_main", "worker_main"]

# -- worker processes -------------------------------------------------------------------
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
        for history in workload.stored:
            hashes = hasher.hash(history)
            # Each chunk's payload starts with its hash, so a mixed-up chunk would show.
            payloads = [h.to_bytes(8, "big") + block[8:] for h in hashes]
            stored += runtime.store_hashes(hashes, payloads)
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


def _measure_cancel(runtime: Any, n: int) -> list[float]:
    """Start a disk prefetch of 8 chunks, cancel it while its reads run, and time until
    everything is released; ``n`` times (the disk tier's keys are used in turn)."""
    import trio
    import trio.testing

    engine = runtime.engine
    disk = next((t for t in engine.tiers if t.name == "disk"), None)
    if disk is None:
        return []
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

    async def run() -> list[float]:
        return [await once(i) for i in range(n if groups else 0)]

    result: list[float] = runtime.call(run)
    return result


def echo_main(pull_endpoint: str, push_endpoint: str, ready: Any = None) -> None:
    """Echo every message from ``pull_endpoint`` (bound) to ``push_endpoint`` until
    ``b"stop"``; ``ready`` (a multiprocessing event) is set once both sockets are set up."""
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind(pull_endpoint)
    push = ctx.socket(zmq.PUSH)
    push.connect(push_endpoint)
    if ready is not None:
        ready.set()
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


def trio_echo_main(pull_endpoint: str, push_endpoint: str, ready: Any = None) -> None:
    """The same echo on lmprefetch's Trio-native sockets: the floor for any Trio worker."""
    import trio

    from ..transport import TrioZmqSocket, close_context, make_pull, make_push, open_context

    async def main() -> None:
        ctx = open_context()
        pull = TrioZmqSocket(make_pull(ctx, pull_endpoint, bind=True, hwm=1000))
        push = TrioZmqSocket(make_push(ctx, push_endpoint, bind=False, hwm=1000))
        if ready is not None:
            ready.set()
        try:
            while True:
                for msg in await pull.recv_batch(64):
                    if msg == b"stop":
                        return
                    push.send_nowait(msg)
        finally:
            close_context(ctx, [pull, push])

    trio.run(main)
