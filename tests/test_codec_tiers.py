"""The codec stage inside the disk, Redis and Mooncake tiers (docs/codecs.md).

What every tier must do with its :class:`~lmprefetch.codec.ChunkStage`, checked on each of them
(the disk tier on real files, the Redis tier on a real ``redis-server``, the Mooncake tier on the
in-process fake of Mooncake's client; the real Mooncake in ``test_mooncake_tier.py``):

* every codec, with and without encryption, gives back the payload (lossless exactly; lossy
  within its error bound, with exactly the payload's length), and the tier counts the stored
  bytes, not the payload's;
* chunks written under one codec are read by a tier configured with another (``none``
  included: the passthrough recognises an encoded chunk);
* a stored chunk damaged at rest (a flipped bit, cut short, an unknown codec, sealed for another
  chunk key or tenant, plaintext where encryption is on, sealed where it is off) is a miss:
  the load stops before it, nothing wrong is handed out, the tier counts it and forgets it;
* the disk tier's capacity counts stored bytes.

Stored chunks are damaged *inside* the tier's own framing (a disk file's header and checksum,
a Redis value's), which is rebuilt around the damaged bytes: what reaches the codec stage is
exactly the damage.
"""

from __future__ import annotations

import random
import struct
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import trio

np = pytest.importorskip("numpy")
ml_dtypes = pytest.importorskip("ml_dtypes")
pytest.importorskip("zstandard")
pytest.importorskip("cryptography")

import xxhash  # noqa: E402

from lmprefetch.codec import ChunkStage, TenantCipher, get_codec, tenant_id  # noqa: E402
from lmprefetch.codec.format import HEADER  # noqa: E402
from lmprefetch.hashing import tenant_salt  # noqa: E402
from lmprefetch.keys import ChunkKey  # noqa: E402
from lmprefetch.memory import Arena  # noqa: E402
from lmprefetch.tiers import chunkfile  # noqa: E402
from lmprefetch.tiers.base import TenantTier  # noqa: E402
from lmprefetch.tiers.disk import open_disk_tier  # noqa: E402
from lmprefetch.tiers.mooncake import mooncake_key, open_mooncake_tier  # noqa: E402
from lmprefetch.tiers.redis import (  # noqa: E402
    decode_value,
    encode_value,
    open_redis_tier,
    redis_key,
    value_is_encoded,
)

from .mooncake_fake import FakePool  # noqa: E402
from .redis_servers import HAVE_REDIS, RedisServer, raw_client  # noqa: E402

LIMIT_S = 60.0
ELEMENTS = 16 * 1024  # bfloat16 values per chunk
SLOT_BYTES = 2 * ELEMENTS
MASTER = bytes(range(32))
OTHER_MASTER = bytes(range(1, 33))
ALICE = tenant_id(tenant_salt("alice"))
BOB = tenant_id(tenant_salt("bob"))

redis_marks = [
    pytest.mark.redis,
    pytest.mark.skipif(not HAVE_REDIS, reason="redis-server / redis-cli not on PATH"),
]
KINDS = ["disk", pytest.param("redis", marks=redis_marks), "mooncake"]


def key(h: int) -> ChunkKey:
    return ChunkKey("codec-tiers", 1, 0, h, "bfloat16")


