"""The schedule explorer (``tests/schedules.py``): every invariant under many interleavings.

* ``test_explore_quick`` runs every scenario under two seeds, disturbed after every step (one
  disturbance per step, in turn): the quick pass of the default suite.
* ``test_explore_deep`` runs ``LMPREFETCH_SCHEDULE_SEEDS`` seeds with every disturbance after
  every step (``nox -s schedules``; skipped otherwise).
* ``test_replay`` replays one schedule named by ``LMPREFETCH_SCHEDULE=scenario:seed:step:name``
  (what a violation report prints).
* The ``test_bites_*`` tests break the engine on purpose and require the explorer to report a
  violation whose seed and step replay it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import pytest

from lmprefetch import prefetch

from . import schedules
from .schedules import Exploration, RunReport, Scenario

QUICK_SEEDS = (0, 1)


def _summary(result: Exploration) -> str:
    shown = "\n".join(r.describe() for r in result.violations[:5])
    return f"{len(result.violations)} schedules violate an invariant:\n{shown}"


def test_explore_quick() -> None:
    result = schedules.explore(schedules.scenarios(), QUICK_SEEDS, every_disturbance=False)
    assert not result.violations, _summary(result)
    assert result.runs > 300  # every step of every scenario, twice


@pytest.mark.skipif(
    not os.environ.get("LMPREFETCH_SCHEDULE_SEEDS"),
    reason="the deep pass runs in nox -s schedules (LMPREFETCH_SCHEDULE_SEEDS=N)",
)
def test_explore_deep() -> None:
    seeds = range(int(os.environ["LMPREFETCH_SCHEDULE_SEEDS"]))
    result = schedules.explore(
        schedules.scenarios(), seeds, every_disturbance=True, stop_after=20
    )
    print(
        f"\nschedules: {len(schedules.scenarios())} scenarios, {result.runs} runs in "
        f"{result.wall_s:.1f} s; per scenario {result.per_scenario}"
    )
    assert not result.violations, _summary(result)


@pytest.mark.skipif(
    not os.environ.get("LMPREFETCH_SCHEDULE"),
    reason="set LMPREFETCH_SCHEDULE=scenario:seed:step:disturbance to replay one schedule",
)
def test_replay() -> None:
    name, seed, step, disturbance = os.environ["LMPREFETCH_SCHEDULE"].split(":")
    k = None if step == "None" else int(step)
    report = schedules.run_once(
        schedules.by_name(name), int(seed), k, None if disturbance == "None" else disturbance
    )
    assert not report.violations, report.describe()


# -- the explorer itself ---------------------------------------------------------------------
@pytest.mark.parametrize("name", [s.name for s in schedules.scenarios()])
def test_a_seed_fixes_the_schedule(name: str) -> None:
    """The same seed steps the same tasks in the same order; other seeds find other orders
    (worker threads included: the disk scenarios' reads land at other steps)."""
    scenario = schedules.by_name(name)
    first, again = schedules.run_once(scenario, 3), schedules.run_once(scenario, 3)
    assert first.trace == again.trace
    assert first.steps > 5
    others = {tuple(schedules.run_once(scenario, seed).trace) for seed in range(4, 10)}
    assert len(others | {tuple(first.trace)}) > 1


def test_threads_run_in_lockstep() -> None:
    """Disk reads run through the simulated threads, so their place in the schedule is
    explored too: across seeds, the reads run at different task steps, and a seed fixes
    them."""
    scenario = schedules.by_name("overlap_cpu_disk")
    runs = [schedules.run_once(scenario, seed) for seed in range(6)]
    assert all(r.thread_steps for r in runs)
    assert len({tuple(r.thread_steps) for r in runs}) > 1
    assert schedules.run_once(scenario, 0).thread_steps == runs[0].thread_steps


# -- it bites: defects put in on purpose -----------------------------------------------------
def _find(scenarios: Sequence[Scenario], seeds: Sequence[int] = (0, 1, 2)) -> RunReport:
    result = schedules.explore(scenarios, seeds, every_disturbance=True, stop_after=1)
    assert result.violations, "the explorer found nothing"
    report = result.violations[0]
    # The report names a schedule that shows the same violation again.
    again = schedules.run_once(
        schedules.by_name(report.scenario), report.seed, report.k, report.disturbance
    )
    assert again.violations, f"{report.describe()} did not replay"
    return report


@contextmanager
def _patched(obj: object, name: str, value: object) -> Iterator[None]:
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def _scenario(name: str, *disturbances: str) -> list[Scenario]:
    s = schedules.by_name(name)
    s.disturbances = {d: s.disturbances[d] for d in disturbances}
    return [s]


def test_bites_the_known_violation() -> None:
    """The engine as it was: ``Engine.cancel`` of a LOADING lookup left its state alone, so a
    lookup whose loads had returned answered a positive hit nobody could claim."""
    original: Callable[..., None] = prefetch.Engine._cancel_record

    def old_cancel_record(self: prefetch.Engine, rec: prefetch._Lookup) -> None:
        if rec.state in (prefetch.LookupState.LOADING, prefetch.LookupState.HELD):
            self.counters["lookups_cancelled"] += 1
        if rec.state is prefetch.LookupState.HELD:
            rec.release()
        if rec.has_task:
            rec.scope.cancel()

    assert original is not old_cancel_record
    with _patched(prefetch.Engine, "_cancel_record", old_cancel_record):
        report = _find(_scenario("overlap_cpu_disk", "cancel_b"))
    assert report.disturbance == "cancel_b"
    assert any("nothing was held to claim" in v for v in report.violations), report.describe()
