"""KV events: the tracker's exactly-once rule on every path a chunk takes onto and off a tier,
the worker's published stream (eviction, restart), and the ``lmprefetch worker`` command.

Every stream is replayed by :class:`Ledger`, which fails on a second ``BlockStored`` for blocks
already announced on a medium or a ``BlockRemoved`` for blocks not announced there; after each
step the blocks the ledger holds must be exactly what the tiers hold.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import trio
import zmq

from lmprefetch import ChunkHasher, PrefetchConfig, WorkerRuntime, open_engine
from lmprefetch.events import (
    LOCAL,
    MEDIUM_CPU,
    MEDIUM_STORAGE,
    OWNERSHIP,
    REMOTE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ChunkBlocks,
    KVEvent,
    KVEventBatch,
    KVEventTracker,
    RankEventMerger,
    decode_batch,
    encode_batch,
)
from lmprefetch.keys import ChunkKey, KeyMaker
from lmprefetch.prefetch import Engine

from .redis_servers import HAVE_REDIS, RedisServer, raw_client, redis_server_fixture  # noqa: F401

ROOT = Path(__file__).resolve().parent.parent
DEADLINE_S = 30
CHUNK = 4
CHUNK_BYTES = 64

Ident = tuple[Any, ...]


class Ledger:
    """What a subscriber believes, built from the stream; fails on any repeated transition."""

    def __init__(self) -> None:
        self.present: dict[Ident, BlockStored] = {}
        self.cleared = 0
        self.stored = 0
        self.removed = 0

    def feed(self, events: Iterable[KVEvent]) -> None:
        for ev in events:
            if isinstance(ev, AllBlocksCleared):
                self.present.clear()
                self.cleared += 1
                continue
            assert ev.ownership == OWNERSHIP
            ident = (ev.medium, ev.locality, tuple(ev.block_hashes))
            if isinstance(ev, BlockStored):
                assert ident not in self.present, f"stored twice without a removal: {ident}"
                self.present[ident] = ev
                self.stored += 1
            else:
                assert ident in self.present, f"removed but not announced: {ident}"
                del self.present[ident]
                self.removed += 1

    def on(self, medium: str, locality: str | None) -> set[int]:
        """Chunk hashes announced on a medium (chunks named by their hash: one block each)."""
        out = set()
        for m, loc, hashes in self.present:
            if (m, loc) == (medium, locality):
                assert len(hashes) == 1
                out.add(hashes[0])
        return out


def tokens(n: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 997 + 3 for i in range(n)]


def payloads(n: int, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(CHUNK_BYTES) for _ in range(n)]


def config(tmp_path: Path | None = None, **overrides: Any) -> PrefetchConfig:
    fields: dict[str, Any] = {
        "chunk_size": CHUNK,
        "chunk_bytes": CHUNK_BYTES,
        "cpu_bytes": CHUNK_BYTES * 8,
        "claim_ttl_s": 60.0,
    }
    if tmp_path is not None:
        fields["disk_path"] = str(tmp_path / "disk")
    fields.update(overrides)
    return PrefetchConfig(**fields)


def hashes_on(engine: Engine, tier_name: str) -> set[int]:
    (tier,) = [t for t in engine.tiers if t.name == tier_name]
    held: list[ChunkKey] = tier.keys()  # type: ignore[attr-defined]
    return {k.chunk_hash for k in held}


def check_matches_tiers(ledger: Ledger, engine: Engine) -> None:
    ledger.feed(engine.take_kv_events())
    assert ledger.on(MEDIUM_CPU, LOCAL) == hashes_on(engine, "cpu")
    if engine.config.disk_path is not None:
        assert ledger.on(MEDIUM_STORAGE, LOCAL) == hashes_on(engine, "disk")


# -- the tracker on its own ----------------------------------------------------------------
def tracker(mode: str = "chunks", *, layers: int = 1, max_pending: int = 1000) -> KVEventTracker:
    keys = KeyMaker("m", 1, 0, "bfloat16", layerwise=layers > 1, num_layers=layers)
    return KVEventTracker(
        keys,
        chunk_size=CHUNK,
        mode=mode,
        max_pending=max_pending,
        orphan_limit=2,  # type: ignore[arg-type]
    )


def key(h: int, layer: int = -1, *, model: str = "m", rank: int = 0) -> ChunkKey:
    return ChunkKey(model, 1, rank, h, "bfloat16", layer)


async def test_repeats_and_unknown_keys_make_no_events() -> None:
    t = tracker()
    t.stored("cpu", key(1))
    t.stored("cpu", key(1))  # a repeat
    t.removed("cpu", key(2))  # never stored
    t.stored("cpu", key(3, model="other"))  # another model's file in a shared directory
    t.stored("disk", key(4, rank=5))  # another rank's
    t.removed("cpu", key(1))
    t.removed("cpu", key(1))  # a repeat
    events = t.take()
    assert [type(e) for e in events] == [BlockStored, BlockRemoved]
    assert events[0].block_hashes == [1] and events[1].block_hashes == [1]
    assert (events[0].medium, events[0].locality, events[0].block_size) == (MEDIUM_CPU, LOCAL, 4)
    assert t.take() == []
    # Stored again after its removal: announced again, once.
    t.stored("cpu", key(1))
    assert [type(e) for e in t.take()] == [BlockStored]


async def test_layerwise_chunk_is_on_a_tier_when_every_layer_is() -> None:
    t = tracker(layers=3)
    for layer in range(3):
        assert t.take() == []
        t.stored("disk", key(7, layer))
    [stored] = t.take()
    assert isinstance(stored, BlockStored) and stored.medium == MEDIUM_STORAGE
    t.removed("disk", key(7, 1))  # one layer gone: the chunk cannot be loaded any more
    [removed] = t.take()
    assert isinstance(removed, BlockRemoved)
    t.removed("disk", key(7, 0))
    t.removed("disk", key(7, 2))
    assert t.take() == []
    # Back on the tier, layer by layer: announced again once complete.
    for layer in range(3):
        t.stored("disk", key(7, layer))
    assert [type(e) for e in t.take()] == [BlockStored]


async def test_described_mode_announces_named_chunks_only_and_late_names_announce() -> None:
    t = tracker("described")
    t.stored("disk", key(1))  # e.g. a disk chunk from before a restart
    t.stored("cpu", key(1))
    assert t.take() == []
    blocks = ChunkBlocks.make([b"\x01" * 32, b"\x02" * 32], 2, token_ids=[5, 6, 7, 8])
    t.describe(1, blocks)  # a request loaded it: now it has a name
    events = t.take()
    assert {(e.medium, e.locality) for e in events} == {
        (MEDIUM_CPU, LOCAL),
        (MEDIUM_STORAGE, LOCAL),
    }
    for e in events:
        assert isinstance(e, BlockStored)
        assert e.block_hashes == [b"\x01" * 32, b"\x02" * 32]
        assert e.token_ids == [5, 6, 7, 8] and e.block_size == 2
    t.describe(1, blocks)  # naming it again announces nothing new
    assert t.take() == []
    t.removed("cpu", key(1))
    [removed] = t.take()
    assert isinstance(removed, BlockRemoved)
    assert removed.block_hashes == [b"\x01" * 32, b"\x02" * 32] and removed.medium == MEDIUM_CPU
    # A chunk never named is never announced, so its removal says nothing either.
    t.stored("cpu", key(9))
    t.removed("cpu", key(9))
    assert t.take() == []


async def test_names_of_chunks_on_no_tier_are_bounded() -> None:
    t = tracker("described")  # orphan_limit=2
    for h in (1, 2, 3):
        t.describe(h, ChunkBlocks.make([h * 10], CHUNK))
    # 1 was forgotten (the oldest name of a chunk on no tier); 2 and 3 are kept for a late
    # write-behind.
    for h in (1, 2, 3):
        t.stored("disk", key(h))
    assert sorted(e.block_hashes[0] for e in t.take()) == [20, 30]


async def test_a_full_queue_drops_and_counts() -> None:
    t = tracker(max_pending=2)
    for h in range(5):
        t.stored("cpu", key(h))
    assert len(t.take()) == 2
    assert t.statistics().dropped == 3


def test_rank_merger_announces_what_every_rank_holds() -> None:
    m = RankEventMerger(2)

    def stored(h: int) -> BlockStored:
        return BlockStored([h], None, [], 4, None, MEDIUM_CPU, None, locality=LOCAL)

    def removed(h: int) -> BlockRemoved:
        return BlockRemoved([h], MEDIUM_CPU, locality=LOCAL)

    m.add(0, stored(1))
    assert m.take() == []  # rank 1 does not have it yet: a lookup would answer 0
    m.add(0, stored(1))  # a repeat
    m.add(1, stored(1))
    assert m.take() == [stored(1)]
    m.add(1, removed(1))
    assert m.take() == [removed(1)]  # the first rank to drop it ends the hit
    m.add(0, removed(1))
    assert m.take() == []
    m.add(1, stored(1))
    m.add(0, stored(1))
    assert m.take() == [stored(1)]
    m.add(0, removed(2))  # never stored
    assert m.take() == []
    single = RankEventMerger(1)
    single.add(0, stored(3))
    single.add(0, removed(3))
    assert single.take() == [stored(3), removed(3)]


def test_batches_encode_as_vllm_expects_and_round_trip() -> None:
    batch = KVEventBatch(
        ts=1.5,
        events=[
            AllBlocksCleared(),
            BlockStored([1, 2], None, [3, 4], 2, None, MEDIUM_CPU, None, ownership=OWNERSHIP),
            BlockRemoved([b"\x00" * 32], MEDIUM_STORAGE, locality=REMOTE),
        ],
    )
    raw = encode_batch(batch)
    assert decode_batch(raw) == batch
    # An array [ts, events, data_parallel_rank] (as vLLM's), events as maps tagged "type".
    plain = msgspec.msgpack.decode(raw)
    assert plain[0] == 1.5 and plain[2] is None
    assert plain[1][0] == {"type": "AllBlocksCleared"}
    assert plain[1][1]["type"] == "BlockStored" and plain[1][1]["block_hashes"] == [1, 2]


# -- the engine: every path on and off a tier --------------------------------------------------
async def test_cpu_eviction_discard_and_close_each_emit_once(tmp_path: Path) -> None:
    ledger = Ledger()
    with trio.fail_after(DEADLINE_S):
        async with open_engine(config(cpu_bytes=CHUNK_BYTES * 4), kv_events="chunks") as engine:
            ledger.feed(engine.take_kv_events())
            assert ledger.cleared == 1  # the stream starts with AllBlocksCleared
            for seed in range(6):  # six one-chunk prompts through a four-slot CPU tier
                assert await engine.store(tokens(CHUNK, seed), payloads(1, seed)) == 1
                check_matches_tiers(ledger, engine)
            assert ledger.removed == 2  # two LRU evictions
            first = next(iter(hashes_on(engine, "cpu")))
            stored = ledger.present[(MEDIUM_CPU, LOCAL, (first,))]
            assert stored.block_size == CHUNK and len(stored.token_ids) == CHUNK
            engine.cpu.discard(engine.keys.first_key(first))
            engine.cpu.discard(engine.keys.first_key(first))  # gone already
            check_matches_tiers(ledger, engine)
            assert ledger.removed == 3
        # Closing drops the CPU tier: one removal per chunk it held.
        ledger.feed(engine.take_kv_events())
        assert ledger.on(MEDIUM_CPU, LOCAL) == set()
        assert ledger.removed == 6


async def test_disk_write_eviction_removal_missing_and_corrupt_each_emit_once(
    tmp_path: Path,
) -> None:
    file_bytes = 4096 + CHUNK_BYTES  # header + payload
    cfg = config(tmp_path, disk_bytes=3 * file_bytes)
    ledger = Ledger()
    hasher = ChunkHasher(CHUNK)
    with trio.fail_after(DEADLINE_S):
        async with open_engine(cfg, kv_events="chunks") as engine:
            for seed in range(5):  # five chunks through a three-file disk tier
                await engine.store(tokens(CHUNK, seed), payloads(1, seed))
                await engine.flush()
                check_matches_tiers(ledger, engine)
            on_disk = sorted(hashes_on(engine, "disk"))
            assert len(on_disk) == 3
            assert ledger.removed == 2  # two files evicted to make room
            (disk,) = [t for t in engine.tiers if t.name == "disk"]
            # Removed through the tier:
            assert await disk.remove(engine.keys.first_key(on_disk[0]))
            assert not await disk.remove(engine.keys.first_key(on_disk[0]))
            check_matches_tiers(ledger, engine)
            # A file deleted behind the tier's back, then a lookup that reads it:
            victim = engine.keys.first_key(on_disk[1])
            engine.cpu.discard(victim)  # so the lookup goes to disk
            await trio.Path(cfg.disk_path or "", victim.to_string() + ".kv").unlink()
            check_matches_tiers(ledger, engine)  # the index does not know yet
            seed = next(s for s in range(5) if hasher.hash(tokens(CHUNK, s))[0] == on_disk[1])
            h = hasher.hash(tokens(CHUNK, seed))
            assert await engine.lookup_and_prefetch("gone", h, [CHUNK]) == 0
            check_matches_tiers(ledger, engine)
            # A corrupt file, found by a lookup:
            victim = engine.keys.first_key(on_disk[2])
            engine.cpu.discard(victim)
            path = trio.Path(cfg.disk_path or "", victim.to_string() + ".kv")
            data = bytearray(await path.read_bytes())
            data[-1] ^= 0xFF
            await path.write_bytes(bytes(data))
            assert await engine.lookup_and_prefetch("bad", [on_disk[2]], [CHUNK]) == 0
            check_matches_tiers(ledger, engine)
            assert hashes_on(engine, "disk") == set()
            assert engine.statistics().kv_events.dropped == 0


async def test_random_operations_keep_the_stream_equal_to_the_tiers(tmp_path: Path) -> None:
    """Stores, lookups (disk loads evict CPU entries to make room), claims, removals, files
    deleted or corrupted behind the tier's back, in a seeded random order: after each step the
    stream (checked for repeats) describes exactly what the tiers hold."""
    file_bytes = 4096 + CHUNK_BYTES
    cfg = config(tmp_path, cpu_bytes=CHUNK_BYTES * 6, disk_bytes=5 * file_bytes)
    rng = random.Random(20240601)
    hasher = ChunkHasher(CHUNK)
    prompts = [tokens(CHUNK * rng.randint(1, 3), seed) for seed in range(10)]
    ledger = Ledger()
    with trio.fail_after(DEADLINE_S * 2):
        async with open_engine(cfg, kv_events="chunks") as engine:
            (disk,) = [t for t in engine.tiers if t.name == "disk"]
            for step in range(150):
                op = rng.choice(["store", "store", "lookup", "lookup", "remove", "unlink",
                                 "discard"])  # fmt: skip
                toks = rng.choice(prompts)
                h = hasher.hash(toks)
                k = engine.keys.first_key(rng.choice(h))
                if op == "store":
                    await engine.store(toks, payloads(len(h), step))
                elif op == "lookup":
                    got = await engine.lookup_and_prefetch(f"l{step}", h, hasher.offsets(len(toks)))
                    with engine.claim(f"l{step}") as items:
                        assert len(items) * CHUNK == got
                elif op == "remove":
                    await disk.remove(k)
                elif op == "unlink":
                    path = trio.Path(cfg.disk_path or "", k.to_string() + ".kv")
                    if await path.exists():
                        await path.unlink()
                else:
                    engine.cpu.discard(k)
                await engine.flush()
                check_matches_tiers(ledger, engine)
            assert ledger.stored > 20 and ledger.removed > 10
            assert engine.is_idle()


async def test_restarted_engine_announces_its_disk_tier(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    with trio.fail_after(DEADLINE_S):
        async with open_engine(cfg, kv_events="chunks") as engine:
            for seed in range(3):
                await engine.store(tokens(2 * CHUNK, seed), payloads(2, seed))
            await engine.flush()
            stored = hashes_on(engine, "disk")
        async with open_engine(cfg, kv_events="chunks") as again:
            events = again.take_kv_events()
            assert isinstance(events[0], AllBlocksCleared)
            ledger = Ledger()
            ledger.feed(events)
            assert ledger.on(MEDIUM_STORAGE, LOCAL) == stored and len(stored) == 6
            for ev in events[1:]:
                # A chunk file keeps neither its tokens nor its parent: both unknown.
                assert isinstance(ev, BlockStored)
                assert ev.token_ids == [] and ev.parent_block_hash is None
        # Described mode (the vLLM connector) announces nothing until a chunk is named.
        async with open_engine(cfg, kv_events="described") as described:
            assert described.take_kv_events() == []
            h = next(iter(stored))
            described.describe_chunks([h], [ChunkBlocks.make([b"v" * 32], 16)])
            [ev] = described.take_kv_events()
            assert isinstance(ev, BlockStored) and ev.medium == MEDIUM_STORAGE
            assert ev.block_hashes == [b"v" * 32]


async def test_events_off_by_config_or_by_default(tmp_path: Path) -> None:
    async with open_engine(config(kv_events=False), kv_events="chunks") as engine:
        assert engine.kv_events is None
        await engine.store(tokens(CHUNK, 1), payloads(1, 1))
        assert engine.take_kv_events() == []
    async with open_engine(config()) as engine:
        assert engine.kv_events is None
        assert "events_stored" not in engine.stats()


@pytest.mark.redis
@pytest.mark.skipif(not HAVE_REDIS, reason="redis-server / redis-cli not on PATH")
async def test_redis_stores_and_removals_seen_by_this_engine(redis_server: RedisServer) -> None:
    cfg = config(redis_url=redis_server.url)
    ledger = Ledger()
    hasher = ChunkHasher(CHUNK)
    toks = tokens(3 * CHUNK, 4)
    h = hasher.hash(toks)
    with trio.fail_after(DEADLINE_S):
        async with open_engine(cfg, kv_events="chunks") as engine:
            (redis_tier,) = [t for t in engine.tiers if t.name == "redis"]
            await engine.store(toks, payloads(3, 4))
            await engine.flush()
            ledger.feed(engine.take_kv_events())
            assert ledger.on(MEDIUM_STORAGE, REMOTE) == set(h)
            # Removed through the tier:
            assert await redis_tier.remove(engine.keys.first_key(h[0]))
            ledger.feed(engine.take_kv_events())
            assert ledger.on(MEDIUM_STORAGE, REMOTE) == set(h[1:])
            # Evicted by Redis (here: deleted by someone else): learnt from the next probe.
            name = b"lmprefetch:" + engine.keys.first_key(h[1]).to_string().encode()
            with raw_client(redis_server.url) as client:
                assert client.delete(name) == 1
            for _ in range(2):  # the second probe finds the same hole: no second event
                for k in engine.keys.keys(h):
                    engine.cpu.discard(k)
                assert await redis_tier.contains_prefix(engine.keys.keys(h[1:]), pin=False) == 0
                ledger.feed(engine.take_kv_events())
            assert ledger.on(MEDIUM_STORAGE, REMOTE) == {h[2]}
            assert ledger.removed == 3 + 2  # two from Redis, three from the CPU discards
            # A corrupt value, found by a load (and deleted by the tier):
            name = b"lmprefetch:" + engine.keys.first_key(h[2]).to_string().encode()
            with raw_client(redis_server.url) as client:
                client.set(name, b"not a chunk")
            assert await engine.lookup_and_prefetch("bad", h[2:], [CHUNK]) == 0
            ledger.feed(engine.take_kv_events())
            assert ledger.on(MEDIUM_STORAGE, REMOTE) == set()
            assert ledger.removed == 3 + 3


# -- a worker's published stream --------------------------------------------------------------
class Subscriber:
    """A pyzmq SUB socket (the router's side) that decodes vLLM-format messages."""

    def __init__(self, endpoint: str, topic: bytes = b"") -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RECONNECT_IVL, 20)
        self.sock.setsockopt(zmq.SUBSCRIBE, topic)
        self.sock.connect(endpoint)
        self.topic = topic
        self.next_seq = 0

    def batch(self, timeout_s: float = DEADLINE_S) -> KVEventBatch:
        assert self.sock.poll(int(timeout_s * 1000)), "no KV event batch arrived"
        topic, seq, payload = self.sock.recv_multipart()
        assert topic == self.topic
        assert int.from_bytes(seq, "big") == self.next_seq
        self.next_seq += 1
        return decode_batch(payload)

    def until(self, ledger: Ledger, done: Any) -> None:
        """Feed batches to ``ledger`` until ``done(ledger)`` holds (each wait has a deadline)."""
        while not done(ledger):
            ledger.feed(self.batch().events)

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture
def subscriber() -> Iterator[Any]:
    made: list[Subscriber] = []

    def make(endpoint: str, topic: bytes = b"") -> Subscriber:
        made.append(Subscriber(endpoint, topic))
        return made[-1]

    yield make
    for s in made:
        s.close()


