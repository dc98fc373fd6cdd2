"""The prefetch engine: one Trio task per lookup, owning every pin and buffer it takes.

Read one lookup's life top to bottom in :meth:`Engine._run_lookup`:

1. Keys and ``cum_tokens`` come from ``(hashes, offsets)``: ``cum_tokens[i]`` is the number of
   tokens in the first ``i`` chunks.
2. Tiers are probed in order on the keys no earlier tier hit (:meth:`Engine._probe_and_load`).
   A probe pins what it counts; the pins are registered with the lookup's exit stack before the
   next checkpoint.  A tier with no hit is skipped and the next one gets the same keys; a tier
   that raises or times out ends the prefix there.
3. Each tier's load starts at once: the CPU tier's hits are zero-copy (the lookup takes an owner
   reference on the cached buffers, synchronously); other tiers load in the lookup's nursery,
   under the weighted limiter (weight = chunks), into freshly allocated arena buffers, while the
   next tier is probed.  Allocation failure is a shorter prefix, never a wait.
4. After the loads, the answer is the number of tokens in the chunks loaded *contiguously* from
   the first chunk; everything past the first hole is released at once.
5. Exactly one answer is given, also when the lookup fails or is cancelled first (``finally``).
6. The loaded buffers are held until :meth:`Engine.claim` moves them to the claimer,
   :meth:`Engine.cancel` drops them, or ``claim_ttl_s`` passes.  Leaving the task (its exit
   stack) releases whatever it still owns.

Cancel scopes replace LMCache's event manager: ``cancel`` is ``scope.cancel()`` plus a synchronous
release of a held result, and "abort and cleanup" is the task unwinding.
"""

from __future__ import annotations

import enum
import heapq
import logging
import math
import os
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import AsyncExitStack, ExitStack, asynccontextmanager, contextmanager
from itertools import accumulate, count
from typing import Any, Literal, cast

import trio

from ._sync import AsyncValue
from .config import PrefetchConfig
from .events import ChunkBlocks, EventMode, KVEvent, KVEventTracker
from .hashing import ChunkHasher
from .keys import ChunkKey, KeyMaker
from .limiter import WeightedCapacityLimiter
from .memory import Arena, Buffer
from .tiers.base import Tier, WriteBehindTier, ZeroCopyTier
from .tiers.cpu import CpuTier

__all__ = ["Engine", "LookupState", "open_engine"]

log = logging.getLogger("lmprefetch.engine")

AnswerCallback = Callable[[int], None]

#: The expiry heap is compacted when it holds twice this many entries (or twice the number of
#: results it held after the last compaction, if more).
_EXPIRIES_COMPACT_MIN = 1024

#: An arena pre-fault this small runs on the Trio thread (a few hundred pages, well under a
#: millisecond): a thread hop would cost more.
_PREFAULT_INLINE_BYTES = 1 << 20


class LookupState(enum.Enum):
    LOADING = "loading"  # probing and loading; no answer yet
    HELD = "held"  # answered > 0; holding buffers for a claim
    CLAIMED = "claimed"  # buffers moved to a claimer
    DONE = "done"  # the task has ended; owns nothing


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

    __slots__ = ("buffers", "keys", "loaded", "n_chunks", "pins", "tier")

    def __init__(self, tier: Tier, keys: list[ChunkKey], n_chunks: int, pins: _Pins):
        self.tier = tier
        self.keys = keys
        self.n_chunks = n_chunks
        self.pins = pins
        self.buffers: list[Buffer] = []  # owned by this part until moved to the lookup
        self.loaded = 0  # whole chunks loaded contiguously from the part's first

    def release_buffers(self, start: int = 0) -> None:
        tail, self.buffers = self.buffers[start:], self.buffers[:start]
        for buf in tail:
            buf.release()


