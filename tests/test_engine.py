"""The prefetch engine: lookup paths, claim, cancel, expiry, faults, and the defect table."""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from lmprefetch import Engine, PrefetchConfig, open_engine
from lmprefetch.prefetch import LookupState
from lmprefetch.tiers.disk import DiskTier

from .fakes import FakeTier
from .helpers import (
    CHUNK,
    assert_conserved,
    engine_with,
    layer_parts,
    offsets,
    payloads,
    put_in,
    resident_bytes,
    tokens,
)


# -- the happy paths ---------------------------------------------------------------------
async def test_cpu_hit_claim_returns_exact_bytes(small_config: PrefetchConfig) -> None:
    async with engine_with(small_config) as engine:
        toks, data = tokens(5), payloads(5)
        assert await engine.store(toks, data) == 5
        hashes = engine.hasher.hash(toks)
        assert await engine.lookup_and_prefetch("r1", hashes, offsets(5)) == 20
        assert engine.statistics().lookups.held == 1
        with engine.claim("r1") as chunks:
            assert [bytes(b.view()) for _, b in chunks] == data
            assert [k.chunk_hash for k, _ in chunks] == hashes
        await engine.wait_quiet()
        assert_conserved(engine)


async def test_partial_prompt_hit_counts_only_stored_prefix(small_config: PrefetchConfig) -> None:
    async with engine_with(small_config) as engine:
        toks = tokens(6)
        await engine.store(toks[: 3 * CHUNK], payloads(3))
        hashes = engine.hasher.hash(toks)
        assert await engine.lookup_and_prefetch("r", hashes, offsets(6)) == 3 * CHUNK
        with engine.claim("r") as chunks:
            assert len(chunks) == 3


async def test_full_miss_answers_zero_and_holds_nothing(small_config: PrefetchConfig) -> None:
    async with engine_with(small_config) as engine:
        hashes = engine.hasher.hash(tokens(3))
        assert await engine.lookup_and_prefetch("m", hashes, offsets(3)) == 0
        assert engine.statistics().lookups.held == 0
        with engine.claim("m") as chunks:
            assert chunks == []
        assert_conserved(engine)


async def test_partial_last_chunk_tokens_counted(small_config: PrefetchConfig) -> None:
    config = small_config.replace(save_partial_chunks=True)
    async with engine_with(config) as engine:
        toks = [*tokens(2), 7, 8]  # two full chunks and a 2-token tail
        assert await engine.store(toks, payloads(3)) == 3
        hashes = engine.hasher.hash(toks)
        assert await engine.lookup_and_prefetch("p", hashes, [4, 4, 2]) == 10


async def test_second_tier_hit_is_loaded_and_combined(small_config: PrefetchConfig) -> None:
    slow = FakeTier("disk")
    async with engine_with(small_config, slow) as engine:
        toks, data = tokens(6), payloads(6)
        await engine.store(toks[: 2 * CHUNK], data[:2])  # chunks 0-1 in CPU
        hashes = await put_in(slow, engine, toks, data)  # chunks 0-5 in the fake tier
        assert await engine.lookup_and_prefetch("t", hashes, offsets(6)) == 24
        with engine.claim("t") as chunks:
            assert [bytes(b.view()) for _, b in chunks] == data
        await engine.wait_quiet()
        assert_conserved(engine)


async def test_tier_with_no_hit_is_skipped_and_next_tier_probed(
    small_config: PrefetchConfig,
) -> None:
    empty, full = FakeTier("empty"), FakeTier("full")
    async with engine_with(small_config, empty, full) as engine:
        toks, data = tokens(3), payloads(3)
        hashes = await put_in(full, engine, toks, data)
        assert await engine.lookup_and_prefetch("s", hashes, offsets(3)) == 12
        assert empty.loads_started == 0


async def test_skip_chunks_counted_but_not_loaded(small_config: PrefetchConfig) -> None:
    async with engine_with(small_config) as engine:
        toks, data = tokens(4), payloads(4)
        await engine.store(toks, data)
        hashes = engine.hasher.hash(toks)
        got = await engine.lookup_and_prefetch("k", hashes, offsets(4), skip_chunks=2)
        assert got == 16
        with engine.claim("k") as chunks:
            assert [bytes(b.view()) for _, b in chunks] == data[2:]


async def test_claim_of_unknown_or_twice_is_empty(small_config: PrefetchConfig) -> None:
    async with engine_with(small_config) as engine:
        toks = tokens(2)
        await engine.store(toks, payloads(2))
        await engine.lookup_and_prefetch("c", engine.hasher.hash(toks), offsets(2))
        with engine.claim("nope") as chunks:
            assert chunks == []
        with engine.claim("c") as chunks:
            assert len(chunks) == 2
        with engine.claim("c") as chunks:
            assert chunks == []


async def test_unclaimed_result_expires_after_ttl(
    small_config: PrefetchConfig, autojump_clock: trio.testing.MockClock
) -> None:
    config = small_config.replace(claim_ttl_s=5.0)
    async with engine_with(config) as engine:
        toks = tokens(3)
        await engine.store(toks, payloads(3))
        await engine.lookup_and_prefetch("e", engine.hasher.hash(toks), offsets(3))
        assert engine.statistics().lookups.held == 1
        await trio.sleep(4.9)
        assert engine.statistics().lookups.held == 1
        await trio.sleep(0.2)
        assert engine.statistics().lookups.expired == 1
        with engine.claim("e") as chunks:
            assert chunks == []
        assert_conserved(engine)


