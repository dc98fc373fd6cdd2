"""A fixed arena of equal-size buffers with explicit owner counts.

The arena is allocated once (private anonymous ``mmap`` memory, page-aligned so ``O_DIRECT``
reads can land in it; or a torch ``uint8`` tensor, pinned when CUDA is available).  It is cut
into ``slot_bytes`` slots.  Anonymous memory is mapped lazily: the first write to each page
faults, which would make the first loads into fresh slots several times slower than later ones,
so :meth:`Arena.prefault` maps the slots handed out first up front (``arena_prefault_bytes``).

:meth:`Arena.allocate` hands out a :class:`Buffer` with one owner, or ``None`` when every slot
is taken: allocation never waits, never loops, never sleeps (LMCache's
allocator busy-loops under pressure, D11).  A holder that shares a buffer calls
:meth:`Buffer.retain`; each owner calls :meth:`Buffer.release` exactly once; the slot returns to
the arena when the last owner releases.  A release past zero raises, so a double release (D01) is
a loud bug, not a silent reuse of memory that is still indexed somewhere.

Owner counts are guarded by one lock, so buffers may be released from the engine's worker
thread (a model step leaving a claim block) as well as from the Trio thread.

Cancellation: nothing here awaits, so nothing here can be cancelled.  Allocation and release
are synchronous, which is what lets a ``finally`` block or an exit-stack callback release a
buffer even while its task is being cancelled.

The ``Dnn`` codes are LMCache's defects, the rows of the defect table in
``docs/cancellation.md`` ("The defects"), each with its ``test_dNN_`` regression tests.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import threading
from collections.abc import Iterable
from typing import Any

import msgspec

__all__ = ["Arena", "ArenaStatistics", "Buffer", "DoubleReleaseError"]

#: ``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14+): fault pages in, writable, without touching
#: their contents.  Python's ``mmap`` module has no name for it before 3.13.
_MADV_POPULATE_WRITE = 23
_PAGE = mmap.PAGESIZE


# pragma: no mutate start
# (Runs once, at import: before mutation testing selects a mutant, so no test could see one.
# tests/test_memory.py checks that pre-faulting goes through madvise where the kernel has it.)
def _libc_madvise() -> Any:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError, TypeError):  # pragma: no cover - not a POSIX libc
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn
# pragma: no mutate end


_madvise = _libc_madvise()


def _populate(address: int, nbytes: int, *, may_write: bool) -> None:
    """Fault ``nbytes`` at ``address`` into memory.  Foreign calls release the GIL, so other
    threads run meanwhile.  ``may_write``: if the kernel cannot populate, zero the bytes
    instead (only for memory nobody uses yet)."""
    start = address - address % _PAGE
    end = -(-(address + nbytes) // _PAGE) * _PAGE
    if _madvise is not None and _madvise(start, end - start, _MADV_POPULATE_WRITE) == 0:
        return
    if may_write:  # an older kernel (EINVAL): touching every page has the same effect
        ctypes.memset(address, 0, nbytes)


class ArenaStatistics(msgspec.Struct, frozen=True, gc=False):
    """An arena's size and the slots in use now (by the CPU tier, lookups and claimers)."""

    slot_bytes: int
    total_slots: int
    used_slots: int
    total_bytes: int
    used_bytes: int


class DoubleReleaseError(RuntimeError):
    """A buffer was released more times than it was owned."""


