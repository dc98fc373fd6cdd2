"""Arena and Buffer: owner counting, allocation failure as a value, thread-safe release."""

from __future__ import annotations

import threading

import pytest

from lmprefetch.memory import Arena, DoubleReleaseError


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
    with pytest.raises(DoubleReleaseError):
        b.release()
    with pytest.raises(DoubleReleaseError):
        b.view()


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
