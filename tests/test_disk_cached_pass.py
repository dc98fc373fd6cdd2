"""The disk tier's page-cache pass: a load's cached chunks are read by one thread call, in
order, with ``RWF_NOWAIT``; what the page cache does not hold goes to the readers that may
wait for the device, and is read whole and verified all the same."""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from lmprefetch._phases import Phases
from lmprefetch.memory import Arena
from lmprefetch.tiers import chunkfile
from lmprefetch.tiers.diskread import _LoadRun

from .disk_tiers import NUM_SLOTS, SLOT_BYTES, TIMEOUT_S, OsProxy, key, load, opened, payload, store
from .tier_io import checked_arena

pytestmark = pytest.mark.skipif(not chunkfile.NOWAIT_FLAG, reason="no RWF_NOWAIT here")


@pytest.fixture
def arena() -> Iterator[Arena]:
    with checked_arena(SLOT_BYTES, NUM_SLOTS) as a:
        yield a


@pytest.mark.parametrize("threads", [1, 2, 3])
async def test_page_cache_hits_take_one_thread_call_per_pass_thread(
    tmp_path: Path, arena: Arena, threads: int
) -> None:
    """A load the page cache holds takes one thread call per thread of its page-cache pass
    (by default one per CPU but the Trio thread's, at most ``read_threads``), which share the
    chunks: each is read once."""
    keys = [key(h) for h in range(20)]  # enough for three readers without the pass
    with trio.fail_after(TIMEOUT_S):
        async with opened(tmp_path, read_threads=3) as tier:
            assert tier._pass_threads == max(1, min(3, len(os.sched_getaffinity(0)) - 1))
            tier._pass_threads = threads
            await store(tier, arena, range(20))
            tier.phases = phases = Phases()
            assert await load(tier, arena, keys) == [payload(h) for h in range(20)]
            calls = [p for p, _, _ in phases.intervals if p == "thread"]
            assert len(calls) == threads
            # Two hand-offs per call: to the thread, and back to the task.
            assert sum(p == "handoff" for p, _, _ in phases.intervals) == 2 * threads
            assert tier.verified_reads + tier.trusted_reads == 20


def _preadv_not_cached(not_cached: set[int], partial: bool, seen: list[int]) -> Any:
    """``os.preadv`` as the page cache would answer for the files open as ``not_cached``: with
    ``RWF_NOWAIT``, ``EAGAIN`` (after part of the bytes, with ``partial``)."""

    def preadv(fd: int, views: Any, offset: int, *flags: int) -> int:
        if fd in not_cached and flags and flags[0] & chunkfile.NOWAIT_FLAG:
            seen.append(fd)
            if partial and offset == 0:
                return os.preadv(fd, [memoryview(views[0])[:100]], offset)  # a short read
            raise BlockingIOError(errno.EAGAIN, "Resource temporarily unavailable")
        return os.preadv(fd, views, offset, *flags)

    return preadv


@pytest.mark.parametrize("passes", [1, 2])
@pytest.mark.parametrize("partial", [False, True])
async def test_chunks_not_in_the_page_cache_are_read_by_the_waiting_readers(
    tmp_path: Path, arena: Arena, monkeypatch: pytest.MonkeyPatch, partial: bool, passes: int
) -> None:
    """Chunks 0-2 are cached; chunk 3's file is not (EAGAIN at once, or after a short read):
    the pass thread that meets it puts it back and stops (another pass thread may read on),
    and what is left is read without RWF_NOWAIT, whole; every chunk once."""
    keys = [key(h) for h in range(20)]
    with trio.fail_after(TIMEOUT_S):
        async with opened(tmp_path, read_threads=3) as tier:
            await store(tier, arena, range(20))
            uncached_path = str(tmp_path / f"{keys[3].to_string()}.kv")
            not_cached: set[int] = set()
            seen: list[int] = []

            def open_tracking(path: str, flags: int, *args: Any) -> int:
                fd = os.open(path, flags, *args)
                if path == uncached_path:
                    not_cached.add(fd)
                return fd

            proxy = OsProxy(
                {"open": open_tracking, "preadv": _preadv_not_cached(not_cached, partial, seen)}
            )
            monkeypatch.setattr(chunkfile, "os", proxy)
            tier._pass_threads = passes
            tier.phases = phases = Phases()
            assert await load(tier, arena, keys) == [payload(h) for h in range(20)]
            assert seen  # the pass met the uncached file ...
            assert tier.cached_pass  # ... which is no reason to stop trying it
            # One call for the pass, then the waiting readers (two, for 17 chunks).
            assert sum(p == "thread" for p, _, _ in phases.intervals) >= 2
            assert tier.verified_reads + tier.trusted_reads == 20
            assert tier.corrupt_files_removed == 0


async def test_a_file_system_that_refuses_rwf_nowait_turns_the_pass_off(
    tmp_path: Path, arena: Arena, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys = [key(h) for h in range(10)]

    def preadv(fd: int, views: Any, offset: int, *flags: int) -> int:
        if flags and flags[0]:
            raise OSError(errno.EOPNOTSUPP, "Operation not supported")
        return os.preadv(fd, views, offset)

    with trio.fail_after(TIMEOUT_S):
        async with opened(tmp_path) as tier:
            await store(tier, arena, range(10))
            monkeypatch.setattr(chunkfile, "os", OsProxy({"preadv": preadv}))
            assert await load(tier, arena, keys) == [payload(h) for h in range(10)]
            assert not tier.cached_pass
            assert await load(tier, arena, keys) == [payload(h) for h in range(10)]
            assert tier.stats.errors == 0


def test_a_chunk_put_back_is_taken_again_and_no_other() -> None:
    """Two pass threads took chunks 0-3 and the one that took chunk 2 put it back (the page
    cache lacked it): the reads after the pass take 2, then 4 on; 3 (read by the other pass
    thread) is not taken twice.  A failed chunk ends what is taken, put back or not."""
    run = _LoadRun([None] * 8)  # type: ignore[list-item]
    assert [run.take() for _ in range(4)] == [0, 1, 2, 3]
    run.put_back(2)
    assert run.remaining() == 5
    assert [run.take(), run.take()] == [2, 4]
    run.put_back(4)
    run.fail(4, chunkfile.FileMissing("gone"))
    assert run.remaining() == 0
    assert run.take() is None
