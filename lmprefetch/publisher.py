"""The KV-event publisher of a standalone worker: a ZeroMQ PUB stream in vLLM's format.

:func:`publish_kv_events` binds an XPUB socket (a PUB socket that also hears subscriptions) and
runs one task that owns it, as every lmprefetch socket has exactly one owning task.  The task
sends what the engine's :class:`~lmprefetch.events.KVEventTracker` queues, as vLLM's publisher
does: one message per batch, three frames::

    [topic, seq, payload]

``topic`` is the configured topic (UTF-8; default empty), ``seq`` the batch's sequence number
(8 bytes, big-endian, from 0, +1 per batch: a gap means lost batches), and ``payload`` a
msgpack :class:`~lmprefetch.events.KVEventBatch` (``[ts, [event, ...]]``) that vLLM's own
``msgspec.msgpack.Decoder(KVEventBatch)`` decodes.

**Nothing is sent before the first subscriber.**  PUB sockets drop messages nobody subscribed to
yet, so a stream that starts with ``AllBlocksCleared`` and the disk tier's chunks would reach
nobody.  The task therefore waits until a subscription to its topic arrives (the XPUB socket
delivers it as a message) and only then starts sending; events queued meanwhile wait in the
tracker (bounded by ``kv_events_max_pending``).  A router that stays up while a worker restarts
reconnects by itself (ZeroMQ re-subscribes), so it hears the restarted worker's announcement.
A second subscriber joining later hears the stream from then on: there is no replay endpoint.

At the high-water mark (``socket_hwm``) a slow subscriber's batches are dropped by ZeroMQ, as
with vLLM's publisher; ``seq`` lets it notice.  Closing stops the task and closes the socket and
its own context; events still queued are not sent (a restarted worker starts with
``AllBlocksCleared``, so subscribers drop what the old one said).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import msgspec
import trio
import zmq

from ._stats import snapshot
from .events import KVEventBatch, KVEventTracker, encode_batch
from .transport import TrioZmqSocket, check_endpoint, close_context, make_xpub, open_context

__all__ = [
    "EventsEndpointError",
    "KVEventPublisher",
    "PublisherCounters",
    "PublisherStatistics",
    "publish_kv_events",
]

log = logging.getLogger("lmprefetch.publisher")

#: Events per published batch at most.
MAX_BATCH_EVENTS = 1024

FailureCallback = Callable[[BaseException], None]


class PublisherCounters(msgspec.Struct, gc=False):
    """What a publisher sent: batches and the events in them, and batches dropped (the
    socket would have blocked)."""

    batches_sent: int = 0
    events_sent: int = 0
    batches_dropped: int = 0


class PublisherStatistics(PublisherCounters, frozen=True, gc=False):  # type: ignore[misc]
    """A snapshot of a publisher's counters (see :class:`PublisherCounters`)."""


class EventsEndpointError(ValueError):
    """The events endpoint is malformed, or cannot be bound (e.g. it is in use)."""


class KVEventPublisher:
    """The running publisher; see :func:`publish_kv_events`."""

    def __init__(self, tracker: KVEventTracker, sock: TrioZmqSocket, topic: str) -> None:
        self.tracker = tracker
        self._sock = sock
        self.topic = topic
        self._topic = topic.encode("utf-8")
        #: Set once a subscriber to the topic arrived (sending starts then).
        self.subscribed = trio.Event()
        #: The live counters (read them; the publisher's task changes them).
        self.counters = PublisherCounters()

    @property
    def endpoint(self) -> str:
        """The bound endpoint (with the real port after binding ``tcp://…:0``)."""
        return str(self._sock.socket.getsockopt_string(zmq.LAST_ENDPOINT))

    def statistics(self) -> PublisherStatistics:
        """A snapshot of the publisher's counters."""
        return snapshot(PublisherStatistics, self.counters)

    async def _run(self) -> None:
        sock = self._sock
        while True:  # the gate: the first subscription that covers our topic
            frame = await sock.recv()
            if frame[:1] == b"\x01" and self._topic.startswith(frame[1:]):
                break
        self.subscribed.set()
        tracker, counters, topic = self.tracker, self.counters, self._topic
        seq = 0
        async for _ in tracker.changed.events(repeat_last=True):
            while True:
                events = tracker.take(MAX_BATCH_EVENTS)
                if not events:
                    break
                payload = encode_batch(KVEventBatch(ts=time.time(), events=events))
                try:
                    sock.send_multipart_nowait((topic, seq.to_bytes(8, "big"), payload))
                except trio.WouldBlock:  # a PUB socket drops instead; be safe anyway
                    counters.batches_dropped += 1
                else:
                    counters.batches_sent += 1
                    counters.events_sent += len(events)
                seq += 1
                await trio.lowlevel.checkpoint()
            # No checkpoint since the queue was seen empty: an event queued from here on sets
            # ``changed`` after this iteration began waiting, so it is never missed.


@asynccontextmanager
async def publish_kv_events(
    tracker: KVEventTracker,
    endpoint: str,
    *,
    topic: str = "",
    hwm: int = 10_000,
    on_failure: FailureCallback | None = None,
) -> AsyncIterator[KVEventPublisher]:
    """Publish ``tracker``'s events on ``endpoint`` until the block exits.

    Args:
        tracker: the engine's tracker (:attr:`~lmprefetch.prefetch.Engine.kv_events`).
        endpoint: bound here: ``tcp://127.0.0.1:PORT``, ``ipc:///path`` or ``ipc://@name``.
        topic: the first frame of every message (subscribers filter on it).
        hwm: the socket's high-water mark (batches per subscriber).
        on_failure: called (on the Trio thread) if the publishing task fails; the exception
            then also leaves this context manager.

    Raises:
        EventsEndpointError: ``endpoint`` is malformed or cannot be bound (in use, no such
            address); the message names it.
    """
    try:
        check_endpoint(endpoint)
    except ValueError as exc:
        raise EventsEndpointError(str(exc)) from None
    ctx = open_context()
    try:
        try:
            raw = make_xpub(ctx, endpoint, hwm=hwm)
        except zmq.ZMQError as exc:
            why = "already in use" if exc.errno == zmq.EADDRINUSE else f"cannot bind ({exc})"
            raise EventsEndpointError(f"events endpoint {endpoint}: {why}") from None
        with TrioZmqSocket(raw) as sock:
            publisher = KVEventPublisher(tracker, sock, topic)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_supervise, publisher, on_failure, name="kv-event-publisher")
                try:
                    yield publisher
                finally:
                    nursery.cancel_scope.cancel()
    finally:
        close_context(ctx)


async def _supervise(publisher: KVEventPublisher, on_failure: FailureCallback | None) -> None:
    try:
        await publisher._run()
    except Exception as exc:
        log.critical("KV event publisher failed; it stops", exc_info=True)
        if on_failure is not None:
            on_failure(exc)
        raise
