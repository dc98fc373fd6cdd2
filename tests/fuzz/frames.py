"""Hostile msgpack for the wire fuzzers, written byte by byte.

msgspec's own encoder only writes well-formed, canonical msgpack, so the frames here are put
together from raw headers instead: every msgpack type in every field (ext types and the
timestamp ext included), maps with non-``str`` keys and duplicate keys, integers at the edges of
every wire type (``-2**63``, ``2**64-1``, …) in every width (also non-minimal ones), NaN and
infinite floats, strings that are not UTF-8, declared lengths far past the end of the frame,
containers nested up to 100,000 deep, truncations and single-byte mutations of valid frames.

Everything is a Hypothesis strategy that draws ``bytes``, so a failure shrinks to a small frame
that can be kept as a regression file (``tests/fuzz/crashes/``).
"""

from __future__ import annotations

import struct
from typing import Any

import msgspec
from hypothesis import strategies as st

from lmprefetch.protocol import (
    LookupCleanupMsg,
    LookupRequestMsg,
    LookupResponseMsg,
    encode,
)

__all__ = [
    "FIELD_NAMES",
    "TAGS",
    "any_value",
    "cleanup_frames",
    "deep_nesting",
    "hostile_frames",
    "message_maps",
    "mutated",
    "odd_requests",
    "request_frames",
    "response_frames",
    "valid_cleanups",
    "valid_requests",
    "valid_responses",
]

I64_MIN = -(2**63)
U64_MAX = 2**64 - 1

TAGS = ("LookupRequestMsg", "LookupResponseMsg", "LookupCleanupMsg")
FIELD_NAMES = (
    "type",
    "lookup_id",
    "hashes",
    "offsets",
    "request_configs",
    "seq",
    "deadline_ms",
    "skip_chunks",
    "num_hit_tokens",
    "worker_id",
)

#: Integers at the edge of some wire type or check: each one and its neighbours.
EDGE_INTS = sorted(
    {
        v + d
        for v in (0, 2**7, 2**8, 2**15, 2**16, 2**31, 2**32, 2**63, 2**64, -(2**5), -(2**7))
        for d in (-1, 0, 1)
        if I64_MIN <= v + d <= U64_MAX
    }
    | {I64_MIN, I64_MIN + 1, -(2**31), -(2**31) - 1, -(2**15), -(2**15) - 1}
)

edge_ints = st.one_of(st.sampled_from(EDGE_INTS), st.integers(I64_MIN, U64_MAX))


# -- raw msgpack headers --------------------------------------------------------------------
def _int(value: int, width: str) -> bytes:
    """``value`` as msgpack in the given width ("fix", "u8" … "u64", "i8" … "i64")."""
    if width == "fix":
        return struct.pack("b", value) if value < 0 else bytes([value])
    code = {"u8": 0xCC, "u16": 0xCD, "u32": 0xCE, "u64": 0xCF}
    code |= {"i8": 0xD0, "i16": 0xD1, "i32": 0xD2, "i64": 0xD3}
    fmt = {"u8": ">B", "u16": ">H", "u32": ">I", "u64": ">Q"}
    fmt |= {"i8": ">b", "i16": ">h", "i32": ">i", "i64": ">q"}
    return bytes([code[width]]) + struct.pack(fmt[width], value)


def _widths(value: int) -> list[str]:
    """Every encoding that can hold ``value`` (msgpack allows non-minimal ones)."""
    out = []
    if -32 <= value <= 127:
        out.append("fix")
    for name, lo, hi in (
        ("u8", 0, 2**8 - 1),
        ("u16", 0, 2**16 - 1),
        ("u32", 0, 2**32 - 1),
        ("u64", 0, U64_MAX),
        ("i8", -(2**7), 2**7 - 1),
        ("i16", -(2**15), 2**15 - 1),
        ("i32", -(2**31), 2**31 - 1),
        ("i64", I64_MIN, 2**63 - 1),
    ):
        if lo <= value <= hi:
            out.append(name)
    return out


@st.composite
def raw_int(draw: st.DrawFn, values: st.SearchStrategy[int] = edge_ints) -> bytes:
    value = draw(values)
    return _int(value, draw(st.sampled_from(_widths(value))))


