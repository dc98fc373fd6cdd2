"""The processes bench-serve starts: vLLM OpenAI servers and ``redis-server``.

Every process is started in a new session (so it leads its own process group, with every child
it spawns: vLLM's engine core and worker), listens on a free loopback port, and logs to a pipe
that a task reads for the process's whole life (a full pipe would stall it).  Readiness is the
process's own word, a log line (``Application startup complete.``, ``Ready to accept
connections``), awaited with a deadline; a process that exits first is an error carrying its
last log lines.

Stopping is by the group's own id, which is the leader's pid: ``SIGINT`` to the group (vLLM and
Redis shut down cleanly on it, and lmprefetch's connector flushes its disk writes), then a wait
on every member's pidfd with a deadline, then ``SIGKILL`` to whatever is left of the group.  Only
processes started here are ever signalled.

A :class:`ProcessSet` owns the processes of one scenario; its ``stop_all`` runs from a
``finally`` (shielded), so an error or Ctrl-C still stops everything.
"""

from __future__ import annotations

import collections
import os
import signal
import socket
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

import trio

from ... import _stopping

__all__ = ["ManagedProcess", "ProcessSet", "ServerError", "free_port"]

#: Lines of each process's log kept for error messages.
_LOG_LINES = 400
#: Seconds a process is given to stop after SIGINT while the command itself is stopping.
STOPPING_GRACE_S = 0.5


