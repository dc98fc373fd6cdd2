"""The prefetch engine: one worker rank's lookups, and claiming or cancelling what they hold.

Every lookup follows one lifecycle, kept by its record (:class:`~lmprefetch.lookup._Lookup`,
whose docstring holds the state table): it starts LOADING, and either holds the chunks it
loaded (HELD) until a claim, a cancel or ``claim_ttl_s``, or ends (DONE) having answered.
A lookup's I/O — probing the tiers, the load policy's decision, the loads and the contiguous
prefix — reads top to bottom in :mod:`lmprefetch.lookup_io`.  The :class:`Engine` here holds
the parts (tiers, arena, limiter, policy, the table of lookups) and the API: it starts
lookups, moves a held result to a claimer (:meth:`Engine.claim`), releases it
(:meth:`Engine.cancel`), and runs the one expiry task that releases held results after
``claim_ttl_s`` (for every held result, with or without a task).

Cancel scopes replace LMCache's event manager: ``cancel`` is a transition of the record
(LOADING → CANCELLED cancels the task's scope; HELD → DONE releases at once), and "abort and
cleanup" is the task unwinding.  The write path is :mod:`lmprefetch.store`; how an engine is
put together from a configuration is :mod:`lmprefetch.wiring` (:func:`open_engine`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import msgspec
import trio

from ._stats import as_dict
from .config import PrefetchConfig
from .events import ChunkBlocks, KVEvent, KVEventStatistics, KVEventTracker
from .hashing import ChunkHasher
from .keys import ChunkKey, KeyMaker
from .limiter import LimiterStatistics, WeightedCapacityLimiter
from .lookup import AnswerCallback, LookupState, LookupStatistics, _Lookup, _Lookups
from .lookup_io import LookupIO
from .memory import Arena, ArenaStatistics, Buffer
from .policy import LoadPolicy, PrefillModel, make_policy
from .store import ChunkStore, StoreStatistics
from .tiers.base import Tier, TierStatistics, WriteBehindTier
from .tiers.cpu import CpuTier
from .trace import DecisionTrace

__all__ = ["Engine", "EngineStatistics", "LookupState"]


class EngineStatistics(msgspec.Struct, frozen=True, gc=False):
    """One engine's state and counters, each component's in its own value.

    :meth:`as_dict` is what :meth:`Engine.stats` returns."""

    rank: int
    world_size: int
    lookups: LookupStatistics
    store: StoreStatistics
    limiter: LimiterStatistics
    arena: ArenaStatistics
    #: Pins held on every tier now.
    pinned_chunks: int
    #: Arena bytes (whole slots) and chunks the CPU tier caches.
    cpu_resident_bytes: int
    cpu_resident_chunks: int
    #: Each tier's counters, in probe order.
    tiers: tuple[tuple[str, TierStatistics], ...]
    #: The KV events' counters, ``None`` when events are off.
    kv_events: KVEventStatistics | None

    def tier(self, name: str) -> TierStatistics:
        """The counters of the tier called ``name``.

        Raises:
            KeyError: the engine has no such tier.
        """
        for tier_name, statistics in self.tiers:
            if tier_name == name:
                return statistics
        raise KeyError(name)

    def as_dict(self) -> dict[str, Any]:
        """The contract's keys at the top level (``inflight_lookups``, ``held_lookups``,
        ``pinned_chunks``, ``limiter_used``, ``arena_total_bytes``, ``arena_used_bytes``,
        ``cpu_resident_bytes``, and ``"tiers": {name: counters}`` in probe order), then
        ``rank``, ``world_size``, ``cpu_resident_chunks``, and each component's counters as a
        dict under its own name: ``"lookups"``, ``"store"``, ``"limiter"``, ``"arena"``,
        ``"kv_events"`` (``None`` when events are off)."""
        return {
            "inflight_lookups": self.lookups.inflight,
            "held_lookups": self.lookups.held,
            "pinned_chunks": self.pinned_chunks,
            "limiter_used": self.limiter.used,
            "arena_total_bytes": self.arena.total_bytes,
            "arena_used_bytes": self.arena.used_bytes,
            "cpu_resident_bytes": self.cpu_resident_bytes,
            "tiers": {name: as_dict(t) for name, t in self.tiers},
            "rank": self.rank,
            "world_size": self.world_size,
            "cpu_resident_chunks": self.cpu_resident_chunks,
            "lookups": as_dict(self.lookups),
            "store": as_dict(self.store),
            "limiter": as_dict(self.limiter),
            "arena": as_dict(self.arena),
            "kv_events": None if self.kv_events is None else as_dict(self.kv_events),
        }


class Engine:
    """One worker rank's prefetch engine.  Create it with :func:`open_engine`.

    All methods run on the engine's Trio thread (``WorkerRuntime`` marshals calls from other
    threads); :class:`~lmprefetch.memory.Buffer` releases may come from any thread.
    """

    def __init__(
        self,
        config: PrefetchConfig,
        *,
        rank: int,
        world_size: int,
        nursery: trio.Nursery,
        arena: Arena,
        cpu: CpuTier,
        tiers: Sequence[Tier],
        kv_events: KVEventTracker | None = None,
        policy: LoadPolicy | None = None,
    ) -> None:
        self.config = config
        #: The KV-event tracker (``None`` when events are off; see :mod:`lmprefetch.events`).
        self.kv_events = kv_events
        self.rank = rank
        self.world_size = world_size
        self.hasher = ChunkHasher.from_config(config)
        self.keys = KeyMaker.from_config(config, rank=rank, world_size=world_size)
        self.arena = arena
        self.cpu = cpu
        self.tiers: tuple[Tier, ...] = tuple(tiers)
        kpc = config.keys_per_chunk
        # Half the arena in chunks: equal-size chunks cannot fragment more than 50 %.
        self.limiter = WeightedCapacityLimiter(max(1, arena.num_slots // kpc // 2))
        self._writes = ChunkStore(
            config,
            hasher=self.hasher,
            keys=self.keys,
            cpu=cpu,
            write_behind=[t for t in self.tiers if isinstance(t, WriteBehindTier)],
            kv_events=kv_events,
        )
        self._lookups = _Lookups(config.claim_ttl_s)
        #: The engine's prefill cost, fed by whoever sees its model steps (the vLLM worker).
        self.prefill = PrefillModel(config.prefill_tokens_per_s)
        #: Where each lookup's decision record goes (``decision_log``, or a subscriber; see
        #: :mod:`lmprefetch.trace`).
        self.trace = DecisionTrace(rank)
        self._io = LookupIO(
            config,
            keys=self.keys,
            arena=arena,
            cpu=cpu,
            tiers=self.tiers,
            limiter=self.limiter,
            policy=policy if policy is not None else make_policy(config.load_policy),
            prefill=self.prefill,
            lookups=self._lookups,
            nursery=nursery,
            trace=self.trace,
        )
        self._expiry_scope = trio.CancelScope()
        nursery.start_soon(self._expire_held, name="lmprefetch-expiry")

    @property
    def policy(self) -> LoadPolicy:
        """The load-or-recompute policy (``load_policy``; see :mod:`lmprefetch.policy`),
        chosen when the engine opens."""
        return self._io.policy

    @property
    def on_lookup_done(self) -> Callable[[int, float], None] | None:
        """Called with ``(hit_tokens, seconds since the lookup started)`` after every answer
        (the metrics hook), or ``None``."""
        return self._lookups.on_lookup_done

    @on_lookup_done.setter
    def on_lookup_done(self, hook: Callable[[int, float], None] | None) -> None:
        self._lookups.on_lookup_done = hook

    # -- lookups ----------------------------------------------------------------------
    def start_lookup(
        self,
        lookup_id: str,
        hashes: Sequence[int],
        offsets: Sequence[int],
        *,
        on_answer: AnswerCallback,
        seq: int = 0,
        deadline: float | None = None,
        skip_chunks: int = 0,
        tenant: bytes = b"",
        load_policy: str = "",
    ) -> _Lookup:
        """Start a lookup and return its record at once.

        ``on_answer(hit_tokens)`` is called exactly once, on the Trio thread: before this
        returns when memory can answer (a hit the CPU tier holds, a miss every tier rules out
        without I/O, a malformed request), else from the lookup's task.  A lookup running under
        the same id is cancelled first (the id was reused).

        Args:
            lookup_id: the engine's request id.
            hashes: one prefix-chained hash per chunk.
            offsets: tokens per chunk (not cumulative).
            seq: the client's sequence number for this use of ``lookup_id``.
            deadline: Trio time after which the lookup stops loading and answers with what
                it has (default: now + ``lookup_timeout_s``; the scheduler gives up then).
            skip_chunks: leading chunks the engine already has; they count as hits and are
                neither probed nor loaded.
            tenant: the request's tenant (:func:`~lmprefetch.codec.tenant_id` of its salt;
                ``b""``: the shared name space): with encryption on, chunks are opened with
                this tenant's key, and another tenant's chunk is a miss.
            load_policy: the load policy for this lookup: ``""`` (the configured
                ``load_policy``) or a built-in one's name (``"always"``, ``"never"``,
                ``"cost"``; see :mod:`lmprefetch.policy`).  Any other name is a malformed
                request: it answers 0.

        Returns:
            The lookup's record (its :attr:`~lmprefetch.lookup._Lookup.state` tells how far
            it got: DONE or HELD when it answered already).
        """
        return self._io.start(
            lookup_id,
            hashes,
            offsets,
            on_answer=on_answer,
            seq=seq,
            deadline=deadline,
            skip_chunks=skip_chunks,
            tenant=tenant,
            load_policy=load_policy,
        )

    async def lookup_and_prefetch(
        self,
        lookup_id: str,
        hashes: Sequence[int],
        offsets: Sequence[int],
        *,
        seq: int = 0,
        deadline: float | None = None,
        skip_chunks: int = 0,
        tenant: bytes = b"",
        load_policy: str = "",
    ) -> int:
        """Look up, prefetch, and return the hit-token count once the loads are done.

        The result stays held for :meth:`claim` (until ``claim_ttl_s``).  Arguments as
        :meth:`start_lookup`'s.

        Cancellation: if this call raises (``Cancelled`` at its one checkpoint, or anything
        else), the lookup it started is cancelled and has released everything by the time the
        exception leaves, even when its answer was already known; a call that raised had no
        lasting effect.  To keep that promise it waits, shielded, for the lookup's task to
        unwind (a tier read already running finishes first, as with
        ``trio.to_thread.run_sync``).
        """
        result: list[int] = []
        done = trio.Event()

        def on_answer(hit_tokens: int) -> None:
            result.append(hit_tokens)
            done.set()

        rec = self.start_lookup(
            lookup_id,
            hashes,
            offsets,
            on_answer=on_answer,
            seq=seq,
            deadline=deadline,
            skip_chunks=skip_chunks,
            tenant=tenant,
            load_policy=load_policy,
        )
        try:
            await done.wait()
        except BaseException:
            # Trio's rule: a call that raised (Cancelled above all) had no lasting effect.
            # The answer may be known already (memory answers before the wait, and an answer
            # can land between the cancellation and this task running again), so the lookup
            # is cancelled whatever its state, releasing what it holds at once; a task still
            # loading owns pins, limiter weight and buffers until it unwinds (a disk read in
            # flight finishes first): wait for that, shielded.
            rec.cancel()
            with trio.CancelScope(shield=True):
                await rec.wait_unwound()
            raise
        return result[0]

    # -- claim and cancel -------------------------------------------------------------
    def take(self, lookup_id: str) -> list[tuple[ChunkKey, Buffer]]:
        """Move a held result to the caller, who must release every buffer (see :meth:`claim`).

        Returns an empty list for an unknown, unanswered, cancelled or expired id.
        """
        rec = self._lookups.by_id.get(lookup_id)
        return [] if rec is None else rec.claim()

    @contextmanager
    def claim(self, lookup_id: str) -> Iterator[list[tuple[ChunkKey, Buffer]]]:
        """``with engine.claim(id) as chunks:`` — the held ``(key, buffer)`` pairs, contiguous
        from the first looked-up chunk; every buffer is released when the block exits."""
        items = self.take(lookup_id)
        try:
            yield items
        finally:
            if items:
                self.arena.release_all([buf for _, buf in items])

    def cancel(self, lookup_id: str, *, seq: int | None = None) -> None:
        """Cancel a lookup and release what it owns (synchronous, idempotent).

        A held result is released before this returns; a lookup still loading answers 0 and
        its task releases what its loads took at its next checkpoint.  With ``seq`` (from a
        cleanup message), a lookup started with a newer sequence number is left alone;
        ``seq`` 0 or ``None`` cancels whatever runs under ``lookup_id``.
        """
        rec = self._lookups.by_id.get(lookup_id)
        if rec is None or (seq and rec.seq > seq):
            return
        rec.cancel()

    def cancel_all(self) -> None:
        """Cancel every lookup (as :meth:`cancel` does, one by one)."""
        self._lookups.cancel_all()

    def note_malformed_request(self) -> None:
        """Count a request that a front end (the lookup server) rejected before it reached
        :meth:`start_lookup`; it shows in ``statistics().lookups.malformed``."""
        self._lookups.note_malformed()

    def current_seq(self, lookup_id: str) -> int | None:
        """The sequence number of the lookup running or held under ``lookup_id``, if any."""
        rec = self._lookups.by_id.get(lookup_id)
        return None if rec is None else rec.seq

    def policy_counters(self) -> dict[str, int]:
        """The load policy's decision counters (``policy_loaded``, ``policy_truncated``,
        ``policy_skipped``, ``deadline_cut``).  Any thread: it only reads integers, so a
        reading taken while a lookup runs may be one decision behind."""
        c = self._lookups.counters
        return {
            "policy_loaded": c.policy_loaded,
            "policy_truncated": c.policy_truncated,
            "policy_skipped": c.policy_skipped,
            "policy_unprobed": c.policy_unprobed,
            "deadline_cut": c.deadline_cut,
        }

    def lookup_tier_tokens(self, lookup_id: str) -> tuple[tuple[str, int], ...]:
        """The hit tokens each tier served a lookup that holds its result, in prefix order
        (``((tier name, tokens), ...)``; the skipped chunks are not counted), else ``()``."""
        rec = self._lookups.by_id.get(lookup_id)
        return () if rec is None or rec.state is not LookupState.HELD else rec.tier_tokens

    def lookup_state(self, lookup_id: str) -> LookupState | None:
        """The state of the lookup running or held under ``lookup_id`` (LOADING or HELD), or
        ``None`` (unknown, answered without a result to hold, cancelled, claimed, expired)."""
        rec = self._lookups.by_id.get(lookup_id)
        return None if rec is None else rec.state

    # -- store: the write path (lmprefetch.store) -------------------------------------
    async def store(
        self,
        token_ids: Sequence[int] | Any,
        payloads: Sequence[Any],
        *,
        salt: bytes | None = None,
    ) -> int:
        """Store chunk payloads for a prompt: ``payloads[i]`` is chunk ``i``'s bytes.

        The CPU tier takes them now; disk and remote tiers get them write-behind.  Returns the
        number of leading chunks stored; when the CPU tier cannot take more (everything
        pinned) it stores what fits.  ``salt`` stores them in a tenant's name space (see
        :func:`~lmprefetch.hashing.tenant_salt`): only lookups hashed with the same salt find
        them, and with encryption on they are sealed with that tenant's key.

        Cancellation: a checkpoint before each chunk; a cancelled store keeps the whole
        chunks stored before it, each queued for write-behind once.

        Raises:
            ValueError: more payloads than chunks, or a payload longer than ``chunk_bytes``
                (or, in layerwise mode, not divisible by ``num_layers``); nothing is stored.
        """
        return await self._writes.store(token_ids, payloads, salt)

    async def store_hashes(
        self,
        hashes: Sequence[int],
        payloads: Sequence[Any],
        *,
        blocks: Sequence[ChunkBlocks] | None = None,
        tenant: bytes = b"",
    ) -> int:
        """:meth:`store` with precomputed chunk hashes.

        ``blocks[i]`` names chunk ``i`` in KV events (the vLLM connector gives vLLM's block
        hashes); without it, events name a chunk by its hash (in ``"chunks"`` mode only).
        ``tenant`` (:func:`~lmprefetch.codec.tenant_id` of the salt the hashes were salted
        with) is whom the chunks are sealed for, with encryption on.
        """
        return await self._writes.store_hashes(hashes, payloads, blocks, tenant)

    def describe_chunks(self, hashes: Sequence[int], blocks: Sequence[ChunkBlocks] | None) -> None:
        """Name chunks for KV events (see :meth:`~lmprefetch.events.KVEventTracker.describe`):
        ``blocks[i]`` names ``hashes[i]``; with ``blocks`` ``None``, in ``"chunks"`` mode, each
        chunk is named by its hash, its parent being the hash before it.  A chunk some tier
        holds unannounced (a disk tier's chunk from before a restart) is announced now.  A
        no-op when events are off."""
        self._writes.describe_chunks(hashes, blocks)

    def take_kv_events(self, max_events: int | None = None) -> list[KVEvent]:
        """The KV events queued so far (empty when events are off); any thread."""
        tracker = self.kv_events
        return [] if tracker is None else tracker.take(max_events)

    async def flush(self) -> None:
        """Wait until every write-behind queued so far is on its tier (disk, remote)."""
        await self._writes.flush()

    # -- state ------------------------------------------------------------------------
    def statistics(self) -> EngineStatistics:
        """A snapshot of the engine's state and counters, component by component."""
        return EngineStatistics(
            rank=self.rank,
            world_size=self.world_size,
            lookups=self._lookups.statistics(),
            store=self._writes.statistics(),
            limiter=self.limiter.statistics(),
            arena=self.arena.statistics(),
            pinned_chunks=sum(t.pinned_count() for t in self.tiers),
            cpu_resident_bytes=self.cpu.resident_bytes,
            cpu_resident_chunks=len(self.cpu),
            tiers=tuple((t.name, t.stats.statistics()) for t in self.tiers),
            kv_events=None if self.kv_events is None else self.kv_events.statistics(),
        )

    def stats(self) -> dict[str, Any]:
        """:meth:`statistics` as a dict (see :meth:`EngineStatistics.as_dict`)."""
        return self.statistics().as_dict()

    async def wait_quiet(self) -> None:
        """Wait until no lookup is loading or held: every lookup has answered, and each one
        that held a result saw it claimed, cancelled or expired.  By then the lookups own
        nothing (no pin, no limiter weight, no buffer but those claimers hold).  Always a
        checkpoint."""
        await self._lookups.wait_quiet()
        while self._io.calibrating:  # background measurements of tiers own loads too
            await self._io.wait_calibrated()
            await self._lookups.wait_quiet()

    def is_idle(self) -> bool:
        """Nothing in flight or held, and the conservation invariant holds: no pin, no limiter
        weight, and no arena byte outside the CPU tier."""
        lookups = self._lookups
        return bool(
            lookups.inflight == 0
            and lookups.held == 0
            and self._io.calibrating == 0
            and all(t.pinned_count() == 0 for t in self.tiers)
            and self.limiter.used == 0
            and self.arena.used_bytes == self.cpu.resident_bytes
        )

    async def _expire_held(self) -> None:
        with self._expiry_scope:
            await self._lookups.expire_held()

    def _close(self) -> None:
        """Start closing (synchronous): cancel every lookup (held results are released at
        once) and stop the expiry task; new lookups answer 0."""
        self._io.close()
        self._lookups.cancel_all()
        self._expiry_scope.cancel()
