"""The rules every tier keeps (``lmprefetch/tiers/base.py``), checked on every tier.

One generic suite, parametrised over the CPU tier, the disk tier (real files in ``tmp_path``),
the Redis tier (a real ``redis-server``, standalone and a 3-node cluster), the Mooncake tier (a
real ``mooncake_master``, in a private network namespace; and on the in-process fake of
Mooncake's client, everywhere) and the fake tier the engine tests use:

* every async method is a checkpoint (``trio.testing.assert_checkpoints``);
* a probe or a load cancelled at any step of any of its tasks leaves no pin behind, and a
  cancel is not a miss (the chunks are still there afterwards);
* nothing writes into a buffer after ``load`` returned or raised: worker threads that write
  buffers are held at a gate, the load is cancelled (or not), the buffers are overwritten with
  a sentinel once ``load`` is done, the gate opens, every worker thread is waited for, and the
  sentinel must have survived;
* a load's count is contiguous from the first key: a hole in the middle (never stored, or
  deleted behind the tier's back between probe and load) ends it;
* pins and loads stay balanced under a seeded random workload checked against a model.

The ``*_sealed`` kinds run the disk, Redis and Mooncake (fake) tiers with a codec stage that
is not a passthrough (``lossless`` and encryption): their loads go through staging and decoding
threads, their writes through encoding, and every rule above must hold all the same.

Real-I/O tiers use the real clock under an outer ``fail_after``.
"""

from __future__ import annotations

import functools
import random
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
import trio
import trio.testing

from lmprefetch.codec import ChunkStage, TenantCipher, get_codec
from lmprefetch.keys import ChunkKey
from lmprefetch.memory import Arena, Buffer
from lmprefetch.policy import TierCost
from lmprefetch.tiers import chunkfile
from lmprefetch.tiers import mooncake as mooncake_module
from lmprefetch.tiers import redis as redis_module
from lmprefetch.tiers.base import Tier
from lmprefetch.tiers.cpu import CpuTier
from lmprefetch.tiers.disk import DiskTier, open_disk_tier
from lmprefetch.tiers.mooncake import MooncakeTier, open_mooncake_tier
from lmprefetch.tiers.redis import open_redis_tier, redis_key
from lmprefetch.tiers.remote import RemoteTier

from .checkpoints import Steps, Target, named, quiesce_threads
from .fakes import FakeTier
from .mooncake_fake import FakePool
from .mooncake_servers import MooncakeMaster, needs_mooncake
from .mooncake_servers import mooncake_master_fixture as mooncake_master_fixture
from .redis_servers import HAVE_REDIS, RedisCluster, RedisServer, raw_client
from .redis_servers import redis_cluster_fixture as redis_cluster_fixture
from .redis_servers import redis_cluster_module_fixture as redis_cluster_module_fixture
from .redis_servers import redis_server_fixture as redis_server_fixture

SLOT_BYTES = 16 * 1024
NUM_SLOTS = 96
LIMIT_S = 60.0
SENTINEL = 0xA5

T = TypeVar("T")

redis_marks = [
    pytest.mark.redis,
    pytest.mark.skipif(not HAVE_REDIS, reason="redis-server / redis-cli not on PATH"),
]
KINDS = [
    "cpu",
    "disk",
    "fake",
    pytest.param("redis", marks=redis_marks),
    pytest.param("redis_cluster", marks=redis_marks),
    pytest.param("mooncake", marks=needs_mooncake),
    "mooncake_fake",
    # The same tiers through a codec stage that is not a passthrough.
    "disk_sealed",
    pytest.param("redis_sealed", marks=redis_marks),
    pytest.param("mooncake_sealed", marks=needs_mooncake),
    "mooncake_fake_sealed",
]


def sealed_stage(kind: str) -> ChunkStage | None:
    """``lossless`` and encryption for the ``*_sealed`` kinds (``None``: payloads as they
    are)."""
    if not kind.endswith("_sealed"):
        return None
    return ChunkStage(get_codec("lossless", dtype="bfloat16"), TenantCipher(bytes(range(32))))


