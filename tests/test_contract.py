"""The public contract, as code outside this repository uses it.

Every name and behaviour here is promised to users (the API reference and the README show
them): the top-level names, ``PrefetchConfig``'s flat fields and defaults, ``ChunkHasher``,
``WorkerRuntime``'s synchronous API with ``LookupClient`` over real sockets, the async engine,
and the ``stats()`` keys with the conservation invariant.  Refactors may move code anywhere;
this file must keep passing unchanged.
"""

from __future__ import annotations

import importlib
import inspect
import time
import uuid
from pathlib import Path

import pytest
import trio

import lmprefetch
from lmprefetch import (
    Buffer,
    ChunkHasher,
    LookupClient,
    PrefetchConfig,
    WorkerRuntime,
    open_engine,
    serve_lookups,
)

CHUNK = 4
#: The keys ``stats()`` has at least, and what they are when nothing is in flight or held.
STATS_KEYS = (
    "inflight_lookups",
    "held_lookups",
    "pinned_chunks",
    "limiter_used",
    "arena_total_bytes",
    "arena_used_bytes",
    "cpu_resident_bytes",
)


def small(**fields: object) -> PrefetchConfig:
    return PrefetchConfig(chunk_size=CHUNK, chunk_bytes=64, cpu_bytes=64 * 32, **fields)


def assert_idle(stats: dict[str, object]) -> None:
    for key in (*STATS_KEYS, "tiers"):
        assert key in stats, key
    assert stats["inflight_lookups"] == 0
    assert stats["held_lookups"] == 0
    assert stats["pinned_chunks"] == 0
    assert stats["limiter_used"] == 0
    assert stats["arena_used_bytes"] == stats["cpu_resident_bytes"]


def test_the_top_level_names() -> None:
    for name in (
        "PrefetchConfig", "ChunkHasher", "WorkerRuntime", "LookupClient", "open_engine",
        "serve_lookups", "Engine", "Buffer", "ChunkKey",
    ):  # fmt: skip
        assert name in lmprefetch.__all__, name
        assert getattr(lmprefetch, name) is not None
    # Imported on first use (PEP 562): every name resolves, to the object its module defines.
    for name in lmprefetch.__all__:
        value = getattr(lmprefetch, name)
        assert getattr(importlib.import_module(value.__module__), name) is value, name
    assert set(dir(lmprefetch)) >= set(lmprefetch.__all__)
    with pytest.raises(AttributeError, match="no attribute 'NoSuchName'"):
        lmprefetch.NoSuchName  # noqa: B018


def test_config_fields_and_defaults() -> None:
    c = PrefetchConfig()
    assert c.chunk_size == 256
    assert c.save_partial_chunks is False
    assert c.hash_algorithm == "blake2b"
    assert (c.model_name, c.kv_dtype) == ("model", "bfloat16")
    assert (c.layerwise, c.num_layers) == (False, 1)
    assert (c.lookup_timeout_s, c.claim_ttl_s) == (3.0, 30.0)
    assert (c.cpu_bytes, c.chunk_bytes) == (1 << 30, 2 << 20)
    assert (c.disk_path, c.disk_bytes) == (None, 16 << 30)
    assert c.redis_url is None
    assert c.mooncake_master is None
    assert c.mooncake_metadata_server == "P2PHANDSHAKE"
    assert c.mooncake_protocol == "tcp"
    assert c.mooncake_local_hostname == "127.0.0.1"
    assert isinstance(c.mooncake_segment_bytes, int)
    assert isinstance(c.mooncake_timeout_s, float)
    assert PrefetchConfig.from_dict({"chunk_size": 16}).chunk_size == 16
    with pytest.raises(ValueError, match="chunk_size"):
        PrefetchConfig(chunk_size=0)