def _header(kind: str, n: int, width: str) -> bytes:
    """The header of a str/bin/array/map/ext of declared length ``n``."""
    if kind == "str":
        if width == "fix":
            return bytes([0xA0 | n])
        return {"8": b"\xd9", "16": b"\xda", "32": b"\xdb"}[width] + _len(n, width)
    if kind == "bin":
        return {"8": b"\xc4", "16": b"\xc5", "32": b"\xc6"}[width] + _len(n, width)
    if kind == "array":
        if width == "fix":
            return bytes([0x90 | n])
        return {"16": b"\xdc", "32": b"\xdd"}[width] + _len(n, width)
    if kind == "map":
        if width == "fix":
            return bytes([0x80 | n])
        return {"16": b"\xde", "32": b"\xdf"}[width] + _len(n, width)
    raise AssertionError(kind)


def _len(n: int, width: str) -> bytes:
    return struct.pack({"8": ">B", "16": ">H", "32": ">I"}[width], n)


def _len_widths(kind: str, n: int) -> list[str]:
    fix_max = {"str": 31, "array": 15, "map": 15, "bin": -1}[kind]
    out = ["fix"] if n <= fix_max else []
    if kind in ("str", "bin") and n < 2**8:
        out.append("8")
    if n < 2**16:
        out.append("16")
    if n < 2**32:
        out.append("32")
    return out


@st.composite
def sized(draw: st.DrawFn, kind: str, body: bytes, count: int | None = None) -> bytes:
    """``body`` behind a ``kind`` header of some width (``count`` items for containers)."""
    n = len(body) if count is None else count
    return _header(kind, n, draw(st.sampled_from(_len_widths(kind, n)))) + body


@st.composite
def lied(draw: st.DrawFn, frames: st.SearchStrategy[bytes]) -> bytes:
    """A frame with a header spliced in somewhere that declares far more than follows: a
    str, bin, ext, array or map of up to 2**32-1 bytes or items, with a short body."""
    frame = draw(frames)
    i = draw(st.integers(0, len(frame)))
    n = draw(st.sampled_from([2**32 - 1, 2**31, 2**16 - 1, 2**16, 255, 31, 15, len(frame) - i]))
    kind = draw(st.sampled_from(["str", "bin", "array", "map", "ext"]))
    if kind == "ext":
        head = b"\xc9" + struct.pack(">I", max(n, 0)) + b"\x01"
    else:
        widths = _len_widths(kind, max(n, 0))
        head = _header(kind, max(n, 0), draw(st.sampled_from(widths)))
    return frame[:i] + head + frame[i:]


def weighted(*choices: tuple[int, st.SearchStrategy[Any]]) -> st.SearchStrategy[Any]:
    """``st.one_of`` with weights (it picks branches about evenly; these are not)."""
    table = [strategy for weight, strategy in choices for _ in range(weight)]
    return st.integers(0, len(table) - 1).flatmap(lambda i: table[i])


def text_bytes(max_size: int = 12) -> st.SearchStrategy[bytes]:
    """UTF-8 text mostly, else bytes that are not UTF-8 (lone surrogates, overlongs, random)."""
    return weighted(
        (8, st.text(max_size=max_size).map(lambda s: s.encode("utf-8", "surrogatepass"))),
        (1, st.binary(max_size=max_size)),
        (1, st.sampled_from([b"\xff", b"\xc0\x80", b"\xed\xa0\x80", b"\xf4\x90\x80\x80"])),
    )


def raw_str(body: st.SearchStrategy[bytes] | None = None) -> st.SearchStrategy[bytes]:
    return (body or text_bytes()).flatmap(lambda b: sized("str", b))


def raw_name(names: tuple[str, ...]) -> st.SearchStrategy[bytes]:
    """A known name as a msgpack str in any width."""
    return st.sampled_from(names).flatmap(lambda s: sized("str", s.encode()))


_floats = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True).map(lambda f: b"\xcb" + struct.pack(">d", f)),
    st.floats(width=32).map(lambda f: b"\xca" + struct.pack(">f", f)),
    st.binary(min_size=8, max_size=8).map(lambda b: b"\xcb" + b),  # every NaN payload
)


