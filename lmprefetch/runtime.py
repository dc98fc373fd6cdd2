"""`WorkerRuntime`: the engine on its own Trio loop in a background thread, with a sync API.

A serving engine's worker code is synchronous (a model step calls ``start_load_kv`` and expects
it to return).  The runtime runs :func:`~lmprefetch.wiring.open_engine` (and, given endpoints,
:func:`~lmprefetch.server.serve_lookups`) on a Trio loop in a thread started with anyio's
``BlockingPortal`` on the trio backend; each sync method marshals one call into that loop.

Ownership across the thread boundary: :meth:`WorkerRuntime.claim` moves a held result out of the
engine (on the Trio thread) to the caller, whose thread releases every buffer when the ``with``
block exits (buffer releases are thread-safe).

Cancellation: :meth:`WorkerRuntime.close` cancels every lookup (each releases what it owns),
flushes pending disk and remote writes, and joins the thread.  A synchronous call that is
waiting on the loop (``store``, ``lookup_and_prefetch``) cannot be interrupted from its own
thread; it returns when the loop answers.
"""

from __future__ import annotations

import concurrent.futures
import logging
import sys
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import AbstractContextManager, asynccontextmanager, contextmanager
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar, overload

import trio
from anyio.abc import TaskStatus
from anyio.from_thread import BlockingPortal, start_blocking_portal

from .config import PrefetchConfig
from .events import ChunkBlocks, EventMode, KVEvent
from .keys import ChunkKey
from .memory import Buffer
from .prefetch import Engine
from .publisher import KVEventPublisher, publish_kv_events
from .server import LookupServer, serve_lookups
from .wiring import open_engine
from .worker_statistics import WorkerStatistics

if sys.version_info < (3, 11):  # pragma: no cover - exercised on 3.10 only
    from exceptiongroup import BaseExceptionGroup

if TYPE_CHECKING:
    from .metrics import MetricsServer, WorkerMetrics

__all__ = ["WorkerRuntime", "WorkerStatistics"]

T = TypeVar("T")

log = logging.getLogger("lmprefetch.runtime")