def test_config_from_file(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('chunk_size = 32\nmodel_name = "m"\n')
    c = PrefetchConfig.from_file(path)
    assert (c.chunk_size, c.model_name) == (32, "m")


def test_chunk_hasher() -> None:
    h = ChunkHasher(4)
    assert inspect.signature(ChunkHasher).parameters.keys() >= {
        "chunk_size", "algorithm", "save_partial_chunks",
    }  # fmt: skip
    tokens = list(range(10))
    hashes = h.hash(tokens)
    assert len(hashes) == 2  # the partial chunk is dropped by default
    assert all(0 <= x < 2**64 for x in hashes)
    assert [s[:2] for s in h.spans(tokens)] == [(0, 4), (4, 8)]
    assert [s[2] for s in h.spans(tokens)] == hashes
    assert ChunkHasher(4, "blake2b", True).hash(tokens)[:2] == hashes  # a prefix chain
    assert len(ChunkHasher(4, save_partial_chunks=True).hash(tokens)) == 3
    assert h.hash([9, *tokens[1:]])[1] != hashes[1]  # chunk 1's hash names its whole prefix


def test_runtime_and_client_over_ipc() -> None:
    """The README's synchronous example: store, lookup (None, then the hit), claim, forget;
    a miss answers 0 and holds nothing; cancel is idempotent; claims of unknown ids are
    empty."""
    tag = uuid.uuid4().hex[:10]
    req, resp = f"ipc://@lmp-contract-{tag}-w0", f"ipc://@lmp-contract-{tag}-s"
    config = small(lookup_timeout_s=10.0)
    tokens = list(range(3 * CHUNK))
    payloads = [bytes([i + 1]) * 16 for i in range(3)]
    worker = WorkerRuntime.start(
        config, rank=0, world_size=1, request_endpoint=req, response_endpoint=resp
    )
    client = LookupClient(config, [req], resp)
    try:
        assert worker.store(tokens, payloads) == 3

        def answer(lookup_id: str, toks: list[int]) -> int:
            first = client.lookup(lookup_id, toks)
            assert first is None  # never blocks: pending
            deadline = time.monotonic() + 10
            while True:
                got = client.lookup(lookup_id, toks)
                if got is not None:
                    return got
                assert time.monotonic() < deadline, "no answer within 10 s"
                time.sleep(0.001)  # the test's own polling, like an engine's step

        assert answer("req-1", tokens) == 3 * CHUNK
        assert client.lookup("req-1", tokens) == 3 * CHUNK  # cached until forgotten
        with worker.claim("req-1") as chunks:
            assert [bytes(buf.view()) for _, buf in chunks] == payloads
            assert all(isinstance(buf, Buffer) for _, buf in chunks)
        client.forget("req-1")
        with worker.claim("req-1") as chunks:
            assert chunks == []
        # A miss answers 0 and holds nothing.
        assert answer("req-2", [10_000 + t for t in tokens]) == 0
        assert worker.stats()["held_lookups"] == 0
        # A partial prompt: the whole chunks that are cached.
        assert answer("req-3", tokens[: 2 * CHUNK] + [77] * CHUNK) == 2 * CHUNK
        client.cancel("req-3")
        client.cancel("req-3")
        worker.cancel("req-3")
        with worker.claim("never-asked") as chunks:
            assert chunks == []
        deadline = time.monotonic() + 10
        while worker.stats()["held_lookups"]:  # the cleanup message travels
            assert time.monotonic() < deadline
            time.sleep(0.001)
        assert_idle(worker.stats())
    finally:
        client.close()
        worker.close()
    worker.close()  # idempotent


def test_store_rejects_a_payload_longer_than_chunk_bytes() -> None:
    with WorkerRuntime.start(small()) as worker:
        with pytest.raises(ValueError, match=r"chunk 1"):
            worker.store(list(range(2 * CHUNK)), [b"x" * 8, b"y" * 65])
        assert_idle(worker.stats())


async def test_engine_async_api_and_conservation(tmp_path: Path) -> None:
    config = small(disk_path=str(tmp_path))
    tokens = list(range(4 * CHUNK))
    payloads = [bytes([i + 7]) * 32 for i in range(4)]
    async with open_engine(config, rank=0, world_size=1) as engine:
        assert await engine.store(tokens, payloads) == 4
        await engine.flush()
        hashes = engine.hasher.hash(tokens)
        offsets = [CHUNK] * len(hashes)
        assert await engine.lookup_and_prefetch("a", hashes, offsets) == 4 * CHUNK
        with engine.claim("a") as chunks:
            assert [bytes(b.view()) for _, b in chunks] == payloads
        # Hashes and offsets of different lengths: answered 0.
        assert await engine.lookup_and_prefetch("bad", hashes, offsets[:-1]) == 0
        # Cancelled while held: released at once; cancel twice is fine.
        assert await engine.lookup_and_prefetch("b", hashes, offsets) == 4 * CHUNK
        engine.cancel("b")
        engine.cancel("b")
        with engine.claim("b") as chunks:
            assert chunks == []
        assert_idle(engine.stats())
        assert "cpu" in engine.stats()["tiers"]
    # The disk tier survives a restart: a new engine finds the chunks from disk.
    async with open_engine(config) as engine:
        hashes = engine.hasher.hash(tokens)
        assert await engine.lookup_and_prefetch("c", hashes, [CHUNK] * 4) == 4 * CHUNK
        with engine.claim("c") as chunks:
            assert [bytes(b.view()) for _, b in chunks] == payloads
        assert list(engine.stats()["tiers"]) == ["cpu", "disk"]
        assert_idle(engine.stats())


async def test_a_cancelled_caller_leaves_nothing_held(tmp_path: Path) -> None:
    config = small(disk_path=str(tmp_path))
    tokens = list(range(4 * CHUNK))
    async with open_engine(config) as engine:
        await engine.store(tokens, [b"p" * 32] * 4)
        await engine.flush()
        hashes = engine.hasher.hash(tokens)
    async with open_engine(config) as engine:  # a disk hit needs a task
        with trio.CancelScope() as scope:
            scope.cancel()
            await engine.lookup_and_prefetch("x", hashes, [CHUNK] * 4)
        with engine.claim("x") as chunks:
            assert chunks == []
        with trio.fail_after(10):
            await engine.wait_quiet()
        assert_idle(engine.stats())


async def test_serve_lookups_is_an_async_context_manager() -> None:
    tag = uuid.uuid4().hex[:10]
    req, resp = f"ipc://@lmp-contract-{tag}-w", f"ipc://@lmp-contract-{tag}-r"
    async with open_engine(small()) as engine, serve_lookups(engine, req, resp):
        pass
    assert inspect.signature(serve_lookups).parameters.keys() >= {
        "engine", "request_endpoint", "response_endpoint",
    }  # fmt: skip
