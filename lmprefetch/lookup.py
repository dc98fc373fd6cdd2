"""A lookup's record and its states: the one lifecycle every lookup follows.

:class:`_Lookup` is what :class:`~lmprefetch.prefetch.Engine` keeps per lookup, shared between
the lookup's I/O (:mod:`lmprefetch.lookup_io`), ``claim``, ``cancel`` and the expiry of
unclaimed results.  It is the only code that changes a lookup's state or what it owns, and
every change is one of the transitions in its docstring's table (the table the documentation
shows).  :class:`_Lookups` is the engine's table of records: the current record of each id,
how many are in each state, the expiry queue, and the lookup counters
(:class:`LookupCounters`), which only the table changes: on a record's transition, or when the
lookup's I/O tells it what it decided (its ``note_*`` methods).

Cancellation: nothing here awaits except :meth:`_Lookups.expire_held` (the engine's expiry task)
and :meth:`_Lookups.wait_quiet`; every transition is synchronous, so ``cancel`` and a claim
block's exit release at once, from any path, also while the lookup's task is being cancelled.
"""

from __future__ import annotations

import enum
import logging
import math
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Final

import msgspec
import trio

from ._stats import snapshot

if TYPE_CHECKING:
    from .keys import ChunkKey
    from .memory import Buffer

__all__ = ["LookupCounters", "LookupState", "LookupStatistics"]

log = logging.getLogger("lmprefetch.engine")

AnswerCallback = Callable[[int], None]
#: Told about every transition (tests): ``(record, from, event, to)``.
TransitionObserver = Callable[["_Lookup", "LookupState | None", str, "LookupState"], None]

#: The expiry queue is compacted when it holds twice this many entries (or twice the number of
#: results it held after the last compaction, if more).
_EXPIRIES_COMPACT_MIN: Final = 1024


class LookupState(enum.Enum):
    """Where a lookup is in its life (see :class:`_Lookup` for the transitions)."""

    LOADING = "loading"  #: probing and loading; no answer yet
    CANCELLED = "cancelled"  #: cancelled while loading; its task unwinds, then answers 0
    HELD = "held"  #: answered > 0; the record holds the buffers for a claim
    CLAIMED = "claimed"  #: the buffers moved to a claimer (final)
    DONE = "done"  #: answered and owns nothing (final)


_LOADING, _CANCELLED, _HELD, _CLAIMED, _DONE = (
    LookupState.LOADING,
    LookupState.CANCELLED,
    LookupState.HELD,
    LookupState.CLAIMED,
    LookupState.DONE,
)

#: The state table as data: ``(from, event, to)``; ``None`` is "before the record exists".
#: ``tests/test_schedules.py::test_the_state_table_is_the_docstrings`` keeps it equal to the
#: table in :class:`_Lookup`'s docstring, and ``tests/test_docs.py`` to the documentation's
#: diagram.
TRANSITIONS: Final = frozenset(
    {
        (None, "start", _LOADING),
        (_LOADING, "hold", _HELD),
        (_LOADING, "end", _DONE),
        (_LOADING, "cancel", _CANCELLED),
        (_CANCELLED, "end", _DONE),
        (_HELD, "claim", _CLAIMED),
        (_HELD, "cancel", _DONE),
        (_HELD, "expire", _DONE),
    }
)


class LookupCounters(msgspec.Struct, gc=False):
    """The lookup counters of one engine: every count since it opened.  The live counters are
    one instance that only the engine's table of lookups (:class:`_Lookups`) changes; a
    snapshot is a :class:`LookupStatistics`."""

    #: Lookups started.
    started: int = 0
    #: Answers above 0, and below or at 0.
    hits: int = 0
    misses: int = 0
    #: Tokens answered as cached, summed over hits.
    hit_tokens: int = 0
    #: Held results claimed, cancelled (in flight or held), and released unclaimed.
    claimed: int = 0
    cancelled: int = 0
    expired: int = 0
    #: Lookups that failed on a bug, or whose answer callback raised (each is logged).
    failed: int = 0
    #: Requests whose hashes and offsets make no sense (answered 0), and requests whose
    #: deadline had passed on arrival (answered 0).
    malformed: int = 0
    deadline_expired: int = 0
    #: The load policy's decisions on lookups that found a hit past the skipped chunks: the
    #: whole hit loaded, a shorter prefix loaded, nothing loaded (a policy that loads nothing,
    #: as ``never``, counts every lookup here); and lookups whose loads the deadline cut short
    #: (``load_deadline_s`` or ``lookup_timeout_s``), answering the prefix loaded by then.
    policy_loaded: int = 0
    policy_truncated: int = 0
    policy_skipped: int = 0
    deadline_cut: int = 0
    #: Lookups for which the load policy ruled a tier out before probing it (no load from it
    #: could have won: its chunks are recomputed without asking it).
    policy_unprobed: int = 0


