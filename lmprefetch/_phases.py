"""A phase recorder: where a read path's time goes, recorded only while a benchmark looks.

Code on a hot path holds an optional :class:`Phases` (``None`` unless a benchmark set one) and
records an interval of a named phase only when it has one::

    phases = self.phases
    t0 = perf_counter() if phases is not None else 0.0
    ...
    if phases is not None:
        phases.add("syscalls", t0, perf_counter())

so the cost when nobody looks is one attribute read and one comparison.  Intervals come from
any thread (``list.append`` is atomic); the benchmark (:mod:`lmprefetch.bench.disk_budget`)
lays them over its own wall time.
"""

from __future__ import annotations

from collections.abc import Callable
from time import perf_counter
from typing import TypeVar, cast

import trio

__all__ = ["Phases", "perf_counter", "to_thread_timed"]

T = TypeVar("T")


class Phases:
    """Intervals ``(phase, start, end)`` in :func:`time.perf_counter` seconds, in the order
    they were recorded."""

    __slots__ = ("intervals",)

    def __init__(self) -> None:
        self.intervals: list[tuple[str, float, float]] = []

    def add(self, phase: str, start: float, end: float) -> None:
        self.intervals.append((phase, start, end))

    def clear(self) -> None:
        self.intervals.clear()


class _TimedLimiter:
    """A limiter that records how long acquiring it took (``limiter``), for one call."""

    __slots__ = ("_limiter", "_phases", "acquired")

    def __init__(self, limiter: trio.CapacityLimiter, phases: Phases) -> None:
        self._limiter = limiter
        self._phases = phases
        self.acquired = 0.0

    async def acquire_on_behalf_of(self, borrower: object) -> None:
        t0 = perf_counter()
        await self._limiter.acquire_on_behalf_of(borrower)
        self.acquired = perf_counter()
        self._phases.add("limiter", t0, self.acquired)

    def release_on_behalf_of(self, borrower: object) -> None:
        self._limiter.release_on_behalf_of(borrower)


async def to_thread_timed(
    phases: Phases,
    limiter: trio.CapacityLimiter,
    fn: Callable[..., T],
    *args: object,
    abandon_on_cancel: bool = False,
) -> T:
    """:func:`trio.to_thread.run_sync` that records its limiter wait (``limiter``), the two
    hand-offs (``handoff``: the token granted → the thread runs ``fn``; ``fn`` returned → the
    calling task runs again) and the thread's time in ``fn`` (``thread``)."""
    timed = _TimedLimiter(limiter, phases)
    span = [0.0, 0.0]

    def call() -> T:
        span[0] = perf_counter()
        try:
            return fn(*args)
        finally:
            span[1] = perf_counter()
            phases.add("thread", span[0], span[1])

    try:
        return await trio.to_thread.run_sync(
            call,
            limiter=cast(trio.CapacityLimiter, timed),
            abandon_on_cancel=abandon_on_cancel,
        )
    finally:
        resumed = perf_counter()
        if span[0]:
            phases.add("handoff", timed.acquired, span[0])
            phases.add("handoff", span[1], resumed)
