"""KV events: which chunks lmprefetch's tiers hold, told in vLLM's KV-event schema.

Cache-aware routers (llm-d's KV-cache manager, NVIDIA Dynamo) place requests by listening to
vLLM's KV events: ``BlockStored`` when a block becomes available on some medium, ``BlockRemoved``
when it goes, ``AllBlocksCleared`` when a publisher forgets everything.  lmprefetch tells its
routers about its own tiers the same way, so an existing subscriber reads its stream unchanged:

* the **schema** below mirrors ``vllm.distributed.kv_events`` (vLLM 0.34) field for field, with
  the same msgspec settings, so the msgpack bytes decode with vLLM's own ``KVEventBatch``;
* the **tracker** (:class:`KVEventTracker`) listens to the tiers (each tier calls
  :meth:`KVEventTracker.stored` and :meth:`KVEventTracker.removed` where its index changes) and
  turns their changes into events, exactly one ``BlockStored`` and one ``BlockRemoved`` per
  stored→removed transition of a chunk on a tier, however many code paths report it;
* :class:`RankEventMerger` combines the streams of several tensor-parallel ranks into one: a
  chunk is announced when every rank holds it and withdrawn when the first rank drops it (a
  lookup answers the minimum over ranks, so that is what a router can count on).

How a chunk is named in its events (its :class:`ChunkBlocks`):

* stored by the vLLM connector: vLLM's own block hashes of the chunk's blocks (what vLLM's
  GPU events and its offloading connector use), ``block_size`` = vLLM's block size, the
  chunk's token ids, the parent block's hash and the LoRA adapter;
* otherwise (``lmprefetch worker``, :meth:`~lmprefetch.prefetch.Engine.store`): the chunk is one
  block named by lmprefetch's chunk hash (:mod:`lmprefetch.hashing`), ``block_size`` =
  ``chunk_size``, with the token ids and parent when the store had them.

Media: the CPU tier is ``medium="CPU"``, the disk tier ``"STORAGE"`` with ``locality="LOCAL"``
and the Redis tier ``"STORAGE"`` with ``locality="REMOTE"`` (vLLM's own convention for its
file-system and object-store tiers); every event says ``ownership="lmprefetch"``.

Threads: the tracker is driven from the engine's Trio thread (tiers call it synchronously);
:meth:`KVEventTracker.take` may be called from any thread (a ``deque`` hands events over).
"""

from __future__ import annotations

import logging
from array import array
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from typing import Any, Final, Literal, TypeAlias

import msgspec

from ._stats import snapshot
from ._sync import RepeatedEvent
from .keys import ChunkKey, KeyMaker

__all__ = [
    "LOCAL",
    "MEDIUM_CPU",
    "MEDIUM_STORAGE",
    "OWNERSHIP",
    "REMOTE",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "ChunkBlocks",
    "EventMode",
    "KVEvent",
    "KVEventBatch",
    "KVEventCounters",
    "KVEventStatistics",
    "KVEventTracker",
    "RankEventMerger",
    "decode_batch",
    "encode_batch",
    "tier_medium",
]

log = logging.getLogger("lmprefetch.events")

#: A block hash as vLLM publishes it: ``bytes`` (its digest) or an ``int`` (vLLM with
#: ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``, and lmprefetch's own 64-bit chunk hashes).
ExternalBlockHash: TypeAlias = int | bytes

MEDIUM_CPU: Final = "CPU"
MEDIUM_STORAGE: Final = "STORAGE"
LOCAL: Final = "LOCAL"
REMOTE: Final = "REMOTE"
#: The ``ownership`` of every event lmprefetch emits.
OWNERSHIP: Final = "lmprefetch"

#: ``(medium, locality)`` of each tier, by tier name.
_TIER_MEDIA: Final[dict[str, tuple[str, str | None]]] = {
    "cpu": (MEDIUM_CPU, LOCAL),
    "disk": (MEDIUM_STORAGE, LOCAL),
    "redis": (MEDIUM_STORAGE, REMOTE),
}

#: How an engine emits events: ``"off"``; ``"chunks"`` (every chunk, named by its block
#: descriptor if it has one, else by lmprefetch's chunk hash; the stream starts with
#: ``AllBlocksCleared``); ``"described"`` (only chunks with a descriptor: the vLLM connector).
EventMode: TypeAlias = Literal["off", "chunks", "described"]


