"""The disk tier: real files under ``tmp_path``, the real clock, an outer ``fail_after``.

Each test names the defect it guards against where there is one (``test_d17_…``, see
DEFECTS.md).  Buffers come from a real :class:`Arena`; every test checks that the arena gets
all its slots back, so a buffer reference the tier forgot to release fails the test.
"""

from __future__ import annotations

import errno
import os
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

if sys.version_info < (3, 11):
    from exceptiongroup import ExceptionGroup
import trio
import trio.testing

from lmprefetch.memory import Arena
from lmprefetch.tiers import chunkfile
from lmprefetch.tiers.disk import HEADER_BYTES, MAGIC, DiskTier

from .disk_tiers import (
    NUM_SLOTS,
    SLOT_BYTES,
    TIMEOUT_S,
    OsProxy,
    enqueue,
    file_of,
    filled,
    key,
    load,
    opened,
    payload,
    store,
)
from .tier_io import checked_arena


@pytest.fixture
def arena() -> Iterator[Arena]:
    with checked_arena(SLOT_BYTES, NUM_SLOTS) as a:
        yield a


# -- round trip, restart ---------------------------------------------------------------------
async def test_round_trip_exact_bytes(tmp_path: Path, arena: Arena) -> None:
    sizes = [SLOT_BYTES, 5000, 1, 0, 4096]
    with trio.fail_after(TIMEOUT_S):
        async with opened(tmp_path) as tier:
            for h, size in enumerate(sizes):
                buf = filled(arena, payload(h, size))
                try:
                    assert await tier.store(key(h), buf) is True
                finally:
                    buf.release()
            await tier.flush()
            assert len(tier) == len(sizes)
            assert tier.used_bytes == sum(HEADER_BYTES + s for s in sizes)
            assert tier.keys() == [key(h) for h in range(len(sizes))]
            got = await load(tier, arena, [key(h) for h in range(len(sizes))])
            assert got == [payload(h, s) for h, s in enumerate(sizes)]
            assert tier.stats.chunks_loaded == len(sizes)
            assert tier.stats.bytes_loaded == sum(sizes)
            assert tier.stats.chunks_stored == len(sizes)
            raw = await file_of(tmp_path, key(1)).read_bytes()
            assert raw[:8] == MAGIC
            assert len(raw) == HEADER_BYTES + 5000
            assert raw[HEADER_BYTES:] == payload(1, 5000)
            assert key(1).to_string().encode() in raw[:HEADER_BYTES]


async def test_survives_restart(tmp_path: Path, arena: Arena) -> None:
    with trio.fail_after(TIMEOUT_S):
        async with opened(tmp_path) as tier:
            await store(tier, arena, range(3))
        async with opened(tmp_path) as tier:
            assert len(tier) == 3
            assert tier.contains_now(key(1))
            assert tier.used_bytes == 3 * (HEADER_BYTES + SLOT_BYTES)
            assert await tier.contains_prefix([key(0), key(1), key(2), key(3)], pin=False) == 3
            got = await load(tier, arena, [key(0), key(1), key(2)])
            assert got == [payload(h) for h in range(3)]


async def test_reopen_with_smaller_capacity_evicts_to_fit(tmp_path: Path, arena: Arena) -> None:
    file_bytes = HEADER_BYTES + SLOT_BYTES
    with trio.fail_after(TIMEOUT_S):
        async with opened(tmp_path) as tier:
            await store(tier, arena, range(4))
        async with opened(tmp_path, capacity_bytes=2 * file_bytes) as tier:
            assert len(tier) == 2
            assert tier.used_bytes == 2 * file_bytes
            assert tier.stats.evictions == 2
        assert len(os.listdir(tmp_path)) == 2


# -- probe and pins --------------------------------------------------------------------------
async def test_contains_prefix_counts_a_prefix_and_pins(tmp_path: Path, arena: Arena) -> None:
    with trio.fail_after(TIMEOUT_S):
        async with opened(tmp_path) as tier:
            await store(tier, arena, [0, 1, 3])
            keys = [key(0), key(1), key(2), key(3)]
            with trio.testing.assert_checkpoints():
                assert await tier.contains_prefix(keys, pin=True) == 2
            assert tier.pinned_count() == 2
            assert tier.is_pinned(key(0))
            assert tier.is_pinned(key(1))
            assert not tier.is_pinned(key(3))
            assert await tier.contains_prefix(keys[2:], pin=True) == 0
            assert await tier.contains_prefix(keys, pin=False) == 2
            assert tier.pinned_count() == 2
            assert tier.stats.probes == 3
            assert tier.stats.hits == 2
            tier.unpin(keys[:2])
            assert tier.pinned_count() == 0
            with pytest.raises(RuntimeError, match="unpin of unpinned"):
                tier.unpin([key(0)])


