"""The `Tier` protocol, and a base class with the default prefix probe.

A tier is one place chunks live: CPU memory, local disk, a remote store.  The prefetch engine
asks each tier, in order, how long a prefix of the remaining keys it holds
(:meth:`Tier.contains_prefix`, pinning what it counts so it cannot be evicted before the load),
then loads that prefix into arena buffers (:meth:`Tier.load`), which returns how many *leading*
keys it really filled (a tier never skips a hole, D13).

Rules every tier keeps:

* ``contains_prefix(keys, pin=True)`` pins exactly the keys it counts, and pins them only after
  its last checkpoint, so a cancelled probe leaves no pin behind.
* ``unpin`` and :meth:`ZeroCopyTier.acquire` are synchronous: release must work in ``finally``
  blocks under cancellation.
* ``load`` fills buffers in order and returns the contiguous count; a buffer past that count may
  hold anything and the caller releases it.  On cancellation ``load`` raises ``Cancelled`` and
  the caller releases every buffer; no write into a buffer may happen after ``load`` returns or
  raises (never abandon a thread that writes into a buffer).
* Errors raised by a tier end the lookup's prefix at that tier; they never fail a lookup.
* A tier derived from :class:`BaseTier` reports where its index changes: ``_note_stored(key)``
  when a key becomes loadable from it, ``_note_removed(key)`` when it stops being (evicted,
  removed, found missing or corrupt).  The engine's KV-event tracker listens
  (:mod:`lmprefetch.events`); with no listener these cost one attribute test.

The ``Dnn`` codes are LMCache's defects, the rows of the defect table in
``docs/cancellation.md`` ("The defects"), each with its ``test_dNN_`` regression tests.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from typing import Protocol, runtime_checkable

import msgspec
import trio

from .._stats import snapshot
from ..keys import ChunkKey
from ..memory import Buffer
from ..policy import EWMA_ALPHA, TierCost

__all__ = [
    "BaseTier",
    "ResidencyListener",
    "SyncProbeTier",
    "TenantTier",
    "Tier",
    "TierCounters",
    "TierStatistics",
    "TierStats",
    "WriteBehindTier",
    "ZeroCopyTier",
]


class TierCounters(msgspec.Struct, gc=False):
    """One tier's counters (every count since it opened) and cost estimates, declared once: the
    live ones are its :class:`TierStats`, a snapshot is a :class:`TierStatistics`."""

    #: Probes, and probes that found at least one key.
    probes: int = 0
    hits: int = 0
    #: Chunks and payload bytes loaded into arena buffers; stored into the tier.
    chunks_loaded: int = 0
    bytes_loaded: int = 0
    chunks_stored: int = 0
    bytes_stored: int = 0
    #: The bytes the tier moved and holds for those chunks after its codec stage
    #: (docs/codecs.md): equal to the payload bytes with the codec ``none`` and no encryption;
    #: the tier's own framing (a disk file's header, a Redis value's) not counted.
    encoded_bytes_loaded: int = 0
    encoded_bytes_stored: int = 0
    #: Seconds worker threads spent encoding the chunks written, and decoding those loaded.
    encode_seconds: float = 0.0
    decode_seconds: float = 0.0
    #: Stored chunks the codec stage refused on a load (damaged, of an unknown encoding,
    #: sealed for another tenant or chunk key, plaintext where encryption is on): misses.
    codec_misses: int = 0
    #: Write-behind chunks dropped instead of written, and entries evicted.
    writes_dropped: int = 0
    #: Write-behind chunks not written because the tier held them already (Redis: a chunk
    #: computed again, by a load policy's choice or by another engine).
    writes_skipped: int = 0
    evictions: int = 0
    #: Calls that failed or timed out.
    errors: int = 0
    #: Time spent in this tier's loads, summed over loads (overlapping loads add up).
    load_seconds: float = 0.0
    #: Wall time during which at least one load of this tier was in flight.
    busy_seconds: float = 0.0
    #: Moving averages of one call's latency (a probe: no payload) and of load throughput
    #: (payload bytes over a load's time past that latency); ``None`` until measured.  The
    #: ``cost`` load policy reads them (:mod:`lmprefetch.policy`).
    latency_s_ewma: float | None = None
    load_bytes_per_s_ewma: float | None = None
    #: Moving average of the write-behind's throughput (payload bytes over a batch's write
    #: call), kept by the tiers that write over a link (Redis, Mooncake); ``None`` until a
    #: batch was written.  Before any load measured the tier, it is the ``cost`` policy's
    #: estimate of a load (the tier's cost is ``stale`` meanwhile, see :meth:`TierStats.cost`).
    store_bytes_per_s_ewma: float | None = None
    #: Moving average of the codec stage's decoding rate (payload bytes per second of a
    #: thread's decoding); ``None`` until a chunk was decoded (never, with the codec ``none``
    #: and no encryption).
    decode_bytes_per_s_ewma: float | None = None
    #: Background loads that measured the tier's throughput (a load policy had dropped its
    #: chunks while the tier was not measured, or measured long ago).
    calibrations: int = 0


class TierStatistics(TierCounters, frozen=True, gc=False):  # type: ignore[misc]
    """A snapshot of one tier's counters (see :class:`TierCounters` for their meaning)."""


