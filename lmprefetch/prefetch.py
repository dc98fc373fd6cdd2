"""The prefetch engine: lookups, and claiming or cancelling what they hold.

Every lookup follows one lifecycle, kept by its record (:class:`~lmprefetch.lookup._Lookup`,
whose docstring holds the state table): it starts LOADING, and either holds the chunks it
loaded (HELD) until a claim, a cancel or ``claim_ttl_s``, or ends (DONE) having answered.
Read a lookup top to bottom here:

1. :meth:`Engine.start_lookup` builds ``cum_tokens`` from ``(hashes, offsets)``
   (``cum_tokens[i]`` is the number of tokens in the first ``i`` chunks) and starts the record.
2. When memory can answer (:meth:`Engine._hits_in_memory`: the CPU tier holds the prompt, or a
   prefix after which every other tier rules itself out without I/O), probing is a dictionary
   walk and loading is taking owner references on the cached buffers, so the record holds or
   ends at once, inside ``start_lookup``: no task (a 16-chunk CPU hit in tens of microseconds).
   The ``never`` policy answers here too, probing nothing.
3. Otherwise one task runs the lookup (:meth:`Engine._run_lookup`), in its own cancel scope.
   Tiers are probed in order on the keys no earlier tier hit (:meth:`Engine._probe_and_load`);
   a probe pins what it counts, and the pins are registered with the task's exit stack before
   the next checkpoint.  A tier with no hit is skipped; a tier that raises or times out ends
   the prefix there.  Each tier's load starts at once, in the task's nursery, under the
   weighted limiter (weight = chunks), into freshly allocated arena buffers, while the next
   tier is probed; allocation failure is a shorter prefix, never a wait.  Under a load policy
   other than ``always`` (:mod:`lmprefetch.policy`) the loads start once every tier was probed
   and the policy chose how many hit chunks to load; what it drops is released at once.  The
   loads stop at the lookup's deadline (or ``load_deadline_s``), keeping what they loaded.
4. After the loads the chunks loaded *contiguously* from the first chunk go to the record
   (``hold``), everything past the first hole is released at once, and the lookup answers; a
   lookup with nothing to hold answers when its task has released everything (``end``).
5. :meth:`Engine.claim` moves a held result to the claimer, :meth:`Engine.cancel` releases it,
   and the engine's one expiry task releases it after ``claim_ttl_s`` (for every held result,
   with or without a task).

Cancel scopes replace LMCache's event manager: ``cancel`` is a transition of the record
(LOADING → CANCELLED cancels the task's scope; HELD → DONE releases at once), and "abort and
cleanup" is the task unwinding.  The write path is :mod:`lmprefetch.store`; how an engine is
put together from a configuration is :mod:`lmprefetch.wiring` (:func:`open_engine`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from itertools import accumulate
from typing import Any, Final, cast

import msgspec
import trio

from .config import PrefetchConfig
from .events import ChunkBlocks, KVEvent, KVEventStatistics, KVEventTracker
from .hashing import ChunkHasher
from .keys import ChunkKey, KeyMaker
from .limiter import LimiterStatistics, WeightedCapacityLimiter
from .lookup import AnswerCallback, LookupState, LookupStatistics, _Lookup, _Lookups
from .memory import Arena, ArenaStatistics, Buffer
from .policy import (
    AlwaysLoad,
    HitPart,
    LoadPolicy,
    LoadRequest,
    NeverLoad,
    PrefillModel,
    make_policy,
)
from .store import ChunkStore, StoreStatistics
from .tiers.base import Tier, TierStatistics, WriteBehindTier, ZeroCopyTier
from .tiers.cpu import CpuTier

__all__ = ["Engine", "EngineStatistics", "LookupState"]

log = logging.getLogger("lmprefetch.engine")

#: With ``load_deadline_s`` set, a tier's part is loaded in up to this many calls, in order,
#: so that a cut keeps what already arrived (see :meth:`Engine._load_in_batches`).
DEADLINE_LOAD_BATCHES: Final = 8
#: ... and this many of them in flight at once.
DEADLINE_LOAD_DEPTH: Final = 3


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
            "tiers": {name: _as_dict(t) for name, t in self.tiers},
            "rank": self.rank,
            "world_size": self.world_size,
            "cpu_resident_chunks": self.cpu_resident_chunks,
            "lookups": _as_dict(self.lookups),
            "store": _as_dict(self.store),
            "limiter": _as_dict(self.limiter),
            "arena": _as_dict(self.arena),
            "kv_events": None if self.kv_events is None else _as_dict(self.kv_events),
        }


def _as_dict(value: Any) -> dict[str, Any]:
    return msgspec.structs.asdict(value)


def _release_pairs(pairs: list[tuple[ChunkKey, Buffer]]) -> None:
    for _, buf in pairs:
        buf.release()


class _Pins:
    """The pins one probe took on one tier; released exactly once, possibly in parts."""

    __slots__ = ("keys", "tier")

    def __init__(self, tier: Tier, keys: Sequence[ChunkKey]) -> None:
        self.tier = tier
        self.keys = list(keys)

    def release_from(self, index: int) -> None:
        tail, self.keys = self.keys[index:], self.keys[:index]
        if tail:
            self.tier.unpin(tail)

    def release(self) -> None:
        self.release_from(0)


class _Part:
    """One tier's share of a lookup: the ``n_chunks`` chunks after the earlier tiers' shares."""

    __slots__ = ("buffers", "keys", "loaded", "n_chunks", "pins", "tier", "zero_copy")

    def __init__(
        self, tier: Tier, keys: list[ChunkKey], n_chunks: int, pins: _Pins, zero_copy: bool
    ):
        self.tier = tier
        self.keys = keys
        self.n_chunks = n_chunks
        self.pins = pins
        self.zero_copy = zero_copy
        self.buffers: list[Buffer] = []  # owned by this part until moved to the lookup
        self.loaded = 0  # whole chunks loaded contiguously from the part's first

    def release_buffers(self, start: int = 0) -> None:
        tail, self.buffers = self.buffers[start:], self.buffers[:start]
        for buf in tail:
            buf.release()

    def truncate(self, n_chunks: int, kpc: int) -> None:
        """Keep only the first ``n_chunks`` chunks: the rest's pins and buffers are released
        now (synchronous)."""
        self.n_chunks = n_chunks
        self.keys = self.keys[: n_chunks * kpc]
        self.pins.release_from(n_chunks * kpc)
        self.release_buffers(n_chunks * kpc)
        self.loaded = min(self.loaded, n_chunks)


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
        # What each tier can do, decided once: zero-copy hits are taken synchronously
        # (references on cached buffers); write-behind tiers get a copy of every store.
        self._probe_order: tuple[tuple[Tier, bool], ...] = tuple(
            (t, isinstance(t, ZeroCopyTier)) for t in self.tiers
        )
        self._other_tiers = tuple(t for t in self.tiers if t is not cpu)
        self._kpc = config.keys_per_chunk
        # Half the arena in chunks: equal-size chunks cannot fragment more than 50 %.
        self.limiter = WeightedCapacityLimiter(max(1, arena.num_slots // self._kpc // 2))
        self._writes = ChunkStore(
            config,
            hasher=self.hasher,
            keys=self.keys,
            cpu=cpu,
            write_behind=[t for t in self.tiers if isinstance(t, WriteBehindTier)],
            kv_events=kv_events,
        )
        self._nursery = nursery
        self._lookups = _Lookups(config.claim_ttl_s)
        #: The load-or-recompute policy (``load_policy``; see :mod:`lmprefetch.policy`).
        self.policy: LoadPolicy = policy if policy is not None else make_policy(config.load_policy)
        #: The engine's prefill cost, fed by whoever sees its model steps (the vLLM worker).
        self.prefill = PrefillModel(config.prefill_tokens_per_s)
        self._expiry_scope = trio.CancelScope()
        nursery.start_soon(self._expire_held, name="lmprefetch-expiry")
        self._closed = False

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

        Returns:
            The lookup's record (its :attr:`~lmprefetch.lookup._Lookup.state` tells how far
            it got: DONE or HELD when it answered already).
        """
        started = trio.current_time()
        lookups = self._lookups
        old = lookups.by_id.get(lookup_id)
        if old is not None:
            old.cancel()
        rec = lookups.start(lookup_id, seq, on_answer, started)
        n_chunks = len(hashes)
        if (
            len(offsets) != n_chunks
            or not 0 <= skip_chunks <= n_chunks
            or (n_chunks and min(offsets) <= 0)
        ):
            lookups.counters.malformed += 1
            rec.end(0)
            return rec
        if self._closed:
            rec.end(0)
            return rec
        if deadline is None:
            deadline = started + self.config.lookup_timeout_s
        elif deadline <= started:
            lookups.counters.deadline_expired += 1
            rec.end(0)
            return rec
        if skip_chunks == n_chunks:
            rec.end(sum(offsets))
            return rec
        if type(self.policy) is NeverLoad:  # recompute: probe nothing, hold nothing
            lookups.counters.policy_skipped += 1
            rec.end(sum(offsets[:skip_chunks]) if skip_chunks else 0)
            return rec
        held = self._hits_in_memory(hashes, skip_chunks)
        if held is not None:  # memory answers: no task
            if held:
                kpc = self._kpc
                keep = found = len(held) // kpc
                if type(self.policy) is AlwaysLoad:  # the hot path: no decision to make
                    lookups.counters.policy_loaded += 1
                else:
                    cum = [0, *accumulate(offsets)]
                    keep = self._decide([(self.cpu, found, True)], cum, skip_chunks)
                    if keep < found:
                        _release_pairs(held[keep * kpc :])
                        del held[keep * kpc :]
            if held:
                hit_tokens = sum(offsets[: skip_chunks + keep])
                skipped = sum(offsets[:skip_chunks]) if skip_chunks else 0
                rec.tier_tokens = ((self.cpu.name, hit_tokens - skipped),)
                rec.hold(held, hit_tokens)
            else:
                rec.end(sum(offsets[:skip_chunks]) if skip_chunks else 0)
            return rec
        cum = [0, *accumulate(offsets)]
        keys = self.keys.keys(hashes)
        self._nursery.start_soon(
            self._run_lookup, rec, rec.run_in_task(), keys, cum, skip_chunks, deadline,
            name=f"lookup:{lookup_id}",
        )  # fmt: skip
        return rec

    def _hits_in_memory(
        self, hashes: Sequence[int], skip_chunks: int
    ) -> list[tuple[ChunkKey, Buffer]] | None:
        """The lookup's result when no tier needs I/O to tell, else ``None``.

        That is the case when the CPU tier holds the whole prompt, or holds a prefix that every
        other tier can rule out going on from (``contains_now`` is ``False``): then probing is a
        dictionary walk and loading is taking owner references, all synchronous.  Returns the
        ``(key, buffer)`` pairs of the whole chunks hit (owner references the caller now owns),
        possibly none.
        """
        cpu, kpc, n_chunks = self.cpu, self._kpc, len(hashes)
        first_key = self.keys.first_key
        firsts: list[ChunkKey] = []  # the first key of each chunk the CPU tier holds
        hit = skip_chunks
        while hit < n_chunks:
            nxt = first_key(hashes[hit])
            if not cpu.contains_now(nxt):
                # Can a tier after the CPU tier go on from here?  (None: it cannot tell.)
                for tier in self._other_tiers:
                    if tier.contains_now(nxt) is not False:
                        return None
                break
            firsts.append(nxt)
            hit += 1
        if hit == skip_chunks:
            return []  # a miss every tier rules out without I/O
        # One key per chunk is its first key; layerwise chunks have a key per layer.
        keys = firsts if kpc == 1 else self.keys.keys(hashes[skip_chunks:hit])
        buffers = cpu.acquire(keys)
        whole = len(buffers) // kpc * kpc
        for buf in buffers[whole:]:
            buf.release()
        return list(zip(keys, buffers[:whole]))

    def _decide(
        self,
        parts: Sequence[tuple[Tier, int, bool]],
        cum: Sequence[int] | None,
        skip_chunks: int,
    ) -> int:
        """How many of the hit chunks (``parts``: tier, chunks, zero-copy, in prefix order)
        to load: the policy's answer, clamped, and counted as loaded, truncated or skipped.
        ``cum`` is the lookup's cumulative token counts (``None`` is fine for ``always``).
        Synchronous, so no pin or buffer changes hands while it runs."""
        found = sum(n for _, n, _ in parts)
        counters = self._lookups.counters
        policy = self.policy
        keep = found
        if found and type(policy) is not AlwaysLoad:
            assert cum is not None
            chunk_bytes = self.config.chunk_bytes
            request = LoadRequest(
                parts=tuple(
                    HitPart(t.name, n, n * chunk_bytes, zc, t.stats.cost()) for t, n, zc in parts
                ),
                chunk_tokens=tuple(
                    cum[i + 1] - cum[i] for i in range(skip_chunks, skip_chunks + found)
                ),
                computed_tokens=cum[skip_chunks],
                prompt_tokens=cum[-1],
                prefill=self.prefill,
            )
            try:
                keep = max(0, min(found, int(policy.chunks_to_load(request))))
            except Exception:
                log.exception("load policy %r failed; loading the whole hit", policy)
                keep = found
        if found and type(policy) is not AlwaysLoad and log.isEnabledFor(logging.DEBUG):
            log.debug(
                "load policy %s: %d of %d hit chunks; tiers %s; prefill (s/token, s/attention) %s",
                type(policy).__name__, keep, found,
                [(t.name, n, t.stats.cost()) for t, n, _ in parts], self.prefill.coefficients(),
            )  # fmt: skip
        if not found:
            pass
        elif keep == found:
            counters.policy_loaded += 1
        elif keep:
            counters.policy_truncated += 1
        else:
            counters.policy_skipped += 1
        return keep

    async def _run_lookup(
        self,
        rec: _Lookup,
        scope: trio.CancelScope,
        keys: list[ChunkKey],
        cum: list[int],
        skip_chunks: int,
        deadline: float,
    ) -> None:
        """A lookup that needs I/O, start to end (see the module docstring)."""
        chunks = 0  # what a lookup that fails or is cancelled answers
        load_deadline_s = self.config.load_deadline_s
        if load_deadline_s is not None:
            deadline = min(deadline, rec.started + load_deadline_s)
        try:
            with scope, ExitStack() as owned:
                try:
                    total, loaded = await self._probe_and_load(
                        rec, keys, cum, skip_chunks, deadline, owned
                    )
                except Exception:
                    # Not a tier's failure (those end the prefix inside): a bug, said loudly.
                    log.exception("lookup %s failed; answering 0", rec.lookup_id)
                    self._lookups.counters.failed += 1
                else:
                    # No checkpoint since the loads ended: the pairs go to the record (or, if
                    # it was cancelled meanwhile, are released) before anything else runs.
                    if loaded and rec.hold(loaded, cum[total]):
                        return
                    chunks = skip_chunks  # nothing loaded: the skipped chunks still count
        finally:
            # Whatever the task took is released by now: a lookup that holds nothing
            # answers here (0 once cancelled); one that holds answered above.
            rec.end(cum[chunks])

    async def _probe_and_load(
        self,
        rec: _Lookup,
        keys: list[ChunkKey],
        cum: list[int],
        skip_chunks: int,
        deadline: float,
        owned: ExitStack,
    ) -> tuple[int, list[tuple[ChunkKey, Buffer]]]:
        """Probe tiers, run their loads, keep the contiguous prefix: its chunk count (with
        ``skip_chunks``) and its ``(key, buffer)`` pairs, which the caller now owns; the
        tokens each tier served go to ``rec.tier_tokens``.

        With the ``always`` policy each tier's load starts as soon as its probe answers.
        With any other, loads start once every tier was probed and the policy chose how
        many hit chunks to load (:meth:`_decide`); the pins (and zero-copy references) of
        the chunks past that point are released at once, before anything else runs.  At
        ``deadline`` (the lookup's, or its ``load_deadline_s``) the loads still running are
        cancelled: the prefix loaded by then is kept, and the cut is counted."""
        kpc = self._kpc
        defer = type(self.policy) is not AlwaysLoad
        n_chunks = len(keys) // kpc
        next_chunk = skip_chunks
        parts: list[_Part] = []

        # Parts own their buffers until the contiguous ones are handed out.
        @owned.callback
        def release_parts() -> None:
            for part in parts:
                part.release_buffers()

        tier_timeout = self.config.tier_timeout_s
        with trio.move_on_at(deadline) as budget:
            async with trio.open_nursery() as loads:
                for tier, zero_copy in self._probe_order:
                    if next_chunk >= n_chunks:
                        break  # everything hit: stop probing early
                    remaining = keys[next_chunk * kpc :]
                    probe_t0 = trio.current_time()
                    try:
                        with trio.move_on_after(tier_timeout) as probe:
                            raw = await tier.contains_prefix(remaining, pin=True)
                    except Exception:
                        log.warning(
                            "tier %s failed a probe; prefix ends there", tier.name, exc_info=True
                        )
                        tier.stats.errors += 1
                        break
                    if probe.cancelled_caught:
                        log.warning("tier %s probe timed out; prefix ends there", tier.name)
                        tier.stats.errors += 1
                        break
                    # No checkpoint from here until the part is registered.
                    tier.stats.observe_probe(trio.current_time() - probe_t0)
                    raw = max(0, min(raw, len(remaining)))
                    pins = _Pins(tier, remaining[:raw])
                    owned.callback(pins.release)
                    hit = raw // kpc
                    pins.release_from(hit * kpc)  # round down to whole chunks
                    if hit == 0:
                        continue  # the next tier gets the same keys
                    part = _Part(tier, remaining[: hit * kpc], hit, pins, zero_copy)
                    parts.append(part)
                    next_chunk += hit
                    if zero_copy:
                        self._take_zero_copy_hits(part)
                    elif not defer:
                        loads.start_soon(self._load_part, part)
                # No checkpoint from the last probe to the loads' start: the policy decides,
                # and what it drops is released now.
                keep = self._decide(
                    [(p.tier, p.n_chunks, p.zero_copy) for p in parts], cum, skip_chunks
                )
                if defer:
                    for part in parts:
                        part.truncate(min(part.n_chunks, keep), kpc)
                        keep -= part.n_chunks
                        if part.n_chunks and not part.zero_copy:
                            loads.start_soon(self._load_part, part)
        # Keep the contiguous prefix; release everything past the first hole.
        total = skip_chunks
        kept: list[tuple[ChunkKey, Buffer]] = []
        sources: list[tuple[str, int]] = []
        hole = False
        for part in parts:
            if hole:
                part.release_buffers()
                continue
            keep = part.loaded * kpc
            kept.extend(zip(part.keys[:keep], part.buffers[:keep]))
            part.buffers = part.buffers[keep:]
            part.release_buffers()
            if part.loaded:  # each tier has one part: its name appears once
                sources.append((part.tier.name, cum[total + part.loaded] - cum[total]))
            total += part.loaded
            hole = part.loaded < part.n_chunks
        if budget.cancelled_caught and (hole or next_chunk < n_chunks):
            # The deadline cut a load, or a probe that might have found more.
            self._lookups.counters.deadline_cut += 1
        rec.tier_tokens = tuple(sources)
        return total, kept

    def _take_zero_copy_hits(self, part: _Part) -> None:
        """Zero-copy: owner references on the cached buffers, taken synchronously."""
        tier = cast(ZeroCopyTier, part.tier)  # pragma: no mutate (a type, not a value)
        part.buffers = tier.acquire(part.keys)
        part.loaded = len(part.buffers) // self._kpc
        part.release_buffers(part.loaded * self._kpc)
        part.pins.release()  # the owner references now keep the entries from eviction

    async def _load_part(self, part: _Part) -> None:
        """Load one tier's hit chunks into new arena buffers, under the limiter.

        Only the tier's own ``load`` may fail softly (see :meth:`_tier_load`); an exception
        from anything else here is a bug in lmprefetch and fails the lookup, loudly.
        """
        kpc = self._kpc
        try:
            async with self.limiter.hold(part.n_chunks) as granted:
                want = granted * kpc
                self.cpu.make_room(want)
                part.buffers = self.arena.allocate_many(want)
                usable = len(part.buffers) // kpc * kpc
                part.release_buffers(usable)  # allocation failure: a shorter prefix
                if usable and self.config.load_deadline_s is not None and usable > kpc:
                    await self._load_in_batches(part, usable // kpc)
                    part.release_buffers(part.loaded * kpc)
                elif usable:
                    got = await self._tier_load(part.tier, part.keys[:usable], part.buffers)
                    part.loaded = got // kpc
                    part.release_buffers(part.loaded * kpc)
        finally:
            part.pins.release()

    async def _load_in_batches(self, part: _Part, chunks: int) -> None:
        """Load a part's first ``chunks`` chunks in up to :data:`DEADLINE_LOAD_BATCHES`
        calls, in order, :data:`DEADLINE_LOAD_DEPTH` at a time (which hides a call's round
        trip behind the previous call's transfer), so that when ``load_deadline_s`` cancels
        the loads, ``part.loaded`` is the prefix already in memory, not nothing.

        ``part.loaded`` moves forward as each batch ends, over the batches that ended whole
        and in order.  The tier's throughput is measured over the part (the bytes of that
        prefix over the time since the first call), also when the deadline cuts it: batches
        run side by side, so one batch's time would count the link's share of the others."""
        kpc = self._kpc
        tier = part.tier
        per = -(-chunks // DEADLINE_LOAD_BATCHES)
        bounds = [(lo, min(lo + per, chunks)) for lo in range(0, chunks, per)]
        filled: list[int | None] = [None] * len(bounds)  # whole chunks from each batch's first
        slots = trio.Semaphore(DEADLINE_LOAD_DEPTH)
        short = False  # a batch ended short: the batches after it cannot extend the prefix

        def advance() -> None:
            loaded = 0
            for (lo, hi), got in zip(bounds, filled):
                if got is None:
                    break
                loaded += got
                if lo + got < hi:
                    break
            part.loaded = loaded

        async def load_batch(index: int) -> None:
            nonlocal short
            lo, hi = bounds[index]
            try:
                got = await self._tier_load(
                    tier, part.keys[lo * kpc : hi * kpc], part.buffers[lo * kpc : hi * kpc],
                    observe=False,
                )  # fmt: skip
                filled[index] = got // kpc
                short = short or lo + got // kpc < hi
                advance()
            finally:
                slots.release()

        t0 = trio.current_time()
        try:
            async with trio.open_nursery() as batches:
                for index in range(len(bounds)):
                    await slots.acquire()
                    if short:
                        slots.release()
                        break
                    batches.start_soon(load_batch, index)
        finally:
            if part.loaded:
                n_bytes = sum(len(buf.view()) for buf in part.buffers[: part.loaded * kpc])
                tier.stats.observe_load(n_bytes, trio.current_time() - t0)

    async def _tier_load(
        self,
        tier: Tier,
        keys: Sequence[ChunkKey],
        buffers: Sequence[Buffer],
        *,
        observe: bool = True,
    ) -> int:
        """``tier.load`` bounded by ``tier_timeout_s``: the contiguous count it filled, and 0
        when the tier raises or times out (the prefix ends at this tier; D05).  ``observe``:
        the call's bytes and time feed the tier's throughput estimate."""
        t0 = trio.current_time()
        tier.stats.load_started(t0)
        try:
            with trio.move_on_after(self.config.tier_timeout_s):
                got = max(0, min(await tier.load(keys, buffers), len(keys)))
                if got and observe:
                    n_bytes = sum(len(buf.view()) for buf in buffers[:got])
                    tier.stats.observe_load(n_bytes, trio.current_time() - t0)
                return got
        except Exception:
            log.warning("tier %s failed a load; prefix ends there", tier.name, exc_info=True)
            tier.stats.errors += 1
            return 0
        finally:
            now = trio.current_time()
            tier.stats.load_ended(now, now - t0)
        log.warning("tier %s load timed out; prefix ends there", tier.name)
        tier.stats.errors += 1
        return 0

    async def lookup_and_prefetch(
        self,
        lookup_id: str,
        hashes: Sequence[int],
        offsets: Sequence[int],
        *,
        seq: int = 0,
        deadline: float | None = None,
        skip_chunks: int = 0,
    ) -> int:
        """Look up, prefetch, and return the hit-token count once the loads are done.

        The result stays held for :meth:`claim` (until ``claim_ttl_s``).

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
        self._lookups.counters.malformed += 1

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
        them.

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
    ) -> int:
        """:meth:`store` with precomputed chunk hashes.

        ``blocks[i]`` names chunk ``i`` in KV events (the vLLM connector gives vLLM's block
        hashes); without it, events name a chunk by its hash (in ``"chunks"`` mode only).
        """
        return await self._writes.store_hashes(hashes, payloads, blocks)

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

    def is_idle(self) -> bool:
        """Nothing in flight or held, and the conservation invariant holds: no pin, no limiter
        weight, and no arena byte outside the CPU tier."""
        lookups = self._lookups
        return bool(
            lookups.inflight == 0
            and lookups.held == 0
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
        self._closed = True
        self._lookups.cancel_all()
        self._expiry_scope.cancel()