async def test_reused_id_cancels_the_old_lookup(small_config: PrefetchConfig) -> None:
    async with engine_with(small_config) as engine:
        toks = tokens(3)
        await engine.store(toks, payloads(3))
        hashes = engine.hasher.hash(toks)
        assert await engine.lookup_and_prefetch("x", hashes, offsets(3), seq=1) == 12
        assert await engine.lookup_and_prefetch("x", hashes[:1], offsets(1), seq=2) == 4
        await trio.testing.wait_all_tasks_blocked()
        assert engine.statistics().lookups.held == 1
        with engine.claim("x") as chunks:
            assert len(chunks) == 1


async def test_cleanup_with_older_seq_leaves_newer_lookup(small_config: PrefetchConfig) -> None:
    async with engine_with(small_config) as engine:
        toks = tokens(2)
        await engine.store(toks, payloads(2))
        hashes = engine.hasher.hash(toks)
        await engine.lookup_and_prefetch("y", hashes, offsets(2), seq=5)
        engine.cancel("y", seq=4)
        assert engine.lookup_state("y") is LookupState.HELD
        engine.cancel("y", seq=5)
        assert engine.lookup_state("y") is None
        await engine.wait_quiet()
        assert_conserved(engine)


async def test_malformed_request_answers_zero_and_counts(small_config: PrefetchConfig) -> None:
    async with engine_with(small_config) as engine:
        assert await engine.lookup_and_prefetch("bad", [1, 2, 3], [4, 4]) == 0
        assert await engine.lookup_and_prefetch("bad2", [1], [0]) == 0
        assert engine.statistics().lookups.malformed == 2


async def test_expired_deadline_answers_zero(small_config: PrefetchConfig) -> None:
    async with engine_with(small_config) as engine:
        toks = tokens(2)
        await engine.store(toks, payloads(2))
        past = trio.current_time() - 1
        got = await engine.lookup_and_prefetch(
            "d", engine.hasher.hash(toks), offsets(2), deadline=past
        )
        assert got == 0
        assert engine.statistics().lookups.deadline_expired == 1


async def test_layerwise_keys_per_layer_and_whole_chunks(small_config: PrefetchConfig) -> None:
    config = small_config.replace(layerwise=True, num_layers=4, chunk_bytes=64)
    async with engine_with(config) as engine:
        toks = tokens(3)
        data = [bytes(range(i, i + 64)) for i in range(3)]
        assert await engine.store(toks, data) == 3
        assert engine.statistics().cpu_resident_chunks == 12
        hashes = engine.hasher.hash(toks)
        # Drop one layer of chunk 1: the hit stops at a whole chunk.
        engine.cpu.discard(engine.keys.keys(hashes)[4 + 2])
        assert await engine.lookup_and_prefetch("L", hashes, offsets(3)) == 4
        with engine.claim("L") as chunks:
            assert len(chunks) == 4
            assert [k.layer for k, _ in chunks] == [0, 1, 2, 3]
            assert b"".join(bytes(b.view()) for _, b in chunks) == data[0]
        await engine.wait_quiet()
        assert_conserved(engine)


# -- store -------------------------------------------------------------------------------
async def test_store_rejects_oversized_payload_naming_the_chunk(
    small_config: PrefetchConfig,
) -> None:
    async with engine_with(small_config) as engine:
        with pytest.raises(ValueError, match=r"payloads\[1\]: chunk 1"):
            await engine.store(tokens(2), [b"a" * 10, b"b" * 65])
        assert engine.statistics().cpu_resident_chunks == 0  # nothing stored
        with pytest.raises(ValueError, match="payloads"):
            await engine.store(tokens(1), payloads(2))


async def test_store_when_everything_pinned_stores_what_fits(
    small_config: PrefetchConfig,
) -> None:
    async with engine_with(small_config) as engine:  # 32 slots
        held = tokens(30, salt=1)
        await engine.store(held, payloads(30))
        await engine.lookup_and_prefetch("hold", engine.hasher.hash(held), offsets(30))
        assert await engine.store(tokens(5, salt=2), payloads(5)) == 2
        assert engine.statistics().store.rejected_chunks == 3
        engine.cancel("hold")
        await engine.wait_quiet()
        assert await engine.store(tokens(5, salt=2), payloads(5)) == 5  # evicts now
        assert_conserved(engine)


# -- defects -----------------------------------------------------------------------------
async def test_d01_cached_chunk_survives_lookup_claim_cleanup_cycles(
    small_config: PrefetchConfig,
) -> None:
    async with engine_with(small_config) as engine:
        toks, data = tokens(3), payloads(3)
        await engine.store(toks, data)
        hashes = engine.hasher.hash(toks)
        for i in range(50):
            assert await engine.lookup_and_prefetch(f"r{i}", hashes, offsets(3)) == 12
            with engine.claim(f"r{i}") as chunks:
                assert [bytes(b.view()) for _, b in chunks] == data
            engine.cancel(f"r{i}")  # cleanup after claim is a no-op
            engine.cancel(f"r{i}")
        # Churn the arena so a wrongly freed slot would be reused and overwritten.
        await engine.store(tokens(20, salt=9), payloads(20, salt=9))
        await engine.lookup_and_prefetch("final", hashes, offsets(3))
        with engine.claim("final") as chunks:
            assert [bytes(b.view()) for _, b in chunks] == data
        await engine.wait_quiet()
        assert_conserved(engine)


