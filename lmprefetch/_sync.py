"""Typed wrappers for the trio-util primitives lmprefetch uses.

trio-util (``RepeatedEvent``) is a well-kept library that covers the "wake the
task that waits for this state" bookkeeping which is easy to get wrong by hand with one-shot
``trio.Event`` objects (a new event per wait, a lost wake-up when it is replaced at the wrong
moment).  It ships no type information, so the few methods used here get typed signatures;
everything else stays inside this module.

Cancellation follows trio-util: every wait is a checkpoint, cancellable like any other.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import trio_util

__all__ = ["RepeatedEvent"]


class RepeatedEvent:
    """An event that can be set any number of times (``trio_util.RepeatedEvent``).

    :meth:`events` is the consumer's loop: it yields once at once (with ``repeat_last``) and
    then once after each :meth:`set` it has not seen yet, coalescing sets that happen while the
    consumer is busy, so the consumer always sees the latest state and never misses a set.
    """

    __slots__ = ("_event", "set")

    def __init__(self) -> None:
        self._event: Any = trio_util.RepeatedEvent()
        #: Trigger the event (synchronous; wakes every waiter).
        self.set: Callable[[], None] = self._event.set

    async def wait(self) -> None:
        """Wait for the next :meth:`set`."""
        await self._event.wait()

    def events(self, *, repeat_last: bool = False) -> AsyncIterator[None]:
        """Iterate once per (coalesced) :meth:`set`; see the class docstring."""
        it: AsyncIterator[None] = self._event.events(repeat_last=repeat_last)
        return it
