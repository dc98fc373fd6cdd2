"""What the remote tiers (Redis, Mooncake) share: calls in worker threads, back-off, write-behind,
closing.

A remote tier talks to its store through a blocking client, so every call runs in
``trio.to_thread.run_sync`` under a :class:`trio.CapacityLimiter` of ``threads`` tokens and the
Trio thread never blocks.  A call that touches no arena memory is bounded by ``timeout_s`` and
abandoned at its deadline or on cancellation (:meth:`RemoteTier._call_abandoning`); an abandoned
thread keeps its limiter token until it really ends.

**Back-off.**  A failed or timed-out call is counted in ``stats.errors`` and starts a back-off
(``backoff_initial_s``, doubling up to ``backoff_max_s``, on ``trio.current_time()``): while it
lasts the tier answers "no more hits" at once, without a thread, and drops writes (counted in
``stats.writes_dropped``); the first call after it tries again, and a success resets it.  So a
lookup gets the prefix found before the failure, promptly, never an exception (D05).

**Write-behind.**  :meth:`RemoteTier.enqueue_write` is synchronous and never blocks: it queues
the buffer (taking a reference) or drops the write when the tier cannot take it now; one writer
task (:meth:`RemoteTier.run_writer`) hands the queue to the tier's ``_write_batch`` in batches
(see :mod:`lmprefetch.tiers.writebehind`).

**Closing** (:meth:`RemoteTier.aclose`): flush what is queued (bounded), drop the rest, own
every limiter token (every thread, abandoned ones too, has ended then), and only then close
the client (the tier's ``_close_client``), so no call is pulled from under a thread.

The ``Dnn`` codes are LMCache's defects, the rows of the defect table in
``docs/cancellation.md`` ("The defects"), each with its ``test_dNN_`` regression tests.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import asynccontextmanager
from typing import ClassVar, Final, ParamSpec, TypeVar

import trio

from ..codec import ChunkStage, get_codec
from ..keys import ChunkKey
from ..memory import Buffer
from .base import BaseTier
from .writebehind import WriteBehindQueue, WriteEntry, WritesBehind

__all__ = [
    "CLOSE_TIMEOUT_S",
    "CONNECT_SLACK_S",
    "KEY_PREFIX",
    "RemoteTier",
    "Unavailable",
    "load_batches",
    "timed",
]

_T = TypeVar("_T")
_P = ParamSpec("_P")

#: Prefix of every key a remote tier stores a chunk under (Redis and Mooncake name a chunk
#: alike: ``KEY_PREFIX + key.to_string()``).
KEY_PREFIX: Final = "lmprefetch:"
#: How long closing waits for queued writes, then for the threads, then for the client.
CLOSE_TIMEOUT_S: Final = 10.0
#: Added to the deadline of the first connection (a client's set-up costs more than a call).
CONNECT_SLACK_S: Final = 5.0


def timed(fn: Callable[_P, _T], spent: list[float]) -> Callable[_P, _T]:
    """``fn``, appending the seconds each call took to ``spent`` (in the thread that runs it:
    a write's own time, without the wait for a thread or the hand-offs)."""

    def run(*args: _P.args, **kwargs: _P.kwargs) -> _T:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent.append(time.perf_counter() - t0)

    return run


class Unavailable(Exception):
    """A remote call did not happen or failed (already counted); the caller stops here."""


def load_batches(
    buffers: Sequence[Buffer], *, max_bytes: int, max_keys: int | None = None
) -> Iterator[tuple[int, int]]:
    """The ``(start, end)`` bounds of consecutive batches of ``buffers``, one remote call
    each, in order: at most ``max_keys`` buffers and ``max_bytes`` of buffer capacity, and at
    least one buffer."""
    total = len(buffers)
    start = 0
    while start < total:
        end = start + 1
        budget = buffers[start].capacity
        while (
            end < total
            and (max_keys is None or end - start < max_keys)
            and budget + buffers[end].capacity <= max_bytes
        ):
            budget += buffers[end].capacity
            end += 1
        yield start, end
        start = end


class RemoteTier(WritesBehind, BaseTier):
    """The part of a remote tier that does not depend on its store (see the module docstring).

    A subclass sets its ``name`` and write batch bounds, implements ``_write_batch`` and
    ``_close_client``, and may narrow :meth:`_usable` (no client yet) and widen
    :meth:`_limiters` (more thread pools).

    Args:
        timeout_s: deadline of one call.
        threads: concurrent calls (worker threads).
        write_queue: writes waiting for the writer; past it writes are dropped and counted.
        backoff_initial_s: first back-off after a failure; doubles on every further failure.
        backoff_max_s: ceiling of the back-off.
        stage: the codec stage (the tier's codec, encryption); ``None``: payloads as they are.

    Raises:
        ValueError: a setting is out of range.
    """

    #: One write batch: at most this many keys and payload bytes.
    write_batch_keys: ClassVar[int] = 16
    write_batch_bytes: ClassVar[int] = 32 * 1024 * 1024

    def __init__(
        self,
        *,
        timeout_s: float,
        threads: int,
        write_queue: int,
        backoff_initial_s: float,
        backoff_max_s: float,
        stage: ChunkStage | None = None,
    ) -> None:
        super().__init__()
        #: What the tier stores a payload as, and reads it back with (docs/codecs.md).
        self.stage = stage if stage is not None else ChunkStage(get_codec("none"))
        if not (math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(f"timeout_s: must be a positive number, got {timeout_s!r}")
        if threads < 1 or write_queue < 1:
            raise ValueError("threads and write_queue must be at least 1")
        if not 0 < backoff_initial_s <= backoff_max_s:
            raise ValueError("backoff: need 0 < backoff_initial_s <= backoff_max_s")
        self._timeout_s = timeout_s
        # The tier's own logger (lmprefetch.tiers.redis, ...), as operators filter by it.
        self._log = logging.getLogger(type(self).__module__)
        self._limiter = trio.CapacityLimiter(threads)
        # Guards the hand-over of a client between worker threads and the Trio thread, and
        # _closed: a thread that builds a client after the tier closed closes it itself.
        self._lock = threading.Lock()
        self._closed = False
        # back-off (Trio thread only)
        self._backoff_initial_s = backoff_initial_s
        self._backoff_max_s = backoff_max_s
        self._next_backoff_s = backoff_initial_s
        self._retry_at = -math.inf
        # write-behind (Trio thread only)
        self._writes = WriteBehindQueue(write_queue, self.stats)

    @property
    def per_tenant(self) -> bool:
        """Chunks are sealed per tenant: loads and writes take the request's tenant."""
        return self.stage.per_tenant

    # -- back-off --------------------------------------------------------------------------
    @property
    def backing_off(self) -> bool:
        """``True`` while the tier answers without touching the network after a failure."""
        return trio.current_time() < self._retry_at

    @property
    def retry_at(self) -> float:
        """The ``trio.current_time()`` from which calls are tried again (in the past, or
        ``-inf``, when the tier is not backing off)."""
        return self._retry_at

    def _failed(self, what: str, cause: object) -> None:
        """Count a failed call and start (or lengthen) the back-off."""
        self.stats.errors += 1
        if not self.backing_off:
            self._log.warning(
                "%s tier: %s failed (%s); backing off %.3g s",
                self.name,
                what,
                cause if cause is not None else "no answer",
                self._next_backoff_s,
            )
        self._retry_at = trio.current_time() + self._next_backoff_s
        self._next_backoff_s = min(self._next_backoff_s * 2, self._backoff_max_s)

    def _succeeded(self) -> None:
        """A call succeeded: the back-off ends and starts from ``backoff_initial_s`` again."""
        if self._next_backoff_s != self._backoff_initial_s:
            self._log.info("%s tier: calls succeed again", self.name)
        self._retry_at = -math.inf
        self._next_backoff_s = self._backoff_initial_s

    def _usable(self) -> bool:
        """Whether calls may go out now: not closed, not backing off."""
        return not self._closed and not self.backing_off

    # -- calls in worker threads ---------------------------------------------------------
    async def _call_abandoning(
        self, what: str, fn: Callable[[], _T], *, deadline_s: float | None = None
    ) -> _T:
        """Run ``fn()`` in a worker thread under the limiter and the per-call deadline (or
        ``deadline_s``); ``fn`` must touch no arena memory, since the thread is abandoned at
        the deadline or on cancellation (``Cancelled`` propagates) and finishes on its own.

        Returns ``fn``'s result.  Raises :class:`Unavailable`: after a checkpoint, without a
        thread, when the tier is not :meth:`_usable`; after counting the failure and starting
        a back-off when ``fn`` raises or misses its deadline.  Waiting for a free thread counts
        against the deadline, but a call that never got a thread starts no back-off.
        """
        if not self._usable():
            await trio.lowlevel.checkpoint()
            raise Unavailable
        started: list[bool] = []

        def run() -> _T:
            started.append(True)
            return fn()

        timeout_s = self._timeout_s if deadline_s is None else deadline_s
        with trio.move_on_after(timeout_s):
            try:
                return await trio.to_thread.run_sync(
                    run, abandon_on_cancel=True, limiter=self._limiter
                )
            except Exception as exc:  # the client's errors, of every kind (D05)
                self._failed(what, exc)
                raise Unavailable from None
        if started:
            self._failed(what, f"no answer within {timeout_s:.3g} s")
        else:
            self._log.debug(
                "%s tier: %s found no free thread within %.3g s", self.name, what, timeout_s
            )
        raise Unavailable

    def _limiters(self) -> Sequence[trio.CapacityLimiter]:
        """Every pool of worker threads that may use the client (owned back on close)."""
        return (self._limiter,)

    # -- write-behind ----------------------------------------------------------------------
    def enqueue_write(self, key: ChunkKey, buf: Buffer, *, tenant: bytes = b"") -> bool:
        """Queue ``buf``'s payload for storing under ``key`` (synchronous, never blocks);
        ``tenant`` is whom it is sealed for (with encryption on).

        Takes its own reference on ``buf``, held until the writer is done with the bytes.
        Returns ``False``, counting ``stats.writes_dropped``, when the queue is full or the
        tier cannot take writes now (closed, backing off, no client yet)."""
        if not self._usable():
            self.stats.writes_dropped += 1
            return False
        return self._writes.put(key, buf, tenant=tenant)

    async def run_writer(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """The write-behind loop (runs until cancelled): ``_write_batch`` on what is queued,
        in order, in batches of at most ``write_batch_keys`` keys and ``write_batch_bytes``."""
        await self._writes.run(
            self._write_batch,
            batch_keys=self.write_batch_keys,
            batch_bytes=self.write_batch_bytes,
            task_status=task_status,
        )

    async def _write_batch(self, batch: list[WriteEntry]) -> None:  # pragma: no cover
        raise NotImplementedError

    # -- running and closing -----------------------------------------------------------
    @asynccontextmanager
    async def running(
        self,
        connect: Callable[[], Awaitable[object]],
        *tasks: Callable[..., Awaitable[None]],
    ) -> AsyncIterator[None]:
        """What a tier's ``open_*`` function does around its block: ``connect()`` (which does
        not fail for a store that is down), then run the writer and ``tasks`` (each started with
        ``nursery.start``) until the block exits; then flush what is queued (shielded, at most
        ``CLOSE_TIMEOUT_S``), stop them, and :meth:`aclose`, on every path."""
        try:
            await connect()
            async with trio.open_nursery() as nursery:
                await nursery.start(self.run_writer)
                for task in tasks:
                    await nursery.start(task)
                try:
                    yield
                finally:
                    with trio.move_on_after(CLOSE_TIMEOUT_S, shield=True):
                        await self.flush()
                    nursery.cancel_scope.cancel()
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        """Flush queued writes (if the writer runs, bounded), drop the rest, wait for every
        thread (bounded), then close the client.  Shielded from cancellation; idempotent."""
        if self._closed:
            await trio.lowlevel.checkpoint()  # closing again is a no-op, and a checkpoint
            return
        with trio.CancelScope(shield=True):
            await self._flush_before_close(CLOSE_TIMEOUT_S)
            with self._lock:
                self._closed = True
            self._writes.drop_queued()
            # Every thread (abandoned ones too) holds a limiter token until it really ends:
            # owning all tokens means no thread uses the client any more.
            owned: list[tuple[trio.CapacityLimiter, object]] = []
            try:
                with trio.move_on_after(CLOSE_TIMEOUT_S) as waited:
                    for limiter in self._limiters():
                        for _ in range(int(limiter.total_tokens)):
                            borrower = object()
                            await limiter.acquire_on_behalf_of(borrower)
                            owned.append((limiter, borrower))
                await self._close_client(threads_ended=not waited.cancelled_caught)
            finally:
                for limiter, borrower in owned:
                    limiter.release_on_behalf_of(borrower)

    async def _close_client(self, *, threads_ended: bool) -> None:  # pragma: no cover
        """Close the client (shielded; the tier is closed, its threads ended unless
        ``threads_ended`` is false: a call outlived ``CLOSE_TIMEOUT_S``)."""
        raise NotImplementedError