async def test_d02_pins_return_to_zero_on_every_path_and_eviction_still_works(
    small_config: PrefetchConfig, autojump_clock: trio.testing.MockClock
) -> None:
    disk = FakeTier("disk")
    config = small_config.replace(claim_ttl_s=1.0)
    async with engine_with(config, disk) as engine:
        toks, data = tokens(4), payloads(4)
        await engine.store(toks, data)
        hashes = await put_in(disk, engine, tokens(8), payloads(8))
        hashes = engine.hasher.hash(tokens(8))
        # hit + claim
        await engine.lookup_and_prefetch("a", hashes, offsets(8))
        with engine.claim("a"):
            pass
        # hit + cancel
        await engine.lookup_and_prefetch("b", hashes, offsets(8))
        engine.cancel("b")
        # hit + expiry
        await engine.lookup_and_prefetch("c", hashes, offsets(8))
        await trio.sleep(2)
        # miss
        await engine.lookup_and_prefetch("d", [1, 2], offsets(2))
        await engine.wait_quiet()
        assert_conserved(engine)
        # Every CPU entry is evictable again: fill the arena with new chunks.
        assert await engine.store(tokens(32, salt=3), payloads(32, salt=3)) == 32


async def test_d04_cancel_in_flight_prefetch_stops_loads_and_releases(
    small_config: PrefetchConfig,
) -> None:
    disk = FakeTier("disk")
    disk.load_gate = trio.Event()
    async with engine_with(small_config, disk) as engine:
        hashes = await put_in(disk, engine, tokens(6), payloads(6))
        answers: list[int] = []
        engine.start_lookup("inflight", hashes, offsets(6), on_answer=answers.append)
        await trio.testing.wait_all_tasks_blocked()
        assert engine.statistics().lookups.inflight == 1
        assert engine.statistics().pinned_chunks == 6
        engine.cancel("inflight")
        await engine.wait_quiet()
        disk.load_gate.set()
        await trio.testing.wait_all_tasks_blocked()
        assert answers == [0]
        assert disk.chunks_read == 0  # nothing was loaded after the cancel
        assert_conserved(engine)


async def test_d05_failing_tier_answers_prefix_before_it_at_once(
    small_config: PrefetchConfig,
) -> None:
    broken = FakeTier("broken")
    broken.load_error = OSError("disk on fire")
    async with engine_with(small_config, broken) as engine:
        toks, data = tokens(5), payloads(5)
        await engine.store(toks[: 2 * CHUNK], data[:2])
        hashes = await put_in(broken, engine, toks, data)
        with trio.fail_after(1):
            assert await engine.lookup_and_prefetch("f", hashes, offsets(5)) == 8
        with engine.claim("f") as chunks:
            assert [bytes(b.view()) for _, b in chunks] == data[:2]
        await engine.wait_quiet()
        assert_conserved(engine, faults=True)
        assert engine.statistics().lookups.failed == 0  # a tier's failure is not the engine's
        broken.load_error = None
        broken.probe_error = RuntimeError("probe broke")
        assert await engine.lookup_and_prefetch("g", hashes, offsets(5)) == 8
        assert broken.stats.errors == 2


async def test_d05_hanging_tier_is_bounded_by_tier_timeout(
    small_config: PrefetchConfig, autojump_clock: trio.testing.MockClock
) -> None:
    config = small_config.replace(tier_timeout_s=0.5)
    hung = FakeTier("hung")
    async with engine_with(config, hung) as engine:
        toks, data = tokens(4), payloads(4)
        await engine.store(toks[:CHUNK], data[:1])
        hashes = await put_in(hung, engine, toks, data)
        hung.load_hang = True
        t0 = trio.current_time()
        assert await engine.lookup_and_prefetch("h", hashes, offsets(4)) == 4
        assert trio.current_time() - t0 == pytest.approx(0.5)
        hung.load_hang = False
        hung.probe_hang = True
        t0 = trio.current_time()
        assert await engine.lookup_and_prefetch("h2", hashes, offsets(4)) == 4
        assert trio.current_time() - t0 == pytest.approx(0.5)
        engine.cancel("h")
        engine.cancel("h2")
        await engine.wait_quiet()
        assert_conserved(engine, faults=True)
        assert engine.statistics().lookups.failed == 0
        assert hung.stats.errors == 2


async def test_d09_concurrent_prefetches_overlap(
    small_config: PrefetchConfig, autojump_clock: trio.testing.MockClock
) -> None:
    disk = FakeTier("disk")
    disk.chunk_delay_s = 0.01
    config = small_config.replace(cpu_bytes=64 * 256)
    async with engine_with(config, disk) as engine:
        all_hashes = []
        for i in range(8):
            all_hashes.append(await put_in(disk, engine, tokens(4, salt=i), payloads(4, salt=i)))
        t0 = trio.current_time()
        async with trio.open_nursery() as nursery:
            for i, hashes in enumerate(all_hashes):
                nursery.start_soon(engine.lookup_and_prefetch, f"c{i}", hashes, offsets(4))
        elapsed = trio.current_time() - t0
        # one lookup takes 4 × 10 ms; eight serialized would take 320 ms
        assert elapsed == pytest.approx(0.04)
        assert disk.max_concurrent_loads == 8


