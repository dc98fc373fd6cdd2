"""The chunk-file format of the disk tier, and its synchronous file I/O.

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

Everything here is synchronous and runs in worker threads only (the disk tier calls it through
``trio.to_thread.run_sync``); nothing here knows about Trio.  Reads verify the key and the
checksum and raise a :class:`ChunkMiss` subclass for anything that is not exactly the chunk
asked for; writes go to a temporary file that is renamed over the final name.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import struct
import tempfile
from collections.abc import Callable

import xxhash

from ..keys import ChunkKey

__all__ = [
    "FILE_SUFFIX",
    "HEADER_BYTES",
    "MAGIC",
    "TEMP_SUFFIX",
    "VERSION",
    "ChunkMiss",
    "DirectUnsupported",
    "FileCorrupt",
    "FileMissing",
    "TooLarge",
    "read_buffered",
    "read_direct",
    "scan_dir",
    "unlink_all",
    "unlink_quiet",
    "write_file",
]

#: First bytes of every chunk file.
MAGIC = b"LMPFKV1\0"
#: Chunk file format version.
VERSION = 1
#: Size of the header before the payload: one page, so an ``O_DIRECT`` payload is aligned.
HEADER_BYTES = 4096
#: magic, version, header size, payload length, xxh3-64 of the payload, key string length.
HEADER = struct.Struct("<8sIIQQI")
MAX_KEY_BYTES = HEADER_BYTES - HEADER.size
#: ``O_DIRECT`` needs block-aligned memory, offsets and lengths; a page covers every block size.
ALIGN = 4096
#: A chunk is read (and hashed) in pieces of this size: small enough that a piece is still in
#: the CPU's cache when it is hashed, and that a cancelled load waits for little; large enough
#: that the per-piece cost (a system call, a few Python operations) stays small.  A multiple of
#: ``ALIGN``.
PIECE_BYTES = 256 * 1024
O_DIRECT_FLAG: int = getattr(os, "O_DIRECT", 0)

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


class DirectUnsupported(Exception):
    """``O_DIRECT`` was refused (``EINVAL``): read this chunk, and all later ones, buffered."""


def scan_dir(
    path: str, owns: Callable[[ChunkKey], bool] | None = None
) -> tuple[list[tuple[int, ChunkKey, int]], int, int]:
    """Create ``path`` if needed; ``([(mtime_ns, key, file_bytes)], foreign, stale_temps)``.

    Only chunk files whose key ``owns`` accepts are listed, and only their temporary files (of
    writes a crash interrupted) are deleted: another tier sharing the directory may be writing
    its own right now.  Everything else counts as foreign and is left alone.

    Raises:
        ValueError: ``path`` cannot be created, is not a directory, or is not writable (the
            message starts with ``disk_path``, the setting to fix).
    """
    check_writable_dir(path)
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
    return found, foreign, stale


def check_writable_dir(path: str) -> None:
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
            return
        raise ValueError(f"disk_path: {path!r} is not writable ({exc.strerror})") from None
    os.close(fd)
    unlink_quiet(probe)


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
    path: str, key_bytes: bytes, slot: memoryview, check: Callable[[], None] | None = None
) -> int:
    """Read and verify the chunk file ``path`` into ``slot`` through the page cache; the
    payload length.  ``check`` is called before each piece after the first, and may raise to
    stop the read (a cancelled load); see :func:`_read_fd`."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return _read_fd(fd, key_bytes, slot, bytearray(HEADER_BYTES), direct=False, check=check)
    finally:
        os.close(fd)


def read_direct(
    path: str, key_bytes: bytes, slot: memoryview, check: Callable[[], None] | None = None
) -> int:
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
                return _read_fd(fd, key_bytes, slot, header, direct=True, check=check)
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
) -> int:
    """Read header and payload of the open chunk file ``fd``; verify; the payload length.

    The payload is read in pieces of :data:`PIECE_BYTES`, and each piece is hashed as soon as
    it has landed, while it is still in the CPU's cache: one pass over memory instead of two
    (a read, then a checksum over the whole payload).  The header comes with the first piece
    and is checked at once, so a file for another key costs one piece, not the whole read.
    Between pieces ``check()`` may raise to stop: a cancelled load then waits for one piece,
    not one chunk.
    """
    file_bytes = os.fstat(fd).st_size
    payload_bytes = file_bytes - HEADER_BYTES
    if payload_bytes < 0:
        raise FileCorrupt(f"{file_bytes} bytes, shorter than the header")
    if payload_bytes > slot.nbytes:
        # Too large for the buffer, or a damaged length: read the header to tell which.
        if _read_into(fd, [header], HEADER_BYTES) < HEADER_BYTES:
            raise FileCorrupt("short read of the header")
        _check_header(header, key_bytes, payload_bytes)
        raise TooLarge(f"a {payload_bytes}-byte payload for a {slot.nbytes}-byte buffer")
    # O_DIRECT reads whole blocks; the read stops at the end of the file.
    want = -(-payload_bytes // ALIGN) * ALIGN if direct else payload_bytes
    hasher = xxhash.xxh3_64()
    checksum = 0
    got = 0  # file bytes read so far
    pos = 0  # payload bytes read so far
    while True:
        n = min(PIECE_BYTES, want - pos)
        with slot[pos : pos + n] as dst:
            if pos == 0:
                got = _read_into(fd, [header, dst], HEADER_BYTES + n)
                if got < HEADER_BYTES:
                    raise FileCorrupt("short read of the header")
                checksum = _check_header(header, key_bytes, payload_bytes)
            else:
                got += _read_into(fd, [dst], n, HEADER_BYTES + pos)
        end = min(pos + n, payload_bytes)
        if got < HEADER_BYTES + end:
            raise FileCorrupt("short read (the file shrank)")
        with slot[pos:end] as piece:
            hasher.update(piece)
        pos += n
        if pos >= want:
            break
        if check is not None:
            check()
    if hasher.intdigest() != checksum:
        raise FileCorrupt("payload checksum mismatch")
    return payload_bytes


def _check_header(header: memoryview | bytearray, key_bytes: bytes, payload_bytes: int) -> int:
    """Verify ``header`` against the expected key and the payload length found; its checksum."""
    magic, version, header_bytes, length, checksum, key_len = HEADER.unpack_from(header, 0)
    if magic != MAGIC:
        raise FileCorrupt("not a chunk file (bad magic)")
    if version != VERSION or header_bytes != HEADER_BYTES:
        raise FileCorrupt(f"unknown format version {version} / header size {header_bytes}")
    start = HEADER.size
    if key_len != len(key_bytes) or bytes(header[start : start + key_len]) != key_bytes:
        raise FileCorrupt("the file holds another key")
    if length != payload_bytes:
        raise FileCorrupt(f"header says {length} payload bytes, the file holds {payload_bytes}")
    return int(checksum)


def _read_into(
    fd: int, views: list[memoryview | bytearray], expected: int, offset: int = 0
) -> int:
    """``preadv`` from ``offset`` until ``expected`` bytes arrived, the views are full or the
    file ended; the number of bytes read."""
    pending = [memoryview(view) for view in views]
    got = 0
    try:
        while pending and got < expected:
            n = os.preadv(fd, pending, offset + got)
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


def write_file(final: str, temp: str, key_bytes: bytes, payload: memoryview) -> None:
    """Write a chunk file to ``temp``, then rename it over ``final`` (atomic)."""
    header = bytearray(HEADER_BYTES)
    HEADER.pack_into(
        header, 0, MAGIC, VERSION, HEADER_BYTES, payload.nbytes,
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
