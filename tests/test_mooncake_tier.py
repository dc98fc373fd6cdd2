"""The Mooncake tier against a real ``mooncake_master`` (and store processes), on loopback in a
private network namespace (see tests/mooncake_servers.py).

The real clock, and an absolute ``trio.fail_after`` on every test.  Faults are real: the
master is SIGKILLed mid-load and restarted on its port, or SIGSTOPped; a worker process that
holds the pool's memory exits; objects are removed behind the tier's back.
"""

from __future__ import annotations

import json
import logging
import os
import random
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from lmprefetch import PrefetchConfig, open_engine
from lmprefetch.keys import ChunkKey
from lmprefetch.memory import Arena
from lmprefetch.tiers import mooncake as mooncake_module
from lmprefetch.tiers.mooncake import MooncakeTier, mooncake_key, open_mooncake_tier

from .mooncake_servers import (
    CALL_TIMEOUT_S,
    MooncakeMaster,
    MooncakeStore,
    mooncake_master_fixture,  # noqa: F401  (fixture "mooncake_master")
    needs_mooncake,
)

pytestmark = needs_mooncake

ROOT = Path(__file__).resolve().parent.parent
SLOT_BYTES = 64 * 1024
BACKOFF_S = 0.2
TEST_DEADLINE_S = 60


def failure_messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "lmprefetch.tiers.mooncake"
        and r.levelno == logging.WARNING
        and " failed" in r.getMessage()
    ]


def make_keys(n: int, *, model: str = "model-a", seed: int = 1, rank: int = 0) -> list[ChunkKey]:
    rng = random.Random(seed)
    return [ChunkKey(model, 1, rank, rng.getrandbits(64), "bfloat16") for _ in range(n)]


def make_payloads(n: int, *, seed: int = 7, size: int | None = None) -> list[bytes]:
    rng = random.Random(seed)
    sizes = [size if size is not None else rng.choice([1, 1000, SLOT_BYTES]) for _ in range(n)]
    return [rng.randbytes(s) for s in sizes]


@asynccontextmanager
async def tier_on(
    address: str, arena: Arena | None = None, **kwargs: Any
) -> AsyncIterator[MooncakeTier]:
    options: dict[str, Any] = {
        "timeout_s": CALL_TIMEOUT_S,
        "segment_bytes": 32 << 20,
        "backoff_initial_s": BACKOFF_S,
        "backoff_max_s": 1.0,
    }
    options.update(kwargs)
    async with open_mooncake_tier(address, arena=arena, **options) as tier:
        yield tier


async def connected(tier: MooncakeTier) -> MooncakeTier:
    """Wait until the tier has a client (setting one up may outlast the open on a busy
    machine)."""
    while not tier.connected:
        assert await tier.connect(), "the tier could not set a client up"
    return tier


async def store_all(
    tier: MooncakeTier, arena: Arena, keys: Sequence[ChunkKey], payloads: Sequence[bytes]
) -> None:
    """Write through the tier's write-behind path and wait until it is in the store."""
    for key, payload in zip(keys, payloads, strict=True):
        buf = arena.allocate()
        assert buf is not None
        try:
            buf.write(payload)
            assert tier.enqueue_write(key, buf)
        finally:
            buf.release()  # the tier holds its own reference until stored
    await tier.flush()


async def load_all(tier: MooncakeTier, arena: Arena, keys: Sequence[ChunkKey]) -> list[bytes]:
    """Load ``keys`` into fresh buffers; the contiguous prefix's bytes (buffers released)."""
    bufs = arena.allocate_many(len(keys))
    assert len(bufs) == len(keys)
    try:
        n = await tier.load(keys, bufs)
        return [bytes(buf.view()) for buf in bufs[:n]]
    finally:
        for buf in bufs:
            buf.release()


@pytest.fixture
def arena() -> Iterator[Arena]:
    arena = Arena(SLOT_BYTES, 96)
    yield arena
    assert arena.free_slots == arena.num_slots, "a buffer reference leaked"
    arena.close()