class LookupStatistics(LookupCounters, frozen=True, gc=False):  # type: ignore[misc]
    """A snapshot of one engine's lookup counters, and the lookups in flight and held now."""

    #: Lookups loading (or unwinding after a cancel) and holding a result, now.
    inflight: int = 0
    held: int = 0


class _Lookup:
    """One lookup's record: its state, the buffers it holds, and every change of either.

    A lookup starts LOADING.  When memory can answer (the CPU tier holds the prompt, or every
    other tier rules out going on without I/O) the engine probes and answers inside
    ``start_lookup`` and the record moves on at once; otherwise a task probes and loads,
    owning the pins, limiter weight and buffers its loads take, and hands the record the
    contiguous prefix it loaded.  Either way the record changes only as this table says:

    | from | event | to | the record owns then |
    |---|---|---|---|
    | (none) | `start`: `Engine.start_lookup` | LOADING | nothing (its task owns what it loads) |
    | LOADING | `hold`: chunks loaded; answers their tokens | HELD | the loaded buffers |
    | LOADING | `end`: nothing to hold; answers | DONE | nothing |
    | LOADING | `cancel` | CANCELLED | nothing; its task unwinds, releasing its loads |
    | CANCELLED | `end`: the task has unwound; answers 0 | DONE | nothing |
    | HELD | `claim` | CLAIMED | nothing: the buffers are the claimer's |
    | HELD | `cancel` | DONE | nothing: released at once |
    | HELD | `expire`: `claim_ttl_s` passed unclaimed | DONE | nothing: released at once |

    * ``cancel`` is every way a lookup is given up: ``Engine.cancel`` (a cleanup message), its
      id reused by a new lookup, the caller of ``lookup_and_prefetch`` cancelled, the engine
      closing.
    * ``end`` without chunks covers a miss, a request that makes no sense, a deadline already
      passed, a closed engine, a lookup that found only its skipped chunks, and a failure (a
      bug, logged); a ``hold`` after a cancel releases what it is handed at once.
    * CLAIMED and DONE are final: there ``claim`` gives nothing and ``cancel`` does nothing.

    Every lookup answers exactly once: ``hold`` answers the held tokens, ``end`` what it is
    given, 0 once cancelled.  The answer comes after the transition, so whoever it wakes finds
    the record in its new state (a positive answer can always be claimed at once), and a
    cancelled lookup answers only after its task released everything.  ``claim``, ``cancel``
    and ``expire`` each empty the record's buffer list as they take it, so whichever comes
    second finds nothing.  Leaving LOADING or HELD for any state but HELD, the record leaves
    its engine's table of ids.
    """

    __slots__ = (
        "_ended",
        "_on_answer",
        "_table",
        "answer",
        "loaded",
        "lookup_id",
        "scope",
        "seq",
        "started",
        "state",
        "tier_tokens",
    )

    def __init__(
        self,
        table: _Lookups,
        lookup_id: str,
        seq: int,
        on_answer: AnswerCallback,
        started: float,
    ) -> None:
        self._table = table
        self.lookup_id = lookup_id
        self.seq = seq
        self.started = started
        self._on_answer = on_answer
        self.state = _LOADING
        #: ``(key, buffer)`` pairs held for a claim (HELD only).
        self.loaded: list[tuple[ChunkKey, Buffer]] = []
        self.answer: int | None = None
        #: The cancel scope of the lookup's task, if it has one (see :meth:`run_in_task`).
        self.scope: trio.CancelScope | None = None
        self._ended: trio.Event | None = None  # made by whoever waits for the task to end
        #: The hit tokens each tier served, in prefix order (skipped chunks not counted):
        #: ``((tier name, tokens), ...)``, set by ``hold``.
        self.tier_tokens: tuple[tuple[str, int], ...] = ()

    def __repr__(self) -> str:
        return (
            f"<lookup {self.lookup_id!r} seq={self.seq} {self.state.value} "
            f"answer={self.answer} chunks_held={len(self.loaded)}>"
        )

    # -- transitions ------------------------------------------------------------------------
    def _move(self, event: str, to: LookupState) -> None:
        frm, self.state = self.state, to
        self._table._moved(self, frm, event, to)

    def run_in_task(self) -> trio.CancelScope:
        """The cancel scope the lookup's task runs in (LOADING only): ``cancel`` cancels it."""
        self.scope = trio.CancelScope()
        return self.scope

    def hold(
        self,
        loaded: list[tuple[ChunkKey, Buffer]],
        hit_tokens: int,
        tier_tokens: tuple[tuple[str, int], ...],
    ) -> bool:
        """LOADING → HELD: take ownership of ``loaded`` (not empty) and answer ``hit_tokens``,
        of which ``tier_tokens`` says which tier served how many (see :attr:`tier_tokens`).

        Once CANCELLED, ``loaded`` is released at once and ``False`` returned: the lookup
        answers 0 when its task ends (:meth:`end`)."""
        if self.state is not _LOADING:
            _release(loaded)
            return False
        self.loaded = loaded
        self.tier_tokens = tier_tokens
        self._move("hold", _HELD)
        self._table._hold(self)
        self._give_answer(hit_tokens)
        return True

    def end(self, hit_tokens: int) -> None:
        """LOADING or CANCELLED → DONE, answering ``hit_tokens`` (0 once cancelled).  The
        record owns nothing here; call it after the lookup's task released everything."""
        state = self.state
        if state is _LOADING:
            self.state = _DONE  # as _move does, one call less on the path of every miss
            self._table._moved(self, _LOADING, "end", _DONE)
            self._give_answer(hit_tokens)
        elif state is _CANCELLED:
            self._move("end", _DONE)
            self._give_answer(0)
            if self._ended is not None:
                self._ended.set()

    def claim(self) -> list[tuple[ChunkKey, Buffer]]:
        """HELD → CLAIMED: move the held pairs to the caller (empty in any other state)."""
        if self.state is not _HELD:
            return []
        items, self.loaded = self.loaded, []
        self._move("claim", _CLAIMED)
        return items

    def cancel(self) -> None:
        """LOADING → CANCELLED (its task is cancelled), HELD → DONE (released at once);
        nothing in any other state.  Synchronous and idempotent."""
        state = self.state
        if state is _LOADING:
            self._move("cancel", _CANCELLED)
            if self.scope is not None:
                self.scope.cancel()
        elif state is _HELD:
            loaded, self.loaded = self.loaded, []
            self._move("cancel", _DONE)
            _release(loaded)

    def expire(self) -> None:
        """HELD → DONE after ``claim_ttl_s``, released at once (nothing in any other state)."""
        if self.state is _HELD:
            loaded, self.loaded = self.loaded, []
            self._move("expire", _DONE)
            _release(loaded)

    async def wait_unwound(self) -> None:
        """Wait until a CANCELLED lookup's task has released everything (at once in any other
        state).  Not a checkpoint when it need not wait; cancellable like ``Event.wait``."""
        if self.state is _CANCELLED:
            if self._ended is None:
                self._ended = trio.Event()
            await self._ended.wait()

    def _give_answer(self, hit_tokens: int) -> None:
        self.answer = hit_tokens
        try:
            self._on_answer(hit_tokens)
        except Exception:  # a broken callback must not break the engine, but it is a bug
            log.exception("answer callback for lookup %s failed", self.lookup_id)
            self._table.note_failed()
        self._table._answered(self, hit_tokens)


