"""Lossy transforms of floating-point KV, each followed by the lossless stage.

Every lossy codec works on the payload's elements (``bfloat16``, ``float16`` or ``float32``;
the dtype comes from the configuration's ``kv_dtype`` and is recorded in the header) and is
opt-in: a user names it for a tier.  A payload it cannot treat — another dtype, a length that
is not a whole number of elements, a non-finite value, a value a scale cannot hold — is encoded
losslessly instead (the header says so), never altered in a way the reader cannot undo.

* ``bitroundN`` — every element's mantissa rounded to its ``N`` leading bits (round to nearest,
  ties to even; ``N`` from 1 to the dtype's mantissa width minus one), then the lossless stage.
  The values stay in their dtype, so the decoder is the lossless one; the dropped bits are zeros
  that zstd removes.  Relative error at most ``2**-(N+1)``.
* ``fp8`` — float8 e4m3 (3 mantissa bits) with one float16 scale per group of ``group``
  elements (the group's largest magnitude maps to 448, e4m3's largest value).
* ``int8`` / ``int4`` — asymmetric integer codes (255 / 15 steps between the group's minimum
  and maximum) with a float16 offset and step per group.

Groups are runs of ``group`` consecutive elements of the payload.  In vLLM's chunk payload the
innermost dimension of every row is ``head_dim`` (see ``lmprefetch/integration/vllm/layout.py``),
so with ``group`` = ``head_dim`` (or a divisor of it) a group is one token's vector of one head,
K or V: per-token scales, what the measurements in docs/codecs.md used.  The reader takes the
group from the header.

Body of ``fp8``/``int8``/``int4`` (before the lossless stage): the float16 steps of every group,
then (integers only) the float16 offsets, then the codes, one byte each (``int4``: two per byte,
the even element in the low nibble); the last group is padded with its last element.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from .format import CorruptEncoding
from .lossless import _scratch, decode_planes, encode_planes

__all__ = [
    "FLOAT_DTYPES",
    "MANTISSA_BITS",
    "bitround",
    "dequantize_into",
    "quantize",
    "quantized_body_bytes",
]

F32 = np.float32
F16 = np.float16
#: The element dtypes lossy codecs accept, as numpy dtypes.
FLOAT_DTYPES: dict[str, Any] = {
    "bfloat16": ml_dtypes.bfloat16,
    "float16": np.float16,
    "float32": np.float32,
}
#: Mantissa bits (without the implicit one) of each float dtype.
MANTISSA_BITS = {"bfloat16": 7, "float16": 10, "float32": 23}
_UINT: dict[int, Any] = {2: np.uint16, 4: np.uint32}
#: The largest group a header may name (what get_codec allows): bounds the decoder's scratch.
MAX_GROUP = 1 << 16
_F16_MAX = float(np.finfo(F16).max)
_FP8_MAX = 448.0
#: Every e4m3 code's value: a table lookup decodes 4x faster than ml_dtypes' cast.
_FP8_VALUES = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(F32)


def bitround(payload: bytes | bytearray | memoryview, dtype: str, keep: int) -> memoryview:
    """The payload's elements with their mantissas rounded to ``keep`` bits (ties to even).

    Non-finite elements are left as they are, and an element that would round up to infinity
    is truncated instead.  Works on the bits in the dtype's own width: for a finite element
    the carry of the rounding never leaves it (it may carry into the exponent: the next
    binade, or infinity, which is caught).
    """
    itemsize = np.dtype(FLOAT_DTYPES[dtype]).itemsize
    uint = _UINT[itemsize]
    drop = MANTISSA_BITS[dtype] - keep
    bits: np.ndarray[Any, Any] = np.frombuffer(payload, dtype=uint)
    if drop <= 0:
        same: memoryview = bits.copy().data.cast("B")
        return same
    exponent = uint(((1 << (8 * itemsize - 1)) - 1) ^ ((1 << MANTISSA_BITS[dtype]) - 1))
    keep_mask = uint(~((1 << drop) - 1) & ((1 << (8 * itemsize)) - 1))
    out = (bits >> drop) & uint(1)  # ties to even: round half up when the kept part is odd
    out += uint((1 << (drop - 1)) - 1)
    out += bits
    out &= keep_mask
    nonfinite = (bits & exponent) == exponent
    infinite = (out & exponent) == exponent
    if infinite.any():
        out[infinite] = bits[infinite] & keep_mask
    if nonfinite.any():
        out[nonfinite] = bits[nonfinite]
    rounded: memoryview = out.data.cast("B")
    return rounded


def _as_float32(payload: bytes | bytearray | memoryview, dtype: str) -> np.ndarray[Any, Any]:
    values: np.ndarray[Any, Any] = np.frombuffer(payload, dtype=FLOAT_DTYPES[dtype]).astype(F32)
    return values


def _groups(values: np.ndarray[Any, Any], group: int) -> np.ndarray[Any, Any]:
    """``values`` as rows of ``group`` elements, the last row padded with its last element."""
    pad = -values.size % group
    if pad:
        values = np.concatenate([values, np.full(pad, values[-1], dtype=values.dtype)])
    return values.reshape(-1, group)


def _round_up_f16(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """The least float16 at least ``x`` (elementwise; ``x`` finite, at most float16's max)."""
    y = x.astype(F16)
    low = y.astype(F32) < x
    return np.where(low, np.nextafter(y, F16(np.inf)), y)


def _round_down_f16(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    y = x.astype(F16)
    high = y.astype(F32) > x
    return np.where(high, np.nextafter(y, F16(-np.inf)), y)


def quantized_body_bytes(codec: str, elements: int, group: int) -> int:
    """Bytes of a quantized body (before the lossless stage)."""
    groups = -(-elements // group)
    padded = groups * group
    if codec == "fp8":
        return groups * 2 + padded
    if codec == "int8":
        return groups * 4 + padded
    return groups * 4 + padded // 2  # int4


def quantize(
    payload: bytes | bytearray | memoryview, dtype: str, codec: str, group: int
) -> bytes | None:
    """The lossy body (after the lossless stage) of ``payload`` for ``codec`` (``fp8``,
    ``int8``, ``int4``), or ``None`` if this payload must be stored losslessly instead (a
    non-finite value, or a range float16 scales cannot hold)."""
    x = _as_float32(payload, dtype)
    if x.size == 0 or not np.isfinite(x).all():
        return None
    rows = _groups(x, group)
    if codec == "fp8":
        peak = np.abs(rows).max(axis=1)
        if peak.max() / _FP8_MAX > _F16_MAX:
            return None
        step = _round_up_f16(peak / _FP8_MAX)
        step = np.where(step == 0, F16(1), step)
        scaled = np.clip(rows / step.astype(F32)[:, None], -_FP8_MAX, _FP8_MAX)
        codes = scaled.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
        parts = [step.tobytes(), codes.tobytes()]
    else:
        levels = 255 if codec == "int8" else 15
        low = rows.min(axis=1)
        high = rows.max(axis=1)
        if max(abs(float(low.min())), abs(float(high.max()))) > _F16_MAX / 2:
            return None
        offset = _round_down_f16(low)
        span = (high - offset.astype(F32)) / levels
        step = _round_up_f16(span)
        step = np.where(step == 0, F16(1), step)
        q = np.rint((rows - offset.astype(F32)[:, None]) / step.astype(F32)[:, None])
        codes = np.clip(q, 0, levels).astype(np.uint8)
        if codec == "int4":
            codes = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
        parts = [step.tobytes(), offset.tobytes(), codes.tobytes()]
    return encode_planes(b"".join(parts), 1)


def dequantize_into(body: memoryview, out: memoryview, dtype: str, codec: str, group: int) -> None:
    """Decode a lossy body into ``out`` (the decoded payload, elements of ``dtype``).

    Raises:
        CorruptEncoding: the body does not have the size its header implies.
    """
    itemsize = np.dtype(FLOAT_DTYPES[dtype]).itemsize
    if len(out) % itemsize or not 1 <= group <= MAX_GROUP or (codec == "int4" and group % 2):
        raise CorruptEncoding(f"{codec} body: {len(out)} bytes in groups of {group}")
    elements = len(out) // itemsize
    inner = _scratch(quantized_body_bytes(codec, elements, group)).data
    decode_planes(body, inner)
    groups = -(-elements // group)
    step = np.frombuffer(inner[: groups * 2], dtype=F16).astype(F32)[:, None]
    if codec == "fp8":
        codes = np.frombuffer(inner[groups * 2 :], dtype=np.uint8)
        values = _FP8_VALUES[codes].reshape(groups, group) * step
    else:
        offset = np.frombuffer(inner[groups * 2 : groups * 4], dtype=F16).astype(F32)[:, None]
        packed = np.frombuffer(inner[groups * 4 :], dtype=np.uint8)
        if codec == "int4":
            q = np.empty((groups, group), dtype=np.uint8)
            nibbles = packed.reshape(groups, group // 2)
            q[:, 0::2] = nibbles & 0x0F
            q[:, 1::2] = nibbles >> 4
        else:
            q = packed.reshape(groups, group)
        values = offset + q.astype(F32) * step
    target = np.frombuffer(out, dtype=FLOAT_DTYPES[dtype])
    target[:] = values.reshape(-1)[:elements].astype(FLOAT_DTYPES[dtype])
