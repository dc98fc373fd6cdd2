"""Arena and Buffer: owner counting, allocation failure as a value, thread-safe release."""

from __future__ import annotations

import mmap
import os
import sys
import threading

import pytest

from lmprefetch.memory import Arena, DoubleReleaseError

from .helpers import resident_bytes


def test_allocate_write_view_release() -> None:
    arena = Arena(16, 2)
    a = arena.allocate()
    assert a is not None
    a.write(b"hello")
    assert bytes(a.view()) == b"hello"
    assert arena.used_bytes == 16
    a.release()
    assert arena.used_bytes == 0


def test_allocation_failure_is_none_never_waits() -> None:
    arena = Arena(8, 2)
    bufs = arena.allocate_many(5)
    assert len(bufs) == 2
    assert arena.allocate() is None
    for b in bufs:
        b.release()
    assert arena.free_slots == 2


def test_owner_counting_and_double_release_is_loud() -> None:
    arena = Arena(8, 1)
    b = arena.allocate()
    assert b is not None
    b.retain()
    b.release()
    assert arena.free_slots == 0
    b.release()
    assert arena.free_slots == 1
    with pytest.raises(DoubleReleaseError, match=r"^buffer 0 released more times than owned$"):
        b.release()
    with pytest.raises(DoubleReleaseError, match=r"^buffer 0 used after its last release$"):
        b.view()


def test_a_released_buffer_cannot_be_written_nor_read_as_a_tensor() -> None:
    """``write`` and ``tensor`` check that the buffer is live, as ``view`` and ``slot`` do: a
    write through a stale handle would land in a slot someone else may own by now."""
    arena = Arena(8, 1)
    b = arena.allocate()
    assert b is not None
    b.write(b"abc")
    b.release()
    again = arena.allocate()  # the same slot, another owner's now
    assert again is b
    b.release()  # that owner is done too: the handle is stale
    with pytest.raises(DoubleReleaseError, match=r"^buffer 0 used after its last release$"):
        b.write(b"xyz")
    with pytest.raises(DoubleReleaseError, match=r"^buffer 0 used after its last release$"):
        b.tensor()  # the liveness check comes before the backend's
    with pytest.raises(DoubleReleaseError, match=r"^buffer 0 used after its last release$"):
        b.slot()
    assert arena.free_slots == 1
    fresh = arena.allocate()
    assert fresh is not None and bytes(fresh.view()) == b""  # nothing was written
    fresh.release()


def test_a_released_buffer_cannot_be_retained_back_to_life() -> None:
    arena = Arena(8, 1)
    b = arena.allocate()
    assert b is not None
    b.release()
    with pytest.raises(DoubleReleaseError, match=r"^retain of released buffer 0$"):
        b.retain()
    with pytest.raises(DoubleReleaseError, match=r"^retain of released buffer 0$"):
        arena.retain_all([b])
    assert b.owners == 0
    assert arena.free_slots == 1
    again = arena.allocate()  # the slot is free for exactly one new owner
    assert again is b and again.owners == 1
    again.release()


def test_payload_too_large() -> None:
    arena = Arena(4, 1)
    b = arena.allocate()
    assert b is not None
    with pytest.raises(ValueError, match="does not fit"):
        b.write(b"12345")
    b.release()


def test_slots_are_page_aligned_for_o_direct() -> None:
    import ctypes

    arena = Arena(4096, 3)
    bufs = arena.allocate_many(3)
    for b in bufs:
        addr = ctypes.addressof(ctypes.c_char.from_buffer(b.slot()))
        assert addr % 4096 == 0
    for b in bufs:
        b.release()


