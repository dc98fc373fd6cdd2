"""The schedule explorer (``tests/schedules.py``): every invariant under many interleavings.

* ``test_explore_quick`` runs every scenario under two seeds, disturbed after every step (one
  disturbance per step, in turn): the quick pass of the default suite.
* ``test_explore_deep`` runs ``LMPF_SCHEDULE_SEEDS`` seeds with every disturbance after
  every step (``nox -s schedules``; skipped otherwise).
* ``test_replay`` replays one schedule named by ``LMPF_SCHEDULE=scenario:seed:step:name``
  (what a violation report prints).
* The ``test_bites_*`` tests break the engine on purpose and require the explorer to report a
  violation whose seed and step replay it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import pytest

from lmprefetch import lookup, lookup_io
from lmprefetch.lookup import LookupState

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
    not os.environ.get("LMPF_SCHEDULE_SEEDS"),
    reason="the deep pass runs in nox -s schedules (LMPF_SCHEDULE_SEEDS=N)",
)
@pytest.mark.parametrize("name", [s.name for s in schedules.scenarios()])
def test_explore_deep(name: str) -> None:
    seeds = range(int(os.environ["LMPF_SCHEDULE_SEEDS"]))
    result = schedules.explore(
        [schedules.by_name(name)], seeds, every_disturbance=True, stop_after=20
    )
    print(f"\nschedules: {name}: {result.runs} runs in {result.wall_s:.1f} s")
    assert not result.violations, _summary(result)


@pytest.mark.skipif(
    not os.environ.get("LMPF_SCHEDULE"),
    reason="set LMPF_SCHEDULE=scenario:seed:step:disturbance to replay one schedule",
)
def test_replay() -> None:
    name, seed, step, disturbance = os.environ["LMPF_SCHEDULE"].split(":")
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
    """The engine as it was: ``Engine.cancel`` of a LOADING lookup forgot the record and
    cancelled its task but left its state alone, so a lookup whose loads had returned held
    and answered a positive hit that nobody could claim."""
    real_cancel = lookup._Lookup.cancel

    def old_cancel(self: lookup._Lookup) -> None:
        if self.state is LookupState.LOADING:
            self._table.by_id.pop(self.lookup_id, None)
            self._table.counters.cancelled += 1
            if self.scope is not None:
                self.scope.cancel()
        else:
            real_cancel(self)

    with _patched(lookup._Lookup, "cancel", old_cancel):
        report = _find(_scenario("overlap_cpu_disk", "cancel_b"))
    assert report.disturbance == "cancel_b"
    assert any("nothing was held to claim" in v for v in report.violations), report.describe()


def test_bites_a_missing_release_on_cancel() -> None:
    """``cancel`` of a held result forgets its buffers instead of releasing them."""

    def leaky_cancel(self: lookup._Lookup) -> None:
        if self.state is LookupState.HELD:
            self.loaded = []
            self._move("cancel", LookupState.DONE)
        elif self.state is LookupState.LOADING:
            self._move("cancel", LookupState.CANCELLED)
            if self.scope is not None:
                self.scope.cancel()

    with _patched(lookup._Lookup, "cancel", leaky_cancel):
        report = _find(_scenario("cpu_hit_claim_expiry", "cancel_a"))
    assert any("owners" in v for v in report.violations), report.describe()


def test_bites_a_double_answer() -> None:
    """A cancelled lookup answers when it is cancelled and again when its task ends."""
    real_cancel = lookup._Lookup.cancel

    def answering_cancel(self: lookup._Lookup) -> None:
        loading = self.state is LookupState.LOADING
        real_cancel(self)
        if loading:
            self._on_answer(0)

    with _patched(lookup._Lookup, "cancel", answering_cancel):
        report = _find(_scenario("remote_fails", "cancel_a"))
    assert any("2 answers" in v for v in report.violations), report.describe()


def test_bites_the_fast_path_skipping_expiry() -> None:
    """A result held without a task is never queued for expiry: it is held forever (the run
    cannot become quiet, which the explorer reports under the mock clock, at once)."""
    real_hold = lookup._Lookups._hold

    def hold(self: lookup._Lookups, rec: lookup._Lookup) -> None:
        if rec.scope is not None:  # only lookups that ran in a task expire
            real_hold(self, rec)

    with _patched(lookup._Lookups, "_hold", hold):
        report = _find(_scenario("cpu_hit_claim_expiry", "expire"), seeds=(0,))
    assert any("TooSlowError" in v for v in report.violations), report.describe()


def test_bites_a_transition_outside_the_table() -> None:
    """An expiry that does not look at the state: a result claimed before its time is
    "expired" too (CLAIMED → DONE, a transition the table does not have)."""

    def expire(self: lookup._Lookup) -> None:
        if self.state is not LookupState.DONE:
            loaded, self.loaded = self.loaded, []
            self._move("expire", LookupState.DONE)
            lookup._release(loaded)

    with _patched(lookup._Lookup, "expire", expire):
        report = _find(_scenario("overlap_cpu_disk", "cancel_a"), seeds=(0,))
    assert any("not in the state table" in v for v in report.violations), report.describe()


def test_bites_a_pin_left_behind() -> None:
    """A tier's load that ends without dropping the lookup's pins (cancelled part way)."""
    real = lookup_io._Pins.release

    def release(self: lookup_io._Pins) -> None:
        if self.tier.name != "disk":
            real(self)

    with _patched(lookup_io._Pins, "release", release):
        report = _find(_scenario("overlap_cpu_disk", "cancel_a"), seeds=(0,))
    assert any("pinned_chunks" in v for v in report.violations), report.describe()


def test_the_state_table_is_the_docstrings() -> None:
    """One table: the transitions the record's code allows are the rows of its docstring's
    table, which the explorer checks every observed transition against."""
    assert schedules.STATE_TABLE == lookup.TRANSITIONS
    assert len(schedules.STATE_TABLE) == 8


def test_bites_a_truncation_that_forgets_the_dropped_chunks() -> None:
    """A policy's truncation that drops the tail of a part's buffers without releasing them
    (the part no longer owns them, nobody else does): the explorer sees arena bytes left over
    at quiescence."""

    def leaky_truncate(self: lookup_io._Part, n_chunks: int, kpc: int) -> None:
        self.n_chunks = n_chunks
        self.keys = self.keys[: n_chunks * kpc]
        self.pins.release_from(n_chunks * kpc)
        self.buffers = self.buffers[: n_chunks * kpc]  # the bug: the tail is not released
        self.loaded = min(self.loaded, n_chunks)

    s = schedules.by_name("policy_deadline")
    s.disturbances = {"deadline": s.disturbances["deadline"]}
    # The CPU part is the last (a remote tier that holds nothing is probed in a task): its
    # zero-copy references are what the policy drops.
    s.cpu = {"P": 4}
    s.disk = {}
    s.remote = {"Q": 0}
    with (
        _patched(lookup_io._Part, "truncate", leaky_truncate),
        _patched(schedules, "by_name", lambda name: s),
    ):
        report = _find([s])
    assert any("arena" in v for v in report.violations), report.describe()
