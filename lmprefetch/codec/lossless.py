"""Lossless: the payload split into byte planes, each compressed with zstd (level 1).

Why planes.  A bfloat16 value's high byte (sign and 7 exponent bits) carries about 3 bits of
entropy in real KV, its low byte (mantissa) about 8; interleaved, a general-purpose compressor
sees neither.  Split (every element's byte ``i`` in plane ``i``, the "byte shuffle"), the
exponent plane shrinks by about 2.5x and the mantissa plane not at all: about 1.45x on
SmolLM2's bf16 KV, close to the entropy bound (docs/codecs.md has the measurements, and the
candidates compared: zstd, lz4, Blosc in ``numcodecs`` and ``blosc2``).  A plane that zstd
cannot shrink by 2 % is stored raw, so the mantissa costs a copy, not a decompression.

Body layout: ``u8 planes``, then per plane ``u8 mode`` (0 raw, 1 zstd) and ``u64 stored
bytes``, then the planes' bytes one after the other.  Every plane decodes to ``decoded //
planes`` bytes; a payload whose length is not a multiple of the element size is one plane.

Decoding writes into the caller's buffer: a one-plane payload is decompressed straight into it;
planes are decompressed into a per-thread scratch buffer and interleaved into it by one numpy
assignment per plane.  zstd, numpy's copies and the checksum release the GIL, so decodes in
worker threads run beside the Trio thread.
"""

from __future__ import annotations

import struct
import threading
from typing import Any

import numpy as np
import zstandard

from .format import CorruptEncoding

__all__ = ["decode_planes", "encode_planes", "max_body_bytes"]

LEVEL = 1
#: A plane is stored compressed only when zstd saves at least this fraction of it.
MIN_SAVING = 0.02
_PLANES = struct.Struct("<B")
_PLANE = struct.Struct("<BQ")
_RAW, _ZSTD = 0, 1

_local = threading.local()


def _compressor() -> zstandard.ZstdCompressor:
    # Not thread-safe: one per thread.
    c: zstandard.ZstdCompressor | None = getattr(_local, "compressor", None)
    if c is None:
        c = _local.compressor = zstandard.ZstdCompressor(level=LEVEL, write_content_size=True)
    return c


def _decompressor() -> zstandard.ZstdDecompressor:
    d: zstandard.ZstdDecompressor | None = getattr(_local, "decompressor", None)
    if d is None:
        d = _local.decompressor = zstandard.ZstdDecompressor()
    return d


def _scratch(nbytes: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """A per-thread buffer of at least ``nbytes`` (reused: no allocation nor page faults per
    chunk)."""
    buf: np.ndarray[Any, np.dtype[np.uint8]] | None = getattr(_local, "scratch", None)
    if buf is None or buf.size < nbytes:
        buf = _local.scratch = np.empty(nbytes, dtype=np.uint8)
    return buf[:nbytes]


def max_body_bytes(payload_bytes: int, itemsize: int) -> int:
    """The largest lossless body of a payload of ``payload_bytes`` (every plane raw)."""
    planes = itemsize if itemsize > 1 and payload_bytes % itemsize == 0 else 1
    return _PLANES.size + planes * _PLANE.size + payload_bytes


def encode_planes(payload: bytes | bytearray | memoryview, itemsize: int) -> bytes:
    """The lossless body of ``payload`` whose elements are ``itemsize`` bytes."""
    data = np.frombuffer(payload, dtype=np.uint8)
    planes = itemsize if itemsize > 1 and data.size % itemsize == 0 else 1
    columns = data.reshape(-1, planes)
    heads = [_PLANES.pack(planes)]
    parts: list[bytes | memoryview] = []
    for i in range(planes):
        plane = np.ascontiguousarray(columns[:, i]).data if planes > 1 else data.data
        packed = _compressor().compress(plane)
        if len(packed) <= len(plane) * (1 - MIN_SAVING):
            heads.append(_PLANE.pack(_ZSTD, len(packed)))
            parts.append(packed)
        else:
            heads.append(_PLANE.pack(_RAW, len(plane)))
            parts.append(plane)
    return b"".join([*heads, *parts])


def decode_planes(body: memoryview, out: memoryview) -> None:
    """Decode a lossless body into ``out``, whose length is the decoded length.

    Raises:
        CorruptEncoding: the body does not decode to exactly ``len(out)`` bytes.
    """
    try:
        (planes,) = _PLANES.unpack_from(body)
        offset = _PLANES.size + planes * _PLANE.size
        if planes < 1 or offset > len(body) or len(out) % planes:
            raise CorruptEncoding("lossless body: bad plane count")
        plane_bytes = len(out) // planes
        dest = np.frombuffer(out, dtype=np.uint8).reshape(-1, planes)
        for i in range(planes):
            mode, stored = _PLANE.unpack_from(body, _PLANES.size + i * _PLANE.size)
            src = body[offset : offset + stored]
            offset += stored
            if len(src) != stored:
                raise CorruptEncoding("lossless body: truncated plane")
            if mode == _RAW:
                if stored != plane_bytes:
                    raise CorruptEncoding("lossless body: raw plane of the wrong size")
                dest[:, i] = np.frombuffer(src, dtype=np.uint8)
            elif mode == _ZSTD:
                target = out if planes == 1 else _scratch(plane_bytes).data
                _decompress_into(src, target)
                if planes > 1:
                    dest[:, i] = np.frombuffer(target, dtype=np.uint8)
            else:
                raise CorruptEncoding(f"lossless body: unknown plane mode {mode}")
        if offset != len(body):
            raise CorruptEncoding("lossless body: trailing bytes")
    except struct.error:
        raise CorruptEncoding("lossless body: truncated") from None


def _decompress_into(src: memoryview, target: memoryview) -> None:
    """Decompress one zstd frame into exactly ``target`` (no intermediate copy)."""
    try:
        with _decompressor().stream_reader(src) as reader:
            filled = 0
            while filled < len(target):
                n = reader.readinto(target[filled:])
                if not n:
                    break
                filled += n
            if filled != len(target) or reader.read(1):
                raise CorruptEncoding("lossless body: a plane of the wrong size")
    except zstandard.ZstdError as exc:
        raise CorruptEncoding(f"lossless body: {exc}") from None
