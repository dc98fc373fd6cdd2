"""`WorkerRuntime`: the engine on its own Trio loop in a background thread, with a sync API.

A serving engine's worker code is synchronous (a model step calls ``start_load_kv`` and expects
it to return).  The runtime runs :func:`~lmprefetch.prefetch.open_engine` (and, given endpoints,
:func:`~lmprefetch.server.serve_lookups`) on a Trio loop in a thread started with anyio's
``BlockingPortal`` on the trio backend; each sync method marshals one call into that loop.

Ownership across the thread boundary: :meth:`WorkerRuntime.claim` moves a held result out of the
engine (on the Trio thread) to the caller, whose thread releases every buffer when the ``with``
block exits (buffer releases are thread-safe).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any

from anyio.from_thread import BlockingPortal, start_blocking_portal

from .config import PrefetchConfig
from .keys import ChunkKey
from .memory import Buffer
from .prefetch import Engine, open_engine

__all__ = ["WorkerRuntime"]

log = logging.getLogger("lmprefetch.runtime")


class WorkerRuntime:
    """One worker rank's engine (and lookup server) on a background Trio loop.

    Create it with :meth:`start`; every method is thread-safe.
    """

    def __init__(self) -> None:  # use WorkerRuntime.start(...)
        self._portal_cm: AbstractContextManager[BlockingPortal] | None = None
        self._portal: BlockingPortal | None = None
        self._engine_cm: AbstractContextManager[Engine] | None = None
        self._server_cm: AbstractContextManager[Any] | None = None
        self._engine: Engine | None = None
        self._server: Any = None
        self._lock = threading.Lock()
        self._closed = False
        self.config: PrefetchConfig | None = None
        self.metrics: Any = None  # WorkerMetrics, when serving metrics
        self.metrics_port: int | None = None
        self._metrics_server: Any = None

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
    ) -> WorkerRuntime:
        """Start the loop thread, open the engine, and serve lookups if endpoints are given.

        Args:
            config: the engine's settings.
            rank: this worker's rank (tensor × pipeline parallel).
            world_size: number of ranks.
            request_endpoint: where this worker binds its request PULL socket.
            response_endpoint: the scheduler's answer endpoint this worker connects to.
            metrics_port: serve Prometheus metrics on this port (0 = any free port).

        Raises:
            ValueError: bad arguments (the thread is stopped again).
        """
        if (request_endpoint is None) != (response_endpoint is None):
            raise ValueError("request_endpoint and response_endpoint go together")
        self = cls()
        self.config = config
        self._portal_cm = start_blocking_portal(backend="trio")
        self._portal = self._portal_cm.__enter__()
        try:
            self._engine_cm = self._portal.wrap_async_context_manager(
                open_engine(config, rank=rank, world_size=world_size)
            )
            self._engine = self._engine_cm.__enter__()
            if request_endpoint is not None and response_endpoint is not None:
                from .server import serve_lookups

                self._server_cm = self._portal.wrap_async_context_manager(
                    serve_lookups(self._engine, request_endpoint, response_endpoint)
                )
                self._server = self._server_cm.__enter__()
            if metrics_port is not None:
                from .metrics import start_metrics_server

                self.metrics_port = start_metrics_server(self, metrics_port)
        except BaseException:
            self.close()
            raise
        return self

    # -- helpers ----------------------------------------------------------------------
    def _running(self) -> tuple[BlockingPortal, Engine]:
        if self._closed or self._portal is None or self._engine is None:
            raise RuntimeError("WorkerRuntime is closed")
        return self._portal, self._engine

    @property
    def engine(self) -> Engine:
        """The engine (touch it only from its own loop, e.g. through :meth:`call`)."""
        return self._running()[1]

    def call(self, func: Any, *args: Any) -> Any:
        """Run ``func(*args)`` (sync or async) on the engine's loop and return its result."""
        portal, _ = self._running()
        return portal.call(func, *args)

    # -- the engine's API, synchronously ----------------------------------------------
    def store(self, token_ids: Sequence[int] | Any, payloads: Sequence[Any]) -> int:
        """Store chunk payloads (see :meth:`Engine.store`); returns chunks stored."""
        portal, engine = self._running()
        return int(portal.call(engine.store, token_ids, payloads))

    def store_hashes(self, hashes: Sequence[int], payloads: Sequence[Any]) -> int:
        """:meth:`store` with precomputed chunk hashes (``payloads[i]`` for ``hashes[i]``):
        for callers that store chunks from the middle of a prompt."""
        portal, engine = self._running()
        return int(portal.call(engine.store_hashes, hashes, payloads))

    def store_hashes_nowait(
        self, hashes: Sequence[int], payloads: Sequence[Any]
    ) -> concurrent.futures.Future[int]:
        """:meth:`store_hashes` without waiting; the payloads must stay unchanged until the
        future is done."""
        portal, engine = self._running()
        return portal.start_task_soon(engine.store_hashes, hashes, payloads)

    def store_nowait(
        self, token_ids: Sequence[int] | Any, payloads: Sequence[Any]
    ) -> concurrent.futures.Future[int]:
        """Schedule a store and return at once; the future gives the chunk count.

        The payloads must stay unchanged until the future is done.
        """
        portal, engine = self._running()
        return portal.start_task_soon(engine.store, token_ids, payloads)

    def lookup_and_prefetch(
        self,
        lookup_id: str,
        hashes: Sequence[int],
        offsets: Sequence[int],
        *,
        skip_chunks: int = 0,
    ) -> int:
        """Blocking :meth:`Engine.lookup_and_prefetch` (for in-process use without sockets)."""
        portal, engine = self._running()

        async def run() -> int:
            return await engine.lookup_and_prefetch(
                lookup_id, hashes, offsets, skip_chunks=skip_chunks
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

    def stats(self) -> dict[str, Any]:
        """The engine's stats (and the server's, when serving)."""
        portal, engine = self._running()
        out: dict[str, Any] = portal.call(engine.stats)
        if self._server is not None:
            out.update(portal.call(self._server.stats))
        return out

    def is_idle(self) -> bool:
        portal, engine = self._running()
        return bool(portal.call(engine.is_idle))

    def close(self) -> None:
        """Cancel every lookup, release everything, flush writes, stop and join the thread.

        Idempotent; safe to call from any thread except the runtime's own.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        errors: list[BaseException] = []
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
            self._metrics_server = None
        for cm in (self._server_cm, self._engine_cm, self._portal_cm):
            if cm is None:
                continue
            try:
                cm.__exit__(None, None, None)
            except Exception as exc:  # keep closing the rest, then re-raise
                errors.append(exc)
        self._server_cm = self._engine_cm = self._portal_cm = None
        self._server = self._engine = self._portal = None
        if errors:
            raise errors[0]

    def __enter__(self) -> WorkerRuntime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