def tier_medium(tier_name: str) -> tuple[str, str | None]:
    """``(medium, locality)`` of a tier: see the module docstring; another tier is its name in
    capitals with no locality."""
    return _TIER_MEDIA.get(tier_name, (tier_name.upper(), None))


# -- the schema (vLLM 0.34's vllm/distributed/kv_events.py; older releases lack some fields) ------
class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the events: a msgpack map tagged ``"type"`` = the class name."""


class BlockStored(KVCacheEvent):
    """Blocks became available on ``medium``.

    ``block_hashes`` are the blocks in order; ``parent_block_hash`` is the block before the
    first one (``None``: the first block of a prompt, or not known); ``token_ids`` are the
    blocks' tokens (empty when not known); ``block_size`` is tokens per block.
    """

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    #: vLLM 0.33+: the tokens after each block that its hash covers (lookahead hashing, for
    #: EAGLE drafters).  lmprefetch's chunks are keyed by their own tokens only, so it never
    #: sets this (see ``supports_lookahead_block_hashes`` in docs/vllm.md).
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    """Blocks stopped being available on ``medium``."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    """The publisher forgot everything it announced before (an ``lmprefetch worker`` says
    this first whenever it starts, then announces what its disk tier holds)."""


KVEvent: TypeAlias = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One published message's payload: ``[ts, [event, ...]]`` (``data_parallel_rank`` when
    set), exactly as vLLM's ``KVEventBatch``."""

    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    """The msgpack payload of one published message."""
    return _encoder.encode(batch)


def decode_batch(payload: bytes | bytearray | memoryview) -> KVEventBatch:
    """Decode a payload (vLLM's publisher's too).

    Raises:
        msgspec.DecodeError: not a KV event batch.
    """
    return _decoder.decode(payload)


# -- what a chunk is called ---------------------------------------------------------------
class ChunkBlocks(msgspec.Struct, frozen=True, gc=False):
    """How one chunk is named in events (see the module docstring).

    Token ids are kept packed (``token_bytes``: signed 64-bit, native order) so that a tracker
    remembering thousands of chunks stays small; :meth:`tokens` unpacks them.
    """

    block_hashes: tuple[ExternalBlockHash, ...]
    block_size: int
    parent_block_hash: ExternalBlockHash | None = None
    token_bytes: bytes = b""
    lora_id: int | None = None
    lora_name: str | None = None

    @classmethod
    def make(
        cls,
        block_hashes: Sequence[ExternalBlockHash],
        block_size: int,
        *,
        parent_block_hash: ExternalBlockHash | None = None,
        token_ids: Iterable[int] = (),
        lora_id: int | None = None,
        lora_name: str | None = None,
    ) -> ChunkBlocks:
        return cls(
            tuple(block_hashes),
            block_size,
            parent_block_hash,
            array("q", map(int, token_ids)).tobytes(),
            lora_id,
            lora_name,
        )

    def tokens(self) -> list[int]:
        out = array("q")
        out.frombytes(self.token_bytes)
        return out.tolist()


# -- the tracker ---------------------------------------------------------------------------
class KVEventCounters(msgspec.Struct, gc=False):
    """The events a tracker emitted (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``),
    and dropped because ``kv_events_max_pending`` were waiting."""

    stored: int = 0
    removed: int = 0
    cleared: int = 0
    dropped: int = 0


class KVEventStatistics(KVEventCounters, frozen=True, gc=False):  # type: ignore[misc]
    """A snapshot of a tracker's counters (see :class:`KVEventCounters`), and the events
    waiting now."""

    pending: int = 0


