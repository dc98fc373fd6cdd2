"""Trio-native ZeroMQ sockets: wait on the socket's FD, drain on ``zmq.EVENTS``.

pyzmq has no Trio backend, and a thread that relays messages into Trio is slower and has
worse failure modes, so :class:`TrioZmqSocket` drives a plain (synchronous) ``zmq.Socket``
from Trio directly, the way :mod:`trio.socket` drives an OS socket ("try the operation, and
only if it would block, wait for readiness").

Why the loop looks the way it does (``ZMQ_FD`` is not an ordinary readiness FD):

* ``ZMQ_FD`` is libzmq's internal mailbox signaller.  It is *edge-triggered* in effect: it
  becomes readable when new commands arrive for the socket, and ``send``, ``recv`` and
  reading ``ZMQ_EVENTS`` all consume those commands.  After any of them the FD may stay quiet
  although a message is queued.  So we never wait first: we try the non-blocking operation,
  and when it says ``zmq.Again`` we read ``ZMQ_EVENTS`` (which processes pending commands)
  and retry at once if it reports readiness; only when it does not do we wait on the FD.
* The FD also wakes for reasons that are not messages (connects, pipe activation, the other
  direction's readiness), so every wake-up just goes round the loop again.
* The one FD serves both directions, and a wake-up consumed by one task is lost to another:
  **at most one task may use a socket at a time** (for the lookup topology that means one
  task per direction, since every socket is PUSH-only or PULL-only).  A second concurrent
  waiter gets :class:`trio.BusyResourceError`.

Cancellation follows trio's own socket code: a cancellation checkpoint *before* the operation,
and after an operation that succeeded at once a ``cancel_shielded_checkpoint`` (a schedule
point that cannot raise), so a message taken off the socket is always returned, never lost to
a late ``Cancelled``.  ZeroMQ operations are atomic, so a cancelled wait leaves the message
in the socket for the next ``recv``.

Closing follows :func:`trio.lowlevel.notify_closing`'s rules: mark closed, notify (waiters
wake with :class:`trio.ClosedResourceError`), close with ``linger=0``, with no checkpoint in
between.  Contexts: one fresh ``zmq.Context()`` per owner (:func:`open_context`), never the
process-wide ``Context.instance()``, terminated by its owner after its sockets are closed
(:func:`close_context`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from types import TracebackType
from typing import Any, cast

import trio
import zmq

__all__ = [
    "TrioZmqSocket",
    "check_endpoint",
    "close_context",
    "drain",
    "make_pull",
    "make_push",
    "make_xpub",
    "open_context",
    "try_send",
]

#: Longest ``ipc://`` path (``sockaddr_un.sun_path`` less its terminator), in bytes.
IPC_PATH_MAX_LEN: int = getattr(zmq, "IPC_PATH_MAX_LEN", 107)

# host: a name, an IPv4 address, ``*`` (bind on all), or a bracketed IPv6 address;
# port: a number or ``*`` (an ephemeral port, bind only).
_TCP_RE = re.compile(r"^tcp://(?P<host>\[[0-9A-Fa-f:.%\w]+\]|[\w.\-*]+):(?P<port>\d{1,5}|\*)$")


def check_endpoint(url: str) -> str:
    """Check that ``url`` is a lookup endpoint lmprefetch can use, and return it.

    Accepted: ``ipc:///path`` (or a relative ``ipc://path``), ``ipc://@abstract-name`` (Linux
    abstract namespace: no file, nothing to clean up) and ``tcp://host:port`` (port ``0`` or
    ``*`` picks a free port when binding).

    Raises:
        ValueError: another scheme, an empty or over-long ipc path (more than
            ``IPC_PATH_MAX_LEN`` = 107 bytes, which the kernel would refuse), or a malformed
            tcp address.
    """
    if not isinstance(url, str):
        raise ValueError(f"endpoint: expected a str URL, got {type(url).__name__}")
    if url.startswith("ipc://"):
        path = url[len("ipc://") :]
        if not path or path == "@":
            raise ValueError(f"endpoint {url!r}: the ipc path is empty")
        if "\x00" in path:
            raise ValueError(f"endpoint {url!r}: the ipc path contains a NUL byte")
        size = len(path.encode("utf-8"))
        if size > IPC_PATH_MAX_LEN:
            raise ValueError(
                f"endpoint {url!r}: the ipc path is {size} bytes, longer than the "
                f"{IPC_PATH_MAX_LEN} a Unix socket address can hold; use a shorter path or "
                f"an abstract name (ipc://@name)"
            )
        return url
    if url.startswith("tcp://"):
        m = _TCP_RE.match(url)
        if m is None:
            raise ValueError(f"endpoint {url!r}: expected tcp://host:port")
        port = m.group("port")
        if port != "*" and int(port) > 65535:
            raise ValueError(f"endpoint {url!r}: port {port} is out of range")
        return url
    raise ValueError(f"endpoint {url!r}: expected ipc://path, ipc://@name or tcp://host:port")


def open_context() -> zmq.Context[zmq.Socket[bytes]]:
    """A fresh ZeroMQ context for one owner (never the process-wide ``Context.instance()``).

    Its owner closes it with :func:`close_context`, which terminates only this context, so
    closing lmprefetch never breaks another library's sockets in the same process.
    """
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    ctx.linger = 0  # sockets made from it drop unsent messages on close instead of hanging term()
    return ctx


def close_context(
    ctx: zmq.Context[Any], sockets: Iterable[TrioZmqSocket | zmq.Socket[Any]] = ()
) -> None:
    """Close ``sockets`` (``linger=0``), then any other socket left in ``ctx``, then terminate it.

    Call it from the thread that owns the context's sockets (ZeroMQ sockets are not
    thread-safe).  A :class:`TrioZmqSocket` is closed with :meth:`TrioZmqSocket.close`, so a
    task waiting on it wakes with :class:`trio.ClosedResourceError`.  Idempotent.

    Terminating joins libzmq's I/O threads; with every socket closed at ``linger=0`` that
    takes well under a millisecond and never waits for a peer.
    """
    for sock in sockets:
        sock.close(linger=0)
    if not ctx.closed:
        # destroy() closes any socket the caller forgot (else term() would wait for it
        # forever), then terms.
        ctx.destroy(linger=0)


#: How often (ms) a connecting ``ipc://`` socket retries a peer that is not there yet (libzmq's
#: default is 100 ms).  A worker that starts before its scheduler binds the answer endpoint, or a
#: client that starts before its worker, would otherwise hold its first message for up to
#: 100 ms; a failed connect to a local socket costs a few microseconds.  ``tcp://`` keeps
#: libzmq's default (a retry there is a packet to another host).
IPC_RECONNECT_IVL_MS = 10


def _make_socket(
    ctx: zmq.Context[Any],
    kind: int,
    endpoint: str,
    *,
    bind: bool,
    hwm: int,
    max_message_bytes: int = -1,
    immediate: bool = False,
) -> zmq.Socket[bytes]:
    check_endpoint(endpoint)
    if isinstance(hwm, bool) or not isinstance(hwm, int) or hwm < 0:
        raise ValueError(f"hwm: must be a non-negative int, got {hwm!r}")
    sock: zmq.Socket[bytes] = ctx.socket(kind)
    ready = False
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, hwm)
        sock.setsockopt(zmq.RCVHWM, hwm)
        # A peer that sends a larger frame is disconnected by libzmq before the frame is
        # buffered, so one hostile frame cannot make us allocate without bound.
        sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        if immediate:
            sock.setsockopt(zmq.IMMEDIATE, 1)
        if not bind and endpoint.startswith("ipc://"):
            sock.setsockopt(zmq.RECONNECT_IVL, IPC_RECONNECT_IVL_MS)
        if bind:
            sock.bind(endpoint)
        else:
            sock.connect(endpoint)
        ready = True
    finally:
        if not ready:
            sock.close(linger=0)
    return sock


def make_push(
    ctx: zmq.Context[Any], endpoint: str, *, bind: bool, hwm: int, immediate: bool = False
) -> zmq.Socket[bytes]:
    """A PUSH socket on ``endpoint`` with ``linger=0`` and ``SNDHWM = RCVHWM = hwm``.

    Returns the plain ``zmq.Socket``; wrap it in :class:`TrioZmqSocket` to use it from Trio.
    After binding to port 0, ``sock.LAST_ENDPOINT`` tells the port chosen.  A connecting
    ``ipc://`` socket retries a missing peer every :data:`IPC_RECONNECT_IVL_MS`.  With
    ``immediate`` (``ZMQ_IMMEDIATE``) nothing is queued until a connection is complete: a send
    before that would block (``send_nowait`` raises :class:`trio.WouldBlock`) instead of
    filling a pipe to a peer that is not there yet.

    Raises:
        ValueError: ``endpoint`` fails :func:`check_endpoint`, or ``hwm`` is negative.
        zmq.ZMQError: binding or connecting failed (e.g. the address is in use).
    """
    return _make_socket(ctx, zmq.PUSH, endpoint, bind=bind, hwm=hwm, immediate=immediate)


def make_pull(
    ctx: zmq.Context[Any],
    endpoint: str,
    *,
    bind: bool,
    hwm: int,
    max_message_bytes: int = -1,
) -> zmq.Socket[bytes]:
    """A PULL socket on ``endpoint`` with ``linger=0`` and ``SNDHWM = RCVHWM = hwm``.

    ``max_message_bytes`` (``ZMQ_MAXMSGSIZE``; -1: no limit) bounds one incoming frame: a peer
    that sends a larger one is disconnected.  See :func:`make_push`.
    """
    return _make_socket(
        ctx, zmq.PULL, endpoint, bind=bind, hwm=hwm, max_message_bytes=max_message_bytes
    )


def make_xpub(ctx: zmq.Context[Any], endpoint: str, *, hwm: int) -> zmq.Socket[bytes]:
    """A bound XPUB socket on ``endpoint`` (``linger=0``, ``SNDHWM = RCVHWM = hwm``): a PUB
    socket that also receives its subscribers' (un)subscriptions as messages (``b"\\x01"`` or
    ``b"\\x00"`` and the topic prefix).  At the high-water mark a subscriber's messages are
    dropped, never waited for.  See :func:`make_push` for the errors.
    """
    return _make_socket(ctx, zmq.XPUB, endpoint, bind=True, hwm=hwm)


def try_send(sock: zmq.Socket[Any], data: bytes | memoryview) -> bool:
    """Queue one message without waiting; ``False`` if the socket cannot take it now.

    A plain ``send(NOBLOCK)`` is not enough: libzmq *throttles* command processing on the
    send path (at most about once per millisecond), so it can say ``zmq.Again`` although the
    peer has long since drained the queue and told us so.  Reading ``ZMQ_EVENTS`` processes
    those commands; when it reports room, one retry tells the truth.
    """
    try:
        sock.send(data, zmq.NOBLOCK)
        return True
    except zmq.Again:
        pass
    if not cast(int, sock.getsockopt(zmq.EVENTS)) & zmq.POLLOUT:
        return False
    try:
        sock.send(data, zmq.NOBLOCK)
        return True
    except zmq.Again:
        return False


def drain(sock: TrioZmqSocket | zmq.Socket[Any], max_n: int) -> list[bytes]:
    """Receive up to ``max_n`` messages that are already queued, without waiting.

    Servers use it to batch: ``first = await sock.recv()`` then ``rest = drain(sock, n)``.
    It stops at the first ``zmq.Again`` (nothing more queued) and never blocks.

    Raises:
        trio.ClosedResourceError: ``sock`` is a closed :class:`TrioZmqSocket`.
    """
    out: list[bytes] = []
    if isinstance(sock, TrioZmqSocket):
        while len(out) < max_n:
            try:
                out.append(sock.recv_nowait())
            except trio.WouldBlock:
                break
        return out
    while len(out) < max_n:
        try:
            out.append(sock.recv(zmq.NOBLOCK))
        except zmq.Again:
            break
    return out


class TrioZmqSocket:
    """A ``zmq.Socket`` driven from Trio without threads.

    The wrapper takes ownership of ``sock``: closing the wrapper closes the socket.  At most
    one task may use one socket at a time (see the module docstring: the FD is shared and its
    wake-ups are consumed); a PUSH-only or PULL-only socket therefore has one owner task.

    It is a context manager; leaving the block closes the socket.

    Args:
        sock: a synchronous pyzmq socket (from a ``zmq.Context``, not ``zmq.asyncio``).
    """

    __slots__ = ("_closed", "_fd", "_sock")

    def __init__(self, sock: zmq.Socket[Any]) -> None:
        self._sock = sock
        self._fd: int = sock.FD
        self._closed = False

    @property
    def socket(self) -> zmq.Socket[Any]:
        """The wrapped pyzmq socket (for options and ``LAST_ENDPOINT``; do not send/recv on it)."""
        return self._sock

    @property
    def closed(self) -> bool:
        return self._closed

    def _events(self) -> int:
        # Reading ZMQ_EVENTS processes the socket's pending commands: it is the
        # authoritative readiness, unlike the FD.
        return cast(int, self._sock.getsockopt(zmq.EVENTS))

    def _check_open(self) -> None:
        if self._closed:
            raise trio.ClosedResourceError("the socket was closed")

    # -- non-blocking -------------------------------------------------------------------

    def recv_nowait(self) -> bytes:
        """Take one queued message, or raise :class:`trio.WouldBlock` if there is none.

        Raises:
            trio.WouldBlock: nothing is queued.
            trio.ClosedResourceError: the socket was closed.
        """
        self._check_open()
        try:
            return self._sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            raise trio.WouldBlock from None

    def send_nowait(self, data: bytes | memoryview) -> None:
        """Queue one message, or raise :class:`trio.WouldBlock` at the high-water mark.

        Raises:
            trio.WouldBlock: the socket cannot take it now (HWM reached, or no peer yet).
            trio.ClosedResourceError: the socket was closed.
        """
        self._check_open()
        if not try_send(self._sock, data):
            raise trio.WouldBlock

    def send_multipart_nowait(self, frames: Sequence[bytes]) -> None:
        """Queue one multipart message (all frames or none), or raise
        :class:`trio.WouldBlock` when the socket cannot take it now.

        Raises:
            trio.WouldBlock: the socket cannot take it now.
            trio.ClosedResourceError: the socket was closed.
        """
        self._check_open()
        try:
            self._sock.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:
            raise trio.WouldBlock from None

    # -- async --------------------------------------------------------------------------

    async def recv_batch(self, max_n: int) -> list[bytes]:
        """Wait until at least one message is queued, then take up to ``max_n`` of them.

        The server's receive loop: it reads ``ZMQ_EVENTS`` (cheap, and authoritative) before
        each receive instead of letting a receive fail with ``zmq.Again``, and waits on the FD
        only when nothing is queued.  Cancellation: nothing is taken off the socket unless the
        call returns (the only checkpoints come before the first receive).

        Raises:
            trio.ClosedResourceError: the socket is closed, or was closed while waiting.
            trio.BusyResourceError: another task is already waiting on this socket.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        sock = self._sock
        waited = False
        while True:
            self._check_open()
            if self._events() & zmq.POLLIN:
                break
            await trio.lowlevel.wait_readable(self._fd)
            waited = True
        out: list[bytes] = []
        while len(out) < max_n:
            try:
                out.append(sock.recv(zmq.NOBLOCK))
            except zmq.Again:
                break
            if not self._events() & zmq.POLLIN:
                break
        if not waited:
            await trio.lowlevel.cancel_shielded_checkpoint()
        return out

    async def recv(self) -> bytes:
        """Receive one message, waiting for one if none is queued.

        On cancellation nothing is lost: either ``Cancelled`` is raised and the message stays
        queued for the next call, or the message is returned (a message once taken off the
        socket is never dropped by a late cancel).  Always a checkpoint.

        Raises:
            trio.ClosedResourceError: the socket is closed, or was closed while waiting.
            trio.BusyResourceError: another task is already waiting on this socket.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        waited = False
        while True:
            self._check_open()
            try:
                data = self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                # The failed recv may have consumed the FD's edge; EVENTS is authoritative.
                if not self._events() & zmq.POLLIN:
                    await trio.lowlevel.wait_readable(self._fd)
                    waited = True
                continue
            if not waited:
                await trio.lowlevel.cancel_shielded_checkpoint()
            return data

    async def send(self, data: bytes | memoryview) -> None:
        """Send one message, waiting while the socket is at its high-water mark.

        On cancellation the message was either fully queued (the call returns) or not queued
        at all (``Cancelled`` is raised).  Always a checkpoint.

        Raises:
            trio.ClosedResourceError: the socket is closed, or was closed while waiting.
            trio.BusyResourceError: another task is already waiting on this socket.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        waited = False
        while True:
            self._check_open()
            try:
                self._sock.send(data, zmq.NOBLOCK)
            except zmq.Again:
                if not self._events() & zmq.POLLOUT:
                    await trio.lowlevel.wait_readable(self._fd)  # ZMQ_FD is read-signalled
                    waited = True
                continue
            if not waited:
                await trio.lowlevel.cancel_shielded_checkpoint()
            return

    # -- closing ------------------------------------------------------------------------

    def close(self, linger: int = 0) -> None:
        """Close the socket at once; idempotent and synchronous.

        A task waiting in :meth:`recv` or :meth:`send` wakes with
        :class:`trio.ClosedResourceError`.  Unsent messages are dropped (``linger=0``), so
        closing never waits for a peer.

        Args:
            linger: milliseconds to keep unsent messages (0: drop them; the default).
        """
        if self._closed:
            return
        self._closed = True
        try:
            trio.lowlevel.notify_closing(self._fd)
        except RuntimeError:
            pass  # not inside a Trio run: nobody can be waiting on the FD
        self._sock.close(linger=linger)

    def __enter__(self) -> TrioZmqSocket:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