# -- round trips ----------------------------------------------------------------------------------
async def test_round_trip_exact_bytes(mooncake_master: MooncakeMaster, arena: Arena) -> None:
    keys = make_keys(40)
    payloads = make_payloads(40)
    with trio.fail_after(TEST_DEADLINE_S):
        async with tier_on(mooncake_master.address, arena) as tier:
            await connected(tier)
            assert tier.name == "mooncake"
            assert tier.contains_now(keys[0]) is None
            assert await tier.contains_prefix(keys, pin=False) == 0
            await store_all(tier, arena, keys, payloads)
            assert tier.stats.chunks_stored == 40
            assert tier.stats.bytes_stored == sum(map(len, payloads))
            assert await tier.contains_prefix(keys, pin=True) == 40
            assert tier.pinned_count() == 40
            tier.unpin(keys)
            # 40 keys: three batches of get-into (16 + 16 + 8)
            assert await load_all(tier, arena, keys) == payloads
            assert tier.stats.chunks_loaded == 40
            assert tier.stats.bytes_loaded == sum(map(len, payloads))
            assert tier.stats.errors == 0
            assert tier.stats.writes_dropped == 0


async def test_a_hole_ends_the_prefix(mooncake_master: MooncakeMaster, arena: Arena) -> None:
    keys = make_keys(8, seed=21)
    payloads = make_payloads(8, seed=22, size=500)
    with trio.fail_after(TEST_DEADLINE_S):
        async with tier_on(mooncake_master.address, arena) as tier:
            await connected(tier)
            # chunk 3 was never stored: 0, 1, 2, (hole), 4, ...
            await store_all(tier, arena, keys[:3] + keys[4:], payloads[:3] + payloads[4:])
            assert await tier.contains_prefix(keys, pin=True) == 3
            assert tier.pinned_count() == 3
            tier.unpin(keys[:3])
            assert await load_all(tier, arena, keys) == payloads[:3]
            assert await load_all(tier, arena, keys[4:]) == payloads[4:]
            assert await tier.contains_prefix(keys[3:], pin=False) == 0
            assert tier.stats.errors == 0  # a hole is a miss, not an error


async def test_a_value_larger_than_the_buffer_is_a_miss_that_stays(
    mooncake_master: MooncakeMaster, arena: Arena
) -> None:
    keys = make_keys(3, seed=31)
    payloads = make_payloads(3, seed=32, size=SLOT_BYTES)
    small = Arena(SLOT_BYTES // 2, 8)
    with trio.fail_after(TEST_DEADLINE_S):
        async with tier_on(mooncake_master.address, arena) as tier:
            await connected(tier)
            await store_all(tier, arena, keys, payloads)
            assert await load_all(tier, small, keys) == []  # an engine with smaller slots
            assert tier.stats.errors == 0
            assert await load_all(tier, arena, keys) == payloads  # still there for the others
    assert small.free_slots == small.num_slots
    small.close()


async def test_models_ranks_and_dtypes_do_not_collide(
    mooncake_master: MooncakeMaster, arena: Arena
) -> None:
    keys = make_keys(2, seed=41)
    others = [
        [k._replace(model_name="model-b") for k in keys],
        [k._replace(rank=1, world_size=2) for k in keys],
        [k._replace(kv_dtype="float16") for k in keys],
        [k._replace(layer=0) for k in keys],
    ]
    with trio.fail_after(TEST_DEADLINE_S):
        async with tier_on(mooncake_master.address, arena) as tier:
            await connected(tier)
            await store_all(tier, arena, keys, [b"a", b"b"])
            for other in others:
                assert await tier.contains_prefix(other, pin=False) == 0
            assert mooncake_key(keys[0]) == "lmprefetch:" + keys[0].to_string()


async def test_two_tiers_share_chunks(mooncake_master: MooncakeMaster) -> None:
    """Two clients with their own arenas (two engines): what one writes the other finds and
    loads byte for byte, from the writer's segment."""
    keys = make_keys(8, seed=11)
    payloads = make_payloads(8, seed=12, size=SLOT_BYTES - 3)
    arena_a, arena_b = Arena(SLOT_BYTES, 16), Arena(SLOT_BYTES, 16)
    with trio.fail_after(TEST_DEADLINE_S):
        async with (
            tier_on(mooncake_master.address, arena_a) as writer,
            tier_on(mooncake_master.address, arena_b, segment_bytes=0) as reader,
        ):
            await connected(writer)
            await connected(reader)
            assert await reader.contains_prefix(keys, pin=False) == 0
            await store_all(writer, arena_a, keys, payloads)
            assert await reader.contains_prefix(keys, pin=False) == 8
            assert await load_all(reader, arena_b, keys) == payloads
    for a in (arena_a, arena_b):
        assert a.free_slots == a.num_slots
        a.close()
