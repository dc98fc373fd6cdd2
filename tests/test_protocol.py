"""The wire protocol: round trips, byte-level compatibility with LMCache 0.5.6, fuzzing."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmprefetch.protocol import (
    LookupCleanupMsg,
    LookupRequestMsg,
    LookupResponseMsg,
    decode_response,
    decode_worker_message,
    encode,
    validate_request,
)

from .fuzz.frames import FIELD_NAMES

U64_MAX = 2**64 - 1
I64_MIN = -(2**63)


# LMCache 0.5.6's message shapes (lmcache/v1/lookup_client/async_lookup_message.py),
# re-declared here field for field: the base is a tagged Struct, nothing else.
class LMCacheAsyncLookupMsg(msgspec.Struct, tag=True):
    pass


class LMCacheLookupRequestMsg(LMCacheAsyncLookupMsg, tag="LookupRequestMsg"):
    lookup_id: str
    hashes: list[int]
    offsets: list[int]
    request_configs: dict[str, str] | None = None


class LMCacheLookupResponseMsg(LMCacheAsyncLookupMsg, tag="LookupResponseMsg"):
    lookup_id: str
    num_hit_tokens: int


class LMCacheLookupCleanupMsg(LMCacheAsyncLookupMsg, tag="LookupCleanupMsg"):
    lookup_id: str


# -- round trips ----------------------------------------------------------------------


def test_request_round_trip() -> None:
    msg = LookupRequestMsg(
        "req-1",
        [1, -5, U64_MAX, I64_MIN],
        [256, 256, 256, 17],
        {"lmcache.tag": "x"},
        seq=42,
        deadline_ms=1_700_000_000_123,
        skip_chunks=2,
    )
    assert decode_worker_message(encode(msg)) == msg


def test_cleanup_round_trip() -> None:
    msg = LookupCleanupMsg("req-1", seq=7)
    out = decode_worker_message(encode(msg))
    assert isinstance(out, LookupCleanupMsg)
    assert out == msg


def test_response_round_trip() -> None:
    msg = LookupResponseMsg("req-1", 768, seq=3, worker_id=1)
    assert decode_response(encode(msg)) == msg


def test_defaults() -> None:
    req = LookupRequestMsg("a", [], [])
    assert (req.request_configs, req.seq, req.deadline_ms, req.skip_chunks) == (None, 0, 0, 0)
    resp = LookupResponseMsg("a", 0)
    assert (resp.seq, resp.worker_id) == (0, -1)
    assert LookupCleanupMsg("a").seq == 0


def test_decoders_reject_the_other_direction() -> None:
    with pytest.raises(msgspec.ValidationError):
        decode_response(encode(LookupCleanupMsg("a")))
    with pytest.raises(msgspec.ValidationError):
        decode_worker_message(encode(LookupResponseMsg("a", 1)))


def test_hash_out_of_range_is_an_encode_error() -> None:
    with pytest.raises(OverflowError):
        encode(LookupRequestMsg("a", [2**64], [1]))


# -- LMCache compatibility ------------------------------------------------------------


def test_lmcache_encoded_messages_decode() -> None:
    # Exactly what LMCache 0.5.6 puts on the wire: a map, "type" first, then its fields in
    # declaration order, defaults included.
    req = msgspec.msgpack.encode(
        {
            "type": "LookupRequestMsg",
            "lookup_id": "cmpl-1",
            "hashes": [-3, U64_MAX],
            "offsets": [256, 100],
            "request_configs": None,
        }
    )
    assert req == msgspec.msgpack.encode(
        LMCacheLookupRequestMsg("cmpl-1", [-3, U64_MAX], [256, 100])
    )
    out = decode_worker_message(req)
    assert out == LookupRequestMsg("cmpl-1", [-3, U64_MAX], [256, 100], None)
    assert isinstance(out, LookupRequestMsg)
    assert (out.seq, out.deadline_ms, out.skip_chunks) == (0, 0, 0)

    cleanup = msgspec.msgpack.encode({"type": "LookupCleanupMsg", "lookup_id": "cmpl-1"})
    assert decode_worker_message(cleanup) == LookupCleanupMsg("cmpl-1", seq=0)

    resp = msgspec.msgpack.encode(
        {"type": "LookupResponseMsg", "lookup_id": "cmpl-1", "num_hit_tokens": 512}
    )
    assert decode_response(resp) == LookupResponseMsg("cmpl-1", 512, seq=0, worker_id=-1)


def test_lmcache_decodes_our_messages() -> None:
    worker_dec = msgspec.msgpack.Decoder(LMCacheLookupRequestMsg | LMCacheLookupCleanupMsg)
    resp_dec = msgspec.msgpack.Decoder(LMCacheLookupResponseMsg)

    req = LookupRequestMsg(
        "r", [5, U64_MAX], [256, 256], {"k": "v"}, seq=9, deadline_ms=123, skip_chunks=1
    )
    assert worker_dec.decode(encode(req)) == LMCacheLookupRequestMsg(
        "r", [5, U64_MAX], [256, 256], {"k": "v"}
    )
    assert worker_dec.decode(encode(LookupCleanupMsg("r", seq=4))) == LMCacheLookupCleanupMsg("r")
    assert resp_dec.decode(encode(LookupResponseMsg("r", 7, seq=2, worker_id=3))) == (
        LMCacheLookupResponseMsg("r", 7)
    )


def _map_keys(buf: bytes) -> list[str]:
    """The keys of a top-level msgpack map, in wire order."""
    raw: Any = msgspec.msgpack.decode(buf)
    assert isinstance(raw, dict)
    return list(raw)


def test_byte_layout() -> None:
    req = encode(LookupRequestMsg("r", [1], [256]))
    # fixmap of 10 entries, then the fixstr key "type" and the fixstr class name.
    assert req[0] == 0x80 | 10
    assert req[1:6] == b"\xa4type"
    assert req[6:7] == bytes([0xA0 | len("LookupRequestMsg")])
    assert req[7:23] == b"LookupRequestMsg"
    assert _map_keys(req) == [
        "type",
        "lookup_id",
        "hashes",
        "offsets",
        "request_configs",
        "seq",
        "deadline_ms",
        "skip_chunks",
        "tenant",
        "load_policy",
    ]

    resp = encode(LookupResponseMsg("r", 1))
    assert resp[0] == 0x80 | 6
    assert resp[1:6] == b"\xa4type"
    assert _map_keys(resp) == [
        "type",
        "lookup_id",
        "num_hit_tokens",
        "seq",
        "worker_id",
        "tier_tokens",
    ]

    cleanup = encode(LookupCleanupMsg("r"))
    assert cleanup[0] == 0x80 | 3
    assert cleanup[1:6] == b"\xa4type"
    assert _map_keys(cleanup) == ["type", "lookup_id", "seq"]

    # LMCache's prefix of the request is byte-identical: same keys, same order, same values.
    ours = msgspec.msgpack.decode(req)
    theirs = msgspec.msgpack.decode(
        msgspec.msgpack.encode(LMCacheLookupRequestMsg("r", [1], [256]))
    )
    assert list(ours.items())[: len(theirs)] == list(theirs.items())


# -- validate_request -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("hashes", "offsets", "skip", "problem"),
    [
        ([1, 2], [256, 256], 0, None),
        ([1, 2], [256, 256], 2, None),
        ([], [], 0, None),
        ([1, 2], [256], 0, "differ in length"),
        ([1], [0], 0, "offsets[0]"),
        ([1, 2], [256, -1], 0, "offsets[1]"),
        ([1], [256], -1, "skip_chunks"),
        ([1], [256], 2, "skip_chunks"),
        ([1, 2, 3], [1, 2**32 - 1, 1], 0, None),  # the edges of a token count
        ([1, 2], [1, 2**32], 0, "offsets[1] must be a token count of 1 to 4294967295, got"),
    ],
)
def test_validate_request(
    hashes: list[int], offsets: list[int], skip: int, problem: str | None
) -> None:
    error = validate_request(LookupRequestMsg("r", hashes, offsets, skip_chunks=skip))
    if problem is None:
        assert error is None
    else:
        assert error is not None
        assert problem in error


@pytest.mark.parametrize(
    ("policy", "problem"),
    [
        ("", None),
        ("always", None),
        ("never", None),
        ("cost", None),
        ("Cost", "load_policy must be one of"),
        ("os:system", "load_policy must be one of"),  # a request never names code to import
    ],
)
def test_a_request_names_a_built_in_load_policy_or_none(policy: str, problem: str | None) -> None:
    error = validate_request(LookupRequestMsg("r", [1], [256], load_policy=policy))
    if problem is None:
        assert error is None
    else:
        assert error is not None
        assert problem in error
        assert repr(policy) in error


def test_a_request_s_load_policy_round_trips() -> None:
    msg = decode_worker_message(encode(LookupRequestMsg("r", [1], [256], load_policy="cost")))
    assert isinstance(msg, LookupRequestMsg)
    assert msg.load_policy == "cost"
    # A client that does not know the field (LMCache's, an older lmprefetch): the configured.
    old = msgspec.msgpack.encode({"type": "LookupRequestMsg", "lookup_id": "r", "hashes": [1],
                                  "offsets": [256], "request_configs": None})  # fmt: skip
    msg = decode_worker_message(old)
    assert isinstance(msg, LookupRequestMsg)
    assert msg.load_policy == ""


@pytest.mark.parametrize("decode", [decode_worker_message, decode_response])
def test_a_frame_too_deep_for_msgspec_is_malformed_and_says_why(decode: Any) -> None:
    """msgspec raises RecursionError, not DecodeError, for containers nested deep enough; the
    decoders turn it into a DecodeError that still names what happened."""
    deep = b"\x81\xa1x" + b"\x91" * 200_000 + b"\xc0"  # {"x": [[[...[nil]...]]]}
    why = r"^MessagePack data is malformed: RecursionError"
    with pytest.raises(msgspec.DecodeError, match=why):
        decode(deep)


# -- fuzzing --------------------------------------------------------------------------

_ints = st.integers(min_value=I64_MIN, max_value=U64_MAX)
_scalars = st.one_of(
    st.none(),
    st.booleans(),
    _ints,
    st.floats(allow_nan=True),
    st.text(max_size=8),
    st.binary(max_size=8),
)
_values = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)
_field_names = st.sampled_from([*FIELD_NAMES, "other"])
_tags = st.sampled_from(["LookupRequestMsg", "LookupResponseMsg", "LookupCleanupMsg", "Nope", ""])


@st.composite
def _mistyped_maps(draw: st.DrawFn) -> bytes:
    fields: dict[str, Any] = draw(st.dictionaries(_field_names, _values, max_size=9))
    if draw(st.booleans()):
        fields["type"] = draw(_tags)
    return msgspec.msgpack.encode(fields)


def _decode_all(buf: bytes) -> None:
    for decode in (decode_worker_message, decode_response):
        try:
            decode(buf)
        except msgspec.DecodeError:
            pass


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=64))
def test_fuzz_random_bytes(buf: bytes) -> None:
    _decode_all(buf)


@settings(max_examples=400, deadline=None)
@given(_mistyped_maps())
def test_fuzz_mistyped_maps(buf: bytes) -> None:
    _decode_all(buf)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=64), st.integers(min_value=0, max_value=60))
def test_fuzz_corrupted_valid_frames(noise: bytes, at: int) -> None:
    good = encode(LookupRequestMsg("r", [1, U64_MAX], [256, 3], seq=1))
    _decode_all(good[:at] + noise)
    _decode_all(good[:at])


@settings(max_examples=200, deadline=None)
@given(st.lists(_ints, max_size=20))
def test_any_64bit_hash_survives(hashes: list[int]) -> None:
    msg = LookupRequestMsg("r", hashes, [1] * len(hashes))
    out = decode_worker_message(encode(msg))
    assert isinstance(out, LookupRequestMsg)
    assert out.hashes == hashes


def test_tier_tokens_travel_and_an_old_peer_reads_none() -> None:
    """The answer's tier split (an optional extension) round-trips; an answer without it (an
    LMCache worker, an older lmprefetch) decodes with ``None``; a negative count is refused."""
    msg = LookupResponseMsg("r", 512, seq=1, worker_id=0, tier_tokens=[("cpu", 256), ("disk", 256)])
    assert decode_response(encode(msg)) == msg
    old = msgspec.msgpack.encode(
        {"type": "LookupResponseMsg", "lookup_id": "r", "num_hit_tokens": 5, "seq": 1}
    )
    assert decode_response(old).tier_tokens is None
    bad = msgspec.msgpack.encode(
        {"type": "LookupResponseMsg", "lookup_id": "r", "num_hit_tokens": 5,
         "tier_tokens": [["cpu", -1]]}
    )  # fmt: skip
    with pytest.raises(msgspec.ValidationError):
        decode_response(bad)
