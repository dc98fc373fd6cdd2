"""The codec library (lmprefetch.codec): round trips, error bounds, and every damaged, truncated
or unknown encoding rejected as a miss, never decoded into wrong bytes."""

from __future__ import annotations

import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

np = pytest.importorskip("numpy")
pytest.importorskip("zstandard")
ml_dtypes = pytest.importorskip("ml_dtypes")

from lmprefetch.codec import (  # noqa: E402
    ChunkStage,
    CodecMiss,
    CorruptEncoding,
    UnknownEncoding,
    codec_problem,
    decode_into,
    get_codec,
    is_lossy,
)
from lmprefetch.codec.format import HEADER, pack  # noqa: E402

SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
DTYPES = ("bfloat16", "float16", "float32")
NP_DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}
LOSSLESS_DTYPES = ("bytes", *DTYPES, "float8_e4m3fn", "int8", "uint8")


def roundtrip(name: str, payload: bytes, dtype: str, group: int = 64) -> bytes:
    blob = get_codec(name, dtype=dtype, group=group).encode(payload)
    out = bytearray(len(payload) + 7)  # larger than needed, as an arena slot is
    n = decode_into(blob, out, dtype=dtype)
    assert n == len(payload)
    return bytes(out[:n])


@SETTINGS
@given(payload=st.binary(max_size=5000), dtype=st.sampled_from(LOSSLESS_DTYPES))
def test_lossless_and_none_give_back_arbitrary_bytes(payload: bytes, dtype: str) -> None:
    for name in ("none", "lossless"):
        assert roundtrip(name, payload, dtype) == payload


def test_lossless_compresses_bf16_like_values_and_decodes_into_a_memoryview_slice() -> None:
    rng = np.random.default_rng(0)
    values = (rng.standard_normal(64 * 1024) * 0.5).astype(ml_dtypes.bfloat16)
    payload = values.tobytes()
    blob = get_codec("lossless", dtype="bfloat16").encode(payload)
    assert len(blob) < 0.8 * len(payload)  # the exponent plane shrinks, the mantissa does not
    arena = bytearray(3 * len(payload))
    slot = memoryview(arena)[len(payload) : 2 * len(payload)]
    assert decode_into(blob, slot) == len(payload)
    assert bytes(slot) == payload
    assert arena[: len(payload)] == bytes(len(payload))  # nothing written outside the slot


def floats(dtype: str, size: int, limit: float = 60000) -> st.SearchStrategy[np.ndarray]:
    width = 32 if dtype == "float32" else 16
    return st.lists(
        st.floats(-limit, limit, allow_nan=False, allow_infinity=False, width=width),
        min_size=size,
        max_size=size,
    ).map(lambda xs: np.array(xs, dtype=np.float32).astype(NP_DTYPES[dtype]))


@st.composite
def float_payloads(draw: st.DrawFn, limit: float = 60000) -> tuple[str, np.ndarray]:
    dtype = draw(st.sampled_from(DTYPES))
    return dtype, draw(floats(dtype, draw(st.integers(1, 300)), limit))


def decoded(name: str, x: np.ndarray, dtype: str, group: int) -> np.ndarray:
    out = roundtrip(name, x.tobytes(), dtype, group)
    return np.frombuffer(out, dtype=NP_DTYPES[dtype]).astype(np.float64)


def output_rounding(dtype: str) -> float:
    """The relative error of writing a float32 result back in ``dtype``."""
    return {"bfloat16": 2.0**-8, "float16": 2.0**-11, "float32": 2.0**-24}[dtype]


@SETTINGS
@given(case=float_payloads(), keep=st.integers(1, 6))
def test_bitround_error_is_within_half_a_unit_of_the_kept_mantissa(
    case: tuple[str, np.ndarray], keep: int
) -> None:
    dtype, x = case
    y = decoded(f"bitround{keep}", x, dtype, 64)
    xf = x.astype(np.float64)
    tiny = float(np.finfo(NP_DTYPES[dtype]).smallest_normal) * 2.0**-keep  # subnormals
    bound = np.maximum(np.abs(xf) * 2.0 ** -(keep + 1), tiny)
    assert np.all(np.abs(y - xf) <= bound)
    # Rounding again changes nothing: the dropped bits are zeros.
    again = decoded(f"bitround{keep}", y.astype(NP_DTYPES[dtype]), dtype, 64)
    assert np.array_equal(again, y)