def kv_payload(seed: int, elements: int = ELEMENTS) -> bytes:
    """bfloat16 values shaped like attention KV: normal, a few larger outliers."""
    rng = np.random.default_rng(seed)
    values = rng.standard_normal(elements).astype(np.float32)
    values[rng.integers(0, elements, elements // 64)] *= 8
    return values.astype(ml_dtypes.bfloat16).tobytes()


def as_float(payload: bytes) -> Any:
    return np.frombuffer(payload, dtype=ml_dtypes.bfloat16).astype(np.float32)


def stage(codec: str = "none", master: bytes | None = None) -> ChunkStage:
    cipher = None if master is None else TenantCipher(master)
    return ChunkStage(get_codec(codec, dtype="bfloat16"), cipher)


# -- the tiers, and reaching around them to their stored bytes ---------------------------------
@dataclass
class Place:
    """Where a tier of one kind keeps its chunks: tiers opened on the same place share them."""

    kind: str
    path: Path
    url: str | None = None
    pool: FakePool = field(default_factory=FakePool)
    #: What the framing of each chunk read by :meth:`stored` said (encoded or not).
    encoded: dict[ChunkKey, bool] = field(default_factory=dict)

    def stored(self, k: ChunkKey) -> bytes | None:
        """The bytes the tier's codec stage produced for ``k`` (inside the tier's framing)."""
        if self.kind == "disk":
            try:
                data = (self.path / f"{k.to_string()}.kv").read_bytes()
            except FileNotFoundError:
                return None
            self.encoded[k] = chunkfile.HEADER.unpack_from(data)[1] == chunkfile.VERSION_ENCODED
            return data[chunkfile.HEADER_BYTES :]
        if self.kind == "redis":
            assert self.url is not None
            with raw_client(self.url) as client:
                raw = client.get(redis_key(k))
            if raw is None:
                return None
            payload = decode_value(raw)
            assert payload is not None
            self.encoded[k] = value_is_encoded(raw)
            return bytes(payload)
        return self.pool.objects.get(mooncake_key(k))

    def replace(self, k: ChunkKey, stored: bytes, like: ChunkKey | None = None) -> None:
        """Put ``stored`` under ``k`` inside valid framing (a tier reads exactly those bytes),
        framed as the chunk ``like`` (by default ``k``) was: encoded or not."""
        encoded = self.encoded.get(like or k, False)
        if self.kind == "disk":
            final = str(self.path / f"{k.to_string()}.kv")
            chunkfile.write_file(
                final, final + ".tmp", k.to_string().encode(), memoryview(stored), encoded=encoded
            )
        elif self.kind == "redis":
            assert self.url is not None
            with raw_client(self.url) as client:
                client.set(redis_key(k), encode_value(stored, encoded=encoded))
        else:
            self.pool.objects[mooncake_key(k)] = bytes(stored)

    def dump(self) -> list[bytes]:
        """Everything the place holds (what an operator's dump or backup would show)."""
        if self.kind == "disk":
            return [p.read_bytes() for p in sorted(self.path.iterdir())]
        if self.kind == "redis":
            assert self.url is not None
            with raw_client(self.url) as client:
                return [client.get(name) for name in client.keys("*")]
        return list(self.pool.objects.values())


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if not HAVE_REDIS:
        pytest.skip("redis-server / redis-cli not on PATH")
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture(params=KINDS)
def place(request: pytest.FixtureRequest, tmp_path: Path) -> Place:
    kind: str = request.param
    url = None
    if kind == "redis":
        url = request.getfixturevalue("redis_url")
        with raw_client(url) as client:
            client.flushall()
    return Place(kind, tmp_path / "tier", url)


@asynccontextmanager
async def opened(place: Place, s: ChunkStage, arena: Arena) -> AsyncIterator[TenantTier]:
    tier: Any
    with trio.fail_after(LIMIT_S):
        if place.kind == "disk":
            async with open_disk_tier(
                str(place.path), capacity_bytes=1 << 26, read_threads=2, write_queue=64,
                o_direct=False, stage=s,
            ) as tier:  # fmt: skip
                yield tier
        elif place.kind == "redis":
            assert place.url is not None
            async with open_redis_tier(
                place.url, timeout_s=LIMIT_S / 4, threads=2, write_queue=64, stage=s
            ) as tier:
                yield tier
        else:
            async with open_mooncake_tier(
                "127.0.0.1:1", arena=arena, timeout_s=10.0, write_queue=64,
                store_factory=place.pool.factory(), stage=s,
            ) as tier:  # fmt: skip
                await tier.wait_connected()
                yield tier


@pytest.fixture
def arena() -> Iterator[Arena]:
    a = Arena(SLOT_BYTES, 32)
    yield a
    assert a.used_slots == 0, "a buffer reference was never released"
    a.close()


async def put(
    tier: TenantTier,
    arena: Arena,
    keys: Sequence[ChunkKey],
    payloads: Sequence[bytes],
    tenant: bytes = b"",
) -> None:
    for k, data in zip(keys, payloads, strict=True):
        buf = arena.allocate()
        assert buf is not None
        try:
            buf.write(data)
            assert tier.enqueue_write(k, buf, tenant=tenant)
        finally:
            buf.release()  # the tier keeps its own reference until written
    await tier.flush()  # type: ignore[attr-defined]


async def get(
    tier: TenantTier, arena: Arena, keys: Sequence[ChunkKey], tenant: bytes = b""
) -> list[bytes]:
    """The payloads of the contiguous prefix the tier loads (buffers released)."""
    bufs = arena.allocate_many(len(keys))
    try:
        n = await tier.load(keys, bufs, tenant=tenant)
        return [bytes(b.view()) for b in bufs[:n]]
    finally:
        for b in bufs:
            b.release()


# -- every codec through every tier --------------------------------------------------------
#: The largest error of each codec on one value, relative to its group's largest magnitude.
LOSSY_BOUND = {"bitround3": 2**-4, "fp8": 2**-3, "int8": 2**-7, "int4": 2**-3}


@pytest.mark.parametrize("sealed", [False, True], ids=["plain", "sealed"])
@pytest.mark.parametrize("codec", ["none", "lossless", "bitround3", "fp8", "int8", "int4"])
async def test_every_codec_round_trips_through_the_tier(
    place: Place, arena: Arena, codec: str, sealed: bool
) -> None:
    keys = [key(i) for i in range(4)]
    payloads = [kv_payload(i) for i in range(4)]
    payloads[3] = payloads[3][:1000]  # a partial chunk
    async with opened(place, stage(codec, MASTER if sealed else None), arena) as tier:
        await put(tier, arena, keys, payloads, ALICE)
        got = await get(tier, arena, keys, ALICE)
        stats = tier.stats
    assert len(got) == 4
    assert [len(g) for g in got] == [len(p) for p in payloads]
    if codec in ("none", "lossless"):
        assert got == payloads
    else:
        for original, back in zip(payloads, got, strict=True):
            x, y = as_float(original), as_float(back)
            scale = np.abs(x).reshape(-1, 2).max()  # never below the group's largest
            assert np.max(np.abs(x - y)) <= LOSSY_BOUND[codec] * max(scale, 1.0) * 2
            assert not np.array_equal(x, y)  # the codec did change the values
    raw = sum(len(p) for p in payloads)
    assert stats.bytes_stored == stats.bytes_loaded == raw
    passthrough = codec == "none" and not sealed
    if passthrough:
        assert stats.encoded_bytes_stored == stats.encoded_bytes_loaded == raw
        assert stats.decode_seconds == 0 and stats.decode_bytes_per_s_ewma is None
    else:
        assert stats.encoded_bytes_stored == stats.encoded_bytes_loaded
        assert stats.decode_seconds > 0 and stats.decode_bytes_per_s_ewma is not None
        assert stats.encode_seconds > 0
        if codec != "none":  # KV-like bfloat16 shrinks under every codec
            assert stats.encoded_bytes_stored < 0.9 * raw
    assert stats.codec_misses == 0


async def test_stored_chunks_hold_no_plaintext_with_encryption_on(
    place: Place, arena: Arena
) -> None:
    """A dump of the store (files, Redis values, Mooncake objects) shows no payload's bytes:
    neither under ``none`` (sealed as they are) nor under ``lossless``."""
    payloads = [kv_payload(i) for i in range(3)]
    async with opened(place, stage("none", MASTER), arena) as tier:
        await put(tier, arena, [key(i) for i in range(3)], payloads, ALICE)
    async with opened(place, stage("lossless", MASTER), arena) as tier:
        await put(tier, arena, [key(10 + i) for i in range(3)], payloads, BOB)
    dump = place.dump()
    assert len(dump) >= 6
    for data in payloads:
        for start in range(0, len(data) - 64, 4096):
            window = data[start : start + 32]
            assert all(window not in stored for stored in dump)
    # (The same check finds the plaintext when encryption is off: it can fail.)
    async with opened(place, stage("none"), arena) as tier:
        await put(tier, arena, [key(20)], payloads[:1])
    assert any(payloads[0][:32] in stored for stored in place.dump())


# -- chunks written under one codec, read under another ----------------------------------------
@pytest.mark.parametrize(
    ("writer", "reader"),
    [
        ("lossless", "none"),
        ("none", "lossless"),
        ("int8", "none"),
        ("bitround3", "lossless"),
        ("lossless", "fp8"),
    ],
)
async def test_chunks_written_with_another_codec_stay_readable(
    place: Place, arena: Arena, writer: str, reader: str
) -> None:
    keys = [key(i) for i in range(3)]
    payloads = [kv_payload(100 + i) for i in range(3)]
    async with opened(place, stage(writer), arena) as tier:
        await put(tier, arena, keys, payloads)
        expected = await get(tier, arena, keys)
    assert len(expected) == 3
    async with opened(place, stage(reader), arena) as tier:
        assert await get(tier, arena, keys) == expected
        assert tier.stats.codec_misses == 0
        assert tier.stats.decode_seconds > 0 or writer == "none"


# -- damaged, unknown and foreign chunks are misses ---------------------------------------------
def flip_bit(blob: bytes, rng: random.Random) -> bytes:
    data = bytearray(blob)
    data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    return bytes(data)


def unknown_codec(blob: bytes) -> bytes:
    """``blob`` (an encoded chunk) with a codec id this reader does not know, its checksum
    made right again: well-formed, from a newer writer."""
    fields = list(HEADER.unpack_from(blob))
    fields[2] = 200
    head = HEADER.pack(*fields)[: HEADER.size - 8]
    digest = xxhash.xxh3_64(head)
    digest.update(blob[HEADER.size :])
    return head + struct.pack("<Q", digest.intdigest()) + blob[HEADER.size :]


Damage = Callable[[bytes, bytes, random.Random], bytes]
#: How a chunk at rest is damaged: (name, writer's codec, sealed, damage(stored, other chunk's
#: stored bytes, rng)).
DAMAGES: list[tuple[str, str, bool, Damage]] = [
    ("flipped bit", "lossless", False, lambda b, _o, r: flip_bit(b, r)),
    ("flipped bit, sealed", "none", True, lambda b, _o, r: flip_bit(b, r)),
    ("cut short", "lossless", False, lambda b, _o, r: b[: r.randrange(1, len(b))]),
    ("cut short, sealed", "lossless", True, lambda b, _o, r: b[: r.randrange(1, len(b))]),
    ("bytes appended", "int4", False, lambda b, _o, _r: b + b"\0" * 16),
    ("unknown codec", "lossless", False, lambda b, _o, _r: unknown_codec(b)),
    ("another chunk's, sealed", "lossless", True, lambda _b, o, _r: o),
]


@pytest.mark.parametrize("reader", ["same", "none"])
@pytest.mark.parametrize(
    ("name", "codec", "sealed", "damage"), DAMAGES, ids=[d[0] for d in DAMAGES]
)
async def test_a_damaged_chunk_is_a_miss_never_wrong_bytes(
    place: Place,
    arena: Arena,
    name: str,
    codec: str,
    sealed: bool,
    damage: Damage,
    reader: str,
) -> None:
    if sealed and reader == "none":
        reader = "same"  # a reader without the key misses every sealed chunk: tested below
    keys = [key(i) for i in range(4)]
    payloads = [kv_payload(200 + i) for i in range(4)]
    rng = random.Random(f"{name}-{reader}")
    writer_stage = stage(codec, MASTER if sealed else None)
    async with opened(place, writer_stage, arena) as tier:
        await put(tier, arena, keys, payloads, ALICE)
        good = await get(tier, arena, keys, ALICE)
    assert len(good) == 4
    stored = place.stored(keys[2])
    other = place.stored(keys[3])
    assert stored is not None and other is not None
    place.replace(keys[2], damage(stored, other, rng))
    reader_stage = writer_stage if reader == "same" else stage("none")
    async with opened(place, reader_stage, arena) as tier:
        got = await get(tier, arena, keys, ALICE)
        assert got == good[:2]  # the prefix before the damage, exact; nothing past it
        assert tier.stats.codec_misses == 1
        # A miss from now on: the disk file and the Redis value are gone, the Mooncake key is
        # refused (its object is immutable) until the writer replaces it.
        assert await tier.contains_prefix(keys, pin=False) == 2
        if place.kind != "mooncake":
            assert place.stored(keys[2]) is None
        await put(tier, arena, keys[2:3], payloads[2:3], ALICE)
        rewritten = good[2] if reader == "same" else payloads[2]  # (through its own codec)
        assert await get(tier, arena, keys, ALICE) == [*good[:2], rewritten, good[3]]
        assert tier.stats.codec_misses == 1


@pytest.mark.parametrize(
    ("writer", "reader", "tenant"),
    [
        ((MASTER, "lossless"), (MASTER, "lossless"), BOB),  # another tenant's key
        ((MASTER, "none"), (MASTER, "none"), b""),  # the shared name space's key
        ((MASTER, "lossless"), (OTHER_MASTER, "lossless"), ALICE),  # another master key
        ((MASTER, "none"), (None, "none"), ALICE),  # no key here: sealed chunks are misses
        ((None, "lossless"), (MASTER, "lossless"), ALICE),  # plaintext where encryption is on
        ((None, "none"), (MASTER, "none"), ALICE),
    ],
    ids=["other-tenant", "shared-space", "other-master", "no-key", "plain-lossless", "plain-raw"],
)
async def test_a_chunk_not_sealed_for_this_tenant_here_is_a_miss(
    place: Place,
    arena: Arena,
    writer: tuple[bytes | None, str],
    reader: tuple[bytes | None, str],
    tenant: bytes,
) -> None:
    keys = [key(i) for i in range(3)]
    payloads = [kv_payload(300 + i) for i in range(3)]
    async with opened(place, stage(writer[1], writer[0]), arena) as tier:
        await put(tier, arena, keys, payloads, ALICE)
        assert await get(tier, arena, keys, ALICE) == payloads
    reader_stage = stage(reader[1], reader[0])
    async with opened(place, reader_stage, arena) as tier:
        assert await get(tier, arena, keys, tenant) == []
        assert tier.stats.bytes_loaded == 0
        if place.kind == "mooncake" and reader_stage.passthrough:
            # A sealed object is larger than the slot the passthrough gets it into: Mooncake
            # refuses the get itself (a miss that stays, as any object too large).
            assert tier.stats.codec_misses == 0
        else:
            assert tier.stats.codec_misses == 1


async def test_a_sealed_chunk_moved_under_another_key_is_a_miss(place: Place, arena: Arena) -> None:
    """Tenants' chunks exchanged at rest (each under the other's key): neither opens, and
    nothing of the other tenant's is handed out."""
    s = stage("lossless", MASTER)
    a, b = key(1), key(2)
    pa, pb = kv_payload(401), kv_payload(402)
    async with opened(place, s, arena) as tier:
        await put(tier, arena, [a], [pa], ALICE)
        await put(tier, arena, [b], [pb], BOB)
    sa, sb = place.stored(a), place.stored(b)
    assert sa is not None and sb is not None
    place.replace(a, sb, like=b)
    place.replace(b, sa, like=a)
    async with opened(place, s, arena) as tier:
        for k, tenant in ((a, ALICE), (a, BOB), (b, BOB), (b, ALICE)):
            assert await get(tier, arena, [k], tenant) == []
        assert tier.stats.codec_misses >= 2


# -- disk accounting ---------------------------------------------------------------------------
def file_size(path: Path) -> int:
    return path.stat().st_size


async def test_the_disk_tier_counts_stored_bytes(tmp_path: Path, arena: Arena) -> None:
    """The index, ``capacity_bytes`` and eviction count a chunk's file as stored: a capacity
    that holds three raw chunks holds more encoded ones (and the index survives a restart)."""
    path = tmp_path / "disk"
    payloads = [kv_payload(500 + i) for i in range(6)]
    keys = [key(i) for i in range(6)]
    capacity = 3 * (chunkfile.HEADER_BYTES + SLOT_BYTES) + 100

    async def fill(codec: str) -> tuple[int, int, list[int]]:
        for f in path.glob("*"):
            f.unlink()
        async with open_disk_tier(
            str(path), capacity_bytes=capacity, read_threads=1, write_queue=64, o_direct=False,
            stage=stage(codec),
        ) as disk:  # fmt: skip
            await put(disk, arena, keys, payloads)
            sizes = [file_size(path / f"{k.to_string()}.kv") for k in keys if k in disk]
            assert disk.used_bytes == sum(sizes) <= capacity
            assert disk.stats.chunks_stored == len(keys)
            return len(disk), disk.used_bytes, sizes

    raw_count, _, _ = await fill("none")
    packed_count, used, sizes = await fill("lossless")
    assert raw_count == 3
    assert packed_count > raw_count
    assert all(size < chunkfile.HEADER_BYTES + SLOT_BYTES for size in sizes)
    async with open_disk_tier(
        str(path), capacity_bytes=capacity, read_threads=1, write_queue=64, o_direct=False,
        stage=stage("none"),
    ) as disk:  # fmt: skip
        assert disk.used_bytes == used  # rebuilt from the files' sizes
        got = await get(disk, arena, keys[-packed_count:])
        assert got == payloads[-packed_count:]


async def test_a_disk_file_too_large_for_the_slot_is_kept(tmp_path: Path, arena: Arena) -> None:
    """The passthrough reads a file into the slot; a stored chunk larger than the slot (raw
    payload of another engine's larger chunks) is a miss that leaves the file, as before."""
    path = tmp_path / "disk"
    big = Arena(2 * SLOT_BYTES, 2)
    try:
        async with open_disk_tier(
            str(path), capacity_bytes=1 << 24, read_threads=1, write_queue=4, o_direct=False
        ) as disk:
            buf = big.allocate()
            assert buf is not None
            buf.write(kv_payload(600, ELEMENTS * 2))
            disk.enqueue_write(key(1), buf)
            buf.release()
            await disk.flush()
            assert await get(disk, arena, [key(1)]) == []
            assert key(1) in disk and disk.stats.codec_misses == 0
    finally:
        big.close()


async def test_the_tiers_framing_says_what_it_holds(place: Place, arena: Arena) -> None:
    """A disk file's format version and a Redis value's magic record whether the codec stage
    encoded what follows: a release that predates codecs then takes an encoded chunk for a
    damaged one (a miss), never for a payload; and a payload stored as it is is read as it
    is, even one that starts like an encoded chunk (Mooncake, with no framing of its own, can
    only tell by those bytes: that one is a miss there, never wrong bytes)."""
    lookalike = b"LKVC" + bytes(range(200)) * 10
    payload = kv_payload(700)
    async with opened(place, stage("none"), arena) as tier:
        await put(tier, arena, [key(1), key(2)], [lookalike, payload])
        got = await get(tier, arena, [key(1), key(2)])
    assert got == ([] if place.kind == "mooncake" else [lookalike, payload])
    async with opened(place, stage("lossless"), arena) as tier:
        await put(tier, arena, [key(3)], [payload])
    for k, encoded in ((key(2), False), (key(3), True)):
        assert place.stored(k) is not None
        if place.kind != "mooncake":
            assert place.encoded[k] is encoded
    if place.kind == "disk":
        header = (place.path / f"{key(3).to_string()}.kv").read_bytes()[:12]
        assert chunkfile.HEADER.unpack_from(header + bytes(36))[1] == 2  # version 2
    elif place.kind == "redis":
        assert place.url is not None
        with raw_client(place.url) as client:
            assert client.get(redis_key(key(3)))[:4] == b"LMP\x02"
            assert client.get(redis_key(key(2)))[:4] == b"LMP\x01"
