"""The engine's books: every counter counts each event exactly once, the per-tier times add up,
records are forgotten when they end, and ``is_idle`` needs every part of the invariant.

Operators read these figures (``stats()``, the metrics endpoint) to tell a slow tier from a
leak, so a counter that stops at 1 or a record that outlives its lookup is a bug, even when
every answer is right.  (Mutation testing found these blind spots: see docs/reliability.md.)
"""

from __future__ import annotations

import logging
import os
from contextlib import ExitStack

import msgspec
import pytest
import trio
import trio.testing

from lmprefetch import PrefetchConfig, open_engine
from lmprefetch.events import BlockRemoved, BlockStored, ChunkBlocks
from lmprefetch.lookup import LookupStatistics
from lmprefetch.prefetch import LookupState
from lmprefetch.store import StoreStatistics
from lmprefetch.wiring import _check_machine_memory

from .fakes import FakeTier
from .helpers import CHUNK, assert_conserved, engine_with, offsets, payloads, put_in, tokens

TTL_S = 5.0


@pytest.fixture
def config() -> PrefetchConfig:
    return PrefetchConfig(
        chunk_size=CHUNK, chunk_bytes=64, cpu_bytes=64 * 32, claim_ttl_s=TTL_S, tier_timeout_s=1.0
    )


async def test_every_counter_counts_each_event_exactly_once(
    config: PrefetchConfig, autojump_clock: trio.testing.MockClock
) -> None:
    disk = FakeTier("disk")
    async with engine_with(config, disk) as engine:
        in_cpu = engine.hasher.hash(tokens(2, salt=1))
        await engine.store(tokens(2, salt=1), payloads(2, salt=1))
        on_disk = await put_in(disk, engine, tokens(3, salt=2), payloads(3, salt=2))
        unknown = engine.hasher.hash(tokens(2, salt=3))

        # 3 claims: two answered without a task (CPU), one by a lookup task (disk).
        for i in range(2):
            assert await engine.lookup_and_prefetch(f"claim{i}", in_cpu, offsets(2)) == 2 * CHUNK
            with engine.claim(f"claim{i}") as chunks:
                assert len(chunks) == 2
        assert await engine.lookup_and_prefetch("claim2", on_disk, offsets(3)) == 3 * CHUNK
        with engine.claim("claim2") as chunks:
            assert len(chunks) == 3

        # 4 expiries: two answered without a task, two by their lookup tasks.
        for i in range(2):
            assert await engine.lookup_and_prefetch(f"cpu-exp{i}", in_cpu, offsets(2)) > 0
            assert await engine.lookup_and_prefetch(f"disk-exp{i}", on_disk, offsets(3)) > 0
        await trio.sleep(TTL_S + 1)
        for i in range(2):
            # An expired result is forgotten, not kept as a dead record under its id.
            assert engine.lookup_state(f"cpu-exp{i}") is None
            assert engine.lookup_state(f"disk-exp{i}") is None
            assert engine.take(f"cpu-exp{i}") == []

        # 3 cancels of held results.
        for i in range(2):
            assert await engine.lookup_and_prefetch(f"cancel{i}", in_cpu, offsets(2)) > 0
            engine.cancel(f"cancel{i}")
        assert await engine.lookup_and_prefetch("cancel2", on_disk, offsets(3)) > 0
        engine.cancel("cancel2")

        # 2 misses.
        for i in range(2):
            assert await engine.lookup_and_prefetch(f"miss{i}", unknown, offsets(2)) == 0

        # 5 malformed requests: 2 reach the engine, 3 were rejected by a front end.
        answers: list[int] = []
        for i in range(2):
            engine.start_lookup(f"bad{i}", in_cpu, offsets(3), on_answer=answers.append)
        for _ in range(3):
            engine.note_malformed_request()

        # 2 deadlines that passed before the lookup started.
        for i in range(2):
            engine.start_lookup(
                f"late{i}",
                in_cpu,
                offsets(2),
                on_answer=answers.append,
                deadline=trio.current_time(),
            )
        assert answers == [0, 0, 0, 0]

        # 2 answer callbacks that raise: each a failed lookup (a bug, counted).
        def broken(hit_tokens: int) -> None:
            raise RuntimeError("the caller's callback is broken")

        engine.start_lookup("broken0", unknown, offsets(2), on_answer=broken)  # answered now
        engine.start_lookup("broken1", on_disk, offsets(3), on_answer=broken)  # by its task
        await trio.testing.wait_all_tasks_blocked()
        assert engine.lookup_state("broken1") is LookupState.HELD
        engine.cancel("broken1")  # a 4th cancel

        # 3 tier errors: two failed loads and one that timed out.
        disk.load_error = OSError("the disk is on fire")
        for i in range(2):
            assert await engine.lookup_and_prefetch(f"fire{i}", on_disk, offsets(3)) == 0
        disk.load_error = None
        disk.load_hang = True
        assert await engine.lookup_and_prefetch("hang", on_disk, offsets(3)) == 0
        disk.load_hang = False

        await engine.wait_quiet()
        stats = engine.statistics()
        assert stats.lookups == LookupStatistics(
            started=3 + 4 + 3 + 2 + 2 + 2 + 2 + 3,
            hits=3 + 4 + 3 + 1,  # broken1's disk hit was answered (not delivered)
            misses=2 + 2 + 2 + 1 + 3,
            hit_tokens=6 * 2 * CHUNK + 5 * 3 * CHUNK,
            claimed=3,
            cancelled=4,
            expired=4,
            failed=2,
            malformed=5,
            deadline_expired=2,
            # Every lookup that found chunks loaded them all (the "always" policy): the
            # 11 hits and the three disk hits whose loads failed.
            policy_loaded=3 + 4 + 3 + 1 + 3,
            policy_truncated=0,
            policy_skipped=0,
            deadline_cut=0,
            inflight=0,
            held=0,
        )
        assert stats.store == StoreStatistics(chunks_stored=2, rejected_chunks=0)
        assert stats.tier("disk").errors == 3
        assert_conserved(engine, faults=True)


