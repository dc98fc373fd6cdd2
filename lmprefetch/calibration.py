"""Measuring a tier in the background: chunks a lookup chose not to load, loaded anyway.

A policy that weighs loading against recomputing needs each tier's throughput, and a tier it
stops loading from would never be measured again.  So when a lookup drops hit chunks of a
tier whose throughput is unknown or older than ``tier_cost_max_age_s``, a few of them
(:data:`CALIBRATION_CHUNKS`) are loaded in the background, as a lookup's load is (same limiter,
same arena, the lookup's tenant), timed by the load itself, and released.  One measurement per
tier at a time; the engine's close cancels them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Final

import trio

from .lookup_parts import _Part
from .trace import CalibrationTrace, DecisionTrace

__all__ = ["CALIBRATION_CHUNKS", "Calibrations"]

#: Chunks a background measurement of a tier loads.
CALIBRATION_CHUNKS: Final = 2


class Calibrations:
    """The background measurements of one engine's tiers.

    Args:
        nursery: where the measurements run.
        load: loads a part into arena buffers under the limiter (``LookupIO._load_part``:
            part, no trace notes, tenant); its time measures the tier.
        kpc: keys per chunk.
        max_age_s: a throughput older than this is measured again.
        trace: where each measurement's record goes.
    """

    def __init__(
        self,
        *,
        nursery: trio.Nursery,
        load: Callable[[_Part, None, bytes], Awaitable[None]],
        kpc: int,
        max_age_s: float,
        trace: DecisionTrace,
    ) -> None:
        self._nursery = nursery
        self._load = load
        self._kpc = kpc
        self._max_age_s = max_age_s
        self._trace = trace
        #: The measurements in flight: their cancel scopes, by tier name.
        self._scopes: dict[str, trio.CancelScope] = {}
        self._done = trio.lowlevel.ParkingLot()
        self._closed = False

    def needed(self, part: _Part) -> bool:
        """Whether dropped chunks of ``part`` should measure its tier: not zero-copy, its
        throughput never measured or older than ``max_age_s``, and no measurement of it in
        flight."""
        if part.zero_copy or part.tier.name in self._scopes or self._closed:
            return False
        stats = part.tier.stats
        if stats.load_bytes_per_s_ewma is None:
            return True
        age = stats.throughput_age_s(trio.current_time())
        return age is not None and age > self._max_age_s

    def start_soon(self, part: _Part, tenant: bytes) -> None:
        """Start measuring ``part``'s tier by loading ``part`` (which owns its pins) in the
        background, as ``tenant`` (the lookup's: a sealed tier opens its chunks with that
        tenant's key); synchronous, so the task owns the part from here on."""
        scope = trio.CancelScope()
        self._scopes[part.tier.name] = scope
        self._nursery.start_soon(self._run, part, scope, tenant, name=f"calibrate:{part.tier.name}")

    async def _run(self, part: _Part, scope: trio.CancelScope, tenant: bytes) -> None:
        """Load ``part`` into arena buffers, as a lookup's load, then release everything."""
        tier = part.tier
        t0 = trio.current_time()
        try:
            with scope:
                await self._load(part, None, tenant)
        finally:
            loaded = part.loaded
            n_bytes = sum(len(buf.view()) for buf in part.buffers[: loaded * self._kpc])
            part.release_buffers()
            part.pins.release()
            del self._scopes[tier.name]
            self._done.unpark_all()
            if loaded:
                tier.stats.calibrations += 1
            if self._trace.enabled:
                seconds = trio.current_time() - t0
                self._trace.emit(
                    CalibrationTrace(
                        self._trace.rank, self._trace.wall() - seconds, tier.name, loaded,
                        n_bytes, seconds, tier.stats.load_bytes_per_s_ewma,
                    )
                )  # fmt: skip

    @property
    def in_flight(self) -> int:
        """Measurements in flight."""
        return len(self._scopes)

    async def wait(self) -> None:
        """Wait until no measurement is in flight (a checkpoint either way)."""
        if not self._scopes:
            await trio.lowlevel.checkpoint()
            return
        while self._scopes:
            await self._done.park()

    def close(self) -> None:
        """Cancel the measurements in flight; start no more."""
        self._closed = True
        for scope in self._scopes.values():
            scope.cancel()