def test_worker_publishes_stores_evictions_and_its_disk_after_a_restart(
    tmp_path: Path, subscriber: Any
) -> None:
    """A router subscribed to a worker sees its CPU and disk stores and evictions; the worker
    restarts on the same endpoint, the router's socket reconnects by itself, and the restarted
    worker says AllBlocksCleared and then what its disk holds."""
    file_bytes = 4096 + CHUNK_BYTES
    cfg = config(tmp_path, cpu_bytes=CHUNK_BYTES * 4, disk_bytes=4 * file_bytes)
    endpoint = f"ipc://@lmp-events-{uuid.uuid4().hex[:12]}"  # the same name after the restart
    sub = subscriber(endpoint, b"kv")
    ledger = Ledger()
    with WorkerRuntime.start(cfg, events_endpoint=endpoint, events_topic="kv") as runtime:
        assert runtime.publisher is not None and runtime.publisher.endpoint == endpoint
        for seed in range(6):
            assert runtime.store(tokens(CHUNK, seed), payloads(1, seed)) == 1
            # A chunk waiting for its disk write holds its CPU slot: with 4 slots, the 5th
            # store could find none to evict if the writer were behind (a busy machine).
            runtime.call(runtime.engine.flush)
        cpu = hashes_on(runtime.engine, "cpu")
        disk = hashes_on(runtime.engine, "disk")
        assert len(cpu) == 4 and len(disk) == 4
        sub.until(
            ledger,
            lambda led: led.on(MEDIUM_CPU, LOCAL) == cpu and led.on(MEDIUM_STORAGE, LOCAL) == disk,
        )
        assert ledger.cleared == 1
        assert ledger.removed == 4  # two CPU and two disk evictions
        stats = runtime.statistics()
        events = stats.engine.kv_events
        assert events is not None and stats.publisher is not None
        assert stats.publisher.events_sent == events.stored + events.removed + 1
    sub.next_seq = 0  # a new publisher counts from 0
    with WorkerRuntime.start(cfg, events_endpoint=endpoint, events_topic="kv"):
        batch = sub.batch()
        assert isinstance(batch.events[0], AllBlocksCleared)
        ledger.feed(batch.events)
        sub.until(ledger, lambda led: led.on(MEDIUM_STORAGE, LOCAL) == disk)
        assert ledger.on(MEDIUM_CPU, LOCAL) == set()


