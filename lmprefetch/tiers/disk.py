"""The disk tier: one checksummed file per chunk, read by worker threads, written behind.

Every chunk lives in its own file ``<key.to_string()>.kv`` under the tier's directory.  A file is
a fixed-size header followed by the payload:

===========  =====  ===========================================================================
offset       bytes  field (integers little-endian)
===========  =====  ===========================================================================
0            8      magic ``b"LMPFKV1\\0"``
8            4      format version (``1``)
12           4      header size in bytes (``4096``)
16           8      payload length in bytes
24           8      xxh3-64 of the payload
32           4      length ``n`` of the key string in bytes
36           n      the key string (``ChunkKey.to_string()``, UTF-8)
36 + n       ...    zero padding up to 4096
4096         len    the payload
===========  =====  ===========================================================================

The key string in the header means a file can never be taken for another key (a file copied or
renamed by hand is a miss, not wrong data); the checksum means a torn or bit-flipped payload is a
miss, never garbage handed to the model (LMCache's disk backend returns normally from a missing
file, leaving the buffer unread, D17).  The header is a whole page so that with ``O_DIRECT`` the
payload starts block-aligned and is read straight into an arena slot.

Threads and the Trio thread.  Every file operation (``open``, ``read``, ``write``, ``stat``,
``scandir``, ``unlink``, ``replace``) runs in :func:`trio.to_thread.run_sync` under a limiter the
tier owns: reads under ``CapacityLimiter(read_threads)`` shared by every load, writes, unlinks and
the directory scan under ``CapacityLimiter(1)``.  The in-memory index (key -> file size, in LRU
order) is touched only from the Trio thread, so it needs no lock.

A load runs up to ``read_threads`` thread calls that take the load's chunks in order, several
chunks per call (a thread round trip costs about as much as copying a 2 MiB chunk out of the page
cache).  Threads that write into a buffer run with ``abandon_on_cancel=False``, and each checks a
stop flag before every chunk; the flag is set in the abort callback of the load's cancellation,
synchronously.  So a cancelled load waits for the reads already running (one chunk per thread),
starts no new one, and never leaves a thread writing into a buffer that the caller frees.

Writes are write-behind: :meth:`DiskTier.enqueue_write` takes an owner reference on the cached
arena buffer and queues it, without blocking; a single writer task writes the queue in order to
a temporary file and :func:`os.replace`\\ s it over the final name, so no partial file is ever
visible under a chunk's name.  Files are not fsynced: this is a cache, and a file torn by a crash
fails its checksum and is dropped on the first read.

Races between a load, the writer and :meth:`DiskTier.remove` on the same key can at worst make a
later load miss (and drop the key); they can never make a load return wrong bytes, because every
read checks the key and the checksum in the file itself.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import mmap
import os
import struct
import tempfile
import threading
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence

import trio
import xxhash

from ..keys import ChunkKey
from ..memory import Buffer
from .base import BaseTier
from .writebehind import WriteBehindQueue, WriteEntry

__all__ = ["HEADER_BYTES", "MAGIC", "DiskTier", "open_disk_tier"]

log = logging.getLogger("lmprefetch.disk")

#: First bytes of every chunk file.
MAGIC = b"LMPFKV1\0"
#: Chunk file format version.
VERSION = 1
#: Size of the header before the payload: one page, so an ``O_DIRECT`` payload is aligned.
HEADER_BYTES = 4096
#: magic, version, header size, payload length, xxh3-64 of the payload, key string length.
_HEADER = struct.Struct("<8sIIQQI")
_MAX_KEY_BYTES = HEADER_BYTES - _HEADER.size
#: ``O_DIRECT`` needs block-aligned memory, offsets and lengths; a page covers every block size.
_ALIGN = 4096
_O_DIRECT: int = getattr(os, "O_DIRECT", 0)

FILE_SUFFIX = ".kv"
TEMP_SUFFIX = ".kv.tmp"


# -- what a chunk read can find (raised in the reading thread) -------------------------------
class _ChunkMiss(Exception):
    """The chunk cannot be loaded from its file; the load stops here."""


class _FileMissing(_ChunkMiss):
    """No file under the key's name."""


