"""lmprefetch: asynchronous, cancellation-correct KV-cache lookup and prefetch, on Trio.

The public surface is re-exported here (the API reference lists it); everything else is an
implementation detail that may change between releases.
"""

from __future__ import annotations

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