async def test_a_failed_lookup_answers_0_even_with_chunks_to_skip(
    config: PrefetchConfig,
) -> None:
    """A bug inside a lookup answers 0, not the skipped prefix: the engine cannot vouch for
    anything once its own code failed."""
    disk = FakeTier("disk")
    async with engine_with(config, disk) as engine:
        hashes = await put_in(disk, engine, tokens(4), payloads(4))

        def bug(n: int) -> list[object]:
            raise RuntimeError("a bug in the arena")

        engine.arena.allocate_many = bug  # type: ignore[method-assign,assignment]
        assert await engine.lookup_and_prefetch("a", hashes, offsets(4)) == 0
        assert await engine.lookup_and_prefetch("b", hashes, offsets(4), skip_chunks=2) == 0
        assert engine.statistics().lookups.failed == 2
        await engine.wait_quiet()
        assert engine.lookup_state("a") is engine.lookup_state("b") is None
        assert_conserved(engine, faults=True)


async def test_a_load_that_fills_nothing_is_no_hit(config: PrefetchConfig) -> None:
    """A tier whose probe says yes but whose load fills 0 chunks (the files went away) adds
    nothing: the answer stops before that tier's chunks."""
    disk = FakeTier("disk")
    async with engine_with(config, disk) as engine:
        hashes = await put_in(disk, engine, tokens(3), payloads(3))
        disk.drop_before_load = set(engine.keys.keys(hashes))
        assert await engine.lookup_and_prefetch("gone", hashes, offsets(3)) == 0
        assert engine.take("gone") == []
        await engine.wait_quiet()
        assert_conserved(engine)


async def test_tier_load_times_are_the_loads_durations(
    config: PrefetchConfig, autojump_clock: trio.testing.MockClock
) -> None:
    disk = FakeTier("disk")
    disk.chunk_delay_s = 0.1
    async with engine_with(config, disk) as engine:
        hashes = await put_in(disk, engine, tokens(4), payloads(4))
        await trio.sleep(100)  # the clock is far from 0: a sum of times would show
        t0 = trio.current_time()
        assert await engine.lookup_and_prefetch("slow", hashes, offsets(4)) == 4 * CHUNK
        elapsed = trio.current_time() - t0
        engine.cancel("slow")
        tier = engine.statistics().tier("disk")
        assert tier.load_seconds == pytest.approx(4 * 0.1)
        assert tier.busy_seconds == pytest.approx(4 * 0.1)
        assert elapsed == pytest.approx(4 * 0.1)


async def test_on_lookup_done_gets_each_lookups_latency(
    config: PrefetchConfig, autojump_clock: trio.testing.MockClock
) -> None:
    disk = FakeTier("disk")
    disk.chunk_delay_s = 0.3
    async with engine_with(config, disk) as engine:
        done: list[tuple[int, float]] = []
        engine.on_lookup_done = lambda hit, seconds: done.append((hit, seconds))
        hashes = await put_in(disk, engine, tokens(2), payloads(2))
        assert await engine.lookup_and_prefetch("hit", hashes, offsets(2)) == 2 * CHUNK
        engine.cancel("hit")
        disk.load_hang = True
        with trio.move_on_after(0.75):  # the caller gives up: answered 0 by the task
            await engine.lookup_and_prefetch("given-up", hashes, offsets(2))
        await engine.wait_quiet()
        assert done == [(2 * CHUNK, pytest.approx(0.6)), (0, pytest.approx(0.75))]


