"""Cancellation at every checkpoint of an operation: a trio Instrument that names the steps.

An operation (a call of ``Engine.lookup_and_prefetch``, a tier's ``load``, ...) runs in a few
tasks: the caller's own task, the tasks it starts (a lookup's load tasks, a disk load's reader
tasks) and tasks that work for it elsewhere (the lookup task the engine starts, a tier's
write-behind task).  :class:`Steps` gives each of those tasks a stable key — its root's name,
then the path of the tasks that started it, each numbered by spawn order among its siblings —
and counts its steps while :attr:`Steps.armed`.

A first, undisturbed run gives :meth:`Steps.targets`: every ``(task key, step, "before" |
"after")``.  The operation is then run once per target with ``action`` (a cancellation) done
just before or just after that step of that task.  A step is numbered within its own task, so
the same target is the same point in that task's code on every run, however the other tasks
and worker threads interleave with it: a target is reproducible even with real threads.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable

import trio

Target = tuple[str, int, str]  # (task key, step number from 1, "before" | "after")


def _short(name: str) -> str:
    """``"lmprefetch.prefetch.Engine._load_part"`` -> ``"_load_part"``."""
    return name.rsplit(".", 1)[-1]


class Steps(trio.abc.Instrument):
    """Counts the steps of an operation's tasks; runs ``action`` at ``target``.

    Args:
        roots: names the tasks that are roots of the operation (the caller's task, a lookup
            task, a tier's writer); ``None`` for a task that is not.  Tasks started by a
            tracked task are tracked too.
        target: the step at which to run ``action`` (at most once), or ``None``.
    """

    def __init__(
        self,
        roots: Callable[[trio.lowlevel.Task], str | None],
        target: Target | None = None,
    ) -> None:
        self.roots = roots
        self.target = target
        self.action: Callable[[], None] | None = None
        self.armed = False
        self.fired = False
        self.keys: dict[trio.lowlevel.Task, str] = {}
        self.counts: Counter[str] = Counter()
        self._spawned: Counter[str] = Counter()

    def task_spawned(self, task: trio.lowlevel.Task) -> None:
        nursery = task.parent_nursery
        parent = nursery.parent_task if nursery is not None else None
        if parent is not None and parent in self.keys:
            base: str | None = f"{self.keys[parent]}/{_short(task.name)}"
        else:
            base = self.roots(task)
        if base is None:
            return
        self.keys[task] = f"{base}#{self._spawned[base]}"
        self._spawned[base] += 1

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        key = self.keys.get(task)
        if key is None or not self.armed:
            return
        self.counts[key] += 1
        self._maybe_fire(key, "before")

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        key = self.keys.get(task)
        if key is None or not self.armed:
            return
        self._maybe_fire(key, "after")

    def _maybe_fire(self, key: str, when: str) -> None:
        if self.fired or self.target is None or self.action is None:
            return
        if self.target == (key, self.counts[key], when):
            self.fired = True
            self.action()

    def targets(self) -> list[Target]:
        """Every step counted, before and after: the targets of the runs that follow."""
        return [
            (key, step, when)
            for key in sorted(self.counts)
            for step in range(1, self.counts[key] + 1)
            for when in ("before", "after")
        ]

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def named(*names: str, prefixes: Iterable[str] = ()) -> Callable[[trio.lowlevel.Task], str | None]:
    """A ``roots`` function: tasks whose (short) name is one of ``names`` or starts with one of
    ``prefixes`` are roots, keyed by that name or prefix."""
    wanted = set(names)
    starts = tuple(prefixes)

    def roots(task: trio.lowlevel.Task) -> str | None:
        short = _short(task.name)
        if short in wanted:
            return short
        for prefix in starts:
            if task.name.startswith(prefix):
                return prefix
        return None

    return roots


async def quiesce_threads(*owners: object) -> None:
    """Wait until no worker thread started with ``trio.to_thread.run_sync`` still runs: take every
    token of the default thread limiter and of every ``trio.CapacityLimiter`` attribute of
    ``owners`` (a tier's own limiters), then give them back.

    A thread holds its limiter token until it really ends, also when its task abandoned it, so
    once every token was ours no such thread runs any more (an event-driven wait, no polling).
    """
    limiters = [trio.to_thread.current_default_thread_limiter()]
    for owner in owners:
        for value in vars(owner).values():
            if isinstance(value, trio.CapacityLimiter) and value not in limiters:
                limiters.append(value)
    for limiter in limiters:
        borrowers = [object() for _ in range(int(limiter.total_tokens))]
        try:
            for borrower in borrowers:
                await limiter.acquire_on_behalf_of(borrower)
        finally:
            for borrower in borrowers:
                try:
                    limiter.release_on_behalf_of(borrower)
                except RuntimeError:  # never acquired (cancelled while waiting)
                    pass