class _Lookup:
    """One lookup's record, shared between its task and ``claim``/``cancel``: its state, the
    buffers it owns, and every ownership transition.

    Only the methods below change :attr:`state` or :attr:`loaded`:

    =========  ========================================  =========  ==========================
    from       event                                     to         the loaded buffers
    =========  ========================================  =========  ==========================
    LOADING    answered with chunks (:meth:`hold`)       HELD       owned by this record
    LOADING    answered 0, failed, or cancelled:          DONE       none (the loads' buffers
               the task ends (:meth:`release`)                      are released by the task)
    HELD       :meth:`claim`                             CLAIMED    move to the claimer, who
                                                                    releases each on leaving
                                                                    its claim block
    HELD       :meth:`release` (cancel, cleanup, the     DONE       released at once,
               id reused, ``claim_ttl_s``, close)                   synchronously
    CLAIMED    the task ends (:meth:`release`)           CLAIMED    (the claimer's)
    DONE       anything                                  DONE       (none)
    =========  ========================================  =========  ==========================

    A lookup answered without a task (a full CPU hit, ``has_task`` False) is born HELD; the
    engine's expiry task plays the task's part for its ``claim_ttl_s``.
    """

    __slots__ = (
        "_on_answer",
        "answer",
        "deadline",
        "ended",
        "has_task",
        "loaded",
        "lookup_id",
        "scope",
        "seq",
        "state",
    )

    def __init__(
        self, lookup_id: str, seq: int, deadline: float, on_answer: AnswerCallback
    ) -> None:
        self.lookup_id = lookup_id
        self.seq = seq
        self.deadline = deadline
        self.scope = trio.CancelScope()
        self.state = LookupState.LOADING
        #: ``(key, buffer)`` pairs this record owns: filled synchronously right before
        #: :meth:`hold` (no checkpoint between), emptied by :meth:`claim` or :meth:`release`.
        self.loaded: list[tuple[ChunkKey, Buffer]] = []
        self.answer: int | None = None
        self.has_task = True  # False: answered synchronously; the expiry task ends its hold
        self.ended: trio.Event | None = None  # made by whoever waits for the task to end
        self._on_answer = on_answer

    def __repr__(self) -> str:
        return (
            f"<lookup {self.lookup_id!r} seq={self.seq} {self.state.value} "
            f"answer={self.answer} chunks_held={len(self.loaded)}>"
        )

    def give_answer(self, hit_tokens: int) -> bool:
        """Answer exactly once; ``False`` if the answer callback raised (it is logged)."""
        if self.answer is not None:
            return True
        self.answer = hit_tokens
        return _call_back(self._on_answer, hit_tokens, self.lookup_id)

    def hold(self) -> None:
        """LOADING → HELD: keep :attr:`loaded` for a claim."""
        assert self.state is LookupState.LOADING and self.loaded
        self.state = LookupState.HELD

    def claim(self) -> list[tuple[ChunkKey, Buffer]]:
        """HELD → CLAIMED: move the held pairs to the caller (empty in any other state)."""
        if self.state is not LookupState.HELD:
            return []
        items, self.loaded = self.loaded, []
        self.state = LookupState.CLAIMED
        return items

    def release(self) -> None:
        """Release every buffer this record owns, at once (synchronous, idempotent); the
        lookup is DONE unless it was claimed."""
        loaded, self.loaded = self.loaded, []
        if loaded:
            loaded[0][1].arena.release_all([buf for _, buf in loaded])
        if self.state is not LookupState.CLAIMED:
            self.state = LookupState.DONE