async def test_when_a_tier_covers_the_rest_later_tiers_are_not_asked(
    config: PrefetchConfig,
) -> None:
    near, far = FakeTier("near"), FakeTier("far")
    async with open_engine(config, extra_tiers=[near, far]) as engine:
        hashes = await put_in(near, engine, tokens(3), payloads(3))
        await put_in(far, engine, tokens(3), payloads(3))
        assert await engine.lookup_and_prefetch("all-near", hashes, offsets(3)) == 3 * CHUNK
        engine.cancel("all-near")
        assert far.keys_probed == 0
        assert far.stats.probes == 0
        await engine.wait_quiet()
        assert_conserved(engine)


async def test_a_claimed_lookup_is_forgotten_at_once(config: PrefetchConfig) -> None:
    disk = FakeTier("disk")
    async with engine_with(config, disk) as engine:
        hashes = await put_in(disk, engine, tokens(2), payloads(2))
        assert await engine.lookup_and_prefetch("c", hashes, offsets(2)) == 2 * CHUNK
        assert engine.lookup_state("c") is LookupState.HELD
        chunks = engine.take("c")
        assert len(chunks) == 2
        assert engine.lookup_state("c") is None  # CLAIMED is final: the id is free
        assert engine.take("c") == []  # claimed once
        engine.arena.release_all([buf for _, buf in chunks])
        await engine.wait_quiet()
        assert_conserved(engine)


@pytest.mark.parametrize(
    "broken",
    ["inflight_lookups", "held_lookups", "pinned_chunks", "limiter_used", "arena_used_bytes"],
)
async def test_is_idle_needs_every_part_of_the_invariant(
    config: PrefetchConfig, broken: str
) -> None:
    """Each part of the invariant made false for real, one at a time: ``is_idle`` says so."""
    disk = FakeTier("disk")
    disk.load_gate = trio.Event()  # a disk load stays in flight
    async with engine_with(config, disk) as engine:
        await engine.store(tokens(1), payloads(1))
        in_cpu = engine.hasher.hash(tokens(1))
        on_disk = await put_in(disk, engine, tokens(2, salt=1), payloads(2, salt=1))
        assert engine.is_idle()
        with ExitStack() as undo:
            if broken == "inflight_lookups":
                engine.start_lookup("in-flight", on_disk, offsets(2), on_answer=lambda n: None)
                undo.callback(engine.cancel, "in-flight")
            elif broken == "held_lookups":
                assert await engine.lookup_and_prefetch("held", in_cpu, offsets(1)) == CHUNK
                undo.callback(engine.cancel, "held")
            elif broken == "pinned_chunks":
                key = engine.keys.keys(in_cpu)
                engine.cpu.pin(key)
                undo.callback(engine.cpu.unpin, key)
            elif broken == "limiter_used":
                undo.callback(engine.limiter.release, engine.limiter.acquire_nowait(1))
            else:
                buf = engine.arena.allocate()
                assert buf is not None
                undo.callback(buf.release)
            stats = engine.statistics()
            now = {
                "inflight_lookups": stats.lookups.inflight,
                "held_lookups": stats.lookups.held,
                "pinned_chunks": stats.pinned_chunks,
                "limiter_used": stats.limiter.used,
                "arena_used_bytes": stats.arena.used_bytes - stats.cpu_resident_bytes,
            }
            assert now[broken] > 0
            assert not engine.is_idle()
        disk.load_gate.set()
        await engine.wait_quiet()
        assert engine.is_idle()


