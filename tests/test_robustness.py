"""Hostile input and cancelled callers: the reproductions of the robustness defects.

Each test here reproduces one defect found by trying lmprefetch from the outside, and failed
before its fix:

1. a caller cancelled at ``lookup_and_prefetch``'s wait left its lookup held;
2. one deeply nested frame killed a worker's receive loop or the client's bridge thread;
3. a receive loop or bridge thread that died did so silently (alive but deaf);
4. an accepted request whose answer could not be encoded was never answered;
5. (start-up errors: see ``test_cli.py``);
6. the answer socket was written from two tasks;
7. a bug in the engine's own code passed as a tier miss.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
import trio
import trio.testing
import zmq

from lmprefetch import LookupClient, PrefetchConfig, WorkerRuntime, open_engine, serve_lookups
from lmprefetch.client import LookupClientError
from lmprefetch.protocol import (
    INT64_MAX,
    LookupRequestMsg,
    LookupResponseMsg,
    decode_response,
    decode_worker_message,
    encode,
    validate_request,
)
from lmprefetch.transport import TrioZmqSocket

from .fakes import FakeTier

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup
from .helpers import CHUNK, Peer, assert_conserved, offsets, payloads, served, tokens

LIMIT_S = 10.0


@pytest.fixture
def config() -> PrefetchConfig:
    return PrefetchConfig(chunk_size=CHUNK, chunk_bytes=64, cpu_bytes=64 * 64)


def ipc() -> str:
    return f"ipc://@lmp-robust-{uuid.uuid4().hex[:12]}"


def nested(depth: int) -> bytes:
    """A msgpack array nested ``depth`` deep: ``[[[...[nil]...]]]`` in ``depth + 1`` bytes."""
    return b"\x91" * depth + b"\xc0"


def with_extra_field(msg: msgspec.Struct, name: str, value_bytes: bytes) -> bytes:
    """``msg`` encoded as a map with one more (unknown) field whose value is raw msgpack."""
    raw = encode(msg)  # type: ignore[arg-type]
    n = raw[0] & 0x0F
    assert raw[0] & 0xF0 == 0x80 and n < 15  # a fixmap
    return bytes([0x80 | (n + 1)]) + raw[1:] + msgspec.msgpack.encode(name) + value_bytes


# -- 1. a cancelled caller leaves nothing behind ----------------------------------------------
async def test_caller_cancelled_with_its_answer_known_leaves_nothing_held(
    config: PrefetchConfig,
) -> None:
    """A full CPU hit is answered before the caller's one checkpoint: cancelling the caller
    there must still cancel the lookup (Trio: a call that raised had no lasting effect)."""
    async with open_engine(config) as engine:
        toks = tokens(4)
        await engine.store(toks, payloads(4))
        hashes = engine.hasher.hash(toks)
        with trio.CancelScope() as scope:
            scope.cancel()
            await engine.lookup_and_prefetch("c", hashes, offsets(4))
        assert scope.cancelled_caught
        assert engine.statistics().lookups.held == 0
        with engine.claim("c") as chunks:
            assert chunks == []
        assert_conserved(engine)


class CancelBeforeStep(trio.abc.Instrument):
    """Runs ``action`` just before the lookup task's ``at``-th step: the caller's cancellation
    is then delivered before the step, whatever that step does (e.g. give the answer)."""

    def __init__(self, at: int, action: Callable[[], None]) -> None:
        self.at = at
        self.action = action
        self.steps = 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        if task.name.startswith("lookup:"):
            self.steps += 1
            if self.steps == self.at:
                self.action()


def test_caller_cancelled_just_before_its_answer_lands_leaves_nothing_held() -> None:
    """The caller's cancellation is delivered, then (before the caller runs again) the lookup
    task takes the step that answers: the caller raises Cancelled, so the lookup must not stay
    held.  Tried before every step of the lookup task, the answering one included."""
    config = PrefetchConfig(chunk_size=CHUNK, chunk_bytes=64, cpu_bytes=64 * 64)

    async def scenario(instrument: CancelBeforeStep | None) -> tuple[list[int], list[int]]:
        disk = FakeTier("disk")
        async with open_engine(config, extra_tiers=[disk]) as engine:
            toks, data = tokens(3), payloads(3)
            await engine.store(toks[:CHUNK], data[:1])
            hashes = engine.hasher.hash(toks)
            for key, payload in list(zip(engine.keys.keys(hashes), data))[1:]:
                disk.data[key] = payload
            answered: list[int] = []
            engine.on_lookup_done = lambda hit, _s: answered.append(hit)
            caller = trio.CancelScope()
            if instrument is not None:
                instrument.action = caller.cancel
            returned: list[int] = []
            with caller:
                returned.append(await engine.lookup_and_prefetch("d", hashes, offsets(3)))
            if returned:
                with engine.claim("d") as chunks:
                    assert [bytes(b.view()) for _, b in chunks] == data
            else:  # the call raised: nothing may be left held, even if it answered
                assert engine.statistics().lookups.held == 0
                assert engine.lookup_state("d") is None
            await engine.wait_quiet()
            assert_conserved(engine)
            return returned, answered

    counter = CancelBeforeStep(0, lambda: None)
    returned, answered = trio.run(scenario, None, instruments=[counter])
    assert returned == answered == [3 * CHUNK]
    total = counter.steps
    assert total >= 2
    outcomes = set()
    for k in range(1, total + 1):
        instrument = CancelBeforeStep(k, lambda: None)
        returned, answered = trio.run(
            scenario,
            instrument,
            instruments=[instrument],
            clock=trio.testing.MockClock(autojump_threshold=0),
        )
        outcomes.add((bool(returned), tuple(answered)))
    # Some cancels landed before the answer (answered 0), and one landed with it: the answer
    # was a hit, but the caller was cancelled.  That is the case that used to leak.
    assert (False, (3 * CHUNK,)) in outcomes


# -- 2. no frame can stop a receive loop ------------------------------------------------------
@pytest.mark.parametrize("depth", [1_000, 10_000, 100_000])
def test_deeply_nested_frames_are_decode_errors(depth: int) -> None:
    """Nesting deep enough to exhaust the decoder's recursion limit is a DecodeError, never a
    RecursionError.  (Where that limit lies depends on the Python version: on 3.13 an array
    1,000 deep inside an ignored field still decodes, and then the message must be intact.)"""
    request = LookupRequestMsg("x", [1], [CHUNK])
    response = LookupResponseMsg("x", 4)
    in_ignored_field = [
        (decode_worker_message, with_extra_field(request, "junk", nested(depth)), request),
        (decode_response, with_extra_field(response, "junk", nested(depth)), response),
    ]
    for decode, frame, intact in in_ignored_field:
        try:
            got = decode(frame)
        except msgspec.DecodeError:
            continue
        assert got == intact
    for decode, frame in [
        (decode_worker_message, nested(depth)),
        (decode_response, b"\x81\xa4type" + nested(depth)),
    ]:
        with pytest.raises(msgspec.DecodeError):
            decode(frame)


async def test_a_deeply_nested_frame_does_not_stop_the_server(config: PrefetchConfig) -> None:
    with trio.fail_after(LIMIT_S):
        async with served(config) as (_engine, server, peer):
            # Deep enough to exhaust the decoder's recursion limit on every Python version.
            for depth in (10_000, 100_000):
                peer.send(with_extra_field(LookupRequestMsg("x", [1], [CHUNK]), "j", nested(depth)))
            peer.request("alive", [7], seq=3)
            got = await peer.answer()
            assert (got.lookup_id, got.seq) == ("alive", 3)
            assert server.statistics().messages_malformed == 2
            assert server.failure is None


async def test_a_frame_at_the_size_limit_is_dropped_and_a_larger_one_disconnects(
    config: PrefetchConfig,
) -> None:
    cfg = config.replace(max_message_bytes=64 * 1024)
    with trio.fail_after(LIMIT_S):
        async with served(cfg) as (_engine, server, peer):
            at_limit = with_extra_field(LookupRequestMsg("x", [1], [CHUNK]), "j", b"")
            at_limit += nested(64 * 1024 - len(at_limit) - 1)
            assert len(at_limit) == 64 * 1024
            peer.send(at_limit)
            peer.request("after-limit", [7], seq=1)
            assert (await peer.answer()).lookup_id == "after-limit"
            assert server.statistics().messages_malformed == 1
            # Larger than the limit: libzmq drops that peer's connection before buffering the
            # frame; the server goes on serving everyone else (here: a second sender).
            peer.send(b"\x91" * (64 * 1024 + 1))
            request_ep = server._requests.socket.getsockopt_string(zmq.LAST_ENDPOINT)
            other = peer.ctx.socket(zmq.PUSH)
            other.linger = 0
            try:
                other.connect(request_ep)
                other.send(encode(LookupRequestMsg("other", [8], [CHUNK], seq=2)))
                assert (await peer.answer()).lookup_id == "other"
            finally:
                other.close()
            assert server.failure is None
            assert server.statistics().messages_malformed == 1  # the big frame never arrived


def test_a_deeply_nested_answer_does_not_stop_the_client_bridge(config: PrefetchConfig) -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    worker_ep, answers_ep = ipc(), ipc()
    pull = ctx.socket(zmq.PULL)
    pull.linger = 0
    pull.bind(worker_ep)
    push = ctx.socket(zmq.PUSH)
    push.linger = 0
    try:
        with LookupClient(config.replace(lookup_timeout_s=30.0), [worker_ep], answers_ep) as c:
            push.connect(answers_ep)
            assert c.lookup("a", tokens(2)) is None
            assert pull.poll(int(LIMIT_S * 1000))
            seq = decode_worker_message(pull.recv()).seq
            for depth in (10_000, 100_000):  # beyond the decoder's limit on every Python
                push.send(with_extra_field(LookupResponseMsg("a", 8, seq=seq), "j", nested(depth)))
            push.send(encode(LookupResponseMsg("a", 8, seq=seq, worker_id=0)))
            assert c.wait("a", LIMIT_S) == 8
            assert c.statistics().malformed_answers == 2
    finally:
        pull.close()
        push.close()
        ctx.term()


# -- 3. a dead loop is never silent ------------------------------------------------------------
async def test_a_receive_task_that_fails_is_reported_and_leaves_the_server(
    config: PrefetchConfig, caplog: pytest.LogCaptureFixture
) -> None:
    failures: list[BaseException] = []
    servers: list[object] = []
    req, resp = ipc(), ipc()
    peer = Peer(req, resp)

    def bug(*args: object, **kwargs: object) -> None:
        raise RuntimeError("a bug in start_lookup")

    async def serve_until_it_fails() -> None:
        async with (
            open_engine(config) as engine,
            serve_lookups(engine, req, resp, on_failure=failures.append) as server,
        ):
            servers.append(server)
            engine.start_lookup = bug  # type: ignore[method-assign]
            peer.request("x", [1])
            await trio.sleep_forever()  # the server's failure cancels this

    try:
        with trio.fail_after(LIMIT_S), pytest.raises(BaseExceptionGroup) as caught:
            await serve_until_it_fails()
    finally:
        peer.close()
    assert caught.group_contains(RuntimeError, match="a bug in start_lookup")
    assert [type(f) for f in failures] == [RuntimeError]
    assert servers[0].failure is failures[0]  # type: ignore[attr-defined]
    assert any(r.levelno == logging.CRITICAL and r.exc_info for r in caplog.records)


def test_a_failed_runtime_reports_once_and_every_later_call_raises(
    config: PrefetchConfig,
) -> None:
    reported = threading.Event()
    failures: list[BaseException] = []

    def on_failure(exc: BaseException) -> None:
        failures.append(exc)
        reported.set()

    req, resp = ipc(), ipc()
    peer = Peer(req, resp)
    runtime = WorkerRuntime.start(
        config, request_endpoint=req, response_endpoint=resp, on_failure=on_failure
    )
    try:

        def bug(*args: object, **kwargs: object) -> None:
            raise RuntimeError("injected bug")

        runtime.call(setattr, runtime.engine, "start_lookup", bug)
        peer.request("x", [1])
        assert reported.wait(LIMIT_S)
        assert runtime.failure is failures[0]
        with pytest.raises(RuntimeError, match="runtime failed"):
            runtime.stats()
        with pytest.raises(RuntimeError, match="runtime failed"):
            runtime.store(tokens(1), payloads(1))
    finally:
        runtime.close()  # does not raise the failure again
        peer.close()
    assert len(failures) == 1


def test_a_worker_process_whose_server_fails_exits_non_zero(tmp_path: Path) -> None:
    req, resp = ipc(), ipc()
    script = tmp_path / "failing_worker.py"
    script.write_text(
        "import sys\n"
        "from lmprefetch import cli, server\n"
        "def bug(self, data):\n"
        "    raise RuntimeError('injected bug in the receive loop')\n"
        "server.LookupServer._handle = bug\n"
        f"sys.exit(cli.main(['worker', '--request-endpoint', {req!r},"
        f" '--response-endpoint', {resp!r}]))\n"
    )
    proc = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        assert "serving" in proc.stdout.readline()  # up and serving
        peer = Peer(req, resp)
        try:
            peer.request("x", [1])
            rc = proc.wait(timeout=30)
        finally:
            peer.close()
        stderr = proc.stderr.read() if proc.stderr is not None else ""
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
    assert rc == 1
    assert "injected bug in the receive loop" in stderr  # the traceback was logged
    assert "stopped by a failure" in stderr.splitlines()[-1]


def test_a_dead_client_bridge_makes_every_lookup_raise(
    config: PrefetchConfig, caplog: pytest.LogCaptureFixture
) -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    worker_ep = ipc()
    pull = ctx.socket(zmq.PULL)
    pull.linger = 0
    pull.bind(worker_ep)
    try:
        with LookupClient(config.replace(lookup_timeout_s=30.0), [worker_ep], ipc()) as client:
            assert client.lookup("before", tokens(1)) is None
            died = threading.Event()

            def bug(*args: object) -> None:
                died.set()
                raise RuntimeError("injected bug in the bridge")

            client._bridge.send_request = bug  # type: ignore[method-assign]
            assert client.lookup("after", tokens(1)) is None  # the bridge runs it and dies
            assert died.wait(LIMIT_S)
            client._bridge.thread.join(LIMIT_S)
            assert not client._bridge.thread.is_alive()
            for lookup_id in ("before", "after", "new"):
                with pytest.raises(LookupClientError, match="bridge thread died"):
                    client.lookup(lookup_id, tokens(1))
            with pytest.raises(LookupClientError):
                client.wait("before", 1.0)
            client.cancel("before")  # abort paths stay quiet
            client.forget("before")
        assert any(r.levelno == logging.CRITICAL for r in caplog.records)
    finally:
        pull.close()
        ctx.term()


# -- 4. every accepted request gets exactly one answer ----------------------------------------
@pytest.mark.parametrize(
    "fields",
    [
        {"seq": -1},
        {"seq": 2**63},
        {"deadline_ms": -5},
        {"deadline_ms": 2**64 - 1},
    ],
)
def test_request_integers_outside_their_wire_type_do_not_decode(fields: dict[str, int]) -> None:
    raw = msgspec.msgpack.encode(
        {"type": "LookupRequestMsg", "lookup_id": "x", "hashes": [1], "offsets": [4], **fields}
    )
    with pytest.raises(msgspec.ValidationError):
        decode_worker_message(raw)


@pytest.mark.parametrize(
    "fields",
    [
        {"num_hit_tokens": -1},
        {"num_hit_tokens": 2**63},
        {"seq": -1},
        {"worker_id": -2},
        {"worker_id": 2**31},
    ],
)
def test_response_integers_outside_their_wire_type_do_not_decode(fields: dict[str, int]) -> None:
    base: dict[str, object] = {"type": "LookupResponseMsg", "lookup_id": "x", "num_hit_tokens": 0}
    with pytest.raises(msgspec.ValidationError):
        decode_response(msgspec.msgpack.encode({**base, **fields}))


def test_offsets_whose_answer_would_not_encode_are_invalid() -> None:
    big = LookupRequestMsg("o", [1, 2], [2**63, 2**63], skip_chunks=2)
    assert validate_request(big) is not None
    assert validate_request(LookupRequestMsg("o", [1], [2**32])) is not None
    assert validate_request(LookupRequestMsg("o", [1, 2], [2**32 - 1] * 2)) is None


async def test_a_request_whose_answer_overflowed_is_answered_zero_once(
    config: PrefetchConfig,
) -> None:
    with trio.fail_after(LIMIT_S):
        async with served(config) as (_engine, server, peer):
            peer.send(encode(LookupRequestMsg("big", [1, 2], [2**63, 2**63], skip_chunks=2)))
            peer.send(encode(LookupRequestMsg("max", [1], [INT64_MAX], skip_chunks=1)))
            got = {(a.lookup_id, a.num_hit_tokens) for a in [await peer.answer() for _ in "ab"]}
            assert got == {("big", 0), ("max", 0)}
            stats = server.statistics()
            assert stats.requests_accepted == 2 == stats.answers_sent


# -- 6. each socket has one owning task ---------------------------------------------------------
async def test_answers_at_the_high_water_mark_wait_in_the_send_task_and_all_arrive(
    config: PrefetchConfig,
) -> None:
    """Answers pile up past the high-water mark while the scheduler is away: they wait in the
    outbox, only the send task touches the answer socket (a second writer could consume the
    socket's wake-up from under the waiting one), and once the scheduler binds its answer
    socket every answer arrives exactly once."""
    n = 2000
    req, resp = ipc(), ipc()
    senders: set[str] = set()
    waits = [0]  # sends that had to wait on the socket
    reconnects = [0]

    class Recording(TrioZmqSocket):
        def send_nowait(self, data: bytes | memoryview) -> None:
            senders.add(trio.lowlevel.current_task().name)
            super().send_nowait(data)

        async def send(self, data: bytes | memoryview) -> None:
            senders.add(trio.lowlevel.current_task().name)
            waits[0] += 1
            await super().send(data)

    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.linger = 0

    def recv_within(seconds: float) -> bytes:
        if not pull.poll(int(seconds * 1000)):
            raise TimeoutError("an answer never arrived")
        return pull.recv()

    try:
        with trio.fail_after(3 * LIMIT_S):
            async with (
                open_engine(config) as engine,
                serve_lookups(engine, req, resp, hwm=1) as server,
            ):
                server._answers = Recording(server._answers.socket)
                connect_now = server._connect_now

                def counted_connect_now() -> None:
                    reconnects[0] += 1
                    connect_now()

                server._connect_now = counted_connect_now  # type: ignore[method-assign]
                # Requests straight into the receive path (misses: answered synchronously).
                for i in range(n):
                    server._handle(encode(LookupRequestMsg(f"r{i}", [i + 1], [CHUNK], seq=1)))
                assert server.statistics().answers_queued == n
                # Nobody is bound at ``resp`` yet: one answer fits the pipe, then the send task
                # waits on the socket.
                await trio.testing.wait_all_tasks_blocked()
                assert server.statistics().answers_waited == 1
                assert reconnects == [1]  # nothing sent yet: the connection is retried once
                pull.bind(resp)  # the scheduler arrives
                seen: dict[str, int] = {}
                for _ in range(n):
                    buf = await trio.to_thread.run_sync(recv_within, LIMIT_S)
                    lookup_id = decode_response(buf).lookup_id
                    seen[lookup_id] = seen.get(lookup_id, 0) + 1
                assert len(seen) == n and set(seen.values()) == {1}
                assert senders == {"lookup-server-send"}
                stats = server.statistics()
                assert stats.answers_sent == stats.requests_accepted == n
                assert stats.answers_queued == 0
                assert stats.answers_waited == waits[0]
                # Once answers went through, a full pipe is the high-water mark, not a missing
                # connection: the send task waits, it does not reconnect (and drop the pipe).
                assert reconnects == [1]
    finally:
        pull.close()
        ctx.term()


# -- 7. a bug in the engine is loud ------------------------------------------------------------
async def test_a_bug_in_the_engine_fails_the_lookup_loudly_not_as_a_miss(
    config: PrefetchConfig, caplog: pytest.LogCaptureFixture
) -> None:
    disk = FakeTier("disk")
    async with open_engine(config, extra_tiers=[disk]) as engine:
        toks, data = tokens(3), payloads(3)
        hashes = engine.hasher.hash(toks)
        for key, payload in zip(engine.keys.keys(hashes), data):
            disk.data[key] = payload

        def bug(n: int) -> list[object]:
            raise RuntimeError("a bug in the arena")

        engine.arena.allocate_many = bug  # type: ignore[method-assign,assignment]
        with caplog.at_level(logging.ERROR, logger="lmprefetch.engine"):
            assert await engine.lookup_and_prefetch("b", hashes, offsets(3)) == 0
        assert engine.statistics().lookups.failed == 1
        assert disk.stats.errors == 0  # the tier did nothing wrong
        assert any("a bug in the arena" in r.getMessage() or r.exc_info for r in caplog.records)
        await engine.wait_quiet()
        assert_conserved(engine, faults=True)
        with pytest.raises(AssertionError, match="lookup failed"):
            assert_conserved(engine)


async def test_a_tier_failure_is_a_shorter_prefix_not_a_failed_lookup(
    config: PrefetchConfig,
) -> None:
    disk = FakeTier("disk")
    disk.load_error = OSError("the disk is on fire")
    async with open_engine(config, extra_tiers=[disk]) as engine:
        toks, data = tokens(3), payloads(3)
        await engine.store(toks[:CHUNK], data[:1])
        hashes = engine.hasher.hash(toks)
        for key, payload in zip(engine.keys.keys(hashes), data):
            disk.data[key] = payload
        assert await engine.lookup_and_prefetch("t", hashes, offsets(3)) == CHUNK
        with engine.claim("t") as chunks:
            assert len(chunks) == 1
        await engine.wait_quiet()
        assert engine.statistics().lookups.failed == 0
        assert disk.stats.errors == 1
        assert_conserved(engine, faults=True)
