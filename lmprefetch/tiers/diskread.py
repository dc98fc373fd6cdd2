"""A disk load's read threads: the chunks they share, and reading one chunk into its slot.

:class:`DiskTier <lmprefetch.tiers.disk.DiskTier>` runs a load on the Trio thread (the index,
the pins, the outcome of each chunk); everything here but :meth:`ChunkReads._in_thread` and
:meth:`ChunkReads._reader` runs in the read threads.  A load's chunks are a :class:`_LoadRun`:
threads take them in order, each outcome written by the one thread that took the chunk.

The page-cache pass.  Most disk hits find their files in the page cache, where a read is a
copy bound by memory bandwidth, which a second thread does not add to (docs/benchmarks.md,
the phase budget), and each thread call costs two hand-offs between the Trio thread and a
worker.  So a load first reads its chunks in one thread call, in order, with ``RWF_NOWAIT``
(:func:`chunkfile.read_buffered` with ``nowait``): a read that would wait for the device raises
:class:`chunkfile.NotCached` instead, the chunk is put back, and the rest of the load goes to
up to ``read_threads`` thread calls that may wait (a device serves several reads at once
faster than one after the other).  A file system that refuses ``RWF_NOWAIT`` turns the pass off
for good, as ``EINVAL`` does ``O_DIRECT``; with ``O_DIRECT`` on there is no pass.

Cancellation.  A thread checks before every chunk, and between the pieces of a chunk, whether
the load was cancelled: the one-call paths through :func:`trio.from_thread.check_cancelled`,
the several-thread path through the run's ``stop`` flag, set synchronously in the abort
callback of the load's cancellation.  Threads write into the caller's buffers, so they are
never abandoned: a cancelled load waits for at most one piece per thread
(:data:`chunkfile.PIECE_BYTES`), then its buffers may be freed.
"""

from __future__ import annotations

import mmap
import threading
import time
from bisect import insort
from collections.abc import Callable
from typing import NamedTuple

import trio

from .._phases import Phases, perf_counter, to_thread_timed
from ..codec import ChunkStage, CodecMiss
from . import chunkfile
from .chunkfile import FileIdentity

#: Chunks one thread call reads at most before handing its read-limiter token back.
_CHUNKS_PER_THREAD_CALL = 8

#: File path, key string, destination slot, and the file's identity if it may skip the hash.
_ReadJob = tuple[str, bytes, memoryview, FileIdentity | None]


class _Loaded(NamedTuple):
    """A chunk read into its slot, verified (or trusted), and decoded."""

    #: The file's read: ``read.payload_bytes`` are the stored bytes (the encoded chunk).
    read: chunkfile.ChunkRead
    #: Read with ``O_DIRECT``.
    direct: bool
    #: This host's clock when the read began (before the file was opened).
    started_ns: int
    #: Bytes of payload now at the start of the slot (after decoding).
    payload_bytes: int
    #: Seconds the codec stage took to decode it (0 for a payload stored as it is), and
    #: whether it decoded anything.
    decode_s: float = 0.0
    decoded: bool = False


class _Undecodable(chunkfile.ChunkMiss):
    """A chunk file whose contents the codec stage refused (it has been unlinked)."""


#: A chunk read's outcome, or why it missed.
_ReadOutcome = _Loaded | chunkfile.ChunkMiss | OSError

#: Per-thread page-aligned buffers that encoded chunks are read into before decoding.
_scratch = threading.local()


