"""WeightedCapacityLimiter: FIFO, no barging, hand-off, head-cancel, clamp, conservation."""

from __future__ import annotations

import random

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from lmprefetch.limiter import LimiterStatistics, WeightedCapacityLimiter


async def test_fast_path_grants_and_release_is_sync() -> None:
    lim = WeightedCapacityLimiter(10)
    with trio.testing.assert_checkpoints():
        assert await lim.acquire(4) == 4
    assert lim.used == 4
    with trio.testing.assert_no_checkpoints():
        lim.release(4)
    assert lim.used == 0


async def test_slow_path_is_a_checkpoint() -> None:
    lim = WeightedCapacityLimiter(2)
    await lim.acquire(2)
    async with trio.open_nursery() as nursery:

        async def waiter() -> None:
            with trio.testing.assert_checkpoints():
                await lim.acquire(1)
            lim.release(1)

        nursery.start_soon(waiter)
        await trio.testing.wait_all_tasks_blocked()
        lim.release(2)


async def test_cancelled_before_acquire_takes_nothing() -> None:
    lim = WeightedCapacityLimiter(5)
    with trio.CancelScope() as scope:
        scope.cancel()
        await lim.acquire(1)
    assert lim.used == 0


async def test_fifo_order_and_no_barging(autojump_clock: trio.testing.MockClock) -> None:
    lim = WeightedCapacityLimiter(10)
    order: list[str] = []
    await lim.acquire(8)

    async def want(name: str, weight: int) -> None:
        async with lim.hold(weight):
            order.append(name)
            await trio.sleep(1)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(want, "big", 9)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(want, "small", 2)  # would fit now (2 free) but must not barge
        await trio.testing.wait_all_tasks_blocked()
        assert order == []
        assert lim.statistics().tasks_waiting == 2
        with pytest.raises(trio.WouldBlock):
            lim.acquire_nowait(2)  # no barging for nowait either
        lim.release(8)
    assert order == ["big", "small"]
    assert lim.used == 0


async def test_large_request_not_starved_by_small_stream(
    autojump_clock: trio.testing.MockClock,
) -> None:
    lim = WeightedCapacityLimiter(10)
    big_done_at: list[float] = []

    async def small(i: int) -> None:
        await trio.sleep(i * 0.1)
        async with lim.hold(3):
            await trio.sleep(0.5)

    async def big() -> None:
        await trio.sleep(0.15)
        async with lim.hold(10):
            big_done_at.append(trio.current_time())

    async with trio.open_nursery() as nursery:
        for i in range(40):
            nursery.start_soon(small, i)
        nursery.start_soon(big)
    # The big request waits only for the smalls that arrived before it.
    assert big_done_at and big_done_at[0] < 1.0


async def test_cancelled_head_lets_smaller_followers_in(
    autojump_clock: trio.testing.MockClock,
) -> None:
    lim = WeightedCapacityLimiter(10)
    # A holds 6, big(8) queued, small(2) behind it; cancelling big admits small.
    await lim.acquire(6)
    admitted: list[str] = []

    async def waiter(name: str, weight: int, scope: trio.CancelScope) -> None:
        with scope:
            async with lim.hold(weight):
                admitted.append(name)
                await trio.sleep_forever()

    big_scope = trio.CancelScope()
    small_scope = trio.CancelScope()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter, "big", 8, big_scope)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(waiter, "small", 2, small_scope)
        await trio.testing.wait_all_tasks_blocked()
        assert admitted == []
        big_scope.cancel()
        await trio.testing.wait_all_tasks_blocked()
        assert admitted == ["small"]
        small_scope.cancel()
    lim.release(6)
    assert lim.used == 0
    assert lim.statistics().tasks_waiting == 0


async def test_oversized_request_is_clamped() -> None:
    lim = WeightedCapacityLimiter(4)
    async with lim.hold(100) as granted:
        assert granted == 4
        assert lim.used == 4
    assert lim.used == 0


