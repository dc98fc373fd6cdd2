"""The remote tier against real ``redis-server`` processes: standalone and a 3-node cluster.

Localhost only, free ports, the real clock, and an absolute ``trio.fail_after`` on every test
that does I/O.  Faults are real: the server is SIGKILLed, SIGSTOPped (a server that accepts
connections but never answers), restarted on the same port, or its values are overwritten
behind the tier's back.
"""

from __future__ import annotations

import re
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path

import pytest
import trio

from lmprefetch.keys import ChunkKey
from lmprefetch.memory import Arena
from lmprefetch.tiers.redis import (
    HEADER_BYTES,
    RedisTier,
    decode_value,
    encode_value,
    open_redis_tier,
    redis_key,
)

from . import tier_io
from .redis_servers import (
    HAVE_REDIS,
    RedisCluster,
    RedisServer,
    free_port,
    raw_client,
    redis_cluster_fixture,  # noqa: F401  (fixture "redis_cluster")
    redis_cluster_module_fixture,  # noqa: F401  (fixture "redis_cluster_module")
    redis_server_fixture,  # noqa: F401  (fixture "redis_server")
)
from .tier_io import checked_arena, failure_messages, load_all, make_keys, store_all

pytestmark = [
    pytest.mark.redis,
    pytest.mark.skipif(not HAVE_REDIS, reason="redis-server / redis-cli not on PATH"),
]

SLOT_BYTES = 64 * 1024
TIMEOUT_S = 0.5  # per-call deadline in these tests
BACKOFF_S = 0.2
TEST_DEADLINE_S = 30
BENCH_SCRIPT = Path(__file__).resolve().parent.parent / "examples" / "bench_redis.py"


#: Payload sizes drawn by make_payloads (Redis stores an empty value too).
make_payloads = partial(tier_io.make_payloads, sizes=(0, 1, 1000, SLOT_BYTES))


@asynccontextmanager
async def tier_on(url: str, **kwargs: float) -> AsyncIterator[RedisTier]:
    options: dict[str, float] = {
        "timeout_s": TIMEOUT_S,
        "threads": 4,
        "write_queue": 256,
        "backoff_initial_s": BACKOFF_S,
        "backoff_max_s": 1.0,
    }
    options.update(kwargs)
    async with open_redis_tier(
        url,
        timeout_s=options["timeout_s"],
        threads=int(options["threads"]),
        write_queue=int(options["write_queue"]),
        backoff_initial_s=options["backoff_initial_s"],
        backoff_max_s=options["backoff_max_s"],
    ) as tier:
        yield tier


async def run_raw(url: str, *command: object) -> object:
    """One command on a plain client, off the Trio thread."""

    def call() -> object:
        with raw_client(url) as client:
            return client.execute_command(*command)

    return await trio.to_thread.run_sync(call)


@pytest.fixture
def arena() -> Iterator[Arena]:
    with checked_arena(SLOT_BYTES, 64) as arena:
        yield arena


@pytest.fixture(params=["standalone", "cluster"])
def redis_url(request: pytest.FixtureRequest) -> str:
    """The URL of a standalone server or of the module's 3-node cluster (emptied)."""
    if request.param == "standalone":
        server: RedisServer = request.getfixturevalue("redis_server")
        return server.url
    cluster: RedisCluster = request.getfixturevalue("redis_cluster")
    return cluster.url


# -- the value format -----------------------------------------------------------------------
def test_value_format_detects_damage() -> None:
    payload = b"kv-cache bytes" * 10
    value = encode_value(payload)
    assert len(value) == HEADER_BYTES + len(payload)
    decoded = decode_value(value)
    assert decoded is not None
    assert bytes(decoded) == payload
    flipped = bytearray(value)
    flipped[-1] ^= 1
    assert decode_value(bytes(flipped)) is None  # checksum
    assert decode_value(value[:-1]) is None  # length
    assert decode_value(b"XXXX" + value[4:]) is None  # magic
    assert decode_value(b"garbage") is None  # too short
    assert redis_key(make_keys(1)[0]).startswith(b"lmprefetch:model-a@1@0@")


