"""Cancellation at every checkpoint of every public async method of ``Engine``.

The steps counted are those of every task the call involves: the caller's own task, the lookup
task the engine starts for it and that task's load tasks (and, for ``store`` and ``flush``, the
tiers' write-behind tasks).  A first run counts them (see ``tests/checkpoints.py``); the call
is then repeated once per step, cancelling just before and just after it — by cancelling the
caller's cancel scope and, for lookups, by ``Engine.cancel`` — over the CPU-hit, disk-hit
(the real disk tier, files in ``tmp_path``), Redis-hit (a real ``redis-server``), partial and
miss paths.

What must hold after each run is checked *before* anything else touches the engine: no
``engine.cancel()`` to tidy up first, which would hide a leak.

* The caller was cancelled: nothing may be held, at once (a call that raised had no lasting
  effect).
* The caller got an answer: it is 0 (and nothing is held) or the whole expected hit, which is
  then claimed, its bytes checked, and nothing may be held after the claim.  A hit that
  ``Engine.cancel`` released after the answer claims nothing; no other hit may come up empty.
* A lookup that ``Engine.cancel`` found before its answer answered 0, whatever it had loaded
  (a cancelled LOADING lookup ends DONE), and is counted once, as a miss.
* A positive answer was claimable when it was given: the lookup was HELD.
* Every started lookup gave exactly one answer (the engine's ``on_lookup_done`` hook).
* A cancelled ``store`` left a consistent cache: whole chunks with their exact bytes, a prefix
  of the call's chunks, write-behind queued for exactly those, and once flushed, exactly those
  on disk / in Redis, with no half-written file visible.

Real tiers run worker threads, so these tests use the real clock under an outer
``fail_after``; a step is numbered within its own task, so each target is the same point in
the code on every run however threads interleave.  The fake-tier scenario runs on the
``MockClock``.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from lmprefetch import Engine, PrefetchConfig, open_engine
from lmprefetch.keys import ChunkKey
from lmprefetch.prefetch import LookupState
from lmprefetch.tiers.base import Tier
from lmprefetch.tiers.chunkfile import TEMP_SUFFIX
from lmprefetch.tiers.disk import DiskTier
from lmprefetch.tiers.redis import RedisTier, decode_value, redis_key

from .checkpoints import Steps, Target, named
from .fakes import FakeTier
from .helpers import CHUNK, assert_conserved, layer_parts, offsets
from .redis_servers import HAVE_REDIS, RedisServer, raw_client
from .redis_servers import redis_server_fixture as redis_server_fixture  # fixture "redis_server"

LIMIT_S = 60.0
CHUNK_BYTES = 4096


def chunk_tokens(n_chunks: int) -> list[int]:
    return list(range(1000, 1000 + n_chunks * CHUNK))


def chunk_data(n_chunks: int) -> list[bytes]:
    """Payloads of different sizes, each with its own bytes."""
    return [random.Random(i).randbytes(CHUNK_BYTES // 2 + 100 * i) for i in range(n_chunks)]


def base_config(**changes: Any) -> PrefetchConfig:
    return PrefetchConfig(
        chunk_size=CHUNK,
        chunk_bytes=CHUNK_BYTES,
        cpu_bytes=CHUNK_BYTES * 64,
        lookup_timeout_s=LIMIT_S,
        tier_timeout_s=LIMIT_S,
        claim_ttl_s=10 * LIMIT_S,
        redis_timeout_s=LIMIT_S / 4,
    ).replace(**changes)


def prepare(config: PrefetchConfig, n_chunks: int) -> None:
    """Store the first ``n_chunks`` chunks into the tiers of ``config`` and flush them: the
    disk directory and the Redis server outlive this engine."""

    async def run() -> None:
        async with open_engine(config) as engine:
            assert await engine.store(chunk_tokens(n_chunks), chunk_data(n_chunks)) == n_chunks
            await engine.flush()

    trio.run(run)


def caller_and_lookup() -> Callable[[trio.lowlevel.Task], str | None]:
    return named("caller", prefixes=("lookup:",))


# -- lookup_and_prefetch -------------------------------------------------------------------
@dataclass
class Lookup:
    """A lookup path: the engine's config, what is in its tiers, and the expected answer."""

    config: PrefetchConfig
    n_chunks: int  # the prompt's length
    hit_chunks: int  # the expected answer, in chunks
    cpu_chunks: int = 0  # stored into the CPU tier of each fresh engine
    fake_chunks: int = 0  # put into a slow fake tier (probed after the configured tiers)
    mock_clock: bool = False
    task_free: bool = False  # answered without a task: only the caller has steps

    def tiers(self) -> list[Tier]:
        if not self.fake_chunks:
            return []
        fake = FakeTier("slow")
        fake.chunk_delay_s = 0.001  # a checkpoint per chunk; time passes under autojump
        return [fake]