def key(h: int) -> ChunkKey:
    return ChunkKey("conformance", 1, 0, h, "bfloat16")


def payload(h: int) -> bytes:
    rng = random.Random(h)
    return rng.randbytes(rng.randrange(1, SLOT_BYTES + 1))


@dataclass
class Harness:
    """One tier under test, with what the suite needs to know about it."""

    kind: str
    tier: Tier
    arena: Arena
    path: Path | None = None
    url: str | None = None

    async def put(self, keys: Sequence[ChunkKey], data: Sequence[bytes] | None = None) -> None:
        """Store ``keys`` (``payload(key.chunk_hash)`` by default) so that they are loadable."""
        for i, k in enumerate(keys):
            buf = self.arena.allocate()
            assert buf is not None
            try:
                buf.write(payload(k.chunk_hash) if data is None else data[i])
                assert await self.tier.store(k, buf)
            finally:
                buf.release()  # a tier keeps its own reference (or copy)
        flush = getattr(self.tier, "flush", None)
        if flush is not None:
            await flush()

    async def delete_behind(self, k: ChunkKey) -> None:
        """Make ``k`` unloadable without telling the tier (its index may still list it)."""
        if isinstance(self.tier, CpuTier):
            self.tier.discard(k)
        elif isinstance(self.tier, DiskTier):
            assert self.path is not None
            await trio.Path(self.path / f"{k.to_string()}.kv").unlink()
        elif isinstance(self.tier, FakeTier):
            del self.tier.data[k]
        elif isinstance(self.tier, MooncakeTier):
            # The tier keeps no index: its own remove is as good as another engine's.  (It
            # waits out the lease a fresh put leaves on the object.)
            assert await self.tier.remove(k)
        else:
            assert self.url is not None
            await trio.to_thread.run_sync(raw_delete, self.url, redis_key(k))

    def load_buffers(self, n: int) -> list[Buffer]:
        bufs = self.arena.allocate_many(n)
        assert len(bufs) == n
        return bufs

    def gate(self, monkeypatch: pytest.MonkeyPatch) -> Gate | None:
        """Hold every worker thread that writes into a buffer at a gate (``None``: this tier
        writes buffers on the Trio thread only)."""
        gate = Gate()
        if isinstance(self.tier, DiskTier):
            # Inside the read, once the thread holds its view of the destination slot.
            monkeypatch.setattr(chunkfile, "_read_into", gate.wrap(chunkfile._read_into))
            return gate
        if self.kind.startswith("redis"):
            monkeypatch.setattr(redis_module, "_copy_into", gate.wrap(redis_module._copy_into))
            return gate
        if self.kind.startswith("mooncake"):  # the get-into thread writes the buffers
            monkeypatch.setattr(
                mooncake_module.calls, "get_into", gate.wrap(mooncake_module.calls.get_into)
            )
            return gate
        return None

    def resident_slots(self) -> int:
        """Arena slots the tier itself keeps (the CPU tier's cache)."""
        return len(self.tier) if isinstance(self.tier, CpuTier) else 0