def test_nothing_is_published_before_a_subscriber(tmp_path: Path, subscriber: Any) -> None:
    """Events wait for the first subscriber (a PUB socket would drop them): one that comes
    late still gets the stream from its first batch, AllBlocksCleared."""
    with WorkerRuntime.start(config(), events_endpoint="tcp://127.0.0.1:0") as runtime:
        assert runtime.store(tokens(2 * CHUNK, 1), payloads(2, 1)) == 2
        publisher = runtime.publisher
        assert publisher is not None
        assert runtime.statistics().publisher.batches_sent == 0
        assert not publisher.subscribed.is_set()
        sub = subscriber(publisher.endpoint)  # the port the OS picked
        batch = sub.batch()
        assert isinstance(batch.events[0], AllBlocksCleared)
        ledger = Ledger()
        ledger.feed(batch.events)
        sub.until(ledger, lambda led: len(led.on(MEDIUM_CPU, LOCAL)) == 2)


def test_events_endpoint_needs_events_on() -> None:
    with pytest.raises(ValueError, match="kv_events"):
        WorkerRuntime.start(config(kv_events=False), events_endpoint="ipc://@lmp-ev-off")


# -- the command --------------------------------------------------------------------------------
def test_worker_command_announces_its_disk_on_the_events_endpoint(
    tmp_path: Path, subscriber: Any
) -> None:
    cfg = config(tmp_path)
    with WorkerRuntime.start(cfg) as runtime:  # fill the disk tier, then stop
        for seed in range(2):
            runtime.store(tokens(2 * CHUNK, seed), payloads(2, seed))
        stored = hashes_on(runtime.engine, "cpu")
    toml = tmp_path / "worker.toml"
    toml.write_text(
        f"chunk_size = {CHUNK}\nchunk_bytes = {CHUNK_BYTES}\ncpu_bytes = {CHUNK_BYTES * 8}\n"
        f'disk_path = "{cfg.disk_path}"\n'
    )
    tag = uuid.uuid4().hex[:10]
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "lmprefetch", "worker", "--config", str(toml),
            "--request-endpoint", f"ipc://@lmp-evw-{tag}",
            "--response-endpoint", f"ipc://@lmp-evs-{tag}",
            "--events-endpoint", "tcp://127.0.0.1:0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        banner = proc.stdout.readline()  # printed once serving: it names the bound port
        assert "KV events on tcp://127.0.0.1:" in banner, banner
        endpoint = banner.rsplit(" ", 1)[-1].strip()
        sub = subscriber(endpoint)
        ledger = Ledger()
        batch = sub.batch()
        assert isinstance(batch.events[0], AllBlocksCleared)
        ledger.feed(batch.events)
        sub.until(ledger, lambda led: led.on(MEDIUM_STORAGE, LOCAL) == stored)
        assert len(stored) == 4
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=DEADLINE_S)
    assert proc.returncode == 0, err