class KVEventTracker:
    """Turns tier changes into events, exactly once per stored→removed transition.

    A chunk is *on* a tier when every one of its keys is (one key, or one per layer in
    layerwise mode).  When it gets on a tier the tracker emits ``BlockStored`` with that tier's
    medium, if it can name the chunk (a :class:`ChunkBlocks` given to :meth:`describe`, or, in
    ``"chunks"`` mode, lmprefetch's chunk hash); when it stops being on a tier, ``BlockRemoved``
    with the same hashes, if and only if it was announced.  A chunk that gets a descriptor
    later (the vLLM connector names a chunk its disk tier held since before a restart when a
    request loads it) is announced on every tier that holds it at that moment.

    Tiers may report the same change twice or report keys that are not theirs (the Redis tier
    reports every hole it finds): the tracker keeps the set of keys on each tier and only acts
    on changes.  Keys of another model, rank or dtype (a shared disk directory) are ignored.

    Args:
        keys: the engine's key maker (which keys are this engine's, and how many per chunk).
        chunk_size: tokens per chunk (the ``block_size`` of chunks named by their hash).
        mode: ``"chunks"`` or ``"described"`` (see :data:`EventMode`).
        max_pending: events waiting for :meth:`take`; past it new events are dropped and
            counted (``statistics().dropped``; one warning).
        orphan_limit: descriptors kept for chunks that are on no tier (a write-behind may still
            land them); the oldest beyond it are forgotten.
    """

    def __init__(
        self,
        keys: KeyMaker,
        *,
        chunk_size: int,
        mode: EventMode,
        max_pending: int,
        orphan_limit: int,
    ) -> None:
        if mode not in ("chunks", "described"):
            raise ValueError(f"mode: must be 'chunks' or 'described', got {mode!r}")
        self._keys = keys
        self._kpc = keys.keys_per_chunk
        self._chunk_size = chunk_size
        self.mode: EventMode = mode
        self._max_pending = max_pending
        self._orphan_limit = orphan_limit
        self._queue: deque[KVEvent] = deque()
        #: Set whenever an event is queued (the publisher waits on it).
        self.changed = RepeatedEvent()
        self._on_tier: dict[str, set[ChunkKey]] = {}
        self._parts: dict[tuple[str, int], int] = {}  # keys of a chunk on a tier
        self._announced: dict[tuple[str, int], tuple[ExternalBlockHash, ...]] = {}
        self._refs: dict[int, int] = {}  # keys of a chunk on any tier
        self._blocks: dict[int, ChunkBlocks] = {}
        self._orphans: OrderedDict[int, None] = OrderedDict()
        self._warned = False
        self._counters = KVEventCounters()

    # -- what tiers call (the Trio thread) ----------------------------------------------
    def stored(self, tier: str, key: ChunkKey) -> None:
        """``key`` is now on ``tier`` (a repeat is ignored)."""
        if not self._is_mine(key):
            return
        held = self._on_tier.setdefault(tier, set())
        if key in held:
            return
        held.add(key)
        h = key.chunk_hash
        slot = (tier, h)
        parts = self._parts.get(slot, 0) + 1
        self._parts[slot] = parts
        self._refs[h] = self._refs.get(h, 0) + 1
        self._orphans.pop(h, None)
        if parts == self._kpc:
            self._announce(tier, h)

    def removed(self, tier: str, key: ChunkKey) -> None:
        """``key`` is no longer on ``tier`` (ignored unless it was)."""
        held = self._on_tier.get(tier)
        if held is None or key not in held:
            return
        held.discard(key)
        h = key.chunk_hash
        slot = (tier, h)
        parts = self._parts[slot] - 1
        if parts:
            self._parts[slot] = parts
        else:
            del self._parts[slot]
        hashes = self._announced.pop(slot, None)
        if hashes is not None:
            medium, locality = tier_medium(tier)
            self._counters.removed += 1
            self._emit(BlockRemoved(list(hashes), medium, locality=locality, ownership=OWNERSHIP))
        refs = self._refs[h] - 1
        if refs:
            self._refs[h] = refs
        else:
            del self._refs[h]
            if h in self._blocks:
                self._orphan(h)

    # -- what the engine calls -----------------------------------------------------------
    def describe(self, chunk_hash: int, blocks: ChunkBlocks) -> None:
        """Name a chunk (the first name given sticks while the chunk is known); a chunk that
        is on some tier unannounced is announced there now."""
        if chunk_hash not in self._blocks:
            self._blocks[chunk_hash] = blocks
            if chunk_hash not in self._refs:
                self._orphan(chunk_hash)
                return
        if chunk_hash not in self._refs:
            return
        for tier in self._on_tier:
            if self._parts.get((tier, chunk_hash)) == self._kpc:
                self._announce(tier, chunk_hash)

    def clear_all(self) -> None:
        """Emit ``AllBlocksCleared`` (and forget what was announced: nothing is now)."""
        self._announced.clear()
        self._counters.cleared += 1
        self._emit(AllBlocksCleared())

    # -- what consumers call (any thread) -------------------------------------------------
    def take(self, max_events: int | None = None) -> list[KVEvent]:
        """The queued events, oldest first (at most ``max_events``); thread-safe."""
        out: list[KVEvent] = []
        queue = self._queue
        while queue and (max_events is None or len(out) < max_events):
            try:
                out.append(queue.popleft())
            except IndexError:  # another consumer took the last one
                break
        return out

    @property
    def pending(self) -> int:
        return len(self._queue)

    def statistics(self) -> KVEventStatistics:
        return snapshot(KVEventStatistics, self._counters, pending=len(self._queue))

    # -- internals -----------------------------------------------------------------------
    def _is_mine(self, key: ChunkKey) -> bool:
        k = self._keys
        return (
            key.model_name == k.model_name
            and key.world_size == k.world_size
            and key.rank == k.rank
            and key.kv_dtype == k.kv_dtype
            and (0 <= key.layer < self._kpc if k.layerwise else key.layer == -1)
        )

    def _announce(self, tier: str, h: int) -> None:
        slot = (tier, h)
        if slot in self._announced:
            return
        blocks = self._blocks.get(h)
        if blocks is None:
            if self.mode != "chunks":
                return
            blocks = ChunkBlocks((h,), self._chunk_size)
        if not blocks.block_hashes:
            return
        medium, locality = tier_medium(tier)
        self._announced[slot] = blocks.block_hashes
        self._counters.stored += 1
        self._emit(
            BlockStored(
                list(blocks.block_hashes),
                blocks.parent_block_hash,
                blocks.tokens(),
                blocks.block_size,
                blocks.lora_id,
                medium,
                blocks.lora_name,
                locality=locality,
                ownership=OWNERSHIP,
            )
        )

    def _orphan(self, h: int) -> None:
        orphans = self._orphans
        orphans[h] = None
        while len(orphans) > self._orphan_limit:
            old, _ = orphans.popitem(last=False)
            self._blocks.pop(old, None)

    def _emit(self, event: KVEvent) -> None:
        if len(self._queue) >= self._max_pending:
            self._counters.dropped += 1
            if not self._warned:
                self._warned = True
                log.warning(
                    "KV events: %d events wait for a consumer; dropping new ones "
                    "(kv_events_max_pending)",
                    len(self._queue),
                )
            return
        self._queue.append(event)
        self.changed.set()