async def test_cancelled_probe_leaves_no_pin(tmp_path: Path, arena: Arena) -> None:
    with trio.fail_after(TIMEOUT_S):
        async with opened(tmp_path) as tier:
            await store(tier, arena, [0, 1])
            with trio.CancelScope() as scope:
                scope.cancel()
                await tier.contains_prefix([key(0), key(1)], pin=True)
            assert scope.cancelled_caught
            assert tier.pinned_count() == 0


# -- misses, holes and corruption (D13, D17) -------------------------------------------------
async def test_d17_file_deleted_between_probe_and_load_truncates(
    tmp_path: Path, arena: Arena
) -> None:
    keys = [key(h) for h in range(5)]
    with trio.fail_after(TIMEOUT_S):
        async with opened(tmp_path) as tier:
            await store(tier, arena, range(5))
            assert await tier.contains_prefix(keys, pin=True) == 5
            await file_of(tmp_path, key(2)).unlink()
            got = await load(tier, arena, keys)
            assert got == [payload(0), payload(1)]  # a hole ends the prefix (D13)
            assert not tier.contains_now(key(2))
            assert tier.contains_now(key(3))
            assert tier.contains_now(key(4))
            assert tier.used_bytes == 4 * (HEADER_BYTES + SLOT_BYTES)
            assert tier.stats.chunks_loaded == 2
            tier.unpin(keys)
            assert tier.pinned_count() == 0


async def test_d17_corrupt_payload_byte_is_a_miss_and_the_file_goes(
    tmp_path: Path, arena: Arena
) -> None:
    keys = [key(h) for h in range(4)]
    with trio.fail_after(TIMEOUT_S):
        async with opened(tmp_path) as tier:
            await store(tier, arena, range(4))
            path = file_of(tmp_path, key(1))
            raw = bytearray(await path.read_bytes())
            raw[HEADER_BYTES + 1234] ^= 0x40
            await path.write_bytes(bytes(raw))
            got = await load(tier, arena, keys)
            assert got == [payload(0)]
            assert not tier.contains_now(key(1))
            assert not await path.exists()
            assert tier.stats.errors == 1
            assert tier.corrupt_files_removed == 1
            # The key can be stored again, and then it loads.
            await store(tier, arena, [1])
            assert await load(tier, arena, keys) == [payload(h) for h in range(4)]


@pytest.mark.parametrize(
    "damage",
    ["magic", "version", "length_field", "truncated_payload", "shorter_than_header"],
)
async def test_d17_corrupt_header_or_short_file_is_a_miss(
    tmp_path: Path, arena: Arena, damage: str
) -> None:
    with trio.fail_after(TIMEOUT_S):
        async with opened(tmp_path) as tier:
            await store(tier, arena, [0, 1])
            path = file_of(tmp_path, key(0))
            raw = bytearray(await path.read_bytes())
            if damage == "magic":
                raw[0:8] = b"NOTMAGIC"
            elif damage == "version":
                raw[8] = 99
            elif damage == "length_field":
                raw[16] ^= 0x01
            elif damage == "truncated_payload":
                raw = raw[: HEADER_BYTES + 100]
            else:
                raw = raw[:100]
            await path.write_bytes(bytes(raw))
            assert await load(tier, arena, [key(0), key(1)]) == []
            assert not tier.contains_now(key(0))
            assert not await path.exists()
            assert await load(tier, arena, [key(1)]) == [payload(1)]


async def test_d17_file_holding_another_key_is_a_miss(tmp_path: Path, arena: Arena) -> None:
    with trio.fail_after(TIMEOUT_S):
        async with opened(tmp_path) as tier:
            await store(tier, arena, [0])
        # A file copied by hand under another key's name (same size, valid checksum).
        await file_of(tmp_path, key(7)).write_bytes(await file_of(tmp_path, key(0)).read_bytes())
        async with opened(tmp_path) as tier:
            assert tier.contains_now(key(7))
            assert await load(tier, arena, [key(7)]) == []
            assert not tier.contains_now(key(7))
            assert not await file_of(tmp_path, key(7)).exists()
            assert await load(tier, arena, [key(0)]) == [payload(0)]


async def test_payload_larger_than_the_buffer_is_a_miss_but_kept(tmp_path: Path) -> None:
    big, small = Arena(SLOT_BYTES, 2), Arena(4096, 2)
    with trio.fail_after(TIMEOUT_S):
        async with opened(tmp_path) as tier:
            await store(tier, big, [0], size=10_000)
            assert await load(tier, small, [key(0)]) == []
            assert tier.contains_now(key(0))
            assert await file_of(tmp_path, key(0)).exists()
            assert tier.stats.errors == 1
            assert await load(tier, big, [key(0)]) == [payload(0, 10_000)]
    for a in (big, small):
        assert a.free_slots == a.num_slots
        a.close()


