"""The Mooncake tier's own logic, on an in-process fake of Mooncake's client
(tests/mooncake_fake.py): runs everywhere, without Mooncake.

What a real master cannot be made to do on demand is injected here: every result code the
tier tells apart, a binding that raises, a setup that fails and then succeeds, a tier that
closes while a client is being set up.  The transfers are real memory copies at the addresses
the tier computes, allowed only inside registered memory.  (The behaviour against a real
master is tests/test_mooncake_tier.py.)
"""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from lmprefetch import PrefetchConfig, open_engine
from lmprefetch.keys import ChunkKey
from lmprefetch.memory import Arena
from lmprefetch.tiers import mooncake as mooncake_module
from lmprefetch.tiers import mooncake_store
from lmprefetch.tiers.mooncake import MooncakeTier, mooncake_key, open_mooncake_tier

from .mooncake_fake import (
    INVALID_PARAMS,
    LEASE_EXPIRED,
    NO_AVAILABLE_HANDLE,
    RPC_FAIL,
    FakePool,
)
from .tier_io import checked_arena, load_all, store_all

SLOT = 4096
DEADLINE_S = 30
ROOT = Path(__file__).resolve().parent.parent


def keys_of(n: int, seed: int = 0) -> list[ChunkKey]:
    return [ChunkKey("m", 1, 0, (seed << 32) + i, "bfloat16") for i in range(n)]


def data_of(n: int, seed: int = 0) -> list[bytes]:
    return [bytes([(seed + i) % 251]) * (100 + 37 * i) for i in range(n)]


@pytest.fixture
def arena() -> Iterator[Arena]:
    with checked_arena(SLOT, 64) as arena:
        yield arena


@asynccontextmanager
async def fake_tier(pool: FakePool, arena: Arena, **kwargs: Any) -> AsyncIterator[MooncakeTier]:
    options: dict[str, Any] = {"timeout_s": 5.0, "backoff_initial_s": 0.05, "backoff_max_s": 0.2}
    options.update(kwargs)
    with trio.fail_after(DEADLINE_S):
        async with open_mooncake_tier(
            "127.0.0.1:50051", arena=arena, store_factory=pool.factory(), **options
        ) as tier:
            await tier.wait_connected()
            yield tier


# -- zero copy ----------------------------------------------------------------------------------
async def test_transfers_go_to_the_registered_arena_and_it_is_registered_once(
    arena: Arena,
) -> None:
    pool = FakePool()
    keys, data = keys_of(20), data_of(20)
    other = Arena(SLOT, 4)
    try:
        async with fake_tier(pool, arena) as tier:
            [client] = pool.clients
            assert client.setup_args == (
                "127.0.0.1", "P2PHANDSHAKE", 0, 0, "tcp", "", "127.0.0.1:50051",
            )  # fmt: skip
            assert client.regions == {arena.address: arena.total_bytes}
            await store_all(tier, arena, keys, data)
            assert pool.objects == {mooncake_key(k): d for k, d in zip(keys, data)}
            for _ in range(3):
                assert await load_all(tier, arena, keys) == data
            assert client.registrations == 1
            # A buffer of another arena: registered on first use, once.
            assert await load_all(tier, other, keys[:4]) == data[:4]
            assert await load_all(tier, other, keys[4:8]) == data[4:8]
            assert client.registrations == 2
        assert client.closed
        assert client.regions == {}  # both unregistered before the arenas can go
    finally:
        other.close()


async def test_closing_unregisters_and_closes_the_client(arena: Arena) -> None:
    pool = FakePool()
    async with fake_tier(pool, arena):
        pass
    [client] = pool.clients
    assert client.closed
    assert client.regions == {}  # the arena was unregistered before the arena could go


# -- result codes -------------------------------------------------------------------------------
async def test_probe_error_code_ends_the_prefix_counts_and_backs_off(
    arena: Arena, caplog: pytest.LogCaptureFixture
) -> None:
    pool = FakePool()
    keys, data = keys_of(6), data_of(6)
    async with fake_tier(pool, arena) as tier:
        await store_all(tier, arena, keys, data)
        pool.exist_codes[mooncake_key(keys[2])] = -1
        with caplog.at_level(logging.WARNING):
            assert await tier.contains_prefix(keys, pin=True) == 2
        assert tier.pinned_count() == 2
        tier.unpin(keys[:2])
        assert tier.stats.errors == 1 and tier.backing_off
        assert any("batch_is_exist failed" in r.getMessage() for r in caplog.records)
        calls = len(pool.calls)
        assert await tier.contains_prefix(keys, pin=False) == 0  # no call while backing off
        assert len(pool.calls) == calls
        await trio.sleep_until(tier.retry_at)
        del pool.exist_codes[mooncake_key(keys[2])]
        assert await tier.contains_prefix(keys, pin=False) == 6
        assert not tier.backing_off


