"""The write path: chunk payloads into the CPU tier now, to the other tiers write-behind.

:class:`ChunkStore` is the engine's write path (``Engine.store``, ``store_hashes``,
``describe_chunks`` and ``flush`` call it).  A stored chunk becomes one arena buffer cached by
the CPU tier (in layerwise mode, one per layer); every tier that takes writes behind the
caller's back (:class:`~lmprefetch.tiers.base.WriteBehindTier`: disk, Redis) gets an owner
reference on that same buffer and writes it later, never on the caller's path (encoding it with
its codec stage there, and sealing it for the chunk's tenant where encryption is on).  KV
events name the stored chunks (:mod:`lmprefetch.events`).

Cancellation: a store checkpoints once per chunk, *before* the chunk; a chunk is cached and
queued for write-behind synchronously, so a cancelled store leaves whole chunks, a prefix of the
call's chunks, each queued for write-behind exactly once.  ``flush`` waits; cancelling it stops
the wait, not the writes.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import ExitStack
from typing import Any, cast

import msgspec
import trio

from ._stats import snapshot
from .codec import tenant_id
from .config import PrefetchConfig
from .events import ChunkBlocks, KVEventTracker
from .hashing import ChunkHasher
from .keys import KeyMaker
from .memory import Buffer
from .tiers.base import TenantTier, WriteBehindTier
from .tiers.cpu import CpuTier

__all__ = ["ChunkStore", "StoreCounters", "StoreStatistics"]


class StoreCounters(msgspec.Struct, gc=False):
    """What the write path stored: chunks taken by the CPU tier (each queued for write-behind),
    and chunks left out because the CPU tier could not take them (everything pinned)."""

    chunks_stored: int = 0
    rejected_chunks: int = 0


class StoreStatistics(StoreCounters, frozen=True, gc=False):  # type: ignore[misc]
    """A snapshot of the write path's counters (see :class:`StoreCounters`)."""