async def test_foreign_files_ignored_and_stale_temp_files_removed(tmp_path: Path) -> None:
    root = trio.Path(tmp_path)
    await (root / "notes.txt").write_text("not a chunk")
    await (root / "garbage.kv").write_bytes(b"x" * 5000)
    await (root / "m@1@0@ab@bfloat16.kv").write_bytes(b"x")  # not the canonical spelling
    await (root / (key(5).to_string() + ".kv")).mkdir()
    await (root / (key(6).to_string() + ".kv.tmp")).write_bytes(b"half a write")
    with trio.fail_after(TIMEOUT_S):
        async with opened(tmp_path) as tier:
            assert len(tier) == 0
            assert tier.used_bytes == 0
            assert tier.foreign_files == 4
            assert tier.stale_temp_files_removed == 1
    assert sorted(os.listdir(tmp_path)) == sorted(
        ["notes.txt", "garbage.kv", "m@1@0@ab@bfloat16.kv", key(5).to_string() + ".kv"]
    )


def _no_new_files(err: int) -> Callable[..., int]:
    """``os.open`` that refuses to create files with ``err``, as a full (or read-only) file
    system does; opening existing files for reading works."""
    real_open = os.open

    def open_(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if flags & os.O_CREAT:
            raise OSError(err, os.strerror(err), path)
        return real_open(path, flags, *args, **kwargs)

    return open_


async def test_opens_on_a_full_file_system_and_serves_what_it_holds(
    tmp_path: Path, arena: Arena, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker restarted while its disk is full (no free inode: not even the start-up probe
    file can be created) starts, serves the chunks on disk, and drops and counts new writes.
    The chaos session restarts a worker on a filled tmpfs; this is that case without a mount."""
    with trio.fail_after(TIMEOUT_S):
        async with opened(tmp_path) as tier:
            await store(tier, arena, range(3))
        with monkeypatch.context() as m:
            m.setattr(os, "open", _no_new_files(errno.ENOSPC))
            async with opened(tmp_path) as tier:
                assert len(tier) == 3
                got = await load(tier, arena, [key(h) for h in range(3)])
                assert got == [payload(h) for h in range(3)]
                assert enqueue(tier, arena, 7)
                await tier.flush()
                assert tier.stats.writes_dropped == 1 and tier.stats.errors == 1
                assert not tier.contains_now(key(7))
        assert "is full" in caplog.text
        assert sorted(os.listdir(tmp_path)) == sorted(key(h).to_string() + ".kv" for h in range(3))
        # Any other refusal is still a disk_path that cannot be used.
        with monkeypatch.context() as m:
            m.setattr(os, "open", _no_new_files(errno.EACCES))
            with pytest.raises(ValueError, match=r"^disk_path: .* is not writable"):
                async with opened(tmp_path):
                    pass


async def test_a_file_whose_name_is_not_utf8_is_foreign_and_the_tier_opens(
    tmp_path: Path,
) -> None:
    """Found by fuzzing file names: a name that is not UTF-8 but otherwise looks like a key
    (os.scandir gives it lone surrogates) raised UnicodeEncodeError out of the directory scan,
    so no worker could open a disk_path holding it (a shared one, say)."""
    stray = trio.Path(
        os.fsdecode(os.fsencode(tmp_path) + b"/\xff@1@0@0000000000000001@bfloat16.kv")
    )
    await stray.write_bytes(b"x")
    with trio.fail_after(TIMEOUT_S):
        async with opened(tmp_path) as tier:
            assert len(tier) == 0
            assert tier.foreign_files == 1
    assert await stray.exists()  # not ours: left alone


# -- capacity and eviction (D02) -------------------------------------------------------------
async def test_d02_eviction_is_lru_unpinned_and_works_again_after_unpin(
    tmp_path: Path, arena: Arena
) -> None:
    size = 4096
    file_bytes = HEADER_BYTES + size
    with trio.fail_after(TIMEOUT_S):
        async with opened(tmp_path, capacity_bytes=4 * file_bytes) as tier:
            await store(tier, arena, [0, 1, 2, 3], size)  # LRU order: 0 1 2 3
            assert await tier.contains_prefix([key(0)], pin=True) == 1
            assert len(await load(tier, arena, [key(1)])) == 1  # LRU order: 0 2 3 1
            await store(tier, arena, [4], size)
            assert set(tier.keys()) == {key(0), key(1), key(3), key(4)}  # 2 went, 0 is pinned
            assert not await file_of(tmp_path, key(2)).exists()
            await store(tier, arena, [5], size)
            assert set(tier.keys()) == {key(0), key(1), key(4), key(5)}
            assert tier.used_bytes == 4 * file_bytes
            assert tier.stats.evictions == 2

            # Everything pinned: a write that needs room is dropped, nothing is evicted.
            everything = tier.keys()
            assert await tier.contains_prefix(everything, pin=True) == 4
            await store(tier, arena, [6], size)
            assert not tier.contains_now(key(6))
            assert set(tier.keys()) == set(everything)
            assert tier.stats.writes_dropped == 1

            # Pins back to 0 (D02), and eviction works again.
            tier.unpin([key(0)])
            tier.unpin(everything)
            assert tier.pinned_count() == 0
            await store(tier, arena, [6], size)
            assert tier.contains_now(key(6))
            assert not tier.contains_now(key(0))  # the least recently used
            assert tier.used_bytes <= 4 * file_bytes
            assert len(os.listdir(tmp_path)) == 4


async def test_a_payload_larger_than_the_capacity_is_dropped(tmp_path: Path, arena: Arena) -> None:
    with trio.fail_after(TIMEOUT_S):
        async with opened(tmp_path, capacity_bytes=HEADER_BYTES + 100) as tier:
            await store(tier, arena, [0], size=100)
            await store(tier, arena, [1], size=101)
            assert tier.keys() == [key(0)]
            assert tier.stats.writes_dropped == 1


# -- write-behind ----------------------------------------------------------------------------
async def test_full_write_queue_drops_and_counts_without_blocking(
    tmp_path: Path, arena: Arena
) -> None:
    with trio.fail_after(TIMEOUT_S):
        async with opened(tmp_path, write_queue=3) as tier:
            with trio.testing.assert_no_checkpoints():  # synchronous: it cannot block
                accepted = [enqueue(tier, arena, h) for h in range(5)]
                assert enqueue(tier, arena, 0) is True  # already queued: no second slot
            assert accepted == [True, True, True, False, False]
            assert tier.stats.writes_dropped == 2
            assert tier.queued_writes == 3
            assert arena.used_slots == 3  # the tier's references on the queued buffers
            await tier.flush()
            assert tier.keys() == [key(0), key(1), key(2)]
            assert arena.used_slots == 0
            assert tier.queued_writes == 0
            assert enqueue(tier, arena, 0) is True  # already on disk


async def test_close_flushes_everything_queued(tmp_path: Path, arena: Arena) -> None:
    with trio.fail_after(TIMEOUT_S):
        async with opened(tmp_path) as tier:
            for h in range(20):
                assert enqueue(tier, arena, h)
        assert arena.used_slots == 0
        assert not enqueue(tier, arena, 99)  # closed: dropped
        assert tier.stats.writes_dropped == 1
        async with opened(tmp_path) as tier:
            assert len(tier) == 20
            assert await load(tier, arena, [key(h) for h in range(20)]) == [
                payload(h) for h in range(20)
            ]


async def test_close_that_cannot_flush_in_time_releases_queued_buffers(
    tmp_path: Path, arena: Arena
) -> None:
    with trio.fail_after(TIMEOUT_S):
        async with opened(tmp_path, close_timeout_s=0) as tier:
            for h in range(8):
                assert enqueue(tier, arena, h)
            assert arena.used_slots == 8
        assert arena.used_slots == 0
        assert tier.stats.writes_dropped + tier.stats.chunks_stored == 8


async def test_cancelled_body_still_flushes_on_close(tmp_path: Path, arena: Arena) -> None:
    with trio.fail_after(TIMEOUT_S):
        with trio.CancelScope() as scope:
            async with opened(tmp_path) as tier:
                for h in range(4):
                    assert enqueue(tier, arena, h)
                scope.cancel()
                await trio.sleep_forever()
        assert arena.used_slots == 0
        async with opened(tmp_path) as tier:
            assert len(tier) == 4


async def test_an_opening_cancelled_as_the_writer_starts_does_not_hang(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C while ``lmprefetch bench-engine`` opened an engine hung for good: the writer
    shields itself from its first step, and trio leaves a child that starts in a cancelled
    ``nursery.start()`` where it is, so the start waited for a writer that never ends."""
    tiers: list[DiskTier] = []
    rebuild = DiskTier._rebuild_index

    async def rebuild_then_cancel(self: DiskTier) -> None:
        tiers.append(self)
        await rebuild(self)
        opening.cancel()  # no checkpoint here: the next one is the writer's start

    monkeypatch.setattr(DiskTier, "_rebuild_index", rebuild_then_cancel)
    started = trio.current_time()
    async with trio.open_nursery() as nursery:

        async def unstick() -> None:  # only where the opening hangs: so that the test ends
            await trio.sleep(TIMEOUT_S)
            for tier in tiers:
                if tier._writer_scope is not None:
                    tier._writer_scope.cancel()

        nursery.start_soon(unstick)
        with trio.CancelScope() as opening:
            async with opened(tmp_path):
                await trio.lowlevel.checkpoint()
                pytest.fail("the tier opened although its opening was cancelled")
        nursery.cancel_scope.cancel()
    assert opening.cancelled_caught
    assert trio.current_time() - started < TIMEOUT_S, "the cancelled opening hung"
    assert tiers and tiers[0]._writes.closed  # the writer ran, and ended


async def test_flush_waits_for_writes_queued_before_it(tmp_path: Path, arena: Arena) -> None:
    with trio.fail_after(TIMEOUT_S):
        async with opened(tmp_path) as tier:
            with trio.testing.assert_checkpoints():
                await tier.flush()  # nothing queued: returns, but is a checkpoint
            for h in range(6):
                enqueue(tier, arena, h)
            async with trio.open_nursery() as nursery:
                for _ in range(3):
                    nursery.start_soon(tier.flush)
            assert len(tier) == 6
            assert tier.queued_writes == 0


async def test_write_error_is_counted_and_releases_the_buffer(
    tmp_path: Path, arena: Arena, monkeypatch: pytest.MonkeyPatch
) -> None:
    def failing_write(final: str, temp: str, key_bytes: bytes, payload: memoryview) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    with trio.fail_after(TIMEOUT_S):
        async with opened(tmp_path) as tier:
            monkeypatch.setattr(chunkfile, "write_file", failing_write)
            enqueue(tier, arena, 0)
            await tier.flush()
            assert tier.stats.errors == 1
            assert len(tier) == 0
            assert arena.used_slots == 0
            monkeypatch.undo()
            await store(tier, arena, [0])
            assert tier.contains_now(key(0))
    assert os.listdir(tmp_path) == [key(0).to_string() + ".kv"]  # no temp file left


async def test_remove_deletes_files_and_queued_writes(tmp_path: Path, arena: Arena) -> None:
    with trio.fail_after(TIMEOUT_S):
        async with opened(tmp_path) as tier:
            await store(tier, arena, [0])
            assert await tier.remove(key(0)) is True
            assert not tier.contains_now(key(0))
            assert tier.used_bytes == 0
            assert not await file_of(tmp_path, key(0)).exists()
            assert await tier.remove(key(0)) is False
            enqueue(tier, arena, 1)  # queued, not yet written
            assert await tier.remove(key(1)) is True
            assert arena.used_slots == 0  # its reference went with it
            await tier.flush()
            assert len(tier) == 0
    assert os.listdir(tmp_path) == []


async def test_load_makes_chunks_most_recently_used(tmp_path: Path, arena: Arena) -> None:
    with trio.fail_after(TIMEOUT_S):
        async with opened(tmp_path) as tier:
            await store(tier, arena, [0, 1, 2])
            await load(tier, arena, [key(0)])
            assert tier.keys() == [key(1), key(2), key(0)]


# -- concurrency and cancellation (D04, D12) -------------------------------------------------
async def test_concurrent_reads_return_the_contiguous_prefix(tmp_path: Path, arena: Arena) -> None:
    keys = [key(h) for h in range(24)]
    with trio.fail_after(TIMEOUT_S):
        async with opened(tmp_path, read_threads=4) as tier:
            await store(tier, arena, range(24), size=6000)
            got = await load(tier, arena, keys)
            assert got == [payload(h, 6000) for h in range(24)]
            await file_of(tmp_path, key(13)).unlink()

            async def one_load() -> None:
                got = await load(tier, arena, keys[:16])  # two loads fill the arena
                assert got == [payload(h, 6000) for h in range(13)]

            async with trio.open_nursery() as nursery:  # concurrent loads share the threads
                nursery.start_soon(one_load)
                nursery.start_soon(one_load)


async def test_d13_chunks_read_past_a_miss_by_other_threads_are_not_counted(
    tmp_path: Path, arena: Arena, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Several threads read one load's chunks in order; the thread that meets the missing
    chunk 5 is held until another thread has read a chunk after it.  That chunk was read,
    but it lies past the hole: the count stops at 5.  (Reads that may wait for the device
    run in several threads; the page-cache pass, one thread in order, is turned off so that
    every chunk takes that path.)"""
    keys = [key(h) for h in range(20)]
    with trio.fail_after(TIMEOUT_S):
        async with opened(tmp_path, read_threads=3) as tier:
            tier.cached_pass = False
            await store(tier, arena, range(20), size=100)
            paths = {str(file_of(tmp_path, k)): i for i, k in enumerate(keys)}
            await file_of(tmp_path, keys[5]).unlink()
            read_past_the_hole = threading.Event()
            real_read = tier._read_chunk

            def read(path: str, key_bytes: bytes, slot: memoryview, *check: Any) -> Any:
                if paths[path] == 5:
                    assert read_past_the_hole.wait(TIMEOUT_S)
                result = real_read(path, key_bytes, slot, *check)
                if paths[path] > 5:
                    read_past_the_hole.set()
                return result

            monkeypatch.setattr(tier, "_read_chunk", read)
            bufs = arena.allocate_many(len(keys))
            try:
                assert await tier.load(keys, bufs) == 5
                assert [bytes(b.view()) for b in bufs[:5]] == [payload(h, 100) for h in range(5)]
            finally:
                for b in bufs:
                    b.release()
            assert read_past_the_hole.is_set()
            assert tier.stats.chunks_loaded == 5
            assert tier.stats.bytes_loaded == 500


@pytest.mark.parametrize("read_threads", [1, 3])
async def test_d04_cancelled_load_starts_no_more_reads_and_counts_nothing(
    tmp_path: Path, arena: Arena, monkeypatch: pytest.MonkeyPatch, read_threads: int
) -> None:
    keys = [key(h) for h in range(12)]
    with trio.fail_after(TIMEOUT_S):
        async with opened(tmp_path, read_threads=read_threads) as tier:
            await store(tier, arena, range(12))
            real_read = tier._read_chunk
            started: list[str] = []
            finished: list[str] = []
            lock = threading.Lock()
            cancel_delivered = threading.Event()

            def cancel_load() -> None:  # runs on the Trio thread
                scope.cancel()
                cancel_delivered.set()

            def read_then_cancel(path: str, key_bytes: bytes, slot: memoryview, *check: Any) -> Any:
                with lock:
                    first = not started
                    started.append(path)
                if not first:  # the other reads in flight finish only after the cancel
                    cancel_delivered.wait(TIMEOUT_S)
                try:
                    result = real_read(path, key_bytes, slot, *check)
                finally:  # (a read cut short between its pieces by the cancel ends too)
                    finished.append(path)
                if first:  # the first chunk is in: cancel the load
                    trio.from_thread.run_sync(cancel_load)
                return result

            monkeypatch.setattr(tier, "_read_chunk", read_then_cancel)
            bufs = arena.allocate_many(len(keys))
            raised: BaseException | None = None
            try:
                with trio.CancelScope() as scope:
                    try:
                        await tier.load(keys, bufs)
                    except BaseException as exc:
                        raised = exc
                        raise
            finally:
                for b in bufs:
                    b.release()
            assert scope.cancelled_caught
            assert isinstance(raised, trio.Cancelled)  # a plain Cancelled, not a group
            # Only the reads already running when the cancel came ran (one per read thread, at
            # most); none started after it; load waited for every one it started.
            assert 1 <= len(started) <= read_threads
            assert set(started) <= {str(file_of(tmp_path, k)) for k in keys[:read_threads]}
            assert sorted(finished) == sorted(started)
            assert tier.stats.chunks_loaded == 0
            assert tier.stats.bytes_loaded == 0
            assert len(tier) == 12  # a cancel is not a miss: nothing left the index
            monkeypatch.undo()
            assert len(await load(tier, arena, keys)) == 12


async def test_a_bug_in_a_read_propagates_and_stops_the_load(
    tmp_path: Path, arena: Arena, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys = [key(h) for h in range(10)]
    with trio.fail_after(TIMEOUT_S):
        async with opened(tmp_path, read_threads=1) as tier:
            await store(tier, arena, range(10), size=100)
            reads: list[str] = []

            def broken_read(path: str, key_bytes: bytes, slot: memoryview, *_: Any) -> Any:
                reads.append(path)
                raise ValueError("a bug")

            monkeypatch.setattr(tier, "_read_chunk", broken_read)
            bufs = arena.allocate_many(len(keys))
            try:
                # One reader thread raises the bug as it is; several raise it in a group.
                with pytest.raises((ValueError, ExceptionGroup)) as info:
                    await tier.load(keys, bufs)
                if isinstance(info.value, ExceptionGroup):
                    assert info.value.subgroup(ValueError) is not None
            finally:
                for b in bufs:
                    b.release()
            assert len(reads) == 1  # the load stopped at the bug
            assert tier.stats.chunks_loaded == 0
            assert len(tier) == 10


async def test_d12_buffer_length_set_only_for_verified_chunks(tmp_path: Path, arena: Arena) -> None:
    with trio.fail_after(TIMEOUT_S):
        async with opened(tmp_path, read_threads=1) as tier:
            await store(tier, arena, [0, 1], size=3000)
            path = file_of(tmp_path, key(1))
            raw = bytearray(await path.read_bytes())
            raw[-1] ^= 0xFF
            await path.write_bytes(bytes(raw))
            bufs = arena.allocate_many(2)
            try:
                assert await tier.load([key(0), key(1)], bufs) == 1
                assert bufs[0].length == 3000
                assert bufs[1].length == 0
            finally:
                for b in bufs:
                    b.release()


async def test_load_with_fewer_buffers_than_keys(tmp_path: Path, arena: Arena) -> None:
    with trio.fail_after(TIMEOUT_S):
        async with opened(tmp_path) as tier:
            await store(tier, arena, range(3))
            bufs = arena.allocate_many(2)
            try:
                assert await tier.load([key(0), key(1), key(2)], bufs) == 2
                assert await tier.load([], []) == 0
            finally:
                for b in bufs:
                    b.release()


# -- O_DIRECT --------------------------------------------------------------------------------
async def test_o_direct_reads_correct_data_or_falls_back(tmp_path: Path, arena: Arena) -> None:
    sizes = [SLOT_BYTES, 5000, 4096, 1]
    with trio.fail_after(TIMEOUT_S):
        async with opened(tmp_path, o_direct=True) as tier:
            for h, size in enumerate(sizes):
                enqueue(tier, arena, h, payload(h, size))
            await tier.flush()
            got = await load(tier, arena, [key(h) for h in range(len(sizes))])
            assert got == [payload(h, s) for h, s in enumerate(sizes)]
            if tier.o_direct_active:  # the file system takes O_DIRECT (ext4, xfs)
                assert tier.o_direct_reads == len(sizes)
            else:  # it refused (tmpfs): every read went buffered
                assert tier.o_direct_reads == 0


async def test_o_direct_refused_falls_back_to_buffered_reads(
    tmp_path: Path, arena: Arena, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_open = os.open

    def refusing_open(path: str, flags: int, *args: int) -> int:
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    with trio.fail_after(TIMEOUT_S):
        async with opened(tmp_path, o_direct=True) as tier:
            await store(tier, arena, range(3), size=7000)
            monkeypatch.setattr(chunkfile, "os", OsProxy({"open": refusing_open}))
            got = await load(tier, arena, [key(h) for h in range(3)])
            assert got == [payload(h, 7000) for h in range(3)]
            assert tier.o_direct_reads == 0
            assert not tier.o_direct_active


def _o_direct_opens(directory: Path) -> bool:
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return False
    probe = directory / "probe"
    probe.write_bytes(b"x")
    try:
        fd = os.open(probe, os.O_RDONLY | flag)
    except OSError:
        return False
    else:
        os.close(fd)
        return True
    finally:
        probe.unlink()


async def test_o_direct_read_refused_falls_back_to_buffered_reads(
    tmp_path: Path, arena: Arena, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The file system opens with O_DIRECT but refuses the read (alignment it does not take).
    if not await trio.to_thread.run_sync(_o_direct_opens, tmp_path):
        pytest.skip("this file system refuses O_DIRECT opens (covered by the test above)")
    direct_fds: set[int] = set()

    def open_tracking(path: str, flags: int, *args: int) -> int:
        fd = os.open(path, flags, *args)
        if flags & getattr(os, "O_DIRECT", 0):
            direct_fds.add(fd)
        return fd

    def close_tracking(fd: int) -> None:
        direct_fds.discard(fd)
        os.close(fd)

    refused: list[int] = []

    def preadv_refusing(fd: int, views: Sequence[Any], offset: int, *flags: int) -> int:
        if fd in direct_fds:
            refused.append(fd)
            raise OSError(errno.EINVAL, "Invalid argument")
        return os.preadv(fd, views, offset, *flags)

    with trio.fail_after(TIMEOUT_S):
        async with opened(tmp_path, o_direct=True) as tier:
            await store(tier, arena, range(3), size=7000)
            monkeypatch.setattr(
                chunkfile,
                "os",
                OsProxy(
                    {"open": open_tracking, "close": close_tracking, "preadv": preadv_refusing}
                ),
            )
            got = await load(tier, arena, [key(h) for h in range(3)])
            assert got == [payload(h, 7000) for h in range(3)]
            assert tier.o_direct_reads == 0
            assert not tier.o_direct_active
            assert tier.stats.errors == 0
            assert len(refused) >= 1


async def test_o_direct_needs_page_aligned_slots(tmp_path: Path) -> None:
    odd = Arena(SLOT_BYTES + 512, 4)  # slots not page-aligned: buffered reads
    with trio.fail_after(TIMEOUT_S):
        async with opened(tmp_path, o_direct=True) as tier:
            await store(tier, odd, range(2), size=SLOT_BYTES)
            assert await load(tier, odd, [key(0), key(1)]) == [payload(0), payload(1)]
            assert tier.o_direct_reads == 0
    assert odd.free_slots == odd.num_slots
    odd.close()


# -- the Trio thread never does file I/O -----------------------------------------------------
async def test_file_operations_never_run_on_the_trio_thread(
    tmp_path: Path, arena: Arena, monkeypatch: pytest.MonkeyPatch
) -> None:
    spy = OsProxy()
    monkeypatch.setattr(chunkfile, "os", spy)
    trio_thread = threading.get_ident()
    file_bytes = HEADER_BYTES + 4096
    with trio.fail_after(TIMEOUT_S):
        async with opened(tmp_path / "tier", capacity_bytes=3 * file_bytes, o_direct=True) as tier:
            await store(tier, arena, range(4), size=4096)  # evicts one
            keys = tier.keys()
            assert len(await load(tier, arena, keys)) == 3
            path = file_of(tmp_path / "tier", keys[1])
            await path.write_bytes(b"corrupt")
            assert len(await load(tier, arena, keys)) == 1  # a corrupt file is unlinked
            await tier.remove(keys[0])
        async with opened(tmp_path / "tier") as tier:
            assert len(tier) == 1
    used = {name for name, _ in spy.calls}
    assert {
        "makedirs",
        "scandir",
        "open",
        "preadv",
        "fstat",
        "writev",
        "replace",
        "unlink",
        "close",
    } <= used
    on_trio_thread = [name for name, thread in spy.calls if thread == trio_thread]
    assert on_trio_thread == []


# -- reads in pieces -------------------------------------------------------------------------
@pytest.mark.parametrize("o_direct", [False, True])
async def test_chunks_are_read_and_verified_piece_by_piece(
    tmp_path: Path, arena: Arena, monkeypatch: pytest.MonkeyPatch, o_direct: bool
) -> None:
    """A chunk larger than a piece is read in several reads, each piece hashed as it lands;
    the bytes are exact for every size around the piece boundaries, and damage in the last
    piece is still caught."""
    monkeypatch.setattr(chunkfile, "PIECE_BYTES", 4096)
    reads: list[int] = []
    real_read_into = chunkfile._read_into

    def counting(fd: int, views: Any, expected: int, offset: int = 0, flags: int = 0) -> int:
        reads.append(expected)
        return real_read_into(fd, views, expected, offset, flags)

    monkeypatch.setattr(chunkfile, "_read_into", counting)
    sizes = [SLOT_BYTES, 12289, 8192, 5000, 4096, 4095, 1, 0]
    keys = [key(h) for h in range(len(sizes))]
    with trio.fail_after(TIMEOUT_S):
        async with opened(tmp_path, o_direct=o_direct) as tier:
            for h, size in enumerate(sizes):
                enqueue(tier, arena, h, payload(h, size))
            await tier.flush()
            assert await load(tier, arena, keys) == [payload(h, s) for h, s in enumerate(sizes)]
            # At least one read per piece (a SLOT_BYTES chunk is 4 pieces).
            assert len(reads) >= sum(max(1, -(-s // 4096)) for s in sizes)
            path = file_of(tmp_path, key(0))
            raw = bytearray(await path.read_bytes())
            raw[-1] ^= 0x01  # the last byte of the last piece
            await path.write_bytes(bytes(raw))
            assert await load(tier, arena, keys) == []
            assert not await path.exists() and tier.corrupt_files_removed == 1


@pytest.mark.parametrize("read_threads", [1, 3])
async def test_a_cancel_stops_a_chunk_read_between_its_pieces(
    tmp_path: Path, arena: Arena, monkeypatch: pytest.MonkeyPatch, read_threads: int
) -> None:
    """The unit of work a cancel waits for is one piece, not one chunk: a read that is
    under way when the load is cancelled stops after the piece it is reading (the threads
    write into the load's buffers, so they are waited for, but not for a whole chunk)."""
    monkeypatch.setattr(chunkfile, "PIECE_BYTES", 4096)  # a SLOT_BYTES chunk: 4 pieces
    keys = [key(h) for h in range(12)]
    with trio.fail_after(TIMEOUT_S):
        async with opened(tmp_path, read_threads=read_threads) as tier:
            await store(tier, arena, range(12))
            real_read_into = chunkfile._read_into
            pieces: list[int] = []
            lock = threading.Lock()
            cancel_delivered = threading.Event()

            def cancel_load() -> None:  # runs on the Trio thread
                scope.cancel()
                cancel_delivered.set()

            def read_piece(
                fd: int, views: Any, expected: int, offset: int = 0, flags: int = 0
            ) -> int:
                with lock:
                    first = not pieces
                    pieces.append(offset)
                if not first:  # other threads' pieces wait for the cancel
                    cancel_delivered.wait(TIMEOUT_S)
                got = real_read_into(fd, views, expected, offset, flags)
                if first:  # the first piece is in: cancel the load
                    trio.from_thread.run_sync(cancel_load)
                return got

            monkeypatch.setattr(chunkfile, "_read_into", read_piece)
            bufs = arena.allocate_many(len(keys))
            try:
                with trio.CancelScope() as scope:
                    await tier.load(keys, bufs)
            finally:
                for b in bufs:
                    b.release()
            assert scope.cancelled_caught
            # Each read under way finished its current piece and stopped: one piece per
            # thread at most, where finishing the chunk would have taken four.
            assert 1 <= len(pieces) <= read_threads
            assert pieces == [0] * len(pieces)  # first pieces only
            assert tier.stats.chunks_loaded == 0 and len(tier) == 12
            monkeypatch.undo()
            assert len(await load(tier, arena, keys)) == 12