class TierStats(TierCounters, gc=False):
    """The counters a tier keeps, as it goes, and the bookkeeping of its busy time
    (:meth:`statistics` takes a frozen snapshot for ``Engine.statistics()`` and the metrics
    exporter)."""

    _loads_active: int = 0
    _busy_since: float = 0.0
    #: When (Trio time) the throughput was last measured; ``None``: never.
    _throughput_at: float | None = None

    def load_started(self, now: float) -> None:
        if self._loads_active == 0:
            self._busy_since = now
        self._loads_active += 1

    def load_ended(self, now: float, elapsed: float) -> None:
        self._loads_active -= 1
        self.load_seconds += elapsed
        if self._loads_active == 0:
            self.busy_seconds += now - self._busy_since

    def observe_probe(self, seconds: float) -> None:
        """A probe (one call, no payload) took ``seconds``: the tier's per-call latency."""
        self.latency_s_ewma = _ewma(self.latency_s_ewma, max(0.0, seconds))

    def observe_load(
        self,
        n_bytes: int,
        seconds: float,
        now: float | None = None,
        latency_s: float | None = None,
    ) -> None:
        """A load moved ``n_bytes`` in ``seconds`` (ending at Trio time ``now``); the time
        past the per-call latency (``latency_s``: the same lookup's probe, else the moving
        average) is the transfer, but at least half the load's time: a call's latency on a
        busy machine is mostly waiting for a thread, and a probe that waited longer than the
        load took must not leave the tier unmeasured (on a fast link it did, every time).
        The decoding (at the measured decode rate) is taken off first: it is not transfer."""
        latency = self.latency_s_ewma if latency_s is None else latency_s
        if self.decode_bytes_per_s_ewma:
            seconds = max(0.0, seconds - n_bytes / self.decode_bytes_per_s_ewma)
        transfer = max(seconds - (latency or 0.0), 0.5 * seconds)
        if n_bytes > 0 and transfer > 0:
            self.load_bytes_per_s_ewma = _ewma(self.load_bytes_per_s_ewma, n_bytes / transfer)
            if now is not None:
                self._throughput_at = now

    def observe_decoded(
        self, payload_bytes: int, encoded_bytes: int, seconds: float, *, decoded: bool = True
    ) -> None:
        """A load's worker thread turned ``encoded_bytes`` read from the tier into
        ``payload_bytes`` in ``seconds`` (``decoded``: through the codec stage; else the bytes
        were the payloads, and only the counts move)."""
        self.encoded_bytes_loaded += encoded_bytes
        if not decoded:
            return
        self.decode_seconds += seconds
        if payload_bytes > 0 and seconds > 0:
            self.decode_bytes_per_s_ewma = _ewma(
                self.decode_bytes_per_s_ewma, payload_bytes / seconds
            )

    def observe_store(self, n_bytes: int, seconds: float) -> None:
        """A write-behind batch moved ``n_bytes`` of payload to the tier in ``seconds`` (the
        write call alone: not its queueing, not its encoding); the time past the per-call
        latency is the transfer, but at least half the call's time, as for a load."""
        transfer = max(seconds - (self.latency_s_ewma or 0.0), 0.5 * seconds)
        if n_bytes > 0 and transfer > 0:
            self.store_bytes_per_s_ewma = _ewma(self.store_bytes_per_s_ewma, n_bytes / transfer)

    def throughput_age_s(self, now: float) -> float | None:
        """Seconds since the throughput was last measured (``None``: never, or not timed)."""
        at = self._throughput_at
        return None if at is None else max(0.0, now - at)

    def cost(self, now: float | None = None, max_age_s: float | None = None) -> TierCost:
        """The tier's cost estimate for a load policy; ``stale`` when no load measured the
        throughput yet, or (given ``now`` and ``max_age_s``) one measured it longer ago than
        that.  Before the first load measured it, the throughput is the write-behind's (a
        tier that writes over a link: the same link, measured by the writes of the chunks a
        lookup will find), or ``None`` where nothing was written yet."""
        age = None if now is None else self.throughput_age_s(now)
        bytes_per_s = self.load_bytes_per_s_ewma
        stale = bytes_per_s is None or (
            max_age_s is not None and age is not None and age > max_age_s
        )
        if bytes_per_s is None:
            bytes_per_s = self.store_bytes_per_s_ewma
        return TierCost(self.latency_s_ewma, bytes_per_s, stale, self.decode_bytes_per_s_ewma)

    def statistics(self) -> TierStatistics:
        return snapshot(TierStatistics, self)