class _FileCorrupt(_ChunkMiss):
    """The file is not a valid chunk file for this key (it has been unlinked)."""


class _TooLarge(_ChunkMiss):
    """A valid file whose payload does not fit the destination buffer (the file is kept)."""


class _DirectUnsupported(Exception):
    """``O_DIRECT`` was refused (``EINVAL``): read this chunk, and all later ones, buffered."""


#: Chunks one thread call reads at most before handing its read-limiter token back.
_CHUNKS_PER_THREAD_CALL = 8

_ReadJob = tuple[str, bytes, memoryview]  # file path, key string, destination slot
_ReadOutcome = tuple[int, bool] | _ChunkMiss | OSError  # (payload bytes, O_DIRECT) or a miss


class _LoadRun:
    """The chunks of one load, shared by the threads reading them.

    Threads take chunk indices in increasing order (:meth:`take`), so when chunk ``i`` fails,
    every chunk before ``i`` has been taken already and no chunk after it is ever needed.
    ``stop`` is set the moment the load is cancelled; a thread checks it before each chunk.
    """

    __slots__ = ("_first_bad", "_lock", "_next", "jobs", "outcomes", "stop")

    def __init__(self, jobs: list[_ReadJob]) -> None:
        self.jobs = jobs
        #: Per chunk: ``None`` until read; written by the one thread that took the chunk, read
        #: by the Trio thread once every thread is done.
        self.outcomes: list[_ReadOutcome | None] = [None] * len(jobs)
        self.stop = threading.Event()
        self._lock = threading.Lock()
        self._next = 0
        self._first_bad = len(jobs)

    def has_work(self) -> bool:
        with self._lock:
            return self._next < self._first_bad and not self.stop.is_set()

    def take(self) -> int | None:
        """The next chunk to read, or ``None`` when there is none or the load stopped."""
        with self._lock:
            if self._next >= self._first_bad or self.stop.is_set():
                return None
            self._next += 1
            return self._next - 1

    def fail(self, i: int, exc: _ChunkMiss | OSError) -> None:
        with self._lock:
            self.outcomes[i] = exc
            self._first_bad = min(self._first_bad, i)


async def _set_when_cancelled(stop: threading.Event) -> None:
    """Sleep until cancelled, and set ``stop`` as the cancel is delivered: synchronously, in
    the abort callback, so no thread of the load can start a chunk after it."""

    def abort(_: trio.lowlevel.RaiseCancelT) -> trio.lowlevel.Abort:
        stop.set()
        return trio.lowlevel.Abort.SUCCEEDED

    await trio.lowlevel.wait_task_rescheduled(abort)