async def test_a_missing_key_is_a_hole_not_an_error(arena: Arena) -> None:
    pool = FakePool()
    keys, data = keys_of(5), data_of(5)
    async with fake_tier(pool, arena) as tier:
        await store_all(tier, arena, keys, data)
        del pool.objects[mooncake_key(keys[3])]  # evicted between probe and load
        assert await load_all(tier, arena, keys) == data[:3]
        assert await tier.contains_prefix(keys, pin=False) == 3
        assert tier.stats.errors == 0 and not tier.backing_off


@pytest.mark.parametrize(
    ("code", "is_error"),
    [(INVALID_PARAMS, False), (LEASE_EXPIRED, True), (RPC_FAIL, True), (-800, True)],
    ids=["larger-than-the-buffer", "lease-expired", "rpc-fail", "transfer-fail"],
)
async def test_a_failed_get_ends_the_load_there(arena: Arena, code: int, is_error: bool) -> None:
    pool = FakePool()
    keys, data = keys_of(20), data_of(20)
    async with fake_tier(pool, arena) as tier:
        await store_all(tier, arena, keys, data)
        pool.get_codes[mooncake_key(keys[17])] = code  # in the second batch
        assert await load_all(tier, arena, keys) == data[:17]
        assert tier.stats.chunks_loaded == 17
        assert tier.stats.bytes_loaded == sum(map(len, data[:17]))
        assert (tier.stats.errors == 1) is is_error
        assert tier.backing_off is is_error


async def test_a_binding_that_raises_is_a_failure_not_an_exception(arena: Arena) -> None:
    pool = FakePool()
    keys, data = keys_of(3), data_of(3)
    async with fake_tier(pool, arena) as tier:
        await store_all(tier, arena, keys, data)
        pool.raise_in.update({"batch_get_into", "batch_is_exist"})
        assert await load_all(tier, arena, keys) == []
        await trio.sleep_until(tier.retry_at)
        assert await tier.contains_prefix(keys, pin=True) == 0
        assert tier.stats.errors == 2 and tier.pinned_count() == 0


async def test_failed_puts_are_dropped_counted_and_back_off(arena: Arena) -> None:
    pool = FakePool()
    keys, data = keys_of(4), data_of(4)
    async with fake_tier(pool, arena) as tier:
        pool.put_codes[mooncake_key(keys[1])] = NO_AVAILABLE_HANDLE  # the pool is full
        await store_all(tier, arena, keys, data)
        assert tier.stats.chunks_stored == 3
        assert tier.stats.writes_dropped == 1
        assert tier.stats.errors == 1 and tier.backing_off
        buf = arena.allocate()
        assert buf is not None
        buf.write(b"x")
        assert not tier.enqueue_write(keys_of(1, seed=9)[0], buf)  # dropped while backing off
        assert buf.owners == 1
        buf.release()
        assert tier.stats.writes_dropped == 2


async def test_an_empty_payload_is_dropped(arena: Arena) -> None:
    pool = FakePool()
    keys = keys_of(2)
    async with fake_tier(pool, arena) as tier:
        await store_all(tier, arena, keys, [b"", b"x"])
        assert tier.stats.writes_dropped == 1 and tier.stats.chunks_stored == 1
        assert tier.stats.errors == 0


