"""A worker's statistics: its engine's, its lookup server's and its KV-event publisher's.

:meth:`WorkerRuntime.statistics <lmprefetch.runtime.WorkerRuntime.statistics>` takes one, and
the Prometheus exporter (:mod:`lmprefetch.metrics`) reads one at every scrape; both import it
from here, so neither imports the other for it.
"""

from __future__ import annotations

from typing import Any

import msgspec

from ._stats import as_dict
from .prefetch import EngineStatistics
from .publisher import PublisherStatistics
from .server import ServerStatistics

__all__ = ["WorkerStatistics"]


class WorkerStatistics(msgspec.Struct, frozen=True, gc=False):
    """A worker's statistics: its engine's, its lookup server's (``None`` when it serves no
    lookups) and its KV-event publisher's (``None`` when it publishes none)."""

    engine: EngineStatistics
    server: ServerStatistics | None
    publisher: PublisherStatistics | None

    def as_dict(self) -> dict[str, Any]:
        """The engine's dict (:meth:`~lmprefetch.prefetch.EngineStatistics.as_dict`), with the
        server's counters under ``"server"`` and the publisher's under ``"publisher"``
        (``None`` when not serving or publishing)."""
        out = self.engine.as_dict()
        out["server"] = None if self.server is None else as_dict(self.server)
        out["publisher"] = None if self.publisher is None else as_dict(self.publisher)
        return out