class DiskTier(BaseTier):
    """Chunk files under ``path``, with an LRU index in memory.

    Build it with :func:`open_disk_tier`, which rebuilds the index from the directory and runs
    the write-behind task.

    Args:
        path: the tier's directory (created if missing).
        capacity_bytes: bytes of chunk files (header included) the tier may keep; least
            recently used unpinned files are evicted past it.
        read_threads: chunk reads in flight at once, over all loads.
        write_queue: writes waiting for the writer; past this, :meth:`enqueue_write` drops.
        o_direct: read with ``O_DIRECT`` when the destination slot and sizes are page-aligned
            (falls back to buffered reads for good on the first ``EINVAL``).
    """

    name = "disk"

    def __init__(
        self,
        path: str,
        *,
        capacity_bytes: int,
        read_threads: int,
        write_queue: int,
        o_direct: bool,
        close_timeout_s: float = 30.0,
    ) -> None:
        super().__init__()
        if capacity_bytes < HEADER_BYTES:
            raise ValueError(f"capacity_bytes: must hold one header ({HEADER_BYTES}), got "
                             f"{capacity_bytes}")
        if read_threads < 1:
            raise ValueError(f"read_threads: must be at least 1, got {read_threads}")
        if write_queue < 1:
            raise ValueError(f"write_queue: must be at least 1, got {write_queue}")
        self.path = os.fspath(path)
        self.capacity_bytes = capacity_bytes
        self.read_threads = read_threads
        self.write_queue = write_queue
        self.close_timeout_s = close_timeout_s
        #: Whether reads still try ``O_DIRECT`` (set to ``False`` by the first ``EINVAL``).
        self.o_direct_active = bool(o_direct and _O_DIRECT)
        self._read_limiter = trio.CapacityLimiter(read_threads)
        self._write_limiter = trio.CapacityLimiter(1)
        self._index: OrderedDict[ChunkKey, int] = OrderedDict()
        self._used_bytes = 0
        # Write-behind (Trio thread only): one file at a time, in order.
        self._writes = WriteBehindQueue(write_queue, self.stats)
        self._writer_scope: trio.CancelScope | None = None
        #: Files in the directory that are not chunk files (left alone).
        self.foreign_files = 0
        #: Temporary files of interrupted writes removed when the index was rebuilt.
        self.stale_temp_files_removed = 0
        #: Chunk files found corrupt by a load (and unlinked).
        self.corrupt_files_removed = 0
        #: Chunks read with ``O_DIRECT``.
        self.o_direct_reads = 0

    # -- index ------------------------------------------------------------------------
    def _file_path(self, key: ChunkKey) -> str:
        return os.path.join(self.path, key.to_string() + FILE_SUFFIX)

    async def _rebuild_index(self) -> None:
        """Create the directory and index the chunk files already in it (oldest first)."""
        found, foreign, stale = await trio.to_thread.run_sync(
            _scan_dir, self.path, limiter=self._write_limiter
        )
        found.sort(key=lambda entry: entry[0])  # by mtime: the best LRU order a restart has
        for _, key, size in found:
            self._index[key] = size
            self._used_bytes += size
        self.foreign_files = foreign
        self.stale_temp_files_removed = stale
        victims: list[str] = []
        while self._used_bytes > self.capacity_bytes and self._index:
            key, size = self._index.popitem(last=False)
            self._used_bytes -= size
            self.stats.evictions += 1
            victims.append(self._file_path(key))
        if victims:  # the capacity shrank since the files were written
            await trio.to_thread.run_sync(_unlink_all, victims, limiter=self._write_limiter)

    def contains_now(self, key: ChunkKey) -> bool:
        return key in self._index

    async def contains(self, key: ChunkKey) -> bool:
        await trio.lowlevel.checkpoint()
        return key in self._index

    async def contains_prefix(self, keys: Sequence[ChunkKey], *, pin: bool) -> int:
        await trio.lowlevel.checkpoint()
        return self._count_prefix(self._index, keys, pin)  # synchronous: pins come last

    def _drop(self, key: ChunkKey) -> None:
        size = self._index.pop(key, None)
        if size is not None:
            self._used_bytes -= size

    # -- load -------------------------------------------------------------------------
    async def load(self, keys: Sequence[ChunkKey], buffers: Sequence[Buffer]) -> int:
        """Read ``keys[i]``'s file into ``buffers[i]``, verified; the contiguous count filled.

        Chunks are read concurrently (at most ``read_threads`` at once over all loads), but the
        result counts only from ``keys[0]`` up to the first chunk that is not indexed, missing,
        short, corrupt, too large for its buffer or unreadable (D13, D17).  A missing, short or
        corrupt file leaves the index (and is unlinked); a file too large for the buffer, or an
        I/O error, is a miss that leaves the file alone.  Chunks past the first miss may or may
        not have been read, and their buffers hold anything.  A buffer's ``length`` is set only
        once its payload passed the key and checksum checks (D12).  Each loaded chunk becomes
        most recently used.

        Cancellation: no chunk read starts after the cancel; reads already running (at most one
        per read thread) finish first, since their threads write into the buffers, and then
        ``Cancelled`` propagates.  The caller releases every buffer.
        """
        n = min(len(keys), len(buffers))
        indexed = 0
        while indexed < n and keys[indexed] in self._index:
            indexed += 1
        if indexed == 0:
            await trio.lowlevel.checkpoint()
            return 0
        with contextlib.ExitStack() as slots:  # released once no thread can touch them
            run = _LoadRun([
                (self._file_path(key), key.to_string().encode(),
                 slots.enter_context(buf.slot()))
                for key, buf in zip(keys[:indexed], buffers, strict=False)
            ])
            readers = min(self.read_threads, -(-indexed // _CHUNKS_PER_THREAD_CALL))
            try:
                if readers == 1:
                    # The common case: one thread call reads every chunk, and checks before
                    # each one whether the load was cancelled.  No tasks, no nurseries.
                    await trio.to_thread.run_sync(
                        self._read_all,
                        run,
                        limiter=self._read_limiter,
                        abandon_on_cancel=False,  # the thread writes into the buffers
                    )
                else:
                    async with trio.open_nursery() as watch:
                        watch.start_soon(_set_when_cancelled, run.stop)
                        async with trio.open_nursery() as reader_tasks:
                            for _ in range(readers):
                                reader_tasks.start_soon(self._reader, run)
                        watch.cancel_scope.cancel()
            except BaseException as exc:
                # A cancelled load raises a plain Cancelled, as a one-task load would, rather
                # than a group of its tasks' Cancelled.  Anything else propagates as it is.
                cancelled = _only_cancelled(exc)
                if cancelled is None:
                    raise
                raise cancelled from None
            finally:
                # Also on cancellation: bad files leave the index.
                count, loaded_bytes = self._settle(keys, buffers, run)
        self.stats.chunks_loaded += count
        self.stats.bytes_loaded += loaded_bytes
        return count

    async def _reader(self, run: _LoadRun) -> None:
        # One thread call reads several chunks: a thread round trip costs about as much as
        # copying a 2 MiB chunk out of the page cache (16 x 2 MiB: one call per chunk ran at
        # ~0.47 of a plain readinto loop, 8 per call at ~0.6-0.75).  The cap hands the read
        # limiter back now and then, so concurrent loads take turns.
        while run.has_work():
            await trio.to_thread.run_sync(
                self._read_run,
                run,
                _CHUNKS_PER_THREAD_CALL,
                limiter=self._read_limiter,
                abandon_on_cancel=False,  # the thread writes into buffers the caller frees
            )

    def _read_all(self, run: _LoadRun) -> None:
        """Read every chunk of ``run`` in order (runs in a worker thread); stops at the first
        failed read, and raises ``Cancelled`` before a chunk once the load was cancelled."""
        for i, job in enumerate(run.jobs):
            trio.from_thread.check_cancelled()
            try:
                run.outcomes[i] = self._read_chunk(*job)
            except (_ChunkMiss, OSError) as exc:
                run.fail(i, exc)
                return

    def _read_run(self, run: _LoadRun, max_chunks: int) -> None:
        """Read the next chunks of ``run``, in order, until ``max_chunks`` were read, a read
        failed, the run has no more work or is told to stop (runs in a worker thread)."""
        try:
            for _ in range(max_chunks):
                i = run.take()
                if i is None:
                    return
                try:
                    run.outcomes[i] = self._read_chunk(*run.jobs[i])
                except (_ChunkMiss, OSError) as exc:
                    run.fail(i, exc)
                    return
        except BaseException:  # a bug: stop the other threads of this load, then propagate
            run.stop.set()
            raise

    def _settle(
        self, keys: Sequence[ChunkKey], buffers: Sequence[Buffer], run: _LoadRun
    ) -> tuple[int, int]:
        """Apply a finished load's outcomes (Trio thread); ``(leading chunks, their bytes)``."""
        count = loaded_bytes = 0
        prefix = True
        for i, outcome in enumerate(run.outcomes):
            key = keys[i]
            if outcome is None:  # not read: past a miss, or cancelled
                prefix = False
            elif isinstance(outcome, tuple):
                length, direct = outcome
                buffers[i].length = length
                self.o_direct_reads += direct
                if key in self._index:
                    self._index.move_to_end(key)
                if prefix:
                    count += 1
                    loaded_bytes += length
            else:
                prefix = False
                if isinstance(outcome, _FileMissing):
                    self._drop(key)
                elif isinstance(outcome, _FileCorrupt):
                    self._drop(key)
                    self.corrupt_files_removed += 1
                    self.stats.errors += 1
                    log.warning("disk tier: dropped corrupt chunk file %s: %s",
                                key.to_string(), outcome)
                elif isinstance(outcome, _TooLarge):  # the file is fine, our slots too small
                    self.stats.errors += 1
                else:  # EIO, EMFILE, ...: a miss now; the file may be fine later
                    self.stats.errors += 1
                    log.warning("disk tier: reading %s failed: %s", key.to_string(), outcome)
        return count, loaded_bytes

    def _read_chunk(self, path: str, key_bytes: bytes, slot: memoryview) -> tuple[int, bool]:
        """Read and verify one chunk file into ``slot`` (runs in a worker thread).

        Returns:
            ``(payload_bytes, read_with_o_direct)``.

        Raises:
            _FileMissing, _FileCorrupt (after unlinking the file), _TooLarge, OSError.
        """
        try:
            if (
                self.o_direct_active
                and slot.nbytes % _ALIGN == 0
                and _address(slot) % _ALIGN == 0
            ):
                try:
                    return _read_direct(path, key_bytes, slot), True
                except _DirectUnsupported:
                    self.o_direct_active = False  # e.g. tmpfs; every later read is buffered
            return _read_buffered(path, key_bytes, slot), False
        except FileNotFoundError:
            raise _FileMissing(path) from None
        except _FileCorrupt:
            _unlink_quiet(path)
            raise

    # -- write-behind -----------------------------------------------------------------
    def enqueue_write(self, key: ChunkKey, buf: Buffer) -> bool:
        """Queue ``buf``'s payload to be written under ``key`` (synchronous, never blocks).

        Takes an owner reference on ``buf``, released once the file is written (or the write
        is dropped, or the tier closes); see :mod:`lmprefetch.tiers.writebehind`.

        Returns:
            ``True`` if the key is on disk, being written or queued; ``False`` if the write is
            dropped (the queue is full, the key is too long, or the tier is closing), counted
            in ``stats.writes_dropped``.
        """
        if key in self._index or self._writes.has(key):
            return True
        if len(key.to_string().encode()) > _MAX_KEY_BYTES:
            self.stats.writes_dropped += 1
            return False
        return self._writes.put(key, buf)

    async def store(self, key: ChunkKey, payload: Buffer) -> bool:
        """:meth:`enqueue_write` (the file is written behind; see :meth:`flush`)."""
        await trio.lowlevel.checkpoint()
        return self.enqueue_write(key, payload)

    async def flush(self) -> None:
        """Wait until every write queued before this call is on disk (or was dropped).

        Cancellation: waiting is cancellable; the writes go on.
        """
        await self._writes.flush()

    async def _run_writer(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                          ) -> None:
        """The write-behind task: writes queued chunks one at a time, in order, until
        :meth:`aclose` stops it.

        It runs shielded: cancelling the scope around the tier (an engine shutting down) must
        not stop the writer before :meth:`aclose` has flushed.  Only :meth:`aclose` cancels it.
        On exit the queue releases the reference of every write still queued.
        """
        with trio.CancelScope(shield=True) as scope:
            self._writer_scope = scope
            await self._writes.run(self._write_batch, batch_keys=1, task_status=task_status)

    async def _write_batch(self, batch: list[WriteEntry]) -> None:
        for entry in batch:
            await self._write_entry(entry)

    async def _write_entry(self, entry: WriteEntry) -> None:
        buf = entry.buffer
        if buf is None or entry.removed:  # removed while queued
            entry.written = True
            await trio.lowlevel.checkpoint()
            return
        key = entry.key
        size = HEADER_BYTES + buf.length
        victims = self._choose_victims(size)
        if victims is None:  # everything that could make room is pinned
            self.stats.writes_dropped += 1
            entry.written = True
            await trio.lowlevel.checkpoint()
            return
        for victim in victims:
            self._drop(victim)
            self.stats.evictions += 1
        if victims:
            await trio.to_thread.run_sync(
                _unlink_all, [self._file_path(v) for v in victims], limiter=self._write_limiter
            )
        final = self._file_path(key)
        try:
            with buf.view() as payload:
                await trio.to_thread.run_sync(
                    _write_file,
                    final,
                    final[: -len(FILE_SUFFIX)] + TEMP_SUFFIX,
                    key.to_string().encode(),
                    payload,
                    limiter=self._write_limiter,
                    abandon_on_cancel=False,  # the thread reads the buffer released after
                )
        except OSError as exc:  # ENOSPC, EIO, a name too long, ...
            self.stats.errors += 1
            self.stats.writes_dropped += 1
            entry.written = True
            log.warning("disk tier: writing %s failed: %s", key.to_string(), exc)
            return
        entry.written = True
        if entry.removed:  # remove(key) came while the file was being written
            await trio.to_thread.run_sync(_unlink_all, [final], limiter=self._write_limiter)
            return
        self._index[key] = size
        self._used_bytes += size
        self.stats.chunks_stored += 1
        self.stats.bytes_stored += buf.length

    def _choose_victims(self, size: int) -> list[ChunkKey] | None:
        """Least recently used unpinned keys whose eviction makes room for ``size`` bytes, or
        ``None`` if even evicting every unpinned file would not."""
        need = self._used_bytes + size - self.capacity_bytes
        if size > self.capacity_bytes:
            return None
        victims: list[ChunkKey] = []
        for key, file_bytes in self._index.items():  # least recently used first
            if need <= 0:
                break
            if not self.is_pinned(key):
                victims.append(key)
                need -= file_bytes
        return victims if need <= 0 else None

    # -- remove -----------------------------------------------------------------------
    async def remove(self, key: ChunkKey) -> bool:
        """Forget ``key``: drop its queued write and delete its file.  ``True`` if it was there."""
        # A queued write is dropped; one being written deletes its file once written.
        found = self._writes.remove(key)
        if key in self._index:
            self._drop(key)
            await trio.to_thread.run_sync(
                _unlink_all, [self._file_path(key)], limiter=self._write_limiter
            )
            return True
        await trio.lowlevel.checkpoint()
        return found

    # -- lifecycle and accounting -----------------------------------------------------
    async def aclose(self) -> None:
        """Flush pending writes (shielded, at most ``close_timeout_s``), then stop the writer.

        Writes queued from here on are dropped.  Writes still queued when the time is up are
        dropped and their buffer references released.  Idempotent.
        """
        self._writes.close()
        with trio.move_on_after(self.close_timeout_s, shield=True) as timeout:
            await self.flush()
        if timeout.cancelled_caught:
            log.warning("disk tier: close gave up flushing after %.1f s, dropping %d writes",
                        self.close_timeout_s, self._writes.pending)
        if self._writer_scope is not None:
            self._writer_scope.cancel()

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, key: object) -> bool:
        return key in self._index

    @property
    def used_bytes(self) -> int:
        """Bytes of the indexed chunk files, headers included."""
        return self._used_bytes

    @property
    def pending_writes(self) -> int:
        """Writes queued or being written."""
        return self._writes.pending

    def keys(self) -> list[ChunkKey]:
        """Indexed keys, least recently used first."""
        return list(self._index)


@contextlib.asynccontextmanager
async def open_disk_tier(
    path: str,
    *,
    capacity_bytes: int,
    read_threads: int,
    write_queue: int,
    o_direct: bool,
    close_timeout_s: float = 30.0,
) -> AsyncIterator[DiskTier]:
    """Open the disk tier in ``path``: create the directory, index the chunk files there (the
    tier survives restarts), run the write-behind task.

    On exit, pending writes are flushed (shielded, for at most ``close_timeout_s``), then the
    writer stops and releases the buffer reference of anything still queued.  Arguments are
    those of :class:`DiskTier`.
    """
    tier = DiskTier(
        path,
        capacity_bytes=capacity_bytes,
        read_threads=read_threads,
        write_queue=write_queue,
        o_direct=o_direct,
        close_timeout_s=close_timeout_s,
    )
    await tier._rebuild_index()
    async with trio.open_nursery() as nursery:
        await nursery.start(tier._run_writer)
        try:
            yield tier
        finally:
            await tier.aclose()


# -- file operations (worker threads only) ---------------------------------------------------
def _scan_dir(path: str) -> tuple[list[tuple[int, ChunkKey, int]], int, int]:
    """Create ``path`` if needed; ``([(mtime_ns, key, file_bytes)], foreign, stale_temps)``.
    Temporary files of interrupted writes are deleted.

    Raises:
        ValueError: ``path`` cannot be created, is not a directory, or is not writable (the
            message starts with ``disk_path``, the setting to fix).
    """
    _check_writable_dir(path)
    found: list[tuple[int, ChunkKey, int]] = []
    foreign = stale = 0
    with os.scandir(path) as entries:
        for entry in entries:
            name = entry.name
            if name.endswith(TEMP_SUFFIX) and entry.is_file(follow_symlinks=False):
                _unlink_quiet(entry.path)
                stale += 1
                continue
            key = _parse_name(name)
            if key is None or not entry.is_file(follow_symlinks=False):
                foreign += 1
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:  # deleted while we looked
                continue
            found.append((st.st_mtime_ns, key, st.st_size))
    return found, foreign, stale


def _check_writable_dir(path: str) -> None:
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"disk_path: {path!r} is not a directory")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise ValueError(
            f"disk_path: cannot create the directory {path!r} ({exc.strerror})"
        ) from None
    # Permission bits say little (root ignores them; a read-only mount ignores them the other
    # way), so write a probe file, the way the tier itself will write.
    try:
        fd, probe = tempfile.mkstemp(dir=path, suffix=TEMP_SUFFIX)
    except OSError as exc:
        raise ValueError(f"disk_path: {path!r} is not writable ({exc.strerror})") from None
    os.close(fd)
    _unlink_quiet(probe)