def _single(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The only leaf exception of ``group`` (nested groups of one), else the group itself."""
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


class WorkerRuntime:
    """One worker rank's engine (and lookup server) on a background Trio loop.

    Create it with :meth:`start`; every method is thread-safe.

    Failure is never silent: if the engine or the lookup server fails while running (a bug, a
    broken socket), the error is logged with its traceback, :attr:`failure` is set, the
    ``on_failure`` callback given to :meth:`start` is called, and every later method except
    :meth:`close` raises :class:`RuntimeError` naming the failure.
    """

    def __init__(self) -> None:  # use WorkerRuntime.start(...)
        self._portal_cm: AbstractContextManager[BlockingPortal] | None = None
        self._portal: BlockingPortal | None = None
        self._task: concurrent.futures.Future[None] | None = None
        self._stop: trio.Event | None = None
        self._engine: Engine | None = None
        self._server: LookupServer | None = None
        #: The KV-event publisher, when started with ``events_endpoint``.
        self.publisher: KVEventPublisher | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._closing = False
        self._on_failure: Callable[[BaseException], None] | None = None
        #: Why the engine or the lookup server stopped on its own, if it did.
        self.failure: BaseException | None = None
        self.config: PrefetchConfig | None = None
        self.metrics: WorkerMetrics | None = None  #: when serving metrics
        self.metrics_port: int | None = None
        self._metrics_server: MetricsServer | None = None

    @classmethod
    def start(
        cls,
        config: PrefetchConfig,
        *,
        rank: int = 0,
        world_size: int = 1,
        request_endpoint: str | None = None,
        response_endpoint: str | None = None,
        metrics_port: int | None = None,
        metrics_host: str = "127.0.0.1",
        on_failure: Callable[[BaseException], None] | None = None,
        kv_events: EventMode | None = None,
        events_endpoint: str | None = None,
        events_topic: str = "",
    ) -> WorkerRuntime:
        """Start the loop thread, open the engine, and serve lookups if endpoints are given.

        Args:
            config: the engine's settings.
            rank: this worker's rank (tensor × pipeline parallel).
            world_size: number of ranks.
            request_endpoint: where this worker binds its request PULL socket.
            response_endpoint: the scheduler's answer endpoint this worker connects to.
            metrics_port: serve Prometheus metrics on this port (0 = any free port).
            metrics_host: the address the metrics server binds (loopback by default; use
                ``0.0.0.0`` for a Prometheus on another host).
            on_failure: called once, from the runtime's thread, if the engine or the lookup
                server fails after start-up (the CLI worker exits non-zero on it).
            kv_events: the engine's KV-event mode (:data:`~lmprefetch.events.EventMode`);
                default ``"chunks"`` with ``events_endpoint``, else ``"off"``.  Events are
                read with :meth:`take_kv_events` or published on ``events_endpoint``.
            events_endpoint: publish KV events here (a bound ZeroMQ PUB socket; see
                :mod:`lmprefetch.publisher`).
            events_topic: the topic frame of every published message.

        Raises:
            ValueError: bad arguments or configuration (the thread is stopped again);
                :class:`~lmprefetch.publisher.EventsEndpointError` for an events endpoint that
                is malformed or in use.
            zmq.ZMQError: an endpoint cannot be bound or connected (e.g. already in use).
            OSError: the metrics port cannot be bound.
        """
        if (request_endpoint is None) != (response_endpoint is None):
            raise ValueError("request_endpoint and response_endpoint go together")
        mode: EventMode = kv_events or ("chunks" if events_endpoint is not None else "off")
        if events_endpoint is not None and (mode == "off" or not config.kv_events):
            raise ValueError(
                "kv_events: an events endpoint was given, but KV events are off "
                "(kv_events = false in the configuration)"
            )
        self = cls()
        self.config = config
        self._on_failure = on_failure
        self._portal_cm = start_blocking_portal(backend="trio")
        self._portal = self._portal_cm.__enter__()
        try:
            try:
                self._task, (self._engine, self._server, self.publisher) = (
                    self._portal.start_task(
                        self._main, config, rank, world_size, request_endpoint,
                        response_endpoint, mode, events_endpoint, events_topic,
                        name="lmprefetch-worker",
                    )
                )  # fmt: skip
            except BaseExceptionGroup as group:
                # Start-up errors come out of the engine's nursery wrapped in a group; the
                # caller wants the one error (a ValueError naming a setting, a bind error).
                raise _single(group) from None
            self._task.add_done_callback(self._task_done)
            if metrics_port is not None:
                from .metrics import start_metrics_server

                self._metrics_server = start_metrics_server(self, metrics_port, metrics_host)
                self.metrics = self._metrics_server.metrics
                self.metrics_port = self._metrics_server.port
        except BaseException as exc:
            if self._task is None and self._portal_cm is not None:
                # Start-up failed or was interrupted (KeyboardInterrupt in this thread) before
                # the engine was up.  Leave the portal with the exception, which cancels the
                # half-started task: a plain exit (as close() does) waits for the task, and
                # this one, once up, would serve until a stop that nobody can send.
                portal_cm, self._portal_cm, self._portal = self._portal_cm, None, None
                portal_cm.__exit__(type(exc), exc, exc.__traceback__)
            self.close()
            raise
        return self

    async def _main(
        self,
        config: PrefetchConfig,
        rank: int,
        world_size: int,
        request_endpoint: str | None,
        response_endpoint: str | None,
        kv_events: EventMode,
        events_endpoint: str | None,
        events_topic: str,
        *,
        task_status: TaskStatus[tuple[Engine, LookupServer | None, KVEventPublisher | None]],
    ) -> None:
        """The runtime's one task: the engine (and server, and publisher) live until
        :meth:`close`."""
        self._stop = trio.Event()
        async with (
            open_engine(config, rank=rank, world_size=world_size, kv_events=kv_events) as engine,
            self._publishing(engine, events_endpoint, events_topic) as publisher,
        ):
            if request_endpoint is None or response_endpoint is None:
                task_status.started((engine, None, publisher))
                await self._stop.wait()
                return
            async with serve_lookups(
                engine, request_endpoint, response_endpoint, on_failure=self._failed
            ) as server:
                task_status.started((engine, server, publisher))
                await self._stop.wait()

    @asynccontextmanager
    async def _publishing(
        self, engine: Engine, endpoint: str | None, topic: str
    ) -> AsyncIterator[KVEventPublisher | None]:
        if endpoint is None or engine.kv_events is None:
            yield None
            return
        async with publish_kv_events(
            engine.kv_events,
            endpoint,
            topic=topic,
            hwm=engine.config.socket_hwm,
            on_failure=self._failed,
        ) as publisher:
            yield publisher

    def _failed(self, exc: BaseException) -> None:
        with self._lock:
            if self.failure is not None or self._closing:
                return
            self.failure = exc
        log.critical("lmprefetch worker runtime failed: %r", exc)
        if self._on_failure is not None:
            self._on_failure(exc)

    def _task_done(self, task: concurrent.futures.Future[None]) -> None:
        # The task ends on its own only when something failed (close() sets _closing first).
        if self._closing:
            return
        exc = None if task.cancelled() else task.exception()
        self._failed(exc if exc is not None else RuntimeError("the engine stopped by itself"))

    # -- helpers ----------------------------------------------------------------------
    def _running(self) -> tuple[BlockingPortal, Engine]:
        if self.failure is not None:
            raise RuntimeError(f"the lmprefetch worker runtime failed: {self.failure!r}") from (
                self.failure
            )
        if self._closed or self._portal is None or self._engine is None:
            raise RuntimeError("WorkerRuntime is closed")
        return self._portal, self._engine

    @property
    def engine(self) -> Engine:
        """The engine (touch it only from its own loop, e.g. through :meth:`call`)."""
        return self._running()[1]

    @overload
    def call(self, func: Callable[..., Awaitable[T]], *args: object) -> T: ...

    @overload
    def call(self, func: Callable[..., T], *args: object) -> T: ...

    def call(self, func: Callable[..., Any], *args: object) -> Any:
        """Run ``func(*args)`` (sync or async) on the engine's loop and return its result."""
        portal, _ = self._running()
        return portal.call(func, *args)

    # -- the engine's API, synchronously ----------------------------------------------
    def store(
        self,
        token_ids: Sequence[int] | Any,
        payloads: Sequence[Any],
        *,
        salt: bytes | None = None,
    ) -> int:
        """Store chunk payloads (see :meth:`Engine.store`); returns chunks stored.  ``salt``
        stores them in a tenant's name space (:func:`~lmprefetch.hashing.tenant_salt`)."""
        portal, engine = self._running()
        return int(portal.call(partial(engine.store, token_ids, payloads, salt=salt)))

    def store_hashes(
        self,
        hashes: Sequence[int],
        payloads: Sequence[Any],
        *,
        blocks: Sequence[ChunkBlocks] | None = None,
        tenant: bytes = b"",
    ) -> int:
        """:meth:`store` with precomputed chunk hashes (``payloads[i]`` for ``hashes[i]``):
        for callers that store chunks from the middle of a prompt.  ``blocks[i]`` names chunk
        ``i`` in KV events; ``tenant`` is whom the chunks are sealed for, with encryption on
        (see :meth:`Engine.store_hashes`)."""
        portal, engine = self._running()
        store = partial(engine.store_hashes, hashes, payloads, blocks=blocks, tenant=tenant)
        return int(portal.call(store))

    def store_hashes_nowait(
        self,
        hashes: Sequence[int],
        payloads: Sequence[Any],
        *,
        blocks: Sequence[ChunkBlocks] | None = None,
        tenant: bytes = b"",
    ) -> concurrent.futures.Future[int]:
        """:meth:`store_hashes` without waiting; the payloads must stay unchanged until the
        future is done."""
        portal, engine = self._running()
        store = partial(engine.store_hashes, hashes, payloads, blocks=blocks, tenant=tenant)
        return portal.start_task_soon(store)

    def store_nowait(
        self,
        token_ids: Sequence[int] | Any,
        payloads: Sequence[Any],
        *,
        salt: bytes | None = None,
    ) -> concurrent.futures.Future[int]:
        """Schedule a store and return at once; the future gives the chunk count.

        The payloads must stay unchanged until the future is done.
        """
        portal, engine = self._running()
        return portal.start_task_soon(partial(engine.store, token_ids, payloads, salt=salt))

    def describe_chunks(self, hashes: Sequence[int], blocks: Sequence[ChunkBlocks]) -> None:
        """Name chunks for KV events (see :meth:`Engine.describe_chunks`)."""
        portal, engine = self._running()
        if engine.kv_events is not None:
            portal.call(engine.describe_chunks, hashes, blocks)

    def take_kv_events(self, max_events: int | None = None) -> list[KVEvent]:
        """The KV events the engine queued so far, oldest first (empty when events are off).

        Thread-safe and does not wait for the engine's loop (the events are handed over in a
        thread-safe queue)."""
        _, engine = self._running()
        return engine.take_kv_events(max_events)

    def lookup_and_prefetch(
        self,
        lookup_id: str,
        hashes: Sequence[int],
        offsets: Sequence[int],
        *,
        skip_chunks: int = 0,
        tenant: bytes = b"",
        load_policy: str = "",
    ) -> int:
        """Blocking :meth:`Engine.lookup_and_prefetch` (for in-process use without sockets)."""
        portal, engine = self._running()

        async def run() -> int:
            return await engine.lookup_and_prefetch(
                lookup_id,
                hashes,
                offsets,
                skip_chunks=skip_chunks,
                tenant=tenant,
                load_policy=load_policy,
            )

        return int(portal.call(run))

    @contextmanager
    def claim(self, lookup_id: str) -> Iterator[list[tuple[ChunkKey, Buffer]]]:
        """``with runtime.claim(id) as chunks:`` — the held ``(key, buffer)`` pairs; every
        buffer is released when the block exits.  Unknown, unanswered, cancelled or expired ids
        give an empty list.

        The pairs come in chunk order, starting at the first chunk after the skipped ones
        (``skip_chunks``), ``keys_per_chunk`` pairs per chunk (one per layer in layerwise
        mode), and cover a contiguous run of chunks."""
        portal, engine = self._running()
        items: list[tuple[ChunkKey, Buffer]] = portal.call(engine.take, lookup_id)
        try:
            yield items
        finally:
            for _, buf in items:
                buf.release()

    def cancel(self, lookup_id: str) -> None:
        """Cancel a lookup and release what it holds (idempotent)."""
        if self._closed:
            return
        portal, engine = self._running()
        portal.call(engine.cancel, lookup_id)

    def statistics(self) -> WorkerStatistics:
        """A snapshot of the engine's state and counters, the lookup server's (when serving)
        and the KV-event publisher's (when publishing), taken on the runtime's loop."""
        portal, _ = self._running()
        return portal.call(self._statistics)

    def _statistics(self) -> WorkerStatistics:
        assert self._engine is not None
        server, publisher = self._server, self.publisher
        return WorkerStatistics(
            engine=self._engine.statistics(),
            server=None if server is None else server.statistics(),
            publisher=None if publisher is None else publisher.statistics(),
        )

    def stats(self) -> dict[str, Any]:
        """:meth:`statistics` as a dict (see :meth:`WorkerStatistics.as_dict
        <lmprefetch.worker_statistics.WorkerStatistics.as_dict>`): the engine's, with the
        server's counters under ``"server"`` and the publisher's under ``"publisher"``."""
        return self.statistics().as_dict()

    def is_idle(self) -> bool:
        portal, engine = self._running()
        return bool(portal.call(engine.is_idle))

    def close(self) -> None:
        """Cancel every lookup, release everything, flush writes, stop and join the thread.

        Idempotent; safe to call from any thread except the runtime's own, also after a
        failure (which was reported when it happened and is not raised again here).
        """
        with self._lock:
            if self._closed:
                return
            self._closed = self._closing = True
        errors: list[BaseException] = []
        if self._metrics_server is not None:
            self._metrics_server.close()
            self._metrics_server = None
        portal, task, stop = self._portal, self._task, self._stop
        if portal is not None and task is not None and stop is not None:
            if not task.done():
                try:
                    portal.call(stop.set)
                except Exception as exc:  # the loop is gone already: report below
                    errors.append(exc)
            try:
                task.result()
            except BaseException as exc:
                if exc is not self.failure:  # a failure is reported once, when it happens
                    errors.append(exc)
        if self._portal_cm is not None:
            try:
                self._portal_cm.__exit__(None, None, None)
            except Exception as exc:
                errors.append(exc)
        self._portal_cm = self._portal = self._task = self._stop = None
        self._server = self._engine = self.publisher = None
        if errors and self.failure is None:
            raise errors[0]

    def __enter__(self) -> WorkerRuntime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