def _ewma(old: float | None, sample: float) -> float:
    return sample if old is None else old + EWMA_ALPHA * (sample - old)


@runtime_checkable
class Tier(Protocol):
    """What the prefetch engine needs of a storage tier."""

    name: str
    stats: TierStats

    async def contains_prefix(self, keys: Sequence[ChunkKey], *, pin: bool) -> int:
        """How many leading ``keys`` this tier holds; pins them when ``pin``."""
        ...

    async def load(self, keys: Sequence[ChunkKey], buffers: Sequence[Buffer]) -> int:
        """Fill ``buffers[i]`` with ``keys[i]``'s payload, in order; the contiguous count filled."""
        ...

    def unpin(self, keys: Sequence[ChunkKey]) -> None:
        """Drop one pin from each key (synchronous)."""
        ...

    def pinned_count(self) -> int:
        """Pins currently held on this tier."""
        ...

    def contains_now(self, key: ChunkKey) -> bool | None:
        """A synchronous answer to "is ``key`` here?", or ``None`` when only an await can tell."""
        ...

    async def store(self, key: ChunkKey, payload: Buffer) -> bool:
        """Store ``payload.view()`` under ``key``; ``False`` when the tier cannot take it."""
        ...

    async def remove(self, key: ChunkKey) -> bool:
        """Forget ``key``; ``True`` if it was there."""
        ...

    async def aclose(self) -> None:
        """Flush pending writes and release everything the tier owns."""
        ...


class SyncProbeTier(Tier, Protocol):
    """A tier whose index is in memory (an optional capability, found by feature detection):
    :meth:`contains_prefix_now` is :meth:`Tier.contains_prefix` answered synchronously, with
    no checkpoint.  The engine's lookup probes such a tier without a cancel scope or a pass of
    Trio's scheduler."""

    def contains_prefix_now(self, keys: Sequence[ChunkKey], *, pin: bool) -> int:
        """How many leading ``keys`` this tier holds; pins them when ``pin`` (synchronous)."""
        ...


class TenantTier(Tier, Protocol):
    """A tier that seals its chunks per tenant (encryption on; its ``per_tenant`` is true):
    its loads and writes take the tenant they are for (``b""``: the shared name space)."""

    @property
    def per_tenant(self) -> bool: ...

    async def load(
        self, keys: Sequence[ChunkKey], buffers: Sequence[Buffer], *, tenant: bytes = b""
    ) -> int:
        """:meth:`Tier.load`, opening sealed chunks for ``tenant``."""
        ...

    def enqueue_write(self, key: ChunkKey, buf: Buffer, *, tenant: bytes = b"") -> bool:
        """:meth:`WriteBehindTier.enqueue_write`, sealing the chunk for ``tenant``."""
        ...


