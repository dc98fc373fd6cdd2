"""A lookup's I/O, top to bottom: probe the tiers, let the policy decide, load, keep the prefix.

:class:`LookupIO` is the part of an :class:`~lmprefetch.prefetch.Engine` that runs lookups; it
moves each lookup's record (:class:`~lmprefetch.lookup._Lookup`) through its states and tells
the engine's table of lookups what it decided.  Read one lookup in this order:

1. :meth:`LookupIO.start` builds ``cum_tokens`` from ``(hashes, offsets)`` (``cum_tokens[i]``
   is the number of tokens in the first ``i`` chunks), starts the record, and answers at once
   what needs no tier: a request that makes no sense, a deadline already passed, a closed
   engine, a ``load_policy`` that names no built-in policy.  The lookup's policy is the
   configured one, or the built-in one the request names (``load_policy``: a request's own
   choice, e.g. from vLLM's ``kv_transfer_params``; each is built once per engine).  A policy
   that decides before probing (:class:`~lmprefetch.policy.Decides`) is asked here; its
   answer bounds the chunks probed (``never``: none, so the lookup answers at once).
2. When memory can answer (:meth:`LookupIO._hits_in_memory`: the CPU tier holds the prompt, or
   a prefix after which every other tier rules itself out without I/O), probing is a
   dictionary walk and loading is taking owner references on the cached buffers, so the
   record holds or ends at once, inside ``start``: no task (a 16-chunk CPU hit in tens of
   microseconds).
3. Otherwise one task runs the lookup (:meth:`LookupIO._run`), in its own cancel scope, and
   owns everything the lookup takes through an exit stack.  Tiers are probed in order on the
   keys no earlier tier hit (:meth:`LookupIO._probe_and_load`); a probe pins what it counts,
   and the pins are registered with the exit stack before the next checkpoint.  A tier with
   no hit is skipped; a tier that raises or times out ends the prefix there.  Each tier's
   share of the hit is a :class:`_Part`.  A zero-copy tier's hits are taken at once (owner
   references); another tier's load (:meth:`LookupIO._load_part`) runs in the task's nursery
   under the weighted limiter (weight = chunks), into freshly allocated arena buffers, while
   the next tier is probed — at once when the policy decided before probing, otherwise once
   every tier was probed and the policy chose how many hit chunks to load (what it drops is
   released first).  Allocation failure is a shorter prefix, never a wait.  A part is loaded
   by one algorithm (:meth:`LookupIO._load_batches`): in order, in one call without a load
   deadline, in up to :data:`LOAD_BATCHES` calls with one, so that the deadline keeps what
   already arrived.  The loads stop at the lookup's deadline (or ``load_deadline_s``).
4. After the loads the chunks loaded *contiguously* from the first chunk go to the record
   (``hold``), everything past the first hole is released at once, and the lookup answers; a
   lookup with nothing to hold answers when its task has released everything (``end``).

Every tier call goes through :meth:`LookupIO._tier_load` (bounded by ``tier_timeout_s``; a tier
that raises or times out shortens the prefix) or the probe in :meth:`LookupIO._probe_and_load`:
those are the seams between a lookup and its tiers.  A tier that seals chunks per tenant
(``per_tenant``: encryption on, docs/codecs.md) is given the lookup's tenant with each load;
its decoding is the tier's business (it happens inside ``load``, in the tier's threads).

Cancellation: a lookup is cancelled through its record (``cancel`` cancels the task's scope);
the task then unwinds, its exit stack releases every pin and buffer it still owns, and the
lookup answers 0.  Nothing here blocks the Trio thread.

The ``Dnn`` codes are LMCache's defects, the rows of the defect table in
``docs/cancellation.md`` ("The defects"), each with its ``test_dNN_`` regression tests.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from itertools import accumulate
from typing import Final, cast

import trio

from .calibration import CALIBRATION_CHUNKS, Calibrations
from .config import PrefetchConfig
from .keys import ChunkKey, KeyMaker
from .limiter import WeightedCapacityLimiter
from .lookup import AnswerCallback, _Lookup, _Lookups
from .lookup_notes import TraceRecords, _Notes
from .lookup_parts import Pairs, _Part, _Pins, _release_pairs
from .memory import Arena, Buffer
from .policy import (
    BUILTIN_POLICIES,
    Decides,
    HitPart,
    LoadPolicy,
    LoadRequest,
    PrefillModel,
    make_policy,
    when_decides,
)
from .tiers.base import SyncProbeTier, TenantTier, Tier, ZeroCopyTier
from .tiers.cpu import CpuTier
from .trace import DecisionTrace, ProbeTrace

__all__ = ["CALIBRATION_CHUNKS", "LOAD_BATCHES", "LOAD_DEPTH", "LookupIO"]

log = logging.getLogger("lmprefetch.engine")

#: With ``load_deadline_s`` set, a tier's part is loaded in up to this many calls, in order,
#: so that a cut keeps what already arrived (see :meth:`LookupIO._load_batches`); without
#: it, in one call.
LOAD_BATCHES: Final = 8
#: ... and this many of them in flight at once.
LOAD_DEPTH: Final = 3


@dataclass(frozen=True, slots=True)
class _PolicyUse:
    """A load policy as lookups use it, read once: whether it decides before probing, its
    ``worth_probing`` (asked before each tier that is not zero-copy is probed; ``None`` when
    it has none or decides first), and the trace records naming it."""

    policy: LoadPolicy
    decides_first: bool
    worth_probing: Callable[[LoadRequest], bool] | None
    records: TraceRecords


def _probes_now(tier: Tier) -> bool:
    """Whether ``tier`` answers a probe synchronously (:class:`SyncProbeTier`), and its
    ``contains_prefix_now`` is the probe its ``contains_prefix`` makes: a subclass that
    overrides ``contains_prefix`` alone (to slow it, count it, fail it) is awaited."""
    if not callable(getattr(tier, "contains_prefix_now", None)):
        return False
    mro = type(tier).__mro__
    now = next((c for c in mro if "contains_prefix_now" in vars(c)), None)
    awaited = next((c for c in mro if "contains_prefix" in vars(c)), object)
    return now is not None and issubclass(now, awaited)


class LookupIO:
    """One engine's lookups, from the request to the record's answer (see the module
    docstring).  Everything runs on the engine's Trio thread.

    Args:
        config: ``lookup_timeout_s``, ``load_deadline_s``, ``tier_timeout_s``,
            ``chunk_bytes`` and ``keys_per_chunk`` are used.
        keys: the engine's key maker.
        arena: where loaded chunks go.
        cpu: the CPU tier (the memory that answers without a task).
        tiers: every tier, in probe order (the CPU tier first).
        limiter: the weighted limiter every load holds.
        policy: the load policy.
        prefill: the engine's prefill cost, for the policy.
        lookups: the engine's table of lookups.
        nursery: where lookup tasks run.
        trace: where each lookup's decision record goes (see :mod:`lmprefetch.trace`).
    """

    def __init__(
        self,
        config: PrefetchConfig,
        *,
        keys: KeyMaker,
        arena: Arena,
        cpu: CpuTier,
        tiers: Sequence[Tier],
        limiter: WeightedCapacityLimiter,
        policy: LoadPolicy,
        prefill: PrefillModel,
        lookups: _Lookups,
        nursery: trio.Nursery,
        trace: DecisionTrace | None = None,
    ) -> None:
        self._config = config
        self._keys = keys
        self._arena = arena
        self._cpu = cpu
        # What each tier can do, decided once: zero-copy hits are taken synchronously
        # (references on cached buffers) instead of loaded.
        self._probe_order: tuple[tuple[Tier, bool], ...] = tuple(
            (t, isinstance(t, ZeroCopyTier)) for t in tiers
        )
        # ... and which can be probed synchronously (an index in memory): no cancel scope, no
        # checkpoint, no pass of the scheduler (SyncProbeTier).
        self._probe_now: dict[int, Callable[..., int]] = {
            id(t): cast(SyncProbeTier, t).contains_prefix_now for t in tiers if _probes_now(t)
        }
        # ... and which tiers seal chunks per tenant: their loads take the lookup's tenant.
        self._per_tenant = frozenset(id(t) for t in tiers if getattr(t, "per_tenant", False))
        self._other_tiers = tuple(t for t in tiers if t is not cpu)
        self._limiter = limiter
        #: The configured load policy.
        self.policy = policy
        self._prefill = prefill
        self._tiers_by_name = {t.name: t for t in tiers}
        self._lookups = lookups
        self._nursery = nursery
        self._kpc = config.keys_per_chunk
        self._calls_per_part = 1 if config.load_deadline_s is None else LOAD_BATCHES
        self._trace = trace if trace is not None else DecisionTrace()
        #: The policies lookups use, by the name a request gives (``""``: the configured one;
        #: a built-in policy a request names is built on first use, and kept: a policy may
        #: learn from its decisions, as ``cost``'s hysteresis does).
        configured = self._use_of(policy)
        self._uses: dict[str, _PolicyUse] = {"": configured}
        if config.load_policy in BUILTIN_POLICIES and type(policy) is type(
            make_policy(config.load_policy)
        ):
            self._uses[config.load_policy] = configured
        #: Background measurements of tiers: dropped chunks loaded as a lookup's would be.
        self._calibrations = Calibrations(
            nursery=nursery, load=self._load_part, kpc=self._kpc,
            max_age_s=config.tier_cost_max_age_s, trace=self._trace,
        )  # fmt: skip
        #: Set when the engine closes: new lookups answer 0.
        self.closed = False

    def _use_of(self, policy: LoadPolicy) -> _PolicyUse:
        first = when_decides(policy) is Decides.BEFORE_PROBING
        return _PolicyUse(
            policy,
            first,
            None if first else getattr(policy, "worth_probing", None),
            TraceRecords(self._trace, policy, self._prefill, self._tiers_by_name),
        )

    def _policy_use(self, name: str) -> _PolicyUse | None:
        """The policy a lookup names (``""``: the configured one), or ``None`` for a name
        that is not a built-in policy's (a request never makes the engine import code)."""
        use = self._uses.get(name)
        if use is None and name in BUILTIN_POLICIES:
            use = self._uses[name] = self._use_of(make_policy(name))
        return use

    # -- 1. the request ---------------------------------------------------------------
    def start(
        self,
        lookup_id: str,
        hashes: Sequence[int],
        offsets: Sequence[int],
        *,
        on_answer: AnswerCallback,
        seq: int,
        deadline: float | None,
        skip_chunks: int,
        tenant: bytes = b"",
        load_policy: str = "",
    ) -> _Lookup:
        """See :meth:`Engine.start_lookup <lmprefetch.prefetch.Engine.start_lookup>`."""
        started = trio.current_time()
        notes = _Notes(started) if self._trace.enabled else None
        lookups = self._lookups
        old = lookups.by_id.get(lookup_id)
        if old is not None:
            old.cancel()
        rec = lookups.start(lookup_id, seq, on_answer, started)
        n_chunks = len(hashes)
        use = self._policy_use(load_policy)
        if (
            use is None
            or len(offsets) != n_chunks
            or not 0 <= skip_chunks <= n_chunks
            or (n_chunks and min(offsets) <= 0)
        ):
            lookups.note_malformed()
            rec.end(0)
            return rec
        if self.closed:
            rec.end(0)
            return rec
        if deadline is None:
            deadline = started + self._config.lookup_timeout_s
        elif deadline <= started:
            lookups.note_deadline_expired()
            rec.end(0)
            return rec
        prompt_tokens = sum(offsets)
        if skip_chunks == n_chunks:
            rec.end(prompt_tokens)
            return rec
        skipped_tokens = sum(offsets[:skip_chunks]) if skip_chunks else 0
        end = n_chunks  # the chunks this lookup may probe and load, skipped ones included
        if use.decides_first:
            request = LoadRequest(
                parts=(),
                chunk_tokens=tuple(offsets[skip_chunks:] if skip_chunks else offsets),
                computed_tokens=skipped_tokens,
                prompt_tokens=prompt_tokens,
                prefill=self._prefill,
            )
            end = skip_chunks + self._ask_policy(request, use.policy)
            if end == skip_chunks:  # load nothing: probe nothing, hold nothing
                lookups.note_decision(n_chunks - skip_chunks, 0)
                rec.end(skipped_tokens)
                if notes is not None:
                    cum = [0, *accumulate(offsets)]
                    use.records.emit(notes, lookup_id, cum, skip_chunks, 0, 0, skipped_tokens)
                return rec

        ruled_out: frozenset[Tier] = frozenset()
        if use.worth_probing is not None:
            ruled_out = self._not_worth_probing(use, hashes, offsets, skip_chunks, end)
            if ruled_out:
                lookups.note_unprobed()
                if notes is not None:
                    notes.not_probed.extend(t.name for t, _ in self._probe_order if t in ruled_out)

        # -- 2. memory answers: no task ---------------------------------------------------
        held = self._hits_in_memory(hashes, skip_chunks, end, ruled_out)
        if held is not None:
            found = keep = len(held) // self._kpc
            if found and not use.decides_first:
                keep = self._decide(
                    use,
                    [(self._cpu, found, True)],
                    offsets[skip_chunks : skip_chunks + found],
                    skipped_tokens,
                    prompt_tokens,
                )
                _release_pairs(held[keep * self._kpc :])
                del held[keep * self._kpc :]
            lookups.note_decision(found, keep)
            hit_tokens = skipped_tokens
            if held:
                hit_tokens += sum(offsets[skip_chunks : skip_chunks + keep])
                rec.hold(held, hit_tokens, ((self._cpu.name, hit_tokens - skipped_tokens),))
            else:
                rec.end(skipped_tokens)
            if notes is not None:
                if found:
                    notes.parts = self._hit_parts([(self._cpu, found, True)])
                    notes.decided = started
                cum = [0, *accumulate(offsets)]
                use.records.emit(notes, lookup_id, cum, skip_chunks, found, keep, hit_tokens)
            return rec

        # -- 3. a task probes and loads ---------------------------------------------------
        load_deadline_s = self._config.load_deadline_s
        if load_deadline_s is not None:
            deadline = min(deadline, started + load_deadline_s)
        cum = [0, *accumulate(offsets)]
        keys = self._keys.keys(hashes if end == n_chunks else hashes[:end])
        self._nursery.start_soon(
            self._run, rec, rec.run_in_task(), keys, cum, skip_chunks, deadline, notes, ruled_out,
            tenant, use,
            name=f"lookup:{lookup_id}",
        )  # fmt: skip
        return rec

    def _not_worth_probing(
        self,
        use: _PolicyUse,
        hashes: Sequence[int],
        offsets: Sequence[int],
        skip_chunks: int,
        end: int,
    ) -> frozenset[Tier]:
        """The tiers the policy's ``worth_probing`` rules out for this lookup, each asked with
        the chunks the CPU tier holds (free, found without I/O) and one hypothetical part: the
        tier holding every further chunk up to ``end``.  A ``worth_probing`` that raises is
        logged and rules nothing out."""
        worth_probing = use.worth_probing
        assert worth_probing is not None
        cpu, first_key = self._cpu, self._keys.first_key
        in_cpu = skip_chunks
        while in_cpu < end and cpu.contains_now(first_key(hashes[in_cpu])):
            in_cpu += 1
        rest = end - in_cpu
        if rest == 0:
            return frozenset()
        now = trio.current_time()
        max_age = self._config.tier_cost_max_age_s
        chunk_bytes = self._config.chunk_bytes
        known = self._hit_parts([(cpu, in_cpu - skip_chunks, True)]) if in_cpu > skip_chunks else ()
        out = []
        for tier, zero_copy in self._probe_order:
            if zero_copy:
                continue
            cost = tier.stats.cost(now, max_age)
            request = LoadRequest(
                parts=(*known, HitPart(tier.name, rest, rest * chunk_bytes, False, cost)),
                chunk_tokens=tuple(offsets[skip_chunks:end]),
                computed_tokens=sum(offsets[:skip_chunks]),
                prompt_tokens=sum(offsets),
                prefill=self._prefill,
            )
            try:
                worth = bool(worth_probing(request))
            except Exception:
                log.exception("load policy %r: worth_probing failed; probing", use.policy)
                worth = True
            if not worth:
                out.append(tier)
        return frozenset(out)

    def _hits_in_memory(
        self,
        hashes: Sequence[int],
        skip_chunks: int,
        end: int,
        ruled_out: frozenset[Tier] = frozenset(),
    ) -> Pairs | None:
        """The lookup's result when no tier needs I/O to tell, else ``None``.

        That is the case when the CPU tier holds every chunk up to ``end``, or holds a prefix
        that every other tier can rule out going on from (``contains_now`` is ``False``, or the
        policy ruled the tier out: ``ruled_out``): then
        probing is a dictionary walk and loading is taking owner references, all synchronous.
        Returns the ``(key, buffer)`` pairs of the whole chunks hit (owner references the
        caller now owns), possibly none.
        """
        cpu, kpc = self._cpu, self._kpc
        first_key = self._keys.first_key
        firsts: list[ChunkKey] = []  # the first key of each chunk the CPU tier holds
        hit = skip_chunks
        while hit < end:
            nxt = first_key(hashes[hit])
            if not cpu.contains_now(nxt):
                # Can a tier after the CPU tier go on from here?  (None: it cannot tell.)
                for tier in self._other_tiers:
                    if tier not in ruled_out and tier.contains_now(nxt) is not False:
                        return None
                break
            firsts.append(nxt)
            hit += 1
        if hit == skip_chunks:
            return []  # a miss every tier rules out without I/O
        # One key per chunk is its first key; layerwise chunks have a key per layer.
        keys = firsts if kpc == 1 else self._keys.keys(hashes[skip_chunks:hit])
        buffers = cpu.acquire(keys)
        whole = len(buffers) // kpc * kpc
        for buf in buffers[whole:]:
            buf.release()
        return list(zip(keys, buffers[:whole]))

    # -- 3. the lookup's task -----------------------------------------------------------
    async def _run(
        self,
        rec: _Lookup,
        scope: trio.CancelScope,
        keys: list[ChunkKey],
        cum: list[int],
        skip_chunks: int,
        deadline: float,
        notes: _Notes | None,
        ruled_out: frozenset[Tier],
        tenant: bytes,
        use: _PolicyUse,
    ) -> None:
        """A lookup that needs I/O, start to end: everything it takes is owned by ``owned``
        until the contiguous prefix moves to the record."""
        chunks = 0  # what a lookup that fails or is cancelled answers
        found = keep = 0
        try:
            with scope, ExitStack() as owned:
                try:
                    total, loaded, sources, found, keep = await self._probe_and_load(
                        keys, cum, skip_chunks, deadline, owned, notes, ruled_out, tenant, use
                    )
                except Exception:
                    # Not a tier's failure (those end the prefix inside): a bug, said loudly.
                    log.exception("lookup %s failed; answering 0", rec.lookup_id)
                    self._lookups.note_failed()
                else:
                    # No checkpoint since the loads ended: the pairs go to the record (or, if
                    # it was cancelled meanwhile, are released) before anything else runs.
                    if loaded and rec.hold(loaded, cum[total], sources):
                        return
                    chunks = skip_chunks  # nothing loaded: the skipped chunks still count
        finally:
            # Whatever the task took is released by now: a lookup that holds nothing
            # answers here (0 once cancelled); one that holds answered above.
            rec.end(cum[chunks])
            if notes is not None:
                use.records.emit(notes, rec.lookup_id, cum, skip_chunks, found, keep, rec.answer)

    async def _probe_and_load(
        self,
        keys: list[ChunkKey],
        cum: list[int],
        skip_chunks: int,
        deadline: float,
        owned: ExitStack,
        notes: _Notes | None = None,
        ruled_out: frozenset[Tier] = frozenset(),
        tenant: bytes = b"",
        use: _PolicyUse | None = None,
    ) -> tuple[int, Pairs, tuple[tuple[str, int], ...], int, int]:
        """Probe the tiers, run their loads, keep the contiguous prefix: its chunk count (with
        ``skip_chunks``), its ``(key, buffer)`` pairs (which the caller now owns), the
        tokens each tier served, and the chunks found and chosen (past ``skip_chunks``).

        A policy that decided before probing has bounded ``keys`` already: each tier's load
        starts as soon as its probe answers.  Any other policy decides once every tier was
        probed (:meth:`_decide`), before any load starts; the pins (and zero-copy references)
        of the chunks past its answer are released at once.  At ``deadline`` the probes and
        loads still running are cancelled: the prefix loaded by then is kept, and the cut is
        counted."""
        kpc = self._kpc
        if use is None:
            use = self._uses[""]
        load_at_once = use.decides_first
        n_chunks = len(keys) // kpc
        next_chunk = skip_chunks
        parts: list[_Part] = []

        # Parts own their buffers until the contiguous ones are handed out.
        @owned.callback
        def release_parts() -> None:
            for part in parts:
                part.release_buffers()

        tier_timeout = self._config.tier_timeout_s
        chosen = 0  # the hit chunks the policy chose (past skip_chunks), once it decided
        probe_order = self._probe_order
        last_tier = len(probe_order) - 1
        # The last part to load is awaited in this task rather than started in one of its
        # own: nothing else is left for this task to do meanwhile, and a task costs a spawn
        # and two passes of the scheduler (the budget in docs/benchmarks.md).
        lone: _Part | None = None
        with trio.move_on_at(deadline) as budget:
            async with trio.open_nursery() as loads:
                for tier_index, (tier, zero_copy) in enumerate(probe_order):
                    if next_chunk >= n_chunks:
                        break  # everything hit: stop probing early
                    if tier in ruled_out:
                        continue  # the policy: no load from it could win
                    remaining = keys[next_chunk * kpc :]
                    probe_t0 = trio.current_time()
                    probe_now = self._probe_now.get(id(tier))
                    try:
                        if probe_now is not None:
                            raw = probe_now(remaining, pin=True)
                        else:
                            with trio.move_on_after(tier_timeout) as probe:
                                raw = await tier.contains_prefix(remaining, pin=True)
                            if probe.cancelled_caught:
                                log.warning("tier %s probe timed out; prefix ends there", tier.name)
                                tier.stats.errors += 1
                                break
                    except Exception:
                        log.warning(
                            "tier %s failed a probe; prefix ends there", tier.name, exc_info=True
                        )
                        tier.stats.errors += 1
                        break
                    # No checkpoint from here until the part is registered.
                    probe_s = trio.current_time() - probe_t0
                    tier.stats.observe_probe(probe_s)
                    raw = max(0, min(raw, len(remaining)))
                    if notes is not None:
                        notes.probes.append(ProbeTrace(tier.name, probe_s, raw // kpc))
                    pins = _Pins(tier, remaining[:raw])
                    owned.callback(pins.release)
                    hit = raw // kpc
                    pins.release_from(hit * kpc)  # round down to whole chunks
                    if hit == 0:
                        continue  # the next tier gets the same keys
                    part = _Part(tier, remaining[: hit * kpc], hit, pins, zero_copy, probe_s)
                    parts.append(part)
                    next_chunk += hit
                    if zero_copy:
                        # Owner references on the cached buffers, taken synchronously; they
                        # keep the entries from eviction, so the pins go.
                        zero_copy_tier = cast(ZeroCopyTier, tier)  # pragma: no mutate (a type)
                        part.buffers = zero_copy_tier.acquire(part.keys)
                        part.loaded = len(part.buffers) // kpc
                        part.release_buffers(part.loaded * kpc)
                        part.pins.release()
                    elif load_at_once:
                        if next_chunk >= n_chunks or tier_index == last_tier:
                            lone = part  # no probe follows: awaited below
                        else:
                            loads.start_soon(self._load_part, part, notes, tenant)
                # No checkpoint from the last probe to the loads' start: the policy decides,
                # and what it drops is released now.
                found = next_chunk - skip_chunks
                keep = found
                if notes is not None and found:
                    notes.parts = self._hit_parts(
                        [(p.tier, p.n_chunks, p.zero_copy) for p in parts]
                    )
                    notes.decided = trio.current_time()
                if found and not load_at_once:
                    keep = self._decide(
                        use,
                        [(p.tier, p.n_chunks, p.zero_copy) for p in parts],
                        [cum[i + 1] - cum[i] for i in range(skip_chunks, next_chunk)],
                        cum[skip_chunks],
                        cum[-1],
                    )
                    to_load = []
                    for part in parts:
                        mine = max(0, min(part.n_chunks, keep))
                        if mine < part.n_chunks and self._calibrations.needed(part):
                            # Chunks of a tier not measured (lately) go: measure it with some.
                            hi = min(part.n_chunks, mine + CALIBRATION_CHUNKS)
                            self._calibrations.start_soon(part.split_off(mine, hi, kpc), tenant)
                            if notes is not None:
                                notes.calibrating.append(part.tier.name)
                        part.truncate(mine, kpc)
                        keep -= part.n_chunks
                        if part.n_chunks and not part.zero_copy:
                            to_load.append(part)
                    if to_load:
                        lone = to_load.pop()
                    for part in to_load:
                        loads.start_soon(self._load_part, part, notes, tenant)
                    keep = sum(p.n_chunks for p in parts)
                self._lookups.note_decision(found, keep)
                chosen = keep
                if lone is not None:
                    await self._load_part(lone, notes, tenant)
        # -- 4. keep the contiguous prefix; release everything past the first hole ----------
        total = skip_chunks
        kept: Pairs = []
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
            self._lookups.note_deadline_cut()
        return total, kept, tuple(sources), next_chunk - skip_chunks, chosen

    # -- the policy ---------------------------------------------------------------------
    def _decide(
        self,
        use: _PolicyUse,
        parts: Sequence[tuple[Tier, int, bool]],
        chunk_tokens: Sequence[int],
        computed_tokens: int,
        prompt_tokens: int,
    ) -> int:
        """How many of the hit chunks (``parts``: tier, chunks, zero-copy, in prefix order;
        ``chunk_tokens``: the tokens of each) to load, asked of a policy that decides after
        probing.  Synchronous, so no pin or buffer changes hands while it runs."""
        return self._ask_policy(
            LoadRequest(
                parts=self._hit_parts(parts),
                chunk_tokens=tuple(chunk_tokens),
                computed_tokens=computed_tokens,
                prompt_tokens=prompt_tokens,
                prefill=self._prefill,
            ),
            use.policy,
        )

    def _hit_parts(self, parts: Sequence[tuple[Tier, int, bool]]) -> tuple[HitPart, ...]:
        """The hit as a policy sees it: each tier's chunks, their bytes and the tier's cost."""
        chunk_bytes = self._config.chunk_bytes
        now, max_age = trio.current_time(), self._config.tier_cost_max_age_s
        return tuple(
            HitPart(t.name, n, n * chunk_bytes, zc, t.stats.cost(now, max_age))
            for t, n, zc in parts
        )

    def _ask_policy(self, request: LoadRequest, policy: LoadPolicy) -> int:
        """``policy``'s answer to ``request``, clamped to ``[0, request.hit_chunks]``; the
        whole hit when the policy raises (logged)."""
        n = len(request.chunk_tokens)
        try:
            keep = int(policy.chunks_to_load(request))
        except Exception:
            log.exception("load policy %r failed; loading the whole hit", policy)
            keep = n
        if not 0 <= keep <= n:
            keep = 0 if keep < 0 else n
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "load policy %s: %d of %d chunks; tiers %s; prefill (s/token, s/attention) %s",
                type(policy).__name__, keep, n,
                [(p.tier, p.chunks, p.cost) for p in request.parts],
                self._prefill.coefficients(),
            )  # fmt: skip
        return keep

    # -- measuring a tier in the background (lmprefetch.calibration) ------------------------
    @property
    def calibrating(self) -> int:
        """Background measurements of tiers in flight."""
        return self._calibrations.in_flight

    async def wait_calibrated(self) -> None:
        """Wait until no background measurement is in flight (a checkpoint either way)."""
        await self._calibrations.wait()

    def close(self) -> None:
        """New lookups answer 0; background measurements are cancelled."""
        self.closed = True
        self._calibrations.close()

    # -- loading one tier's part ----------------------------------------------------------
    async def _load_part(
        self, part: _Part, notes: _Notes | None = None, tenant: bytes = b""
    ) -> None:
        """Load one tier's hit chunks into new arena buffers, under the limiter (``tenant``:
        the lookup's, for a tier that seals per tenant).

        Only the tier's own ``load`` may fail softly (see :meth:`_tier_load`); an exception
        from anything else here is a bug in lmprefetch and fails the lookup, loudly.
        """
        kpc = self._kpc
        if notes is not None:
            notes.loads_began()
        try:
            async with self._limiter.hold(part.n_chunks) as granted:
                want = granted * kpc
                self._cpu.make_room(want)
                part.buffers = self._arena.allocate_many(want)
                usable = len(part.buffers) // kpc * kpc
                part.release_buffers(usable)  # allocation failure: a shorter prefix
                if usable:
                    await self._load_batches(part, usable // kpc, tenant)
                    part.release_buffers(part.loaded * kpc)
        finally:
            part.pins.release()
            if notes is not None:
                notes.loads_ended()

    async def _load_batches(self, part: _Part, chunks: int, tenant: bytes = b"") -> None:
        """Load a part's first ``chunks`` chunks (their buffers allocated) in order, in up to
        ``self._calls_per_part`` calls (one without ``load_deadline_s``, :data:`LOAD_BATCHES`
        with it), :data:`LOAD_DEPTH` at a time (which hides a call's round trip behind the
        previous call's transfer), so that when the deadline cancels the loads,
        ``part.loaded`` is the prefix already in memory, not nothing.

        ``part.loaded`` moves forward as each call ends, over the calls that ended whole and
        in order; once a call ends short, no later one starts.  The tier's throughput is
        measured over the part (the bytes of that prefix over the time since the first call),
        also when the deadline cuts it: calls run side by side, so one call's time would count
        the link's share of the others."""
        kpc = self._kpc
        tier = part.tier
        per = -(-chunks // self._calls_per_part)
        bounds = [(lo, min(lo + per, chunks)) for lo in range(0, chunks, per)]
        filled: list[int | None] = [None] * len(bounds)  # whole chunks from each call's first
        short = False  # a call ended short: the calls after it cannot extend the prefix

        async def load_batch(index: int) -> None:
            nonlocal short
            lo, hi = bounds[index]
            got = await self._tier_load(
                tier, part.keys[lo * kpc : hi * kpc], part.buffers[lo * kpc : hi * kpc], tenant
            )
            filled[index] = got // kpc
            short = short or lo + got // kpc < hi
            loaded = 0
            for (first, last), whole in zip(bounds, filled):
                if whole is None:
                    break
                loaded += whole
                if first + whole < last:
                    break
            part.loaded = loaded

        t0 = trio.current_time()
        try:
            if len(bounds) == 1:  # one call: it needs no task of its own
                await load_batch(0)
                return
            slots = trio.Semaphore(LOAD_DEPTH)

            async def in_slot(index: int) -> None:
                try:
                    await load_batch(index)
                finally:
                    slots.release()

            async with trio.open_nursery() as batches:
                for index in range(len(bounds)):
                    await slots.acquire()
                    if short:
                        slots.release()
                        break
                    batches.start_soon(in_slot, index)
        finally:
            if part.loaded:
                n_bytes = sum(buf.length for buf in part.buffers[: part.loaded * kpc])
                now = trio.current_time()
                tier.stats.observe_load(n_bytes, now - t0, now, part.probe_s)

    async def _tier_load(
        self, tier: Tier, keys: Sequence[ChunkKey], buffers: Sequence[Buffer], tenant: bytes = b""
    ) -> int:
        """``tier.load`` bounded by ``tier_timeout_s``: the contiguous count it filled, and 0
        when the tier raises or times out (the prefix ends at this tier; D05).  A tier that
        seals per tenant is given ``tenant``."""
        t0 = trio.current_time()
        tier.stats.load_started(t0)
        try:
            with trio.move_on_after(self._config.tier_timeout_s):
                if id(tier) in self._per_tenant:
                    loaded = await cast(TenantTier, tier).load(keys, buffers, tenant=tenant)
                else:
                    loaded = await tier.load(keys, buffers)
                return max(0, min(loaded, len(keys)))
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
