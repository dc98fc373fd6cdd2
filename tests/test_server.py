"""The worker-side lookup server, driven by a raw ZeroMQ peer playing the scheduler.

Real sockets (abstract ipc), real clock, an outer ``fail_after`` on every test.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
import trio
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmprefetch import Engine, PrefetchConfig, open_engine, serve_lookups, transport
from lmprefetch.prefetch import LookupState
from lmprefetch.protocol import (
    LookupCleanupMsg,
    LookupRequestMsg,
    encode,
)

from .fakes import FakeTier
from .helpers import CHUNK, Peer, served


async def poll_until(engine: Engine, predicate: Callable[[], bool]) -> None:
    """Wait for state that a message on a real socket changes, under the caller's
    ``fail_after`` deadline.  The engine has no event for "a message arrived", but the server
    hands every message to it (``start_lookup``, ``cancel``): the predicate is checked again
    after each such call, which the engine's methods are wrapped to signal."""
    changed: list[trio.Event] | None = getattr(engine.cancel, "changed", None)
    if changed is None:
        changed = []
        for name in ("start_lookup", "cancel"):
            method = getattr(engine, name)

            def signalling(*args: Any, _method: Any = method, **kwargs: Any) -> Any:
                try:
                    return _method(*args, **kwargs)
                finally:
                    for event in changed:
                        event.set()

            signalling.changed = changed  # type: ignore[attr-defined]
            setattr(engine, name, signalling)
    while not predicate():
        event = trio.Event()
        changed.append(event)
        try:
            await event.wait()
        finally:
            changed.remove(event)


@pytest.fixture
def config() -> PrefetchConfig:
    return PrefetchConfig(chunk_size=CHUNK, chunk_bytes=64, cpu_bytes=64 * 64)


async def test_request_gets_one_answer_with_seq_and_worker_id(config: PrefetchConfig) -> None:
    with trio.fail_after(10):
        async with served(config, rank=1, world_size=2) as (engine, server, peer):
            toks = list(range(12))
            await engine.store(toks, [b"x" * 8] * 3)
            peer.request("a", engine.hasher.hash(toks), seq=7)
            got = await peer.answer()
            assert (got.lookup_id, got.num_hit_tokens, got.seq, got.worker_id) == ("a", 12, 7, 1)
            peer.request("b", [1, 2], seq=8)
            got = await peer.answer()
            assert (got.lookup_id, got.num_hit_tokens) == ("b", 0)
            assert server.statistics().requests_received == 2


async def test_lmcache_shaped_request_is_served(config: PrefetchConfig) -> None:
    with trio.fail_after(10):
        async with served(config) as (engine, _, peer):
            toks = list(range(8))
            await engine.store(toks, [b"x" * 8] * 2)
            raw = msgspec.msgpack.encode(
                {
                    "type": "LookupRequestMsg",
                    "lookup_id": "lm",
                    "hashes": engine.hasher.hash(toks),
                    "offsets": [4, 4],
                    "request_configs": None,
                }
            )
            peer.send(raw)
            got = await peer.answer()
            assert (got.lookup_id, got.num_hit_tokens) == ("lm", 8)


async def test_d03_cleanup_cancels_and_releases_with_no_other_traffic(
    config: PrefetchConfig,
) -> None:
    with trio.fail_after(10):
        async with served(config) as (engine, _, peer):
            toks = list(range(16))
            await engine.store(toks, [b"x" * 8] * 4)
            peer.request("c", engine.hasher.hash(toks), seq=1)
            assert (await peer.answer()).num_hit_tokens == 16
            assert engine.statistics().lookups.held == 1
            peer.send(encode(LookupCleanupMsg("c", seq=1)))
            # The cleanup travels on the socket; no other message follows it.
            await poll_until(engine, lambda: engine.statistics().lookups.held == 0)
            assert engine.is_idle()


async def test_d06_newer_seq_cancels_older_and_stale_request_dropped(
    config: PrefetchConfig,
) -> None:
    disk = FakeTier("disk")
    disk.load_gate = trio.Event()
    with trio.fail_after(10):
        async with served(config, disk) as (engine, server, peer):
            hashes = engine.hasher.hash(list(range(12)))
            for key in engine.keys.keys(hashes):
                disk.data[key] = b"y" * 8
            other = list(range(100, 108))
            await engine.store(other, [b"o" * 8] * 2)
            peer.request("r", hashes, seq=1)  # blocks in the disk load
            await poll_until(engine, lambda: engine.statistics().lookups.inflight == 1)
            peer.request("r", engine.hasher.hash(other), seq=2)  # the id is reused
            answers = {}
            for _ in range(2):
                got = await peer.answer()
                answers[got.seq] = got.num_hit_tokens
            # The old lookup was cancelled (and still answered exactly once); the new one hit.
            assert answers == {1: 0, 2: 8}
            assert disk.chunks_read == 0
            peer.request("r", hashes, seq=1)  # stale: older than the held lookup
            peer.send(encode(LookupCleanupMsg("r", seq=2)))
            await poll_until(engine, lambda: engine.lookup_state("r") is None)
            assert server.statistics().requests_stale == 1