async def test_d10_oversized_request_is_clamped_not_raised(small_config: PrefetchConfig) -> None:
    disk = FakeTier("disk")
    async with engine_with(small_config, disk) as engine:  # 32 slots: limiter capacity 16
        assert engine.limiter.total == 16
        hashes = await put_in(disk, engine, tokens(24), payloads(24))
        assert await engine.lookup_and_prefetch("big", hashes, offsets(24)) == 16 * CHUNK
        engine.cancel("big")
        await engine.wait_quiet()
        assert_conserved(engine)


async def test_d11_arena_exhausted_gives_shorter_prefix_never_waits(
    small_config: PrefetchConfig,
) -> None:
    disk = FakeTier("disk")
    async with engine_with(small_config, disk) as engine:  # 32 slots
        held = tokens(28, salt=5)
        await engine.store(held, payloads(28, salt=5))
        await engine.lookup_and_prefetch("pin", engine.hasher.hash(held), offsets(28))
        hashes = await put_in(disk, engine, tokens(10), payloads(10))
        with trio.fail_after(1):
            assert await engine.lookup_and_prefetch("short", hashes, offsets(10)) == 4 * CHUNK
        with engine.claim("short") as chunks:
            assert [bytes(b.view()) for _, b in chunks] == payloads(10)[:4]
        engine.cancel("pin")
        await engine.wait_quiet()
        assert_conserved(engine)


@pytest.mark.parametrize("unreadable", [None, 1], ids=["all_readable", "chunk_1_unreadable"])
@pytest.mark.parametrize("layerwise", [False, True], ids=["chunks", "layerwise"])
@pytest.mark.parametrize("tier_kind", ["fake", "disk"])
async def test_d12_allocation_failure_never_hands_out_unread_buffers(
    tmp_path: Path, tier_kind: str, layerwise: bool, unreadable: int | None
) -> None:
    """The arena runs out while a load allocates its buffers: ``allocate_many`` hands back
    fewer than asked.  The lookup answers the shorter prefix it could read (shorter still
    when a chunk among the allocated ones cannot be read), holds nothing past it (no unread
    buffer, no buffer of half a chunk), and everything goes back afterwards."""
    kpc = 2 if layerwise else 1
    config = PrefetchConfig(
        chunk_size=CHUNK,
        chunk_bytes=64 * kpc,
        cpu_bytes=64 * 32,  # 32 slots of 64 bytes
        layerwise=layerwise,
        num_layers=kpc,
        disk_path=str(tmp_path) if tier_kind == "disk" else None,
    )
    toks, data = tokens(6), payloads(6, size=48 * kpc)
    extra: list[FakeTier] = []
    if tier_kind == "disk":
        async with open_engine(config) as engine:  # the disk tier outlives this engine
            assert await engine.store(toks, data) == 6
    else:
        extra = [FakeTier("fake")]
    async with open_engine(config, extra_tiers=extra) as engine:  # its CPU tier is empty
        hashes = engine.hasher.hash(toks)
        if extra:
            extra[0].data.update(zip(engine.keys.keys(hashes), layer_parts(data, kpc)))
        # Fill the arena with CPU chunks held by a lookup (never evicted) and leave 5 slots
        # free: 5 chunks, or 2 whole chunks and one slot of a third in layerwise mode.
        held_chunks = 27 // kpc
        held_toks = tokens(held_chunks, salt=3)
        await engine.store(held_toks, payloads(held_chunks, salt=3, size=48 * kpc))
        await engine.flush()
        held_hashes = engine.hasher.hash(held_toks)
        assert await engine.lookup_and_prefetch("hold", held_hashes, offsets(held_chunks)) > 0
        blockers = engine.arena.allocate_many(27 - held_chunks * kpc)
        assert engine.arena.free_slots == 5
        loaded = 5 // kpc
        if unreadable is not None:  # its first layer's file, or the fake's value, vanishes
            gone = engine.keys.keys(hashes)[unreadable * kpc]
            if extra:
                extra[0].drop_before_load = {gone}
            else:
                await trio.Path(tmp_path / f"{gone.to_string()}.kv").unlink()
            loaded = unreadable
        used_before = engine.arena.used_slots
        got = await engine.lookup_and_prefetch("short", hashes, offsets(6))
        assert got == loaded * CHUNK  # a shorter prefix, never a wait, never an error
        # Held now: exactly the loaded chunks' buffers, nothing unread, no half chunk.
        assert engine.arena.used_slots == used_before + loaded * kpc
        with engine.claim("short") as chunks:
            assert [bytes(b.view()) for _, b in chunks] == layer_parts(data, kpc)[: loaded * kpc]
        for buf in blockers:
            buf.release()
        engine.cancel("hold")
        await engine.wait_quiet()
        assert_conserved(engine)
        # With room again, the whole prompt (up to an unreadable chunk) loads.
        whole = 6 if unreadable is None else unreadable
        assert await engine.lookup_and_prefetch("full", hashes, offsets(6)) == whole * CHUNK
        with engine.claim("full") as chunks:
            assert [bytes(b.view()) for _, b in chunks] == layer_parts(data, kpc)[: whole * kpc]
        await engine.wait_quiet()
        assert_conserved(engine)


