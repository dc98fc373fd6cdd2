"""Fuzzing what the disk tier reads back: chunk files and the names of the files it finds.

A chunk file is read back as the chunk asked for (its whole payload, checksum verified) or it
is a miss; a file name in the tier's directory is the canonical name of a key or not one of
ours.  Nothing else may happen: the directory may be shared, and hold anything.  The checks are
``tests/fuzz/targets.py``'s, which the coverage-guided fuzzer shares (``nox -s fuzz``).
"""

from __future__ import annotations

import os
import string
import tempfile

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmprefetch.keys import ChunkKey
from lmprefetch.tiers import chunkfile

from .fuzz import budget
from .fuzz.frames import mutated, weighted
from .fuzz.targets import CHUNK_KEY, CHUNK_SLOT_BYTES, check_chunk_file, check_chunk_name


def fuzz_settings(examples: int) -> settings:
    return budget.fuzz_settings(examples, HealthCheck.data_too_large)


def _written(key: ChunkKey, payload: bytes) -> bytes:
    """The bytes of a chunk file as the disk tier writes it."""
    with tempfile.TemporaryDirectory() as tmp:
        final = os.path.join(tmp, "c.kv")
        key_bytes = key.to_string().encode()
        chunkfile.write_file(final, final + ".tmp", key_bytes, memoryview(payload))
        with open(final, "rb") as f:
            return f.read()


_keys = st.builds(
    ChunkKey,
    st.sampled_from([CHUNK_KEY.model_name, "other", "org/m%"]),
    st.integers(1, 4),
    st.integers(0, 3),
    st.sampled_from([CHUNK_KEY.chunk_hash, 0, -1]),
    st.sampled_from([CHUNK_KEY.kv_dtype, "int8"]),
    st.sampled_from([-1, 0, 5]),
).filter(lambda k: k.rank < k.world_size)
_files = st.builds(
    _written,
    weighted((3, st.just(CHUNK_KEY)), (1, _keys)),
    st.binary(max_size=CHUNK_SLOT_BYTES + 8),
)


@st.composite
def _header_edits(draw: st.DrawFn) -> bytes:
    """A valid file with one header field rewritten (every field, any value of its width)."""
    data = bytearray(draw(_files))
    field = draw(st.integers(0, 5))
    offsets = (0, 8, 12, 16, 24, 32)
    widths = (8, 4, 4, 8, 8, 4)
    value = draw(st.binary(min_size=widths[field], max_size=widths[field]))
    data[offsets[field] : offsets[field] + widths[field]] = value
    return bytes(data)


@st.composite
def _payload_edits(draw: st.DrawFn) -> bytes:
    """A valid file with one payload byte changed, or the payload cut or extended (a torn or
    bit-flipped write): the checksum or the length must catch it."""
    data = bytearray(draw(_files))
    end = chunkfile.HEADER_BYTES
    how = draw(st.sampled_from(["flip", "cut", "extend"]))
    if how == "flip" and len(data) > end:
        i = draw(st.integers(end, len(data) - 1))
        data[i] ^= 1 << draw(st.integers(0, 7))
    elif how == "cut":
        del data[draw(st.integers(end, len(data))) :]
    else:
        data += draw(st.binary(min_size=1, max_size=8))
    return bytes(data)


@fuzz_settings(200)
@given(
    weighted(
        (2, _files),
        (2, mutated(_files)),
        (2, _payload_edits()),
        (2, _header_edits()),
        (1, _files.map(lambda f: f + b"\0")),
        (1, st.binary(max_size=64)),
        (1, st.binary(max_size=64).map(lambda b: chunkfile.MAGIC + b)),
    )
)
def test_a_chunk_file_is_its_chunk_or_a_miss(data: bytes) -> None:
    check_chunk_file(data)


_name_text = weighted(
    (3, st.text(string.ascii_letters + string.digits + "%/-_.", max_size=6)),
    (1, st.text(max_size=4)),
    # A name that is not UTF-8: os.scandir hands it over with lone surrogates.
    (2, st.binary(min_size=1, max_size=3).map(lambda b: b.decode("utf-8", "surrogateescape"))),
)


@st.composite
def _names(draw: st.DrawFn) -> bytes:
    """File names shaped like key names (``model@world@rank@hash@dtype[@Llayer].kv``), with
    any text in any part, as the file system hands them over (bytes, maybe not UTF-8)."""
    small = st.integers(-2, 9).map(str)
    hashes = st.sampled_from([0, 1, -1, 2**64 - 1, 2**64, -(2**63)]).map(lambda h: f"{h:016x}")
    parts = [  # each part mostly well-formed, so that the others get looked at
        draw(_name_text),
        draw(weighted((3, small), (1, _name_text))),
        draw(weighted((3, small), (1, _name_text))),
        draw(weighted((3, hashes), (1, _name_text))),
        draw(weighted((3, st.sampled_from(["bfloat16", "int8"])), (1, _name_text))),
    ]
    if draw(st.integers(0, 3)) == 0:
        parts.append(draw(weighted((3, small.map(lambda n: f"L{n}")), (1, _name_text))))
    suffix = draw(
        weighted(
            (3, st.just(chunkfile.FILE_SUFFIX)),
            (1, st.sampled_from([chunkfile.TEMP_SUFFIX, "", ".KV"])),
        )
    )
    return ("@".join(parts) + suffix).encode("utf-8", "surrogateescape")


@fuzz_settings(200)
@given(
    weighted(
        (4, _names()),
        (1, mutated(_names())),
        (1, st.binary(max_size=40)),
        (1, _keys.map(lambda k: (k.to_string() + chunkfile.FILE_SUFFIX).encode())),
    )
)
def test_a_file_name_is_a_key_or_not_ours(name: bytes) -> None:
    check_chunk_name(name)
