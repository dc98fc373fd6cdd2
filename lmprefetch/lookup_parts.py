"""A lookup's shares of its hit: the pins each probe took, and each tier's part.

:class:`~lmprefetch.lookup_io.LookupIO` owns these through a lookup's exit stack; each is
released exactly once, possibly in pieces (the policy keeps a prefix, a deadline cuts a load),
and every method here is synchronous, so no pin or buffer changes hands at a checkpoint.
"""

from __future__ import annotations

from collections.abc import Sequence

from .keys import ChunkKey
from .memory import Buffer
from .tiers.base import Tier

Pairs = list[tuple[ChunkKey, Buffer]]


class _Pins:
    """The pins one probe took on one tier; released exactly once, possibly in parts."""

    __slots__ = ("keys", "tier")

    def __init__(self, tier: Tier, keys: Sequence[ChunkKey]) -> None:
        self.tier = tier
        self.keys = list(keys)

    def release_from(self, index: int) -> None:
        tail, self.keys = self.keys[index:], self.keys[:index]
        if tail:
            self.tier.unpin(tail)

    def release(self) -> None:
        self.release_from(0)


class _Part:
    """One tier's share of a lookup: the ``n_chunks`` chunks after the earlier tiers' shares."""

    __slots__ = ("buffers", "keys", "loaded", "n_chunks", "pins", "probe_s", "tier", "zero_copy")

    def __init__(
        self,
        tier: Tier,
        keys: list[ChunkKey],
        n_chunks: int,
        pins: _Pins,
        zero_copy: bool,
        probe_s: float | None = None,
    ):
        self.tier = tier
        #: How long this lookup's probe of the tier took: the latency of its load's call.
        self.probe_s = probe_s
        self.keys = keys
        self.n_chunks = n_chunks
        self.pins = pins
        self.zero_copy = zero_copy
        self.buffers: list[Buffer] = []  # owned by this part until moved to the lookup
        self.loaded = 0  # whole chunks loaded contiguously from the part's first

    def release_buffers(self, start: int = 0) -> None:
        tail, self.buffers = self.buffers[start:], self.buffers[:start]
        for buf in tail:
            buf.release()

    def split_off(self, lo: int, hi: int, kpc: int) -> _Part:
        """Chunks ``[lo, hi)`` (not loaded yet) as a part of their own, which takes their pins
        over (synchronous: no pin is released or taken)."""
        keys = self.keys[lo * kpc : hi * kpc]
        taken = set(keys)
        self.pins.keys = [k for k in self.pins.keys if k not in taken]
        return _Part(self.tier, keys, hi - lo, _Pins(self.tier, keys), False, self.probe_s)

    def truncate(self, n_chunks: int, kpc: int) -> None:
        """Keep only the first ``n_chunks`` chunks: the rest's pins and buffers are released
        now (synchronous)."""
        self.n_chunks = n_chunks
        self.keys = self.keys[: n_chunks * kpc]
        self.pins.release_from(n_chunks * kpc)
        self.release_buffers(n_chunks * kpc)
        self.loaded = min(self.loaded, n_chunks)


def _release_pairs(pairs: Pairs) -> None:
    for _, buf in pairs:
        buf.release()