class Buffer:
    """One arena slot: ``length`` payload bytes at the start of a ``capacity``-byte slot."""

    __slots__ = ("_arena", "_owners", "capacity", "index", "length")

    def __init__(self, arena: Arena, index: int, capacity: int) -> None:
        self._arena = arena
        self.index = index
        self.capacity = capacity
        self.length = 0
        self._owners = 0

    # -- data -------------------------------------------------------------------------
    def view(self) -> memoryview:
        """Exactly the stored payload bytes (read-write view into the arena)."""
        self._check_live()
        start = self.index * self.capacity
        return self._arena._view[start : start + self.length]

    def slot(self) -> memoryview:
        """The whole slot, for filling; set :attr:`length` after writing."""
        self._check_live()
        start = self.index * self.capacity
        return self._arena._view[start : start + self.capacity]

    def write(self, payload: Any) -> None:
        """Copy ``payload`` (any bytes-like object) into the slot and set :attr:`length`.

        Raises:
            DoubleReleaseError: the buffer was released (its slot may be someone else's).
            ValueError: ``payload`` is longer than the slot.
        """
        self._check_live()
        src = memoryview(payload).cast("B")
        n = src.nbytes
        if n > self.capacity:
            raise ValueError(f"payload of {n} bytes does not fit a {self.capacity}-byte buffer")
        start = self.index * self.capacity
        self._arena._view[start : start + n] = src
        self.length = n

    def tensor(self) -> Any:
        """The payload as a torch ``uint8`` tensor view (torch backend only).

        Raises:
            DoubleReleaseError: the buffer was released.
            RuntimeError: the arena is not a torch tensor.
        """
        self._check_live()
        tensor = self._arena._tensor
        if tensor is None:
            raise RuntimeError("Buffer.tensor() needs buffer_backend='torch'")
        start = self.index * self.capacity
        return tensor[start : start + self.length]

    # -- ownership --------------------------------------------------------------------
    @property
    def arena(self) -> Arena:
        """The arena this buffer is a slot of."""
        return self._arena

    @property
    def owners(self) -> int:
        return self._owners

    def retain(self) -> Buffer:
        """Add an owner; returns ``self``."""
        with self._arena._lock:
            if self._owners <= 0:
                raise DoubleReleaseError(f"retain of released buffer {self.index}")
            self._owners += 1
        return self

    def release(self) -> None:
        """Drop one owner; the last release returns the slot to the arena."""
        arena = self._arena
        with arena._lock:
            if self._owners <= 0:
                raise DoubleReleaseError(f"buffer {self.index} released more times than owned")
            self._owners -= 1
            if self._owners == 0:
                self.length = 0
                arena._free.append(self)

    def _check_live(self) -> None:
        if self._owners <= 0:
            raise DoubleReleaseError(f"buffer {self.index} used after its last release")

    def __repr__(self) -> str:
        return f"<Buffer {self.index} len={self.length} owners={self._owners}>"


