"""Worker processes for end-to-end tests: real `WorkerRuntime`s over ipc, controlled by a pipe."""

from __future__ import annotations

import multiprocessing as mp
import threading
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from lmprefetch import PrefetchConfig

Preload = Sequence[tuple[list[int], list[bytes]]]


def _worker_main(
    conn: Connection,
    config_dict: dict[str, Any],
    rank: int,
    world_size: int,
    request_endpoint: str,
    response_endpoint: str,
    preload: Preload,
    metrics: bool,
) -> None:
    import trio

    from lmprefetch import WorkerRuntime

    runtime = WorkerRuntime.start(
        PrefetchConfig.from_dict(config_dict),
        rank=rank,
        world_size=world_size,
        request_endpoint=request_endpoint,
        response_endpoint=response_endpoint,
        metrics_port=0 if metrics else None,
    )
    engine = runtime.engine
    # Every message the server handles reaches the engine as start_lookup or cancel: wrap
    # both (before any message can arrive) so that wait_idle can wait for the next one.
    changed: list[trio.Event] = []

    def signalling(method: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return method(*args, **kwargs)
            finally:
                for event in changed:
                    event.set()

        return call

    for name in ("start_lookup", "cancel"):
        setattr(engine, name, signalling(getattr(engine, name)))
    for tokens, payloads in preload:
        runtime.store(tokens, payloads)
    conn.send(("ready", runtime.metrics_port))

    async def wait_idle(timeout_s: float) -> bool:
        with trio.move_on_after(timeout_s):
            while not engine.is_idle():
                event = trio.Event()
                changed.append(event)
                try:
                    await engine.wait_quiet()  # every lookup task ended
                    if not engine.is_idle():
                        await event.wait()  # a held result waits for its cleanup message
                finally:
                    changed.remove(event)
        return bool(engine.is_idle())

    held_reads: list[threading.Event] = []  # [a read reached the gate, the gate is open]

    def hold_disk_reads() -> None:
        """From now on every chunk read of the disk tier waits (in its worker thread) until
        ``release_disk_reads``: a lookup that loads from disk stays in flight."""
        (disk,) = [t for t in engine.tiers if t.name == "disk"]
        reached, gate = threading.Event(), threading.Event()
        read = disk._read_chunk

        def held(*args: Any) -> Any:
            reached.set()
            gate.wait(60)
            return read(*args)

        disk._read_chunk = held  # type: ignore[method-assign]
        held_reads[:] = [reached, gate]

    while True:
        cmd, arg = conn.recv()
        if cmd == "hold_disk_reads":
            conn.send(runtime.call(hold_disk_reads))
        elif cmd == "wait_read_held":
            conn.send(held_reads[0].wait(float(arg)))
        elif cmd == "release_disk_reads":
            held_reads[1].set()
            conn.send(True)
        elif cmd == "stats":
            conn.send(runtime.stats())
        elif cmd == "claim":
            with runtime.claim(arg) as chunks:
                conn.send([bytes(buf.view()) for _, buf in chunks])
        elif cmd == "wait_idle":
            conn.send(runtime.call(wait_idle, float(arg)))
        elif cmd == "close":
            arena = engine.arena
            runtime.close()
            conn.send(arena.used_slots)
            return


@dataclass
class WorkerHandle:
    rank: int
    process: Any
    conn: Connection
    request_endpoint: str
    metrics_port: int | None = None

    def ask(self, cmd: str, arg: Any = None, timeout_s: float = 30.0) -> Any:
        self.conn.send((cmd, arg))
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"worker {self.rank} did not answer {cmd!r}")
        return self.conn.recv()

    def kill(self) -> None:
        self.process.kill()
        self.process.join(10)


@contextmanager
def start_workers(
    config: PrefetchConfig,
    preloads: Sequence[Preload],
    *,
    start: Sequence[int] | None = None,
    metrics: bool = False,
) -> Iterator[tuple[list[str], str, dict[int, WorkerHandle]]]:
    """Start one worker process per entry of ``preloads`` (or only the ranks in ``start``).

    Yields the request endpoints of all ranks, the scheduler's response endpoint, and the
    handles of the started workers.  Every started process is stopped (or killed) on exit.
    """
    ctx = mp.get_context("spawn")
    tag = uuid.uuid4().hex[:10]
    world = len(preloads)
    endpoints = [f"ipc://@lmp-e2e-{tag}-w{r}" for r in range(world)]
    response = f"ipc://@lmp-e2e-{tag}-sched"
    handles: dict[int, WorkerHandle] = {}
    try:
        for rank in start if start is not None else range(world):
            parent, child = ctx.Pipe()
            p = ctx.Process(
                target=_worker_main,
                args=(
                    child,
                    config.to_dict(),
                    rank,
                    world,
                    endpoints[rank],
                    response,
                    list(preloads[rank]),
                    metrics,
                ),
                daemon=True,
            )
            p.start()
            handles[rank] = WorkerHandle(rank, p, parent, endpoints[rank])
        for h in handles.values():
            if not h.conn.poll(120):
                raise TimeoutError(f"worker {h.rank} did not start")
            _, h.metrics_port = h.conn.recv()
        yield endpoints, response, handles
    finally:
        for h in handles.values():
            if h.process.is_alive():
                try:
                    h.ask("close", timeout_s=30)
                except (TimeoutError, EOFError, OSError):
                    pass
                h.process.join(30)
            if h.process.is_alive():
                h.kill()
