"""The write-behind queue shared by the tiers that store slowly (disk, Redis, Mooncake).

:meth:`Engine.store` puts a chunk in the CPU tier at once and hands the *same arena buffer*
to every slower tier's :meth:`WriteBehindQueue.put`, which takes its own owner reference and
returns without waiting.  One writer task per tier (:meth:`WriteBehindQueue.run`) takes the
queue in order, a batch at a time, and calls the tier's ``write(batch)``.  So a store never
waits for a disk or a network, and the model step that stores never does I/O.

Ownership: every :class:`WriteEntry` owns one reference on its buffer from :meth:`put` until
exactly one of these releases it: the tier's ``write`` (which may release early, e.g. once the
bytes are copied out, with :meth:`WriteEntry.take_buffer`), the writer loop after ``write``
returns or raises, :meth:`WriteBehindQueue.remove` of a queued entry, or the loop's exit (the
tier closing), which drops and releases whatever is still queued.

``flush`` has one meaning for every tier: **wait until every write put before the call has been
handled** — written, or dropped and counted in ``stats.writes_dropped``.  Writes put after the
call are not waited for.  Waiting is cancellable; the writes go on.

Accounting: a ``write(batch)`` that returns has counted each entry itself (``chunks_stored`` /
``bytes_stored``, or ``writes_dropped``); if it raises (a cancelled writer at shutdown), every
entry of the batch that it had not finished is counted as dropped here.

Cancellation: the writer loop is cancelled only by its tier's shutdown, after a bounded flush.
Everything here is synchronous except the waits in :meth:`flush` and :meth:`run`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Awaitable, Callable

import trio

from ..keys import ChunkKey
from ..memory import Buffer
from .base import TierStats

__all__ = ["WriteBehindQueue", "WriteEntry", "WritesBehind"]


class WriteEntry:
    """One queued write: ``key``, one owner reference on ``buf`` (until released), and the
    tenant the chunk belongs to (whom a tier that encrypts seals it for; ``b""``: the shared
    name space)."""

    __slots__ = ("_buf", "key", "removed", "seq", "tenant", "written")

    def __init__(self, key: ChunkKey, buf: Buffer, seq: int, tenant: bytes = b"") -> None:
        self.key = key
        self._buf: Buffer | None = buf
        self.seq = seq
        self.tenant = tenant
        #: :meth:`WriteBehindQueue.remove` came for this key (while queued or being written).
        self.removed = False
        #: Set by the tier's ``write`` once the entry is accounted (stored or dropped).
        self.written = False

    def __repr__(self) -> str:
        state = "removed" if self.removed else "written" if self.written else "pending"
        return f"<write {self.key.to_string()} seq={self.seq} {state}>"

    @property
    def buffer(self) -> Buffer | None:
        """The buffer, while this entry still owns its reference."""
        return self._buf

    def take_buffer(self) -> Buffer | None:
        """Take over the entry's reference (the caller must release it), or ``None``."""
        buf, self._buf = self._buf, None
        return buf

    def release(self) -> None:
        """Release the entry's reference if it still holds one (idempotent)."""
        buf, self._buf = self._buf, None
        if buf is not None:
            buf.release()


WriteBatch = Callable[[list[WriteEntry]], Awaitable[None]]