async def test_a_deadline_that_passes_in_the_limiters_queue_is_a_shorter_prefix(
    config: PrefetchConfig, autojump_clock: trio.testing.MockClock
) -> None:
    """A tier's share that never got the limiter loaded nothing: the answer is the prefix
    before it, and that is not a failure."""
    disk = FakeTier("disk")
    disk.load_gate = trio.Event()
    config = msgspec.structs.replace(config, tier_timeout_s=30.0, lookup_timeout_s=30.0)
    async with engine_with(config, disk) as engine:
        capacity = engine.limiter.total
        big = await put_in(disk, engine, tokens(capacity, salt=1), payloads(capacity, salt=1))
        await engine.store(tokens(1, salt=2), payloads(1, salt=2))
        small = await put_in(disk, engine, tokens(3, salt=2), payloads(3, salt=2))
        answers: list[int] = []
        engine.start_lookup("big", big, offsets(capacity), on_answer=answers.append)
        await trio.testing.wait_all_tasks_blocked()
        assert engine.limiter.used == capacity
        deadline = trio.current_time() + 1.0
        assert (
            await engine.lookup_and_prefetch("small", small, offsets(3), deadline=deadline)
            == CHUNK  # the CPU tier's chunk; the disk's two waited for the limiter in vain
        )
        assert engine.statistics().lookups.failed == 0
        with engine.claim("small") as chunks:
            assert len(chunks) == 1
        disk.load_gate.set()
        await trio.testing.wait_all_tasks_blocked()
        engine.cancel("big")
        await engine.wait_quiet()
        assert_conserved(engine)


async def test_a_full_arena_is_a_shorter_prefix_not_a_failure(config: PrefetchConfig) -> None:
    disk = FakeTier("disk")
    async with engine_with(config, disk) as engine:
        hashes = await put_in(disk, engine, tokens(2), payloads(2))
        taken = engine.arena.allocate_many(engine.arena.num_slots)  # somebody holds them all
        assert engine.arena.free_slots == 0
        try:
            assert await engine.lookup_and_prefetch("full", hashes, offsets(2)) == 0
            assert engine.statistics().lookups.failed == 0
        finally:
            engine.arena.release_all(taken)
        await engine.wait_quiet()
        assert_conserved(engine)


async def test_parts_past_a_hole_give_their_buffers_back_at_once(config: PrefetchConfig) -> None:
    """Chunks loaded past the first hole are no use: their buffers go back to the arena when
    the answer is given, not when the held result is claimed or expires."""
    near, broken = FakeTier("near"), FakeTier("broken")
    far, farther = FakeTier("far"), FakeTier("farther")
    broken.load_error = OSError("this tier fails its loads")
    async with open_engine(config, extra_tiers=[near, broken, far, farther]) as engine:
        toks, data = tokens(5), payloads(5)
        hashes = engine.hasher.hash(toks)
        keys = engine.keys.keys(hashes)
        near.data[keys[0]] = data[0]
        broken.data[keys[1]] = data[1]
        far.data.update({keys[2]: data[2], keys[3]: data[3]})
        farther.data[keys[4]] = data[4]
        assert await engine.lookup_and_prefetch("holed", hashes, offsets(5)) == CHUNK
        assert far.chunks_read == 2 and farther.chunks_read == 1  # loaded, but past the hole
        stats = engine.statistics()
        assert stats.lookups.held == 1
        slot = engine.arena.slot_bytes
        assert stats.arena.used_bytes - stats.cpu_resident_bytes == 1 * slot
        with engine.claim("holed") as chunks:
            assert [bytes(buf.view()) for _, buf in chunks] == data[:1]
        await engine.wait_quiet()
        assert_conserved(engine, faults=True)


async def test_an_answer_given_at_once_took_no_time(
    config: PrefetchConfig, autojump_clock: trio.testing.MockClock
) -> None:
    async with open_engine(config) as engine:
        done: list[tuple[int, float]] = []
        engine.on_lookup_done = lambda hit, seconds: done.append((hit, seconds))
        await trio.sleep(100)  # a clock far from 0
        hashes = engine.hasher.hash(tokens(2))
        await engine.store(tokens(2), payloads(2))
        assert await engine.lookup_and_prefetch("hit", hashes, offsets(2)) == 2 * CHUNK
        engine.cancel("hit")
        engine.start_lookup("bad", hashes, offsets(3), on_answer=lambda n: None)
        assert done == [(2 * CHUNK, 0.0), (0, 0.0)]


async def test_a_callback_that_raises_is_logged_with_its_lookup_id(
    config: PrefetchConfig, caplog: pytest.LogCaptureFixture
) -> None:
    disk = FakeTier("disk")

    def broken(hit_tokens: int) -> None:
        raise RuntimeError("the caller's callback is broken")

    async with engine_with(config, disk) as engine:
        on_disk = await put_in(disk, engine, tokens(2), payloads(2))
        with caplog.at_level(logging.ERROR, logger="lmprefetch.engine"):
            engine.start_lookup("answered-now-7", on_disk, offsets(3), on_answer=broken)
            engine.start_lookup("answered-by-task-8", on_disk, offsets(2), on_answer=broken)
            await trio.testing.wait_all_tasks_blocked()
        engine.cancel("answered-by-task-8")
        await engine.wait_quiet()
        messages = [r.getMessage() for r in caplog.records]
        assert any("answered-now-7" in m for m in messages), messages
        assert any("answered-by-task-8" in m for m in messages), messages
        assert engine.statistics().lookups.failed == 2


