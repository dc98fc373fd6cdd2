"""The Mooncake tier against a real ``mooncake_master`` (and store processes), on loopback in a
private network namespace (see tests/mooncake_servers.py).

The real clock, and an absolute ``trio.fail_after`` on every test.  Faults are real: the
master is SIGKILLed mid-load and restarted on its port, or SIGSTOPped; a worker process that
holds the pool's memory exits; objects are removed behind the tier's back.
"""

from __future__ import annotations

import json
import selectors
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from lmprefetch import PrefetchConfig, open_engine
from lmprefetch.memory import Arena
from lmprefetch.tiers import mooncake as mooncake_module
from lmprefetch.tiers.mooncake import MooncakeTier, mooncake_key, open_mooncake_tier

from . import tier_io
from .checkpoints import quiesce_threads
from .mooncake_servers import (
    CALL_TIMEOUT_S,
    MooncakeMaster,
    MooncakeStore,
    mooncake_master_fixture,  # noqa: F401  (fixture "mooncake_master")
    needs_mooncake,
)
from .tier_io import checked_arena, failure_messages, load_all, make_keys, store_all

pytestmark = needs_mooncake

ROOT = Path(__file__).resolve().parent.parent
SLOT_BYTES = 64 * 1024
BACKOFF_S = 0.2
TEST_DEADLINE_S = 60


#: Payload sizes drawn by make_payloads (Mooncake stores no empty object).
make_payloads = partial(tier_io.make_payloads, sizes=(1, 1000, SLOT_BYTES))


@asynccontextmanager
async def tier_on(
    address: str, arena: Arena | None = None, **kwargs: Any
) -> AsyncIterator[MooncakeTier]:
    options: dict[str, Any] = {
        "timeout_s": CALL_TIMEOUT_S,
        "segment_bytes": 32 << 20,
        "backoff_initial_s": BACKOFF_S,
        "backoff_max_s": 1.0,
    }
    options.update(kwargs)
    async with open_mooncake_tier(address, arena=arena, **options) as tier:
        yield tier


async def connected(tier: MooncakeTier) -> MooncakeTier:
    """Wait until the tier has a client (setting one up may outlast the open on a busy
    machine; the tier's own task goes on trying)."""
    await tier.wait_connected()
    return tier


@pytest.fixture
def arena() -> Iterator[Arena]:
    with checked_arena(SLOT_BYTES, 96) as arena:
        yield arena


# -- round trips ----------------------------------------------------------------------------------
async def test_round_trip_exact_bytes(mooncake_master: MooncakeMaster, arena: Arena) -> None:
    keys = make_keys(40)
    payloads = make_payloads(40)
    with trio.fail_after(TEST_DEADLINE_S):
        async with tier_on(mooncake_master.address, arena) as tier:
            await connected(tier)
            assert tier.name == "mooncake"
            assert tier.contains_now(keys[0]) is None
            assert await tier.contains_prefix(keys, pin=False) == 0
            await store_all(tier, arena, keys, payloads)
            assert tier.stats.chunks_stored == 40
            assert tier.stats.bytes_stored == sum(map(len, payloads))
            assert await tier.contains_prefix(keys, pin=True) == 40
            assert tier.pinned_count() == 40
            tier.unpin(keys)
            # 40 keys: three batches of get-into (16 + 16 + 8)
            assert await load_all(tier, arena, keys) == payloads
            assert tier.stats.chunks_loaded == 40
            assert tier.stats.bytes_loaded == sum(map(len, payloads))
            assert tier.stats.errors == 0
            assert tier.stats.writes_dropped == 0


async def test_a_hole_ends_the_prefix(mooncake_master: MooncakeMaster, arena: Arena) -> None:
    keys = make_keys(8, seed=21)
    payloads = make_payloads(8, seed=22, size=500)
    with trio.fail_after(TEST_DEADLINE_S):
        async with tier_on(mooncake_master.address, arena) as tier:
            await connected(tier)
            # chunk 3 was never stored: 0, 1, 2, (hole), 4, ...
            await store_all(tier, arena, keys[:3] + keys[4:], payloads[:3] + payloads[4:])
            assert await tier.contains_prefix(keys, pin=True) == 3
            assert tier.pinned_count() == 3
            tier.unpin(keys[:3])
            assert await load_all(tier, arena, keys) == payloads[:3]
            assert await load_all(tier, arena, keys[4:]) == payloads[4:]
            assert await tier.contains_prefix(keys[3:], pin=False) == 0
            assert tier.stats.errors == 0  # a hole is a miss, not an error