def _call_back(on_answer: AnswerCallback, hit_tokens: int, lookup_id: str) -> bool:
    try:
        on_answer(hit_tokens)
    except Exception:  # a broken callback must not break the engine, but it is a bug
        log.exception("answer callback for lookup %s failed", lookup_id)
        return False
    return True


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
    ) -> None:
        self.config = config
        #: The KV-event tracker (``None`` when events are off; see :mod:`lmprefetch.events`).
        self.kv_events = kv_events
        self.rank = rank
        self.world_size = world_size
        self.hasher = ChunkHasher(
            config.chunk_size, config.hash_algorithm, config.save_partial_chunks
        )
        self.keys = KeyMaker(
            config.model_name,
            world_size,
            rank,
            config.kv_dtype,
            layerwise=config.layerwise,
            num_layers=config.num_layers,
        )
        self.arena = arena
        self.cpu = cpu
        self.tiers: tuple[Tier, ...] = tuple(tiers)
        # What each tier can do, decided once: zero-copy hits are taken synchronously
        # (references on cached buffers); write-behind tiers get a copy of every store.
        self._probe_order: tuple[tuple[Tier, bool], ...] = tuple(
            (t, isinstance(t, ZeroCopyTier)) for t in self.tiers
        )
        self._other_tiers = tuple(t for t in self.tiers if t is not cpu)
        self._write_behind: tuple[WriteBehindTier, ...] = tuple(
            t for t in self.tiers if isinstance(t, WriteBehindTier)
        )
        self._kpc = config.keys_per_chunk
        # Half the arena in chunks: equal-size chunks cannot fragment more than 50 %.
        self.limiter = WeightedCapacityLimiter(max(1, arena.num_slots // self._kpc // 2))
        self._nursery = nursery
        self._lookups: dict[str, _Lookup] = {}  # the current lookup of each id
        self._live: set[_Lookup] = set()  # every lookup whose task has not ended
        self._tasks_alive = AsyncValue(0)  # len(self._live), for wait_quiet()
        # Results answered without a task (full CPU hits): (expiry time, tie-break, record).
        self._expiries: list[tuple[float, int, _Lookup]] = []
        self._expiry_scope = trio.CancelScope()
        self._expiry_ties = count()  # orders equal deadlines; never compares records
        self._expiries_compact_at = _EXPIRIES_COMPACT_MIN
        self._expiry_task_scope = trio.CancelScope()
        nursery.start_soon(self._expire_held, name="lmprefetch-expiry")
        self._closed = False
        self.counters: dict[str, int] = dict.fromkeys(
            (
                "lookups",
                "lookup_hits",
                "lookup_misses",
                "hit_tokens",
                "lookups_claimed",
                "lookups_cancelled",
                "lookups_expired",
                "lookups_failed",
                "malformed_requests",
                "deadline_expired",
                "chunks_stored",
                "store_rejected_chunks",
            ),
            0,
        )
        #: Called with (hit_tokens, seconds) after every answer (metrics hook).
        self.on_lookup_done: Callable[[int, float], None] | None = None

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
    ) -> _Lookup | None:
        """Start a lookup and return at once.

        ``on_answer(hit_tokens)`` is called exactly once, on the Trio thread: maybe before this
        returns (a malformed request, a miss known without I/O), else from the lookup's task.
        A running lookup with the same id is cancelled first (the id was reused).

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
            The lookup's record, or ``None`` if it was answered already.
        """
        started = trio.current_time()
        self.counters["lookups"] += 1
        old = self._lookups.pop(lookup_id, None)
        if old is not None:
            self._cancel_record(old)
        n_chunks = len(hashes)
        if (
            len(offsets) != n_chunks
            or not 0 <= skip_chunks <= n_chunks
            or (n_chunks and min(offsets) <= 0)
        ):
            self.counters["malformed_requests"] += 1
            self._answer_now(lookup_id, on_answer, 0, started)
            return None
        if self._closed:
            self._answer_now(lookup_id, on_answer, 0, started)
            return None
        if deadline is None:
            deadline = started + self.config.lookup_timeout_s
        elif deadline <= started:
            self.counters["deadline_expired"] += 1
            self._answer_now(lookup_id, on_answer, 0, started)
            return None
        cum = [0, *accumulate(offsets)]
        if skip_chunks == n_chunks:
            self._answer_now(lookup_id, on_answer, cum[n_chunks], started)
            return None
        rec = self._try_without_task(
            lookup_id, hashes, cum, skip_chunks, seq, deadline, on_answer, started
        )
        if rec is not False:
            return rec
        keys = self.keys.keys(hashes)
        rec = _Lookup(lookup_id, seq, deadline, on_answer)
        self._lookups[lookup_id] = rec
        self._live.add(rec)
        self._tasks_alive.value = len(self._live)
        self._nursery.start_soon(
            self._run_lookup, rec, keys, cum, skip_chunks, started, name=f"lookup:{lookup_id}"
        )
        return rec

    def _try_without_task(
        self,
        lookup_id: str,
        hashes: Sequence[int],
        cum: list[int],
        skip_chunks: int,
        seq: int,
        deadline: float,
        on_answer: AnswerCallback,
        started: float,
    ) -> _Lookup | Literal[False] | None:
        """Answer at once when no I/O is needed, else return ``False``.

        A lookup needs no task when the CPU tier holds the whole prompt, or holds a prefix
        that every other tier can rule out going on from (``contains_now`` is ``False``):
        then probing is a dictionary walk and loading is taking owner references, all
        synchronous.  Such a result is held like any other, and the engine's expiry task
        releases it after ``claim_ttl_s`` unless a claim or cancel comes first.
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
                        return False
                break
            firsts.append(nxt)
            hit += 1
        if hit == skip_chunks:
            # A miss every tier can rule out without I/O: answer now, hold nothing.
            self._answer_now(lookup_id, on_answer, cum[skip_chunks], started)
            return None
        # One key per chunk is its first key; layerwise chunks have a key per layer.
        keys = firsts if kpc == 1 else self.keys.keys(hashes[skip_chunks:hit])
        buffers = cpu.acquire(keys)
        whole = len(buffers) // kpc * kpc
        for buf in buffers[whole:]:
            buf.release()
        if whole == 0:
            self._answer_now(lookup_id, on_answer, cum[skip_chunks], started)
            return None
        rec = _Lookup(lookup_id, seq, deadline, on_answer)
        rec.has_task = False
        rec.loaded = list(zip(keys, buffers[:whole]))
        rec.hold()
        self._lookups[lookup_id] = rec
        expires = started + self.config.claim_ttl_s
        heap = self._expiries
        heapq.heappush(heap, (expires, next(self._expiry_ties), rec))
        if len(heap) >= 2 * self._expiries_compact_at:
            # Claimed and cancelled results stay in the heap until their time comes (lazy
            # deletion); drop them now and then, so the heap tracks the results really held
            # rather than the lookup rate times claim_ttl_s.  Amortised O(1) per push.
            heap[:] = [entry for entry in heap if entry[2].state is LookupState.HELD]
            heapq.heapify(heap)
            self._expiries_compact_at = max(_EXPIRIES_COMPACT_MIN, len(heap))
        if expires < self._expiry_scope.deadline:
            self._expiry_scope.deadline = expires
        tokens = cum[skip_chunks + whole // kpc]
        self._count_answer(tokens, started, rec.give_answer(tokens))
        return rec

    async def _expire_held(self) -> None:
        """Release results that were answered without a task once ``claim_ttl_s`` passes."""
        heap = self._expiries
        with self._expiry_task_scope:
            await self._expire_loop(heap)

    async def _expire_loop(self, heap: list[tuple[float, int, _Lookup]]) -> None:
        while True:
            now = trio.current_time()
            while heap and heap[0][0] <= now:
                _, _, rec = heapq.heappop(heap)
                if rec.state is LookupState.HELD:
                    self.counters["lookups_expired"] += 1
                    self._end_held(rec)
            self._expiry_scope = trio.CancelScope(deadline=heap[0][0] if heap else math.inf)
            with self._expiry_scope:
                await trio.sleep_forever()

    def _end_held(self, rec: _Lookup) -> None:
        """Release a held result and forget it (synchronous)."""
        rec.release()
        if self._lookups.get(rec.lookup_id) is rec:
            del self._lookups[rec.lookup_id]

    def _answer_now(
        self, lookup_id: str, on_answer: AnswerCallback, hit_tokens: int, started: float
    ) -> None:
        self._count_answer(hit_tokens, started, _call_back(on_answer, hit_tokens, lookup_id))

    def _count_answer(self, hit_tokens: int, started: float, delivered: bool) -> None:
        if not delivered:  # the answer callback raised: a bug, counted where tests look
            self.counters["lookups_failed"] += 1
        if hit_tokens > 0:
            self.counters["lookup_hits"] += 1
            self.counters["hit_tokens"] += hit_tokens
        else:
            self.counters["lookup_misses"] += 1
        if self.on_lookup_done is not None:
            self.on_lookup_done(hit_tokens, trio.current_time() - started)

    async def _run_lookup(
        self,
        rec: _Lookup,
        keys: list[ChunkKey],
        cum: list[int],
        skip_chunks: int,
        started: float,
    ) -> None:
        try:
            with rec.scope, ExitStack() as owned:
                # Whatever the record still owns when the task ends is released here.
                owned.callback(rec.release)
                try:
                    chunks = await self._probe_and_load(rec, keys, skip_chunks, owned)
                except Exception:
                    # Not a tier's failure (those end the prefix inside): a bug, said loudly.
                    log.exception("lookup %s failed; answering 0", rec.lookup_id)
                    self.counters["lookups_failed"] += 1
                    rec.release()
                    chunks = 0
                if rec.loaded:
                    rec.hold()  # before the answer: whoever the answer wakes finds it held
                else:
                    chunks = min(chunks, skip_chunks)
                self._count_answer(cum[chunks], started, rec.give_answer(cum[chunks]))
                if rec.state is not LookupState.HELD:
                    return
                await trio.sleep(self.config.claim_ttl_s)
                self.counters["lookups_expired"] += 1
        finally:
            if rec.answer is None:  # cancelled or failed before the answer
                self._count_answer(0, started, rec.give_answer(0))
            rec.release()  # owns nothing by now; DONE unless claimed
            if self._lookups.get(rec.lookup_id) is rec:
                del self._lookups[rec.lookup_id]
            self._live.discard(rec)
            self._tasks_alive.value = len(self._live)
            if rec.ended is not None:
                rec.ended.set()

    async def _probe_and_load(
        self, rec: _Lookup, keys: list[ChunkKey], skip_chunks: int, owned: ExitStack
    ) -> int:
        """Probe tiers, run their loads, keep the contiguous prefix; returns its chunk count
        (including ``skip_chunks``).  The kept buffers end up in ``rec.loaded``."""
        kpc = self._kpc
        n_chunks = len(keys) // kpc
        next_chunk = skip_chunks
        parts: list[_Part] = []

        # Parts own their buffers until the contiguous ones move to ``rec.loaded``.
        @owned.callback
        def release_parts() -> None:
            for part in parts:
                part.release_buffers()

        tier_timeout = self.config.tier_timeout_s
        with trio.move_on_at(rec.deadline):
            async with trio.open_nursery() as loads:
                for tier, zero_copy in self._probe_order:
                    if next_chunk >= n_chunks:
                        break  # everything hit: stop probing early
                    remaining = keys[next_chunk * kpc :]
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
                    raw = max(0, min(raw, len(remaining)))
                    pins = _Pins(tier, remaining[:raw])
                    owned.callback(pins.release)
                    hit = raw // kpc
                    pins.release_from(hit * kpc)  # round down to whole chunks
                    if hit == 0:
                        continue  # the next tier gets the same keys
                    part = _Part(tier, remaining[: hit * kpc], hit, pins)
                    parts.append(part)
                    next_chunk += hit
                    if zero_copy:
                        self._take_zero_copy_hits(part)
                    else:
                        loads.start_soon(self._load_part, part)
        # Keep the contiguous prefix; release everything past the first hole.
        total = skip_chunks
        hole = False
        for part in parts:
            if hole:
                part.release_buffers()
                continue
            keep = part.loaded * kpc
            rec.loaded.extend(zip(part.keys[:keep], part.buffers[:keep]))
            part.buffers = part.buffers[keep:]
            part.release_buffers()
            total += part.loaded
            hole = part.loaded < part.n_chunks
        return total

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
                if usable:
                    got = await self._tier_load(part.tier, part.keys[:usable], part.buffers)
                    part.loaded = got // kpc
                    part.release_buffers(part.loaded * kpc)
        finally:
            part.pins.release()

    async def _tier_load(
        self, tier: Tier, keys: Sequence[ChunkKey], buffers: Sequence[Buffer]
    ) -> int:
        """``tier.load`` bounded by ``tier_timeout_s``: the contiguous count it filled, and 0
        when the tier raises or times out (the prefix ends at this tier; D05)."""
        t0 = trio.current_time()
        tier.stats.load_started(t0)
        try:
            with trio.move_on_after(self.config.tier_timeout_s):
                got = await tier.load(keys, buffers)
                return max(0, min(got, len(keys)))
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

    # -- claim and cancel -------------------------------------------------------------
    def take(self, lookup_id: str) -> list[tuple[ChunkKey, Buffer]]:
        """Move a held result to the caller, who must release every buffer (see :meth:`claim`).

        Returns an empty list for an unknown, unanswered, cancelled or expired id.
        """
        rec = self._lookups.get(lookup_id)
        if rec is None:
            return []
        items = rec.claim()
        if not items:
            return []
        if rec.has_task:
            rec.scope.cancel()  # the task ends its hold and releases its pins
        else:
            del self._lookups[lookup_id]
        self.counters["lookups_claimed"] += 1
        return items

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

        With ``seq`` (from a cleanup message), a lookup started with a newer sequence number
        is left alone; ``seq`` 0 or ``None`` cancels whatever runs under ``lookup_id``.
        """
        rec = self._lookups.get(lookup_id)
        if rec is None:
            return
        if seq and rec.seq > seq:
            return
        del self._lookups[lookup_id]
        self._cancel_record(rec)

    def _cancel_record(self, rec: _Lookup) -> None:
        if rec.state in (LookupState.LOADING, LookupState.HELD):
            self.counters["lookups_cancelled"] += 1
        if rec.state is LookupState.HELD:
            rec.release()  # at once, not when the task next runs
        if rec.has_task:
            rec.scope.cancel()

    def cancel_all(self) -> None:
        for rec in list(self._lookups.values()):
            self.cancel(rec.lookup_id)

    def note_malformed_request(self) -> None:
        """Count a request that a front end (the lookup server) rejected before it reached
        :meth:`start_lookup`; it shows in ``stats()["malformed_requests"]``."""
        self.counters["malformed_requests"] += 1

    def current_seq(self, lookup_id: str) -> int | None:
        """The sequence number of the running lookup of ``lookup_id``, if any."""
        rec = self._lookups.get(lookup_id)
        return None if rec is None else rec.seq

    def lookup_state(self, lookup_id: str) -> LookupState | None:
        rec = self._lookups.get(lookup_id)
        return None if rec is None else rec.state

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
            # The answer may be known already (a full CPU hit answers before the wait, and an
            # answer can land between the cancellation and this task running again), so the
            # lookup is cancelled whatever its state, releasing what it holds at once.
            if rec is not None:
                if self._lookups.get(lookup_id) is rec:
                    self.cancel(lookup_id)
                if rec in self._live:
                    # Its task still owns pins, limiter weight and buffers until it unwinds
                    # (a disk read in flight finishes first): wait for that, shielded, so
                    # that everything is released by the time the exception leaves.
                    if rec.ended is None:
                        rec.ended = trio.Event()
                    with trio.CancelScope(shield=True):
                        await rec.ended.wait()
            raise
        return result[0]

    # -- store ------------------------------------------------------------------------
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

        Raises:
            ValueError: more payloads than chunks, or a payload longer than ``chunk_bytes``
                (or, in layerwise mode, not divisible by ``num_layers``); nothing is stored.
        """
        hashes = self.hasher.hash(token_ids, salt)
        blocks: list[ChunkBlocks] | None = None
        if self.kv_events is not None and self.kv_events.mode == "chunks":
            # Events name these chunks by their hashes, with their tokens and parents.
            tokens = list(token_ids)
            cs = self.config.chunk_size
            blocks = [
                ChunkBlocks.make(
                    (h,),
                    len(tokens[i * cs : (i + 1) * cs]),
                    parent_block_hash=hashes[i - 1] if i else None,
                    token_ids=tokens[i * cs : (i + 1) * cs],
                )
                for i, h in enumerate(hashes[: len(payloads)])
            ]
        return await self.store_hashes(hashes, payloads, blocks=blocks)

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
        if len(payloads) > len(hashes):
            raise ValueError(
                f"payloads: {len(payloads)} payloads for a prompt of {len(hashes)} chunks"
            )
        if blocks is not None and len(blocks) < len(payloads):
            raise ValueError(f"blocks: {len(blocks)} for {len(payloads)} payloads")
        views = [_as_bytes_view(p, i) for i, p in enumerate(payloads)]
        if self.kv_events is not None:
            self.describe_chunks(hashes[: len(views)], blocks)
        kpc = self._kpc
        for i, view in enumerate(views):
            if view.nbytes > self.config.chunk_bytes:
                raise ValueError(
                    f"payloads[{i}]: chunk {i} has {view.nbytes} bytes, more than chunk_bytes "
                    f"({self.config.chunk_bytes})"
                )
            if view.nbytes % kpc:
                raise ValueError(
                    f"payloads[{i}]: chunk {i} has {view.nbytes} bytes, not divisible by "
                    f"num_layers ({kpc})"
                )
        keys = self.keys.keys(hashes[: len(views)])
        stored = 0
        # This call's own chunks are not evicted to make room for its later chunks.
        with ExitStack() as mine:
            for i, view in enumerate(views):
                await trio.lowlevel.checkpoint()
                part = view.nbytes // kpc
                chunk_keys = keys[i * kpc : (i + 1) * kpc]
                bufs: list[Buffer] = []
                for layer, key in enumerate(chunk_keys):
                    buf = self.cpu.put(key, view[layer * part : (layer + 1) * part])
                    if buf is None:
                        break
                    mine.callback(buf.retain().release)
                    bufs.append(buf)
                if len(bufs) < kpc:
                    for key in chunk_keys[: len(bufs)]:
                        self.cpu.discard(key)
                    self.counters["store_rejected_chunks"] += len(views) - i
                    break
                for key, buf in zip(chunk_keys, bufs):
                    for tier in self._write_behind:
                        tier.enqueue_write(key, buf)
                stored += 1
                # Counted per chunk: a store cancelled at a later chunk keeps these.
                self.counters["chunks_stored"] += 1
        return stored

    def describe_chunks(
        self, hashes: Sequence[int], blocks: Sequence[ChunkBlocks] | None
    ) -> None:
        """Name chunks for KV events (see :meth:`~lmprefetch.events.KVEventTracker.describe`):
        ``blocks[i]`` names ``hashes[i]``; with ``blocks`` ``None``, in ``"chunks"`` mode, each
        chunk is named by its hash, its parent being the hash before it.  A chunk some tier
        holds unannounced (a disk tier's chunk from before a restart) is announced now.  A
        no-op when events are off."""
        tracker = self.kv_events
        if tracker is None:
            return
        if blocks is not None:
            for h, b in zip(hashes, blocks):
                tracker.describe(h, b)
        elif tracker.mode == "chunks":
            cs = self.config.chunk_size
            for i, h in enumerate(hashes):
                parent = hashes[i - 1] if i else None
                tracker.describe(h, ChunkBlocks((h,), cs, parent))

    def take_kv_events(self, max_events: int | None = None) -> list[KVEvent]:
        """The KV events queued so far (empty when events are off); any thread."""
        tracker = self.kv_events
        return [] if tracker is None else tracker.take(max_events)

    async def flush(self) -> None:
        """Wait until every write-behind queued so far is on its tier (disk, remote)."""
        for tier in self._write_behind:
            await tier.flush()

    # -- stats ------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """A snapshot of the engine's state and counters."""
        inflight = sum(1 for rec in self._live if rec.state is LookupState.LOADING)
        held = sum(1 for rec in self._lookups.values() if rec.state is LookupState.HELD)
        lim = self.limiter.statistics()
        out: dict[str, Any] = {
            "inflight_lookups": inflight,
            "held_lookups": held,
            "pinned_chunks": sum(t.pinned_count() for t in self.tiers),
            "limiter_used": lim.used,
            "limiter_total": lim.total,
            "limiter_waiting": lim.tasks_waiting,
            "arena_total_bytes": self.arena.total_bytes,
            "arena_used_bytes": self.arena.used_bytes,
            "cpu_resident_bytes": self.cpu.resident_bytes,
            "cpu_resident_chunks": len(self.cpu),
            "rank": self.rank,
            "world_size": self.world_size,
            "tiers": {t.name: t.stats.as_dict() for t in self.tiers},
        }
        out.update(self.counters)
        if self.kv_events is not None:
            out.update(self.kv_events.counters)
            out["events_pending"] = self.kv_events.pending
        return out

    async def wait_quiet(self) -> None:
        """Wait until no lookup task is alive (every lookup answered and released, or held
        lookups claimed, cancelled or expired)."""
        await self._tasks_alive.wait_value(_is_zero)  # always a checkpoint

    def is_idle(self) -> bool:
        """Nothing in flight or held, and the conservation invariant holds: no pin, no limiter
        weight, and no arena byte outside the CPU tier."""
        s = self.stats()
        return bool(
            s["inflight_lookups"] == 0
            and s["held_lookups"] == 0
            and s["pinned_chunks"] == 0
            and s["limiter_used"] == 0
            and s["arena_used_bytes"] == s["cpu_resident_bytes"]
        )

    def _close(self) -> None:
        self._closed = True
        self.cancel_all()
        self._expiry_task_scope.cancel()


def _is_zero(n: int) -> bool:
    return n == 0


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


def _key_owner(config: PrefetchConfig, rank: int, world_size: int) -> Callable[[ChunkKey], bool]:
    """Which chunk keys are this engine's: the ranks of one engine (and other models) may share
    a ``disk_path``; each indexes and evicts only its own files."""
    mine = (config.model_name, world_size, rank, config.kv_dtype)

    def owns(key: ChunkKey) -> bool:
        return (key.model_name, key.world_size, key.rank, key.kv_dtype) == mine

    return owns


def _check_machine_memory(cpu_bytes: int) -> None:
    """A ``cpu_bytes`` larger than the machine's memory is a configuration error, said at
    start-up: the arena would be created lazily and fail much later, inside a lookup."""
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # pragma: no cover - not POSIX
        return
    if physical > 0 and cpu_bytes > physical:
        raise ValueError(
            f"cpu_bytes: {cpu_bytes} bytes is more than this machine's memory "
            f"({physical} bytes); lower cpu_bytes"
        )


def _open_tracker(
    config: PrefetchConfig, rank: int, world_size: int, mode: EventMode, tiers: Sequence[Tier]
) -> KVEventTracker | None:
    """The KV-event tracker, listening to every tier that reports its changes; ``None`` when
    events are off.  What the disk tier holds already is registered (and announced in
    ``"chunks"`` mode, after ``AllBlocksCleared``)."""
    if mode == "off" or not config.kv_events:
        return None
    keys = KeyMaker(
        config.model_name,
        world_size,
        rank,
        config.kv_dtype,
        layerwise=config.layerwise,
        num_layers=config.num_layers,
    )
    tracker = KVEventTracker(
        keys,
        chunk_size=config.chunk_size,
        mode=mode,
        max_pending=config.kv_events_max_pending,
        # A chunk on no tier may still be landed by a write-behind: keep the names of as many
        # (a size with some slack, not a rule a test could pin down).
        orphan_limit=config.disk_write_queue + config.redis_write_queue + 64,  # pragma: no mutate
    )
    if mode == "chunks":
        tracker.clear_all()
    for tier in tiers:
        if hasattr(tier, "listener"):
            tier.listener = tracker
            existing = getattr(tier, "keys", None)
            if callable(existing):  # the disk tier's index, rebuilt from its directory
                for key in existing():  # least recently used first
                    tracker.stored(tier.name, key)
    return tracker


@asynccontextmanager
async def open_engine(
    config: PrefetchConfig,
    *,
    rank: int = 0,
    world_size: int = 1,
    extra_tiers: Sequence[Tier] = (),
    kv_events: EventMode = "off",
) -> AsyncIterator[Engine]:
    """Open one rank's engine: arena, tiers, and the nursery its lookups run in.

    ``extra_tiers`` are probed after the configured ones (CPU, disk, Redis, Mooncake), in
    order; those that are a :class:`~lmprefetch.tiers.base.WriteBehindTier` (``enqueue_write``
    and ``flush``) also get write-behind copies of stored chunks.  The engine does not close
    them.

    ``kv_events`` turns on KV events (:mod:`lmprefetch.events`; ``config.kv_events = False``
    keeps them off): ``"chunks"`` starts the stream with ``AllBlocksCleared`` and announces
    what the disk tier holds, named by chunk hash; ``"described"`` (the vLLM connector) only
    announces chunks named with :meth:`Engine.describe_chunks` or ``store_hashes(blocks=…)``.

    On exit every lookup is cancelled and releases what it owns, pending disk and remote writes
    are flushed, and the CPU tier is dropped.  A new engine on the same ``disk_path`` finds the
    chunks the old one stored.

    Raises:
        TypeError: ``config`` is not a :class:`PrefetchConfig`.
        ValueError: a setting this machine cannot honour, naming it: ``rank`` out of range,
            ``cpu_bytes`` more than the machine's memory, ``disk_path`` not a writable
            directory, ``redis_url`` without the ``redis`` extra installed (or
            ``mooncake_master`` without the ``mooncake`` extra).
    """
    if not isinstance(config, PrefetchConfig):
        raise TypeError(f"config: expected PrefetchConfig, got {type(config).__name__}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank: must be in [0, world_size={world_size}), got {rank}")
    _check_machine_memory(config.cpu_bytes)
    if config.redis_url is not None:
        try:
            import redis  # noqa: F401  (only to say which extra is missing)
        except ImportError:
            raise ValueError(
                "redis_url: the Redis tier needs the redis extra: "
                "python -m pip install 'lmprefetch[redis]'"
            ) from None
    if config.mooncake_master is not None:
        from .tiers.mooncake import check_installed

        check_installed()  # ValueError naming the extra
    try:
        arena = Arena(config.slot_bytes, config.arena_slots, backend=config.buffer_backend)
    except (MemoryError, OSError) as exc:
        raise ValueError(f"cpu_bytes: cannot allocate {config.cpu_bytes} bytes ({exc})") from None
    cpu = CpuTier(arena)
    tiers: list[Tier] = [cpu]
    try:
        prefault = min(config.arena_prefault_bytes, arena.total_bytes)
        if prefault > _PREFAULT_INLINE_BYTES:
            t0 = trio.current_time()
            done = await trio.to_thread.run_sync(arena.prefault, prefault)
            log.info(
                "arena: %d of %d bytes pre-faulted in %.3f s",
                done, arena.total_bytes, trio.current_time() - t0,
            )  # fmt: skip
        elif prefault:  # a few pages: less than a thread hop costs
            arena.prefault(prefault)
        async with AsyncExitStack() as stack:
            if config.disk_path is not None:
                from .tiers.disk import open_disk_tier

                disk = await stack.enter_async_context(
                    open_disk_tier(
                        config.disk_path,
                        capacity_bytes=config.disk_bytes,
                        read_threads=config.disk_read_threads,
                        write_queue=config.disk_write_queue,
                        o_direct=config.disk_o_direct,
                        owns=_key_owner(config, rank, world_size),
                    )
                )
                tiers.append(disk)
            if config.redis_url is not None:
                from .tiers.redis import open_redis_tier

                remote = await stack.enter_async_context(
                    open_redis_tier(
                        config.redis_url,
                        timeout_s=config.redis_timeout_s,
                        threads=config.redis_threads,
                        write_queue=config.redis_write_queue,
                        backoff_initial_s=config.redis_backoff_initial_s,
                        backoff_max_s=config.redis_backoff_max_s,
                    )
                )
                tiers.append(remote)
            if config.mooncake_master is not None:
                from .tiers.mooncake import open_mooncake_tier_from_config

                tiers.append(await stack.enter_async_context(
                    open_mooncake_tier_from_config(config, arena)
                ))  # fmt: skip
            tiers.extend(extra_tiers)
            tracker = _open_tracker(config, rank, world_size, kv_events, tiers)
            async with trio.open_nursery() as nursery:
                engine = Engine(
                    config,
                    rank=rank,
                    world_size=world_size,
                    nursery=nursery,
                    arena=arena,
                    cpu=cpu,
                    tiers=tiers,
                    kv_events=tracker,
                )
                try:
                    yield engine
                finally:
                    engine._close()
    finally:
        cpu.clear()
        if arena.used_slots == 0:
            arena.close()
        else:  # buffers still claimed by someone: leave the memory to the GC
            log.warning("engine closed with %d arena slots still claimed", arena.used_slots)