async def test_a_records_state_ends_done_unless_claimed(config: PrefetchConfig) -> None:
    disk = FakeTier("disk")
    async with engine_with(config, disk) as engine:
        await engine.store(tokens(2, salt=1), payloads(2, salt=1))
        in_cpu = engine.hasher.hash(tokens(2, salt=1))
        on_disk = await put_in(disk, engine, tokens(2), payloads(2))
        answers: list[int] = []
        now = engine.start_lookup("now", in_cpu, offsets(2), on_answer=answers.append)
        task = engine.start_lookup("task", on_disk, offsets(2), on_answer=answers.append)
        claimed = engine.start_lookup("claimed", in_cpu, offsets(2), on_answer=answers.append)
        assert now is not None and task is not None and claimed is not None
        await trio.testing.wait_all_tasks_blocked()
        assert answers == [2 * CHUNK] * 3
        assert now.state is task.state is claimed.state is LookupState.HELD
        engine.cancel("now")
        engine.cancel("task")
        with engine.claim("claimed"):
            pass
        await engine.wait_quiet()
        assert now.state is LookupState.DONE
        assert task.state is LookupState.DONE
        assert claimed.state is LookupState.CLAIMED
        assert_conserved(engine)


async def test_stores_that_do_not_fit_count_every_rejected_chunk(config: PrefetchConfig) -> None:
    async with open_engine(config) as engine:  # 32 slots
        taken = engine.arena.allocate_many(engine.arena.num_slots - 2)
        try:
            assert await engine.store(tokens(5, salt=1), payloads(5)) == 2
            # Room again only by evicting the first store's chunks, not this call's own.
            assert await engine.store(tokens(4, salt=2), payloads(4)) == 2
            assert engine.statistics().store.rejected_chunks == 3 + 2
        finally:
            engine.arena.release_all(taken)


async def test_a_layerwise_chunk_that_does_not_fit_leaves_none_of_its_layers(
    config: PrefetchConfig,
) -> None:
    config = msgspec.structs.replace(config, layerwise=True, num_layers=2)
    async with open_engine(config) as engine:
        taken = engine.arena.allocate_many(engine.arena.num_slots - 5)  # room for 5 layers
        try:
            assert await engine.store(tokens(3), [bytes([i]) * 64 for i in range(3)]) == 2
            assert engine.statistics().cpu_resident_chunks == 4  # chunk 2's first layer is gone
            assert engine.arena.free_slots == 1
            assert engine.statistics().store.rejected_chunks == 1
        finally:
            engine.arena.release_all(taken)


async def test_store_says_which_payload_is_wrong_and_stores_nothing(
    config: PrefetchConfig,
) -> None:
    async with open_engine(config) as engine:
        with pytest.raises(
            ValueError, match=r"^payloads\[1\]: chunk 1 is a str, not a bytes-like object$"
        ):
            await engine.store(tokens(2), [b"a" * 8, "text"])
        layered = msgspec.structs.replace(config, layerwise=True, num_layers=4)
    async with open_engine(layered) as engine:
        with pytest.raises(
            ValueError,
            match=r"^payloads\[1\]: chunk 1 has 6 bytes, not divisible by num_layers \(4\)$",
        ):
            await engine.store(tokens(2), [b"a" * 8, b"b" * 6])
        assert engine.statistics().cpu_resident_chunks == 0


async def test_store_hashes_takes_one_block_name_per_payload(config: PrefetchConfig) -> None:
    async with open_engine(config, kv_events="chunks") as engine:
        hashes = engine.hasher.hash(tokens(2))
        blocks = [ChunkBlocks.make((1000 + i,), CHUNK) for i in range(2)]
        with pytest.raises(ValueError, match=r"^blocks: 1 for 2 payloads$"):
            await engine.store_hashes(hashes, payloads(2), blocks=blocks[:1])
        assert engine.statistics().cpu_resident_chunks == 0
        assert await engine.store_hashes(hashes, payloads(2), blocks=blocks) == 2
        stored = [e for e in engine.take_kv_events() if isinstance(e, BlockStored)]
        assert [e.block_hashes for e in stored] == [[1000], [1001]]