async def test_a_value_larger_than_the_buffer_is_a_miss_that_stays(
    mooncake_master: MooncakeMaster, arena: Arena
) -> None:
    keys = make_keys(3, seed=31)
    payloads = make_payloads(3, seed=32, size=SLOT_BYTES)
    small = Arena(SLOT_BYTES // 2, 8)
    with trio.fail_after(TEST_DEADLINE_S):
        async with tier_on(mooncake_master.address, arena) as tier:
            await connected(tier)
            await store_all(tier, arena, keys, payloads)
            assert await load_all(tier, small, keys) == []  # an engine with smaller slots
            assert tier.stats.errors == 0
            assert await load_all(tier, arena, keys) == payloads  # still there for the others
    assert small.free_slots == small.num_slots
    small.close()


async def test_models_ranks_and_dtypes_do_not_collide(
    mooncake_master: MooncakeMaster, arena: Arena
) -> None:
    keys = make_keys(2, seed=41)
    others = [
        [k._replace(model_name="model-b") for k in keys],
        [k._replace(rank=1, world_size=2) for k in keys],
        [k._replace(kv_dtype="float16") for k in keys],
        [k._replace(layer=0) for k in keys],
    ]
    with trio.fail_after(TEST_DEADLINE_S):
        async with tier_on(mooncake_master.address, arena) as tier:
            await connected(tier)
            await store_all(tier, arena, keys, [b"a", b"b"])
            for other in others:
                assert await tier.contains_prefix(other, pin=False) == 0
            assert mooncake_key(keys[0]) == "lmprefetch:" + keys[0].to_string()


async def test_two_tiers_share_chunks(mooncake_master: MooncakeMaster) -> None:
    """Two clients with their own arenas (two engines): what one writes the other finds and
    loads byte for byte, from the writer's segment."""
    keys = make_keys(8, seed=11)
    payloads = make_payloads(8, seed=12, size=SLOT_BYTES - 3)
    arena_a, arena_b = Arena(SLOT_BYTES, 16), Arena(SLOT_BYTES, 16)
    with trio.fail_after(TEST_DEADLINE_S):
        async with (
            tier_on(mooncake_master.address, arena_a) as writer,
            tier_on(mooncake_master.address, arena_b, segment_bytes=0) as reader,
        ):
            await connected(writer)
            await connected(reader)
            assert await reader.contains_prefix(keys, pin=False) == 0
            await store_all(writer, arena_a, keys, payloads)
            assert await reader.contains_prefix(keys, pin=False) == 8
            assert await load_all(reader, arena_b, keys) == payloads
    for a in (arena_a, arena_b):
        assert a.free_slots == a.num_slots
        a.close()


async def test_http_metadata_server_instead_of_the_handshake() -> None:
    """The other metadata option the docs give: the master's built-in HTTP metadata server."""
    master = MooncakeMaster(lease_ttl_ms=1000, http_metadata=True).start()
    keys = make_keys(6, seed=131)
    payloads = make_payloads(6, seed=132, size=3000)
    arena_a, arena_b = Arena(SLOT_BYTES, 16), Arena(SLOT_BYTES, 16)
    try:
        with trio.fail_after(TEST_DEADLINE_S):
            meta = master.metadata_url
            async with (
                tier_on(master.address, arena_a, metadata_server=meta) as writer,
                tier_on(master.address, arena_b, metadata_server=meta, segment_bytes=0) as reader,
            ):
                await connected(writer)
                await connected(reader)
                await store_all(writer, arena_a, keys, payloads)
                assert await reader.contains_prefix(keys, pin=False) == 6
                assert await load_all(reader, arena_b, keys) == payloads
    finally:
        master.kill()
    for a in (arena_a, arena_b):
        assert a.free_slots == a.num_slots
        a.close()


# -- faults ---------------------------------------------------------------------------------------
class Gate:
    """Hold the tier's get-into calls (in their worker threads) from the ``hold_from``-th on,
    until :meth:`open`; counts the calls."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, hold_from: int = 1) -> None:
        self.calls = 0
        self.hold_from = hold_from
        self.reached = threading.Event()
        self._open = threading.Event()
        real = mooncake_module.calls.get_into

        def gated(*args: Any) -> list[int]:
            self.calls += 1
            if self.calls >= self.hold_from:
                self.reached.set()
                assert self._open.wait(TEST_DEADLINE_S), "the gate never opened"
            return real(*args)

        monkeypatch.setattr(mooncake_module.calls, "get_into", gated)

    async def wait_reached(self) -> None:
        assert await trio.to_thread.run_sync(self.reached.wait, TEST_DEADLINE_S)

    def open(self) -> None:
        self._open.set()


async def test_master_killed_mid_load_shortens_the_prefix_and_the_tier_recovers(
    mooncake_master: MooncakeMaster,
    arena: Arena,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """40 chunks load in three batches; the master dies while the second batch's thread is
    about to ask it where its objects are.  The load returns the first batch (16 chunks, the
    right bytes), counts the failure and backs off; the master restarts on its port, empty,
    and the same client stores and loads again (it mounts its segment again by itself)."""
    keys = make_keys(40, seed=101)
    payloads = make_payloads(40, seed=102, size=4000)
    with trio.fail_after(TEST_DEADLINE_S):
        async with tier_on(mooncake_master.address, arena) as tier:
            await connected(tier)
            await store_all(tier, arena, keys, payloads)
            assert await tier.contains_prefix(keys, pin=True) == 40
            gate = Gate(monkeypatch, hold_from=2)
            got: list[list[bytes]] = []
            async with trio.open_nursery() as nursery:

                async def load() -> None:
                    got.append(await load_all(tier, arena, keys))

                nursery.start_soon(load)
                try:
                    await gate.wait_reached()
                    await trio.to_thread.run_sync(mooncake_master.kill)
                    caplog.clear()
                    t0 = trio.current_time()
                finally:
                    gate.open()
            assert trio.current_time() - t0 < CALL_TIMEOUT_S  # refused: prompt
            tier.unpin(keys)
            assert got == [payloads[:16]]
            assert gate.calls == 2  # no batch after the failed one
            [failure] = failure_messages(caplog, "mooncake")
            assert "batch_get_into failed" in failure, failure
            assert tier.stats.errors == 1 and tier.backing_off
            # while backing off: answers at once, without a thread
            assert tier.contains_now(keys[0]) is False
            assert await tier.contains_prefix(keys, pin=True) == 0
            assert tier.pinned_count() == 0

            await trio.to_thread.run_sync(mooncake_master.start)  # same port, empty
            fresh = make_keys(4, seed=103)
            data = make_payloads(4, seed=104, size=300)
            # Recovery: once the backoff is over and the client has mounted its segment again
            # (Mooncake pings the master), stores land and load again.
            while tier.stats.chunks_stored < 40 + 4:
                await trio.sleep_until(tier.retry_at)
                await store_all(tier, arena, fresh, data)
            assert await tier.contains_prefix(fresh, pin=False) == 4
            assert await load_all(tier, arena, fresh) == data
            assert not tier.backing_off
            # The restarted master lost its index: what was stored before is gone.
            assert await tier.contains_prefix(keys, pin=False) == 0


async def test_stopped_master_costs_at_most_the_deadline(
    mooncake_master: MooncakeMaster, arena: Arena, caplog: pytest.LogCaptureFixture
) -> None:
    """A master that accepts connections but never answers (SIGSTOP): the probe is abandoned
    at the tier's deadline, the load's call (never abandoned) ends at Mooncake's RPC timeout,
    which the tier set from the same deadline; both with what they had, counted."""
    keys = make_keys(4, seed=61)
    payloads = make_payloads(4, seed=62, size=100)
    with trio.fail_after(TEST_DEADLINE_S):
        async with tier_on(mooncake_master.address, arena) as tier:
            await connected(tier)
            await store_all(tier, arena, keys, payloads)
            mooncake_master.pause()
            try:
                caplog.clear()
                t0 = trio.current_time()
                assert await tier.contains_prefix(keys, pin=True) == 0
                assert trio.current_time() - t0 < CALL_TIMEOUT_S + 1
                assert tier.pinned_count() == 0
                assert tier.backing_off
                await trio.sleep_until(tier.retry_at)
                t0 = trio.current_time()
                assert await load_all(tier, arena, keys) == []
                # Mooncake's RPC timeout (the tier's deadline), not its default of 30 s
                assert trio.current_time() - t0 < 2 * CALL_TIMEOUT_S
                assert tier.stats.errors == 2
                assert len(failure_messages(caplog, "mooncake")) == 2
            finally:
                mooncake_master.resume()
            # The master is back.  Mooncake's client may need a call or two to reconnect (it
            # dropped the connection that timed out): the tier gets there by itself, trying
            # again each time its backoff ends.
            while (got := await load_all(tier, arena, keys)) != payloads:
                assert got == []  # a failed load answers nothing, never other bytes
                await trio.sleep_until(tier.retry_at)
            assert not tier.backing_off
            await quiesce_threads(tier)  # the abandoned probe has ended too


async def test_master_down_at_start_does_not_fail_the_open(arena: Arena) -> None:
    """Nobody listens: the tier opens without a client (at most its connect deadline), answers
    misses and drops writes; once a master starts there, the tier's own task sets a client up
    and chunks flow."""
    master = MooncakeMaster()  # not started: its port is free
    keys = make_keys(3, seed=81)
    with trio.fail_after(TEST_DEADLINE_S):
        t0 = trio.current_time()
        async with tier_on(master.address, arena, timeout_s=1.0) as tier:
            assert trio.current_time() - t0 < 1.0 + mooncake_module.CONNECT_SLACK_S + 1
            assert not tier.connected
            assert tier.contains_now(keys[0]) is False
            assert await tier.contains_prefix(keys, pin=True) == 0
            assert await load_all(tier, arena, keys) == []
            assert await tier.remove(keys[0]) is False
            buf = arena.allocate()
            assert buf is not None
            try:
                buf.write(b"x")
                assert not await tier.store(keys[0], buf)
                assert buf.owners == 1
            finally:
                buf.release()
            assert tier.stats.writes_dropped == 1
            await trio.to_thread.run_sync(master.start)
            try:
                await tier.wait_connected()  # the tier's reconnecting task gets there
                await store_all(tier, arena, keys, [b"a", b"bb", b"ccc"])
                assert await load_all(tier, arena, keys) == [b"a", b"bb", b"ccc"]
            finally:
                await trio.to_thread.run_sync(master.stop)


async def test_a_cancelled_load_waits_for_its_batch_and_starts_no_other(
    mooncake_master: MooncakeMaster, arena: Arena, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The get-into thread writes into the buffers: a cancel waits for it (so the buffers are
    the caller's again when ``load`` raises) and no later batch starts."""
    keys = make_keys(40, seed=111)
    payloads = make_payloads(40, seed=112, size=2000)
    with trio.fail_after(TEST_DEADLINE_S):
        async with tier_on(mooncake_master.address, arena) as tier:
            await connected(tier)
            await store_all(tier, arena, keys, payloads)
            gate = Gate(monkeypatch)
            bufs = arena.allocate_many(40)
            ended = trio.Event()
            scope = trio.CancelScope()
            try:
                async with trio.open_nursery() as nursery:

                    async def load() -> None:
                        try:
                            with scope:
                                await tier.load(keys, bufs)
                        finally:
                            ended.set()

                    nursery.start_soon(load)
                    try:
                        await gate.wait_reached()
                        scope.cancel()
                        await trio.testing.wait_all_tasks_blocked()
                        assert not ended.is_set()  # held by its thread
                    finally:
                        gate.open()
                assert ended.is_set() and scope.cancelled_caught
                assert gate.calls == 1
                assert bytes(bufs[0].slot()[: len(payloads[0])]) == payloads[0]  # it finished
            finally:
                for buf in bufs:
                    buf.release()


async def test_remove_waits_for_a_readers_lease(
    arena: Arena, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A load leases its objects (3 s here): removing one right after waits for the lease
    instead of pulling the memory from under a reader."""
    master = MooncakeMaster(lease_ttl_ms=3000).start()
    codes: list[int] = []
    real = mooncake_module.calls.remove

    def recorded(*args: Any) -> int:
        codes.append(real(*args))
        return codes[-1]

    monkeypatch.setattr(mooncake_module.calls, "remove", recorded)
    keys = make_keys(2, seed=121)
    try:
        with trio.fail_after(TEST_DEADLINE_S):
            async with tier_on(master.address, arena) as tier:
                await connected(tier)
                await store_all(tier, arena, keys, [b"one", b"two"])
                assert await load_all(tier, arena, keys) == [b"one", b"two"]
                assert await tier.remove(keys[0]) is True
                assert codes[0] == -706 and codes[-1] == 0  # OBJECT_HAS_LEASE, then gone
                assert await tier.contains_prefix(keys, pin=False) == 0
                assert await tier.remove(keys[0]) is False
                assert await tier.contains(keys[1])
                assert tier.stats.errors == 0
    finally:
        master.kill()


# -- cross-process and the standalone-store deployment --------------------------------------------
CHUNK = 16
CHUNK_BYTES = 4096


class WorkerProcess:
    """``python -m tests.mooncake_worker``: one engine with the Mooncake tier in its own
    process, asked over its stdin and stdout."""

    def __init__(self, **fields: Any) -> None:
        config = {
            "chunk_size": CHUNK,
            "chunk_bytes": CHUNK_BYTES,
            "cpu_bytes": 256 * CHUNK_BYTES,
            "lookup_timeout_s": 60.0,
            "tier_timeout_s": 60.0,
            "mooncake_timeout_s": CALL_TIMEOUT_S,
            "arena_prefault_bytes": 0,
            **fields,
        }
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.mooncake_worker", json.dumps(config)],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.ready = self._read()

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            if not sel.select(TEST_DEADLINE_S):
                raise AssertionError("the worker did not answer in time")
        line = self.proc.stdout.readline()
        assert line, f"the worker exited (status {self.proc.wait(TEST_DEADLINE_S)})"
        answer: dict[str, Any] = json.loads(line)
        return answer

    def ask(self, cmd: str, **args: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"cmd": cmd, **args}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        """End of stdin: the engine closes (its Mooncake client with it), the process exits."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            assert self.proc.wait(TEST_DEADLINE_S) == 0
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            if self.proc.stdout is not None:
                self.proc.stdout.close()

    def __enter__(self) -> WorkerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def prompts(n: int, chunks: int, seed: int) -> list[list[int]]:
    return [[(seed << 32) + (i << 16) + j for j in range(chunks * CHUNK)] for i in range(n)]


def expected_chunks(tokens: list[int]) -> list[list[int]]:
    from lmprefetch.hashing import ChunkHasher

    from .mooncake_worker import digest, payload

    return [
        [h, CHUNK_BYTES, digest(payload(h, CHUNK_BYTES))] for h in ChunkHasher(CHUNK).hash(tokens)
    ]


def test_stored_by_one_process_hit_by_another_byte_exact(
    mooncake_master: MooncakeMaster,
) -> None:
    """Worker A stores (in its own segment); worker B, another process with no memory in
    the pool, finds every chunk, loads it from A's segment into its arena and holds A's bytes."""
    docs = prompts(3, 6, seed=1)
    with (
        WorkerProcess(
            mooncake_master=mooncake_master.address, mooncake_segment_bytes=16 << 20
        ) as a,
        WorkerProcess(mooncake_master=mooncake_master.address, mooncake_segment_bytes=0) as b,
    ):
        assert a.ask("store", prompts=docs) == {"stored": 18}
        for tokens in docs:
            answer = b.ask("lookup", tokens=tokens)
            assert answer["hit_tokens"] == len(tokens)
            assert answer["chunks"] == expected_chunks(tokens)
        # a prompt sharing the first chunks only: the hit stops where the other one starts
        mixed = docs[0][: 2 * CHUNK] + docs[1][2 * CHUNK :]
        assert b.ask("lookup", tokens=mixed)["hit_tokens"] == 2 * CHUNK
        stats = b.ask("stats")
        tier = stats["stats"]["tiers"]["mooncake"]
        assert tier["chunks_loaded"] == 18 + 2 and tier["errors"] == 0
        assert stats["idle"]


def test_standalone_store_a_worker_restart_loses_nothing(
    mooncake_master: MooncakeMaster,
) -> None:
    """The deployment the docs recommend: a standalone store process holds the pool and the
    serving workers contribute nothing.  A worker stores, stops (its client closes), and the
    restarted worker serves every chunk."""
    store = MooncakeStore(mooncake_master, segment_mib=32).start()
    try:
        docs = prompts(2, 5, seed=2)
        fields = {"mooncake_master": mooncake_master.address, "mooncake_segment_bytes": 0}
        with WorkerProcess(**fields) as first:
            assert first.ask("store", prompts=docs) == {"stored": 10}
        with WorkerProcess(**fields) as restarted:
            for tokens in docs:
                answer = restarted.ask("lookup", tokens=tokens)
                assert answer["hit_tokens"] == len(tokens)
                assert answer["chunks"] == expected_chunks(tokens)
    finally:
        store.stop()


def test_co_located_pool_a_worker_restart_takes_its_chunks(
    mooncake_master: MooncakeMaster,
) -> None:
    """Why the standalone store: when the only memory in the pool is a worker's own segment,
    the chunks in it go with the worker."""
    docs = prompts(1, 4, seed=3)
    fields = {"mooncake_master": mooncake_master.address, "mooncake_segment_bytes": 16 << 20}
    with WorkerProcess(**fields) as first:
        assert first.ask("store", prompts=docs) == {"stored": 4}
    with WorkerProcess(**fields) as restarted:
        assert restarted.ask("lookup", tokens=docs[0])["hit_tokens"] == 0


# -- through the engine ---------------------------------------------------------------------------
def engine_config(master: str, **fields: Any) -> PrefetchConfig:
    return PrefetchConfig(
        chunk_size=4,
        chunk_bytes=64,
        cpu_bytes=64 * 64,
        arena_prefault_bytes=0,
        mooncake_master=master,
        mooncake_segment_bytes=16 << 20,
        mooncake_timeout_s=CALL_TIMEOUT_S,
        **fields,
    )


async def test_engine_master_killed_mid_lookup_answers_the_shorter_prefix(
    mooncake_master: MooncakeMaster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the engine: the lookup loads from Mooncake (its CPU tier forgot the chunks);
    the master dies while the load's second batch is held; the lookup answers the first
    batch, within its deadline, the claim holds the right bytes, and nothing stays pinned,
    claimed or counted in the limiter."""
    config = engine_config(mooncake_master.address, lookup_timeout_s=30.0, tier_timeout_s=30.0)
    tokens = list(range(4 * 24))  # 24 chunks: batches of 16 and 8
    payloads = [bytes([i]) * (20 + i) for i in range(24)]
    with trio.fail_after(TEST_DEADLINE_S):
        async with open_engine(config) as engine:
            tier = next(t for t in engine.tiers if t.name == "mooncake")
            assert isinstance(tier, MooncakeTier)
            await connected(tier)
            assert await engine.store(tokens, payloads) == 24
            await engine.flush()
            hashes = engine.hasher.hash(tokens)
            for key in engine.keys.keys(hashes):
                engine.cpu.discard(key)
            gate = Gate(monkeypatch, hold_from=2)
            answer: list[int] = []
            async with trio.open_nursery() as nursery:

                async def lookup() -> None:
                    answer.append(await engine.lookup_and_prefetch("req", hashes, [4] * 24))

                nursery.start_soon(lookup)
                try:
                    await gate.wait_reached()
                    await trio.to_thread.run_sync(mooncake_master.kill)
                finally:
                    gate.open()
            assert answer == [16 * 4]
            with engine.claim("req") as claimed:
                assert [bytes(buf.view()) for _, buf in claimed] == payloads[:16]
            assert engine.is_idle()
            stats = engine.statistics().tier("mooncake")
            assert stats.chunks_loaded == 16 and stats.errors >= 1
            # later lookups answer promptly: at once while backing off, then refused by the
            # dead master
            t0 = trio.current_time()
            assert await engine.lookup_and_prefetch("again", hashes, [4] * 24) == 0
            assert trio.current_time() - t0 < CALL_TIMEOUT_S + 1
            assert engine.is_idle()


async def test_metrics_carry_the_mooncake_tier_label(mooncake_master: MooncakeMaster) -> None:
    from prometheus_client import generate_latest

    from lmprefetch.metrics import WorkerMetrics
    from lmprefetch.runtime import WorkerStatistics

    config = engine_config(mooncake_master.address)
    tokens = list(range(8))
    with trio.fail_after(TEST_DEADLINE_S):
        async with open_engine(config) as engine:
            await connected(next(t for t in engine.tiers if isinstance(t, MooncakeTier)))
            assert await engine.store(tokens, [b"x" * 10, b"y" * 20]) == 2
            await engine.flush()
            metrics = WorkerMetrics(
                lambda: WorkerStatistics(engine=engine.statistics(), server=None, publisher=None)
            )
            text = generate_latest(metrics.registry).decode()
    line = 'lmprefetch_tier_stored_bytes_total{rank="0",tier="mooncake",world_size="1"} 30.0'
    assert line in text, text
    assert 'lmprefetch_tier_errors_total{rank="0",tier="mooncake",world_size="1"} 0.0' in text


# -- the benchmark example runs -------------------------------------------------------------------
def test_bench_mooncake_example_runs(tmp_path: Path) -> None:
    out = tmp_path / "fig.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "bench_mooncake.py"), "--chunks", "4",
         "--chunk-bytes", "65536", "--repeat", "2", "--rounds", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=300, check=False, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "ratio engine / direct" in done.stdout, done.stdout
    fig = json.loads(out.read_text())
    assert fig["samples"] == 2 and fig["engine_gbps"] > 0 and fig["direct_gbps"] > 0
