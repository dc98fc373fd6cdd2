"""Chunk keys: what a chunk is stored under, per rank (and per layer in layerwise mode).

A key is ``(model_name, world_size, rank, chunk_hash, kv_dtype, layer)``; ``layer`` is ``-1``
outside layerwise mode.  Keys are per rank: the same prompt chunk has a different key on every
tensor/pipeline-parallel rank, because every rank holds a different slice of the KV cache.  Every
tier uses the same key and the same string form (:meth:`ChunkKey.to_string`), which is safe as a
file name and as a Redis key.

Pure functions of their arguments: nothing here does I/O or awaits.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import TYPE_CHECKING, NamedTuple
from urllib.parse import quote, unquote

if TYPE_CHECKING:
    from .config import PrefetchConfig

__all__ = ["ChunkKey", "KeyMaker"]


@lru_cache(maxsize=64)
def _quoted(model_name: str) -> str:
    # A process serves a handful of model names; percent-encoding one is most of the cost of
    # a key string, which the disk tier builds for every chunk it reads.
    return quote(model_name, safe="")


class ChunkKey(NamedTuple):
    """The identity of one stored payload."""

    model_name: str
    world_size: int
    rank: int
    chunk_hash: int
    kv_dtype: str
    layer: int = -1

    def to_string(self) -> str:
        """``model@world_size@rank@hash16hex@dtype[@Llayer]``; ``/`` and ``%`` in the model
        name are percent-encoded so the string is a valid file name."""
        model = _quoted(self.model_name)
        base = f"{model}@{self.world_size}@{self.rank}@{self.chunk_hash:016x}@{self.kv_dtype}"
        return base if self.layer < 0 else f"{base}@L{self.layer}"

    @classmethod
    def from_string(cls, text: str) -> ChunkKey:
        """Parse :meth:`to_string`'s output.

        Raises:
            ValueError: ``text`` is not a key string.
        """
        parts = text.split("@")
        if len(parts) not in (5, 6):
            raise ValueError(f"not a chunk key: {text!r}")
        try:
            layer = -1
            if len(parts) == 6:
                if not parts[5].startswith("L"):
                    raise ValueError(text)
                layer = int(parts[5][1:])
            return cls(
                unquote(parts[0]), int(parts[1]), int(parts[2]), int(parts[3], 16), parts[4], layer
            )
        except ValueError:
            raise ValueError(f"not a chunk key: {text!r}") from None


class KeyMaker:
    """Builds one rank's keys from chunk hashes."""

    __slots__ = ("keys_per_chunk", "kv_dtype", "layerwise", "model_name", "rank", "world_size")

    def __init__(
        self,
        model_name: str,
        world_size: int,
        rank: int,
        kv_dtype: str,
        *,
        layerwise: bool = False,
        num_layers: int = 1,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank: must be in [0, world_size={world_size}), got {rank}")
        self.model_name = model_name
        self.world_size = world_size
        self.rank = rank
        self.kv_dtype = kv_dtype
        self.layerwise = layerwise
        self.keys_per_chunk = num_layers if layerwise else 1

    @classmethod
    def from_config(cls, config: PrefetchConfig, *, rank: int = 0, world_size: int = 1) -> KeyMaker:
        """Rank ``rank``'s key maker for ``config`` (``model_name``, ``kv_dtype``,
        ``layerwise``, ``num_layers``)."""
        return cls(
            config.model_name,
            world_size,
            rank,
            config.kv_dtype,
            layerwise=config.layerwise,
            num_layers=config.num_layers,
        )

    def first_key(self, chunk_hash: int) -> ChunkKey:
        """The first key of one chunk (layer 0 in layerwise mode)."""
        layer = 0 if self.layerwise else -1
        return ChunkKey(
            self.model_name, self.world_size, self.rank, chunk_hash, self.kv_dtype, layer
        )

    def keys(self, hashes: Sequence[int]) -> list[ChunkKey]:
        """Chunk-major keys: in layerwise mode ``keys_per_chunk`` consecutive keys per chunk."""
        m, w, r, d = self.model_name, self.world_size, self.rank, self.kv_dtype
        if not self.layerwise:
            return [ChunkKey(m, w, r, h, d) for h in hashes]
        n = self.keys_per_chunk
        return [ChunkKey(m, w, r, h, d, layer) for h in hashes for layer in range(n)]
