"""What a process holds, as the kernel sees it: its open file descriptors and its native threads
(Linux ``/proc``).  Shutdown tests (D19) snapshot these before starting a component and check
after closing it that nothing it made is still there: a socket or an eventfd left open, a
ZeroMQ context never terminated (its ``ZMQbg/…`` I/O threads live until ``term``), a thread
never joined.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest

HAVE_PROC = os.path.isdir("/proc/self/fd") and os.path.isdir("/proc/self/task")
needs_proc = pytest.mark.skipif(not HAVE_PROC, reason="needs Linux /proc")


def open_fds() -> set[tuple[int, str]]:
    """``(fd, what it points at)`` for every open file descriptor of this process."""
    out = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            out.add((int(name), os.readlink(f"/proc/self/fd/{name}")))
        except FileNotFoundError:  # the fd listdir itself used, closed again
            continue
    return out


def native_threads() -> dict[int, str]:
    """This process's native threads: thread id -> name (``comm``).  Compare ids, not names:
    a thread sets its own name once it runs, so a name read early may still be the default."""
    threads: dict[int, str] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                threads[int(tid)] = f.read().strip()
        except FileNotFoundError:  # the thread ended while we looked
            continue
    return threads


@dataclass
class Snapshot:
    fds: set[tuple[int, str]]
    threads: dict[int, str]

    @classmethod
    def take(cls) -> Snapshot:
        return cls(open_fds(), native_threads())

    def new_fds(self) -> set[tuple[int, str]]:
        """File descriptors open now that were not open at the snapshot."""
        return open_fds() - self.fds

    def new_threads(self) -> dict[int, str]:
        """Native threads running now that were not running at the snapshot (threads that
        ended since, e.g. idle worker threads of earlier tests, do not hide new ones)."""
        return {tid: name for tid, name in native_threads().items() if tid not in self.threads}

    def new_zmq_threads(self) -> dict[int, str]:
        """The new native threads that belong to a ZeroMQ context (``ZMQbg/IO/…``,
        ``ZMQbg/Reaper``): ``zmq_ctx_term`` joins them, so none may outlive a closed context.

        (Python threads are checked with :func:`threading.enumerate` instead: a joined Python
        thread can still be in the kernel's list for a moment while it exits.)"""
        return {tid: name for tid, name in self.new_threads().items() if name.startswith("ZMQ")}
