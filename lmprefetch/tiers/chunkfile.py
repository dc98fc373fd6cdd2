"""The chunk-file format of the disk tier, and its synchronous file I/O.

Every chunk lives in its own file ``<key.to_string()>.kv`` under the tier's directory.  A file is
a fixed-size header followed by the payload:

===========  =====  ===========================================================================
offset       bytes  field (integers little-endian)
===========  =====  ===========================================================================
0            8      magic ``b"LMPFKV1\\0"``
8            4      format version: ``1``, the payload as it is; ``2``, what the tier's codec
                    stage made of it (an encoded or sealed chunk, docs/codecs.md)
12           4      header size in bytes (``4096``)
16           8      payload length in bytes
24           8      xxh3-64 of the payload
32           4      length ``n`` of the key string in bytes
36           n      the key string (``ChunkKey.to_string()``, UTF-8)
36 + n       ...    zero padding up to 4096
4096         len    the payload
===========  =====  ===========================================================================

A release that predates codecs knows only version 1: it takes an encoded file for a corrupt
one (a miss), never for a payload.

The key string in the header means a file can never be taken for another key (a file copied or
renamed by hand is a miss, not wrong data); the checksum means a torn or bit-flipped payload is a
miss, never garbage handed to the model (LMCache's disk backend returns normally from a missing
file, leaving the buffer unread, D17).  The header is a whole page so that with ``O_DIRECT`` the
payload starts block-aligned and is read straight into an arena slot.

Everything here is synchronous and runs in worker threads only (the disk tier calls it through
``trio.to_thread.run_sync``); nothing here knows about Trio.  Reads verify the key and the
checksum and raise a :class:`ChunkMiss` subclass for anything that is not exactly the chunk
asked for; writes go to a temporary file that is renamed over the final name.

Verified once.  A read also returns the file's :class:`FileIdentity` (device, inode, size,
mtime and ctime in nanoseconds, from ``fstat`` of the file it read).  A later read that is given
that identity as ``trusted`` and finds the file's identity unchanged skips the checksum (the key
and the length in the header are still checked): nothing has changed the file since its bytes
were verified.  Anything that writes into the file, truncates it, renames another file over its
name or sets its times changes at least its ctime, which the kernel sets and nobody can set
back.  What the identity cannot see is a change within one tick of the file system's
timestamps (coarse clocks; 1 s or 2 s on some file systems): git's "racy" files.  So, as git
does, an identity is trusted only when the file's timestamps are older than the verification by
more than :data:`RACY_NS` (:func:`may_trust`); a younger file is verified again on every read
until it is old enough.

The ``Dnn`` codes are LMCache's defects, the rows of the defect table in
``docs/cancellation.md`` ("The defects"), each with its ``test_dNN_`` regression tests.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import struct
import tempfile
import time
from collections.abc import Callable
from typing import NamedTuple

import xxhash

from .._phases import Phases, perf_counter
from ..keys import ChunkKey

__all__ = [
    "FILE_SUFFIX",
    "HEADER_BYTES",
    "MAGIC",
    "RACY_NS",
    "TEMP_SUFFIX",
    "VERSION",
    "VERSION_ENCODED",
    "ChunkMiss",
    "ChunkRead",
    "DirectUnsupported",
    "FileCorrupt",
    "FileIdentity",
    "FileMissing",
    "TooLarge",
    "may_trust",
    "read_buffered",
    "read_direct",
    "scan_dir",
    "unlink_all",
    "unlink_quiet",
    "write_file",
]

#: First bytes of every chunk file.
MAGIC = b"LMPFKV1\0"
#: Chunk file format version: a payload as it is.
VERSION = 1
#: ... and a file whose payload is what the codec stage made of one.
VERSION_ENCODED = 2
#: Size of the header before the payload: one page, so an ``O_DIRECT`` payload is aligned.
HEADER_BYTES = 4096
#: magic, version, header size, payload length, xxh3-64 of the payload, key string length.
HEADER = struct.Struct("<8sIIQQI")
MAX_KEY_BYTES = HEADER_BYTES - HEADER.size
#: ``O_DIRECT`` needs block-aligned memory, offsets and lengths; a page covers every block size.
ALIGN = 4096
#: A chunk is read (and hashed) in pieces of this size: small enough that a piece is still in
#: the CPU's cache when it is hashed, and that a cancelled load waits for little (a 1 MiB piece
#: is read in about 0.15 ms from the page cache); large enough that the cost of each piece
#: stays small.  That cost is not only a system call and a few Python operations: the thread
#: gives the GIL up and takes it back around every read and every hash, and with several read
#: threads and the Trio thread each taking it back can wait for the others.  Measured on a
#: 2-core VM (16 x 2 MiB disk hits through the engine, variants alternated in one process):
#: 256 KiB pieces took 1.2-1.6x the time of 1 MiB pieces; 512 KiB 1.03-1.16x; whole 2 MiB
#: chunks 0.83-1.05x (the machine's load moved more than that), but a cancel would then wait
#: for a whole chunk.  A multiple of ``ALIGN``.
PIECE_BYTES = 1024 * 1024
#: A file whose mtime or ctime is less than this before the moment it was verified may change
#: again without its timestamps showing it, so its identity is not trusted (git's "racy" rule).
#: 2 s covers the coarsest timestamps in use (FAT: 2 s; ext3, HFS+ and some NFS servers: 1 s;
#: ext4, xfs, btrfs and tmpfs: one tick of the kernel's coarse clock, a few ms).
RACY_NS = 2_000_000_000
O_DIRECT_FLAG: int = getattr(os, "O_DIRECT", 0)
#: ``preadv2``'s ``RWF_NOWAIT`` (Linux 4.14+): read only what the page cache holds.
NOWAIT_FLAG: int = getattr(os, "RWF_NOWAIT", 0)

FILE_SUFFIX = ".kv"
TEMP_SUFFIX = ".kv.tmp"

#: A probe file that fails with one of these found a full file system, not an unwritable one.
_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})

log = logging.getLogger("lmprefetch.disk")


# -- what a chunk read can find (raised in the reading thread) -------------------------------
class ChunkMiss(Exception):
    """The chunk cannot be loaded from its file; the load stops here."""


class FileMissing(ChunkMiss):
    """No file under the key's name."""