@SETTINGS
@given(
    case=float_payloads(limit=30000),  # float16 offsets and steps: see quantize()
    name=st.sampled_from(["int8", "int4"]),
    group=st.sampled_from([2, 8, 64]),
)
def test_integer_codes_err_by_at_most_half_a_step_of_their_group(
    case: tuple[str, np.ndarray], name: str, group: int
) -> None:
    dtype, x = case
    y = decoded(name, x, dtype, group)
    xf = x.astype(np.float64)
    levels = 255 if name == "int8" else 15
    pad = -xf.size % group
    rows = np.concatenate([xf, np.full(pad, xf[-1])]).reshape(-1, group)
    span = rows.max(axis=1) - rows.min(axis=1)
    # The float16 offset rounds down by at most one unit, the step up by one unit.
    slack = np.abs(rows.min(axis=1)) * 2.0**-10 + 6e-8
    step = ((span + slack) / levels) * (1 + 2.0**-9) + 6e-8
    bound = np.repeat(step / 2, group)[: xf.size] + np.abs(xf) * output_rounding(dtype) * 2
    assert np.all(np.abs(y - xf) <= bound + 1e-12)


@SETTINGS
@given(case=float_payloads(), group=st.sampled_from([1, 16, 64]))
def test_fp8_error_is_within_e4m3_precision_of_the_group_scale(
    case: tuple[str, np.ndarray], group: int
) -> None:
    dtype, x = case
    y = decoded("fp8", x, dtype, group)
    xf = x.astype(np.float64)
    pad = -xf.size % group
    rows = np.concatenate([xf, np.full(pad, xf[-1])]).reshape(-1, group)
    # (A float16 scale is at least 2**-24: smaller magnitudes keep an absolute error.)
    peak = np.maximum(np.abs(rows).max(axis=1) / 448 * (1 + 2.0**-10), 2.0**-24)
    scale = np.repeat(peak, group)[: xf.size]
    # e4m3: 3 mantissa bits (relative 2**-4), subnormals below 2**-6 in steps of 2**-9.
    bound = np.abs(xf) * 2.0**-4 + scale * 2.0**-10 + np.abs(xf) * output_rounding(dtype) * 2
    assert np.all(np.abs(y - xf) <= bound + 1e-12)


@pytest.mark.parametrize("name", ["bitround3", "fp8", "int8", "int4"])
def test_a_lossy_codec_stores_what_it_cannot_treat_losslessly(name: str) -> None:
    x = np.array([1.0, np.inf, -2.5, np.nan] * 40, dtype=np.float32).astype(ml_dtypes.bfloat16)
    payload = x.tobytes()
    assert roundtrip(name, payload, "bfloat16") == payload
    odd = payload + b"\x01"  # not a whole number of elements
    assert roundtrip(name, odd, "bfloat16") == odd


@pytest.mark.parametrize(
    ("name", "dtype", "problem"),
    [
        ("zip", None, "must be one of"),
        ("bitround7", "bfloat16", "N from 1 to 6"),
        ("bitround0", "float16", "must be one of"),
        ("int8", "int8", "needs a floating-point kv_dtype"),
        ("fp8", "float8_e4m3fn", "needs a floating-point kv_dtype"),
    ],
)
def test_codec_names_are_checked(name: str, dtype: str | None, problem: str) -> None:
    found = codec_problem(name, dtype)
    assert found is not None and problem in found
    with pytest.raises(ValueError, match="codec: "):
        get_codec(name, dtype=dtype or "bfloat16")


def test_codec_names_that_are_valid() -> None:
    for name in ("none", "lossless", "bitround1", "bitround6", "fp8", "int8", "int4"):
        assert codec_problem(name, "bfloat16") is None
    assert codec_problem("bitround9", "float16") is None
    assert is_lossy("int4") and not is_lossy("lossless")
    with pytest.raises(ValueError, match="group"):
        get_codec("int4", dtype="bfloat16", group=7)


