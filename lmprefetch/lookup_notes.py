"""A lookup's trace record: what it noted while it ran, and the record built from it.

Notes are taken only while the engine's :class:`~lmprefetch.trace.DecisionTrace` has a
subscriber; :func:`emit` turns them into a :class:`~lmprefetch.trace.LookupTrace` once the
lookup has answered.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import trio

from .policy import HitPart, LoadPolicy, LoadRequest, PrefillModel, TierCost, predict
from .tiers.base import Tier
from .trace import DecisionTrace, LookupTrace, PartTrace, ProbeTrace

__all__ = ["TraceRecords"]


def _part_trace(part: HitPart, age_s: float | None) -> PartTrace:
    cost: TierCost = part.cost
    return PartTrace(
        part.tier, part.chunks, part.bytes, part.zero_copy, cost.latency_s, cost.bytes_per_s, age_s
    )


class _Notes:
    """What one lookup noted for its trace record (built only while the engine's
    :class:`~lmprefetch.trace.DecisionTrace` has a subscriber): Trio times from its start."""

    __slots__ = (
        "calibrating",
        "decided",
        "load_ended",
        "load_started",
        "not_probed",
        "parts",
        "probes",
        "t0",
    )

    def __init__(self, t0: float) -> None:
        self.t0 = t0
        self.probes: list[ProbeTrace] = []
        self.not_probed: list[str] = []
        self.calibrating: list[str] = []
        #: The hit as the policy saw it (or would have: a policy deciding before probing).
        self.parts: tuple[HitPart, ...] = ()
        self.decided: float | None = None
        self.load_started: float | None = None
        self.load_ended: float | None = None

    def loads_began(self) -> None:
        if self.load_started is None:
            self.load_started = trio.current_time()

    def loads_ended(self) -> None:
        self.load_ended = trio.current_time()


class TraceRecords:
    """Builds one engine's lookup trace records and emits them to its trace: what its load
    policy decided with its prefill model, over its tiers (by name)."""

    def __init__(
        self,
        trace: DecisionTrace,
        policy: LoadPolicy,
        prefill: PrefillModel,
        tiers: Mapping[str, Tier],
    ) -> None:
        self._trace = trace
        self._policy = policy
        self._prefill = prefill
        self._tiers = tiers

    def emit(
        self,
        notes: _Notes,
        lookup_id: str,
        cum: Sequence[int],
        skip_chunks: int,
        found: int,
        keep: int,
        answer: int | None,
    ) -> None:
        """Emit the lookup's trace record (see :class:`~lmprefetch.trace.LookupTrace`)."""
        t0 = notes.t0
        computed = cum[skip_chunks]
        request = LoadRequest(
            parts=notes.parts,
            chunk_tokens=tuple(
                cum[i + 1] - cum[i] for i in range(skip_chunks, skip_chunks + found)
            ),
            computed_tokens=computed,
            prompt_tokens=cum[-1],
            prefill=self._prefill,
        )
        load_s, recompute_s = predict(request, keep) if found else (None, None)
        load_all_s = predict(request, found)[0] if found else None
        recompute_all_s = predict(request, 0)[1] if found else None
        coefficients, source = self._prefill.state()
        decision = (
            "miss" if not found else
            "loaded" if keep >= found else "truncated" if keep else "skipped"
        )  # fmt: skip
        load = None
        if notes.load_started is not None and notes.load_ended is not None:
            load = notes.load_ended - notes.load_started
        self._trace.emit(
            LookupTrace(
                rank=self._trace.rank,
                lookup_id=lookup_id,
                wall=self._trace.wall() - (trio.current_time() - t0),
                policy=type(self._policy).__name__,
                prompt_tokens=cum[-1],
                computed_tokens=computed,
                hit_chunks=found,
                hit_tokens=cum[skip_chunks + found] - computed,
                kept_chunks=keep,
                kept_tokens=cum[skip_chunks + keep] - computed,
                decision=decision,
                parts=tuple(
                    _part_trace(p, self._tiers[p.tier].stats.throughput_age_s(t0))
                    for p in notes.parts
                ),
                probes=tuple(notes.probes),
                prefill_a=None if coefficients is None else coefficients[0],
                prefill_b=None if coefficients is None else coefficients[1],
                prefill_source=source,
                predicted_load_s=load_s,
                predicted_recompute_s=recompute_s,
                predicted_load_all_s=load_all_s,
                predicted_recompute_all_s=recompute_all_s,
                decided_s=None if notes.decided is None else notes.decided - t0,
                load_s=load,
                answered_s=trio.current_time() - t0,
                answer_tokens=answer if answer is not None else 0,
                not_probed=tuple(notes.not_probed),
                calibrating=tuple(notes.calibrating),
            )
        )