async def test_d13_chunk_deleted_between_probe_and_load_truncates(
    small_config: PrefetchConfig,
) -> None:
    disk, remote = FakeTier("disk"), FakeTier("remote")
    async with engine_with(small_config, disk, remote) as engine:
        toks, data = tokens(8), payloads(8)
        keys = engine.keys.keys(engine.hasher.hash(toks))
        for key, payload in list(zip(keys, data))[:4]:
            disk.data[key] = payload
        for key, payload in zip(keys, data):
            remote.data[key] = payload
        disk.drop_before_load = {keys[1]}
        hashes = engine.hasher.hash(toks)
        assert await engine.lookup_and_prefetch("h", hashes, offsets(8)) == CHUNK
        with engine.claim("h") as chunks:
            assert [bytes(b.view()) for _, b in chunks] == data[:1]
        await engine.wait_quiet()
        assert_conserved(engine)


# -- the same defects on the real disk tier (files in tmp_path, worker threads) --------------
DISK_LIMIT_S = 30.0


def disk_config(tmp_path: Path, **changes: object) -> PrefetchConfig:
    return PrefetchConfig(
        chunk_size=CHUNK,
        chunk_bytes=64,
        cpu_bytes=64 * 64,
        disk_path=str(tmp_path),
        lookup_timeout_s=DISK_LIMIT_S,
        tier_timeout_s=DISK_LIMIT_S,
    ).replace(**changes)


async def on_disk(config: PrefetchConfig, *prompts: tuple[list[int], list[bytes]]) -> None:
    """Store ``prompts`` into the disk tier of ``config`` with an engine that is then closed:
    the next engine on that directory starts with an empty CPU tier."""
    async with open_engine(config) as engine:
        for toks, data in prompts:
            assert await engine.store(toks, data) == len(data)


def the_disk(engine: Engine) -> DiskTier:
    (disk,) = [t for t in engine.tiers if isinstance(t, DiskTier)]
    return disk


class Answers:
    """Collects the answers of ``expected`` lookups; ``all_in`` is set once each answered."""

    def __init__(self, expected: int) -> None:
        self.expected = expected
        self.got: dict[str, list[int]] = {}
        self.all_in = trio.Event()

    def callback(self, lookup_id: str) -> Callable[[int], None]:
        def on_answer(hit_tokens: int) -> None:
            self.got.setdefault(lookup_id, []).append(hit_tokens)
            if len(self.got) == self.expected:
                self.all_in.set()

        return on_answer


class ReadGate:
    """Holds the disk tier's chunk reads (in its worker threads) until opened; counts the
    reads started and the threads waiting in it."""

    def __init__(self, disk: DiskTier, monkeypatch: pytest.MonkeyPatch, *, hold_from: int = 0):
        self._read = disk._read_chunk
        self._cond = threading.Condition()
        self._open = False
        self.hold_from = hold_from  # the first reads pass; the read number ``hold_from`` waits
        self.started = 0
        self.waiting = 0
        monkeypatch.setattr(disk, "_read_chunk", self._gated)

    def _gated(self, *args: Any) -> Any:
        with self._cond:
            number = self.started
            self.started += 1
            if number >= self.hold_from and not self._open:
                self.waiting += 1
                self._cond.notify_all()
                assert self._cond.wait_for(lambda: self._open, DISK_LIMIT_S), "gate never opened"
                self.waiting -= 1
        return self._read(*args)

    async def wait_for_waiting(self, n: int) -> bool:
        """Until ``n`` threads wait at the gate (``False`` past the deadline)."""

        def wait() -> bool:
            with self._cond:
                return self._cond.wait_for(lambda: self.waiting >= n, DISK_LIMIT_S)

        return await trio.to_thread.run_sync(wait)

    def open(self) -> None:
        with self._cond:
            self._open = True
            self._cond.notify_all()

    def __enter__(self) -> ReadGate:
        return self

    def __exit__(self, *exc: object) -> None:
        self.open()  # also when the test fails: no thread is left waiting