@st.composite
def raw_ext(draw: st.DrawFn) -> bytes:
    code = draw(st.integers(-128, 127))
    if code == 0 or draw(st.booleans()):
        code = -1  # the timestamp extension, which msgspec interprets
    size = draw(st.sampled_from([1, 2, 4, 8, 12, 16, 0, 3, 17]))
    body = draw(st.binary(min_size=size, max_size=size))
    fixed = {1: 0xD4, 2: 0xD5, 4: 0xD6, 8: 0xD7, 16: 0xD8}
    if size in fixed and draw(st.booleans()):
        return bytes([fixed[size]]) + struct.pack("b", code) + body
    width = draw(st.sampled_from(["8", "16", "32"]))
    head = {"8": b"\xc7", "16": b"\xc8", "32": b"\xc9"}[width] + _len(size, width)
    return head + struct.pack("b", code) + body


scalars = st.one_of(
    st.sampled_from([b"\xc0", b"\xc2", b"\xc3", b"\xc1"]),  # nil, false, true, never-used
    raw_int(),
    _floats,
    raw_str(),
    st.binary(max_size=12).flatmap(lambda b: sized("bin", b)),
    raw_ext(),
)


def _array(items: list[bytes]) -> st.SearchStrategy[bytes]:
    return sized("array", b"".join(items), len(items))


def _map(pairs: list[tuple[bytes, bytes]]) -> st.SearchStrategy[bytes]:
    return sized("map", b"".join(k + v for k, v in pairs), len(pairs))


@st.composite
def deep_nesting(draw: st.DrawFn, min_depth: int = 500, max_depth: int = 100_000) -> bytes:
    """A container nested ``depth`` deep: arrays, maps (``str`` or non-``str`` keys) or both."""
    depth = draw(
        st.one_of(st.sampled_from([1_000, 10_000, 100_000]), st.integers(min_depth, max_depth))
    )
    unit = draw(st.sampled_from([b"\x91", b"\x81\xa1k", b"\x81\xc0", b"\x81\x01", b"\x92\xc0"]))
    tail = draw(st.sampled_from([b"\xc0", b"", b"\x90", b"\x80"]))  # b"": truncated
    return unit * depth + tail


def any_value(max_leaves: int = 8) -> st.SearchStrategy[bytes]:
    """Any msgpack value (well-formed or not), nested a little; sometimes very deep."""
    nested = st.recursive(
        scalars,
        lambda inner: st.one_of(
            st.lists(inner, max_size=4).flatmap(_array),
            st.lists(st.tuples(inner, inner), max_size=3).flatmap(_map),
        ),
        max_leaves=max_leaves,
    )
    return weighted((8, nested), (1, deep_nesting()), (1, st.binary(max_size=8)))


# -- plausible field values: the right type, at the edges -----------------------------------
def _int_list(values: st.SearchStrategy[int], max_size: int = 6) -> st.SearchStrategy[bytes]:
    return st.lists(raw_int(values), max_size=max_size).flatmap(_array)


def plausible(field: str, hashes: st.SearchStrategy[int] = edge_ints) -> st.SearchStrategy[bytes]:
    """A value of about the right type for ``field``: what a confused or hostile peer sends."""
    if field == "type":
        return raw_name(TAGS)
    if field == "lookup_id":
        return raw_str()
    if field == "hashes":
        return _int_list(hashes)
    if field == "offsets":
        small = st.one_of(st.integers(1, 64), st.sampled_from([0, -1, 2**32 - 1, 2**32, 2**63]))
        return _int_list(st.one_of(small, edge_ints))
    if field == "request_configs":
        pair = st.tuples(raw_str(), st.one_of(raw_str(), scalars))
        return st.one_of(st.just(b"\xc0"), st.lists(pair, max_size=3).flatmap(_map))
    if field == "deadline_ms":  # 0 (none) mostly, so that lookups run
        return st.one_of(st.just(b"\x00"), raw_int())
    if field in ("seq", "skip_chunks", "num_hit_tokens", "worker_id"):
        return st.one_of(raw_int(st.integers(-2, 8)), raw_int())
    return any_value()


_REQUIRED = {
    "LookupRequestMsg": ("lookup_id", "hashes", "offsets"),
    "LookupResponseMsg": ("lookup_id", "num_hit_tokens"),
    "LookupCleanupMsg": ("lookup_id",),
}
_OPTIONAL = {
    "LookupRequestMsg": ("request_configs", "seq", "deadline_ms", "skip_chunks"),
    "LookupResponseMsg": ("seq", "worker_id", "tier_tokens"),
    "LookupCleanupMsg": ("seq",),
}