async def test_d16_past_deadline_answers_zero_at_once(config: PrefetchConfig) -> None:
    with trio.fail_after(10):
        async with served(config) as (engine, _, peer):
            toks = list(range(8))
            await engine.store(toks, [b"x" * 8] * 2)
            past_ms = int((time.time() - 1) * 1000)
            peer.request("late", engine.hasher.hash(toks), deadline_ms=past_ms)
            assert (await peer.answer()).num_hit_tokens == 0
            assert engine.statistics().lookups.deadline_expired == 1
            assert engine.statistics().lookups.held == 0


async def test_d16_worker_stops_at_the_request_deadline(config: PrefetchConfig) -> None:
    hung = FakeTier("hung")
    hung.load_hang = True
    cfg = config.replace(tier_timeout_s=60.0)
    with trio.fail_after(10):
        async with served(cfg, hung) as (engine, _, peer):
            hashes = engine.hasher.hash(list(range(8)))
            for key in engine.keys.keys(hashes):
                hung.data[key] = b"z" * 8
            peer.request("d", hashes, deadline_ms=int((time.time() + 0.2) * 1000))
            # The load hangs, and the tier's own timeout (60 s) lies beyond this test's
            # deadline (10 s): only the request's deadline can end the lookup.
            assert (await peer.answer()).num_hit_tokens == 0
            assert hung.loads_started == 1
            await engine.wait_quiet()
            assert engine.is_idle()


async def test_malformed_messages_counted_and_dropped(config: PrefetchConfig) -> None:
    with trio.fail_after(10):
        async with served(config) as (engine, server, peer):
            peer.send(b"\xc1 not msgpack")
            peer.send(msgspec.msgpack.encode({"type": "Nope", "lookup_id": "x"}))
            peer.send(msgspec.msgpack.encode({"type": "LookupRequestMsg", "lookup_id": 5}))
            peer.send(encode(LookupRequestMsg("m", [1, 2, 3], [4, 4])))  # lengths disagree
            got = await peer.answer()
            assert (got.lookup_id, got.num_hit_tokens) == ("m", 0)
            peer.request("ok", [1])
            assert (await peer.answer()).lookup_id == "ok"
            assert server.statistics().messages_malformed == 4
            assert engine.statistics().lookups.malformed == 1


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    garbage=st.lists(
        st.one_of(
            st.binary(max_size=64),
            st.builds(
                lambda d: msgspec.msgpack.encode(d),
                st.dictionaries(
                    st.sampled_from(
                        [
                            "type",
                            "lookup_id",
                            "hashes",
                            "offsets",
                            "seq",
                            "deadline_ms",
                            "skip_chunks",
                            "request_configs",
                        ]
                    ),
                    st.one_of(
                        st.integers(-(2**63), 2**64 - 1),
                        st.text(max_size=8),
                        st.lists(st.integers(-5, 2**64 - 1), max_size=4),
                        st.none(),
                        st.sampled_from(["LookupRequestMsg", "LookupCleanupMsg"]),
                    ),
                ),
            ),
        ),
        min_size=200,
        max_size=400,
    )
)
def test_fuzzed_messages_never_stop_the_worker(garbage: list[bytes]) -> None:
    config = PrefetchConfig(chunk_size=CHUNK, chunk_bytes=64, cpu_bytes=64 * 64)

    async def main() -> None:
        with trio.fail_after(20):
            async with served(config) as (engine, _server, peer):
                for data in garbage * 5:  # thousands of messages
                    peer.send(data)
                peer.request("alive", [42], seq=10**6)
                while True:
                    got = await peer.answer()
                    if got.lookup_id == "alive":
                        break
                engine.cancel_all()
                await engine.wait_quiet()
                assert engine.is_idle()

    trio.run(main)


