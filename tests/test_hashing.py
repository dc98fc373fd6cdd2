"""ChunkHasher and keys: chunking, prefix chaining, determinism across processes."""

from __future__ import annotations

import subprocess
import sys
from array import array

import pytest

from lmprefetch import ChunkHasher, ChunkKey
from lmprefetch.keys import KeyMaker


def test_full_chunks_only_by_default() -> None:
    h = ChunkHasher(4)
    assert len(h.hash(list(range(11)))) == 2
    assert h.offsets(11) == [4, 4]
    assert h.spans(list(range(11))) == [
        (0, 4, h.hash(range(4))[0]),
        (4, 8, h.hash(list(range(8)))[1]),
    ]


def test_partial_tail_when_asked() -> None:
    h = ChunkHasher(4, save_partial_chunks=True)
    assert len(h.hash(list(range(11)))) == 3
    assert h.offsets(11) == [4, 4, 3]
    assert h.spans(list(range(11)))[-1][:2] == (8, 11)


def test_prefix_chaining() -> None:
    h = ChunkHasher(4)
    a = h.hash([1, 2, 3, 4, 5, 6, 7, 8])
    b = h.hash([1, 2, 3, 4, 5, 6, 7, 9])
    c = h.hash([0, 2, 3, 4, 5, 6, 7, 8])
    assert a[0] == b[0] and a[1] != b[1]
    assert a[1] != c[1]  # same second chunk, different prefix
    assert all(0 <= x < 2**64 for x in a)


@pytest.mark.parametrize("algorithm", ["blake2b", "sha256"])
def test_input_types_agree(algorithm: str) -> None:
    np = pytest.importorskip("numpy")
    h = ChunkHasher(8, algorithm)
    toks = list(range(100, 164))
    ref = h.hash(toks)
    assert h.hash(tuple(toks)) == ref
    assert h.hash(array("l", toks)) == ref
    assert h.hash(np.array(toks, dtype=np.int32)) == ref
    assert h.hash(range(100, 164)) == ref


def test_algorithms_differ_and_bad_args() -> None:
    toks = list(range(8))
    assert ChunkHasher(4).hash(toks) != ChunkHasher(4, "sha256").hash(toks)
    with pytest.raises(ValueError, match="algorithm"):
        ChunkHasher(4, "md5")
    with pytest.raises(ValueError, match="chunk_size"):
        ChunkHasher(0)
    with pytest.raises(ValueError, match="token_ids"):
        ChunkHasher(4).hash(["a", "b", "c", "d"])


def test_deterministic_across_processes() -> None:
    code = "from lmprefetch import ChunkHasher;print(ChunkHasher(16).hash(list(range(64))))"
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": seed, "PATH": ""},
        ).stdout
        for seed in ("1", "2")
    }
    assert len(outs) == 1
    assert outs.pop().strip() == str(ChunkHasher(16).hash(list(range(64))))


def test_key_string_round_trip_and_file_safe() -> None:
    k = ChunkKey("org/model%v2", 4, 3, 2**64 - 1, "bfloat16", 7)
    s = k.to_string()
    assert "/" not in s
    assert ChunkKey.from_string(s) == k
    k2 = ChunkKey("m", 1, 0, 5, "float16")
    assert k2.to_string() == "m@1@0@0000000000000005@float16"
    assert ChunkKey.from_string(k2.to_string()) == k2
    with pytest.raises(ValueError):
        ChunkKey.from_string("not-a-key")


def test_keys_per_rank_and_layer() -> None:
    a = KeyMaker("m", 2, 0, "bfloat16").keys([1, 2])
    b = KeyMaker("m", 2, 1, "bfloat16").keys([1, 2])
    assert a != b and [k.chunk_hash for k in a] == [1, 2]
    lw = KeyMaker("m", 1, 0, "bfloat16", layerwise=True, num_layers=3).keys([9, 8])
    assert [(k.chunk_hash, k.layer) for k in lw] == [(9, 0), (9, 1), (9, 2), (8, 0), (8, 1), (8, 2)]
    with pytest.raises(ValueError, match="rank"):
        KeyMaker("m", 2, 2, "bfloat16")
