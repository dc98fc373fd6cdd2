"""The codecs by name: what ``disk_codec``, ``redis_codec`` and ``mooncake_codec`` may say, and
the one decoder that reads whatever any of them wrote.

=================  =====  =====================================================================
name               lossy  what it stores
=================  =====  =====================================================================
``none``           no     the payload as it is
``lossless``       no     byte planes + zstd (:mod:`.lossless`)
``bitround<N>``    yes    mantissas rounded to ``N`` bits, then ``lossless`` (``bitround3``)
``fp8``            yes    float8 e4m3 with a float16 scale per group
``int8``           yes    8-bit codes with a float16 offset and step per group
``int4``           yes    4-bit codes, likewise
=================  =====  =====================================================================

:func:`get_codec` builds a :class:`Codec` for a name, the payload's element dtype (the
configuration's ``kv_dtype``) and the group size of the lossy codecs' scales; its
:meth:`Codec.encode` is what a tier's write-behind calls.  :func:`decode_into` reads any encoded
chunk, whatever codec, parameters, dtype or grouping wrote it (all in its header), into the
caller's buffer — e.g. an arena slot's memoryview — and raises a
:class:`~lmprefetch.codec.format.CodecMiss` for anything it cannot vouch for.

Only the names and this module's functions are needed to check a configuration; the codecs
themselves import numpy, zstandard and ml_dtypes (the ``codecs`` extra) when first used.
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass

from .format import (
    DTYPE_IDS,
    HEADER,
    CodecMiss,
    CorruptEncoding,
    UnknownEncoding,
    pack,
    unpack,
)

__all__ = [
    "CODEC_NAMES",
    "DEFAULT_GROUP",
    "EXTRA_HINT",
    "LOSSY_DTYPES",
    "Codec",
    "codec_problem",
    "decode_into",
    "get_codec",
    "is_lossy",
    "missing_modules",
]

#: The names a tier's codec may take (``bitround<N>``: ``N`` from 1 to the dtype's mantissa
#: bits minus one, e.g. ``bitround3``).
CODEC_NAMES = ("none", "lossless", "bitround<N>", "fp8", "int8", "int4")
#: Elements per scale when nothing else is said: 64, the head size of most models (and a
#: divisor of 128 and 256), so a group is one token's vector of one head.
DEFAULT_GROUP = 64
#: The KV dtypes the lossy codecs accept.
LOSSY_DTYPES = ("bfloat16", "float16", "float32")
EXTRA_HINT = "pip install 'lmprefetch[codecs]'"

_BITROUND = re.compile(r"bitround([1-9][0-9]?)", re.ASCII)
_MANTISSA = {"bfloat16": 7, "float16": 10, "float32": 23}
_QUANTIZED = ("fp8", "int8", "int4")
#: The modules each kind of codec needs.
_NEEDS = {"none": (), "lossless": ("numpy", "zstandard")}
_LOSSY_NEEDS = ("numpy", "zstandard", "ml_dtypes")


def _kind(name: str) -> tuple[str, int] | None:
    """``(header codec name, parameter)`` of a codec name, or ``None`` if unknown."""
    if name in ("none", "lossless", *_QUANTIZED):
        return name, 0
    found = _BITROUND.fullmatch(name)
    if found:
        return "bitround", int(found[1])
    return None


def is_lossy(name: str) -> bool:
    """Whether the codec ``name`` (a valid name) changes the values it stores."""
    return name not in ("none", "lossless")


def missing_modules(name: str) -> list[str]:
    """The modules the codec ``name`` needs that are not installed."""
    needs = _NEEDS.get(name, _LOSSY_NEEDS)
    return [m for m in needs if importlib.util.find_spec(m) is None]


def codec_problem(name: str, kv_dtype: str | None = None) -> str | None:
    """What is wrong with the codec name ``name`` for payloads of ``kv_dtype`` (a phrase such
    as configuration checks return: ``must be one of ..., got 'zip'``), or ``None``."""
    kind = _kind(name) if isinstance(name, str) else None
    if kind is None:
        return f"must be one of {', '.join(CODEC_NAMES)}, got {name!r}"
    codec, param = kind
    if kv_dtype is not None and is_lossy(name):
        if kv_dtype not in LOSSY_DTYPES:
            return (
                f"the lossy codec {name!r} needs a floating-point kv_dtype "
                f"({', '.join(LOSSY_DTYPES)}), got {kv_dtype!r}"
            )
        if codec == "bitround" and not 1 <= param < _MANTISSA[kv_dtype]:
            return (
                f"bitround<N> keeps N of {kv_dtype}'s {_MANTISSA[kv_dtype]} mantissa bits: N "
                f"from 1 to {_MANTISSA[kv_dtype] - 1}, got {name!r}"
            )
    missing = missing_modules(name)
    if missing:
        return f"the codec {name!r} needs {', '.join(missing)}: {EXTRA_HINT}"
    return None


@dataclass(frozen=True)
class Codec:
    """One tier's codec: encodes payloads of ``dtype`` elements (use :func:`get_codec`).

    Attributes:
        name: the configured name (``"bitround3"``).
        lossy: whether decoding gives back other values than were encoded.
        dtype: the payloads' element dtype, recorded in every header.
        group: elements per scale of ``fp8``/``int8``/``int4`` (0 for the others).
    """

    name: str
    lossy: bool
    dtype: str
    group: int
    _kind: str
    _param: int

    def encode(self, payload: bytes | bytearray | memoryview) -> bytes:
        """The encoded chunk of ``payload`` (header and body): a pure function, safe to call
        from several threads at once; zstd and numpy release the GIL while they work.

        A lossy codec that cannot treat this payload (see :mod:`.lossy`) encodes it losslessly,
        and the header says so.
        """
        from . import lossless, lossy

        data = memoryview(payload).cast("B")
        itemsize = DTYPE_IDS[self.dtype][1]
        kind, param, group = self._kind, self._param, self.group
        body: bytes | memoryview | None
        if kind == "none":
            body = data
        elif kind == "lossless":
            body = lossless.encode_planes(data, itemsize)
        elif len(data) % itemsize:
            body = None
        elif kind == "bitround":
            body = lossless.encode_planes(lossy.bitround(data, self.dtype, param), itemsize)
        else:
            body = lossy.quantize(data, self.dtype, kind, group)
        if body is not None and kind != "none" and len(body) > len(data):
            body = None  # never larger than lossless (tiny groups): max_encoded_bytes holds
        if body is None:  # a lossy codec that cannot treat this payload
            kind, param, group = "lossless", 0, 0
            body = lossless.encode_planes(data, itemsize)
        return pack(kind, param, self.dtype, group, len(data), body)

    def max_encoded_bytes(self, payload_bytes: int) -> int:
        """The most bytes :meth:`encode` returns for a payload of ``payload_bytes`` (a tier
        sizes its read buffers with it): the header, plus the lossless stage's plane table
        around planes stored raw at worst."""
        from .lossless import max_body_bytes

        return HEADER.size + max_body_bytes(payload_bytes, DTYPE_IDS[self.dtype][1])


def get_codec(name: str, *, dtype: str = "bytes", group: int = DEFAULT_GROUP) -> Codec:
    """The codec ``name`` for payloads of ``dtype`` elements (a ``kv_dtype`` name; ``"bytes"``
    for opaque payloads, lossless only).

    Args:
        name: a codec name (:data:`CODEC_NAMES`).
        dtype: the payloads' element dtype.
        group: elements per scale of the ``fp8``/``int8``/``int4`` codecs (even for ``int4``):
            in vLLM's payload ``head_dim`` or a divisor of it gives per-token scales.

    Raises:
        ValueError: an unknown name, a lossy codec for a dtype it cannot treat, a bad group,
            or a library the codec needs is missing (the message says what to install).
    """
    if dtype not in DTYPE_IDS:
        raise ValueError(f"dtype: unknown {dtype!r} (known: {', '.join(DTYPE_IDS)})")
    problem = codec_problem(name, dtype if dtype != "bytes" else None)
    if problem is None and is_lossy(name) and dtype not in LOSSY_DTYPES:
        problem = f"the lossy codec {name!r} needs a floating-point dtype, got {dtype!r}"
    if problem is not None:
        raise ValueError(f"codec: {problem}")
    kind, param = _kind(name) or ("none", 0)
    if kind in _QUANTIZED:
        if not 1 <= group <= 1 << 16 or (kind == "int4" and group % 2):
            raise ValueError(f"group: must be 1 to 65536 (even for int4), got {group}")
    else:
        group = 0
    return Codec(name, is_lossy(name), dtype, group, kind, param)


def decode_into(
    blob: bytes | bytearray | memoryview, out: bytearray | memoryview, *, dtype: str | None = None
) -> int:
    """Decode an encoded chunk into the start of ``out``; returns the decoded length.

    Reads whatever codec wrote ``blob``.  ``out`` is typically an arena slot's memoryview: the
    decoded bytes are written into it directly (the lossless stage decompresses a one-plane
    payload straight into it, and interleaves byte planes into it; lossy codecs write their
    dequantized values into it).  On a :class:`CodecMiss` the contents of ``out`` are
    unspecified: the caller must not hand it out.

    Args:
        blob: the stored bytes.
        out: the destination, at least the decoded length.
        dtype: the element dtype the reader expects (its ``kv_dtype``); a chunk recorded with
            another one is an :class:`UnknownEncoding`.

    Raises:
        CodecMiss: damaged (:class:`CorruptEncoding`: checksum, lengths, body), unknown
            (:class:`UnknownEncoding`: version, codec, dtype) or larger than ``out``.
    """
    header, body = unpack(blob)
    if dtype is not None and header.dtype not in (dtype, "bytes"):
        raise UnknownEncoding(f"a chunk of {header.dtype}, expected {dtype}")
    target = memoryview(out).cast("B")
    if header.decoded_bytes > len(target):
        raise CodecMiss(
            f"decodes to {header.decoded_bytes} bytes, more than the {len(target)} given"
        )
    target = target[: header.decoded_bytes]
    codec = header.codec
    try:
        if codec == "none":
            if len(body) != len(target):
                raise CorruptEncoding("raw body of the wrong size")
            target[:] = body
            return len(target)
        missing = missing_modules("lossless" if codec in ("lossless", "bitround") else "fp8")
        if missing:
            raise UnknownEncoding(f"a {codec} chunk needs {', '.join(missing)}: {EXTRA_HINT}")
        from . import lossless, lossy

        if codec in ("lossless", "bitround"):
            lossless.decode_planes(body, target)
        else:
            if header.dtype not in LOSSY_DTYPES:
                raise CorruptEncoding(f"a {codec} chunk of {header.dtype}")
            lossy.dequantize_into(body, target, header.dtype, codec, header.group)
    except (ValueError, TypeError, IndexError) as exc:  # a body numpy cannot shape
        raise CorruptEncoding(f"{codec} body: {exc}") from None
    return len(target)
