"""Cancellation at every checkpoint of a lookup leaves nothing behind (DESIGN §7).

A trio Instrument counts the steps of a lookup's tasks (the lookup task and its per-tier load
tasks).  A first run measures how many steps the scenario takes; then the scenario is repeated
once per step ``k``, cancelling the lookup right after its ``k``-th step — through
``Engine.cancel`` and, separately, by cancelling the caller of ``lookup_and_prefetch``.  After
each run the conservation invariant must hold and exactly one answer must have been given.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import trio
import trio.testing

from lmprefetch import Engine, PrefetchConfig, open_engine

from .fakes import FakeTier
from .test_engine import CHUNK, assert_conserved, offsets, payloads, tokens


class StepCounter(trio.abc.Instrument):
    """Counts steps of lookup tasks; runs ``action`` after step number ``at``."""

    def __init__(self) -> None:
        self.steps = 0
        self.at: int | None = None
        self.action: Callable[[], None] | None = None

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        if not (task.name.startswith("lookup:") or task.name.endswith("_load_part")):
            return
        self.steps += 1
        if self.at is not None and self.steps == self.at and self.action is not None:
            self.action()


Setup = Callable[[Engine, FakeTier], Awaitable[list[int]]]


async def cpu_hit(engine: Engine, disk: FakeTier) -> list[int]:
    toks = tokens(4)
    await engine.store(toks, payloads(4))
    return engine.hasher.hash(toks)


async def partial_hit(engine: Engine, disk: FakeTier) -> list[int]:
    toks = tokens(6)
    await engine.store(toks[: 2 * CHUNK], payloads(2))
    hashes = engine.hasher.hash(toks)
    for key, data in list(zip(engine.keys.keys(hashes), payloads(6)))[:4]:
        disk.data[key] = data
    return hashes


async def disk_hit(engine: Engine, disk: FakeTier) -> list[int]:
    toks = tokens(5)
    hashes = engine.hasher.hash(toks)
    for key, data in zip(engine.keys.keys(hashes), payloads(5)):
        disk.data[key] = data
    return hashes


async def miss(engine: Engine, disk: FakeTier) -> list[int]:
    return engine.hasher.hash(tokens(3, salt=7))


SCENARIOS = {"cpu_hit": cpu_hit, "partial_hit": partial_hit, "disk_hit": disk_hit, "miss": miss}


async def run_scenario(
    config: PrefetchConfig,
    setup: Setup,
    counter: StepCounter,
    *,
    cancel_at: int | None,
    via_caller: bool,
) -> tuple[int, list[int]]:
    disk = FakeTier("disk")
    disk.chunk_delay_s = 0.001  # a checkpoint per chunk, and time passing under autojump
    answers: list[int] = []
    async with open_engine(config, extra_tiers=[disk]) as engine:
        hashes = await setup(engine, disk)
        caller = trio.CancelScope()
        counter.steps = 0
        counter.at = cancel_at
        counter.action = caller.cancel if via_caller else (lambda: engine.cancel("L"))

        async def call() -> None:
            with caller:
                answers.append(await engine.lookup_and_prefetch("L", hashes, offsets(len(hashes))))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(call)
        # Past the answer the lookup holds its result; cancel it to end the run.
        engine.cancel("L")
        await engine.wait_quiet()
        steps = counter.steps
        counter.at = None
        assert_conserved(engine)
    return steps, answers


@pytest.mark.parametrize("via_caller", [False, True], ids=["engine_cancel", "caller_cancel"])
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_cancel_at_every_checkpoint(scenario: str, via_caller: bool) -> None:
    config = PrefetchConfig(chunk_size=CHUNK, chunk_bytes=64, cpu_bytes=64 * 32)
    setup = SCENARIOS[scenario]
    counter = StepCounter()

    def run(cancel_at: int | None) -> tuple[int, list[int]]:
        return trio.run(
            functools.partial(
                run_scenario, config, setup, counter, cancel_at=cancel_at, via_caller=via_caller
            ),
            clock=trio.testing.MockClock(autojump_threshold=0),
            instruments=[counter],
        )

    total, answers = run(None)
    # A full CPU hit needs no I/O: it is answered without a task, so it has no checkpoint.
    assert total >= 1 or scenario == "cpu_hit"
    assert len(answers) == 1
    for k in range(1, total + 1):
        steps, answers = run(k)
        # The caller either got the answer or was cancelled before it; never two answers.
        assert len(answers) <= 1, (k, answers)
        assert steps <= total + 1


@pytest.mark.parametrize("via_caller", [False, True], ids=["engine_cancel", "caller_cancel"])
def test_cancel_at_every_checkpoint_real_disk_tier(via_caller: bool, tmp_path: Path) -> None:
    """The same with the real disk tier (files, worker threads) under the real clock.

    Thread timing varies between runs, so step ``k`` is not the same checkpoint every time;
    what must hold is that wherever the cancel lands, nothing is left behind.
    """
    config = PrefetchConfig(
        chunk_size=CHUNK, chunk_bytes=4096, cpu_bytes=4096 * 64, disk_path=str(tmp_path)
    )
    toks = tokens(12)
    data = [bytes([i]) * 4096 for i in range(12)]

    async def prepare() -> None:
        async with open_engine(config) as engine:
            await engine.store(toks, data)
            await engine.flush()

    trio.run(prepare)
    counter = StepCounter()

    async def scenario(cancel_at: int | None) -> tuple[int, list[int]]:
        answers: list[int] = []
        with trio.fail_after(20):
            async with open_engine(config) as engine:  # a fresh engine: the CPU tier is empty
                hashes = engine.hasher.hash(toks)
                caller = trio.CancelScope()
                counter.steps = 0
                counter.at = cancel_at
                counter.action = caller.cancel if via_caller else (lambda: engine.cancel("L"))

                async def call() -> None:
                    with caller:
                        answers.append(
                            await engine.lookup_and_prefetch("L", hashes, offsets(len(hashes)))
                        )

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(call)
                if answers and answers[0]:
                    with engine.claim("L") as chunks:
                        assert [bytes(b.view()) for _, b in chunks] == data[: len(chunks)]
                engine.cancel("L")
                await engine.wait_quiet()
                steps = counter.steps
                counter.at = None
                assert_conserved(engine)
        return steps, answers

    total, answers = trio.run(scenario, None, instruments=[counter])
    assert answers == [12 * CHUNK]
    assert total >= 2
    for k in range(1, total + 1):
        _, answers = trio.run(scenario, k, instruments=[counter])
        assert len(answers) <= 1