async def test_remove_waits_for_a_lease_then_gives_up(
    arena: Arena, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(mooncake_module, "REMOVE_LEASE_WAIT_S", 0.3)
    pool = FakePool()
    keys, data = keys_of(2), data_of(2)
    async with fake_tier(pool, arena) as tier:
        await store_all(tier, arena, keys, data)
        name = mooncake_key(keys[0])
        pool.leased.add(name)
        assert await tier.remove(keys[0]) is False  # still leased after the wait
        assert name in pool.objects
        assert pool.calls.count("remove") > 2
        pool.leased.clear()
        assert await tier.remove(keys[0]) is True
        assert await tier.remove(keys[0]) is False
        assert tier.stats.errors == 0


async def test_remove_drops_a_queued_write(arena: Arena) -> None:
    pool = FakePool()
    [key] = keys_of(1)
    async with fake_tier(pool, arena) as tier:
        buf = arena.allocate()
        assert buf is not None
        buf.write(b"abc")
        assert tier.enqueue_write(key, buf)
        buf.release()
        assert await tier.remove(key) is True  # it was queued
        await tier.flush()
        assert pool.objects == {}


# -- connecting ---------------------------------------------------------------------------------
async def test_a_failed_setup_backs_off_and_the_tier_connects_later(arena: Arena) -> None:
    pool = FakePool()
    pool.setup_codes = [-1, -1]
    keys, data = keys_of(2), data_of(2)
    with trio.fail_after(DEADLINE_S):
        async with open_mooncake_tier(
            "127.0.0.1:1", arena=arena, store_factory=pool.factory(),
            backoff_initial_s=0.05, backoff_max_s=0.1,
        ) as tier:  # fmt: skip
            assert not tier.connected  # the first setup failed
            assert tier.contains_now(keys[0]) is False
            assert tier.stats.errors >= 1
            await tier.wait_connected()  # the tier's own task tried again
            assert [c.closed for c in pool.clients] == [True, True, False]  # failed ones closed
            await store_all(tier, arena, keys, data)
            assert await load_all(tier, arena, keys) == data


async def test_a_setup_finishing_after_the_close_closes_its_client(arena: Arena) -> None:
    pool = FakePool()
    entered, release = threading.Event(), threading.Event()
    make = pool.factory()

    def slow_factory() -> Any:
        store = make()
        real_setup = store.setup

        def setup(*args: Any) -> int:
            entered.set()
            release.wait(DEADLINE_S)
            return real_setup(*args)

        store.setup = setup  # type: ignore[method-assign]
        return store

    with trio.fail_after(DEADLINE_S):
        async with open_mooncake_tier(
            "127.0.0.1:1", arena=arena, store_factory=slow_factory, timeout_s=0.05
        ) as tier:
            assert not tier.connected  # the open did not wait past its deadline
            assert await trio.to_thread.run_sync(entered.wait, DEADLINE_S)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(tier.aclose)  # it waits for the setup's thread
                await trio.testing.wait_all_tasks_blocked()
                release.set()
        [client] = pool.clients
        assert client.closed and not tier.connected


def test_timeouts_and_address_go_to_mooncake_only_where_the_environment_is_silent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import os

    for name in ("MC_RPC_TIMEOUT_MS", "MC_RPC_CONNECT_TIMEOUT_MS", "MC_TCP_PROGRESS_TIMEOUT_SEC",
                 "MC_TCP_STATUS_TIMEOUT_SEC", "MC_STORE_CLIENT_SETUP_RETRIES",
                 "MC_TCP_BIND_ADDRESS"):  # fmt: skip
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MC_TCP_PROGRESS_TIMEOUT_SEC", "9")
    mooncake_store.set_environment(1.5, "P2PHANDSHAKE", "10.0.0.7")
    assert "MC_TCP_BIND_ADDRESS" not in os.environ  # the handshake advertises local_hostname

    assert os.environ["MC_RPC_TIMEOUT_MS"] == "1500"
    assert os.environ["MC_RPC_CONNECT_TIMEOUT_MS"] == "1500"
    assert os.environ["MC_TCP_PROGRESS_TIMEOUT_SEC"] == "9"  # the operator's
    assert os.environ["MC_TCP_STATUS_TIMEOUT_SEC"] == "2"  # whole seconds, rounded up
    assert os.environ["MC_STORE_CLIENT_SETUP_RETRIES"] == "1"
    mooncake_store.set_environment(1.5, "http://h:1/metadata", "10.0.0.7")
    assert os.environ["MC_TCP_BIND_ADDRESS"] == "10.0.0.7"  # what a metadata server advertises


def test_bad_settings_are_value_errors() -> None:
    for master in ("nohost", "h:0", "h:99999", "a/b:1", " :1"):
        with pytest.raises(ValueError, match="host:port"):
            MooncakeTier(master)
    with pytest.raises(ValueError, match="timeout_s"):
        MooncakeTier("h:1", timeout_s=0)
    for segment in (-1, 1, (16 << 20) - 1):
        with pytest.raises(ValueError, match="segment_bytes"):
            MooncakeTier("h:1", segment_bytes=segment)
    MooncakeTier("h:1", segment_bytes=16 << 20)


# -- in the engine ------------------------------------------------------------------------------
async def test_the_engine_puts_the_tier_after_disk_and_shares_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two engines on one fake pool: CPU, disk, Mooncake in that order; what engine A stores
    engine B (empty CPU tier, its own disk) loads from Mooncake."""
    pool = FakePool()
    monkeypatch.setattr(mooncake_module.calls, "new_store", pool.factory())
    # The fake pool stands in for Mooncake's client: this runs where the extra is not installed.
    monkeypatch.setattr(mooncake_store, "check_installed", lambda: None)
    config = PrefetchConfig(
        chunk_size=4, chunk_bytes=64, cpu_bytes=64 * 32, arena_prefault_bytes=0,
        mooncake_master="127.0.0.1:50051", mooncake_segment_bytes=0,
        mooncake_metadata_server="http://127.0.0.1:8080/metadata",
        mooncake_local_hostname="10.1.2.3",
    )  # fmt: skip
    tokens = list(range(16))
    payloads = [bytes([i]) * (10 + i) for i in range(4)]
    with trio.fail_after(DEADLINE_S):
        async with open_engine(config.replace(disk_path=str(tmp_path / "a"))) as engine_a:
            assert [t.name for t in engine_a.tiers] == ["cpu", "disk", "mooncake"]
            tier = engine_a.tiers[-1]
            assert isinstance(tier, MooncakeTier)
            await tier.wait_connected()
            assert pool.clients[0].setup_args[:2] == ("10.1.2.3", "http://127.0.0.1:8080/metadata")
            assert pool.clients[0].regions == {engine_a.arena.address: engine_a.arena.total_bytes}
            assert await engine_a.store(tokens, payloads) == 4
            await engine_a.flush()
        async with open_engine(config.replace(disk_path=str(tmp_path / "b"))) as engine_b:
            tier = engine_b.tiers[-1]
            assert isinstance(tier, MooncakeTier)
            await tier.wait_connected()
            hashes = engine_b.hasher.hash(tokens)
            assert await engine_b.lookup_and_prefetch("r", hashes, [4] * 4) == 16
            with engine_b.claim("r") as claimed:
                assert [bytes(b.view()) for _, b in claimed] == payloads
            assert engine_b.statistics().tier("mooncake").chunks_loaded == 4
            assert engine_b.is_idle()


def test_mooncake_master_without_the_extra_is_one_line_naming_it(tmp_path: Path) -> None:
    """An install without Mooncake: the worker stops at start-up with one line, exit 2."""
    config = tmp_path / "c.toml"
    config.write_text('mooncake_master = "127.0.0.1:50051"\n')
    script = tmp_path / "no_mooncake.py"
    script.write_text(
        "import sys\n"
        "sys.modules['mooncake'] = None  # as if the mooncake extra were not installed\n"
        "sys.modules['mooncake.store'] = None\n"
        "from lmprefetch.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    out = subprocess.run(
        [sys.executable, str(script), "worker", "--config", str(config),
         "--request-endpoint", f"ipc://{tmp_path}/req", "--response-endpoint",
         f"ipc://{tmp_path}/resp"],
        capture_output=True, text=True, timeout=120, check=False, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert "mooncake_master" in lines[0] and "lmprefetch[mooncake]" in lines[0]


async def test_a_put_keeps_its_buffer_until_mooncake_has_read_it(
    arena: Arena, monkeypatch: pytest.MonkeyPatch
) -> None:
    """batch_put_from reads the arena in its thread: the queued write's reference keeps the
    slot out of the arena until that thread is done, even once the writer is cancelled."""
    pool = FakePool()
    [key] = keys_of(1)
    reached, opened = threading.Event(), threading.Event()
    real = mooncake_module.calls.put_from

    def gated(*args: Any) -> list[int]:
        reached.set()
        assert opened.wait(DEADLINE_S)
        return real(*args)

    monkeypatch.setattr(mooncake_module.calls, "put_from", gated)
    async with fake_tier(pool, arena) as tier:
        buf = arena.allocate()
        assert buf is not None
        buf.write(b"payload")
        assert tier.enqueue_write(key, buf)
        buf.release()  # the caller's reference: only the tier's is left
        assert await trio.to_thread.run_sync(reached.wait, DEADLINE_S)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(tier.aclose)  # cancels nothing: aclose waits for the writes
            await trio.testing.wait_all_tasks_blocked()
            assert arena.used_slots == 1  # still the put's
            opened.set()
        assert arena.used_slots == 0
        assert pool.objects == {mooncake_key(key): b"payload"}


async def test_a_cancelled_writer_waits_for_the_put_reading_its_buffers(
    arena: Arena, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool = FakePool()
    [key] = keys_of(1)
    reached, opened = threading.Event(), threading.Event()
    real = mooncake_module.calls.put_from

    def gated(*args: Any) -> list[int]:
        reached.set()
        assert opened.wait(DEADLINE_S)
        return real(*args)

    monkeypatch.setattr(mooncake_module.calls, "put_from", gated)
    tier = MooncakeTier("127.0.0.1:1", store_factory=pool.factory())
    tier.add_arena(arena)
    with trio.fail_after(DEADLINE_S):
        assert await tier.connect()
        ended = trio.Event()
        async with trio.open_nursery() as nursery:

            async def writer() -> None:
                try:
                    await tier.run_writer()
                finally:
                    ended.set()

            nursery.start_soon(writer)
            buf = arena.allocate()
            assert buf is not None
            buf.write(b"payload")
            assert tier.enqueue_write(key, buf)
            buf.release()
            assert await trio.to_thread.run_sync(reached.wait, DEADLINE_S)
            nursery.cancel_scope.cancel()
            with trio.CancelScope(shield=True):
                await trio.testing.wait_all_tasks_blocked()
                assert not ended.is_set()  # the writer waits for its thread
                assert arena.used_slots == 1
                opened.set()
        assert arena.used_slots == 0
        await tier.aclose()