async def test_stored_chunks_are_announced_with_their_parents_and_tokens(
    config: PrefetchConfig,
) -> None:
    """In ``"chunks"`` mode a stored chunk is named by its hash; its parent is the chunk before
    it in the prompt, and its tokens are its own ``chunk_size`` tokens."""
    async with open_engine(config, kv_events="chunks") as engine:
        toks = tokens(4)
        hashes = engine.hasher.hash(toks)
        assert await engine.store(toks, payloads(3)) == 3
        stored = [e for e in engine.take_kv_events() if isinstance(e, BlockStored)]
        assert [
            (e.block_hashes, e.parent_block_hash, e.token_ids, e.block_size) for e in stored
        ] == [
            ([hashes[0]], None, toks[0:4], CHUNK),
            ([hashes[1]], hashes[0], toks[4:8], CHUNK),
            ([hashes[2]], hashes[1], toks[8:12], CHUNK),
        ]


async def test_layerwise_chunks_are_announced_once_each_not_once_per_layer(
    config: PrefetchConfig,
) -> None:
    config = msgspec.structs.replace(config, layerwise=True, num_layers=4)
    async with open_engine(config, kv_events="chunks") as engine:
        toks = tokens(2)
        hashes = engine.hasher.hash(toks)
        assert await engine.store(toks, [bytes([i]) * 64 for i in range(2)]) == 2
        stored = [e for e in engine.take_kv_events() if isinstance(e, BlockStored)]
        assert [e.block_hashes for e in stored] == [[hashes[0]], [hashes[1]]]
        # One layer gone is the whole chunk gone from the CPU tier.
        engine.cpu.discard(engine.keys.keys(hashes)[4 + 1])
        removed = [e for e in engine.take_kv_events() if isinstance(e, BlockRemoved)]
        assert [e.block_hashes for e in removed] == [[hashes[1]]]


async def test_stats_report_the_engines_shape_and_state(config: PrefetchConfig) -> None:
    async with open_engine(config, rank=1, world_size=3, kv_events="chunks") as engine:
        await engine.store(tokens(2), payloads(2))
        stats = engine.stats()
        slots = engine.arena.num_slots
        slot_bytes = engine.arena.slot_bytes
        assert {k: stats[k] for k in (
            "rank", "world_size", "limiter_used", "arena_total_bytes", "cpu_resident_chunks",
        )} == {
            "rank": 1, "world_size": 3, "limiter_used": 0,
            "arena_total_bytes": slots * slot_bytes, "cpu_resident_chunks": 2,
        }  # fmt: skip
        assert stats["limiter"] == {
            "total": slots // 2, "used": 0, "tasks_waiting": 0, "weight_waiting": 0,
        }  # fmt: skip
        assert stats["arena"] == {
            "slot_bytes": slot_bytes, "total_slots": slots, "used_slots": 2,
            "total_bytes": slots * slot_bytes, "used_bytes": 2 * slot_bytes,
        }  # fmt: skip
        # AllBlocksCleared, then 2 stored: each component's counters under its own name.
        assert stats["kv_events"] == {
            "stored": 2, "removed": 0, "cleared": 1, "dropped": 0, "pending": 1 + 2,
        }  # fmt: skip
        assert list(stats["tiers"]) == ["cpu"]
        assert stats["tiers"]["cpu"]["chunks_stored"] == 2
        # The typed value behind the dict.
        typed = engine.statistics()
        assert typed.as_dict() == stats
        assert typed.tier("cpu").chunks_stored == 2
        with pytest.raises(KeyError):
            typed.tier("disk")


async def test_a_closed_engine_answers_0_at_once_and_holds_nothing(
    config: PrefetchConfig, caplog: pytest.LogCaptureFixture
) -> None:
    async with open_engine(config) as engine:
        await engine.store(tokens(2), payloads(2))
        hashes = engine.hasher.hash(tokens(2))
    answers: list[int] = []
    done: list[int] = []
    engine.on_lookup_done = lambda hit, seconds: done.append(hit)
    late = engine.start_lookup("late", hashes, offsets(2), on_answer=answers.append)
    assert late.state is LookupState.DONE
    assert answers == [0] and done == [0]
    assert engine.lookup_state("late") is None

    def broken(hit_tokens: int) -> None:
        raise RuntimeError("broken callback")

    with caplog.at_level(logging.ERROR, logger="lmprefetch.engine"):
        engine.start_lookup("closed-9", hashes, offsets(2), on_answer=broken)
    assert any("closed-9" in r.getMessage() for r in caplog.records)


