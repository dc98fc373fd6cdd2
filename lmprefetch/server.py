"""The worker-side lookup server: requests in over ZeroMQ, one engine lookup each, answers out.

:func:`serve_lookups` binds a PULL socket for requests and cleanups and connects a PUSH socket to
the scheduler's answer endpoint.  Each socket has exactly one owning task, as
:class:`~lmprefetch.transport.TrioZmqSocket` requires (its FD's wake-ups are consumed by
whoever touches the socket, so a second user can swallow the owner's wake-up):

* the **receive task** owns the request socket.  It drains every queued frame per wake-up; each
  request becomes :meth:`Engine.start_lookup`, whose answer callback appends exactly one encoded
  :class:`~lmprefetch.protocol.LookupResponseMsg` to the outbox;
* the **send task** owns the answer socket.  It sends what the outbox holds, and at the
  socket's high-water mark, or while the answer connection is not up, waits on the socket
  (the outbox keeps growing meanwhile; nothing is dropped while the server runs).  A worker
  that started before its scheduler does not wait for libzmq's next
  reconnect: an answer that finds no connection retries it at once.

Message rules:

* A cleanup cancels that lookup (only if it is not newer than the cleanup's ``seq``).
* A request for an id that is running cancels the older lookup (the id was reused); a request
  older than the running one (smaller ``seq``) is stale and dropped.
* A request past its ``deadline_ms`` is answered 0 at once (D16).
* A frame that does not decode, for any reason (not msgpack, wrong shape, an integer out of its
  wire range, nesting deep enough to exhaust the decoder's recursion limit), is counted as
  malformed and dropped.  A request that decodes but makes no sense (see
  :func:`~lmprefetch.protocol.validate_request`) is answered 0 and counted as malformed.  So
  every *accepted* request (decoded, not stale) gets exactly one answer.

Failure: a frame can never stop the server.  If a task fails for any other reason (a bug, a
broken socket) the error is logged with its traceback, ``on_failure`` is called, and the
exception leaves :func:`serve_lookups` (trio's nursery rules): the server never lives on deaf.
:class:`~lmprefetch.runtime.WorkerRuntime` turns that into a failed runtime, and the
``lmprefetch worker`` command into a non-zero exit.

The ``Dnn`` codes are LMCache's defects, the rows of the defect table in
``docs/cancellation.md`` ("The defects"), each with its ``test_dNN_`` regression tests.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import msgspec
import trio
import zmq

from . import protocol
from ._stats import snapshot
from .prefetch import Engine
from .transport import (
    TrioZmqSocket,
    check_endpoint,
    close_context,
    make_pull,
    make_push,
    open_context,
)

__all__ = ["LookupServer", "ServerCounters", "ServerStatistics", "serve_lookups"]

log = logging.getLogger("lmprefetch.server")

_DRAIN_BATCH = 512

FailureCallback = Callable[[BaseException], None]


class ServerCounters(msgspec.Struct, gc=False):
    """What a lookup server received and sent (every count since it started)."""

    #: Decoded requests; those not stale (each gets exactly one answer); stale ones (older
    #: than the running lookup of their id), dropped.
    requests_received: int = 0
    requests_accepted: int = 0
    requests_stale: int = 0
    cleanups_received: int = 0
    #: Frames dropped as undecodable, plus requests answered 0 as nonsense.
    messages_malformed: int = 0
    answers_sent: int = 0
    #: Answers that met the high-water mark, or came while the scheduler's answer endpoint
    #: was not connected, and waited.
    answers_waited: int = 0
    #: Answers left unsent at shutdown.
    answers_dropped: int = 0


class ServerStatistics(ServerCounters, frozen=True, gc=False):  # type: ignore[misc]
    """A snapshot of a lookup server's counters (see :class:`ServerCounters`), and the
    answers waiting to be sent now."""

    answers_queued: int = 0


class LookupServer:
    """The running server; see :func:`serve_lookups`."""

    def __init__(
        self,
        engine: Engine,
        requests: TrioZmqSocket,
        answers: TrioZmqSocket,
        response_endpoint: str | None = None,
    ) -> None:
        self.engine = engine
        self._requests = requests
        self._answers = answers
        #: Where the answer socket connects (to retry at once; see :meth:`_connect_now`).
        self._response_endpoint = response_endpoint
        self._outbox: deque[bytes] = deque()
        # Where the send task waits for answers: Trio's own parking lot, the cheapest wake-up
        # between two tasks (~6 µs less per answer than trio-util's RepeatedEvent here).
        self._outbox_lot = trio.lowlevel.ParkingLot()
        #: The exception that stopped the server, if one did.
        self.failure: BaseException | None = None
        #: The live counters (read them; the server's tasks change them).
        self.counters = ServerCounters()

    def statistics(self) -> ServerStatistics:
        """A snapshot of the server's counters (see :class:`ServerStatistics`)."""
        return snapshot(ServerStatistics, self.counters, answers_queued=len(self._outbox))

    # -- receiving (the receive task owns the request socket) ---------------------------
    async def _receive_loop(self) -> None:
        sock = self._requests
        handle = self._handle
        while True:
            for data in await sock.recv_batch(_DRAIN_BATCH):
                handle(data)

    def _handle(self, data: bytes) -> None:
        try:
            msg = protocol.decode_worker_message(data)
        except msgspec.DecodeError as exc:
            self.counters.messages_malformed += 1
            log.debug("dropped a malformed message: %s", exc)
            return
        if isinstance(msg, protocol.LookupCleanupMsg):
            self.counters.cleanups_received += 1
            self.engine.cancel(msg.lookup_id, seq=msg.seq)
            return
        self.counters.requests_received += 1
        current = self.engine.current_seq(msg.lookup_id)
        if current is not None and msg.seq and msg.seq < current:
            self.counters.requests_stale += 1
            return
        self.counters.requests_accepted += 1
        lookup_id, seq, rank = msg.lookup_id, msg.seq, self.engine.rank
        outbox, lot = self._outbox, self._outbox_lot

        engine = self.engine

        def on_answer(hit_tokens: int) -> None:
            # Called exactly once per accepted request, on the Trio thread.  Every field was
            # range-checked on the way in, so the answer always encodes.  A positive answer's
            # record is held (the transition comes first): it says which tiers served it.
            sources = engine.lookup_tier_tokens(lookup_id) if hit_tokens else ()
            outbox.append(
                protocol.encode(
                    protocol.LookupResponseMsg(
                        lookup_id,
                        hit_tokens,
                        seq=seq,
                        worker_id=rank,
                        tier_tokens=list(sources) if sources else None,
                    )
                )
            )
            if lot:  # the send task is waiting for answers
                lot.unpark_all()

        problem = protocol.validate_request(msg)
        if problem is not None:
            self.counters.messages_malformed += 1
            self.engine.note_malformed_request()
            log.debug("malformed request %s: %s", lookup_id, problem)
            on_answer(0)
            return
        deadline: float | None = None
        if msg.deadline_ms:
            remaining_s = msg.deadline_ms / 1000.0 - time.time()
            deadline = trio.current_time() + remaining_s
        self.engine.start_lookup(
            lookup_id,
            msg.hashes,
            msg.offsets,
            on_answer=on_answer,
            seq=seq,
            deadline=deadline,
            skip_chunks=msg.skip_chunks,
            tenant=msg.tenant,
            load_policy=msg.load_policy,
        )

    # -- sending (the send task owns the answer socket) ---------------------------------
    async def _send_loop(self) -> None:
        sock = self._answers
        outbox = self._outbox
        counters = self.counters
        lot = self._outbox_lot
        # The answer socket queues nothing before a connection is complete (ZMQ_IMMEDIATE), so
        # a send that would block means: at the high-water mark, or not connected.  Until one
        # send has gone through, it can only be the latter (later, libzmq's own reconnect,
        # every IPC_RECONNECT_IVL_MS, covers a scheduler that restarts).
        connected = False
        while True:
            while outbox:
                data = outbox[0]
                try:
                    sock.send_nowait(data)
                except trio.WouldBlock:
                    # Wait on the socket (only this task touches it, so no wake-up can be
                    # taken from under it).
                    counters.answers_waited += 1
                    if not connected:
                        self._connect_now()
                    await sock.send(data)
                connected = True
                outbox.popleft()
                counters.answers_sent += 1
            # No checkpoint since the outbox was seen empty, so no answer can have been
            # appended unseen: the next one unparks this task.
            await lot.park()

    def _connect_now(self) -> None:
        """Retry the answer connection now instead of at libzmq's next reconnect (send task
        only).  There is an answer to send, so a scheduler sent a request: its answer endpoint
        is most likely bound by now, although this worker found nobody there before (it
        started first).  Nothing is lost: with ``ZMQ_IMMEDIATE``
        no message waits in a pipe that is not connected; the answers wait in the outbox."""
        endpoint = self._response_endpoint
        if endpoint is None:
            return
        raw = self._answers.socket
        try:
            raw.disconnect(endpoint)
        except zmq.ZMQError:  # not known under that name: leave libzmq's own retries alone
            return
        raw.connect(endpoint)

    async def _supervise(
        self, name: str, loop: Callable[[], Awaitable[None]], on_failure: FailureCallback | None
    ) -> None:
        try:
            await loop()
        except Exception as exc:
            self.failure = exc
            log.critical("lookup server: the %s task failed; the server stops", name, exc_info=True)
            if on_failure is not None:
                on_failure(exc)
            raise