@st.composite
def message_maps(
    draw: st.DrawFn,
    tags: tuple[str, ...] = TAGS,
    hashes: st.SearchStrategy[int] = edge_ints,
) -> bytes:
    """A msgpack map shaped like a message: a tag (or none, or a wrong one), its fields (now
    and then one missing, or of another type) with values at the edges of their types, and
    unknown names, non-``str`` keys and duplicate keys besides."""
    tag = draw(st.sampled_from(tags))
    pairs: list[tuple[bytes, bytes]] = []
    if draw(st.integers(0, 9)):  # the tag: mostly right, else any text, else another type
        tag_value = weighted((8, sized("str", tag.encode())), (1, raw_str()), (1, any_value()))
        pairs.append((b"\xa4type", draw(tag_value)))
    for name in _REQUIRED[tag] + _OPTIONAL[tag]:
        roll = draw(st.integers(0, 19))
        if roll == 0 or (roll < 8 and name in _OPTIONAL[tag]):
            continue  # missing
        value = any_value() if roll == 1 else plausible(name, hashes)
        pairs.append((draw(raw_name((name,))), draw(value)))
    for _ in range(draw(st.sampled_from([0, 0, 0, 1, 1, 2, 3]))):
        kind = draw(st.integers(0, 2))
        if kind == 0:  # an unknown field (ignored by the decoder, but still parsed)
            pairs.append((draw(raw_str()), draw(any_value())))
        elif kind == 1:  # a key that is not a string
            pairs.append((draw(scalars), draw(any_value())))
        else:  # another message's field
            name = draw(st.sampled_from(FIELD_NAMES))
            pairs.append((draw(raw_name((name,))), draw(plausible(name, hashes))))
    if pairs and draw(st.booleans()):
        pairs = draw(st.permutations(pairs))
    if pairs and draw(st.integers(0, 4)) == 0:  # a duplicated field
        pairs.append(pairs[draw(st.integers(0, len(pairs) - 1))])
    return draw(_map(pairs))


# -- valid messages and mutations of them ---------------------------------------------------
_ids = st.text(max_size=10)
_u63 = st.one_of(st.sampled_from([0, 1, 2**63 - 1]), st.integers(0, 2**63 - 1))
_configs = st.one_of(st.none(), st.dictionaries(st.text(max_size=4), st.text(max_size=4)))


def valid_requests(
    hashes: st.SearchStrategy[int] = edge_ints,
) -> st.SearchStrategy[LookupRequestMsg]:
    @st.composite
    def build(draw: st.DrawFn) -> LookupRequestMsg:
        hs = draw(st.lists(hashes, max_size=6))
        offsets = draw(st.lists(st.integers(1, 64), min_size=len(hs), max_size=len(hs)))
        return LookupRequestMsg(
            draw(_ids),
            hs,
            offsets,
            draw(_configs),
            seq=draw(_u63),
            deadline_ms=draw(st.one_of(st.just(0), _u63)),
            skip_chunks=draw(st.integers(0, len(hs))),
        )

    return build()


def odd_requests(
    hashes: st.SearchStrategy[int] = edge_ints,
) -> st.SearchStrategy[LookupRequestMsg]:
    """Requests with one flaw that only a check catches: an offset of 0, negative or past
    2**32-1 (:func:`~lmprefetch.protocol.validate_request`), hashes and offsets of different
    lengths, ``skip_chunks`` out of range, or ``seq`` / ``deadline_ms`` outside their wire
    range (the decoder).  Every one of them encodes: msgpack holds -2**63 … 2**64-1."""
    bad_offsets = st.sampled_from([0, -1, I64_MIN, 2**32, 2**63 - 1, 2**63, U64_MAX])

    @st.composite
    def build(draw: st.DrawFn) -> LookupRequestMsg:
        hs = draw(st.lists(hashes, min_size=1, max_size=5))
        offsets = draw(st.lists(st.integers(1, 64), min_size=len(hs), max_size=len(hs)))
        fields: dict[str, Any] = {"seq": draw(_u63), "skip_chunks": draw(st.integers(0, len(hs)))}
        flaw = draw(st.sampled_from(["offset", "offsets", "length", "skip", "seq", "deadline"]))
        if flaw == "offset":
            offsets[draw(st.integers(0, len(hs) - 1))] = draw(bad_offsets)
        elif flaw == "offsets":
            offsets = [draw(bad_offsets)] * len(hs)
        elif flaw == "length":
            offsets = draw(
                st.lists(st.integers(1, 64), max_size=6).filter(lambda o: len(o) != len(hs))
            )
        elif flaw == "skip":
            fields["skip_chunks"] = draw(
                st.one_of(st.integers(-3, -1), edge_ints).filter(lambda k: not 0 <= k <= len(hs))
            )
        elif flaw == "seq":
            fields["seq"] = draw(st.sampled_from([-1, I64_MIN, 2**63, U64_MAX]))
        else:
            fields["deadline_ms"] = draw(st.sampled_from([-1, I64_MIN, 2**63, U64_MAX]))
        return LookupRequestMsg(draw(_ids), hs, offsets, **fields)

    return build()


