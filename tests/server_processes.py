"""What the tests' server processes share (``redis-server``, ``mooncake_master``,
``mooncake_client``): a free loopback port, and stopping, pausing and killing a process of our
own, by its pid (a test never signals a process it did not start).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess

__all__ = ["ServerProcess", "free_port"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bind to port 0, read it, close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class ServerProcess:
    """A server process a test started: :attr:`proc` while it runs.  A subclass starts it and
    tidies up in :meth:`_reaped` once it is gone (its log pipe).

    Args:
        wait_s: how long stopping or killing waits for the process to exit.
    """

    def __init__(self, wait_s: float) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self._wait_s = wait_s
        self._paused = False

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def kill(self) -> None:
        """SIGKILL and reap; starting it again reuses its ports."""
        proc = self.proc
        if proc is None:
            return
        if self._paused:
            self.resume()
        proc.kill()
        proc.wait(timeout=self._wait_s)
        self._reaped()

    def pause(self) -> None:
        """SIGSTOP, and wait until the whole process has stopped (the signal is only queued:
        its other threads may answer a request meanwhile).  The process keeps its sockets
        (connections are accepted: the kernel's backlog) but never answers."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)
        self._paused = True
        _, status = os.waitpid(self.proc.pid, os.WUNTRACED)  # our child: reports the stop
        assert os.WIFSTOPPED(status), status

    def resume(self) -> None:
        """SIGCONT after :meth:`pause`."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)
        self._paused = False

    def stop(self) -> None:
        """SIGTERM and reap (SIGKILL if it does not exit in time)."""
        proc = self.proc
        if proc is None:
            return
        if self._paused:
            self.resume()
        proc.terminate()
        try:
            proc.wait(timeout=self._wait_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        self._reaped()

    def _reaped(self) -> None:
        self.proc = None