class FileCorrupt(ChunkMiss):
    """The file is not a valid chunk file for this key (it has been unlinked)."""


class TooLarge(ChunkMiss):
    """A valid file whose payload does not fit the destination buffer (the file is kept)."""


class NotCached(Exception):
    """A read with ``nowait`` found bytes of the file that are not in the page cache (reading
    them would wait for the device): nothing is wrong with the file, read it without
    ``nowait``.  ``unsupported``: the file system refuses ``RWF_NOWAIT`` altogether."""

    def __init__(self, unsupported: bool = False) -> None:
        super().__init__("not in the page cache" if not unsupported else "RWF_NOWAIT refused")
        self.unsupported = unsupported


class DirectUnsupported(Exception):
    """``O_DIRECT`` was refused (``EINVAL``): read this chunk, and all later ones, buffered."""


class FileIdentity(NamedTuple):
    """What ``fstat`` says about a file that changes whenever its bytes may have.

    Writing into the file, truncating it or setting its times changes its ctime (the kernel
    sets it to the time of the change, and no call sets it back); replacing it by a rename
    changes its inode (or device).
    """

    device: int
    inode: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> FileIdentity:
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class ChunkRead(NamedTuple):
    """A chunk read into its slot."""

    #: Bytes of payload now at the start of the slot.
    payload_bytes: int
    #: The identity of the file read (``fstat`` of the open file, before its bytes were read).
    identity: FileIdentity
    #: ``True``: the payload's checksum was computed and matched.  ``False``: the file's
    #: identity was the ``trusted`` one given, so the checksum was skipped.
    hashed: bool
    #: The payload is what a codec stage made of one (format version 2), to be decoded.
    encoded: bool = False


def may_trust(identity: FileIdentity, verified_at_ns: int) -> bool:
    """Whether a file verified at ``verified_at_ns`` (the file system's clock, taken before
    the file was opened) may be read unhashed while its identity stays ``identity``: only if
    its timestamps were older than the verification by at least :data:`RACY_NS`.  A change
    made after the verification then has a later timestamp, so it shows in the identity."""
    return max(identity.mtime_ns, identity.ctime_ns) + RACY_NS <= verified_at_ns