class ChunkStore:
    """One engine's write path.

    Args:
        config: ``chunk_bytes``, ``chunk_size`` and the layerwise settings are used.
        hasher: the engine's chunk hasher.
        keys: the engine's key maker (this rank's keys).
        cpu: the CPU tier, which takes every stored chunk first.
        write_behind: the tiers that get a write-behind copy of every stored chunk.
        kv_events: the KV-event tracker, or ``None`` when events are off.
    """

    def __init__(
        self,
        config: PrefetchConfig,
        *,
        hasher: ChunkHasher,
        keys: KeyMaker,
        cpu: CpuTier,
        write_behind: Sequence[WriteBehindTier],
        kv_events: KVEventTracker | None,
    ) -> None:
        self._chunk_bytes = config.chunk_bytes
        self._chunk_size = config.chunk_size
        self._kpc = config.keys_per_chunk
        self._hasher = hasher
        self._keys = keys
        self._cpu = cpu
        self._write_behind = tuple(write_behind)
        # The tiers that seal per tenant (encryption on) get each chunk's tenant.
        self._per_tenant = frozenset(
            id(t) for t in self._write_behind if getattr(t, "per_tenant", False)
        )
        self._kv_events = kv_events
        self._counters = StoreCounters()

    def statistics(self) -> StoreStatistics:
        return snapshot(StoreStatistics, self._counters)

    async def store(
        self, token_ids: Sequence[int] | Any, payloads: Sequence[Any], salt: bytes | None
    ) -> int:
        """See :meth:`Engine.store <lmprefetch.prefetch.Engine.store>`."""
        hashes = self._hasher.hash(token_ids, salt)
        blocks: list[ChunkBlocks] | None = None
        tracker = self._kv_events
        if tracker is not None and tracker.mode == "chunks":
            # Events name these chunks by their hashes, with their tokens and parents.
            tokens = list(token_ids)
            cs = self._chunk_size
            blocks = [
                ChunkBlocks.make(
                    (h,),
                    len(tokens[i * cs : (i + 1) * cs]),
                    parent_block_hash=hashes[i - 1] if i else None,
                    token_ids=tokens[i * cs : (i + 1) * cs],
                )
                for i, h in enumerate(hashes[: len(payloads)])
            ]
        return await self.store_hashes(hashes, payloads, blocks, tenant_id(salt))

    async def store_hashes(
        self,
        hashes: Sequence[int],
        payloads: Sequence[Any],
        blocks: Sequence[ChunkBlocks] | None,
        tenant: bytes = b"",
    ) -> int:
        """See :meth:`Engine.store_hashes <lmprefetch.prefetch.Engine.store_hashes>`."""
        if len(payloads) > len(hashes):
            raise ValueError(
                f"payloads: {len(payloads)} payloads for a prompt of {len(hashes)} chunks"
            )
        if blocks is not None and len(blocks) < len(payloads):
            raise ValueError(f"blocks: {len(blocks)} for {len(payloads)} payloads")
        views = [_as_bytes_view(p, i) for i, p in enumerate(payloads)]
        if self._kv_events is not None:
            self.describe_chunks(hashes[: len(views)], blocks)
        kpc = self._kpc
        for i, view in enumerate(views):
            if view.nbytes > self._chunk_bytes:
                raise ValueError(
                    f"payloads[{i}]: chunk {i} has {view.nbytes} bytes, more than chunk_bytes "
                    f"({self._chunk_bytes})"
                )
            if view.nbytes % kpc:
                raise ValueError(
                    f"payloads[{i}]: chunk {i} has {view.nbytes} bytes, not divisible by "
                    f"num_layers ({kpc})"
                )
        keys = self._keys.keys(hashes[: len(views)])
        cpu = self._cpu
        stored = 0
        # This call's own chunks are not evicted to make room for its later chunks.
        with ExitStack() as mine:
            for i, view in enumerate(views):
                await trio.lowlevel.checkpoint()
                part = view.nbytes // kpc
                chunk_keys = keys[i * kpc : (i + 1) * kpc]
                bufs: list[Buffer] = []
                for layer, key in enumerate(chunk_keys):
                    buf = cpu.put(key, view[layer * part : (layer + 1) * part])
                    if buf is None:
                        break
                    mine.callback(buf.retain().release)
                    bufs.append(buf)
                if len(bufs) < kpc:
                    for key in chunk_keys[: len(bufs)]:
                        cpu.discard(key)
                    self._counters.rejected_chunks += len(views) - i
                    break
                for key, buf in zip(chunk_keys, bufs):
                    for tier in self._write_behind:
                        if id(tier) in self._per_tenant:
                            cast(TenantTier, tier).enqueue_write(key, buf, tenant=tenant)
                        else:
                            tier.enqueue_write(key, buf)
                stored += 1
                # Counted per chunk: a store cancelled at a later chunk keeps these.
                self._counters.chunks_stored += 1
        return stored

    def describe_chunks(self, hashes: Sequence[int], blocks: Sequence[ChunkBlocks] | None) -> None:
        """See :meth:`Engine.describe_chunks <lmprefetch.prefetch.Engine.describe_chunks>`."""
        tracker = self._kv_events
        if tracker is None:
            return
        if blocks is not None:
            for h, b in zip(hashes, blocks):
                tracker.describe(h, b)
        elif tracker.mode == "chunks":
            cs = self._chunk_size
            for i, h in enumerate(hashes):
                parent = hashes[i - 1] if i else None
                tracker.describe(h, ChunkBlocks((h,), cs, parent))

    async def flush(self) -> None:
        """Wait until every write-behind queued so far is on its tier (disk, remote)."""
        for tier in self._write_behind:
            await tier.flush()


def _as_bytes_view(payload: Any, index: int) -> memoryview:
    if hasattr(payload, "detach") and hasattr(payload, "numpy"):  # a torch tensor
        import torch  # importable: this is one of its tensors

        # Its bytes as uint8 first: numpy has no bfloat16 (nor fp8), the usual KV dtypes.
        payload = payload.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()
    try:
        return memoryview(payload).cast("B")
    except TypeError:
        raise ValueError(
            f"payloads[{index}]: chunk {index} is a {type(payload).__name__}, not a bytes-like "
            "object"
        ) from None