class WriteBehindQueue:
    """A bounded FIFO of :class:`WriteEntry` and the loop that drains it.

    Args:
        capacity: entries that may wait (queued, not being written); past it :meth:`put`
            drops and counts.
        stats: the tier's counters (``writes_dropped`` is counted here).
    """

    def __init__(self, capacity: int, stats: TierStats) -> None:
        if capacity < 1:
            raise ValueError(f"write_queue: must be at least 1, got {capacity}")
        self.capacity = capacity
        self._stats = stats
        self._queue: deque[WriteEntry] = deque()
        self._queued: dict[ChunkKey, WriteEntry] = {}
        self._in_flight: list[WriteEntry] = []
        self._put_seq = 0
        self._done_seq = 0
        self._work = trio.lowlevel.ParkingLot()  # the writer waits here for entries
        self._progress = trio.lowlevel.ParkingLot()  # flush() waits here for the writer
        self._closed = False
        self._running = False

    def __repr__(self) -> str:
        return (
            f"<WriteBehindQueue queued={len(self._queue)} in_flight={len(self._in_flight)} "
            f"closed={self._closed}>"
        )

    # -- the producer side (synchronous, never blocks) -----------------------------------
    def put(self, key: ChunkKey, buf: Buffer, *, tenant: bytes = b"") -> bool:
        """Queue a write of ``buf``'s payload under ``key`` for ``tenant``, taking an owner
        reference.

        Returns:
            ``False`` (and counts ``writes_dropped``) when the queue is full or closed.
        """
        if self._closed or len(self._queue) >= self.capacity:
            self._stats.writes_dropped += 1
            return False
        self._put_seq += 1
        entry = WriteEntry(key, buf.retain(), self._put_seq, tenant)
        self._queue.append(entry)
        self._queued[key] = entry
        self._work.unpark()
        return True

    def has(self, key: ChunkKey) -> bool:
        """Whether a write of ``key`` is queued or being written (and was not removed)."""
        if key in self._queued:
            return True
        return any(e.key == key and not e.removed for e in self._in_flight)

    def remove(self, key: ChunkKey) -> bool:
        """Forget the pending write of ``key``: a queued one is dropped (its reference
        released at once); one being written is marked ``removed`` for the tier's ``write``
        to undo.  ``True`` if there was one."""
        found = False
        entry = self._queued.pop(key, None)
        if entry is not None:
            entry.removed = True
            entry.release()
            found = True
        for entry in self._in_flight:
            if entry.key == key and not entry.removed:
                entry.removed = True
                found = True
        return found

    @property
    def pending(self) -> int:
        """Writes queued or being written."""
        return len(self._queued) + sum(1 for e in self._in_flight if not e.written)

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Refuse new writes from now on (they are dropped and counted)."""
        self._closed = True

    # -- waiting ------------------------------------------------------------------------
    async def flush(self) -> None:
        """Wait until every write put before this call has been written or dropped.

        Always a checkpoint.  Cancellation: the wait ends; the writes go on.

        Raises:
            RuntimeError: writes are waiting but no writer loop runs.
        """
        target = self._put_seq
        if self._done_seq >= target:
            await trio.lowlevel.checkpoint()
            return
        while self._done_seq < target:
            if not self._running:
                raise RuntimeError("write-behind: writes are queued but no writer runs")
            await self._progress.park()

    # -- the consumer side -----------------------------------------------------------------
    async def run(
        self,
        write: WriteBatch,
        *,
        batch_keys: int = 1,
        batch_bytes: int | None = None,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """The writer loop: take up to ``batch_keys`` entries (and ``batch_bytes`` payload
        bytes, at least one entry) in order and ``await write(batch)``, until cancelled.

        On exit the queue is closed and every entry still queued is dropped, counted and
        released, so each reference :meth:`put` took is released exactly once.
        """
        self._running = True
        task_status.started()
        try:
            while True:
                while not self._queue:
                    await self._work.park()
                batch = self._take(batch_keys, batch_bytes)
                self._in_flight = batch
                try:
                    await write(batch)
                except BaseException:
                    self._stats.writes_dropped += sum(
                        1 for e in batch if not e.written and not e.removed
                    )
                    raise
                finally:
                    for entry in batch:
                        entry.written = True
                        entry.release()
                    self._in_flight = []
                    self._done_seq = batch[-1].seq
                    self._progress.unpark_all()
        finally:
            self._running = False
            self._closed = True
            self.drop_queued()

    def _take(self, batch_keys: int, batch_bytes: int | None) -> list[WriteEntry]:
        batch: list[WriteEntry] = []
        size = 0
        queue, queued = self._queue, self._queued
        while queue and len(batch) < batch_keys:
            entry = queue[0]
            buf = entry.buffer
            length = 0 if buf is None else buf.length
            if batch and batch_bytes is not None and size + length > batch_bytes:
                break
            queue.popleft()
            if queued.get(entry.key) is entry:
                del queued[entry.key]
            batch.append(entry)
            size += length
        return batch

    def drop_queued(self) -> None:
        """Drop every queued (not yet taken) write: count it and release its reference."""
        while self._queue:
            entry = self._queue.popleft()
            if self._queued.get(entry.key) is entry:
                del self._queued[entry.key]
            if not entry.removed:
                self._stats.writes_dropped += 1
            entry.release()
            self._done_seq = entry.seq
        self._progress.unpark_all()


class WritesBehind:
    """The write-behind side every slow tier shares (disk, Redis, Mooncake): :meth:`store`
    queues, :meth:`flush` waits, :attr:`queued_writes` counts.  A tier makes ``self._writes``,
    runs its writer loop, and decides in its own ``enqueue_write`` what it takes."""

    _writes: WriteBehindQueue

    def enqueue_write(  # pragma: no cover - abstract
        self, key: ChunkKey, buf: Buffer, *, tenant: bytes = b""
    ) -> bool:
        raise NotImplementedError

    async def store(self, key: ChunkKey, payload: Buffer) -> bool:
        """:meth:`enqueue_write` (write-behind: ``True`` means queued, not yet written; see
        :meth:`flush`)."""
        await trio.lowlevel.checkpoint()
        return self.enqueue_write(key, payload)

    @property
    def queued_writes(self) -> int:
        """Writes queued or being written."""
        return self._writes.pending

    async def flush(self) -> None:
        """Wait until every write queued before this call was written (or dropped).

        Cancellation: the wait ends; the writes go on.

        Raises:
            RuntimeError: writes are queued but no writer runs (open the tier with its
                ``open_*`` function, which runs it).
        """
        await self._writes.flush()

    async def _flush_before_close(self, timeout_s: float) -> bool:
        """Refuse new writes, then wait (shielded, at most ``timeout_s``) for the queued ones;
        whether every one was written or dropped by then.  With no writer running nothing is
        waited for: the caller drops what is queued."""
        self._writes.close()
        with trio.move_on_after(timeout_s, shield=True) as waited:
            try:
                await self.flush()
            except RuntimeError:  # no writer runs
                return False
        return not waited.cancelled_caught
