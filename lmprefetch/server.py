"""The worker-side lookup server: requests in over ZeroMQ, one engine lookup each, answers out.

:func:`serve_lookups` binds a PULL socket for requests and cleanups and connects a PUSH socket to
the scheduler's answer endpoint.  One task receives (draining every queued message per wake-up);
each request becomes :meth:`Engine.start_lookup`, whose answer callback queues exactly one
:class:`~lmprefetch.protocol.LookupResponseMsg`; one task sends the queued answers.  So each
socket has exactly one task, as :class:`~lmprefetch.transport.TrioZmqSocket` requires.

* A cleanup cancels that lookup (only if it is not newer than the cleanup's ``seq``).
* A request for an id that is running cancels the older lookup (the id was reused); a request
  older than the running one (smaller ``seq``) is stale and dropped.
* A request past its ``deadline_ms`` is answered 0 at once (D16).
* Bytes that do not decode, and unknown messages, are counted and dropped; a request whose
  ``hashes`` and ``offsets`` disagree is answered 0 and counted as malformed.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import msgspec
import trio

from . import protocol
from .prefetch import Engine
from .transport import (
    TrioZmqSocket,
    check_endpoint,
    close_context,
    make_pull,
    make_push,
    open_context,
)

__all__ = ["LookupServer", "serve_lookups"]

log = logging.getLogger("lmprefetch.server")

_DRAIN_BATCH = 512


class LookupServer:
    """The running server; see :func:`serve_lookups`."""

    def __init__(self, engine: Engine, requests: TrioZmqSocket, answers: TrioZmqSocket) -> None:
        self.engine = engine
        self._requests = requests
        self._answers = answers
        self._outbox: deque[bytes] = deque()
        self._wake = trio.Event()
        self.counters: dict[str, int] = dict.fromkeys(
            (
                "requests_received",
                "cleanups_received",
                "answers_sent",
                "answers_dropped",
                "messages_malformed",
                "requests_stale",
            ),
            0,
        )

    def stats(self) -> dict[str, int]:
        out = dict(self.counters)
        out["answers_queued"] = len(self._outbox)
        return out

    # -- receiving --------------------------------------------------------------------
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
            self.counters["messages_malformed"] += 1
            log.debug("dropped a malformed message: %s", exc)
            return
        if isinstance(msg, protocol.LookupCleanupMsg):
            self.counters["cleanups_received"] += 1
            self.engine.cancel(msg.lookup_id, seq=msg.seq)
            return
        self.counters["requests_received"] += 1
        current = self.engine.current_seq(msg.lookup_id)
        if current is not None and msg.seq and msg.seq < current:
            self.counters["requests_stale"] += 1
            return
        lookup_id, seq, rank = msg.lookup_id, msg.seq, self.engine.rank

        def on_answer(hit_tokens: int) -> None:
            self._queue(
                protocol.encode(
                    protocol.LookupResponseMsg(lookup_id, hit_tokens, seq=seq, worker_id=rank)
                )
            )

        problem = protocol.validate_request(msg)
        if problem is not None:
            self.counters["messages_malformed"] += 1
            self.engine.counters["malformed_requests"] += 1
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
        )

    # -- sending ----------------------------------------------------------------------
    def _queue(self, data: bytes) -> None:
        # With nothing queued, send at once: no task switch on the answer's path.  The sender
        # task waits on the socket only while the outbox is non-empty, so this never races
        # it for the socket's edge-triggered FD.
        if not self._outbox:
            try:
                self._answers.send_nowait(data)
            except trio.WouldBlock:
                pass
            else:
                self.counters["answers_sent"] += 1
                return
        self._outbox.append(data)
        self._wake.set()

    async def _send_loop(self) -> None:
        sock = self._answers
        outbox = self._outbox
        while True:
            if not outbox:
                self._wake = trio.Event()
                await self._wake.wait()
                continue
            data = outbox.popleft()
            try:
                sock.send_nowait(data)
            except trio.WouldBlock:
                await sock.send(data)
            self.counters["answers_sent"] += 1


@asynccontextmanager
async def serve_lookups(
    engine: Engine,
    request_endpoint: str,
    response_endpoint: str,
    *,
    hwm: int | None = None,
) -> AsyncIterator[LookupServer]:
    """Serve lookups for ``engine`` until the block exits.

    Args:
        engine: the rank's engine (from :func:`~lmprefetch.prefetch.open_engine`).
        request_endpoint: bound by this worker; the scheduler's client connects to it.
        response_endpoint: the scheduler's answer endpoint; this worker connects to it.
        hwm: socket high-water mark (default: the engine config's ``socket_hwm``).

    On exit both tasks stop and the sockets and the server's own ZeroMQ context are closed;
    lookups already started keep running in the engine until it closes.
    """
    check_endpoint(request_endpoint)
    check_endpoint(response_endpoint)
    hwm = engine.config.socket_hwm if hwm is None else hwm
    ctx = open_context()
    sockets: list[TrioZmqSocket] = []
    try:
        requests = TrioZmqSocket(make_pull(ctx, request_endpoint, bind=True, hwm=hwm))
        sockets.append(requests)
        answers = TrioZmqSocket(make_push(ctx, response_endpoint, bind=False, hwm=hwm))
        sockets.append(answers)
        server = LookupServer(engine, requests, answers)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server._receive_loop, name="lookup-server-recv")
            nursery.start_soon(server._send_loop, name="lookup-server-send")
            try:
                yield server
            finally:
                nursery.cancel_scope.cancel()
    finally:
        for sock in sockets:
            sock.close()
        close_context(ctx)