def _read_scratch(nbytes: int) -> memoryview:
    """A page-aligned buffer of at least ``nbytes`` for this thread (an anonymous mapping, so
    ``O_DIRECT`` reads can land in it), reused from chunk to chunk."""
    size = -(-nbytes // chunkfile.ALIGN) * chunkfile.ALIGN
    region: mmap.mmap | None = getattr(_scratch, "region", None)
    if region is None or len(region) < size:
        region = _scratch.region = mmap.mmap(-1, size)
    return memoryview(region)[:size]


class _LoadRun:
    """The chunks of one load, shared by the threads reading them.

    Threads take chunk indices in increasing order (:meth:`take`), so when chunk ``i`` fails,
    every chunk before ``i`` has been taken already and no chunk after it is ever needed.  A
    chunk the page-cache pass put back (:meth:`put_back`) is taken again before any chunk
    not taken yet, by a read that may wait for the device.  ``stop`` is set the moment the
    load is cancelled; a thread checks it before each chunk.
    """

    __slots__ = (
        "_first_bad", "_lock", "_next", "_returned", "jobs", "outcomes", "stop", "tenant",
    )  # fmt: skip

    def __init__(self, jobs: list[_ReadJob], tenant: bytes = b"") -> None:
        self.jobs = jobs
        #: The tenant whose chunks these are (what sealed chunks are opened for).
        self.tenant = tenant
        #: Per chunk: ``None`` until read; written by the one thread that took the chunk, read
        #: by the Trio thread once every thread is done.
        self.outcomes: list[_ReadOutcome | None] = [None] * len(jobs)
        self.stop = threading.Event()
        self._lock = threading.Lock()
        self._next = 0
        self._first_bad = len(jobs)
        #: Chunks put back, to be taken again (in increasing order, before ``_next``).
        self._returned: list[int] = []

    def has_work(self) -> bool:
        return self.remaining() > 0 and not self.stop.is_set()

    def take(self) -> int | None:
        """The next chunk to read, or ``None`` when there is none or the load stopped."""
        with self._lock:
            if self.stop.is_set():
                return None
            if self._returned:
                i = self._returned.pop(0)
                if i < self._first_bad:
                    return i
                self._returned.clear()  # all past the first failed chunk: never needed
            if self._next >= self._first_bad:
                return None
            self._next += 1
            return self._next - 1

    def remaining(self) -> int:
        """Chunks not taken yet, or put back (up to the first failed one)."""
        with self._lock:
            returned = sum(1 for i in self._returned if i < self._first_bad)
            return returned + max(0, self._first_bad - self._next)

    def put_back(self, i: int) -> None:
        """Chunk ``i``, taken by this thread, is to be taken again (by another kind of read)."""
        with self._lock:
            insort(self._returned, i)

    def fail(self, i: int, exc: chunkfile.ChunkMiss | OSError) -> None:
        with self._lock:
            self.outcomes[i] = exc
            self._first_bad = min(self._first_bad, i)

    def check(self) -> None:
        """Raise :class:`_Stopped` once the load is cancelled (between a chunk's pieces)."""
        if self.stop.is_set():
            raise _Stopped


class _Stopped(Exception):
    """A chunk read left half-way because its load was cancelled; the chunk is not loaded."""


async def _set_when_cancelled(stop: threading.Event) -> None:
    """Sleep until cancelled, and set ``stop`` as the cancel is delivered: synchronously, in
    the abort callback, so no thread of the load can start a chunk after it."""

    def abort(_: trio.lowlevel.RaiseCancelT) -> trio.lowlevel.Abort:
        stop.set()
        return trio.lowlevel.Abort.SUCCEEDED

    await trio.lowlevel.wait_task_rescheduled(abort)


class ChunkReads:
    """The thread side of :class:`~lmprefetch.tiers.disk.DiskTier`'s loads (a mixin: the tier
    sets these attributes)."""

    #: What the tier stores a payload as, and reads it back with.
    stage: ChunkStage
    #: Whether reads still try ``O_DIRECT`` (set to ``False`` by the first ``EINVAL``).
    o_direct_active: bool
    #: Whether a load first reads what the page cache holds in one thread call
    #: (``RWF_NOWAIT``; set to ``False`` where the file system refuses it).
    cached_pass: bool
    #: Where a benchmark records the time of each phase of a load; ``None``: nothing.
    phases: Phases | None
    _read_limiter: trio.CapacityLimiter

    async def _reader(self, run: _LoadRun) -> None:
        # One thread call reads several chunks: a thread round trip costs about as much as
        # copying a 2 MiB chunk out of the page cache (16 x 2 MiB: one call per chunk ran at
        # ~0.47 of a plain readinto loop, 8 per call at ~0.6-0.75).  The cap hands the read
        # limiter back now and then, so concurrent loads take turns.
        while run.has_work():
            await self._in_thread(self._read_run, run, _CHUNKS_PER_THREAD_CALL)

    async def _in_thread(self, fn: Callable[..., None], *args: object) -> None:
        """``fn(*args)`` in a read thread, under the read limiter; never abandoned (the thread
        writes into buffers the caller frees)."""
        if self.phases is not None:
            await to_thread_timed(self.phases, self._read_limiter, fn, *args)
            return
        await trio.to_thread.run_sync(
            fn, *args, limiter=self._read_limiter, abandon_on_cancel=False
        )

    def _read_all(self, run: _LoadRun, cached: bool) -> None:
        """Read the chunks of ``run`` not taken yet, in order (runs in a worker thread); stops
        at the first failed read, and raises ``Cancelled`` before a chunk, or between the
        pieces of one, once the load was cancelled.  ``cached``: only while the page cache
        holds the bytes; the first chunk it does not is put back for a read that may wait."""
        check = trio.from_thread.check_cancelled
        while True:
            check()
            i = run.take()
            if i is None:
                return
            try:
                if not self._read_taken(run, i, check, cached):
                    return
            except chunkfile.NotCached as exc:
                run.put_back(i)
                if exc.unsupported:
                    self.cached_pass = False  # every later load reads as it did before
                return

    def _read_taken(
        self, run: _LoadRun, i: int, check: Callable[[], None], cached: bool = False
    ) -> bool:
        """Read chunk ``i`` of ``run`` (taken by this thread) into its slot; ``False`` when
        it failed (recorded in ``run``: the load stops there)."""
        path, key_bytes, slot, trusted = run.jobs[i]
        try:
            run.outcomes[i] = self._read_chunk(
                path, key_bytes, slot, check, trusted, run.tenant, cached
            )
        except (chunkfile.ChunkMiss, OSError) as exc:
            run.fail(i, exc)
            return False
        return True

    def _read_run(self, run: _LoadRun, max_chunks: int) -> None:
        """Read the next chunks of ``run``, in order, until ``max_chunks`` were read, a read
        failed, the run has no more work or is told to stop (runs in a worker thread)."""
        try:
            for _ in range(max_chunks):
                i = run.take()
                if i is None or not self._read_taken(run, i, run.check):
                    return
        except _Stopped:  # cancelled half-way through chunk i: it stays unread
            return
        except BaseException:  # a bug: stop the other threads of this load, then propagate
            run.stop.set()
            raise

    def _read_chunk(
        self,
        path: str,
        key_bytes: bytes,
        slot: memoryview,
        check: Callable[[], None] | None = None,
        trusted: FileIdentity | None = None,
        tenant: bytes = b"",
        cached: bool = False,
    ) -> _Loaded:
        """Read, verify and decode one chunk file into ``slot`` (runs in a worker thread);
        ``check`` runs between its pieces and raises to stop (see
        :func:`chunkfile.read_buffered`); the checksum is skipped if the file's identity is
        still ``trusted``; sealed chunks are opened for ``tenant``; ``cached``: only from the
        page cache (else :class:`chunkfile.NotCached`, the slot holding anything).

        A passthrough stage reads the file straight into ``slot`` (a file a little larger than
        the slot, a chunk written under another codec, is read again into scratch); any other
        reads it into a per-thread scratch buffer and decodes that into ``slot``.

        Raises:
            chunkfile.FileMissing, chunkfile.FileCorrupt and _Undecodable (after unlinking
            the file), chunkfile.TooLarge, OSError.
        """
        started_ns = time.time_ns()
        stage = self.stage
        target = slot if stage.passthrough else _read_scratch(stage.max_read_bytes(slot.nbytes))
        try:
            try:
                read, direct = self._read_file(path, key_bytes, target, check, trusted, cached)
            except chunkfile.TooLarge:
                if target is not slot:
                    raise
                target = _read_scratch(stage.max_read_bytes(slot.nbytes))
                read, direct = self._read_file(path, key_bytes, target, check, trusted, cached)
                if not read.encoded:
                    raise  # a payload larger than this slot, as it was first found
        except FileNotFoundError:
            raise chunkfile.FileMissing(path) from None
        except chunkfile.FileCorrupt:
            chunkfile.unlink_quiet(path)
            raise
        stored = read.payload_bytes
        if target is slot and stage.is_raw(slot[:stored], read.encoded):
            return _Loaded(read, direct, started_ns, stored)
        t0 = time.perf_counter()
        refused = None
        encoded = read.encoded
        phases = self.phases
        try:
            if target is slot:  # a passthrough tier's file written under another codec
                n = stage.decode_in_place(
                    slot, stored, key_name=key_bytes, tenant=tenant, encoded=encoded
                )
            else:
                n = stage.decode_into(
                    target[:stored], slot, key_name=key_bytes, tenant=tenant, encoded=encoded
                )
        except CodecMiss as exc:
            refused = str(exc)
        if phases is not None:
            phases.add("codec", t0, perf_counter())
        if refused is not None:
            # Raised out here, with no trace of the decoder's frames: they hold views of the
            # slot, which must not outlive the load (the arena could not close).
            chunkfile.unlink_quiet(path)
            raise _Undecodable(refused)
        return _Loaded(read, direct, started_ns, n, time.perf_counter() - t0, encoded)

    def _read_file(
        self,
        path: str,
        key_bytes: bytes,
        target: memoryview,
        check: Callable[[], None] | None,
        trusted: FileIdentity | None,
        cached: bool = False,
    ) -> tuple[chunkfile.ChunkRead, bool]:
        """Read and verify one chunk file's stored bytes into ``target``; the read, and
        whether it used ``O_DIRECT`` (never when ``cached``: page-cache bytes only)."""
        if cached:
            read = chunkfile.read_buffered(
                path, key_bytes, target, check, trusted, self.phases, nowait=True
            )
            return read, False
        if (
            self.o_direct_active
            and target.nbytes % chunkfile.ALIGN == 0
            and chunkfile.address(target) % chunkfile.ALIGN == 0
        ):
            try:
                return chunkfile.read_direct(
                    path, key_bytes, target, check, trusted, self.phases
                ), True
            except chunkfile.DirectUnsupported:
                self.o_direct_active = False  # e.g. tmpfs; every later read is buffered
        return chunkfile.read_buffered(path, key_bytes, target, check, trusted, self.phases), False


def _only_cancelled(exc: BaseException) -> trio.Cancelled | None:
    """``exc`` if it is ``Cancelled``; one of them if ``exc`` is an exception group holding
    nothing else; ``None`` otherwise."""
    if isinstance(exc, trio.Cancelled):
        return exc
    children = getattr(exc, "exceptions", None)  # a BaseExceptionGroup
    if not children:
        return None
    leaves = [_only_cancelled(child) for child in children]
    if any(leaf is None for leaf in leaves):
        return None
    return leaves[0]
