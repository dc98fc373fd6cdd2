"""What the scheduler side knows, without asking, about the chunks its workers hold: the
answer behind ``may_load_async``.

vLLM 0.34 asks ``may_load_async(request)`` once, when the request enters its waiting queues,
right after ``on_new_request`` sent the request's lookup: the workers' answer cannot be there
yet.  A request for which the connector says True goes to vLLM's queue of asynchronous loads,
which vLLM serves while the running batch is full; a wrong True holds the other loads back.
So the scheduler side answers from what its workers *told* it: the chunks a recent lookup
found on every rank, and the chunks it had them save since.  A lookup that finds less takes
its chunks back out, so a wrong guess is made at most once per chunk.

Only the scheduler's thread touches this (``on_new_request``, ``may_load_async``,
``get_num_new_matched_tokens``, ``build_connector_meta``): no lock, no I/O, a dict look-up.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

__all__ = ["KnownChunks"]

#: Chunk hashes remembered (least recently told forgotten first): 8 bytes of key and about a
#: hundred of dict entry each, a few MiB at most.
DEFAULT_CAPACITY = 1 << 15


class KnownChunks:
    """A bounded set of chunk hashes the workers were last known to hold."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"capacity: must be at least 1, got {capacity}")
        self._capacity = capacity
        self._hashes: OrderedDict[int, None] = OrderedDict()

    def held(self, hashes: Iterable[int]) -> None:
        """The workers hold these chunks (a lookup found them, or they were saved)."""
        known = self._hashes
        for h in hashes:
            known[h] = None
            known.move_to_end(h)
        while len(known) > self._capacity:
            known.popitem(last=False)

    def gone(self, hashes: Iterable[int]) -> None:
        """A lookup did not find these chunks on every rank."""
        for h in hashes:
            self._hashes.pop(h, None)

    def __contains__(self, chunk_hash: object) -> bool:
        return chunk_hash in self._hashes

    def __len__(self) -> int:
        return len(self._hashes)
