"""What several test files share: small prompts and payloads, the engine's conservation
invariant, an engine with extra tiers, an engine served on real sockets to a raw scheduler
peer, and the arena's resident bytes.

Test files import from here, never from each other (a test module imported by another would
have its tests collected twice under some invocations, and its fixtures leak into the other).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import trio
import zmq

from lmprefetch import Engine, PrefetchConfig, open_engine, serve_lookups
from lmprefetch.memory import Arena
from lmprefetch.protocol import LookupRequestMsg, LookupResponseMsg, decode_response, encode
from lmprefetch.server import LookupServer

from .fakes import FakeTier

CHUNK = 4  # tokens per chunk in small_config


def tokens(n_chunks: int, salt: int = 0) -> list[int]:
    return [salt * 100_000 + i for i in range(n_chunks * CHUNK)]


def payloads(n_chunks: int, salt: int = 0, size: int = 48) -> list[bytes]:
    return [bytes([(salt * 31 + i) % 251]) * size for i in range(n_chunks)]


def offsets(n: int) -> list[int]:
    return [CHUNK] * n


def layer_parts(data: list[bytes], kpc: int) -> list[bytes]:
    """Each chunk's payload cut into its ``kpc`` per-layer parts, in key order."""
    out = []
    for payload in data:
        part = len(payload) // kpc
        out.extend(payload[i * part : (i + 1) * part] for i in range(kpc))
    return out


#: The load-policy tests' chunks: tokens and payload bytes per chunk.
POLICY_CS = 64
POLICY_PAYLOAD = 64 * 1024


def policy_config(**changes: object) -> PrefetchConfig:
    """The load-policy tests' engine: 64-token, 64 KiB chunks, room for 64 of them."""
    base = PrefetchConfig(
        chunk_size=POLICY_CS,
        chunk_bytes=POLICY_PAYLOAD,
        cpu_bytes=POLICY_PAYLOAD * 64,
        arena_prefault_bytes=0,
        lookup_timeout_s=30.0,
        tier_timeout_s=10.0,
    )
    return base.replace(**changes)


def policy_prompt(n_chunks: int, salt: int) -> list[int]:
    return [salt * 1_000_000 + i for i in range(n_chunks * POLICY_CS)]


def policy_data(n_chunks: int, salt: int) -> list[bytes]:
    return [bytes([(salt + i) % 251]) * POLICY_PAYLOAD for i in range(n_chunks)]


def assert_conserved(engine: Engine, *, faults: bool = False) -> None:
    """The conservation invariant (nothing in flight or held, no pin, no limiter weight, no
    arena byte outside the CPU tier), and, unless the test injected ``faults``, no failed
    lookup and no tier error: a bug in lmprefetch must never pass as a miss."""
    s = engine.statistics()
    assert s.lookups.inflight == 0
    assert s.lookups.held == 0
    assert s.pinned_chunks == 0
    assert s.limiter.used == 0
    assert s.arena.used_bytes == s.cpu_resident_bytes
    for tier in engine.tiers:
        assert tier.pinned_count() == 0, tier.name
    if not faults:
        assert s.lookups.failed == 0, "a lookup failed: see the logged traceback"
        for name, tier_stats in s.tiers:
            assert tier_stats.errors == 0, f"tier {name} reported errors"


@asynccontextmanager
async def engine_with(config: PrefetchConfig, *extra: FakeTier) -> AsyncIterator[Engine]:
    async with open_engine(config, extra_tiers=extra) as engine:
        yield engine


async def put_in(tier: FakeTier, engine: Engine, toks: list[int], data: list[bytes]) -> list[int]:
    hashes = engine.hasher.hash(toks)
    for key, payload in zip(engine.keys.keys(hashes), data):
        tier.data[key] = payload
    return hashes


class Peer:
    """The scheduler's end: a PUSH to the worker and a bound PULL for answers (blocking pyzmq,
    used from Trio through short non-blocking polls in a worker thread)."""

    def __init__(self, request_ep: str, response_ep: str) -> None:
        self.ctx = zmq.Context()
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.linger = 0
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.linger = 0
        self.pull.bind(response_ep)
        self.push.connect(request_ep)

    def send(self, data: bytes) -> None:
        self.push.send(data)

    def request(self, lookup_id: str, hashes: list[int], **kw: Any) -> None:
        self.send(encode(LookupRequestMsg(lookup_id, hashes, [CHUNK] * len(hashes), **kw)))

    async def answer(self, timeout_s: float = 5.0) -> LookupResponseMsg:
        def recv() -> bytes:
            if not self.pull.poll(int(timeout_s * 1000)):
                raise TimeoutError("no answer")
            return self.pull.recv()

        return decode_response(await trio.to_thread.run_sync(recv))

    def close(self) -> None:
        self.push.close()
        self.pull.close()
        self.ctx.term()


@asynccontextmanager
async def served(
    config: PrefetchConfig, *extra: FakeTier, rank: int = 0, world_size: int = 1
) -> AsyncIterator[tuple[Engine, LookupServer, Peer]]:
    tag = uuid.uuid4().hex[:10]
    req, resp = f"ipc://@lmp-test-{tag}-req", f"ipc://@lmp-test-{tag}-resp"
    peer = Peer(req, resp)
    try:
        async with (
            open_engine(config, rank=rank, world_size=world_size, extra_tiers=extra) as engine,
            serve_lookups(engine, req, resp) as server,
        ):
            yield engine, server, peer
    finally:
        peer.close()


def resident_bytes(arena: Arena) -> int:
    """Bytes of the arena that are in memory now (``mincore``, page by page)."""
    import ctypes
    import ctypes.util
    import mmap

    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    pages = -(-arena.total_bytes // mmap.PAGESIZE)
    vec = ctypes.create_string_buffer(pages)
    view = arena._view
    address = ctypes.addressof(ctypes.c_char.from_buffer(view))
    assert libc.mincore(address, arena.total_bytes, vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec.raw) * mmap.PAGESIZE