class ServerError(RuntimeError):
    """A process did not start (or died); the message ends with its last log lines."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bind to port 0, read it, close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _group_members(pgid: int) -> list[int]:
    """Pids of the live processes in process group ``pgid`` (from ``/proc``)."""
    members = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses.
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(entry.name))
    return members


class ManagedProcess:
    """One process (and its group) with its log.

    Args:
        name: for messages ("apc server", "redis").
        argv: the command.
        env: its environment (complete, not merged).
        ready_marker: the log line fragment that says it is ready.
        cwd: its working directory.
        port: a loopback TCP port it serves: ready only once it accepts a connection there
            too.  vLLM's API server logs uvicorn's "Application startup complete" on a socket
            it bound but that uvicorn only starts listening on a moment later: a request in
            that moment is refused.
    """

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        env: Mapping[str, str],
        ready_marker: str,
        cwd: Path | None = None,
        port: int | None = None,
    ) -> None:
        self.name = name
        self.port = port
        self.argv = list(argv)
        self.env = dict(env)
        self.ready_marker = ready_marker
        self.cwd = cwd
        self.log: collections.deque[str] = collections.deque(maxlen=_LOG_LINES)
        self.proc: trio.Process | None = None
        self._ready = trio.Event()
        self._accepting = False
        self._eof = trio.Event()
        self._pump_scope = trio.CancelScope()

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(list(self.log)[-lines:])

    def log_lines(self) -> list[str]:
        return list(self.log)

    async def start(self, nursery: trio.Nursery, timeout_s: float) -> None:
        """Start the process and return once it logged its ready line.

        Raises:
            ServerError: it exited first, or did not get ready within ``timeout_s`` (it is
                stopped before this raises).
        """
        self.proc = await trio.lowlevel.open_process(
            self.argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=self.env,
            cwd=self.cwd,
            start_new_session=True,
        )
        nursery.start_soon(self._pump)
        ok = False
        try:
            with trio.move_on_after(timeout_s):
                async with trio.open_nursery() as wait:

                    async def until(event: trio.Event) -> None:
                        await event.wait()
                        wait.cancel_scope.cancel()

                    wait.start_soon(until, self._ready)
                    wait.start_soon(until, self._eof)
                if self._ready.is_set() and self.port is not None:
                    await self._until_accepting(self.port)
            ok = self._ready.is_set() and (self.port is None or self._accepting)
            if not ok:
                why = "exited" if self._eof.is_set() else f"was not ready after {timeout_s:.0f} s"
                raise ServerError(f"{self.name} {why}; its last log lines:\n{self.log_tail()}")
        finally:
            if not ok:
                with trio.CancelScope(shield=True):
                    await self.stop()

    async def _until_accepting(self, port: int) -> None:
        """Return once 127.0.0.1:``port`` accepts a connection, or the process has exited
        (polled: nothing signals a socket starting to listen)."""
        while not self._eof.is_set():
            with trio.socket.socket() as sock:
                try:
                    await sock.connect(("127.0.0.1", port))
                except OSError:  # refused: not listening yet
                    pass
                else:
                    self._accepting = True
                    return
            await trio.sleep(0.02)

    async def _pump(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        stream = self.proc.stdout
        pending = b""
        with self._pump_scope:
            try:
                while True:
                    data = await stream.receive_some(65536)
                    if not data:
                        break
                    pending += data
                    *lines, pending = pending.split(b"\n")
                    for raw in lines:
                        line = raw.decode(errors="replace").rstrip("\r")
                        self.log.append(line)
                        if self.ready_marker in line:
                            self._ready.set()
            finally:
                if pending:
                    self.log.append(pending.decode(errors="replace"))
                self._eof.set()
                await trio.aclose_forcefully(stream)

    async def stop(self, grace_s: float = 60.0) -> int | None:
        """Stop the process group: ``SIGINT``, wait up to ``grace_s``, then ``SIGKILL``.

        When the command itself is being stopped (Ctrl-C, SIGTERM), the grace is
        :data:`STOPPING_GRACE_S` at most: the run's results are lost anyway, and the command
        must end promptly.  Returns the leader's exit status (``None`` if it never started).
        Idempotent.
        """
        proc = self.proc
        if proc is None:
            return None
        if _stopping.received() is not None:
            grace_s = min(grace_s, STOPPING_GRACE_S)
        pgid = proc.pid
        if not await self._signal_and_wait(pgid, signal.SIGINT, grace_s):
            await self._signal_and_wait(pgid, signal.SIGKILL, 30.0)
        if proc.returncode is None:  # the leader is always a member; reap it
            await proc.wait()
        # Every writer of the pipe is gone; the pump ends at EOF (or now, if a process that
        # left the group still holds the pipe).
        with trio.move_on_after(5.0):
            await self._eof.wait()
        self._pump_scope.cancel()
        return proc.returncode

    async def _signal_and_wait(self, pgid: int, sig: signal.Signals, timeout_s: float) -> bool:
        """Send ``sig`` to the group and wait for its members to exit; True if they all did."""
        assert self.proc is not None
        fds = []
        for pid in _group_members(pgid):
            try:
                fds.append(os.pidfd_open(pid))
            except ProcessLookupError:
                continue
        try:
            if not fds:
                return True
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                return True
            with trio.move_on_after(timeout_s):
                for fd in fds:
                    await trio.lowlevel.wait_readable(fd)
                return not _group_members(pgid)
            return False
        finally:
            for fd in fds:
                os.close(fd)


class ProcessSet:
    """The processes of one scenario, all stopped by :meth:`stop_all` (call it in a
    ``finally``).  Their log pumps run in ``nursery``."""

    def __init__(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery
        self._procs: list[ManagedProcess] = []

    async def start(self, proc: ManagedProcess, timeout_s: float) -> ManagedProcess:
        self._procs.append(proc)
        await proc.start(self._nursery, timeout_s)
        return proc

    async def stop(self, proc: ManagedProcess) -> None:
        await proc.stop()
        if proc in self._procs:
            self._procs.remove(proc)

    def post_mortem(self, lines: int = 30) -> str:
        """What each process said last, for a scenario that failed because one went away or
        stopped answering (a request refused, a stream cut): those that ended first (with
        their exit status), then those still running."""
        out = []
        for proc in sorted(self._procs, key=lambda p: p.proc is None or p.proc.poll() is None):
            if proc.proc is None:
                continue
            status = proc.proc.poll()
            state = "still running" if status is None else f"exited (status {status})"
            out.append(f"{proc.name} {state}; its last log lines:\n{proc.log_tail(lines)}")
        return "\n".join(out)

    async def stop_all(self) -> None:
        """Stop every process still running (concurrently), shielded from cancellation."""
        with trio.CancelScope(shield=True):
            async with trio.open_nursery() as nursery:
                for proc in self._procs:
                    nursery.start_soon(proc.stop)
            self._procs.clear()
