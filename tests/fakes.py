"""In-process tiers with programmable faults, for engine tests."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import trio

from lmprefetch.keys import ChunkKey
from lmprefetch.memory import Buffer
from lmprefetch.tiers.base import BaseTier


class FakeTier(BaseTier):
    """A dict-backed tier.  Knobs:

    * ``probe_error`` / ``load_error``: raise this from the probe / load.
    * ``probe_hang`` / ``load_hang``: block forever in the probe / load.
    * ``probe_gate``: a ``trio.Event`` each key's probe waits on (to hold a probe in flight);
      ``keys_probed`` counts the keys whose probe started.
    * ``load_gate``: a ``trio.Event`` each chunk read waits on (to hold a load in flight).
    * ``drop_before_load``: keys deleted after the probe, before the load reads them.
    * ``chunk_delay_s``: ``trio.sleep`` before each chunk (use with ``autojump_clock``).
    * ``on_load_done``: called synchronously just before ``load`` returns its count.
    """

    def __init__(self, name: str = "fake") -> None:
        super().__init__()
        self.name = name
        self.data: dict[ChunkKey, bytes] = {}
        self.probe_error: BaseException | None = None
        self.load_error: BaseException | None = None
        self.probe_hang = False
        self.load_hang = False
        self.load_gate: trio.Event | None = None
        self.probe_gate: trio.Event | None = None
        self.keys_probed = 0
        self.drop_before_load: set[ChunkKey] = set()
        self.chunk_delay_s = 0.0
        self.on_load_done: Callable[[], None] | None = None
        self.loads_started = 0
        self.chunks_read = 0
        self.max_concurrent_loads = 0
        self._loading = 0

    def contains_now(self, key: ChunkKey) -> bool | None:
        return None

    async def contains(self, key: ChunkKey) -> bool:
        self.keys_probed += 1
        await trio.lowlevel.checkpoint()
        if self.probe_gate is not None:
            await self.probe_gate.wait()
        if self.probe_error is not None:
            raise self.probe_error
        if self.probe_hang:
            await trio.sleep_forever()
        return key in self.data

    async def load(self, keys: Sequence[ChunkKey], buffers: Sequence[Buffer]) -> int:
        self.loads_started += 1
        self._loading += 1
        self.max_concurrent_loads = max(self.max_concurrent_loads, self._loading)
        try:
            await trio.lowlevel.checkpoint()
            if self.load_error is not None:
                raise self.load_error
            if self.load_hang:
                await trio.sleep_forever()
            for key in self.drop_before_load:
                self.data.pop(key, None)
            n = 0
            for key, buf in zip(keys, buffers):
                if self.load_gate is not None:
                    await self.load_gate.wait()
                if self.chunk_delay_s:
                    await trio.sleep(self.chunk_delay_s)
                payload = self.data.get(key)
                if payload is None:
                    break
                buf.write(payload)
                self.chunks_read += 1
                n += 1
            self.stats.chunks_loaded += n
            if self.on_load_done is not None:
                self.on_load_done()
            return n
        finally:
            self._loading -= 1

    async def store(self, key: ChunkKey, payload: Buffer) -> bool:
        await trio.lowlevel.checkpoint()
        self.data[key] = bytes(payload.view())
        return True

    def enqueue_write(self, key: ChunkKey, buf: Buffer) -> bool:
        self.data[key] = bytes(buf.view())
        return True

    async def flush(self) -> None:
        await trio.lowlevel.checkpoint()  # enqueue_write wrote at once: nothing is pending

    async def remove(self, key: ChunkKey) -> bool:
        await trio.lowlevel.checkpoint()
        return self.data.pop(key, None) is not None

    async def aclose(self) -> None:
        await trio.lowlevel.checkpoint()


class ThrottledTier(FakeTier):
    """A :class:`FakeTier` behind a slow link: every call (probe or load) pays ``rtt_s``,
    and payload bytes pass a token bucket of ``bytes_per_s`` shared by every load (loads
    queue on the link).  Time is Trio's, so under ``autojump_clock`` it costs nothing."""

    def __init__(self, name: str = "slow", *, bytes_per_s: float, rtt_s: float) -> None:
        super().__init__(name)
        self.bytes_per_s = bytes_per_s
        self.rtt_s = rtt_s
        self._link_free_at = 0.0

    async def contains_prefix(self, keys: Sequence[ChunkKey], *, pin: bool) -> int:
        await trio.sleep(self.rtt_s)
        return await super().contains_prefix(keys, pin=pin)

    async def load(self, keys: Sequence[ChunkKey], buffers: Sequence[Buffer]) -> int:
        await trio.sleep(self.rtt_s)
        n_bytes = sum(len(self.data.get(key, b"")) for key in keys)
        start = max(trio.current_time(), self._link_free_at)
        self._link_free_at = start + n_bytes / self.bytes_per_s
        await trio.sleep_until(self._link_free_at)
        return await super().load(keys, buffers)