async def test_a_worker_whose_scheduler_came_back_answers_without_waiting_for_a_reconnect(
    config: PrefetchConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker's answer socket that is not connected retries the connection the moment an
    answer is ready (a request came, so a scheduler is there), instead of at libzmq's next
    reconnect: here that would be an hour away, so the answer could only come from the
    retry.  Nothing is lost meanwhile: the answer waits in the outbox, not in a dead pipe."""
    monkeypatch.setattr(transport, "IPC_RECONNECT_IVL_MS", 3_600_000)
    tag = uuid.uuid4().hex[:10]
    req, resp = f"ipc://@lmp-test-{tag}-req", f"ipc://@lmp-test-{tag}-resp"
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    early = ctx.socket(zmq.PULL)
    early.linger = 0
    accepted = early.get_monitor_socket(zmq.EVENT_ACCEPTED)
    early.bind(resp)
    monitors = [accepted]

    def wait_event(monitor: zmq.Socket[bytes]) -> None:
        if not monitor.poll(20_000):
            raise TimeoutError("no socket event")
        monitor.recv_multipart()

    try:
        with trio.fail_after(30):
            async with open_engine(config) as engine, serve_lookups(engine, req, resp) as server:
                await trio.to_thread.run_sync(wait_event, accepted)  # the worker reached it
                dropped = server._answers.socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
                monitors.append(dropped)
                early.close()  # the scheduler goes away: libzmq would retry in an hour
                await trio.to_thread.run_sync(wait_event, dropped)
                peer = Peer(req, resp)  # a scheduler binds the endpoint again and asks
                try:
                    peer.request("first", [1, 2])
                    got = await peer.answer(timeout_s=20)
                    assert (got.lookup_id, got.num_hit_tokens) == ("first", 0)
                    stats = server.statistics()
                    assert stats.answers_waited == 1 and stats.answers_sent == 1
                finally:
                    peer.close()
    finally:
        for monitor in monitors:
            monitor.close(0)
        early.close(0)
        ctx.term()


async def test_a_stale_cleanup_leaves_the_newer_lookup_alone(config: PrefetchConfig) -> None:
    """A cleanup for an older use of an id (it crossed the newer request on the way) must not
    cancel the newer lookup; a cleanup with the current ``seq`` does."""
    with trio.fail_after(10):
        async with served(config) as (engine, _, peer):
            toks = list(range(8))
            await engine.store(toks, [b"x" * 8] * 2)
            peer.request("r", engine.hasher.hash(toks), seq=2)
            assert (await peer.answer()).num_hit_tokens == 8
            peer.send(encode(LookupCleanupMsg("r", seq=1)))  # stale
            peer.request("marker", [12345], seq=1)  # after the cleanup, on the same socket
            assert (await peer.answer()).lookup_id == "marker"
            assert engine.lookup_state("r") is LookupState.HELD
            peer.send(encode(LookupCleanupMsg("r", seq=2)))
            await poll_until(engine, lambda: engine.lookup_state("r") is None)
            assert engine.is_idle()


async def test_skipped_chunks_count_as_hits_on_the_wire(config: PrefetchConfig) -> None:
    """``skip_chunks``: chunks the engine has already; they count as hit tokens without being
    probed, and the lookup goes on from the first one after them."""
    with trio.fail_after(10):
        async with served(config) as (engine, _, peer):
            toks = list(range(16))
            hashes = engine.hasher.hash(toks)
            await engine.store(toks[:12], [b"x" * 8] * 3)
            peer.request("unknown", [7, 8, 9], skip_chunks=2)
            assert (await peer.answer()).num_hit_tokens == 2 * CHUNK
            peer.request("known", hashes, skip_chunks=1)
            assert (await peer.answer()).num_hit_tokens == 3 * CHUNK
            with engine.claim("known") as chunks:
                assert len(chunks) == 2  # chunks 1 and 2: the skipped one is not loaded
            assert engine.is_idle()


async def test_a_requests_own_load_policy_is_the_lookups(config: PrefetchConfig) -> None:
    """``load_policy`` on the wire: ``never`` answers without loading what the configured
    ``always`` would load; a name no built-in policy has is malformed, answered 0."""
    with trio.fail_after(10):
        async with served(config) as (engine, server, peer):
            toks = list(range(12))
            hashes = engine.hasher.hash(toks)
            await engine.store(toks, [b"x" * 8] * 3)
            peer.request("never", hashes, load_policy="never")
            assert (await peer.answer()).num_hit_tokens == 0
            peer.request("own", hashes, load_policy="pkg.mod:Class")
            assert (await peer.answer()).num_hit_tokens == 0
            assert server.statistics().messages_malformed == 1
            peer.request("configured", hashes)
            assert (await peer.answer()).num_hit_tokens == 12
            engine.cancel("configured")
            assert engine.is_idle()