@dataclass
class Outcome:
    returned: list[int]  # what the caller got (empty: it was cancelled)
    answers: list[int]  # every answer the engine gave
    fired: bool


async def run_lookup(path: Lookup, steps: Steps, via: str) -> Outcome:
    toks, data = chunk_tokens(path.n_chunks), chunk_data(path.n_chunks)
    answers: list[int] = []
    returned: list[int] = []
    expected = path.hit_chunks * CHUNK
    with trio.fail_after(LIMIT_S):
        async with open_engine(path.config, extra_tiers=path.tiers()) as engine:
            if path.cpu_chunks:
                await engine.store(toks[: path.cpu_chunks * CHUNK], data[: path.cpu_chunks])
                await engine.flush()  # write-behind done before the lookup starts
            hashes = engine.hasher.hash(toks)
            for tier in engine.tiers:
                if isinstance(tier, FakeTier):
                    pairs = zip(engine.keys.keys(hashes[: path.fake_chunks]), data)
                    tier.data.update(pairs)
            held_at_answer: list[bool] = []

            def on_lookup_done(hit: int, _s: float) -> None:
                # A positive answer is claimable when it is given: the record holds it.
                if hit > 0:
                    held_at_answer.append(engine.lookup_state("L") is LookupState.HELD)
                answers.append(hit)

            engine.on_lookup_done = on_lookup_done
            caller_scope = trio.CancelScope()
            # When Engine.cancel found the lookup: "before" or "after" its answer.
            cancelled: list[str] = []

            def engine_cancel() -> None:
                if engine.lookup_state("L") is not None:
                    cancelled.append("after" if answers else "before")
                engine.cancel("L")

            steps.action = caller_scope.cancel if via == "caller" else engine_cancel

            async def caller() -> None:
                with caller_scope:
                    returned.append(
                        await engine.lookup_and_prefetch("L", hashes, offsets(path.n_chunks))
                    )

            steps.armed = True
            async with trio.open_nursery() as nursery:
                nursery.start_soon(caller, name="caller")
            steps.armed = False

            # Nothing may be held beyond what the caller now owns; no engine.cancel() first.
            assert all(held_at_answer), "a positive answer nobody could claim"
            if cancelled == ["before"]:
                # A lookup cancelled before its answer answers 0, whatever it had loaded.
                assert returned == [0]
            if not returned:
                assert via == "caller"
                assert engine.lookup_state("L") is None
                assert_conserved(engine)
            elif returned[0] == 0:
                assert_conserved(engine)
            else:
                assert returned[0] == expected
                with engine.claim("L") as chunks:
                    if cancelled == ["after"]:  # the cancel released the held result
                        assert chunks == []
                    else:
                        assert [bytes(b.view()) for _, b in chunks] == data[: path.hit_chunks]
                        assert [k.chunk_hash for k, _ in chunks] == hashes[: path.hit_chunks]
                assert_conserved(engine)
            await engine.wait_quiet()
            assert_conserved(engine)
            assert engine.statistics().lookups.started == 1
    assert engine.arena.used_slots == 0  # closed: every reference was released
    assert len(answers) == 1, answers  # exactly one answer per started lookup
    assert answers[0] in (0, expected)
    if cancelled == ["before"]:
        assert answers == [0]
    lookups = engine.statistics().lookups
    # Counted once: a lookup cancelled before its answer is a miss, never also a hit.
    assert lookups.hits + lookups.misses == 1
    if returned:
        assert answers == returned
    return Outcome(returned, answers, steps.fired)