#: ``seq`` out of its wire range now and then (msgpack holds it; the decoder must refuse it).
valid_cleanups = st.builds(LookupCleanupMsg, _ids, seq=weighted((5, _u63), (1, edge_ints)))
#: Answers, with every integer now and then anywhere in msgpack's range.
valid_responses = st.builds(
    LookupResponseMsg,
    _ids,
    weighted((5, _u63), (1, edge_ints)),
    seq=weighted((5, _u63), (1, edge_ints)),
    worker_id=weighted((5, st.integers(-1, 2**31 - 1)), (1, edge_ints)),
    tier_tokens=st.one_of(
        st.none(),
        st.lists(
            st.tuples(
                st.sampled_from(["cpu", "disk", "redis", ""]), weighted((5, _u63), (1, edge_ints))
            ),
            max_size=3,
        ),
    ),
)


@st.composite
def mutated(draw: st.DrawFn, frames: st.SearchStrategy[bytes]) -> bytes:
    """A frame with one change: a byte replaced, inserted or removed, a bit flipped, or the
    frame cut short (or two frames glued together)."""
    frame = draw(frames)
    how = draw(st.sampled_from(["replace", "flip", "insert", "delete", "truncate", "glue"]))
    i = draw(st.integers(0, max(len(frame) - 1, 0)))
    if how == "replace" and frame:
        return frame[:i] + bytes([draw(st.integers(0, 255))]) + frame[i + 1 :]
    if how == "flip" and frame:
        return frame[:i] + bytes([frame[i] ^ (1 << draw(st.integers(0, 7)))]) + frame[i + 1 :]
    if how == "insert":
        return frame[:i] + bytes([draw(st.integers(0, 255))]) + frame[i:]
    if how == "delete":
        return frame[:i] + frame[i + 1 :]
    if how == "truncate":
        return frame[:i]
    return frame + draw(frames)


def _encoded(msgs: st.SearchStrategy[Any]) -> st.SearchStrategy[bytes]:
    return msgs.map(encode)


def request_frames(hashes: st.SearchStrategy[int] = edge_ints) -> st.SearchStrategy[bytes]:
    """Valid requests, and as many with one flaw (:func:`odd_requests`)."""
    return _encoded(weighted((1, valid_requests(hashes)), (1, odd_requests(hashes))))


cleanup_frames = _encoded(valid_cleanups)
response_frames = _encoded(valid_responses)


def hostile_frames(
    valid: st.SearchStrategy[bytes],
    tags: tuple[str, ...] = TAGS,
    hashes: st.SearchStrategy[int] = edge_ints,
) -> st.SearchStrategy[bytes]:
    """Any frame a hostile or broken peer might send; a third of them ``valid`` ones."""
    maps = message_maps(tags, hashes)
    return weighted(
        (6, valid),
        (2, mutated(valid)),
        (2, maps),
        (1, mutated(maps)),
        (1, any_value()),
        (1, st.binary(max_size=32)),
        (1, lied(valid)),
        (1, lied(maps)),
        # An LMCache-style map whose unknown field holds something very deep.
        (1, st.tuples(valid, deep_nesting()).map(_with_junk_field)),
    )


def _with_junk_field(pair: tuple[bytes, bytes]) -> bytes:
    """``frame`` (a fixmap) with one more, unknown field whose value is ``junk``."""
    frame, junk = pair
    if not frame or frame[0] & 0xF0 != 0x80 or frame[0] & 0x0F == 0x0F:
        return frame + junk
    return bytes([frame[0] + 1]) + frame[1:] + msgspec.msgpack.encode("junk") + junk