def test_bad_url_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="redis://"):
        RedisTier("http://127.0.0.1:1")
    with pytest.raises(ValueError, match="redis"):
        RedisTier("redis://127.0.0.1:1,")


# -- round trips ----------------------------------------------------------------------------
async def test_round_trip_exact_bytes(redis_url: str, arena: Arena) -> None:
    keys = make_keys(24)
    payloads = make_payloads(24)
    with trio.fail_after(TEST_DEADLINE_S):
        async with tier_on(redis_url) as tier:
            assert tier.name == "redis"
            assert tier.contains_now(keys[0]) is None
            await store_all(tier, arena, keys, payloads)
            assert tier.stats.chunks_stored == 24
            assert tier.stats.bytes_stored == sum(map(len, payloads))
            assert await tier.contains_prefix(keys, pin=True) == 24
            assert tier.pinned_count() == 24
            tier.unpin(keys)
            assert tier.pinned_count() == 0
            assert await load_all(tier, arena, keys) == payloads
            assert tier.stats.chunks_loaded == 24
            assert tier.stats.errors == 0


async def test_a_chunk_redis_holds_is_not_sent_again(redis_url: str, arena: Arena) -> None:
    """A second engine storing chunks the first one stored (or a load policy's recomputed
    chunks) sends only those Redis does not hold: the link carries each chunk once."""
    keys = make_keys(10, seed=41)
    payloads = make_payloads(10, size=SLOT_BYTES)

    async def received() -> int:
        total = 0
        for url in redis_url.split(","):
            info = await run_raw(url, "INFO", "stats")
            assert isinstance(info, dict)
            total += int(info["total_net_input_bytes"])
        return total

    with trio.fail_after(TEST_DEADLINE_S):
        async with tier_on(redis_url) as first:
            await store_all(first, arena, keys[:8], payloads[:8])
            assert first.stats.chunks_stored == 8
            assert first.stats.writes_skipped == 0
        async with tier_on(redis_url) as second:
            before = await received()
            zeros = [bytes(len(p)) for p in payloads[:8]]
            await store_all(second, arena, keys, zeros + payloads[8:])
            sent = await received() - before
            assert second.stats.writes_skipped == 8
            assert second.stats.chunks_stored == 2
            assert second.stats.bytes_stored == 2 * SLOT_BYTES
            assert second.stats.writes_dropped == 0
            # The link carried the two new chunks and the keys, not the eight held ones.
            assert 2 * SLOT_BYTES < sent < 3 * SLOT_BYTES
            # Redis kept the first engine's values (the zeros were never sent) ...
            assert await load_all(second, arena, keys) == payloads
            # ... and a batch that is all held measures no write throughput.
            assert second.stats.store_bytes_per_s_ewma is not None
        async with tier_on(redis_url) as third:
            await store_all(third, arena, keys[:4], payloads[:4])
            assert third.stats.writes_skipped == 4
            assert third.stats.chunks_stored == 0
            assert third.stats.store_bytes_per_s_ewma is None


async def test_cluster_keys_spread_over_every_node(
    redis_cluster: RedisCluster, arena: Arena
) -> None:
    keys = make_keys(32, seed=3)
    payloads = make_payloads(32, size=100)
    with trio.fail_after(TEST_DEADLINE_S):
        async with tier_on(redis_cluster.url) as tier:
            assert tier.cluster
            await store_all(tier, arena, keys, payloads)
            for node in redis_cluster.nodes:  # every node holds some of one lookup's keys
                assert int(str(await run_raw(node.url, "DBSIZE"))) > 0
            assert await tier.contains_prefix(keys, pin=False) == 32
            assert await load_all(tier, arena, keys) == payloads


