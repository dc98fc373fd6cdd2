"""The self-describing envelope of one encoded chunk, and what a reader raises when it cannot
trust one.

An encoded chunk is a fixed 36-byte header followed by the codec's body:

======  =====  ================================================================================
offset  bytes  field (integers little-endian)
======  =====  ================================================================================
0       4      magic ``b"LKVC"``
4       1      format version (``1``)
5       1      codec id (:data:`CODEC_IDS`: 0 none, 1 lossless, 2 bitround, 3 fp8, 4 int8,
               5 int4)
6       1      codec parameter (``bitround``: mantissa bits kept; otherwise 0)
7       1      element dtype id (:data:`DTYPE_IDS`; 0 = opaque bytes)
8       4      group: elements per scale (lossy codecs with per-group scales; otherwise 0)
12      8      decoded length: bytes of the payload the body decodes to
20      8      body length: bytes after the header (the blob is exactly header + body)
28      8      xxh3-64 of bytes 0–27 of the header followed by the body
36      …      the body (the codec's own layout, see :mod:`.lossless` and :mod:`.lossy`)
======  =====  ================================================================================

So a reader knows what it reads (the codec, its parameters, the dtype and the grouping come
from the header, not from the reader's configuration: chunks written under another setting stay
readable), and a reader never hands out bytes it cannot vouch for: a wrong magic, an unknown
version, codec or dtype, a length that does not add up, a checksum that does not match, or a
body the codec cannot parse all raise a :class:`CodecMiss`, which a tier treats like a missing
chunk.  The checksum covers the encoded bytes (cheaper than the decoded ones, and it catches a
damaged body before the decompressor reads it).

Pure functions: nothing here does I/O.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

import xxhash

__all__ = [
    "CODEC_IDS",
    "DTYPE_IDS",
    "HEADER",
    "MAGIC",
    "VERSION",
    "CodecMiss",
    "CorruptEncoding",
    "Header",
    "UnknownEncoding",
    "dtype_itemsize",
    "is_encoded",
    "pack",
    "unpack",
]

MAGIC = b"LKVC"
VERSION = 1
#: magic, version, codec, parameter, dtype, group, decoded length, body length, checksum.
HEADER = struct.Struct("<4sBBBBIQQQ")
_CHECKED = HEADER.size - 8  # the header bytes the checksum covers (all but itself)

#: Codec name -> id in the header.  Ids are never reused.
CODEC_IDS = {"none": 0, "lossless": 1, "bitround": 2, "fp8": 3, "int8": 4, "int4": 5}
#: Element dtype name -> (id in the header, bytes per element).  ``bytes``: opaque bytes.
DTYPE_IDS = {
    "bytes": (0, 1),
    "bfloat16": (1, 2),
    "float16": (2, 2),
    "float32": (3, 4),
    "float8_e4m3fn": (4, 1),
    "float8_e5m2": (5, 1),
    "int8": (6, 1),
    "uint8": (7, 1),
}
_CODEC_NAMES = {v: k for k, v in CODEC_IDS.items()}
_DTYPE_NAMES = {v[0]: k for k, v in DTYPE_IDS.items()}


class CodecMiss(Exception):
    """A stored chunk that cannot be decoded into exactly the bytes that were stored: the load
    stops at this chunk (a miss), nothing is handed out."""

    def detached(self) -> CodecMiss:
        """This exception without its traceback and context, to keep as a value: the
        decoder's frames it would hold refer to views of the caller's buffer (an arena slot
        must not stay exported after the load)."""
        self.__traceback__ = None
        self.__context__ = None
        self.__cause__ = None
        return self


class CorruptEncoding(CodecMiss):
    """Damaged: the checksum, a length or the codec's body does not add up (or it is not an
    encoded chunk at all)."""


class UnknownEncoding(CodecMiss):
    """Well-formed, but written by a newer format, codec or dtype than this reader knows, or
    for a dtype other than the one the reader expects."""


class Header(NamedTuple):
    """The fields of an encoded chunk's header."""

    codec: str
    param: int
    dtype: str
    group: int
    decoded_bytes: int
    body_bytes: int


def dtype_itemsize(dtype: str) -> int:
    """Bytes per element of a header dtype name.

    Raises:
        ValueError: not a dtype name of :data:`DTYPE_IDS`.
    """
    try:
        return DTYPE_IDS[dtype][1]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r} (known: {', '.join(DTYPE_IDS)})") from None


def is_encoded(blob: bytes | bytearray | memoryview) -> bool:
    """Whether ``blob`` starts like an encoded chunk (its magic); says nothing of its
    integrity."""
    return bytes(memoryview(blob)[: len(MAGIC)]) == MAGIC


def pack(
    codec: str, param: int, dtype: str, group: int, decoded_bytes: int, body: bytes | memoryview
) -> bytes:
    """One encoded chunk: the header (checksum included) and ``body``."""
    prefix = HEADER.pack(
        MAGIC,
        VERSION,
        CODEC_IDS[codec],
        param,
        DTYPE_IDS[dtype][0],
        group,
        decoded_bytes,
        len(body),
        0,
    )[:_CHECKED]
    digest = xxhash.xxh3_64(prefix)
    digest.update(body)
    return b"".join((prefix, digest.digest()[::-1], body))  # little-endian like the rest


def unpack(blob: bytes | bytearray | memoryview) -> tuple[Header, memoryview]:
    """The header of an encoded chunk and a view of its body, both verified.

    Raises:
        CorruptEncoding: not an encoded chunk, a length that does not add up, or a checksum
            that does not match.
        UnknownEncoding: a version, codec or dtype this reader does not know.
    """
    view = memoryview(blob).cast("B")
    if len(view) < HEADER.size:
        raise CorruptEncoding(f"{len(view)} bytes: shorter than an encoded chunk's header")
    magic, version, codec_id, param, dtype_id, group, decoded, body_len, checksum = (
        HEADER.unpack_from(view)
    )
    if magic != MAGIC:
        raise CorruptEncoding("not an encoded chunk (no magic)")
    if body_len != len(view) - HEADER.size:
        raise CorruptEncoding(
            f"body of {len(view) - HEADER.size} bytes, the header says {body_len}"
        )
    digest = xxhash.xxh3_64(view[:_CHECKED])
    digest.update(view[HEADER.size :])
    if digest.intdigest() != checksum:
        raise CorruptEncoding("checksum mismatch")
    # Checked after the checksum: a damaged byte is "corrupt", a newer writer "unknown".
    if version != VERSION:
        raise UnknownEncoding(f"format version {version} (this reader knows {VERSION})")
    codec = _CODEC_NAMES.get(codec_id)
    if codec is None:
        raise UnknownEncoding(f"codec id {codec_id}")
    dtype = _DTYPE_NAMES.get(dtype_id)
    if dtype is None:
        raise UnknownEncoding(f"dtype id {dtype_id}")
    return Header(codec, param, dtype, group, decoded, body_len), view[HEADER.size :]
