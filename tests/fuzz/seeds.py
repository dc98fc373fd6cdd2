"""The seed corpus of each fuzz target: small, valid inputs that reach every branch worth
mutating from.  ``python -m tests.fuzz.seeds`` (from the repository root) rewrites
``tests/fuzz/corpus/<target>/seed-*``; inputs the fuzzer added (``libFuzzer -merge``) are left
alone.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from lmprefetch.hashing import ChunkHasher
from lmprefetch.protocol import (
    LookupCleanupMsg,
    LookupRequestMsg,
    LookupResponseMsg,
    encode,
)

from .targets import CHUNK, CHUNK_KEY, CHUNK_SLOT_BYTES, RANK, join_frames, stored_prompts

CORPUS = Path(__file__).parent / "corpus"


def _lmcache(fields: dict[str, object]) -> bytes:
    """A frame as LMCache 0.5.6 writes it: the tag first, no extension fields."""
    return msgspec.msgpack.encode(fields)


def request_seeds() -> dict[str, bytes]:
    hasher = ChunkHasher(CHUNK)
    cpu, _, slow = (hasher.hash(p) for p in stored_prompts())
    return {
        "request-cpu-hit": encode(LookupRequestMsg("a", cpu, [CHUNK] * len(cpu), seq=1)),
        "request-slow-hit": encode(LookupRequestMsg("b", slow, [CHUNK] * len(slow), seq=2)),
        "request-miss": encode(LookupRequestMsg("c", [1, 2], [CHUNK, 3], {"k": "v"}, seq=3)),
        "request-skip": encode(
            LookupRequestMsg("d", slow, [CHUNK] * len(slow), seq=4, skip_chunks=2)
        ),
        "request-deadline": encode(
            LookupRequestMsg("e", cpu, [CHUNK] * len(cpu), seq=5, deadline_ms=1)
        ),
        "request-empty": encode(LookupRequestMsg("", [], [])),
        "request-edges": encode(
            LookupRequestMsg("f", [-(2**63), 2**64 - 1], [2**32 - 1] * 2, seq=2**63 - 1)
        ),
        "request-lmcache": _lmcache(
            {
                "type": "LookupRequestMsg",
                "lookup_id": "g",
                "hashes": cpu,
                "offsets": [CHUNK] * 3,
                "request_configs": None,
            }
        ),
        "request-invalid": encode(LookupRequestMsg("h", [1, 2], [CHUNK])),
        "cleanup": encode(LookupCleanupMsg("a", seq=1)),
        "cleanup-lmcache": _lmcache({"type": "LookupCleanupMsg", "lookup_id": "a"}),
    }


def response_seeds() -> dict[str, bytes]:
    return {
        "response": encode(LookupResponseMsg("a", 12, seq=1, worker_id=RANK)),
        "response-edges": encode(LookupResponseMsg("b", 2**63 - 1, seq=2**63 - 1, worker_id=-1)),
        "response-lmcache": _lmcache(
            {"type": "LookupResponseMsg", "lookup_id": "c", "num_hit_tokens": 0}
        ),
    }


def chunk_file_seeds() -> dict[str, bytes]:
    """Chunk files as the disk tier writes them: for the key the check reads, for another
    key, and too large for the buffer."""
    import tempfile

    from lmprefetch.tiers import chunkfile

    def written(key: bytes, payload: bytes) -> bytes:
        with tempfile.TemporaryDirectory() as tmp:
            final = f"{tmp}/chunk.kv"
            chunkfile.write_file(final, final + ".tmp", key, memoryview(payload))
            with open(final, "rb") as f:
                return f.read()

    key = CHUNK_KEY.to_string().encode()
    other = CHUNK_KEY._replace(rank=1).to_string().encode()
    return {
        "valid": written(key, bytes(range(40))),
        "valid-empty": written(key, b""),
        "valid-full": written(key, b"\xff" * CHUNK_SLOT_BYTES),
        "other-key": written(other, bytes(range(40))),
        "too-large": written(key, b"x" * (CHUNK_SLOT_BYTES + 1)),
        "header-only": written(key, b"")[: chunkfile.HEADER_BYTES - 1],
    }


def chunk_name_seeds() -> dict[str, bytes]:
    from lmprefetch.tiers import chunkfile

    names = {
        "plain": CHUNK_KEY.to_string(),
        "layer": CHUNK_KEY._replace(layer=3).to_string(),
        "negative-hash": CHUNK_KEY._replace(chunk_hash=-1).to_string(),
        "quoted-model": CHUNK_KEY._replace(model_name="org/m%1").to_string(),
    }
    out = {name: (text + chunkfile.FILE_SUFFIX).encode() for name, text in names.items()}
    out["temp"] = (names["plain"] + chunkfile.TEMP_SUFFIX).encode()
    return out


def seeds() -> dict[str, dict[str, bytes]]:
    """Target → seed name → input."""
    requests, responses = request_seeds(), response_seeds()
    hasher = ChunkHasher(CHUNK)
    cpu, _, slow = (hasher.hash(p) for p in stored_prompts())
    conversation = [  # a reused id, a stale request, a cleanup, garbage in between
        encode(LookupRequestMsg("x", slow, [CHUNK] * len(slow), seq=5)),
        encode(LookupRequestMsg("x", cpu, [CHUNK] * len(cpu), seq=6)),
        encode(LookupRequestMsg("x", cpu, [CHUNK] * len(cpu), seq=4)),
        b"\xc1",
        encode(LookupCleanupMsg("x", seq=6)),
        encode(LookupRequestMsg("y", slow[:2], [CHUNK, CHUNK], seq=1)),
    ]
    return {
        "worker_frame": {**requests, "not-a-request": responses["response"]},
        "response_frame": {**responses, "not-a-response": requests["request-miss"]},
        "server_frames": {
            **{name: join_frames([frame]) for name, frame in requests.items()},
            "conversation": join_frames(conversation),
            "all-requests": join_frames(requests.values()),
        },
        "config_toml": {
            "defaults": b"",
            "table": b"[lmprefetch]\nchunk_size = 16\ncpu_bytes = 65536\nchunk_bytes = 64\n",
            "every-kind": (
                b'chunk_size = 4\nmodel_name = "m"\nlookup_timeout_s = 1.5\nlayerwise = true\n'
                b"num_layers = 2\nchunk_bytes = 64\ncpu_bytes = 4096\n"
                b'disk_path = "/tmp/x"\nredis_url = "redis://127.0.0.1:1"\n'
            ),
            "wrong": b"chunk_size = 'x'\n[other]\na = [1, {b = 2}]\n",
        },
        "chunk_file": chunk_file_seeds(),
        "chunk_name": chunk_name_seeds(),
    }


def main() -> None:
    for target, inputs in seeds().items():
        directory = CORPUS / target
        directory.mkdir(parents=True, exist_ok=True)
        for old in directory.glob("seed-*"):
            old.unlink()
        for name, data in inputs.items():
            (directory / f"seed-{name}").write_bytes(data)
        print(f"{directory}: {len(inputs)} seeds")


if __name__ == "__main__":
    main()
