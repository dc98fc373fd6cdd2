"""Per-tenant name spaces: salted chunk hashes, and tenants kept apart by the engine, the client
and two engines sharing one Redis.

A salt (vLLM's ``cache_salt``, a LoRA adapter) is chained into chunk 0's hash, so every key of a
salted prompt differs from the unsalted prompt's and from the same prompt's under another salt.
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import trio

from lmprefetch import ChunkHasher, LookupClient, PrefetchConfig, WorkerRuntime, open_engine
from lmprefetch.hashing import tenant_salt

from .redis_servers import HAVE_REDIS, RedisServer, redis_server_fixture  # noqa: F401

ROOT = Path(__file__).resolve().parent.parent
DEADLINE_S = 30


def tokens(n: int, seed: int = 1) -> list[int]:
    return [(seed * 7919 + i * 31) % 997 + 3 for i in range(n)]


# -- hashing ----------------------------------------------------------------------------------
@pytest.mark.parametrize("algorithm", ["blake2b", "sha256"])
def test_a_salt_changes_every_chunk_hash_and_salts_differ(algorithm: str) -> None:
    h = ChunkHasher(4, algorithm)
    toks = tokens(40)
    plain = h.hash(toks)
    a = h.hash(toks, tenant_salt("tenant-a"))
    a_again = h.hash(toks, tenant_salt("tenant-a"))
    b = h.hash(toks, tenant_salt("tenant-b"))
    assert len(plain) == len(a) == len(b) == 10
    assert a == a_again  # deterministic
    # Every key differs, not just the first: no chunk of a salted prompt is shared.
    assert not set(a) & set(plain)
    assert not set(a) & set(b)
    assert not set(b) & set(plain)
    assert h.hash(toks, None) == plain


def test_unsalted_hashes_are_unchanged() -> None:
    """Without a salt the hashes are those of the release before salts existed (fixed
    values): caches written before keep hitting, and LMCache-compatible requests are as they
    were."""
    assert ChunkHasher(4).hash([1, 2, 3, 4, 5, 6, 7, 8]) == [
        0x31F2B7D0B7D92C73,
        0xB606083C40B15A85,
    ]
    assert ChunkHasher(4, "sha256").hash([1, 2, 3, 4]) == [0x281B02B10F5F4997]


def test_tenant_salt_parts_cannot_be_confused() -> None:
    assert tenant_salt() is None
    assert tenant_salt("", None, "") is None
    salts = [
        tenant_salt("ab"),
        tenant_salt("a"),
        tenant_salt(None, "ab"),  # the same string as a cache salt and as an adapter name
        tenant_salt("a", "b"),
        tenant_salt("ab", "c"),
        tenant_salt("a", "bc"),  # same concatenation as the one before
        tenant_salt(None, "lora", "/adapters/one"),
        tenant_salt(None, "lora", "/adapters/two"),  # same name, another adapter
        tenant_salt(None, "lora"),
    ]
    assert len(set(salts)) == len(salts)
    h = ChunkHasher(4)
    hashed = [tuple(h.hash(tokens(8), s)) for s in salts]
    assert len(set(hashed)) == len(hashed)
    with pytest.raises(ValueError, match="salt"):
        h.hash(tokens(8), b"")
    with pytest.raises(ValueError, match="salt"):
        h.hash(tokens(8), "text")  # type: ignore[arg-type]


def test_salted_hashes_are_the_same_in_another_process() -> None:
    code = (
        "from lmprefetch.hashing import ChunkHasher, tenant_salt;"
        "print(ChunkHasher(4).hash(list(range(3, 43)), tenant_salt('t', 'l', 'i')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
        env={"PYTHONHASHSEED": "12345", "PATH": ""},
    ).stdout
    here = ChunkHasher(4).hash(list(range(3, 43)), tenant_salt("t", "l", "i"))
    assert out.strip() == str(here)


# -- the engine -------------------------------------------------------------------------------
async def test_engine_keeps_tenants_apart(small_config: PrefetchConfig) -> None:
    toks = tokens(16)
    payloads = [bytes([i]) * 40 for i in range(4)]
    salt_a, salt_b = tenant_salt("a"), tenant_salt("b")
    hasher = ChunkHasher(4)
    offsets = hasher.offsets(16)
    with trio.fail_after(DEADLINE_S):
        async with open_engine(small_config) as engine:
            assert await engine.store(toks, payloads, salt=salt_a) == 4
            # The same tenant finds all of it, with the bytes it stored.
            assert await engine.lookup_and_prefetch("a", hasher.hash(toks, salt_a), offsets) == 16
            with engine.claim("a") as items:
                assert [bytes(buf.view()) for _, buf in items] == payloads
            # Another tenant, and the unsalted name space, find nothing.
            assert await engine.lookup_and_prefetch("b", hasher.hash(toks, salt_b), offsets) == 0
            assert await engine.lookup_and_prefetch("u", hasher.hash(toks), offsets) == 0
            # B's own store is found by B, and A's chunks are still A's.
            other = [bytes([9 - i]) * 40 for i in range(4)]
            assert await engine.store(toks, other, salt=salt_b) == 4
            assert await engine.lookup_and_prefetch("b2", hasher.hash(toks, salt_b), offsets) == 16
            with engine.claim("b2") as items:
                assert [bytes(buf.view()) for _, buf in items] == other
            assert await engine.lookup_and_prefetch("a2", hasher.hash(toks, salt_a), offsets) == 16
            with engine.claim("a2") as items:
                assert [bytes(buf.view()) for _, buf in items] == payloads
            assert engine.is_idle()


def test_client_salt_reaches_the_right_name_space(small_config: PrefetchConfig) -> None:
    """``LookupClient.lookup(salt=...)`` hashes on the bridge thread under the salt; the
    request carries only the salted hashes."""
    tag = uuid.uuid4().hex[:10]
    worker, sched = f"ipc://@lmp-ten-w-{tag}", f"ipc://@lmp-ten-s-{tag}"
    toks = tokens(16, seed=5)
    salt = tenant_salt("tenant-x")
    with (
        WorkerRuntime.start(
            small_config, request_endpoint=worker, response_endpoint=sched
        ) as runtime,
        LookupClient(small_config, [worker], sched) as client,
    ):
        assert runtime.store(toks, [b"x" * 64] * 4, salt=salt) == 4
        for lookup_id, kwargs, want in (
            ("same", {"salt": salt}, 16),
            ("other", {"salt": tenant_salt("tenant-y")}, 0),
            ("plain", {}, 0),
        ):
            assert client.lookup(lookup_id, toks, **kwargs) is None
            assert client.wait(lookup_id, DEADLINE_S) == want, lookup_id
            client.cancel(lookup_id)


# -- two engines sharing one Redis ------------------------------------------------------------
@pytest.mark.redis
@pytest.mark.skipif(not HAVE_REDIS, reason="redis-server / redis-cli not on PATH")
async def test_two_engines_sharing_redis_keep_tenants_apart(redis_server: RedisServer) -> None:
    """Two engines (two servers: own CPU tiers, one Redis): a tenant's chunks stored by one
    are found by the other under the same salt only."""
    config = PrefetchConfig(
        chunk_size=4, chunk_bytes=64, cpu_bytes=64 * 32, redis_url=redis_server.url
    )
    toks = tokens(12, seed=9)
    hasher = ChunkHasher(4)
    offsets = hasher.offsets(12)
    salt_a, salt_b = tenant_salt("a"), tenant_salt("b")
    payloads_a = [bytes([0xA0 + i]) * 64 for i in range(3)]
    payloads_b = [bytes([0xB0 + i]) * 64 for i in range(3)]
    with trio.fail_after(DEADLINE_S):
        async with open_engine(config) as one, open_engine(config) as two:
            assert await one.store(toks, payloads_a, salt=salt_a) == 3
            await one.flush()  # in Redis now
            # Server two has an empty CPU tier: its hits come from Redis.
            assert await two.lookup_and_prefetch("b", hasher.hash(toks, salt_b), offsets) == 0
            assert await two.lookup_and_prefetch("u", hasher.hash(toks), offsets) == 0
            assert await two.lookup_and_prefetch("a", hasher.hash(toks, salt_a), offsets) == 12
            with two.claim("a") as items:
                assert [bytes(buf.view()) for _, buf in items] == payloads_a
            assert two.statistics().tier("redis").chunks_loaded == 3
            # Tenant B stores through server two; server one finds it under B's salt only.
            assert await two.store(toks, payloads_b, salt=salt_b) == 3
            await two.flush()
            assert await one.lookup_and_prefetch("b", hasher.hash(toks, salt_b), offsets) == 12
            with one.claim("b") as items:
                assert [bytes(buf.view()) for _, buf in items] == payloads_b
            assert await one.lookup_and_prefetch("u", hasher.hash(toks), offsets) == 0
            assert one.is_idle() and two.is_idle()