def _release(loaded: list[tuple[ChunkKey, Buffer]]) -> None:
    if loaded:
        loaded[0][1].arena.release_all([buf for _, buf in loaded])


class _Lookups:
    """The engine's lookups: the current record of each id, the count in each state, the
    expiry queue of held results, and the counters.  What is in it changes only when a record
    starts (:meth:`start`) or makes a transition (``_moved``, ``_hold``, ``_answered``, called
    by :class:`_Lookup`); the counters change there and in the ``note_*`` methods, which the
    lookup's I/O calls to say what it decided, and nowhere else.

    Args:
        claim_ttl_s: how long a held result waits for its claim.
    """

    def __init__(self, claim_ttl_s: float) -> None:
        self.claim_ttl_s = claim_ttl_s
        self.by_id: dict[str, _Lookup] = {}
        #: The live counters (read them; only this table changes them).
        self.counters = LookupCounters()
        self.inflight = 0  # LOADING or CANCELLED
        self.held = 0
        #: Called with (hit_tokens, seconds since the lookup started) after every answer.
        self.on_lookup_done: Callable[[int, float], None] | None = None
        #: Told about every transition (tests), or ``None``.
        self.observer: TransitionObserver | None = None
        # Held results in the order they expire (claim_ttl_s is one value and the clock does
        # not go back, so holding order is expiry order): (expiry time, record).  Claimed and
        # cancelled ones stay until their time comes or the queue is compacted.
        self._expiries: deque[tuple[float, _Lookup]] = deque()
        self._expiries_compact_at = _EXPIRIES_COMPACT_MIN
        self._expiry_wakeup = trio.CancelScope()
        # Where wait_quiet() waits: Trio's own parking lot, unparked when the last lookup
        # loading or held moves on (a transition pays one truth test when nobody waits).
        self._quiet = trio.lowlevel.ParkingLot()

    def start(self, lookup_id: str, seq: int, on_answer: AnswerCallback, started: float) -> _Lookup:
        """A new LOADING record, the current one of its id (cancel the old one first)."""
        rec = _Lookup(self, lookup_id, seq, on_answer, started)
        self.by_id[lookup_id] = rec
        self.counters.started += 1
        self.inflight += 1
        if self.observer is not None:
            self.observer(rec, None, "start", _LOADING)
        return rec

    # -- called by the records --------------------------------------------------------------
    def _moved(self, rec: _Lookup, frm: LookupState, event: str, to: LookupState) -> None:
        if frm is _HELD:
            self.held -= 1
        elif to is not _CANCELLED:  # out of LOADING or CANCELLED: no longer in flight
            self.inflight -= 1
        if to is _HELD:
            self.held += 1
        else:
            by_id = self.by_id
            if by_id.get(rec.lookup_id) is rec:
                del by_id[rec.lookup_id]
            if event != "end":
                counters = self.counters
                if event == "cancel":
                    counters.cancelled += 1
                elif event == "claim":
                    counters.claimed += 1
                else:
                    counters.expired += 1
        if self.observer is not None:
            self.observer(rec, frm, event, to)
        if self._quiet and not (self.inflight or self.held):
            self._quiet.unpark_all()

    def _answered(self, rec: _Lookup, hit_tokens: int) -> None:
        counters = self.counters
        if hit_tokens > 0:
            counters.hits += 1
            counters.hit_tokens += hit_tokens
        else:
            counters.misses += 1
        hook = self.on_lookup_done
        if hook is not None:
            hook(hit_tokens, trio.current_time() - rec.started)

    def _hold(self, rec: _Lookup) -> None:
        """Queue a held result's expiry (``claim_ttl_s`` from now)."""
        expires = trio.current_time() + self.claim_ttl_s
        queue = self._expiries
        if not queue:
            self._expiry_wakeup.deadline = expires
        queue.append((expires, rec))
        if len(queue) >= 2 * self._expiries_compact_at:
            # Lazy deletion leaves claimed and cancelled results in the queue until their
            # time; drop them now and then, so the queue tracks the results really held
            # rather than the lookup rate times claim_ttl_s.  Amortised O(1) per hold.
            kept = [entry for entry in queue if entry[1].state is _HELD]
            self._expiries = deque(kept)
            self._expiries_compact_at = max(_EXPIRIES_COMPACT_MIN, len(kept))

    # -- what the lookup's I/O decided --------------------------------------------------------
    def note_malformed(self) -> None:
        """A request that makes no sense (answered 0, or dropped by a front end)."""
        self.counters.malformed += 1

    def note_deadline_expired(self) -> None:
        """A request whose deadline had passed on arrival (answered 0)."""
        self.counters.deadline_expired += 1

    def note_failed(self) -> None:
        """A lookup failed on a bug, or its answer callback raised (logged where it happened)."""
        self.counters.failed += 1

    def note_decision(self, hit_chunks: int, load_chunks: int) -> None:
        """The load policy chose to load ``load_chunks`` of ``hit_chunks`` chunks (nothing is
        counted without a hit)."""
        counters = self.counters
        if not hit_chunks:
            return
        if load_chunks >= hit_chunks:
            counters.policy_loaded += 1
        elif load_chunks:
            counters.policy_truncated += 1
        else:
            counters.policy_skipped += 1

    def note_unprobed(self) -> None:
        """The policy ruled out probing a tier for a lookup."""
        self.counters.policy_unprobed += 1

    def note_deadline_cut(self) -> None:
        """The deadline cut a lookup's loads (or a probe that might have found more)."""
        self.counters.deadline_cut += 1

    # -- the engine's side --------------------------------------------------------------------
    def cancel_all(self) -> None:
        for rec in list(self.by_id.values()):
            rec.cancel()

    async def expire_held(self) -> None:
        """Release held results whose ``claim_ttl_s`` passed (the engine's expiry task; runs
        until cancelled)."""
        while True:
            queue = self._expiries
            now = trio.current_time()
            while queue and queue[0][0] <= now:
                queue.popleft()[1].expire()
            self._expiry_wakeup = trio.CancelScope(deadline=queue[0][0] if queue else math.inf)
            with self._expiry_wakeup:
                await trio.sleep_forever()

    async def wait_quiet(self) -> None:
        """Wait until no lookup is LOADING, CANCELLED or HELD (a checkpoint either way)."""
        if not (self.inflight or self.held):
            await trio.lowlevel.checkpoint()
            return
        while self.inflight or self.held:
            await self._quiet.park()

    def statistics(self) -> LookupStatistics:
        return snapshot(LookupStatistics, self.counters, inflight=self.inflight, held=self.held)