async def test_two_engines_share_chunks(redis_url: str) -> None:
    """Two tiers with their own arenas (two engines, empty CPU tiers, two machines): what one
    writes the other finds and loads byte for byte."""
    keys = make_keys(8, seed=11)
    payloads = make_payloads(8, seed=12, size=SLOT_BYTES - 3)
    arena_a, arena_b = Arena(SLOT_BYTES, 16), Arena(SLOT_BYTES, 16)
    with trio.fail_after(TEST_DEADLINE_S):
        async with tier_on(redis_url) as writer, tier_on(redis_url) as reader:
            assert await reader.contains_prefix(keys, pin=False) == 0
            await store_all(writer, arena_a, keys, payloads)
            assert await reader.contains_prefix(keys, pin=False) == 8
            assert await load_all(reader, arena_b, keys) == payloads
    assert arena_a.free_slots == arena_a.num_slots
    assert arena_b.free_slots == arena_b.num_slots
    arena_a.close()
    arena_b.close()


async def test_contains_prefix_stops_at_first_hole(redis_url: str, arena: Arena) -> None:
    keys = make_keys(6, seed=21)
    payloads = make_payloads(6, seed=22, size=500)
    with trio.fail_after(TEST_DEADLINE_S):
        async with tier_on(redis_url) as tier:
            # chunk 2 was never stored: 0, 1, (hole), 3, 4, 5
            await store_all(tier, arena, keys[:2] + keys[3:], payloads[:2] + payloads[3:])
            assert await tier.contains_prefix(keys, pin=True) == 2
            assert tier.pinned_count() == 2
            tier.unpin(keys[:2])
            assert await load_all(tier, arena, keys) == payloads[:2]
            assert await tier.contains_prefix(keys[3:], pin=False) == 3
            assert tier.pinned_count() == 0


async def test_d13_chunk_deleted_between_probe_and_load(redis_url: str, arena: Arena) -> None:
    """LMCache's Redis connector dropped missing values from a batch GET, pairing later values
    with the wrong keys.  The load must stop at the hole."""
    keys = make_keys(5, seed=31)
    payloads = make_payloads(5, seed=32, size=2000)
    with trio.fail_after(TEST_DEADLINE_S):
        async with tier_on(redis_url) as tier:
            await store_all(tier, arena, keys, payloads)
            assert await tier.contains_prefix(keys, pin=True) == 5
            assert await run_raw(redis_url, "DEL", redis_key(keys[2])) == 1
            bufs = arena.allocate_many(5)
            try:
                assert await tier.load(keys, bufs) == 2
                assert [bytes(b.view()) for b in bufs[:2]] == payloads[:2]
                assert all(b.length == 0 for b in bufs[2:])  # nothing later was written
            finally:
                for buf in bufs:
                    buf.release()
            tier.unpin(keys)
            assert tier.pinned_count() == 0


@pytest.mark.parametrize("damage", ["garbage", "flipped", "truncated", "foreign_magic"])
async def test_corrupt_value_is_a_miss_from_there(
    redis_url: str, arena: Arena, damage: str
) -> None:
    keys = make_keys(4, seed=41)
    payloads = make_payloads(4, seed=42, size=3000)
    good = encode_value(payloads[1])
    bad = {
        "garbage": b"not an lmprefetch value",
        "flipped": good[:-1] + bytes([good[-1] ^ 0xFF]),
        "truncated": good[:-10],
        "foreign_magic": b"LMP\x09" + good[4:],
    }[damage]
    with trio.fail_after(TEST_DEADLINE_S):
        async with tier_on(redis_url) as tier:
            await store_all(tier, arena, keys, payloads)
            await run_raw(redis_url, "SET", redis_key(keys[1]), bad)
            assert await load_all(tier, arena, keys) == payloads[:1]
            assert tier.stats.errors == 1
            assert not tier.backing_off  # bad data is not a sick server
            # the corrupt value was removed, so the probe now agrees with the load
            assert await tier.contains_prefix(keys, pin=False) == 1
            # and the next store of the chunk writes it again (Redis no longer holds it)
            await store_all(tier, arena, keys[1:2], payloads[1:2])
            assert tier.stats.writes_skipped == 0
            assert await load_all(tier, arena, keys) == payloads