class Arena:
    """``num_slots`` buffers of ``slot_bytes`` bytes each.

    Args:
        slot_bytes: size of one slot.
        num_slots: number of slots.
        backend: ``"bytes"`` (anonymous mmap) or ``"torch"``.
    """

    def __init__(self, slot_bytes: int, num_slots: int, *, backend: str = "bytes") -> None:
        if slot_bytes < 1 or num_slots < 1:
            raise ValueError("Arena needs at least one slot of at least one byte")
        self.slot_bytes = slot_bytes
        self.num_slots = num_slots
        self._lock = threading.Lock()
        self._tensor: Any = None
        size = slot_bytes * num_slots
        if backend == "torch":
            import torch

            pin = bool(torch.cuda.is_available())
            self._tensor = torch.empty(size, dtype=torch.uint8, pin_memory=pin)
            self._mmap: mmap.mmap | None = None
            self._view = memoryview(self._tensor.numpy()).cast("B")
        elif backend == "bytes":
            # Private, not the default shared mapping: nothing shares the arena with another
            # process, and private anonymous pages fault in about twice as fast here.
            flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
            self._mmap = mmap.mmap(-1, size, flags=flags)
            self._view = memoryview(self._mmap)
        else:
            raise ValueError(f"backend: must be 'bytes' or 'torch', got {backend!r}")
        self._all = [Buffer(self, i, slot_bytes) for i in range(num_slots)]
        # Pop from the end: the lowest slots are handed out first.
        self._free: list[Buffer] = list(reversed(self._all))


    def __repr__(self) -> str:
        return (
            f"<Arena {self.num_slots} slots x {self.slot_bytes} bytes, "
            f"{self.used_slots} used>"
        )

    def allocate(self) -> Buffer | None:
        """A buffer with one owner, or ``None`` if every slot is in use (never waits)."""
        with self._lock:
            if not self._free:
                return None
            buf = self._free.pop()
            buf._owners = 1
            return buf

    def allocate_many(self, n: int) -> list[Buffer]:
        """Up to ``n`` buffers (fewer when the arena runs out), each with one owner."""
        with self._lock:
            take = min(n, len(self._free))
            out = [self._free.pop() for _ in range(take)]
            for buf in out:
                buf._owners = 1
            return out

    def prefault(self, nbytes: int) -> int:
        """Map the first ``nbytes`` of the arena (whole slots; the slots :meth:`allocate`
        hands out first) into memory now, so that loads into them do not page-fault.  Call it
        before any slot is in use (a kernel older than Linux 5.14 has the slots zeroed
        instead).  It may take a while (about 0.3–1 s per GiB on a small VM) and releases the
        GIL meanwhile.  Returns the bytes pre-faulted."""
        slots = min(self.num_slots, -(-max(0, nbytes) // self.slot_bytes))
        n = slots * self.slot_bytes
        if n:
            with self._view[:n] as head:
                address = ctypes.addressof(ctypes.c_char.from_buffer(head))
                _populate(address, n, may_write=self.used_slots == 0)
        return n

    def retain_all(self, bufs: Iterable[Buffer]) -> None:
        """:meth:`Buffer.retain` each of ``bufs`` (buffers of this arena), under one lock."""
        with self._lock:
            for buf in bufs:
                if buf._arena is not self:
                    raise ValueError(f"buffer {buf.index} belongs to another arena")
                if buf._owners <= 0:
                    raise DoubleReleaseError(f"retain of released buffer {buf.index}")
                buf._owners += 1

    def release_all(self, bufs: Iterable[Buffer]) -> None:
        """:meth:`Buffer.release` each of ``bufs`` (buffers of this arena) in order, under one
        lock.  A buffer released more often than owned raises :class:`DoubleReleaseError`
        there, with the buffers before it released, as a loop of ``release`` calls would."""
        free = self._free
        with self._lock:
            for buf in bufs:
                if buf._arena is not self:
                    raise ValueError(f"buffer {buf.index} belongs to another arena")
                if buf._owners <= 0:
                    raise DoubleReleaseError(
                        f"buffer {buf.index} released more times than owned"
                    )
                buf._owners -= 1
                if buf._owners == 0:
                    buf.length = 0
                    free.append(buf)

    def statistics(self) -> ArenaStatistics:
        used = self.num_slots - len(self._free)
        return ArenaStatistics(
            slot_bytes=self.slot_bytes,
            total_slots=self.num_slots,
            used_slots=used,
            total_bytes=self.slot_bytes * self.num_slots,
            used_bytes=used * self.slot_bytes,
        )

    @property
    def total_bytes(self) -> int:
        return self.slot_bytes * self.num_slots

    @property
    def address(self) -> int:
        """The address of the arena's first byte (slot ``i`` starts ``i * slot_bytes`` after
        it), for a library that registers memory to transfer into it without a copy (the
        Mooncake tier).  The memory stays at this address until :meth:`close`."""
        return ctypes.addressof(ctypes.c_char.from_buffer(self._view))

    @property
    def used_slots(self) -> int:
        return self.num_slots - len(self._free)

    @property
    def used_bytes(self) -> int:
        return self.used_slots * self.slot_bytes

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def close(self) -> None:
        """Drop the backing memory (only once no buffer is in use)."""
        self._view.release()
        if self._mmap is not None:
            self._mmap.close()
            self._mmap = None
        self._tensor = None