@asynccontextmanager
async def serve_lookups(
    engine: Engine,
    request_endpoint: str,
    response_endpoint: str,
    *,
    hwm: int | None = None,
    on_failure: FailureCallback | None = None,
) -> AsyncIterator[LookupServer]:
    """Serve lookups for ``engine`` until the block exits.

    Args:
        engine: the rank's engine (from :func:`~lmprefetch.wiring.open_engine`).
        request_endpoint: bound by this worker; the scheduler's client connects to it.
        response_endpoint: the scheduler's answer endpoint; this worker connects to it.
        hwm: socket high-water mark (default: the engine config's ``socket_hwm``).
        on_failure: called (on the Trio thread) with the exception if a server task fails;
            the exception then also leaves this context manager.

    Raises:
        ValueError: an endpoint is malformed, or the request endpoint is already bound by
            someone else (the message names it).
        zmq.ZMQError: another socket error while binding or connecting.

    On exit both tasks stop and the sockets and the server's own ZeroMQ context are closed;
    answers still queued are dropped (and counted); lookups already started keep running in
    the engine until it closes.
    """
    check_endpoint(request_endpoint)
    check_endpoint(response_endpoint)
    hwm = engine.config.socket_hwm if hwm is None else hwm
    ctx = open_context()
    sockets: list[TrioZmqSocket] = []
    try:
        max_bytes = engine.config.max_message_bytes
        requests = TrioZmqSocket(
            make_pull(ctx, request_endpoint, bind=True, hwm=hwm, max_message_bytes=max_bytes)
        )
        sockets.append(requests)
        answers = TrioZmqSocket(
            make_push(ctx, response_endpoint, bind=False, hwm=hwm, immediate=True)
        )
        sockets.append(answers)
        server = LookupServer(engine, requests, answers, response_endpoint)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                server._supervise, "receive", server._receive_loop, on_failure,
                name="lookup-server-recv",
            )  # fmt: skip
            nursery.start_soon(
                server._supervise, "send", server._send_loop, on_failure,
                name="lookup-server-send",
            )  # fmt: skip
            try:
                yield server
            finally:
                nursery.cancel_scope.cancel()
                server.counters.answers_dropped += len(server._outbox)
                server._outbox.clear()
    finally:
        for sock in sockets:
            sock.close()
        close_context(ctx)
