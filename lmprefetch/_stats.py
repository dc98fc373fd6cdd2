"""Statistics as trio does them: each component's counters declared once, one accessor.

A component declares its counters once, as a mutable msgspec ``Struct`` with a default of 0
for each (``LookupCounters``, ``ServerCounters``, ...); it keeps one instance and changes it in
place, where the counted thing happens.  Its snapshot (``LookupStatistics``, ...) is a frozen
``Struct`` that extends the counters with what is read from live state when the snapshot is
taken (the lookups in flight, the answers queued); :func:`snapshot` takes it, and the
component's ``statistics()`` is the one accessor.  Where the public contract keeps a dict
(``Engine.stats()``, ``WorkerRuntime.stats()``, ``LookupClient.stats()``), it is derived from
the snapshot, never kept beside it.

msgspec lets a frozen ``Struct`` extend a mutable one; mypy's dataclass rules do not know that,
hence the ``type: ignore[misc]`` on each snapshot class.
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

__all__ = ["as_dict", "snapshot"]

S = TypeVar("S", bound=msgspec.Struct)


def snapshot(cls: type[S], counters: object, **now: object) -> S:
    """A ``cls`` with the values of ``counters`` (the live counters whose fields ``cls``
    extends; any extra field of theirs is left out) and ``now`` (the fields read from live
    state)."""
    values = {name: getattr(counters, name) for name in cls.__struct_fields__ if name not in now}
    return cls(**values, **now)


def as_dict(statistics: msgspec.Struct) -> dict[str, Any]:
    """A snapshot's fields as a dict (one level: nested snapshots stay values)."""
    return msgspec.structs.asdict(statistics)
