"""What the disk tier's test files share: chunk keys and payloads, a tier opened on a
directory, storing and loading through an arena, and a stand-in for ``os`` that records which
thread makes each file call.

Test files import from here, never from each other (see ``tests/helpers.py``).
"""

from __future__ import annotations

import os
import random
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio

from lmprefetch.keys import ChunkKey
from lmprefetch.memory import Arena, Buffer
from lmprefetch.tiers.disk import DiskTier, open_disk_tier

SLOT_BYTES = 16 * 1024  # a multiple of the page size: O_DIRECT can read into these slots
NUM_SLOTS = 32
TIMEOUT_S = 20


def key(h: int) -> ChunkKey:
    return ChunkKey("m", 1, 0, h, "bfloat16")


def payload(h: int, size: int = SLOT_BYTES) -> bytes:
    return random.Random(h).randbytes(size)


def file_of(path: Path, k: ChunkKey) -> trio.Path:
    return trio.Path(path / (k.to_string() + ".kv"))



@asynccontextmanager
async def opened(path: Path, **overrides: Any) -> AsyncIterator[DiskTier]:
    kwargs: dict[str, Any] = {
        "capacity_bytes": 1 << 24,
        "read_threads": 4,
        "write_queue": 64,
        "o_direct": False,
    }
    kwargs.update(overrides)
    async with open_disk_tier(str(path), **kwargs) as tier:
        yield tier


def filled(arena: Arena, data: bytes) -> Buffer:
    buf = arena.allocate()
    assert buf is not None
    buf.write(data)
    return buf


def enqueue(tier: DiskTier, arena: Arena, h: int, data: bytes | None = None) -> bool:
    """Queue ``data`` (default ``payload(h)``) under ``key(h)``, as the engine's store does:
    the caller's own reference is released at once, the tier keeps its own."""
    buf = filled(arena, payload(h) if data is None else data)
    try:
        return tier.enqueue_write(key(h), buf)
    finally:
        buf.release()


async def store(tier: DiskTier, arena: Arena, hs: Sequence[int], size: int = SLOT_BYTES) -> None:
    for h in hs:
        assert enqueue(tier, arena, h, payload(h, size))
    await tier.flush()


async def load(tier: DiskTier, arena: Arena, keys: Sequence[ChunkKey]) -> list[bytes]:
    """Load ``keys``; the payloads of the contiguous prefix the tier reports."""
    bufs = arena.allocate_many(len(keys))
    try:
        assert len(bufs) == len(keys)
        n = await tier.load(keys, bufs)
        return [bytes(b.view()) for b in bufs[:n]]
    finally:
        for b in bufs:
            b.release()


_FILE_CALLS = frozenset(
    {
        "open",
        "close",
        "preadv",
        "pread",
        "read",
        "write",
        "writev",
        "fstat",
        "stat",
        "scandir",
        "listdir",
        "makedirs",
        "mkdir",
        "unlink",
        "remove",
        "replace",
        "rename",
    }
)


class OsProxy:
    """Stands in for the ``os`` module inside ``lmprefetch.tiers.disk``: records which thread
    makes each file call, and can replace some calls."""

    def __init__(self, replace: dict[str, Callable[..., Any]] | None = None) -> None:
        self.calls: list[tuple[str, int]] = []
        self._replace = replace or {}

    def __getattr__(self, name: str) -> Any:
        real = self._replace.get(name, getattr(os, name))
        if name not in _FILE_CALLS:
            return real

        def spy(*args: Any, **kwargs: Any) -> Any:
            self.calls.append((name, threading.get_ident()))
            return real(*args, **kwargs)

        return spy
