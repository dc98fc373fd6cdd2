"""`WeightedCapacityLimiter`: a strict-FIFO, weighted capacity limiter for Trio.

Trio's :class:`trio.CapacityLimiter` gives every borrower one token; a prefetch needs as many
tokens as it loads chunks.  This limiter hands out *weights*:

* **Strict FIFO with hand-off.**  A request that does not fit waits in line; nobody behind it
  may overtake it (no barging), so a stream of small requests can never starve a large one
  (LMCache's ``WeightedSemaphore`` has no order, D10).  :meth:`release` charges the freed weight
  to the waiters at the head of the line *before* they run, so capacity cannot be stolen between
  wake-up and resumption.
* **Oversized requests are clamped.**  A request heavier than the whole capacity is granted the
  capacity instead of raising; the caller loads a shorter prefix.
* **Synchronous release.**  :meth:`release` never awaits, so it is safe in ``finally`` blocks and
  in ``__exit__`` under cancellation.
* **Cancellation-safe while queued.**  A waiter cancelled in line leaves it; if it was the head,
  the next waiters that now fit are let in at once.

The checkpoint discipline copies :meth:`trio.CapacityLimiter.acquire_on_behalf_of`: a
cancellation checkpoint first, then either a ``cancel_shielded_checkpoint`` after an immediate
grant (a granted weight is never lost to a late ``Cancelled``) or a park in line.

The ``Dnn`` codes are LMCache's defects, the rows of the defect table in
``docs/cancellation.md`` ("The defects"), each with its ``test_dNN_`` regression tests.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import msgspec
import trio

__all__ = ["LimiterStatistics", "WeightedCapacityLimiter"]


class LimiterStatistics(msgspec.Struct, frozen=True, gc=False):
    total: int
    used: int
    tasks_waiting: int
    weight_waiting: int


class _Waiter:
    __slots__ = ("task", "weight")

    def __init__(self, task: trio.lowlevel.Task, weight: int) -> None:
        self.task = task
        self.weight = weight


class WeightedCapacityLimiter:
    """Hands out up to ``total`` units of weight, first come first served.

    Args:
        total: the capacity (at least 1).
    """

    def __init__(self, total: int) -> None:
        if isinstance(total, bool) or not isinstance(total, int) or total < 1:
            raise ValueError(f"total: must be a positive int, got {total!r}")
        self._total = total
        self._used = 0
        self._waiters: OrderedDict[int, _Waiter] = OrderedDict()
        self._tickets = itertools.count()  # waiter ids; the dict's order is the line

    @property
    def total(self) -> int:
        return self._total

    @property
    def used(self) -> int:
        return self._used

    @property
    def available(self) -> int:
        return self._total - self._used

    def clamp(self, weight: int) -> int:
        """The weight a request of ``weight`` is granted: ``min(weight, total)``."""
        if weight < 0:
            raise ValueError(f"weight: must not be negative, got {weight}")
        return min(weight, self._total)

    def acquire_nowait(self, weight: int) -> int:
        """Take ``clamp(weight)`` at once if nobody waits and it fits.

        Returns:
            The granted weight.

        Raises:
            trio.WouldBlock: someone is waiting, or it does not fit now.
        """
        granted = self.clamp(weight)
        if self._waiters or granted > self._total - self._used:
            raise trio.WouldBlock
        self._used += granted
        return granted

    async def acquire(self, weight: int) -> int:
        """Wait in line for ``clamp(weight)`` units and take them.

        Returns:
            The granted weight (``min(weight, total)``).

        On cancellation: if the weight was not granted yet the caller leaves the line and owns
        nothing; once this returns, the caller owns the weight and must :meth:`release` it
        (use :meth:`hold`).
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        try:
            granted = self.acquire_nowait(weight)
        except trio.WouldBlock:
            pass
        else:
            await trio.lowlevel.cancel_shielded_checkpoint()
            return granted
        granted = self.clamp(weight)
        ticket = next(self._tickets)
        self._waiters[ticket] = _Waiter(trio.lowlevel.current_task(), granted)

        def abort(_: trio.lowlevel.RaiseCancelT) -> trio.lowlevel.Abort:
            # Still in line (never granted): leave it, and let in whoever now fits.
            del self._waiters[ticket]
            self._grant()
            return trio.lowlevel.Abort.SUCCEEDED

        await trio.lowlevel.wait_task_rescheduled(abort)
        return granted

    def release(self, weight: int) -> None:
        """Give back ``weight`` units (synchronous) and hand them to the head of the line."""
        if weight < 0 or weight > self._used:
            raise RuntimeError(f"release of {weight} with only {self._used} in use")
        self._used -= weight
        self._grant()

    @asynccontextmanager
    async def hold(self, weight: int) -> AsyncIterator[int]:
        """``async with limiter.hold(w) as granted:`` — acquire, then release on exit."""
        granted = await self.acquire(weight)
        try:
            yield granted
        finally:
            self.release(granted)

    def __repr__(self) -> str:
        return (
            f"<WeightedCapacityLimiter {self._used}/{self._total} used, "
            f"{len(self._waiters)} waiting>"
        )

    def statistics(self) -> LimiterStatistics:
        return LimiterStatistics(
            total=self._total,
            used=self._used,
            tasks_waiting=len(self._waiters),
            weight_waiting=sum(w.weight for w in self._waiters.values()),
        )

    def _grant(self) -> None:
        # Hand-off: charge the weight before the task runs again.
        while self._waiters:
            ticket, waiter = next(iter(self._waiters.items()))
            if waiter.weight > self._total - self._used:
                return
            del self._waiters[ticket]
            self._used += waiter.weight
            trio.lowlevel.reschedule(waiter.task)