# -- damage: never wrong bytes ------------------------------------------------------------------
@st.composite
def encoded_chunks(draw: st.DrawFn) -> tuple[bytes, bytes]:
    name = draw(st.sampled_from(["none", "lossless", "bitround3", "fp8", "int8", "int4"]))
    dtype = "bytes" if name in ("none", "lossless") and draw(st.booleans()) else "bfloat16"
    size = draw(st.integers(1, 200)) * 2
    payload = (
        draw(floats("bfloat16", size // 2)).tobytes() if dtype == "bfloat16" else
        draw(st.binary(min_size=size, max_size=size))
    )  # fmt: skip
    return get_codec(name, dtype=dtype, group=16).encode(payload), payload


def decodes(blob: bytes | bytearray, size: int) -> bytes | None:
    out = bytearray(size)
    try:
        n = decode_into(blob, out)
    except CodecMiss:
        return None
    return bytes(out[:n])


@SETTINGS
@given(case=encoded_chunks(), data=st.data())
def test_every_flipped_bit_is_a_miss(case: tuple[bytes, bytes], data: st.DataObject) -> None:
    blob, payload = case
    bit = data.draw(st.integers(0, 8 * len(blob) - 1))
    damaged = bytearray(blob)
    damaged[bit // 8] ^= 1 << (bit % 8)
    assert decodes(damaged, len(payload) + 64) is None


@SETTINGS
@given(case=encoded_chunks(), data=st.data())
def test_every_truncation_or_extension_is_a_miss(
    case: tuple[bytes, bytes], data: st.DataObject
) -> None:
    blob, payload = case
    cut = data.draw(st.integers(0, len(blob) - 1))
    assert decodes(blob[:cut], len(payload) + 64) is None
    assert decodes(blob + data.draw(st.binary(min_size=1, max_size=9)), len(payload) + 64) is None


@SETTINGS
@given(junk=st.binary(max_size=400))
def test_arbitrary_bytes_are_never_decoded(junk: bytes) -> None:
    # Not written by an encoder: no magic, or a checksum that cannot match.
    assert decodes(b"LKVC" + junk, 4096) is None
    assert decodes(junk, 4096) is None


def rewritten(blob: bytes, **fields: int) -> bytes:
    """``blob`` with header fields replaced and a fresh checksum: what a newer (or buggy)
    writer would produce."""
    names = ("magic", "version", "codec", "param", "dtype", "group", "decoded", "body", "sum")
    values = dict(zip(names, HEADER.unpack_from(blob)))
    values.update(fields)
    body = blob[HEADER.size :]
    import xxhash

    prefix = HEADER.pack(*(values[n] for n in names[:-1]), 0)[: HEADER.size - 8]
    return prefix + struct.pack("<Q", xxhash.xxh3_64_intdigest(prefix + body)) + body


@pytest.mark.parametrize(
    ("fields", "error"),
    [
        ({"version": 2}, UnknownEncoding),
        ({"codec": 99}, UnknownEncoding),
        ({"dtype": 99}, UnknownEncoding),
        ({"decoded": 1 << 40}, CodecMiss),  # larger than the destination
        ({"decoded": 10}, CorruptEncoding),  # the body decodes to another size
        ({"group": 0}, CorruptEncoding),
        ({"group": 3}, CorruptEncoding),  # int4 needs an even group
        ({"group": 1 << 30}, CorruptEncoding),  # no 1 GiB of scratch for a 512-byte chunk
        ({"codec": 4}, CorruptEncoding),  # an int4 body read as int8
    ],
)
def test_well_formed_but_unknown_or_inconsistent_headers_are_misses(
    fields: dict[str, int], error: type[Exception]
) -> None:
    x = np.linspace(-3, 3, 256, dtype=np.float32).astype(ml_dtypes.bfloat16)
    blob = get_codec("int4", dtype="bfloat16", group=16).encode(x.tobytes())
    assert decodes(blob, 512) is not None
    with pytest.raises(error):
        decode_into(rewritten(blob, **fields), bytearray(512))


def test_a_chunk_of_another_dtype_is_a_miss_for_a_reader_that_expects_its_own() -> None:
    blob = get_codec("lossless", dtype="float16").encode(b"\x00\x3c" * 10)
    with pytest.raises(UnknownEncoding, match="float16"):
        decode_into(blob, bytearray(20), dtype="bfloat16")
    assert decode_into(blob, bytearray(20), dtype="float16") == 20


def test_a_header_without_a_body_is_a_miss() -> None:
    blob = pack("lossless", 0, "bytes", 0, 100, b"")
    with pytest.raises(CorruptEncoding):
        decode_into(blob, bytearray(100))


# -- the stage: codecs and raw payloads side by side ----------------------------------------------
def test_a_stage_reads_chunks_written_with_any_codec_or_none() -> None:
    x = np.linspace(-2, 2, 1024, dtype=np.float32).astype(ml_dtypes.bfloat16).tobytes()
    key = b"model@1@0@00000000000000aa@bfloat16"
    writers = {n: ChunkStage(get_codec(n, dtype="bfloat16")) for n in ("none", "lossless", "int8")}
    stored = {n: s.encode(x, key_name=key) for n, s in writers.items()}
    assert stored["none"] is x  # passthrough: the payload itself, no copy
    reader = ChunkStage(get_codec("lossless", dtype="bfloat16"))
    for name, blob in stored.items():
        out = bytearray(len(x))
        assert reader.decode_into(blob, out, key_name=key) == len(x)
        if name != "int8":
            assert bytes(out) == x
    too_small = bytearray(len(x) - 1)
    for blob in stored.values():
        with pytest.raises(CodecMiss):
            reader.decode_into(blob, too_small, key_name=key)


@SETTINGS
@given(
    payload=st.binary(max_size=3000),
    name=st.sampled_from(["none", "lossless", "bitround2", "fp8", "int8", "int4"]),
    group=st.sampled_from([2, 4, 64]),
    sealed=st.booleans(),
)
def test_stored_bytes_never_exceed_the_stated_bound(
    payload: bytes, name: str, group: int, sealed: bool
) -> None:
    from lmprefetch.codec import TenantCipher

    stage = ChunkStage(
        get_codec(name, dtype="bfloat16", group=group),
        TenantCipher(bytes(32)) if sealed else None,
    )
    stored = stage.encode(payload, key_name=b"k")
    assert len(stored) <= stage.max_stored_bytes(len(payload))