class DirScan(NamedTuple):
    """What :func:`scan_dir` found."""

    #: ``(mtime_ns, key, file_bytes)`` of each chunk file of the tier's own keys.
    found: list[tuple[int, ChunkKey, int]]
    #: Entries that are not the tier's chunk files (left alone).
    foreign: int
    #: Temporary files of interrupted writes, deleted.
    stale_temps: int
    #: The file system's clock minus this host's (see :func:`check_writable_dir`).
    clock_offset_ns: int


def scan_dir(path: str, owns: Callable[[ChunkKey], bool] | None = None) -> DirScan:
    """Create ``path`` if needed and list the chunk files in it.

    Only chunk files whose key ``owns`` accepts are listed, and only their temporary files (of
    writes a crash interrupted) are deleted: another tier sharing the directory may be writing
    its own right now.  Everything else counts as foreign and is left alone.

    Raises:
        ValueError: ``path`` cannot be created, is not a directory, or is not writable (the
            message starts with ``disk_path``, the setting to fix).
    """
    clock_offset_ns = check_writable_dir(path)
    found: list[tuple[int, ChunkKey, int]] = []
    foreign = stale = 0
    with os.scandir(path) as entries:
        for entry in entries:
            name = entry.name
            if name.endswith(TEMP_SUFFIX) and entry.is_file(follow_symlinks=False):
                temp_key = parse_name(name[: -len(TEMP_SUFFIX)] + FILE_SUFFIX)
                if temp_key is not None and (owns is None or owns(temp_key)):
                    unlink_quiet(entry.path)
                    stale += 1
                else:
                    foreign += 1
                continue
            key = parse_name(name)
            if key is None or not entry.is_file(follow_symlinks=False):
                foreign += 1
                continue
            if owns is not None and not owns(key):
                foreign += 1
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:  # deleted while we looked
                continue
            found.append((st.st_mtime_ns, key, st.st_size))
    return DirScan(found, foreign, stale, clock_offset_ns)


def check_writable_dir(path: str) -> int:
    """Check that ``path`` is (or can be made) a writable directory, by writing a probe file.

    Returns:
        The file system's clock minus this host's, in ns, from the probe file's mtime: a lower
        bound (the timestamp is coarse), 0 if the file system is full.  Files on a network
        file system get the server's timestamps; :func:`may_trust` compares them with this
        host's clock plus this offset.

    Raises:
        ValueError: as :func:`scan_dir`.
    """
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
        if exc.errno in _FULL:
            # Writable, but full now (no free block or inode, or over quota).  A full disk is
            # a state, not a wrong setting: the tier serves the chunks it holds and drops (and
            # counts) writes until there is room, so a worker restarted on it must start.
            log.warning("disk_path %r is full (%s); starting anyway", path, exc.strerror)
            return 0
        raise ValueError(f"disk_path: {path!r} is not writable ({exc.strerror})") from None
    try:
        # The probe's mtime was taken from the file system's clock before now, and truncated
        # to its timestamp granularity: the offset is at most the true one, which errs on the
        # side of verifying a file again (see may_trust).
        offset_ns = os.fstat(fd).st_mtime_ns - time.time_ns()
    finally:
        os.close(fd)
        unlink_quiet(probe)
    return offset_ns


def parse_name(name: str) -> ChunkKey | None:
    if not name.endswith(FILE_SUFFIX):
        return None
    text = name[: -len(FILE_SUFFIX)]
    try:
        key = ChunkKey.from_string(text)
        # Only the canonical spelling is ours: two names must never map to one key.
        canonical = key.to_string()
    except ValueError:  # UnicodeEncodeError too: a name that is not UTF-8 is not ours
        return None
    return key if canonical == text else None


def address(view: memoryview) -> int:
    """The memory address of ``view``'s first byte (it must be writable)."""
    return ctypes.addressof((ctypes.c_char * 1).from_buffer(view))