async def test_release_more_than_used_raises() -> None:
    lim = WeightedCapacityLimiter(4)
    with pytest.raises(RuntimeError):
        lim.release(1)
    with pytest.raises(ValueError, match="total"):
        WeightedCapacityLimiter(0)


@pytest.mark.parametrize("total", [0, -3, True, 2.5, "4"])
def test_a_total_that_is_not_a_positive_int_is_refused_naming_it(total: object) -> None:
    with pytest.raises(ValueError, match="total"):
        WeightedCapacityLimiter(total)  # type: ignore[arg-type]


async def test_a_negative_weight_is_refused_naming_it_and_takes_nothing() -> None:
    lim = WeightedCapacityLimiter(4)
    with pytest.raises(ValueError, match="weight"):
        lim.acquire_nowait(-1)
    with pytest.raises(ValueError, match="weight"):
        await lim.acquire(-1)
    assert lim.used == 0
    assert lim.statistics().tasks_waiting == 0


async def test_a_release_of_more_than_is_held_says_how_much_and_changes_nothing() -> None:
    lim = WeightedCapacityLimiter(4)
    await lim.acquire(2)
    with pytest.raises(RuntimeError, match="release of 3 with only 2 in use"):
        lim.release(3)
    with pytest.raises(RuntimeError, match="release of -1"):
        lim.release(-1)
    assert lim.used == 2
    lim.release(0)  # releasing nothing is allowed (a part that got no weight)
    lim.release(2)
    assert lim.used == 0


async def test_statistics_count_the_waiters_and_their_clamped_weight() -> None:
    lim = WeightedCapacityLimiter(5)
    await lim.acquire(4)
    async with trio.open_nursery() as nursery:
        # One at a time: Trio may run tasks started together in either order.
        nursery.start_soon(lim.acquire, 3)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(lim.acquire, 9)  # clamped to the capacity, 5
        await trio.testing.wait_all_tasks_blocked()
        assert lim.statistics() == LimiterStatistics(
            total=5, used=4, tasks_waiting=2, weight_waiting=8
        )
        lim.release(4)  # the 3 goes in; the 5 still does not fit
        assert lim.statistics() == LimiterStatistics(
            total=5, used=3, tasks_waiting=1, weight_waiting=5
        )
        lim.release(3)
    assert lim.statistics() == LimiterStatistics(total=5, used=5, tasks_waiting=0, weight_waiting=0)
    lim.release(5)


async def test_handoff_charges_before_waiter_runs() -> None:
    lim = WeightedCapacityLimiter(4)
    await lim.acquire(4)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lim.acquire, 3)
        await trio.testing.wait_all_tasks_blocked()
        lim.release(4)
        # Charged at hand-off, before the waiter even ran again.
        assert lim.used == 3
        with pytest.raises(trio.WouldBlock):
            lim.acquire_nowait(2)
    lim.release(3)


@settings(max_examples=40, deadline=None)
@given(
    capacity=st.integers(1, 12),
    jobs=st.lists(
        st.tuples(st.integers(0, 20), st.integers(0, 5), st.booleans()), min_size=1, max_size=25
    ),
    seed=st.integers(0, 2**16),
)
def test_random_workload_conserves_capacity(
    capacity: int, jobs: list[tuple[int, int, bool]], seed: int
) -> None:
    rng = random.Random(seed)

    async def main() -> None:
        lim = WeightedCapacityLimiter(capacity)
        peak = 0

        async def job(weight: int, hold_s: int, cancel_early: bool) -> None:
            nonlocal peak
            with trio.move_on_after(0.5 if cancel_early else 1000):
                await trio.sleep(rng.random())
                async with lim.hold(weight) as granted:
                    assert granted == min(weight, capacity)
                    peak = max(peak, lim.used)
                    assert lim.used <= capacity
                    await trio.sleep(hold_s)

        async with trio.open_nursery() as nursery:
            for weight, hold_s, cancel_early in jobs:
                nursery.start_soon(job, weight, hold_s, cancel_early)
        assert lim.used == 0
        assert lim.statistics().tasks_waiting == 0
        assert peak <= capacity

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