class Gate:
    """Worker threads wait here before writing into a buffer, until :meth:`open`."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self._open = threading.Event()

    def wrap(self, func: Callable[..., T]) -> Callable[..., T]:
        @functools.wraps(func)
        def gated(*args: Any) -> T:
            self.entered.set()
            assert self._open.wait(LIMIT_S), "the gate never opened"
            return func(*args)

        return gated

    def open(self) -> None:
        self._open.set()


def raw_delete(url: str, name: bytes) -> None:
    with raw_client(url) as client:
        client.delete(name)


@pytest.fixture(params=KINDS)
def kind_and_url(request: pytest.FixtureRequest) -> tuple[str, str | None]:
    kind: str = request.param
    if kind in ("redis", "redis_sealed"):
        server: RedisServer = request.getfixturevalue("redis_server")
        return kind, server.url
    if kind == "redis_cluster":
        cluster: RedisCluster = request.getfixturevalue("redis_cluster")
        return kind, cluster.url
    if kind in ("mooncake", "mooncake_sealed"):
        master: MooncakeMaster = request.getfixturevalue("mooncake_master")
        return kind, master.address
    return kind, None


@pytest.fixture
def arena() -> Iterator[Arena]:
    a = Arena(SLOT_BYTES, NUM_SLOTS)
    yield a
    assert a.used_slots == 0, "a buffer reference was never released"
    a.close()


@asynccontextmanager
async def opened(kind: str, url: str | None, arena: Arena, path: Path) -> AsyncIterator[Harness]:
    with trio.fail_after(LIMIT_S):
        if kind == "cpu":
            cpu = CpuTier(arena)
            try:
                yield Harness(kind, cpu, arena)
            finally:
                await cpu.aclose()
        elif kind == "fake":
            yield Harness(kind, FakeTier(), arena)
        elif kind.startswith("disk"):
            async with open_disk_tier(
                str(path), capacity_bytes=1 << 26, read_threads=3, write_queue=256, o_direct=False,
                stage=sealed_stage(kind),
            ) as disk:  # fmt: skip
                yield Harness(kind, disk, arena, path=path)
        elif kind.startswith("mooncake"):
            real = kind in ("mooncake", "mooncake_sealed")
            async with open_mooncake_tier(
                url if real else "127.0.0.1:1",
                arena=arena,
                segment_bytes=(16 << 20) if real else 0,
                timeout_s=10.0,  # the longest the tier allows; Mooncake's own are set apart
                write_queue=256,
                store_factory=None if real else FakePool().factory(),
                stage=sealed_stage(kind),
            ) as mooncake:
                await mooncake.wait_connected()
                yield Harness(kind, mooncake, arena, url=url)
        else:
            assert url is not None
            async with open_redis_tier(
                url, timeout_s=LIMIT_S / 4, threads=4, write_queue=256, stage=sealed_stage(kind)
            ) as r:
                yield Harness(kind, r, arena, url=url)


@pytest.fixture
async def h(
    kind_and_url: tuple[str, str | None], arena: Arena, tmp_path: Path
) -> AsyncIterator[Harness]:
    kind, url = kind_and_url
    async with opened(kind, url, arena, tmp_path / "tier") as harness:
        yield harness
        assert harness.tier.pinned_count() == 0, "a test left pins behind"


async def load_bytes(h: Harness, keys: Sequence[ChunkKey]) -> list[bytes]:
    """Load ``keys``; the payloads of the contiguous prefix the tier reports (buffers freed)."""
    bufs = h.load_buffers(len(keys))
    try:
        n = await h.tier.load(keys, bufs)
        assert 0 <= n <= len(keys)
        return [bytes(b.view()) for b in bufs[:n]]
    finally:
        for b in bufs:
            b.release()


# -- every async method is a checkpoint --------------------------------------------------------
async def test_every_async_method_is_a_checkpoint(h: Harness) -> None:
    tier = h.tier
    keys = [key(i) for i in range(4)]
    buf = h.arena.allocate()
    assert buf is not None
    buf.write(payload(0))
    try:
        for k in keys:
            with trio.testing.assert_checkpoints():
                await tier.store(k, buf)
    finally:
        buf.release()
    flush = getattr(tier, "flush", None)
    if flush is not None:
        with trio.testing.assert_checkpoints():
            await flush()
        with trio.testing.assert_checkpoints():
            await flush()  # nothing queued
    for probe_keys in (keys, [key(99), *keys], []):
        with trio.testing.assert_checkpoints():
            n = await tier.contains_prefix(probe_keys, pin=True)
        tier.unpin(probe_keys[:n])
    for load_keys in (keys, [key(99)], []):
        bufs = h.load_buffers(len(load_keys))
        try:
            with trio.testing.assert_checkpoints():
                await tier.load(load_keys, bufs)
        finally:
            for b in bufs:
                b.release()
    for k in (keys[0], key(99)):  # there and not there
        with trio.testing.assert_checkpoints():
            await tier.remove(k)
    for _ in range(2):  # closing, and closing again
        with trio.testing.assert_checkpoints():
            await tier.aclose()


# -- cancellation at every step ----------------------------------------------------------------
async def call_once(op: Callable[[], Awaitable[T]], target: Target | None) -> tuple[list[T], Steps]:
    """Run ``op`` in a task named ``caller``, cancelling it at ``target`` (see Steps)."""
    steps = Steps(named("caller"), target)
    scope = trio.CancelScope()
    steps.action = scope.cancel
    out: list[T] = []

    async def caller() -> None:
        with scope:
            out.append(await op())

    trio.lowlevel.add_instrument(steps)
    try:
        steps.armed = True
        async with trio.open_nursery() as nursery:
            nursery.start_soon(caller, name="caller")
    finally:
        steps.armed = False
        trio.lowlevel.remove_instrument(steps)
    return out, steps


async def cancel_at_every_step(
    op: Callable[[], Awaitable[T]],
    check: Callable[[list[T]], Awaitable[None]],
    *,
    same_steps: bool = True,
) -> int:
    """``op`` once undisturbed, then cancelled before and after each of its steps; ``check``
    after each run.  Returns how many runs were cancelled.

    ``same_steps``: the caller's own steps come the same on every run, so each of its targets
    must be reached (not so for an ``op`` that waits for a tier's writer task, whose progress
    between the caller's steps depends on its threads)."""
    out, measured = await call_once(op, None)
    assert out
    await check(out)
    cancelled = 0
    for target in measured.targets():
        out, steps = await call_once(op, target)
        if same_steps and target[0] == "caller#0":
            assert steps.fired, target
        cancelled += not out
        await check(out)
    assert cancelled  # at least cancelling before the first step raised
    return cancelled


async def test_cancelled_probe_leaves_no_pin(h: Harness) -> None:
    keys = [key(i) for i in range(12)]
    await h.put(keys[:9])

    async def probe() -> int:
        return await h.tier.contains_prefix(keys, pin=True)

    async def check(out: list[int]) -> None:
        if out:  # returned: exactly the counted keys are pinned
            assert out == [9]
            assert h.tier.pinned_count() == 9
            h.tier.unpin(keys[:9])
        assert h.tier.pinned_count() == 0

    await cancel_at_every_step(probe, check)


@pytest.mark.parametrize("n_keys", [4, 12])  # the disk tier: one reader thread, or several
async def test_cancelled_load_leaves_the_tier_whole(h: Harness, n_keys: int) -> None:
    keys = [key(i) for i in range(n_keys)]
    await h.put(keys)
    # The engine loads what its probe pinned; a load neither takes nor drops pins.
    assert await h.tier.contains_prefix(keys, pin=True) == n_keys

    async def load() -> list[bytes]:
        return await load_bytes(h, keys)

    async def check(out: list[list[bytes]]) -> None:
        if out:
            assert out == [[payload(k.chunk_hash) for k in keys]]
        assert h.tier.pinned_count() == n_keys
        assert h.arena.used_slots == h.resident_slots()
        # A cancel is not a miss: everything is still there.
        assert await h.tier.contains_prefix(keys, pin=False) == n_keys

    await cancel_at_every_step(load, check)
    h.tier.unpin(keys)
    assert await load_bytes(h, keys) == [payload(k.chunk_hash) for k in keys]


async def flushed(h: Harness) -> None:
    flush = getattr(h.tier, "flush", None)
    if flush is not None:
        await flush()


async def agree(h: Harness, k: ChunkKey) -> int:
    """The tier's index and its data agree on ``k``: it counts ``k`` exactly when ``k``
    loads, with its bytes.  Returns 1 if ``k`` is there, else 0."""
    await flushed(h)
    await quiesce_threads(h.tier)  # a remote call a cancel abandoned has finished too
    n = await h.tier.contains_prefix([k], pin=False)
    assert await load_bytes(h, [k]) == [payload(k.chunk_hash)] * n
    assert h.arena.used_slots == h.resident_slots()  # every reference taken was released
    return n


async def test_cancelled_store_leaves_the_tier_consistent(h: Harness) -> None:
    """``store`` (and the flush of a write-behind tier) cancelled at every step: the chunk is
    stored whole or not at all, a store that answered True is there once flushed."""
    fresh = iter(range(10_000, 20_000))
    current: list[ChunkKey] = []

    async def store() -> bool:
        k = key(next(fresh))  # a new key every run: a store of a present key does nothing
        current[:] = [k]
        buf = h.arena.allocate()
        assert buf is not None
        try:
            buf.write(payload(k.chunk_hash))
            ok = await h.tier.store(k, buf)
        finally:
            buf.release()
        await flushed(h)
        return ok

    async def check(out: list[bool]) -> None:
        (k,) = current
        there = await agree(h, k)
        if out:
            assert out == [True]
            assert there == 1
        assert h.tier.pinned_count() == 0

    await cancel_at_every_step(store, check, same_steps=False)


async def test_cancelled_remove_leaves_the_tier_consistent(h: Harness) -> None:
    fresh = iter(range(20_000, 30_000))
    current: list[ChunkKey] = []

    async def remove() -> bool:
        k = key(next(fresh))
        await h.put([k])
        current[:] = [k]
        return await h.tier.remove(k)

    async def check(out: list[bool]) -> None:
        (k,) = current
        there = await agree(h, k)
        if out:  # removed, and says so
            assert out == [True]
            assert there == 0

    await cancel_at_every_step(remove, check, same_steps=False)


# -- no write into a buffer after load returned or raised -------------------------------------
@pytest.mark.parametrize("cancel", [True, False], ids=["cancelled", "returned"])
@pytest.mark.parametrize("n_keys", [4, 12])
async def test_no_write_into_a_buffer_after_load(
    h: Harness, monkeypatch: pytest.MonkeyPatch, cancel: bool, n_keys: int
) -> None:
    keys = [key(i) for i in range(n_keys)]
    await h.put(keys)
    gate = h.gate(monkeypatch)
    bufs = h.load_buffers(n_keys)
    done = trio.Event()
    result: list[int] = []
    scope = trio.CancelScope()

    async def loader() -> None:
        try:
            with scope:
                result.append(await h.tier.load(keys, bufs))
        finally:
            done.set()

    def fill_sentinel() -> None:
        for b in bufs:
            b.slot()[:] = bytes([SENTINEL]) * b.capacity

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(loader)
            if gate is not None:  # a worker thread is about to write into a buffer
                assert await trio.to_thread.run_sync(gate.entered.wait, LIMIT_S)
            if cancel:
                scope.cancel()
            await trio.testing.wait_all_tasks_blocked()
            if done.is_set():
                # load is over: no thread may write into these buffers any more
                fill_sentinel()
                if gate is not None:
                    gate.open()
            else:
                assert gate is not None  # only a thread can keep a load from finishing
                gate.open()
                await done.wait()
                fill_sentinel()
        await quiesce_threads(h.tier)  # every worker thread has finished
        for b in bufs:
            assert bytes(b.slot()) == bytes([SENTINEL]) * b.capacity, "written after load"
        if cancel:
            # Cancelled, or the cancel came while the thread finished the load's last read:
            # then, as trio.to_thread.run_sync does, the finished work is returned.
            assert scope.cancelled_caught != (result == [n_keys])
        else:
            assert result == [n_keys]
    finally:
        for b in bufs:
            b.release()


# -- contiguous counts -------------------------------------------------------------------------
async def test_a_hole_never_stored_ends_the_count(h: Harness) -> None:
    keys = [key(i) for i in range(8)]
    await h.put([k for i, k in enumerate(keys) if i != 3])
    assert await h.tier.contains_prefix(keys, pin=False) == 3
    assert await load_bytes(h, keys) == [payload(i) for i in range(3)]
    assert await h.tier.contains_prefix(keys[3:], pin=False) == 0
    assert await load_bytes(h, keys[3:]) == []
    assert await load_bytes(h, keys[4:]) == [payload(i) for i in range(4, 8)]


@pytest.mark.parametrize("hole", [0, 3, 13, 19])
async def test_a_hole_made_between_probe_and_load_ends_the_count(h: Harness, hole: int) -> None:
    keys = [key(i) for i in range(20)]  # the disk tier reads these with several threads
    await h.put(keys)
    assert await h.tier.contains_prefix(keys, pin=True) == 20
    try:
        await h.delete_behind(keys[hole])
        assert await load_bytes(h, keys) == [payload(i) for i in range(hole)]
    finally:
        h.tier.unpin(keys)


async def test_fewer_buffers_than_keys_count_at_most_the_buffers(h: Harness) -> None:
    keys = [key(i) for i in range(6)]
    await h.put(keys)
    bufs = h.load_buffers(4)
    try:
        assert await h.tier.load(keys, bufs) == 4
        assert [bytes(b.view()) for b in bufs] == [payload(i) for i in range(4)]
    finally:
        for b in bufs:
            b.release()


# -- balanced under a random workload -----------------------------------------------------------
@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_pins_and_loads_balanced_under_a_random_workload(h: Harness, seed: int) -> None:
    """A seeded random sequence of stores, removes, probes (pinning or not, some cancelled at
    once), unpins and loads, against a model of what is stored and what is pinned."""
    rng = random.Random(seed)
    pool = [key(1000 * seed + i) for i in range(20)]
    stored: dict[ChunkKey, bytes] = {}
    pinned: list[list[ChunkKey]] = []

    def prefix(keys: Sequence[ChunkKey]) -> int:
        n = 0
        while n < len(keys) and keys[n] in stored:
            n += 1
        return n

    for step in range(70):
        op = rng.choice(["store", "store", "remove", "probe", "probe", "unpin", "load", "load"])
        keys = rng.sample(pool, rng.randint(1, 8))
        if op == "store":
            data = [rng.randbytes(rng.randint(1, SLOT_BYTES)) for _ in keys]
            fresh = [(k, d) for k, d in zip(keys, data) if k not in stored]
            await h.put([k for k, _ in fresh], [d for _, d in fresh])
            stored.update(fresh)  # a stored key is never overwritten (chunks are immutable)
        elif op == "remove":
            assert await h.tier.remove(keys[0]) == (keys[0] in stored)
            stored.pop(keys[0], None)
        elif op == "probe":
            pin = rng.random() < 0.7
            if rng.random() < 0.2:  # cancelled before it could answer: pins nothing
                with trio.CancelScope() as scope:
                    scope.cancel()
                    await h.tier.contains_prefix(keys, pin=pin)
                assert scope.cancelled_caught
            else:
                n = await h.tier.contains_prefix(keys, pin=pin)
                assert n == prefix(keys), (step, op)
                if pin and n:
                    pinned.append(keys[:n])
        elif op == "unpin" and pinned:
            h.tier.unpin(pinned.pop(rng.randrange(len(pinned))))
        elif op == "load":
            assert await load_bytes(h, keys) == [stored[k] for k in keys[: prefix(keys)]]
        assert h.tier.pinned_count() == sum(map(len, pinned)), (step, op)
        assert h.arena.used_slots == h.resident_slots(), (step, op)
    for group in pinned:
        h.tier.unpin(group)
    assert h.tier.pinned_count() == 0


# -- the write-behind's throughput, the cost policy's estimate before any load -----------------
async def test_a_tier_that_writes_over_a_link_measures_its_writes(h: Harness) -> None:
    """Redis and Mooncake time each write-behind batch (the call in its thread, not the wait
    for a thread, nor the encoding): until a load measures the tier, that throughput is its
    cost's, marked stale (``docs/policy.md``).  The tiers of this machine (CPU, disk) and the
    plain fake keep none: their cost stays unknown until loaded from."""
    before = h.tier.stats.cost()
    assert before.bytes_per_s is None and before.stale
    await h.put([key(h_) for h_ in range(40_000, 40_004)])
    cost = h.tier.stats.cost()
    if isinstance(h.tier, RemoteTier):
        assert cost.bytes_per_s is not None and cost.bytes_per_s > 0
        assert cost.stale  # an estimate, until a load measures the tier
        h.tier.stats.observe_load(1 << 20, 0.5, now=1.0)
        assert h.tier.stats.cost(1.0, 60.0) == TierCost(
            h.tier.stats.latency_s_ewma, 2 << 20, False, h.tier.stats.decode_bytes_per_s_ewma
        )
    else:
        assert cost.bytes_per_s is None and cost.stale