def read_buffered(
    path: str,
    key_bytes: bytes,
    slot: memoryview,
    check: Callable[[], None] | None = None,
    trusted: FileIdentity | None = None,
    phases: Phases | None = None,
    nowait: bool = False,
) -> ChunkRead:
    """Read and verify the chunk file ``path`` into ``slot`` through the page cache.

    ``check`` is called before each piece after the first, and may raise to stop the read (a
    cancelled load).  If the file's identity is ``trusted`` (what an earlier read that hashed
    it returned), the checksum is skipped; see :func:`_read_fd`.  ``phases``: where a
    benchmark records the time of the system calls and the hashing.  ``nowait``: read only
    from the page cache (``RWF_NOWAIT``), raising :class:`NotCached` at the first byte that is
    not there (the slot then holds anything).
    """
    t0 = perf_counter() if phases is not None else 0.0
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    if phases is not None:
        phases.add("syscalls", t0, perf_counter())
    try:
        return _read_fd(
            fd, key_bytes, slot, bytearray(HEADER_BYTES), direct=False, check=check,
            trusted=trusted, phases=phases, flags=NOWAIT_FLAG if nowait else 0,
        )
    finally:
        t0 = perf_counter() if phases is not None else 0.0
        os.close(fd)
        if phases is not None:
            phases.add("syscalls", t0, perf_counter())