def _parse_name(name: str) -> ChunkKey | None:
    if not name.endswith(FILE_SUFFIX):
        return None
    text = name[: -len(FILE_SUFFIX)]
    try:
        key = ChunkKey.from_string(text)
    except ValueError:
        return None
    # Only the canonical spelling is ours: two names must never map to one key.
    return key if key.to_string() == text else None


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


def _address(view: memoryview) -> int:
    """The memory address of ``view``'s first byte (it must be writable)."""
    return ctypes.addressof((ctypes.c_char * 1).from_buffer(view))


def _read_buffered(path: str, key_bytes: bytes, slot: memoryview) -> int:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return _read_fd(fd, key_bytes, slot, bytearray(HEADER_BYTES), direct=False)
    finally:
        os.close(fd)


def _read_direct(path: str, key_bytes: bytes, slot: memoryview) -> int:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | _O_DIRECT)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            raise _DirectUnsupported from None
        raise
    try:
        # The header lands in its own page-aligned page (anonymous mmap memory).
        with mmap.mmap(-1, HEADER_BYTES) as header_page, memoryview(header_page) as header:
            try:
                return _read_fd(fd, key_bytes, slot, header, direct=True)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
        # (Raised out here, once the page is unmapped: a misaligned read refused.)
        raise _DirectUnsupported
    finally:
        os.close(fd)