def cancel_everywhere(path: Lookup, via: str) -> None:
    """Count the steps of one undisturbed lookup, then cancel it at each one in turn."""

    def run(target: Target | None) -> tuple[Outcome, Steps]:
        steps = Steps(caller_and_lookup(), target)
        clock = trio.testing.MockClock(autojump_threshold=0) if path.mock_clock else None
        outcome = trio.run(
            functools.partial(run_lookup, path, steps, via), clock=clock, instruments=[steps]
        )
        return outcome, steps

    outcome, measured = run(None)
    assert outcome.returned == [path.hit_chunks * CHUNK]
    roots = {key.split("/")[0] for key in measured.counts}
    assert "caller#0" in roots
    assert ("lookup:#0" in roots) != path.task_free
    cancelled_caller = False
    for target in measured.targets():
        outcome, _ = run(target)
        assert outcome.fired, f"step {target} was not reached"
        cancelled_caller |= not outcome.returned
    # A caller cancelled before its first step must have raised, whatever the path.
    assert cancelled_caller or via == "engine"


def disk_config(tmp_path: Path, **changes: Any) -> PrefetchConfig:
    return base_config(disk_path=str(tmp_path / "disk"), **changes)


def lookup_paths(tmp_path: Path) -> dict[str, Lookup]:
    return {
        # Answered without a task (zero-copy references, synchronous).
        "cpu_hit": Lookup(base_config(), 4, 4, cpu_chunks=4, task_free=True),
        # A fresh engine on a disk directory holding 5 chunks: the CPU tier is empty.
        "disk_hit": Lookup(disk_config(tmp_path), 5, 5),
        # CPU holds chunks 0-1, disk 0-3 of a 6-chunk prompt: a CPU part and a disk part.
        "partial": Lookup(disk_config(tmp_path), 6, 4, cpu_chunks=2),
        # Nothing anywhere; the disk index rules the miss out without I/O.
        "miss": Lookup(disk_config(tmp_path), 3, 0, task_free=True),
        # CPU 0-1, a fake tier with a checkpoint per chunk holding 0-5 (MockClock).
        "slow_tier": Lookup(base_config(), 6, 6, cpu_chunks=2, fake_chunks=6, mock_clock=True),
    }


def prepare_disk(path: Lookup, name: str) -> None:
    if name == "disk_hit":
        prepare(path.config, 5)
    elif name == "partial":
        prepare(path.config, 4)
    elif name == "miss":
        prepare(path.config, 0)


@pytest.mark.parametrize("via", ["caller", "engine"])
@pytest.mark.parametrize("name", ["cpu_hit", "disk_hit", "partial", "miss", "slow_tier"])
def test_lookup_cancelled_at_every_checkpoint(name: str, via: str, tmp_path: Path) -> None:
    path = lookup_paths(tmp_path)[name]
    prepare_disk(path, name)
    cancel_everywhere(path, via)


redis_only = pytest.mark.skipif(not HAVE_REDIS, reason="redis-server / redis-cli not on PATH")


@pytest.mark.redis
@redis_only
@pytest.mark.parametrize("via", ["caller", "engine"])
@pytest.mark.parametrize("name", ["redis_hit", "three_tiers", "redis_miss"])
def test_lookup_cancelled_at_every_checkpoint_redis(
    name: str, via: str, tmp_path: Path, redis_server: RedisServer
) -> None:
    redis = base_config(redis_url=redis_server.url)
    if name == "redis_hit":  # a fresh engine: CPU empty, Redis holds 5 chunks
        prepare(redis, 5)
        path = Lookup(redis, 5, 5)
    elif name == "three_tiers":  # CPU 0-1, disk 0-3, Redis 0-5 of 8: loads from two tiers
        prepare(redis, 6)
        prepare(disk_config(tmp_path), 4)
        path = Lookup(disk_config(tmp_path, redis_url=redis_server.url), 8, 6, cpu_chunks=2)
    else:  # Redis cannot rule a miss out without asking: a lookup task probes it
        path = Lookup(redis, 3, 0)
    cancel_everywhere(path, via)


# -- store, store_hashes ---------------------------------------------------------------------
def cached(engine: Engine, key: ChunkKey) -> tuple[bytes, int]:
    """The payload the CPU tier caches under ``key``, and how many owners its buffer has."""
    (buf,) = engine.cpu.acquire([key])
    try:
        return bytes(buf.view()), buf.owners - 1
    finally:
        buf.release()