async def test_d04_cancel_in_flight_disk_prefetch_stops_reads_and_releases(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = disk_config(tmp_path)
    toks, data = tokens(6), payloads(6)
    await on_disk(config, (toks, data))
    with trio.fail_after(DISK_LIMIT_S):
        async with open_engine(config) as engine:
            disk = the_disk(engine)
            # Chunk 0 is read; the read of chunk 1 waits at the gate.
            with ReadGate(disk, monkeypatch, hold_from=1) as gate:
                answers: list[int] = []
                hashes = engine.hasher.hash(toks)
                engine.start_lookup("L", hashes, offsets(6), on_answer=answers.append)
                assert await gate.wait_for_waiting(1)
                assert engine.statistics().lookups.inflight == 1
                assert engine.statistics().pinned_chunks == 6
                engine.cancel("L")
                gate.open()  # the read in flight finishes; no other read may start
                await engine.wait_quiet()
                assert answers == [0]
                assert gate.started == 2  # chunk 0, and chunk 1 that was in flight at the cancel
                assert disk.stats.chunks_loaded == 0  # nothing counted as loaded
                assert len(disk) == 6  # a cancel is not a miss: every chunk is still indexed
                assert_conserved(engine)


async def test_d09_disk_load_in_flight_while_the_next_tier_is_probed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk tier's load runs while the next tier is probed (not after it): with the disk
    read held in its thread, the remote tier's probe must have started."""
    config = disk_config(tmp_path)
    toks, data = tokens(8), payloads(8)
    await on_disk(config, (toks[: 4 * CHUNK], data[:4]))
    remote = FakeTier("remote")
    remote.probe_gate = trio.Event()
    with trio.fail_after(DISK_LIMIT_S):
        async with open_engine(config, extra_tiers=[remote]) as engine:
            hashes = engine.hasher.hash(toks)
            remote.data.update(zip(engine.keys.keys(hashes), data))
            with ReadGate(the_disk(engine), monkeypatch) as gate:
                answers = Answers(1)
                engine.start_lookup("L", hashes, offsets(8), on_answer=answers.callback("L"))
                assert await gate.wait_for_waiting(1)  # the disk load is in flight
                await trio.testing.wait_all_tasks_blocked()
                assert remote.keys_probed >= 1  # ...and the next tier's probe runs meanwhile
                assert the_disk(engine).stats.chunks_loaded == 0
                assert answers.got == {}
                remote.probe_gate.set()
                gate.open()
                await answers.all_in.wait()
                assert answers.got == {"L": [8 * CHUNK]}
                with engine.claim("L") as chunks:
                    assert [bytes(b.view()) for _, b in chunks] == data
                await engine.wait_quiet()
                assert_conserved(engine)


async def test_d09_concurrent_disk_lookups_are_all_in_flight_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Eight disk lookups: all eight loads are in flight together under the weighted limiter,
    and their reads run in eight threads at once (LMCache ran them one at a time)."""
    config = disk_config(tmp_path, disk_read_threads=8)
    prompts = [(tokens(2, salt=i), payloads(2, salt=i)) for i in range(8)]
    await on_disk(config, *prompts)
    with trio.fail_after(DISK_LIMIT_S):
        async with open_engine(config) as engine:
            disk = the_disk(engine)
            with ReadGate(disk, monkeypatch) as gate:
                in_load = 0
                real_load = disk.load

                async def counted_load(keys: Any, buffers: Any) -> int:
                    nonlocal in_load
                    in_load += 1
                    try:
                        return await real_load(keys, buffers)
                    finally:
                        in_load -= 1

                monkeypatch.setattr(disk, "load", counted_load)
                answers = Answers(8)
                for i, (toks, _) in enumerate(prompts):
                    hashes = engine.hasher.hash(toks)
                    engine.start_lookup(
                        f"c{i}", hashes, offsets(2), on_answer=answers.callback(f"c{i}")
                    )
                await trio.testing.wait_all_tasks_blocked()
                assert in_load == 8  # every load started, none waits for another
                assert engine.limiter.used == 16
                assert await gate.wait_for_waiting(8)  # eight reads in eight threads at once
                gate.open()
                await answers.all_in.wait()
                assert answers.got == {f"c{i}": [2 * CHUNK] for i in range(8)}
                for i, (_, data) in enumerate(prompts):
                    with engine.claim(f"c{i}") as chunks:
                        assert [bytes(b.view()) for _, b in chunks] == data
                await engine.wait_quiet()
                assert_conserved(engine)


class SpawnCounter(trio.abc.Instrument):
    """Counts the tasks spawned, and the task steps run, while installed."""

    def __init__(self) -> None:
        self.spawned: list[str] = []
        self.steps = 0

    def task_spawned(self, task: trio.lowlevel.Task) -> None:
        self.spawned.append(task.name)

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self.steps += 1


@pytest.mark.parametrize("policy", ["always", "cost"])
async def test_a_lone_disk_hit_takes_one_task_and_no_probe_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, policy: str
) -> None:
    """A hit one tier serves whole: the disk tier is probed synchronously (its index is in
    memory: no await of ``contains_prefix``), and its load, the lookup's last, runs in the
    lookup's own task: one task spawned per lookup, whichever policy decides and when."""
    config = disk_config(tmp_path, load_policy=policy)
    toks, data = tokens(6), payloads(6)
    await on_disk(config, (toks, data))
    with trio.fail_after(DISK_LIMIT_S):
        async with open_engine(config) as engine:
            disk = the_disk(engine)
            awaited: list[int] = []
            real_probe = disk.contains_prefix

            async def counted_probe(keys: Any, *, pin: bool) -> int:
                awaited.append(len(keys))
                return await real_probe(keys, pin=pin)

            monkeypatch.setattr(disk, "contains_prefix", counted_probe)
            hashes = engine.hasher.hash(toks)
            counter = SpawnCounter()
            trio.lowlevel.add_instrument(counter)
            try:
                hit = await engine.lookup_and_prefetch("L", hashes, offsets(6))
            finally:
                trio.lowlevel.remove_instrument(counter)
            assert hit == 6 * CHUNK
            assert counter.spawned == ["lookup:L"]
            assert awaited == []
            assert disk.stats.probes == 1
            with engine.claim("L") as chunks:
                assert [bytes(b.view()) for _, b in chunks] == data
            await engine.wait_quiet()
            assert_conserved(engine)


def test_a_tier_overriding_only_the_awaited_probe_is_awaited() -> None:
    """The synchronous probe is used only where it is the probe ``contains_prefix`` makes: a
    subclass that overrides ``contains_prefix`` alone (to slow, count or fail it) keeps it."""
    from lmprefetch.lookup_io import _probes_now
    from lmprefetch.tiers.cpu import CpuTier

    class Slowed(DiskTier):
        async def contains_prefix(self, keys: Any, *, pin: bool) -> int:
            await trio.sleep(1)
            return await super().contains_prefix(keys, pin=pin)

    class SlowedBoth(Slowed):
        def contains_prefix_now(self, keys: Any, *, pin: bool) -> int:
            return super().contains_prefix_now(keys, pin=pin)

    def bare(cls: type[Any]) -> Any:
        return cls.__new__(cls)  # (only the class is looked at)

    assert _probes_now(bare(DiskTier))
    assert _probes_now(bare(CpuTier))
    assert not _probes_now(bare(Slowed))
    assert _probes_now(bare(SlowedBoth))
    assert not _probes_now(FakeTier("remote"))


async def test_d13_disk_file_deleted_between_probe_and_load_truncates(tmp_path: Path) -> None:
    """Chunk 1's file goes after the disk tier indexed it: the disk load stops there, and the
    remote tier's later chunks are not used (never paired with the wrong keys)."""
    config = disk_config(tmp_path)
    toks, data = tokens(8), payloads(8)
    await on_disk(config, (toks[: 4 * CHUNK], data[:4]))
    remote = FakeTier("remote")
    with trio.fail_after(DISK_LIMIT_S):
        async with open_engine(config, extra_tiers=[remote]) as engine:
            hashes = engine.hasher.hash(toks)
            keys = engine.keys.keys(hashes)
            remote.data.update(zip(keys, data))
            disk = the_disk(engine)
            assert disk.contains_now(keys[1])
            await trio.Path(tmp_path / f"{keys[1].to_string()}.kv").unlink()
            assert await engine.lookup_and_prefetch("h", hashes, offsets(8)) == CHUNK
            with engine.claim("h") as chunks:
                assert [bytes(b.view()) for _, b in chunks] == data[:1]
            assert not disk.contains_now(keys[1])  # the missing file left the index
            assert remote.loads_started == 1  # loaded, then dropped past the hole
            await engine.wait_quiet()
            assert_conserved(engine)


async def test_caller_cancelled_before_answer_cancels_lookup(small_config: PrefetchConfig) -> None:
    disk = FakeTier("disk")
    disk.load_gate = trio.Event()
    async with engine_with(small_config, disk) as engine:
        hashes = await put_in(disk, engine, tokens(3), payloads(3))
        with trio.move_on_after(0.05):
            await engine.lookup_and_prefetch("gone", hashes, offsets(3))
        await engine.wait_quiet()
        assert engine.lookup_state("gone") is None
        assert_conserved(engine)


async def test_close_with_lookups_in_flight_and_held_releases_all(
    small_config: PrefetchConfig,
) -> None:
    disk = FakeTier("disk")
    disk.load_gate = trio.Event()
    answers: list[int] = []
    async with open_engine(small_config, extra_tiers=[disk]) as engine:
        toks = tokens(3, salt=1)
        await engine.store(toks, payloads(3))
        await engine.lookup_and_prefetch("held", engine.hasher.hash(toks), offsets(3))
        hashes = await put_in(disk, engine, tokens(3), payloads(3))
        engine.start_lookup("loading", hashes, offsets(3), on_answer=answers.append)
        await trio.testing.wait_all_tasks_blocked()
        arena = engine.arena
    assert answers == [0]
    assert arena.used_slots == 0


async def test_answer_callback_errors_are_contained(
    small_config: PrefetchConfig, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(_: int) -> None:
        raise RuntimeError("callback bug")

    async with engine_with(small_config) as engine:
        toks = tokens(2)
        await engine.store(toks, payloads(2))
        with caplog.at_level(logging.ERROR):
            engine.start_lookup("cb", engine.hasher.hash(toks), offsets(2), on_answer=broken)
            await trio.testing.wait_all_tasks_blocked()
        assert "callback" in caplog.text
        engine.cancel("cb")


async def test_ranks_sharing_a_disk_path_never_index_or_evict_each_others_files(
    tmp_path: Path,
) -> None:
    """The ranks of one engine share ``disk_path``: each indexes, evicts and cleans up only
    its own chunk files (and temp files), so one rank's eviction never costs another a hit."""
    chunk_bytes = 4096
    file_bytes = chunk_bytes + 4096  # one chunk file, header included
    config = PrefetchConfig(
        chunk_size=CHUNK,
        chunk_bytes=chunk_bytes,
        cpu_bytes=chunk_bytes * 16,
        disk_path=str(tmp_path),
        disk_bytes=3 * file_bytes,
    )
    toks = tokens(3)
    data = [bytes([i]) * chunk_bytes for i in range(3)]
    async with open_engine(config, rank=0, world_size=2) as engine:
        assert await engine.store(toks, data) == 3
        await engine.flush()
    # Rank 0 has a write in progress (its temp file) while rank 1 starts.
    in_progress = trio.Path(tmp_path / "model@2@0@00000000000000ff@bfloat16.kv.tmp")
    await in_progress.write_bytes(b"half a chunk")
    async with open_engine(config, rank=1, world_size=2) as engine:
        disk = engine.tiers[1]
        assert isinstance(disk, DiskTier)
        assert len(disk) == 0 and disk.foreign_files == 4  # rank 0's 3 files and its temp
        # Filling rank 1's share evicts only rank 1's own files.
        for salt in (4, 5):
            assert await engine.store(tokens(3, salt=salt), data) == 3
            await engine.flush()
        assert len(disk) == 3
        assert disk.stats.evictions == 3
    assert len(list(await trio.Path(tmp_path).glob("model@2@0@*.kv"))) == 3  # rank 0's
    assert await in_progress.exists()
    async with open_engine(config, rank=0, world_size=2) as engine:  # a fresh CPU tier
        hashes = engine.hasher.hash(toks)
        assert await engine.lookup_and_prefetch("r", hashes, offsets(3)) == 3 * CHUNK
        with engine.claim("r") as chunks:
            assert [bytes(b.view()) for _, b in chunks] == data
        assert engine.tiers[1].stale_temp_files_removed == 1  # its own temp file, at start
        await engine.wait_quiet()
        assert_conserved(engine)


async def test_claimed_and_cancelled_results_do_not_pile_up_in_the_expiry_queue(
    small_config: PrefetchConfig,
) -> None:
    """Every held result expires through one queue; results that were claimed or cancelled
    leave it (lazily, amortised), so it follows what is held, not the lookup rate times
    claim_ttl_s."""
    async with engine_with(small_config) as engine:
        toks = tokens(2)
        await engine.store(toks, payloads(2))
        hashes = engine.hasher.hash(toks)
        kept = []
        for i in range(10_000):
            assert await engine.lookup_and_prefetch(f"r{i}", hashes, offsets(2)) == 8
            if i % 1000 == 0:
                kept.append(f"r{i}")  # still held
            elif i % 2:
                with engine.claim(f"r{i}") as chunks:
                    assert len(chunks) == 2
            else:
                engine.cancel(f"r{i}")
        assert len(engine._lookups._expiries) < 2 * 1024 + len(kept)
        assert engine.statistics().lookups.held == len(kept)
        for lookup_id in kept:
            with engine.claim(lookup_id) as chunks:
                assert len(chunks) == 2
        await engine.wait_quiet()
        assert_conserved(engine)


@pytest.mark.skipif(sys.platform != "linux", reason="mincore on an anonymous mapping: Linux")
@pytest.mark.parametrize("prefault_slots", [0, 3, 40, 64])
async def test_open_engine_prefaults_the_configured_part_of_the_arena(prefault_slots: int) -> None:
    """``arena_prefault_bytes`` of the arena (whole slots, from the first) is in memory once
    the engine is open; the rest is mapped on first use.  Large amounts go to a thread."""
    slot = 64 * 1024
    config = PrefetchConfig(
        chunk_size=CHUNK,
        chunk_bytes=slot,
        cpu_bytes=slot * 48,
        arena_prefault_bytes=prefault_slots * slot,
    )
    async with open_engine(config) as engine:
        assert resident_bytes(engine.arena) == min(prefault_slots, 48) * slot


async def test_wait_quiet_waits_for_every_held_result_with_or_without_a_task(
    small_config: PrefetchConfig, autojump_clock: trio.testing.MockClock
) -> None:
    """Nothing loading or held: a result answered from memory (no task) counts as much as one
    a lookup task loaded; each ends the wait when it is claimed, cancelled or expires."""
    disk = FakeTier("disk")
    config = small_config.replace(claim_ttl_s=10.0)
    async with engine_with(config, disk) as engine:
        await engine.store(tokens(2), payloads(2))
        in_cpu = engine.hasher.hash(tokens(2))
        on_disk = await put_in(disk, engine, tokens(2, salt=1), payloads(2, salt=1))
        assert await engine.lookup_and_prefetch("memory", in_cpu, offsets(2)) == 2 * CHUNK
        with trio.move_on_after(1) as waited:
            await engine.wait_quiet()
        assert waited.cancelled_caught  # held without a task: not quiet
        assert await engine.lookup_and_prefetch("task", on_disk, offsets(2)) == 2 * CHUNK
        held_at = trio.current_time()
        with trio.move_on_after(4) as waited:
            await engine.wait_quiet()
        assert waited.cancelled_caught  # both still held
        with engine.claim("memory"):
            pass
        with trio.move_on_after(1) as waited:
            await engine.wait_quiet()
        assert waited.cancelled_caught  # "task" is still held
        await engine.wait_quiet()  # until "task" expires
        assert trio.current_time() == pytest.approx(held_at + 10.0)
        assert engine.statistics().lookups.expired == 1
        assert_conserved(engine)
