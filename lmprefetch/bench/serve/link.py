"""A slow link to Redis for bench-serve's ``slow_remote_*`` scenarios: delay and rate on one
TCP port's traffic, on the loopback interface of a private network namespace.

Two mechanisms, detected, never assumed:

* ``netem``: the port's traffic (both directions: to it and from it) is put in an ``htb``
  class of its own with ``u32`` filters on the TCP port, and the class's leaf qdisc is
  ``netem delay D rate R``, as a real link: every packet waits ``D`` and the bytes pass at
  ``R``.
* ``htb+proxy``, where the kernel has no ``netem`` qdisc (``tc`` says "Specified qdisc kind is
  unknown"): the same ``htb`` classes, at rate ``R`` each, limit the bytes; the delay is added
  by :class:`DelayProxy`, a small TCP forwarder on loopback in front of Redis (a process of
  its own, ``python -m lmprefetch.bench.serve.link proxy``) that hands every byte on ``D``
  after it arrived, in each direction, without waiting for anything else (a delay line:
  requests in flight are pipelined, as on a link with that one-way delay).

Every address is ``127.0.0.1``; every ``tc`` command acts on ``lo`` of the namespace this
process runs in, so a benchmark that shapes must run in a private one
(:func:`lmprefetch.bench.netns.loopback_only`).  Traffic on other ports is not classified
and passes unshaped.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = [
    "DelayProxy",
    "LinkSpec",
    "Shaper",
    "Sink",
    "TcResult",
    "main",
    "measure_transfer",
    "tc_commands",
]

#: The marker the proxy process prints once it accepts connections.
PROXY_READY = "lmprefetch delay proxy ready"


@dataclass(frozen=True)
class LinkSpec:
    """A link: ``rate_bytes_per_s`` in each direction, ``delay_s`` one way (so a round trip
    takes at least twice that)."""

    rate_bytes_per_s: float
    delay_s: float

    def describe(self) -> str:
        return f"{self.rate_bytes_per_s / 1e6:g} MB/s each way, {self.delay_s * 1e3:g} ms one way"


@dataclass(frozen=True)
class TcResult:
    returncode: int
    stderr: str


#: Runs one ``tc`` command (the arguments after ``tc``); replaced in tests.
TcRunner = Callable[[Sequence[str]], TcResult]


def run_tc(args: Sequence[str]) -> TcResult:
    exe = shutil.which("tc")
    if exe is None:
        return TcResult(127, "tc (iproute2) is not installed")
    done = subprocess.run([exe, *args], capture_output=True, text=True, check=False)
    return TcResult(done.returncode, done.stderr.strip())


def _rate(spec: LinkSpec) -> str:
    return f"{max(1, round(spec.rate_bytes_per_s * 8))}bit"


def tc_commands(port: int, spec: LinkSpec, *, netem: bool, dev: str = "lo") -> list[list[str]]:
    """The ``tc`` commands that shape ``port``'s traffic on ``dev``: a root ``htb`` whose
    unclassified traffic passes unshaped, one class per direction at the link's rate, ``u32``
    filters on the destination and the source port, and (``netem``) a ``netem`` leaf with the
    delay and the rate."""
    rate = _rate(spec)
    cmds = [f"qdisc add dev {dev} root handle 1: htb".split()]
    for minor, field in ((10, "dport"), (20, "sport")):
        cmds.append(
            f"class add dev {dev} parent 1: classid 1:{minor} htb rate {rate} ceil {rate}".split()
        )
        cmds.append(
            f"filter add dev {dev} parent 1: protocol ip prio 1 u32 "
            f"match ip {field} {port} 0xffff flowid 1:{minor}".split()
        )
        if netem:
            cmds.append(
                f"qdisc add dev {dev} parent 1:{minor} handle {minor}: netem "
                f"delay {spec.delay_s * 1e3:g}ms rate {rate} limit 100000".split()
            )
    return cmds


class Shaper:
    """Shapes one port's traffic with ``tc``; :meth:`install` detects the mechanism.

    Args:
        runner: runs one ``tc`` command (default: the ``tc`` binary).
        dev: the interface (``lo``).
    """

    def __init__(self, runner: TcRunner = run_tc, dev: str = "lo") -> None:
        self._run = runner
        self.dev = dev
        self.installed = False

    def netem_available(self) -> tuple[bool, str]:
        """Whether this kernel and ``tc`` can add a ``netem`` qdisc, and ``tc``'s words if not
        (tried on ``dev``'s root, then removed)."""
        probe = self._run(["qdisc", "add", "dev", self.dev, "root", "handle", "1:", "netem",
                           "delay", "1ms"])  # fmt: skip
        if probe.returncode != 0:
            return False, probe.stderr or f"tc exit status {probe.returncode}"
        self._run(["qdisc", "del", "dev", self.dev, "root"])
        return True, ""

    def install(self, port: int, spec: LinkSpec, *, netem: bool) -> None:
        """Shape ``port``'s traffic: the rate, and with ``netem`` the delay too (without it,
        the caller adds the delay with a :class:`DelayProxy` listening on ``port``).

        Raises:
            OSError: ``tc`` cannot shape here (no ``htb``, not allowed: run in a private
                network namespace); nothing is left installed.
        """
        self.remove()
        for cmd in tc_commands(port, spec, netem=netem, dev=self.dev):
            done = self._run(cmd)
            if done.returncode != 0:
                self.remove()
                raise OSError(f"tc {' '.join(cmd)}: {done.stderr or done.returncode}")
            self.installed = True

    def remove(self) -> None:
        """Remove the root qdisc (and so everything under it); idempotent."""
        self._run(["qdisc", "del", "dev", self.dev, "root"])
        self.installed = False


# -- the delay proxy (a process of its own: asyncio, not lmprefetch's Trio engine) -----------
class DelayProxy:
    """Forwards TCP connections from ``listen_port`` to ``target_port`` on 127.0.0.1, every
    byte ``delay_s`` after it arrived, in each direction.

    Each direction of a connection is a delay line: what is read is queued with its due time
    and written when that time comes, while reading goes on; so a reply that needs several
    round trips takes them, and data in flight is not held back by the delay of what came
    before it.  Writing waits for the socket (``drain``), so a slow reader slows the sender
    down through TCP as usual.
    """

    def __init__(self, listen_port: int, target_port: int, delay_s: float) -> None:
        self.listen_port = listen_port
        self.target_port = target_port
        self.delay_s = delay_s
        self.bytes_forwarded = [0, 0]  # to the target, back to the client

    async def serve(self, ready: Callable[[], None] | None = None) -> None:
        server = await asyncio.start_server(self._connection, "127.0.0.1", self.listen_port)
        async with server:
            if ready is not None:
                ready()
            await server.serve_forever()

    async def _connection(
        self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter
    ) -> None:
        try:
            t_reader, t_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            c_writer.close()
            return
        for w in (c_writer, t_writer):
            sock = w.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            await asyncio.gather(
                self._direction(c_reader, t_writer, 0), self._direction(t_reader, c_writer, 1)
            )
        finally:
            for w in (c_writer, t_writer):
                w.close()

    async def _direction(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int
    ) -> None:
        loop = asyncio.get_running_loop()
        line: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def deliver() -> None:
            while True:
                due, data = await line.get()
                wait = due - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                if not data:
                    with contextlib.suppress(OSError):
                        writer.write_eof()
                    return
                writer.write(data)
                await writer.drain()
                self.bytes_forwarded[index] += len(data)

        sender = asyncio.ensure_future(deliver())
        try:
            while True:
                try:
                    data = await reader.read(1 << 16)
                except OSError:
                    data = b""
                line.put_nowait((loop.time() + self.delay_s, data))
                if not data:
                    break
            await sender
        except (OSError, ConnectionError):
            sender.cancel()
        finally:
            if not sender.done():
                sender.cancel()


# -- measuring a link (the tests, and a look at the link before a scenario uses it) --------
def measure_transfer(port: int, up: int, down: int, timeout_s: float = 60.0) -> float:
    """Seconds for one exchange with a :class:`Sink` behind ``port``: ``up`` bytes to it,
    then ``down`` bytes back (the clock stops at the last byte received)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        t0 = time.perf_counter()
        sock.sendall(up.to_bytes(8, "big") + down.to_bytes(8, "big") + bytes(up))
        _recv_exact(sock, max(1, down))
        return time.perf_counter() - t0


class Sink:
    """A TCP server on 127.0.0.1 (a thread of its own) for :func:`measure_transfer`: reads
    ``up`` and ``down`` (8 bytes each), then ``up`` bytes, then sends ``down`` bytes (at
    least one).  ``with Sink() as sink: sink.port``."""

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def __enter__(self) -> Sink:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._listener.close()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    @staticmethod
    def _handle(conn: socket.socket) -> None:
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                while True:
                    head = _recv_exact(conn, 16)
                    up, down = int.from_bytes(head[:8], "big"), int.from_bytes(head[8:], "big")
                    left = up
                    while left:
                        left -= len(_recv_exact(conn, min(left, 1 << 16)))
                    conn.sendall(bytes(max(1, down)))
            except (ConnectionError, OSError):
                return


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        data = sock.recv(n - len(out))
        if not data:
            raise ConnectionError("closed")
        out += data
    return bytes(out)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m lmprefetch.bench.serve.link proxy --listen PORT --target PORT --delay-ms D``."""
    p = argparse.ArgumentParser(prog="python -m lmprefetch.bench.serve.link")
    sub = p.add_subparsers(dest="command", required=True)
    proxy = sub.add_parser("proxy", help="a delay proxy on 127.0.0.1")
    proxy.add_argument("--listen", type=int, required=True)
    proxy.add_argument("--target", type=int, required=True)
    proxy.add_argument("--delay-ms", type=float, required=True)
    args = p.parse_args(argv)
    forwarder = DelayProxy(args.listen, args.target, args.delay_ms / 1e3)

    def ready() -> None:
        print(f"{PROXY_READY} on 127.0.0.1:{args.listen}", flush=True)

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(forwarder.serve(ready))
    return 0


if __name__ == "__main__":
    sys.exit(main())