async def tier_payloads(engine: Engine, tier: Tier, keys: list[ChunkKey]) -> list[bytes]:
    bufs = engine.arena.allocate_many(len(keys))
    try:
        assert len(bufs) == len(keys)
        n = await tier.load(keys, bufs)
        return [bytes(b.view()) for b in bufs[:n]]
    finally:
        for buf in bufs:
            buf.release()


def redis_contents(url: str, keys: list[ChunkKey]) -> tuple[list[bytes], list[bytes | None]]:
    """Every lmprefetch key in Redis, and the decoded payloads under ``keys``."""
    with raw_client(url) as client:
        names = sorted(client.scan_iter(match=b"lmprefetch:*"))
        values = [decode_value(client.get(redis_key(k))) for k in keys]
    return names, [bytes(v) if v is not None else None for v in values]


async def check_store(
    engine: Engine, keys: list[ChunkKey], data: list[bytes], returned: list[int], url: str | None
) -> None:
    """What a (maybe cancelled) store left must be consistent, now and once flushed."""
    kpc = engine.config.keys_per_chunk
    parts = layer_parts(data, kpc)
    in_cpu = [k for k in keys if k in engine.cpu]
    # Whole chunks, a prefix of the call's chunks, each with its exact bytes.
    assert in_cpu == keys[: len(in_cpu)]
    assert len(in_cpu) % kpc == 0
    n_chunks = len(in_cpu) // kpc
    assert [cached(engine, k)[0] for k in in_cpu] == parts[: len(in_cpu)]
    if returned:
        assert returned == [len(data)] == [n_chunks]
    assert engine.statistics().store.chunks_stored == n_chunks  # counted even when cancelled
    # Write-behind holds references on the cached buffers only: nothing else is held.
    assert_conserved(engine)
    for tier in engine.tiers:
        if isinstance(tier, DiskTier):  # queued or written: exactly the cached chunks
            assert set(tier.keys()) <= set(in_cpu)
            assert tier.queued_writes + len(tier) == len(in_cpu)
    await engine.flush()
    for tier in engine.tiers:
        if isinstance(tier, DiskTier):
            assert set(tier.keys()) == set(in_cpu)
            assert await tier_payloads(engine, tier, in_cpu) == parts[: len(in_cpu)]
            files = await trio.Path(tier.path).iterdir()
            assert not [f for f in files if f.name.endswith(TEMP_SUFFIX)]  # no half-written file
        if isinstance(tier, RedisTier):
            assert url is not None
            names, values = await trio.to_thread.run_sync(redis_contents, url, in_cpu)
            assert names == sorted(redis_key(k) for k in in_cpu)
            assert values == parts[: len(in_cpu)]
    # Flushed: the write-behind let go of its references; only the cache owns its buffers.
    assert [cached(engine, k)[1] for k in in_cpu] == [1] * len(in_cpu)
    assert_conserved(engine)


async def run_store(
    config: PrefetchConfig,
    steps: Steps,
    method: str,
    n_chunks: int,
    url: str | None,
) -> tuple[list[int], bool]:
    toks, data = chunk_tokens(n_chunks), chunk_data(n_chunks)
    returned: list[int] = []
    with trio.fail_after(LIMIT_S):
        async with open_engine(config) as engine:
            hashes = engine.hasher.hash(toks)
            keys = engine.keys.keys(hashes)
            caller_scope = trio.CancelScope()
            steps.action = caller_scope.cancel

            async def caller() -> None:
                with caller_scope:
                    if method == "store":
                        returned.append(await engine.store(toks, data))
                    else:
                        returned.append(await engine.store_hashes(hashes, data))

            steps.armed = True
            async with trio.open_nursery() as nursery:
                nursery.start_soon(caller, name="caller")
            steps.armed = False
            await check_store(engine, keys, data, returned, url)
    assert engine.arena.used_slots == 0  # closed: every reference was released
    return returned, steps.fired