@runtime_checkable
class ZeroCopyTier(Tier, Protocol):
    """A tier whose hits are arena buffers already (the CPU tier): loading is taking a reference.

    The engine takes such a tier's hits synchronously with :meth:`acquire` instead of
    allocating buffers and awaiting :meth:`Tier.load`.
    """

    def acquire(self, keys: Sequence[ChunkKey]) -> list[Buffer]:
        """Owned references to the cached buffers of a prefix of ``keys`` (synchronous)."""
        ...


@runtime_checkable
class WriteBehindTier(Protocol):
    """A tier that takes stores behind the caller's back (disk, Redis): the engine hands it
    every chunk it stores (see :mod:`lmprefetch.tiers.writebehind`)."""

    def enqueue_write(self, key: ChunkKey, buf: Buffer) -> bool:
        """Queue a write of ``buf`` under ``key``, taking an owner reference; never blocks.
        ``False`` if the write was dropped (and counted)."""
        ...

    async def flush(self) -> None:
        """Wait until every write queued before the call was written or dropped."""
        ...


class ResidencyListener(Protocol):
    """Told about every change of what a tier holds (synchronously, on the Trio thread)."""

    def stored(self, tier: str, key: ChunkKey) -> None: ...

    def removed(self, tier: str, key: ChunkKey) -> None: ...


class BaseTier:
    """Pin bookkeeping and a default :meth:`contains_prefix` built on per-key :meth:`contains`.

    Subclasses implement :meth:`contains` (and :meth:`load`, :meth:`store`, ...).  Pins are a
    per-key count kept here; a subclass consults :meth:`is_pinned` before evicting.
    """

    name = "tier"

    def __init__(self) -> None:
        self._pins: dict[ChunkKey, int] = {}
        self._pin_total = 0
        self.stats = TierStats()
        #: Told where this tier's index changes (the engine's KV-event tracker), or ``None``.
        self.listener: ResidencyListener | None = None

    def _note_stored(self, key: ChunkKey) -> None:
        if self.listener is not None:
            self.listener.stored(self.name, key)

    def _note_removed(self, key: ChunkKey) -> None:
        if self.listener is not None:
            self.listener.removed(self.name, key)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} pinned={self._pin_total}>"

    async def contains(self, key: ChunkKey) -> bool:  # pragma: no cover - abstract
        raise NotImplementedError

    def contains_now(self, key: ChunkKey) -> bool | None:
        return None

    async def contains_prefix(self, keys: Sequence[ChunkKey], *, pin: bool) -> int:
        """Probe keys one by one until the first miss; pin the prefix after the last await."""
        self.stats.probes += 1
        n = 0
        for key in keys:
            if not await self.contains(key):
                break
            n += 1
        if n == 0:
            await trio.lowlevel.checkpoint()  # every probe is a checkpoint, hit or miss
        if pin:
            self.pin(keys[:n])
        if n:
            self.stats.hits += 1
        return n

    def _count_prefix(
        self, present: Container[ChunkKey], keys: Sequence[ChunkKey], pin: bool
    ) -> int:
        """The synchronous probe of a tier with an in-memory index: count the leading keys
        in ``present`` and pin them.  Callers checkpoint *before* it, so the pins are taken
        after the probe's last checkpoint."""
        self.stats.probes += 1
        n = 0
        for key in keys:
            if key not in present:
                break
            n += 1
        if n:
            self.stats.hits += 1
            if pin:
                self.pin(keys[:n])
        return n

    # -- pins -------------------------------------------------------------------------
    def pin(self, keys: Sequence[ChunkKey]) -> None:
        pins = self._pins
        for key in keys:
            pins[key] = pins.get(key, 0) + 1
        self._pin_total += len(keys)

    def unpin(self, keys: Sequence[ChunkKey]) -> None:
        pins = self._pins
        for key in keys:
            count = pins.get(key, 0)
            if count <= 0:
                raise RuntimeError(f"{self.name}: unpin of unpinned key {key.to_string()}")
            if count == 1:
                del pins[key]
            else:
                pins[key] = count - 1
        self._pin_total -= len(keys)

    def is_pinned(self, key: ChunkKey) -> bool:
        return key in self._pins

    def pinned_count(self) -> int:
        return self._pin_total
