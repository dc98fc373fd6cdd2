"""The decision trace (lmprefetch.trace): each lookup's decision with its inputs and measured
outcome, the background measurements of tiers, and the ``decision_log`` file.

The slow tier is a token bucket (5 MB/s plus 20 ms per call) on Trio's mock clock.
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import trio

from lmprefetch import open_engine
from lmprefetch.trace import (
    CalibrationTrace,
    DecisionTrace,
    GcTrace,
    LookupTrace,
    StepTrace,
    TraceRecord,
    decode_records,
)

from .fakes import ThrottledTier
from .helpers import (
    POLICY_CS,
    POLICY_PAYLOAD,
    assert_conserved,
    engine_with,
    policy_config,
    policy_data,
    policy_prompt,
    put_in,
)

CS = POLICY_CS
PAYLOAD = POLICY_PAYLOAD
MB = 1_000_000


def _lookups(records: list[TraceRecord]) -> list[LookupTrace]:
    return [r for r in records if isinstance(r, LookupTrace)]


async def test_each_lookup_is_recorded_with_its_inputs_and_outcome(
    autojump_clock: trio.abc.Clock,
) -> None:
    slow = ThrottledTier("slow", bytes_per_s=5 * MB, rtt_s=0.020)
    config = policy_config(load_policy="cost", prefill_tokens_per_s=1_000)
    async with engine_with(config, slow) as eng:
        records: list[TraceRecord] = []
        eng.trace.subscribe(records.append)
        first = await put_in(slow, eng, policy_prompt(8, 1), policy_data(8, 1))
        second = await put_in(slow, eng, policy_prompt(8, 2), policy_data(8, 2))
        # Not measured: skipped, and measured in the background.
        assert await eng.lookup_and_prefetch("a", first, [CS] * 8, skip_chunks=1) == CS
        await eng.wait_quiet()
        # Measured: 7 chunks load in 20 ms + 92 ms, and take 448 ms to compute.  Loaded.
        assert await eng.lookup_and_prefetch("b", second, [CS] * 8) == 8 * CS
        eng.cancel("b")
        await eng.wait_quiet()
        a, b = _lookups(records)
        assert (a.lookup_id, a.decision, a.policy) == ("a", "skipped", "CostPolicy")
        assert (a.prompt_tokens, a.computed_tokens, a.hit_chunks, a.hit_tokens) == (
            8 * CS,
            CS,
            7,
            7 * CS,
        )
        assert (a.kept_chunks, a.answer_tokens, a.calibrating) == (0, CS, ("slow",))
        [part] = a.parts
        assert (part.tier, part.chunks, part.bytes, part.zero_copy) == (
            "slow",
            7,
            7 * PAYLOAD,
            False,
        )
        assert part.bytes_per_s is None  # what the policy saw: not measured yet
        assert [(p.tier, p.chunks) for p in a.probes] == [("cpu", 0), ("slow", 7)]
        assert a.probes[1].seconds == pytest.approx(0.020)
        assert (a.prefill_a, a.prefill_b, a.prefill_source) == (0.001, 0.0, "configured")
        assert a.predicted_load_s == 0.0 and a.predicted_load_all_s is None  # nothing known
        assert a.predicted_recompute_s == pytest.approx(7 * CS / 1_000)
        assert a.load_s is None
        assert a.answered_s == pytest.approx(0.020)
        [calibration] = [r for r in records if isinstance(r, CalibrationTrace)]
        assert (calibration.tier, calibration.chunks) == ("slow", 2)
        assert calibration.bytes_per_s == pytest.approx(5 * MB, rel=1e-3)
        assert (b.decision, b.kept_chunks, b.answer_tokens) == ("loaded", 8, 8 * CS)
        expected_load = 0.020 + 8 * PAYLOAD / (5 * MB)
        assert b.predicted_load_s == pytest.approx(expected_load, rel=1e-3)
        assert b.predicted_load_all_s == b.predicted_load_s
        assert b.predicted_recompute_s == 0.0
        assert b.predicted_recompute_all_s == pytest.approx(8 * CS / 1_000)
        assert b.load_s == pytest.approx(expected_load, rel=1e-3)  # measured
        assert b.decided_s == pytest.approx(0.020)
        assert b.answered_s == pytest.approx(0.020 + expected_load, rel=1e-3)
        assert b.parts[0].age_s == pytest.approx(b.wall - calibration.wall - 0.020, abs=0.5)
        assert_conserved(eng)


async def test_a_tier_ruled_out_and_a_cpu_hit_are_recorded_too(
    autojump_clock: trio.abc.Clock,
) -> None:
    slow = ThrottledTier("slow", bytes_per_s=5 * MB, rtt_s=0.020)
    config = policy_config(load_policy="cost", prefill_tokens_per_s=10_000)
    async with engine_with(config, slow) as eng:
        records: list[TraceRecord] = []
        unsubscribe = eng.trace.subscribe(records.append)
        warm = await put_in(slow, eng, policy_prompt(4, 9), policy_data(4, 9))
        assert await eng.lookup_and_prefetch("warm", warm, [CS] * 4) == 0
        await eng.wait_quiet()
        prompt = policy_prompt(6, 3)
        assert await eng.store(prompt[: 2 * CS], policy_data(2, 3)) == 2
        hashes = eng.hasher.hash(prompt)
        # The CPU tier holds 2 chunks; the slow tier is ruled out: answered from memory.
        assert await eng.lookup_and_prefetch("m", hashes, [CS] * 6) == 2 * CS
        eng.cancel("m")
        rec = _lookups(records)[-1]
        assert (rec.decision, rec.hit_chunks, rec.kept_chunks) == ("loaded", 2, 2)
        assert rec.not_probed == ("slow",)
        assert rec.probes == ()
        assert [(p.tier, p.zero_copy) for p in rec.parts] == [("cpu", True)]
        assert rec.predicted_load_s == 0.0
        assert eng.statistics().lookups.policy_unprobed == 1
        unsubscribe()
        assert not eng.trace.enabled
        assert await eng.lookup_and_prefetch("n", hashes, [CS] * 6) == 2 * CS
        eng.cancel("n")
        assert _lookups(records)[-1].lookup_id == "m"  # nothing recorded any more
        await eng.wait_quiet()
        assert_conserved(eng)


async def test_the_decision_log_is_a_json_lines_file(tmp_path: Path) -> None:
    path = tmp_path / "decisions-{rank}.jsonl"
    config = policy_config(decision_log=str(path))
    with trio.fail_after(30):
        async with open_engine(config) as eng:
            assert eng.trace.enabled
            prompt = policy_prompt(3, 1)
            assert await eng.store(prompt, policy_data(3, 1)) == 3
            assert await eng.lookup_and_prefetch("x", eng.hasher.hash(prompt), [CS] * 3) == 3 * CS
            eng.cancel("x")
            # A step, as the vLLM worker records one (from its own thread).
            await trio.to_thread.run_sync(
                eng.trace.emit, StepTrace(0, 1.0, 512, 512 * 512, 0.1, 0.0, None)
            )
            gc.collect()
    records = decode_records((tmp_path / "decisions-0.jsonl").read_bytes() + b'{"kind": "lo')
    lookups = [r for r in records if isinstance(r, LookupTrace)]
    assert [(r.lookup_id, r.decision, r.answer_tokens) for r in lookups] == [("x", "loaded", 192)]
    assert StepTrace(0, 1.0, 512, 512 * 512, 0.1, 0.0, None) in records
    assert any(isinstance(r, GcTrace) and r.generation == 2 for r in records)


async def test_a_decision_log_that_cannot_be_written_is_a_config_error(tmp_path: Path) -> None:
    config = policy_config(decision_log=str(tmp_path / "no-such-dir" / "d.jsonl"))
    with pytest.raises(ValueError, match="^decision_log: cannot append to "):
        async with open_engine(config):
            pass  # pragma: no cover


def test_a_trace_without_subscribers_is_off() -> None:
    trace = DecisionTrace(rank=3)
    assert not trace.enabled
    got: list[TraceRecord] = []
    stop = trace.subscribe(got.append)
    record = GcTrace(3, 1.0, 2, 0.01)
    trace.emit(record)
    stop()
    trace.emit(record)
    assert got == [record]
    assert not trace.enabled
