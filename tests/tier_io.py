"""Chunks written through a tier and read back, for the tier suites (Redis, Mooncake, the fake
Mooncake, disk): random keys and payloads, ``store_all`` through the write-behind path,
``load_all`` into fresh buffers, and an arena that fails the test when a buffer leaks.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Protocol

import pytest

from lmprefetch.keys import ChunkKey
from lmprefetch.memory import Arena, Buffer

__all__ = [
    "checked_arena",
    "failure_messages",
    "load_all",
    "make_keys",
    "make_payloads",
    "store_all",
]


class _WritesBehind(Protocol):
    def enqueue_write(self, key: ChunkKey, buf: Buffer) -> bool: ...

    async def flush(self) -> None: ...


class _Loads(Protocol):
    async def load(self, keys: Sequence[ChunkKey], buffers: Sequence[Buffer]) -> int: ...


def make_keys(n: int, *, model: str = "model-a", seed: int = 1, rank: int = 0) -> list[ChunkKey]:
    """``n`` keys with random chunk hashes (the same ones for the same ``seed``)."""
    rng = random.Random(seed)
    return [ChunkKey(model, 1, rank, rng.getrandbits(64), "bfloat16") for _ in range(n)]


def make_payloads(
    n: int, *, sizes: Sequence[int], seed: int = 7, size: int | None = None
) -> list[bytes]:
    """``n`` random payloads of ``size`` bytes each, or of sizes drawn from ``sizes``."""
    rng = random.Random(seed)
    lengths = [size if size is not None else rng.choice(list(sizes)) for _ in range(n)]
    return [rng.randbytes(length) for length in lengths]


async def store_all(
    tier: _WritesBehind, arena: Arena, keys: Sequence[ChunkKey], payloads: Sequence[bytes]
) -> None:
    """Write through the tier's write-behind path and wait until it is written."""
    for key, payload in zip(keys, payloads, strict=True):
        buf = arena.allocate()
        assert buf is not None
        try:
            buf.write(payload)
            assert tier.enqueue_write(key, buf)
        finally:
            buf.release()  # the tier holds its own reference until written
    await tier.flush()


async def load_all(tier: _Loads, arena: Arena, keys: Sequence[ChunkKey]) -> list[bytes]:
    """Load ``keys`` into fresh buffers; the contiguous prefix's bytes (buffers released)."""
    bufs = arena.allocate_many(len(keys))
    assert len(bufs) == len(keys)
    try:
        n = await tier.load(keys, bufs)
        return [bytes(buf.view()) for buf in bufs[:n]]
    finally:
        for buf in bufs:
            buf.release()


@contextmanager
def checked_arena(slot_bytes: int, slots: int) -> Iterator[Arena]:
    """An arena that fails the test on exit if a buffer reference was never released."""
    arena = Arena(slot_bytes, slots)
    yield arena
    assert arena.free_slots == arena.num_slots, "a buffer reference was never released"
    arena.close()


def failure_messages(caplog: pytest.LogCaptureFixture, tier: str) -> list[str]:
    """The ``tier``'s "call failed" warnings (one per failure outside a back-off, naming the
    cause), from its own logger (``lmprefetch.tiers.<tier>``)."""
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == f"lmprefetch.tiers.{tier}"
        and r.levelno == logging.WARNING
        and " failed" in r.getMessage()
    ]
