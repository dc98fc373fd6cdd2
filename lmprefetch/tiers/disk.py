"""The disk tier: one checksummed file per chunk, read by worker threads, written behind.

Every chunk lives in its own file ``<key.to_string()>.kv`` under the tier's directory: a
one-page header (magic, version, payload length, xxh3-64 checksum, the key string) followed by
the payload.  The format and the synchronous reads and writes are in
:mod:`lmprefetch.tiers.chunkfile`, the read threads' side of a load in
:mod:`lmprefetch.tiers.diskread`; this module is the tier around them: the in-memory index, the
pins, a load's outcome, eviction and write-behind.

The key string in the header means a file can never be taken for another key (a file copied or
renamed by hand is a miss, not wrong data); the checksum means a torn or bit-flipped payload is a
miss, never garbage handed to the model (LMCache's disk backend returns normally from a missing
file, leaving the buffer unread, D17).

Verified once.  The tier remembers, per key, the identity of the file (device, inode, size,
mtime, ctime) that a read hashed and found good, and later reads of an unchanged file skip the
hash (:mod:`lmprefetch.tiers.chunkfile` explains why a change always shows, and git's rule for
files changed too recently to tell).  The checksum is the expensive part of a read that the
page cache serves: hashing runs without the GIL, so it does not serialise concurrent reads, but
it costs CPU time the reads could use.  What is remembered lives in memory: after a restart
every file is hashed on its first read again.  ``verify_once = False`` hashes every read.

Threads and the Trio thread.  Every file operation (``open``, ``read``, ``write``, ``stat``,
``scandir``, ``unlink``, ``replace``) runs in :func:`trio.to_thread.run_sync` under a limiter the
tier owns: reads under ``CapacityLimiter(read_threads)`` shared by every load, writes, unlinks and
the directory scan under ``CapacityLimiter(1)``.  The in-memory index (key -> file size, in LRU
order) is touched only from the Trio thread, so it needs no lock.

A load reads the chunks the page cache holds in one thread call per CPU but the one the Trio
thread keeps (at most ``read_threads``), taking them in order (the page-cache pass,
``RWF_NOWAIT``); what would wait for the device goes to up to ``read_threads`` thread calls
that take the remaining chunks in order, several per call (:mod:`lmprefetch.tiers.diskread`).
Threads that write into a buffer run with ``abandon_on_cancel=False``, and each checks for the
load's cancellation before every chunk and between the pieces of a chunk
(:data:`chunkfile.PIECE_BYTES`, each hashed while it is still in the CPU's cache).  So a
cancelled load waits for the pieces already being read (one per thread), starts no new one, and
never leaves a thread writing into a buffer that the caller frees.

Writes are write-behind: :meth:`DiskTier.enqueue_write` takes an owner reference on the cached
arena buffer and queues it, without blocking; a single writer task writes the queue in order to
a temporary file and :func:`os.replace`\\ s it over the final name, so no partial file is ever
visible under a chunk's name.  Files are not fsynced: this is a cache, and a file torn by a crash
fails its checksum and is dropped on the first read.

Races between a load, the writer and :meth:`DiskTier.remove` on the same key can at worst make a
later load miss (and drop the key); they can never make a load return wrong bytes, because every
read checks the key and the checksum in the file itself.

Codecs.  The tier's :class:`~lmprefetch.codec.ChunkStage` (``disk_codec`` and encryption,
docs/codecs.md) encodes each chunk in the writer's thread, before the file is written: a file
holds the stored bytes, and the index, ``capacity_bytes`` and eviction count them.  A read
thread reads a file into a per-thread scratch buffer and decodes it into the arena slot (zstd
and numpy release the GIL); a chunk the stage refuses (damaged, unknown, another tenant's) is a
miss, and its file is removed.  With the codec ``none`` and no encryption the stage is a
passthrough: files hold payloads, read straight into the slot as before (``O_DIRECT``, verified
once), and a file written under another codec is recognised by its first bytes and decoded.

The ``Dnn`` codes are LMCache's defects, the rows of the defect table in
``docs/cancellation.md`` ("The defects"), each with its ``test_dNN_`` regression tests.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from functools import partial

import trio

from .._phases import Phases, perf_counter
from ..codec import ChunkStage, get_codec
from ..keys import ChunkKey
from ..memory import Buffer
from . import chunkfile
from .base import BaseTier
from .chunkfile import HEADER_BYTES, MAGIC, FileIdentity
from .diskread import (
    _CHUNKS_PER_THREAD_CALL,
    ChunkReads,
    _Loaded,
    _LoadRun,
    _only_cancelled,
    _set_when_cancelled,
    _Undecodable,
)
from .writebehind import WriteBehindQueue, WriteEntry, WritesBehind

__all__ = ["HEADER_BYTES", "MAGIC", "DiskTier", "open_disk_tier"]

log = logging.getLogger("lmprefetch.disk")

class DiskTier(ChunkReads, WritesBehind, BaseTier):
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
        owns: which keys are this tier's.  Several tiers may share one directory (the ranks
            of one engine, or several models): each indexes, evicts and cleans up only the
            files of its own keys and leaves the others alone (counted in
            :attr:`foreign_files`).  ``None``: every chunk file is this tier's.
        stage: the codec stage (``disk_codec``, encryption); ``None``: payloads as they are.
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
        owns: Callable[[ChunkKey], bool] | None = None,
        stage: ChunkStage | None = None,
    ) -> None:
        super().__init__()
        self._owns = owns
        self.stage = stage if stage is not None else ChunkStage(get_codec("none"))
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
        self.o_direct_active = bool(o_direct and chunkfile.O_DIRECT_FLAG)
        self.cached_pass = bool(chunkfile.NOWAIT_FLAG)
        self._read_limiter = trio.CapacityLimiter(read_threads)
        #: Threads of a load's page-cache pass: one per CPU but the one the Trio thread needs,
        #: at most ``read_threads``, at least one (docs/benchmarks.md: on 2 CPUs a second pass
        #: thread made a lone hit 8 % faster and its cancel's p99 2.2 times slower).
        self._pass_threads = max(1, min(read_threads, len(os.sched_getaffinity(0)) - 1))
        self._write_limiter = trio.CapacityLimiter(1)
        self._index: OrderedDict[ChunkKey, int] = OrderedDict()
        self._used_bytes = 0
        # Verified once: the identity of each file whose bytes a read verified, while it may be
        # trusted (chunkfile.may_trust).  Trio thread only, like the index; a key leaves both
        # together.
        self._trusted: dict[ChunkKey, FileIdentity] = {}
        #: The file system's clock minus this host's (measured when the tier opens).
        self.clock_offset_ns = 0
        #: Whether a file verified once is read unhashed while it is unchanged; ``False``
        #: hashes every read (the benchmarks compare the two).
        self.verify_once = True
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
        #: Chunks whose payload was hashed and matched its checksum.
        self.verified_reads = 0
        #: Chunks read without hashing: their file was unchanged since a verified read.
        self.trusted_reads = 0
        self.phases: Phases | None = None  # (lmprefetch bench-disk's budget sets one)

    # -- index ------------------------------------------------------------------------
    def _file_path(self, key: ChunkKey) -> str:
        return os.path.join(self.path, key.to_string() + chunkfile.FILE_SUFFIX)

    def _path_and_name(self, key: ChunkKey) -> tuple[str, bytes]:
        """The key's file path and its key string (as the header holds it), built once."""
        name = key.to_string()
        return os.path.join(self.path, name + chunkfile.FILE_SUFFIX), name.encode()

    async def _rebuild_index(self) -> None:
        """Create the directory and index the chunk files already in it (oldest first)."""
        scan = await trio.to_thread.run_sync(
            chunkfile.scan_dir, self.path, self._owns, limiter=self._write_limiter
        )
        found = sorted(scan.found, key=lambda entry: entry[0])  # by mtime: the best LRU order
        for _, key, size in found:
            self._index[key] = size
            self._used_bytes += size
        self.foreign_files = scan.foreign
        self.stale_temp_files_removed = scan.stale_temps
        self.clock_offset_ns = scan.clock_offset_ns
        victims: list[str] = []
        while self._used_bytes > self.capacity_bytes and self._index:
            key, size = self._index.popitem(last=False)
            self._used_bytes -= size
            self.stats.evictions += 1
            victims.append(self._file_path(key))
        if victims:  # the capacity shrank since the files were written
            await trio.to_thread.run_sync(
                chunkfile.unlink_all, victims, limiter=self._write_limiter
            )

    @property
    def per_tenant(self) -> bool:
        """Chunks are sealed per tenant: loads and writes take the request's tenant."""
        return self.stage.per_tenant

    def contains_now(self, key: ChunkKey) -> bool:
        return key in self._index

    async def contains(self, key: ChunkKey) -> bool:
        await trio.lowlevel.checkpoint()
        return key in self._index

    async def contains_prefix(self, keys: Sequence[ChunkKey], *, pin: bool) -> int:
        await trio.lowlevel.checkpoint()
        return self.contains_prefix_now(keys, pin=pin)  # synchronous: pins come last

    def contains_prefix_now(self, keys: Sequence[ChunkKey], *, pin: bool) -> int:
        """:meth:`contains_prefix` without its checkpoint: the index is in memory, so the
        engine's lookup probes this tier synchronously (a probe that may wait is awaited)."""
        phases = self.phases
        t0 = perf_counter() if phases is not None else 0.0
        found = self._count_prefix(self._index, keys, pin)
        if phases is not None:
            phases.add("probe", t0, perf_counter())
        return found

    def _drop(self, key: ChunkKey) -> None:
        self._trusted.pop(key, None)
        size = self._index.pop(key, None)
        if size is not None:
            self._used_bytes -= size
            self._note_removed(key)

    # -- load -------------------------------------------------------------------------
    async def load(
        self, keys: Sequence[ChunkKey], buffers: Sequence[Buffer], *, tenant: bytes = b""
    ) -> int:
        """Read ``keys[i]``'s file into ``buffers[i]``, verified and decoded (sealed chunks
        opened for ``tenant``); the contiguous count filled.

        Chunks are read concurrently (at most ``read_threads`` at once over all loads), but the
        result counts only from ``keys[0]`` up to the first chunk that is not indexed, missing,
        short, corrupt, undecodable, too large for its buffer or unreadable (D13, D17).  A
        missing, short, corrupt or undecodable file leaves the index (and is unlinked); a file
        too large for the buffer, or an I/O error, is a miss that leaves the file alone.  Chunks
        past the first miss may or may not have been read, and their buffers hold anything.  A
        buffer's ``length`` is set only once its payload passed the key and checksum checks and
        decoded (D12).  Each loaded chunk becomes most recently used.

        Cancellation: no chunk read starts after the cancel, and one already running stops at
        the end of its current piece (at most one piece per read thread; the threads write into
        the buffers, so they are waited for), and then ``Cancelled`` propagates.  The caller
        releases every buffer.
        """
        n = min(len(keys), len(buffers))
        indexed = 0
        while indexed < n and keys[indexed] in self._index:
            indexed += 1
        if indexed == 0:
            await trio.lowlevel.checkpoint()
            return 0
        trusted = self._trusted if self.verify_once else {}
        slots: list[memoryview] = []
        try:  # the slots' views are released once no thread can touch them
            slots.extend(buf.slot() for buf in buffers[:indexed])
            run = _LoadRun(
                [
                    (*self._path_and_name(key), slot, trusted.get(key))
                    for key, slot in zip(keys, slots, strict=False)
                ],
                tenant,
            )
            try:
                if self.cached_pass and not self.o_direct_active:
                    # Page-cache hits, the common case: a thread call per CPU but one (at
                    # least one, at most ``read_threads``) takes the chunks in order for as
                    # long as the page cache holds their bytes (RWF_NOWAIT), and checks
                    # between pieces whether the load was cancelled; a chunk the page cache
                    # lacks is put back.  A copy out of the page cache is bound by one core's
                    # memory traffic, so more cores copy faster, but the Trio thread keeps
                    # one: with none left, its wake-ups (a cancel's, the other lookups')
                    # wait for a reader (the phase budget, docs/benchmarks.md).  Concurrent
                    # loads share the read threads through the read limiter, first come
                    # first served.
                    passes = min(self._pass_threads, len(run.jobs))
                    if passes == 1:
                        await self._in_thread(self._read_all, run, True)
                    else:
                        async with trio.open_nursery() as in_cache:
                            for _ in range(passes):
                                in_cache.start_soon(self._in_thread, self._read_all, run, True)
                # What is left would wait for the device: several threads, where there are
                # enough chunks for them.
                readers = min(self.read_threads, -(-run.remaining() // _CHUNKS_PER_THREAD_CALL))
                if readers == 1:
                    await self._in_thread(self._read_all, run, False)
                elif readers > 1:
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
        finally:
            for slot in slots:
                slot.release()
        self.stats.chunks_loaded += count
        self.stats.bytes_loaded += loaded_bytes
        return count

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
            elif isinstance(outcome, _Loaded):
                buffers[i].length = outcome.payload_bytes
                self.o_direct_reads += outcome.direct
                if key in self._index:
                    self._index.move_to_end(key)
                    self._note_verified(key, outcome)
                if prefix:
                    count += 1
                    loaded_bytes += outcome.payload_bytes
                    self.stats.observe_decoded(
                        outcome.payload_bytes,
                        outcome.read.payload_bytes,
                        outcome.decode_s,
                        decoded=outcome.decoded,
                    )
            else:
                prefix = False
                if isinstance(outcome, chunkfile.FileMissing):
                    self._drop(key)
                elif isinstance(outcome, _Undecodable):
                    self._drop(key)
                    self.stats.codec_misses += 1
                    log.warning("disk tier: dropped chunk file %s: %s", key.to_string(), outcome)
                elif isinstance(outcome, chunkfile.FileCorrupt):
                    self._drop(key)
                    self.corrupt_files_removed += 1
                    self.stats.errors += 1
                    log.warning("disk tier: dropped corrupt chunk file %s: %s",
                                key.to_string(), outcome)
                elif isinstance(outcome, chunkfile.TooLarge):  # the file is fine, the slot small
                    self.stats.errors += 1
                else:  # EIO, EMFILE, ...: a miss now; the file may be fine later
                    self.stats.errors += 1
                    log.warning("disk tier: reading %s failed: %s", key.to_string(), outcome)
        return count, loaded_bytes

    def _note_verified(self, key: ChunkKey, loaded: _Loaded) -> None:
        """Remember (or forget) ``key``'s file as verified after a read (Trio thread)."""
        read = loaded.read
        if not read.hashed:
            self.trusted_reads += 1
            return
        self.verified_reads += 1
        if chunkfile.may_trust(read.identity, loaded.started_ns + self.clock_offset_ns):
            self._trusted[key] = read.identity
        else:  # racy (too young to tell a later change by its timestamps): hash it next time
            self._trusted.pop(key, None)

    # -- write-behind -----------------------------------------------------------------
    def enqueue_write(self, key: ChunkKey, buf: Buffer, *, tenant: bytes = b"") -> bool:
        """Queue ``buf``'s payload to be written under ``key`` (synchronous, never blocks);
        ``tenant`` is whom it is sealed for (with encryption on).

        Takes an owner reference on ``buf``, released once the file is written (or the write
        is dropped, or the tier closes); see :mod:`lmprefetch.tiers.writebehind`.

        Returns:
            ``True`` if the key is on disk, being written or queued; ``False`` if the write is
            dropped (the queue is full, the key is too long, or the tier is closing), counted
            in ``stats.writes_dropped``.
        """
        if key in self._index or self._writes.has(key):
            return True
        if len(key.to_string().encode()) > chunkfile.MAX_KEY_BYTES:
            self.stats.writes_dropped += 1
            return False
        return self._writes.put(key, buf, tenant=tenant)

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
        payload_bytes = buf.length
        stored: bytes | bytearray | memoryview | None = None  # None: the buffer's own bytes
        if not self.stage.passthrough:
            # Encoded in the writer's thread, never on the caller's path; the buffer goes back
            # as soon as its bytes are encoded.
            stored, seconds = await trio.to_thread.run_sync(
                _encode, self.stage, buf, key, entry.tenant,
                limiter=self._write_limiter,
                abandon_on_cancel=False,  # the thread reads the buffer released after
            )  # fmt: skip
            self.stats.encode_seconds += seconds
            entry.release()
        size = HEADER_BYTES + (payload_bytes if stored is None else len(stored))
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
                chunkfile.unlink_all,
                [self._file_path(v) for v in victims],
                limiter=self._write_limiter,
            )
        final = self._file_path(key)
        try:
            with contextlib.ExitStack() as views:
                data = views.enter_context(buf.view()) if stored is None else memoryview(stored)
                # (A payload as it is: the call there always was; format version 2 otherwise.)
                write = (
                    chunkfile.write_file
                    if stored is None
                    else partial(chunkfile.write_file, encoded=True)
                )
                await trio.to_thread.run_sync(
                    write,
                    final,
                    final[: -len(chunkfile.FILE_SUFFIX)] + chunkfile.TEMP_SUFFIX,
                    key.to_string().encode(),
                    data,
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
            await trio.to_thread.run_sync(
                chunkfile.unlink_all, [final], limiter=self._write_limiter
            )
            return
        self._trusted.pop(key, None)  # a new file: verified on its first read
        self._index[key] = size
        self._used_bytes += size
        self.stats.chunks_stored += 1
        self.stats.bytes_stored += payload_bytes
        self.stats.encoded_bytes_stored += size - HEADER_BYTES
        self._note_stored(key)

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
                chunkfile.unlink_all, [self._file_path(key)], limiter=self._write_limiter
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
        if not await self._flush_before_close(self.close_timeout_s):
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
    owns: Callable[[ChunkKey], bool] | None = None,
    stage: ChunkStage | None = None,
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
        owns=owns,
        stage=stage,
    )
    await tier._rebuild_index()
    async with trio.open_nursery() as nursery:
        # Shielded: the writer shields itself from the start, so a start() cancelled before
        # the writer said it started would wait for it forever (trio leaves a child that
        # starts in a cancelled start() where it is, and start() waits for it to end).  The
        # start takes no time; the cancellation is seen at the next checkpoint.
        with trio.CancelScope(shield=True):
            await nursery.start(tier._run_writer)
        try:
            yield tier
        finally:
            await tier.aclose()


# -- file operations (worker threads only) ---------------------------------------------------
def _encode(
    stage: ChunkStage, buf: Buffer, key: ChunkKey, tenant: bytes
) -> tuple[bytes | bytearray | memoryview, float]:
    """The stored bytes of ``buf``'s payload, and the seconds encoding took."""
    t0 = time.perf_counter()
    with buf.view() as payload:
        stored = stage.encode(payload, key_name=key.to_string().encode(), tenant=tenant)
    return stored, time.perf_counter() - t0