async def test_a_miss_known_without_io_answers_the_skipped_tokens_at_once(
    config: PrefetchConfig,
    autojump_clock: trio.testing.MockClock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """CPU tier only: a prompt it does not hold is answered synchronously, the skipped chunks
    counting as hits, in no time; a raising callback there is logged with its lookup id."""
    async with open_engine(config) as engine:
        done: list[tuple[int, float]] = []
        engine.on_lookup_done = lambda hit, seconds: done.append((hit, seconds))
        await trio.sleep(50)
        hashes = engine.hasher.hash(tokens(3))
        answers: list[int] = []
        rec = engine.start_lookup(
            "skip", hashes, offsets(3), on_answer=answers.append, skip_chunks=1
        )
        assert rec.state is LookupState.DONE and answers == [CHUNK]
        assert done == [(CHUNK, 0.0)]
        everything = engine.start_lookup(
            "all", hashes, offsets(3), on_answer=answers.append, skip_chunks=3
        )
        assert everything.state is LookupState.DONE and answers == [CHUNK, 3 * CHUNK]

        def broken(hit_tokens: int) -> None:
            raise RuntimeError("broken callback")

        with caplog.at_level(logging.ERROR, logger="lmprefetch.engine"):
            engine.start_lookup("miss-now-5", hashes, offsets(3), on_answer=broken)
        assert any("miss-now-5" in r.getMessage() for r in caplog.records)
        assert engine.statistics().lookups.failed == 1


async def test_a_one_token_chunk_is_a_hit(config: PrefetchConfig) -> None:
    async with open_engine(config) as engine:
        hashes = engine.hasher.hash(tokens(1))
        await engine.store(tokens(1), payloads(1))
        assert await engine.lookup_and_prefetch("one", hashes, [1]) == 1
        engine.cancel("one")
        lookups = engine.statistics().lookups
        assert (lookups.hits, lookups.misses, lookups.hit_tokens) == (1, 0, 1)


async def test_a_result_claimed_from_the_cpu_tier_is_forgotten_at_once(
    config: PrefetchConfig,
) -> None:
    async with open_engine(config) as engine:
        hashes = engine.hasher.hash(tokens(2))
        await engine.store(tokens(2), payloads(2))
        assert await engine.lookup_and_prefetch("c", hashes, offsets(2)) == 2 * CHUNK
        with engine.claim("c") as chunks:
            assert len(chunks) == 2
            assert engine.lookup_state("c") is None  # no task to end it: gone with the claim
        assert_conserved(engine)


async def test_held_results_expire_in_the_order_of_their_deadlines(
    config: PrefetchConfig, autojump_clock: trio.testing.MockClock
) -> None:
    async with open_engine(config) as engine:
        hashes = engine.hasher.hash(tokens(2))
        await engine.store(tokens(2), payloads(2))
        await trio.sleep(100)
        for i in range(3):
            assert await engine.lookup_and_prefetch(f"h{i}", hashes, offsets(2)) > 0
            await trio.sleep(1)
        # Held at 100, 101 and 102; each expires TTL_S later, no sooner and no later.
        await trio.sleep_until(100 + TTL_S - 0.5)
        assert [engine.lookup_state(f"h{i}") for i in range(3)] == [LookupState.HELD] * 3
        await trio.sleep_until(100 + TTL_S + 0.5)
        assert [engine.lookup_state(f"h{i}") for i in range(3)] == [
            None,
            LookupState.HELD,
            LookupState.HELD,
        ]
        await trio.sleep_until(102 + TTL_S + 0.5)
        assert [engine.lookup_state(f"h{i}") for i in range(3)] == [None] * 3
        assert engine.statistics().lookups.expired == 3


def test_a_cpu_budget_beyond_the_machine_is_refused_naming_the_field() -> None:
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    _check_machine_memory(physical)  # all of it: allowed (the kernel may overcommit)
    with pytest.raises(
        ValueError,
        match=rf"^cpu_bytes: {physical + 1} bytes is more than this machine's memory "
        rf"\({physical} bytes\); lower cpu_bytes$",
    ):
        _check_machine_memory(physical + 1)


async def test_a_first_chunk_missing_a_layer_is_a_miss_answered_at_once(
    config: PrefetchConfig, autojump_clock: trio.testing.MockClock
) -> None:
    config = msgspec.structs.replace(config, layerwise=True, num_layers=4)
    async with open_engine(config) as engine:
        done: list[tuple[int, float]] = []
        engine.on_lookup_done = lambda hit, seconds: done.append((hit, seconds))
        await trio.sleep(50)
        toks = tokens(3)
        hashes = engine.hasher.hash(toks)
        await engine.store(toks, [bytes([i]) * 64 for i in range(3)])
        engine.cpu.discard(engine.keys.keys(hashes)[4 + 3])  # chunk 1's last layer
        answers: list[int] = []
        rec = engine.start_lookup("a", hashes, offsets(3), on_answer=answers.append,
                                  skip_chunks=1)  # fmt: skip
        assert rec.state is LookupState.DONE
        assert answers == [CHUNK] and done == [(CHUNK, 0.0)]
        assert engine.statistics().lookups.failed == 0
        assert_conserved(engine)


async def test_chunks_stored_by_hash_are_named_by_hash_with_their_parents(
    config: PrefetchConfig,
) -> None:
    """``store_hashes`` without block names, in ``"chunks"`` mode: each chunk is named by its
    hash, its parent is the chunk before it, and ``take_kv_events(n)`` hands out at most n."""
    async with open_engine(config, kv_events="chunks") as engine:
        hashes = engine.hasher.hash(tokens(3))
        assert await engine.store_hashes(hashes, payloads(3)) == 3
        first = engine.take_kv_events(2)
        assert len(first) == 2  # AllBlocksCleared, then the first chunk
        stored = [e for e in first + engine.take_kv_events() if isinstance(e, BlockStored)]
        assert [(e.block_hashes, e.parent_block_hash, e.block_size) for e in stored] == [
            ([hashes[0]], None, CHUNK),
            ([hashes[1]], hashes[0], CHUNK),
            ([hashes[2]], hashes[1], CHUNK),
        ]
        assert engine.take_kv_events() == []


async def test_answers_given_at_once_log_a_broken_callback_with_the_lookup_id(
    config: PrefetchConfig, caplog: pytest.LogCaptureFixture
) -> None:
    """A malformed request, and a layerwise first chunk missing a layer, are answered before
    start_lookup returns; a callback that raises there is logged under the lookup's id, and the
    latency hook still gets its figure."""

    def broken(hit_tokens: int) -> None:
        raise RuntimeError("broken callback")

    layered = msgspec.structs.replace(config, layerwise=True, num_layers=4)
    async with open_engine(layered) as engine:
        done: list[tuple[int, float]] = []
        engine.on_lookup_done = lambda hit, seconds: done.append((hit, seconds))
        toks = tokens(2)
        hashes = engine.hasher.hash(toks)
        await engine.store(toks, [bytes([i]) * 64 for i in range(2)])
        engine.cpu.discard(engine.keys.keys(hashes)[1])  # chunk 0's second layer
        with caplog.at_level(logging.ERROR, logger="lmprefetch.engine"):
            engine.start_lookup("malformed-3", hashes, offsets(3), on_answer=broken)
            engine.start_lookup("layer-gone-4", hashes, offsets(2), on_answer=broken)
        messages = [r.getMessage() for r in caplog.records]
        assert any("malformed-3" in m for m in messages), messages
        assert any("layer-gone-4" in m for m in messages), messages
        assert [hit for hit, _ in done] == [0, 0]
        assert engine.statistics().lookups.failed == 2


async def test_late_and_fully_skipped_lookups_log_a_broken_callback_with_the_lookup_id(
    config: PrefetchConfig, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(hit_tokens: int) -> None:
        raise RuntimeError("broken callback")

    async with open_engine(config) as engine:
        done: list[int] = []
        engine.on_lookup_done = lambda hit, seconds: done.append(hit)
        hashes = engine.hasher.hash(tokens(2))
        with caplog.at_level(logging.ERROR, logger="lmprefetch.engine"):
            engine.start_lookup(
                "late-1", hashes, offsets(2), on_answer=broken, deadline=trio.current_time()
            )
            engine.start_lookup("skipped-2", hashes, offsets(2), on_answer=broken, skip_chunks=2)
        messages = [r.getMessage() for r in caplog.records]
        assert any("late-1" in m for m in messages), messages
        assert any("skipped-2" in m for m in messages), messages
        assert done == [0, 2 * CHUNK]


async def test_a_closed_engine_starts_no_task_for_a_tier_that_needs_one(
    config: PrefetchConfig,
) -> None:
    disk = FakeTier("disk")  # keeps its data after the engine closed; answers only with I/O
    async with engine_with(config, disk) as engine:
        hashes = await put_in(disk, engine, tokens(2), payloads(2))
    answers: list[int] = []
    after = engine.start_lookup("after", hashes, offsets(2), on_answer=answers.append)
    assert after.state is LookupState.DONE and after.scope is None  # no task
    assert answers == [0]


async def test_the_limiter_holds_half_the_arena_and_at_least_one_chunk() -> None:
    for slots, expected in ((2, 1), (3, 1), (8, 4)):
        config = PrefetchConfig(chunk_size=CHUNK, chunk_bytes=64, cpu_bytes=64 * slots)
        async with open_engine(config) as engine:
            assert engine.statistics().limiter.total == expected, slots