def _read_fd(
    fd: int, key_bytes: bytes, slot: memoryview, header: memoryview | bytearray, *, direct: bool
) -> int:
    """Read header and payload of the open chunk file ``fd``; verify; the payload length."""
    file_bytes = os.fstat(fd).st_size
    payload_bytes = file_bytes - HEADER_BYTES
    if payload_bytes < 0:
        raise _FileCorrupt(f"{file_bytes} bytes, shorter than the header")
    if payload_bytes > slot.nbytes:
        # Too large for the buffer, or a damaged length: read the header to tell which.
        if _read_into(fd, [header], HEADER_BYTES) < HEADER_BYTES:
            raise _FileCorrupt("short read of the header")
        _check_header(header, key_bytes, payload_bytes)
        raise _TooLarge(f"a {payload_bytes}-byte payload for a {slot.nbytes}-byte buffer")
    # O_DIRECT reads whole blocks; the read stops at the end of the file.
    want = -(-payload_bytes // _ALIGN) * _ALIGN if direct else payload_bytes
    with slot[:want] as dst:
        got = _read_into(fd, [header, dst], file_bytes)
    if got < file_bytes:
        raise _FileCorrupt("short read (the file shrank)")
    checksum = _check_header(header, key_bytes, payload_bytes)
    with slot[:payload_bytes] as payload:
        if xxhash.xxh3_64_intdigest(payload) != checksum:
            raise _FileCorrupt("payload checksum mismatch")
    return payload_bytes


def _check_header(header: memoryview | bytearray, key_bytes: bytes, payload_bytes: int) -> int:
    """Verify ``header`` against the expected key and the payload length found; its checksum."""
    magic, version, header_bytes, length, checksum, key_len = _HEADER.unpack_from(header, 0)
    if magic != MAGIC:
        raise _FileCorrupt("not a chunk file (bad magic)")
    if version != VERSION or header_bytes != HEADER_BYTES:
        raise _FileCorrupt(f"unknown format version {version} / header size {header_bytes}")
    start = _HEADER.size
    if key_len != len(key_bytes) or bytes(header[start : start + key_len]) != key_bytes:
        raise _FileCorrupt("the file holds another key")
    if length != payload_bytes:
        raise _FileCorrupt(f"header says {length} payload bytes, the file holds {payload_bytes}")
    return int(checksum)


def _read_into(fd: int, views: list[memoryview | bytearray], expected: int) -> int:
    """``preadv`` from offset 0 until ``expected`` bytes arrived, the views are full or the
    file ended; the number of bytes read."""
    pending = [memoryview(view) for view in views]
    got = 0
    try:
        while pending and got < expected:
            n = os.preadv(fd, pending, got)
            if n == 0:
                break
            got += n
            # Rare: a read cut short.  Go on after what arrived.
            while pending and n >= pending[0].nbytes:
                n -= pending.pop(0).nbytes
            if pending and n:
                pending[0] = pending[0][n:]
        return got
    finally:
        # Release at once, not when a traceback holding this frame dies: a live view keeps
        # the memory it points into (an mmap) from being closed.
        for view in pending:
            view.release()


def _write_file(final: str, temp: str, key_bytes: bytes, payload: memoryview) -> None:
    """Write a chunk file to ``temp``, then rename it over ``final`` (atomic)."""
    header = bytearray(HEADER_BYTES)
    _HEADER.pack_into(
        header, 0, MAGIC, VERSION, HEADER_BYTES, payload.nbytes,
        xxhash.xxh3_64_intdigest(payload), len(key_bytes),
    )
    header[_HEADER.size : _HEADER.size + len(key_bytes)] = key_bytes
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        try:
            _write_all(fd, [memoryview(header), payload])
        finally:
            os.close(fd)
        os.replace(temp, final)
    except BaseException:
        _unlink_quiet(temp)
        raise


def _write_all(fd: int, views: list[memoryview]) -> None:
    pending = [memoryview(view) for view in views]
    try:
        while pending:
            written = os.writev(fd, pending)
            while pending and written >= pending[0].nbytes:
                written -= pending.pop(0).nbytes
            if pending and written:
                pending[0] = pending[0][written:]
    finally:
        for view in pending:  # as in _read_into
            view.release()


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _unlink_all(paths: list[str]) -> None:
    for path in paths:
        _unlink_quiet(path)
