"""lmprefetch: asynchronous, cancellation-correct KV-cache lookup and prefetch, on Trio.

The public surface is re-exported here (the API reference lists it); everything else is an
implementation detail that may change between releases.

The names are imported on first use (PEP 562): ``import lmprefetch`` itself imports nothing
else, so that the ``lmprefetch`` command can take charge of Ctrl-C before the slow imports
(Trio, pyzmq, msgspec) begin.  ``from lmprefetch import LookupClient`` works as always.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .client import LookupClient as LookupClient
    from .client import LookupClientError as LookupClientError
    from .config import ConfigFileError as ConfigFileError
    from .config import PrefetchConfig as PrefetchConfig
    from .hashing import ChunkHasher as ChunkHasher
    from .keys import ChunkKey as ChunkKey
    from .limiter import WeightedCapacityLimiter as WeightedCapacityLimiter
    from .memory import Arena as Arena
    from .memory import Buffer as Buffer
    from .prefetch import Engine as Engine
    from .runtime import WorkerRuntime as WorkerRuntime
    from .server import serve_lookups as serve_lookups
    from .wiring import open_engine as open_engine

__version__ = "0.1.0"

#: Each public name and the module that defines it.
_MODULE_OF = {
    "Arena": "memory",
    "Buffer": "memory",
    "ChunkHasher": "hashing",
    "ChunkKey": "keys",
    "ConfigFileError": "config",
    "Engine": "prefetch",
    "LookupClient": "client",
    "LookupClientError": "client",
    "PrefetchConfig": "config",
    "WeightedCapacityLimiter": "limiter",
    "WorkerRuntime": "runtime",
    "open_engine": "wiring",
    "serve_lookups": "server",
}

__all__ = [
    "Arena",
    "Buffer",
    "ChunkHasher",
    "ChunkKey",
    "ConfigFileError",
    "Engine",
    "LookupClient",
    "LookupClientError",
    "PrefetchConfig",
    "WeightedCapacityLimiter",
    "WorkerRuntime",
    "open_engine",
    "serve_lookups",
]


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'lmprefetch' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # the next access is a plain attribute
    return value


def __dir__() -> list[str]:
    return [*__all__, "__version__"]