def read_direct(
    path: str,
    key_bytes: bytes,
    slot: memoryview,
    check: Callable[[], None] | None = None,
    trusted: FileIdentity | None = None,
    phases: Phases | None = None,
) -> ChunkRead:
    """:func:`read_buffered` with ``O_DIRECT`` (``slot`` must be page-aligned); raises
    :class:`DirectUnsupported` when the file system refuses it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | O_DIRECT_FLAG)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            raise DirectUnsupported from None
        raise
    try:
        # The header lands in its own page-aligned page (anonymous mmap memory).
        with mmap.mmap(-1, HEADER_BYTES) as header_page, memoryview(header_page) as header:
            try:
                return _read_fd(
                    fd, key_bytes, slot, header, direct=True, check=check, trusted=trusted,
                    phases=phases,
                )
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
        # (Raised out here, once the page is unmapped: a misaligned read refused.)
        raise DirectUnsupported
    finally:
        os.close(fd)


def _read_fd(
    fd: int,
    key_bytes: bytes,
    slot: memoryview,
    header: memoryview | bytearray,
    *,
    direct: bool,
    check: Callable[[], None] | None = None,
    trusted: FileIdentity | None = None,
    phases: Phases | None = None,
    flags: int = 0,
) -> ChunkRead:
    """Read header and payload of the open chunk file ``fd``; verify them (``flags``:
    ``preadv2``'s, for every read).

    The payload is read in pieces of :data:`PIECE_BYTES`, and each piece is hashed as soon as
    it has landed, while it is still in the CPU's cache: one pass over memory instead of two
    (a read, then a checksum over the whole payload).  The header comes with the first piece
    and is checked at once, so a file for another key costs one piece, not the whole read.
    Between pieces ``check()`` may raise to stop: a cancelled load then waits for one piece,
    not one chunk.

    The identity is taken (``fstat``) before any byte is read.  When it equals ``trusted``,
    the file has not changed since a read verified those bytes, and no piece is hashed; the
    header (key, length) is checked all the same, and ``fstat`` once more after the last piece:
    a file changed during the read is hashed then.
    """
    t0 = perf_counter() if phases is not None else 0.0
    identity = FileIdentity.of(os.fstat(fd))
    if phases is not None:
        phases.add("syscalls", t0, perf_counter())
    payload_bytes = identity.size - HEADER_BYTES
    if payload_bytes < 0:
        raise FileCorrupt(f"{identity.size} bytes, shorter than the header")
    if payload_bytes > slot.nbytes:
        # Too large for the buffer, or a damaged length: read the header to tell which.
        if _read_into(fd, [header], HEADER_BYTES, 0, flags) < HEADER_BYTES:
            raise FileCorrupt("short read of the header")
        _check_header(header, key_bytes, payload_bytes)
        raise TooLarge(f"a {payload_bytes}-byte payload for a {slot.nbytes}-byte buffer")
    # O_DIRECT reads whole blocks; the read stops at the end of the file.
    want = -(-payload_bytes // ALIGN) * ALIGN if direct else payload_bytes
    hasher = None if identity == trusted else xxhash.xxh3_64()
    checksum = 0
    encoded = False
    got = 0  # file bytes read so far
    pos = 0  # payload bytes read so far
    while True:
        n = min(PIECE_BYTES, want - pos)
        t0 = perf_counter() if phases is not None else 0.0
        with slot[pos : pos + n] as dst:
            if pos == 0:
                got = _read_into(fd, [header, dst], HEADER_BYTES + n, 0, flags)
                if got < HEADER_BYTES:
                    raise FileCorrupt("short read of the header")
                checksum, encoded = _check_header(header, key_bytes, payload_bytes)
            else:
                got += _read_into(fd, [dst], n, HEADER_BYTES + pos, flags)
        if phases is not None:
            phases.add("syscalls", t0, t0 := perf_counter())
        end = min(pos + n, payload_bytes)
        if got < HEADER_BYTES + end:
            raise FileCorrupt("short read (the file shrank)")
        if hasher is not None:
            with slot[pos:end] as piece:
                hasher.update(piece)
            if phases is not None:
                phases.add("hash", t0, perf_counter())
        pos += n
        if pos >= want:
            break
        if check is not None:
            check()
    if hasher is None:
        # Trusted, but changed while it was being read (by someone else: the tier's own writes
        # replace a file, they never write into one)?  Its ctime says so; then the bytes that
        # landed are checked after all.
        t0 = perf_counter() if phases is not None else 0.0
        after = FileIdentity.of(os.fstat(fd))
        if phases is not None:
            phases.add("syscalls", t0, perf_counter())
        if after == identity:
            return ChunkRead(payload_bytes, identity, False, encoded)
        with slot[:payload_bytes] as payload:
            if xxhash.xxh3_64_intdigest(payload) != checksum:
                raise FileCorrupt("payload checksum mismatch (changed while read)")
        return ChunkRead(payload_bytes, after, True, encoded)
    if hasher.intdigest() != checksum:
        raise FileCorrupt("payload checksum mismatch")
    return ChunkRead(payload_bytes, identity, True, encoded)


def _check_header(
    header: memoryview | bytearray, key_bytes: bytes, payload_bytes: int
) -> tuple[int, bool]:
    """Verify ``header`` against the expected key and the payload length found; its checksum,
    and whether the payload is encoded (version 2)."""
    magic, version, header_bytes, length, checksum, key_len = HEADER.unpack_from(header, 0)
    if magic != MAGIC:
        raise FileCorrupt("not a chunk file (bad magic)")
    if version not in (VERSION, VERSION_ENCODED) or header_bytes != HEADER_BYTES:
        raise FileCorrupt(f"unknown format version {version} / header size {header_bytes}")
    start = HEADER.size
    if key_len != len(key_bytes) or bytes(header[start : start + key_len]) != key_bytes:
        raise FileCorrupt("the file holds another key")
    if length != payload_bytes:
        raise FileCorrupt(f"header says {length} payload bytes, the file holds {payload_bytes}")
    return int(checksum), version == VERSION_ENCODED


def _read_into(
    fd: int, views: list[memoryview | bytearray], expected: int, offset: int = 0, flags: int = 0
) -> int:
    """``preadv`` (with ``flags``) from ``offset`` until ``expected`` bytes arrived, the views
    are full or the file ended; the number of bytes read.  Raises :class:`NotCached` where
    ``RWF_NOWAIT`` in ``flags`` meets bytes the page cache does not hold, or is refused."""
    pending = [memoryview(view) for view in views]
    got = 0
    try:
        while pending and got < expected:
            try:
                n = os.preadv(fd, pending, offset + got, flags)
            except BlockingIOError:
                raise NotCached from None
            except OSError as exc:
                if flags and exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise NotCached(unsupported=True) from None
                raise
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


def write_file(
    final: str, temp: str, key_bytes: bytes, payload: memoryview, *, encoded: bool = False
) -> None:
    """Write a chunk file to ``temp``, then rename it over ``final`` (atomic); ``encoded``:
    ``payload`` is what a codec stage made of one (format version 2)."""
    header = bytearray(HEADER_BYTES)
    HEADER.pack_into(
        header, 0, MAGIC, VERSION_ENCODED if encoded else VERSION, HEADER_BYTES, payload.nbytes,
        xxhash.xxh3_64_intdigest(payload), len(key_bytes),
    )
    header[HEADER.size : HEADER.size + len(key_bytes)] = key_bytes
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        try:
            _write_all(fd, [memoryview(header), payload])
        finally:
            os.close(fd)
        os.replace(temp, final)
    except BaseException:
        unlink_quiet(temp)
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


def unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def unlink_all(paths: list[str]) -> None:
    for path in paths:
        unlink_quiet(path)