def test_release_from_many_threads() -> None:
    arena = Arena(8, 64)
    bufs = arena.allocate_many(64)
    for b in bufs:
        for _ in range(9):
            b.retain()
    threads = [threading.Thread(target=lambda: [b.release() for b in bufs]) for _ in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert arena.free_slots == 64


@pytest.mark.skipif(sys.platform != "linux", reason="mincore on an anonymous mapping: Linux")
def test_prefault_maps_the_first_slots_into_memory_now() -> None:
    slot = 64 * 1024
    arena = Arena(slot, 32)
    try:
        assert resident_bytes(arena) == 0  # anonymous memory: nothing mapped until used
        # Whole slots, from the first: the ones allocate() hands out first.
        assert arena.prefault(10 * slot + 1) == 11 * slot
        assert resident_bytes(arena) == 11 * slot
        first = arena.allocate()
        assert first is not None and first.index == 0
        first.release()
        assert arena.prefault(1 << 40) == arena.total_bytes  # capped at the arena
        assert resident_bytes(arena) == arena.total_bytes
        assert arena.prefault(0) == 0
    finally:
        arena.close()


def _kernel_at_least(major: int, minor: int) -> bool:
    release = os.uname().release.split("-")[0].split(".")
    return (int(release[0]), int(release[1])) >= (major, minor)


@pytest.mark.skipif(
    sys.platform != "linux" or not _kernel_at_least(5, 14),
    reason="MADV_POPULATE_WRITE needs Linux 5.14",
)
def test_prefault_asks_the_kernel_and_writes_nothing_where_it_can(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where the kernel populates pages (madvise), pre-faulting writes no byte: the slow
    fallback (zeroing every page from Python's thread) is only for older kernels."""
    import lmprefetch.memory as memory

    assert memory._madvise is not None

    def no_writes(*args: object) -> None:
        raise AssertionError("pre-faulting wrote the pages instead of asking the kernel")

    monkeypatch.setattr(memory.ctypes, "memset", no_writes)
    slot = 64 * 1024
    arena = Arena(slot, 8)
    try:
        assert arena.prefault(arena.total_bytes) == arena.total_bytes
        assert resident_bytes(arena) == arena.total_bytes
    finally:
        arena.close()


def test_retain_all_and_release_all_count_like_one_call_per_buffer() -> None:
    arena = Arena(16, 4)
    a, b, c = arena.allocate_many(3)
    arena.retain_all([a, b])
    assert (a.owners, b.owners, c.owners) == (2, 2, 1)
    arena.release_all([a, b, c])
    assert (a.owners, b.owners, c.owners) == (1, 1, 0)
    assert arena.free_slots == 2  # c went back, a and b still have an owner
    # A double release is loud at the buffer it happens to, the ones before it released.
    with pytest.raises(DoubleReleaseError):
        arena.release_all([a, c, b])
    assert (a.owners, b.owners) == (0, 1)
    with pytest.raises(DoubleReleaseError):
        arena.retain_all([c])
    other = Arena(16, 1)
    (d,) = other.allocate_many(1)
    with pytest.raises(ValueError, match="another arena"):
        arena.release_all([d])
    with pytest.raises(ValueError, match="another arena"):
        arena.retain_all([d])
    assert d.owners == 1
    b.release()
    d.release()
    assert arena.free_slots == 4 and other.free_slots == 1


def test_a_plain_arena_has_no_tensor_and_says_which_backend_does() -> None:
    arena = Arena(8, 1)
    buf = arena.allocate()
    assert buf is not None
    with pytest.raises(RuntimeError, match=r"^Buffer\.tensor\(\) needs buffer_backend='torch'$"):
        buf.tensor()
    buf.release()


@pytest.mark.parametrize("how", ["release", "release_all"])
def test_a_slot_comes_back_empty_and_a_second_release_names_it(how: str) -> None:
    arena = Arena(16, 2)
    first, second = arena.allocate_many(2)
    second.write(b"stale bytes")

    def drop(buf: object) -> None:
        if how == "release":
            buf.release()  # type: ignore[attr-defined]
        else:
            arena.release_all([buf])  # type: ignore[list-item]

    drop(second)
    again = arena.allocate()
    assert again is second
    assert again.length == 0 and bytes(again.view()) == b""  # nothing of the last owner's
    drop(again)
    with pytest.raises(DoubleReleaseError, match=r"^buffer 1 released more times than owned$"):
        drop(again)
    assert arena.free_slots == 1
    drop(first)
    assert arena.free_slots == 2


@pytest.mark.parametrize(("slot_bytes", "num_slots"), [(0, 4), (4, 0), (-1, -1)])
def test_an_arena_needs_a_slot_of_a_byte(slot_bytes: int, num_slots: int) -> None:
    with pytest.raises(ValueError, match=r"^Arena needs at least one slot of at least one byte$"):
        Arena(slot_bytes, num_slots)


def test_the_smallest_arena_works_and_a_fresh_buffer_is_empty() -> None:
    arena = Arena(1, 1)
    buf = arena.allocate()
    assert buf is not None
    assert buf.length == 0 and bytes(buf.view()) == b""
    buf.write(b"x")
    assert bytes(buf.view()) == b"x"
    buf.release()
    arena.close()
    arena.close()  # closing twice is harmless


def test_an_unknown_backend_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match=r"^backend: must be 'bytes' or 'torch', got 'gpu'$"):
        Arena(8, 1, backend="gpu")


@pytest.mark.skipif(sys.platform != "linux", reason="/proc/self/maps: Linux")
def test_the_arena_is_a_private_mapping() -> None:
    """Private, not shared: no other process maps it, and private pages fault in faster."""
    import ctypes

    arena = Arena(64 * 1024, 4)
    try:
        address = ctypes.addressof(ctypes.c_char.from_buffer(arena._view))
        with open("/proc/self/maps") as maps:
            for line in maps:
                span, perms = line.split()[:2]
                low, high = (int(x, 16) for x in span.split("-"))
                if low <= address < high:
                    assert perms == "rw-p", line
                    break
            else:
                raise AssertionError("the arena is not in /proc/self/maps")
    finally:
        arena.close()


@pytest.mark.skipif(sys.platform != "linux", reason="mincore on an anonymous mapping: Linux")
def test_without_madvise_prefault_zeroes_only_an_unused_arena(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a kernel without MADV_POPULATE_WRITE, pre-faulting touches (zeroes) every page of an
    arena nobody uses yet, and never writes into one whose slots are in use."""
    import lmprefetch.memory as memory

    monkeypatch.setattr(memory, "_madvise", None)
    slot = 64 * 1024
    arena = Arena(slot, 4)
    try:
        assert arena.prefault(arena.total_bytes) == arena.total_bytes
        assert resident_bytes(arena) == arena.total_bytes
        assert bytes(arena._view) == bytes(arena.total_bytes)
    finally:
        arena.close()
    arena = Arena(slot, 4)
    try:
        buf = arena.allocate()
        assert buf is not None
        buf.write(b"in use")
        assert arena.prefault(arena.total_bytes) == arena.total_bytes
        assert bytes(buf.view()) == b"in use"
        assert resident_bytes(arena) == mmap.PAGESIZE  # only the page that was written
        buf.release()
    finally:
        arena.close()