def store_everywhere(
    make_config: Callable[[int], PrefetchConfig], method: str, reset: Callable[[], None]
) -> None:
    n_chunks = 5
    url = make_config(0).redis_url

    def run(i: int, target: Target | None) -> tuple[list[int], Steps]:
        reset()
        steps = Steps(named("caller", "_run_writer", "run_writer"), target)
        returned, _ = trio.run(
            run_store, make_config(i), steps, method, n_chunks, url, instruments=[steps]
        )
        return returned, steps

    returned, measured = run(0, None)
    assert returned == [n_chunks]
    assert measured.counts["caller#0"] == n_chunks + 1  # a checkpoint per chunk
    outcomes = set()
    for i, target in enumerate(measured.targets(), 1):
        returned, steps = run(i, target)
        if target[0] == "caller#0":  # the caller's steps are the same on every run
            assert steps.fired, target
        outcomes.add(tuple(returned))
    assert () in outcomes  # some stores were cancelled


def no_reset() -> None:
    pass


@pytest.mark.parametrize("method", ["store", "store_hashes"])
@pytest.mark.parametrize("tiers", ["cpu", "disk", "disk_layerwise"])
def test_store_cancelled_at_every_checkpoint(method: str, tiers: str, tmp_path: Path) -> None:
    def make_config(i: int) -> PrefetchConfig:
        if tiers == "cpu":
            return base_config()
        config = disk_config(tmp_path / str(i))  # a fresh directory per run
        if tiers == "disk_layerwise":
            config = config.replace(layerwise=True, num_layers=4, chunk_bytes=CHUNK_BYTES)
        return config

    store_everywhere(make_config, method, no_reset)


@pytest.mark.redis
@redis_only
def test_store_cancelled_at_every_checkpoint_redis(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    def make_config(i: int) -> PrefetchConfig:
        return disk_config(tmp_path / str(i), redis_url=redis_server.url)

    def reset() -> None:
        with raw_client(redis_server.url) as client:
            client.flushall()

    store_everywhere(make_config, "store", reset)


# -- flush -----------------------------------------------------------------------------------
async def run_flush(
    config: PrefetchConfig, steps: Steps, n_chunks: int, url: str | None
) -> tuple[bool, bool]:
    toks, data = chunk_tokens(n_chunks), chunk_data(n_chunks)
    flushed: list[bool] = []
    with trio.fail_after(LIMIT_S):
        async with open_engine(config) as engine:
            keys = engine.keys.keys(engine.hasher.hash(toks))
            assert await engine.store(toks, data) == n_chunks  # write-behind queued
            caller_scope = trio.CancelScope()
            steps.action = caller_scope.cancel

            async def caller() -> None:
                with caller_scope:
                    await engine.flush()
                    flushed.append(True)

            steps.armed = True
            async with trio.open_nursery() as nursery:
                nursery.start_soon(caller, name="caller")
            steps.armed = False
            # A cancelled flush stops waiting; the writes go on and nothing is lost.
            assert_conserved(engine)
            await check_store(engine, keys, data, [n_chunks], url)
    assert engine.arena.used_slots == 0  # closed: every reference was released
    return bool(flushed), steps.fired


def flush_everywhere(
    make_config: Callable[[int], PrefetchConfig], reset: Callable[[], None]
) -> None:
    n_chunks = 8
    url = make_config(0).redis_url

    def run(i: int, target: Target | None) -> tuple[bool, Steps]:
        reset()
        steps = Steps(named("caller", "_run_writer", "run_writer"), target)
        flushed, _ = trio.run(run_flush, make_config(i), steps, n_chunks, url, instruments=[steps])
        return flushed, steps

    flushed, measured = run(0, None)
    assert flushed
    # The writers' steps interleave with the caller's differently on every run (threads), so
    # a target past the first steps may not be reached; each run's checks hold either way.
    outcomes = set()
    for i, target in enumerate(measured.targets(), 1):
        flushed, steps = run(i, target)
        if target[:2] == ("caller#0", 1):
            assert steps.fired
        outcomes.add(flushed)
    assert False in outcomes  # some flushes were cancelled


def test_flush_cancelled_at_every_checkpoint_disk(tmp_path: Path) -> None:
    flush_everywhere(lambda i: disk_config(tmp_path / str(i)), no_reset)


@pytest.mark.redis
@redis_only
def test_flush_cancelled_at_every_checkpoint_redis(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    def reset() -> None:
        with raw_client(redis_server.url) as client:
            client.flushall()

    flush_everywhere(lambda i: base_config(redis_url=redis_server.url), reset)

