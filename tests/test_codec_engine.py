"""Codecs and per-tenant encryption through the engine (docs/codecs.md): configured by
``disk_codec``, ``redis_codec`` and ``encryption_key_file``, with the tenant carried from the
client's salt over the wire to the tier.

The acceptance figure of issue 27: under damaged, foreign-key and unknown-codec chunks, **0
wrong bytes and 0 cross-tenant plaintext**.  Two tenants store the same prompt through an
engine whose disk and Redis are shared; then the stored chunks are exchanged between the
tenants' keys, damaged, opened under another master key, and dumped.  Every claimed chunk is
compared with what its own tenant stored: each claimed byte is the tenant's own, or nothing is
claimed.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from pathlib import Path

import pytest
import trio

pytest.importorskip("numpy")
pytest.importorskip("zstandard")
pytest.importorskip("cryptography")

from lmprefetch import ChunkHasher, LookupClient, PrefetchConfig, WorkerRuntime, open_engine
from lmprefetch.codec import tenant_id
from lmprefetch.hashing import tenant_salt
from lmprefetch.keys import KeyMaker
from lmprefetch.prefetch import Engine
from lmprefetch.tiers import chunkfile
from lmprefetch.tiers.redis import decode_value, encode_value, redis_key

from .redis_servers import HAVE_REDIS, RedisServer, raw_client
from .redis_servers import redis_server_fixture as redis_server_fixture

DEADLINE_S = 60
CHUNK = 16  # tokens per chunk
CHUNK_BYTES = 8192
N_CHUNKS = 4
SALT_A, SALT_B = tenant_salt("alice"), tenant_salt("bob")

redis_mark = [
    pytest.mark.redis,
    pytest.mark.skipif(not HAVE_REDIS, reason="redis-server / redis-cli not on PATH"),
]


def tokens() -> list[int]:
    return [(i * 37) % 1000 + 3 for i in range(CHUNK * N_CHUNKS)]


def kv(tenant: str, i: int) -> bytes:
    """A chunk payload: bfloat16-like, compressible, and different per tenant and chunk."""
    import numpy as np

    rng = np.random.default_rng(abs(hash((tenant, i))) % 2**32)
    values = rng.standard_normal(CHUNK_BYTES // 2).astype(np.float32)
    return (values.view(np.uint32) >> 16).astype(np.uint16).tobytes()


PAYLOADS = {t: [kv(t, i) for i in range(N_CHUNKS)] for t in ("alice", "bob")}


def key_file(tmp_path: Path, name: str = "key", seed: int = 7) -> str:
    path = tmp_path / name
    path.write_bytes(bytes((seed + i) % 256 for i in range(32)))
    return str(path)


def config(
    tmp_path: Path, redis_url: str | None, key: str | None, **extra: object
) -> PrefetchConfig:
    fields: dict[str, object] = {
        "chunk_size": CHUNK,
        "chunk_bytes": CHUNK_BYTES,
        "cpu_bytes": CHUNK_BYTES * 64,
        "disk_path": str(tmp_path / "disk"),
        "redis_url": redis_url,
        "encryption_key_file": key,
        "disk_codec": "none",
        "redis_codec": "lossless",
        **extra,
    }
    return PrefetchConfig(**fields)  # type: ignore[arg-type]


class Tally:
    """What the lookups claimed: bytes that are the tenant's own, wrong bytes, and chunks of
    the other tenant (cross-tenant plaintext)."""

    def __init__(self) -> None:
        self.own = self.wrong = self.foreign = 0

    async def look(
        self, engine: Engine, lookup_id: str, tenant: str, *, as_tenant: str | None = None
    ) -> int:
        """Look up ``tenant``'s prompt (opened as ``as_tenant``, by default the same); claim and
        compare every chunk; the chunks claimed."""
        salt = SALT_A if tenant == "alice" else SALT_B
        opener = as_tenant or tenant
        hasher = ChunkHasher(CHUNK)
        toks = tokens()
        hit = await engine.lookup_and_prefetch(
            lookup_id,
            hasher.hash(toks, salt),
            hasher.offsets(len(toks)),
            tenant=tenant_id(SALT_A if opener == "alice" else SALT_B),
        )
        other = "bob" if tenant == "alice" else "alice"
        with engine.claim(lookup_id) as items:
            for i, (_, buf) in enumerate(items):
                data = bytes(buf.view())
                if data == PAYLOADS[tenant][i]:
                    self.own += 1
                else:
                    self.wrong += 1
                    if data in PAYLOADS[other]:
                        self.foreign += 1
        return hit // CHUNK


def stored_keys(engine: Engine, salt: bytes) -> list:
    maker = KeyMaker.from_config(engine.config, rank=0, world_size=1)
    return maker.keys(ChunkHasher(CHUNK).hash(tokens(), salt))


def swap_at_rest(tmp_path: Path, redis_url: str, keys_a: Sequence, keys_b: Sequence) -> None:
    """Exchange the two tenants' stored chunks, key by key, on disk and in Redis (each under
    the other's key, inside valid framing: the tiers' own checksums pass)."""
    disk = tmp_path / "disk"
    for a, b in zip(keys_a, keys_b, strict=True):
        fa, fb = disk / f"{a.to_string()}.kv", disk / f"{b.to_string()}.kv"
        da = fa.read_bytes()[chunkfile.HEADER_BYTES :]
        db = fb.read_bytes()[chunkfile.HEADER_BYTES :]
        for path, k, data in ((fa, a, db), (fb, b, da)):
            chunkfile.write_file(
                str(path), str(path) + ".tmp", k.to_string().encode(), memoryview(data),
                encoded=True,  # (sealed chunks, as the tier framed them)
            )  # fmt: skip
    with raw_client(redis_url) as client:
        for a, b in zip(keys_a, keys_b, strict=True):
            va, vb = client.get(redis_key(a)), client.get(redis_key(b))
            client.set(redis_key(a), vb)
            client.set(redis_key(b), va)


def damage_at_rest(tmp_path: Path, redis_url: str, keys: Sequence) -> None:
    """Flip one bit in the stored bytes of every chunk after the first (inside valid
    framing)."""
    disk = tmp_path / "disk"
    for k in keys[1:]:
        path = disk / f"{k.to_string()}.kv"
        data = bytearray(path.read_bytes()[chunkfile.HEADER_BYTES :])
        data[len(data) // 2] ^= 0x10
        chunkfile.write_file(
            str(path), str(path) + ".tmp", k.to_string().encode(), memoryview(data), encoded=True
        )
    with raw_client(redis_url) as client:
        for k in keys[1:]:
            payload = decode_value(client.get(redis_key(k)))
            assert payload is not None
            data = bytearray(payload)
            data[len(data) // 2] ^= 0x10
            client.set(redis_key(k), encode_value(data, encoded=True))


def dump(tmp_path: Path, redis_url: str) -> list[bytes]:
    files = [p.read_bytes() for p in (tmp_path / "disk").iterdir()]
    with raw_client(redis_url) as client:
        return files + [client.get(name) for name in client.keys("*")]


async def one_tier(tmp_path: Path, url: str, key: str | None, tier: str) -> PrefetchConfig:
    """A reader that sees only ``tier`` (disk or Redis): the other is left out."""
    c = config(tmp_path, url if tier == "redis" else None, key)
    if tier == "redis":
        c = c.replace(disk_path=str(tmp_path / "empty-disk"))
    return c


@pytest.mark.parametrize("tier", ["disk", "redis"])
@pytest.mark.redis
@pytest.mark.skipif(not HAVE_REDIS, reason="redis-server / redis-cli not on PATH")
async def test_zero_wrong_bytes_and_zero_cross_tenant_plaintext(
    tmp_path: Path, redis_server: RedisServer, tier: str
) -> None:
    url = redis_server.url
    key = key_file(tmp_path)
    tally = Tally()
    with trio.fail_after(DEADLINE_S):
        async with open_engine(config(tmp_path, url, key)) as writer:
            for tenant, salt in (("alice", SALT_A), ("bob", SALT_B)):
                assert await writer.store(tokens(), PAYLOADS[tenant], salt=salt) == N_CHUNKS
            await writer.flush()
            keys_a, keys_b = stored_keys(writer, SALT_A), stored_keys(writer, SALT_B)

        # At rest: no prompt's KV in any file or Redis value.
        for stored in dump(tmp_path, url):
            for payloads in PAYLOADS.values():
                assert all(p[i : i + 32] not in stored for p in payloads for i in (0, 4096))

        reader = await one_tier(tmp_path, url, key, tier)
        # Each tenant reads its own chunks back (from this one tier: a fresh CPU tier).
        async with open_engine(reader) as engine:
            assert await tally.look(engine, "a", "alice") == N_CHUNKS
            assert await tally.look(engine, "b", "bob") == N_CHUNKS
            # A lookup that names the wrong tenant opens nothing (the prompt's own hashes).
            assert await tally.look(engine, "a-as-b", "alice", as_tenant="bob") == 0
            assert engine.statistics().tier(tier).codec_misses >= 1
        assert tally.own == 2 * N_CHUNKS and tally.wrong == 0

        # Another master key opens nothing (and the chunks it refused are dropped).
        other_key = key_file(tmp_path, "other", seed=99)
        async with open_engine(reader.replace(encryption_key_file=other_key)) as engine:
            assert await tally.look(engine, "a-other-key", "alice") == 0

    # The tenants' chunks exchanged at rest: each lookup finds the other's chunk under its
    # own key, and opens none of it.
    with trio.fail_after(DEADLINE_S):
        async with open_engine(config(tmp_path, url, key)) as writer:
            for tenant, salt in (("alice", SALT_A), ("bob", SALT_B)):
                assert await writer.store(tokens(), PAYLOADS[tenant], salt=salt) == N_CHUNKS
            await writer.flush()
        swap_at_rest(tmp_path, url, keys_a, keys_b)
        async with open_engine(reader) as engine:
            assert await tally.look(engine, "a-swapped", "alice") == 0
            assert await tally.look(engine, "b-swapped", "bob") == 0
            assert engine.statistics().tier(tier).codec_misses >= 2

        # Damaged chunks (after the first): the prefix before the damage, exact.
        async with open_engine(config(tmp_path, url, key)) as writer:
            assert await writer.store(tokens(), PAYLOADS["alice"], salt=SALT_A) == N_CHUNKS
            await writer.flush()
        damage_at_rest(tmp_path, url, keys_a)
        async with open_engine(reader) as engine:
            assert await tally.look(engine, "a-damaged", "alice") == 1

        # Without encryption, the sealed chunks are misses (no plaintext for the keyless).
        async with open_engine(config(tmp_path, url, key)) as writer:
            assert await writer.store(tokens(), PAYLOADS["alice"], salt=SALT_A) == N_CHUNKS
            await writer.flush()
        async with open_engine(reader.replace(encryption_key_file=None)) as engine:
            assert await tally.look(engine, "a-keyless", "alice") == 0

    assert tally.wrong == 0
    assert tally.foreign == 0
    assert tally.own == 2 * N_CHUNKS + 1


@pytest.mark.redis
@pytest.mark.skipif(not HAVE_REDIS, reason="redis-server / redis-cli not on PATH")
async def test_plaintext_chunks_are_refused_once_encryption_is_on(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """Chunks written before encryption was turned on (plaintext, on disk and in Redis) are
    misses for an engine that encrypts: a store that should hold only ciphertext was written
    to by someone without the key."""
    url = redis_server.url
    tally = Tally()
    with trio.fail_after(DEADLINE_S):
        async with open_engine(config(tmp_path, url, None)) as writer:
            assert await writer.store(tokens(), PAYLOADS["alice"], salt=SALT_A) == N_CHUNKS
            await writer.flush()
        async with open_engine(config(tmp_path, url, key_file(tmp_path))) as engine:
            assert await tally.look(engine, "a", "alice") == 0
            stats = engine.statistics()
            assert stats.tier("disk").codec_misses == 1
    assert tally.wrong == 0


async def test_codecs_through_the_engine_and_statistics(tmp_path: Path) -> None:
    """``disk_codec = "lossless"``: chunks come back exactly after a restart, the disk holds
    fewer bytes than the payloads, and the statistics say so (``stats()`` too)."""
    c = config(tmp_path, None, None, disk_codec="lossless")
    tally = Tally()
    with trio.fail_after(DEADLINE_S):
        async with open_engine(c) as engine:
            assert await engine.store(tokens(), PAYLOADS["alice"], salt=SALT_A) == N_CHUNKS
            await engine.flush()
            disk = engine.statistics().tier("disk")
            assert disk.bytes_stored == N_CHUNKS * CHUNK_BYTES
            assert disk.encoded_bytes_stored < 0.8 * disk.bytes_stored
            assert disk.encode_seconds > 0
        async with open_engine(c) as engine:
            assert await tally.look(engine, "a", "alice") == N_CHUNKS
            disk = engine.statistics().tier("disk")
            assert disk.bytes_loaded == N_CHUNKS * CHUNK_BYTES
            assert disk.encoded_bytes_loaded < disk.bytes_loaded
            assert disk.decode_seconds > 0 and disk.decode_bytes_per_s_ewma
            assert engine.stats()["tiers"]["disk"]["codec_misses"] == 0
            # The load policy's cost of the tier includes its decoding.
            cost = next(t for t in engine.tiers if t.name == "disk").stats.cost()
            assert cost.decode_bytes_per_s == disk.decode_bytes_per_s_ewma
    assert tally.own == N_CHUNKS and tally.wrong == 0


def test_the_tenant_travels_from_the_client_to_the_tier(tmp_path: Path) -> None:
    """Through the wire: a worker that encrypts opens a disk hit with the tenant the client's
    request names (the salt's digest).  The same hashes with another tenant named, or none,
    open nothing (and the refused chunks are dropped), so the worker did use what the request
    carried."""
    c = config(tmp_path, None, key_file(tmp_path))
    toks = tokens()
    hasher = ChunkHasher(CHUNK)
    hashes, offsets = hasher.hash(toks, SALT_A), hasher.offsets(len(toks))
    for lookup_id, kwargs, want in (
        ("bob-named", {"hashes": hashes, "offsets": offsets, "salt": SALT_B}, 0),
        ("unnamed", {"hashes": hashes, "offsets": offsets}, 0),
        ("alice-hashed", {"hashes": hashes, "offsets": offsets, "salt": SALT_A}, len(toks)),
        ("alice", {"salt": SALT_A}, len(toks)),
    ):
        with WorkerRuntime.start(c) as runtime:  # the chunks on disk, sealed for alice
            assert runtime.store(toks, PAYLOADS["alice"], salt=SALT_A) == N_CHUNKS
        tag = uuid.uuid4().hex[:10]
        worker, sched = f"ipc://@lmp-codec-w-{tag}", f"ipc://@lmp-codec-s-{tag}"
        with (  # a new worker: an empty CPU tier
            WorkerRuntime.start(c, request_endpoint=worker, response_endpoint=sched) as runtime,
            LookupClient(c, [worker], sched) as client,
        ):
            assert client.lookup(lookup_id, toks, **kwargs) is None  # type: ignore[arg-type]
            assert client.wait(lookup_id, DEADLINE_S) == want, lookup_id
            if want:
                with runtime.claim(lookup_id) as items:
                    assert [bytes(b.view()) for _, b in items] == PAYLOADS["alice"]
            client.cancel(lookup_id)
            misses = runtime.stats()["tiers"]["disk"]["codec_misses"]
            assert misses == (0 if want else 1), lookup_id


async def test_bench_codecs_disk_hit_measures_each_codec_beside_none() -> None:
    """``bench-codecs --disk-hit``'s measurement (small synthetic chunks here; the real
    figures come from the trained model's KV): each codec's disk hit through the engine,
    its stored bytes, and its ratio to ``none`` from the same run."""
    from lmprefetch.bench.codecs import disk_hits

    chunks = [kv("alice", i) for i in range(3)]
    with trio.fail_after(DEADLINE_S):
        rows = await disk_hits(chunks, ["lossless", "none+aes"], 1, CHUNK)
    by = {r["codec"]: r for r in rows}
    assert list(by) == ["none", "lossless", "none+aes"]
    assert by["none"]["stored_ratio"] == 1.0 and by["none"]["vs_none"] == 1.0
    assert by["lossless"]["stored_ratio"] < 0.9
    assert by["none+aes"]["stored_ratio"] > 1.0  # the envelope and the tag
    assert all(r["samples"] == 3 and r["hit_ms"] > 0 and r["raw_read_ms"] > 0 for r in rows)
