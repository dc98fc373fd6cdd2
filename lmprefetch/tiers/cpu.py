"""The CPU tier: the hot cache, an LRU over arena buffers.

Every cached chunk is one arena :class:`~lmprefetch.memory.Buffer` whose first owner is this
tier.  A hit is zero-copy: :meth:`CpuTier.acquire` gives the lookup its own owner reference on the
cached buffer, so a lookup, a claim and the cache all hold the same memory and each releases only
its own reference (LMCache releases the cache's reference on cleanup too, D01).  A buffer with a
pin or with any owner besides the cache is never evicted.

Cancellation: the probe has one checkpoint, *before* it counts and pins (so a cancelled probe
pins nothing); :meth:`CpuTier.acquire`, :meth:`CpuTier.put` and eviction are synchronous.

The ``Dnn`` codes are LMCache's defects, the rows of the defect table in
``docs/cancellation.md`` ("The defects"), each with its ``test_dNN_`` regression tests.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import trio

from ..keys import ChunkKey
from ..memory import Arena, Buffer
from .base import BaseTier

__all__ = ["CpuTier"]


class CpuTier(BaseTier):
    """LRU hot cache over ``arena``.

    Args:
        arena: the arena buffers come from (shared with prefetch buffers).
    """

    name = "cpu"

    def __init__(self, arena: Arena) -> None:
        super().__init__()
        self._arena = arena
        self._entries: OrderedDict[ChunkKey, Buffer] = OrderedDict()

    # -- probe and load ---------------------------------------------------------------
    def contains_now(self, key: ChunkKey) -> bool:
        return key in self._entries

    async def contains_prefix(self, keys: Sequence[ChunkKey], *, pin: bool) -> int:
        await trio.lowlevel.checkpoint()
        return self.contains_prefix_now(keys, pin=pin)  # synchronous: pins come last

    def contains_prefix_now(self, keys: Sequence[ChunkKey], *, pin: bool) -> int:
        """:meth:`contains_prefix` without its checkpoint (the entries are in memory)."""
        return self._count_prefix(self._entries, keys, pin)

    def acquire(self, keys: Sequence[ChunkKey]) -> list[Buffer]:
        """One owner reference per cached buffer of the leading ``keys`` (stops at a miss)."""
        out: list[Buffer] = []
        entries = self._entries
        for key in keys:
            buf = entries.get(key)
            if buf is None:
                break
            entries.move_to_end(key)
            out.append(buf)
        self._arena.retain_all(out)
        self.stats.chunks_loaded += len(out)
        self.stats.bytes_loaded += sum(b.length for b in out)
        return out

    async def load(self, keys: Sequence[ChunkKey], buffers: Sequence[Buffer]) -> int:
        """Copying load (the engine uses :meth:`acquire` instead; kept for the protocol)."""
        await trio.lowlevel.checkpoint()
        n = 0
        for key, dst in zip(keys, buffers):
            src = self._entries.get(key)
            if src is None:
                break
            dst.write(src.view())
            n += 1
        return n

    # -- store ------------------------------------------------------------------------
    def put(self, key: ChunkKey, payload: memoryview | bytes | bytearray) -> Buffer | None:
        """Cache ``payload`` under ``key`` (synchronous); the cached buffer, or ``None`` if no
        slot can be freed (everything pinned or in use).  An existing key is only touched."""
        buf = self._entries.get(key)
        if buf is not None:
            self._entries.move_to_end(key)
            return buf
        buf = self._arena.allocate()
        while buf is None:
            if not self._evict_one():
                return None
            buf = self._arena.allocate()
        try:
            buf.write(payload)
        except Exception:  # synchronous: nothing here can be cancelled
            buf.release()
            raise
        self._entries[key] = buf
        self.stats.chunks_stored += 1
        self.stats.bytes_stored += buf.length
        self._note_stored(key)
        return buf

    async def store(self, key: ChunkKey, payload: Buffer) -> bool:
        await trio.lowlevel.checkpoint()
        return self.put(key, payload.view()) is not None

    def make_room(self, slots: int) -> int:
        """Evict unpinned, unshared entries until ``slots`` arena slots are free (or nothing
        more can go); returns the free slot count."""
        while self._arena.free_slots < slots and self._evict_one():
            pass
        return self._arena.free_slots

    def _evict_one(self) -> bool:
        for key, buf in self._entries.items():  # least recently used first
            if buf.owners == 1 and not self.is_pinned(key):
                del self._entries[key]
                buf.release()
                self.stats.evictions += 1
                self._note_removed(key)
                return True
        return False

    async def remove(self, key: ChunkKey) -> bool:
        await trio.lowlevel.checkpoint()
        return self.discard(key)

    def discard(self, key: ChunkKey) -> bool:
        """Forget ``key`` (synchronous).  Lookups holding its buffer keep their reference."""
        buf = self._entries.pop(key, None)
        if buf is None:
            return False
        buf.release()
        self._note_removed(key)
        return True

    # -- accounting -------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    @property
    def resident_bytes(self) -> int:
        """Arena bytes the cache holds (whole slots)."""
        return len(self._entries) * self._arena.slot_bytes

    def keys(self) -> list[ChunkKey]:
        return list(self._entries)

    async def aclose(self) -> None:
        self.clear()
        await trio.lowlevel.checkpoint()  # an async method is always a checkpoint

    def clear(self) -> None:
        """Drop every cached entry (each drops only the cache's own reference)."""
        entries, self._entries = self._entries, OrderedDict()
        for key, buf in entries.items():
            buf.release()
            self._note_removed(key)