async def test_value_larger_than_the_buffer_is_a_miss_but_stays(redis_server: RedisServer) -> None:
    keys = make_keys(3, seed=45)
    big = Arena(SLOT_BYTES, 4)
    small = Arena(SLOT_BYTES // 2, 4)
    payloads = [b"a" * 10, b"b" * SLOT_BYTES, b"c" * 10]
    with trio.fail_after(TEST_DEADLINE_S):
        async with tier_on(redis_server.url) as tier:
            await store_all(tier, big, keys, payloads)
            assert await load_all(tier, small, keys) == payloads[:1]
            assert tier.stats.errors == 0
            assert await load_all(tier, big, keys) == payloads  # still there for larger slots
    for a in (big, small):
        assert a.free_slots == a.num_slots
        a.close()


async def test_model_names_do_not_collide(redis_url: str, arena: Arena) -> None:
    hashes = [111, 222, 333]
    keys_a = [ChunkKey("org/model-a", 1, 0, h, "bfloat16") for h in hashes]
    keys_b = [ChunkKey("org/model-b", 1, 0, h, "bfloat16") for h in hashes]
    keys_rank1 = [ChunkKey("org/model-a", 2, 1, h, "bfloat16") for h in hashes]
    with trio.fail_after(TEST_DEADLINE_S):
        async with tier_on(redis_url) as tier:
            await store_all(tier, arena, keys_a, [b"A0", b"A1", b"A2"])
            await store_all(tier, arena, keys_b, [b"B0", b"B1", b"B2"])
            assert await load_all(tier, arena, keys_a) == [b"A0", b"A1", b"A2"]
            assert await load_all(tier, arena, keys_b) == [b"B0", b"B1", b"B2"]
            assert await tier.contains_prefix(keys_rank1, pin=False) == 0


# -- faults (D05) ---------------------------------------------------------------------------
async def test_d05_server_killed_answers_promptly_and_backs_off(
    redis_server: RedisServer, arena: Arena, caplog: pytest.LogCaptureFixture
) -> None:
    keys = make_keys(4, seed=51)
    payloads = make_payloads(4, seed=52, size=100)
    # The per-call deadline lies beyond the test's: only a prompt failure ends a call.
    with trio.fail_after(TEST_DEADLINE_S):
        async with tier_on(redis_server.url, timeout_s=2 * TEST_DEADLINE_S) as tier:
            await store_all(tier, arena, keys, payloads)
            assert await tier.contains_prefix(keys, pin=False) == 4
            redis_server.kill()

            caplog.clear()
            assert await load_all(tier, arena, keys) == []  # a failed load: nothing, no raise
            # Promptly: the refused connection ended the call.
            [failure] = failure_messages(caplog, "redis")
            assert "GET failed" in failure and "refused" in failure, failure
            assert tier.stats.errors == 1
            assert tier.backing_off

            # while backing off: an answer at once, no network call (it would fail and count)
            assert await tier.contains_prefix(keys, pin=True) == 0
            assert await load_all(tier, arena, keys) == []
            assert tier.stats.errors == 1
            assert tier.pinned_count() == 0

            # writes while backing off are dropped and counted, buffers untouched
            buf = arena.allocate()
            assert buf is not None
            try:
                buf.write(b"x")
                assert not tier.enqueue_write(keys[0], buf)
                assert buf.owners == 1
            finally:
                buf.release()
            assert tier.stats.writes_dropped == 1

            # after the backoff the tier tries again (still down: a longer backoff)
            await trio.sleep_until(tier.retry_at)
            assert await tier.contains_prefix(keys, pin=False) == 0
            assert tier.stats.errors == 2
            assert tier.retry_at - trio.current_time() > BACKOFF_S  # doubled


async def test_d05_stopped_server_times_out_within_the_deadline(
    redis_server: RedisServer, arena: Arena, caplog: pytest.LogCaptureFixture
) -> None:
    """A server that accepts connections but never answers (SIGSTOP): the probe and the load
    each give up at the per-call deadline with what they had.  Both bounds of a call (the
    Trio-side deadline, "no answer", and redis-py's socket timeout) are ``timeout_s``; the
    failure must be one of them, while the server is still stopped."""
    keys = make_keys(4, seed=61)
    payloads = make_payloads(4, seed=62, size=100)
    with trio.fail_after(TEST_DEADLINE_S):
        async with tier_on(redis_server.url) as tier:
            await store_all(tier, arena, keys, payloads)
            redis_server.pause()
            try:
                caplog.clear()
                assert await tier.contains_prefix(keys, pin=True) == 0
                assert tier.pinned_count() == 0
                assert tier.backing_off
                await trio.sleep_until(tier.retry_at)
                assert await load_all(tier, arena, keys) == []
                assert tier.stats.errors == 2
                failures = failure_messages(caplog, "redis")
                assert len(failures) == 2, failures
                for failure, call in zip(failures, ("EXISTS", "GET"), strict=True):
                    assert f"{call} failed" in failure, failure
                    assert re.search(r"no answer|[Tt]imeout|timed out", failure), failure
            finally:
                redis_server.resume()
            # the server is back: the first call after the backoff succeeds and resets it
            await trio.sleep_until(tier.retry_at)
            assert await load_all(tier, arena, keys) == payloads
            assert not tier.backing_off


async def test_d05_restarted_server_recovers_after_backoff(
    redis_server: RedisServer, arena: Arena
) -> None:
    keys = make_keys(4, seed=71)
    payloads = make_payloads(4, seed=72, size=1000)
    with trio.fail_after(TEST_DEADLINE_S):
        async with tier_on(redis_server.url) as tier:
            await store_all(tier, arena, keys, payloads)
            redis_server.kill()
            assert await tier.contains_prefix(keys, pin=False) == 0
            assert tier.backing_off
            redis_server.start()  # same port, empty (nothing persisted)

            def seed() -> None:  # another engine wrote these meanwhile
                with raw_client(redis_server.url) as client:
                    for key, payload in zip(keys, payloads, strict=True):
                        client.set(redis_key(key), encode_value(payload))

            await trio.to_thread.run_sync(seed)
            # the server is up again: the first call after the backoff expires gets hits
            await trio.sleep_until(tier.retry_at)
            assert await tier.contains_prefix(keys, pin=False) == 4
            assert not tier.backing_off
            assert await load_all(tier, arena, keys) == payloads
            # and writes flow again
            await store_all(tier, arena, make_keys(2, seed=73), [b"new0", b"new1"])
            assert tier.stats.chunks_stored == 4 + 2


@pytest.mark.parametrize("nodes", [1, 3], ids=["standalone", "cluster"])
async def test_d05_server_down_at_start_does_not_fail_the_engine(arena: Arena, nodes: int) -> None:
    url = ",".join(f"redis://127.0.0.1:{free_port()}" for _ in range(nodes))  # nobody listens
    keys = make_keys(3, seed=81)
    with trio.fail_after(TEST_DEADLINE_S):
        async with tier_on(url) as tier:
            assert tier.backing_off
            assert tier.stats.errors == 1
            assert await tier.contains_prefix(keys, pin=True) == 0
            assert await load_all(tier, arena, keys) == []
            assert await tier.remove(keys[0]) is False
            buf = arena.allocate()
            assert buf is not None
            try:
                assert not await tier.store(keys[0], buf)
            finally:
                buf.release()
            await tier.flush()


async def test_d05_cluster_node_killed(tmp_path: Path, arena: Arena) -> None:
    """One of three cluster nodes dies: lookups answer promptly (a prefix, at most up to the
    first key on the dead node), nothing raises, nothing leaks."""
    cluster = RedisCluster(tmp_path / "cluster").start()
    try:
        keys = make_keys(12, seed=91)
        payloads = make_payloads(12, seed=92, size=256)
        with trio.fail_after(TEST_DEADLINE_S):
            async with tier_on(cluster.url) as tier:
                await store_all(tier, arena, keys, payloads)
                dead = cluster.nodes[1]

                def first_on_dead_node() -> int:
                    with raw_client(cluster.url) as client:
                        for i, key in enumerate(keys):
                            if client.get_node_from_key(redis_key(key)).port == dead.port:
                                return i
                    return len(keys)

                limit = await trio.to_thread.run_sync(first_on_dead_node)
                assert limit < len(keys)
                dead.kill()
                hits = await tier.contains_prefix(keys, pin=True)
                loaded = await load_all(tier, arena, keys)
                assert hits <= limit
                assert len(loaded) <= limit
                assert loaded == payloads[: len(loaded)]
                tier.unpin(keys[:hits])
                assert tier.pinned_count() == 0
                assert tier.stats.errors >= 1
    finally:
        cluster.stop()


# -- cancellation ---------------------------------------------------------------------------
async def test_cancelled_load_returns_at_once_and_never_writes_buffers(
    redis_server: RedisServer, arena: Arena
) -> None:
    keys = make_keys(3, seed=101)
    payloads = make_payloads(3, seed=102, size=100)
    # The per-call timeout lies beyond the test's deadline: a load that waited for its
    # fetch thread (blocked on the stopped server) instead of abandoning it would fail.
    with trio.fail_after(TEST_DEADLINE_S):
        async with tier_on(redis_server.url, timeout_s=2 * TEST_DEADLINE_S) as tier:
            await store_all(tier, arena, keys, payloads)
            bufs = arena.allocate_many(3)
            try:
                for buf in bufs:
                    buf.slot()[:] = b"\xab" * buf.capacity
                redis_server.pause()
                with trio.move_on_after(0.1) as scope:
                    await tier.load(keys, bufs)
                assert scope.cancelled_caught  # returned: the fetch thread was abandoned
                redis_server.resume()
                await tier.aclose()  # waits for the abandoned thread to end
                assert all(b.length == 0 for b in bufs)
                assert all(bytes(b.slot()) == b"\xab" * b.capacity for b in bufs)  # untouched
            finally:
                for buf in bufs:
                    buf.release()


async def test_cancelled_probe_pins_nothing(redis_server: RedisServer, arena: Arena) -> None:
    keys = make_keys(3, seed=111)
    with trio.fail_after(TEST_DEADLINE_S):
        async with tier_on(redis_server.url) as tier:
            await store_all(tier, arena, keys, [b"1", b"2", b"3"])
            with trio.CancelScope() as scope:
                scope.cancel()
                await tier.contains_prefix(keys, pin=True)
            assert scope.cancelled_caught
            assert tier.pinned_count() == 0


# -- write-behind ---------------------------------------------------------------------------
async def test_write_queue_full_drops_and_counts_never_blocks(
    redis_server: RedisServer, arena: Arena
) -> None:
    keys = make_keys(6, seed=121)
    with trio.fail_after(TEST_DEADLINE_S):
        async with tier_on(redis_server.url, write_queue=2) as tier:
            bufs = arena.allocate_many(6)
            try:
                for i, buf in enumerate(bufs):
                    buf.write(bytes([i]) * 10)
                # synchronous: the writer cannot run between these calls
                accepted = [
                    tier.enqueue_write(key, buf) for key, buf in zip(keys, bufs, strict=True)
                ]
                assert accepted == [True, True, False, False, False, False]
                assert tier.stats.writes_dropped == 4
                assert [b.owners for b in bufs] == [2, 2, 1, 1, 1, 1]
            finally:
                for buf in bufs:
                    buf.release()
            await tier.flush()
            assert tier.queued_writes == 0
            assert await tier.contains_prefix(keys, pin=False) == 2
            assert await load_all(tier, arena, keys) == [bytes([0]) * 10, bytes([1]) * 10]


async def test_close_flushes_queued_writes(redis_server: RedisServer, arena: Arena) -> None:
    keys = make_keys(10, seed=131)
    payloads = make_payloads(10, seed=132, size=SLOT_BYTES)
    with trio.fail_after(TEST_DEADLINE_S):
        async with tier_on(redis_server.url) as tier:
            for key, payload in zip(keys, payloads, strict=True):
                buf = arena.allocate()
                assert buf is not None
                buf.write(payload)
                assert tier.enqueue_write(key, buf)
                buf.release()
            assert arena.used_slots == 10  # the queue owns them now
        assert arena.free_slots == arena.num_slots
        async with tier_on(redis_server.url) as tier:
            assert await load_all(tier, arena, keys) == payloads


async def test_close_releases_writes_it_cannot_send(
    redis_server: RedisServer, arena: Arena
) -> None:
    """Writes queued to a server that stops answering: closing does not hang, every buffer
    reference comes back, the lost writes are counted."""
    keys = make_keys(8, seed=141)
    with trio.fail_after(TEST_DEADLINE_S):
        async with tier_on(redis_server.url) as tier:
            redis_server.pause()
            try:
                for key in keys:
                    buf = arena.allocate()
                    assert buf is not None
                    buf.write(b"payload")
                    tier.enqueue_write(key, buf)
                    buf.release()
                await tier.flush()  # bounded: the SET times out, the rest is dropped
                assert tier.stats.writes_dropped == 8
                assert tier.stats.errors == 1
            finally:
                redis_server.resume()
        assert tier.stats.chunks_stored == 0


async def test_contains_and_remove(redis_url: str, arena: Arena) -> None:
    keys = make_keys(2, seed=151)
    with trio.fail_after(TEST_DEADLINE_S):
        async with tier_on(redis_url) as tier:
            await store_all(tier, arena, keys, [b"x", b"y"])
            assert await tier.contains(keys[0]) is True
            assert await tier.remove(keys[0]) is True
            assert await tier.remove(keys[0]) is False
            assert await tier.contains(keys[0]) is False
            assert await tier.contains_prefix(keys, pin=False) == 0
            assert await tier.contains_prefix(keys[1:], pin=False) == 1


# -- the benchmark example runs ---------------------------------------------------------------
async def test_bench_redis_example_runs(tmp_path: Path) -> None:
    script = BENCH_SCRIPT
    with trio.fail_after(120):
        done = await trio.run_process(
            [sys.executable, str(script), "--chunks", "4", "--chunk-bytes", "65536",
             "--repeat", "3", "--rounds", "1", "--requests", "200", "--workdir", str(tmp_path)],
            capture_stdout=True,
            capture_stderr=True,
        )  # fmt: skip
    out = done.stdout.decode()
    assert "ratio" in out, out


# -- through the engine -----------------------------------------------------------------------
async def test_two_engines_share_the_remote_tier(redis_url: str) -> None:
    """Engine A stores; engine B (its own empty CPU tier: another machine) finds the prefix in
    Redis, prefetches it, and the claim holds A's bytes.  Nothing stays pinned or claimed."""
    from lmprefetch import PrefetchConfig, open_engine

    config = PrefetchConfig(
        chunk_size=4,
        chunk_bytes=64,
        cpu_bytes=64 * 32,
        redis_url=redis_url,
        redis_timeout_s=TIMEOUT_S,
    )
    tokens = list(range(16))  # 4 chunks
    payloads = [bytes([i]) * (10 + i) for i in range(4)]
    with trio.fail_after(TEST_DEADLINE_S):
        async with open_engine(config) as engine_a:
            assert await engine_a.store(tokens, payloads) == 4
            await engine_a.flush()
        async with open_engine(config) as engine_b:
            hashes = engine_b.hasher.hash(tokens)
            assert await engine_b.lookup_and_prefetch("req", hashes, [4] * 4) == 16
            with engine_b.claim("req") as claimed:
                assert [bytes(buf.view()) for _, buf in claimed] == payloads
            stats = engine_b.statistics()
            assert stats.pinned_chunks == 0
            assert stats.limiter.used == 0