# -- several ranks into one stream ----------------------------------------------------------
class RankEventMerger:
    """One stream for ``world_size`` ranks: ``BlockStored`` once every rank stored the blocks
    on that medium, ``BlockRemoved`` as soon as one rank removed them (if they were announced).

    Blocks are identified by ``(medium, locality, block hashes)``; every rank names a chunk
    the same way (the hashes come from the scheduler).  ``AllBlocksCleared`` from any rank
    clears everything.  Pure bookkeeping: not thread-safe, no I/O.
    """

    def __init__(self, world_size: int) -> None:
        if world_size < 1:
            raise ValueError(f"world_size: must be at least 1, got {world_size}")
        self.world_size = world_size
        self._holders: dict[tuple[object, ...], set[int]] = {}
        self._published: set[tuple[object, ...]] = set()
        self._out: list[KVEvent] = []

    def add(self, rank: int, event: KVEvent) -> None:
        if isinstance(event, AllBlocksCleared):
            self._holders.clear()
            self._published.clear()
            self._out.append(event)
            return
        ident = (event.medium, event.locality, tuple(event.block_hashes))
        if isinstance(event, BlockStored):
            holders = self._holders.setdefault(ident, set())
            if rank in holders:
                return
            holders.add(rank)
            if len(holders) == self.world_size and ident not in self._published:
                self._published.add(ident)
                self._out.append(event)
            return
        holders_now = self._holders.get(ident)
        if holders_now is None or rank not in holders_now:
            return
        holders_now.discard(rank)
        if not holders_now:
            del self._holders[ident]
        if ident in self._published:
            self._published.discard(ident)
            self._out.append(event)

    def take(self) -> list[KVEvent]:
        out, self._out = self._out, []
        return out
