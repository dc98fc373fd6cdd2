"""Trio-native ZeroMQ sockets.

Real I/O on loopback and abstract ipc only, so these tests use the real clock under an outer
``fail_after`` (``autojump_clock`` would fire while a task waits on a socket).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import trio
import trio.testing
import zmq

from lmprefetch.transport import (
    TrioZmqSocket,
    check_endpoint,
    close_context,
    drain,
    make_pull,
    make_push,
    open_context,
)

LIMIT_S = 10


def ipc_endpoint() -> str:
    return f"ipc://@lmprefetch-test-{uuid.uuid4().hex}"


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    ctx = open_context()
    yield ctx
    close_context(ctx)


def pipe(
    ctx: zmq.Context[zmq.Socket[bytes]], transport: str, hwm: int = 1000
) -> tuple[TrioZmqSocket, TrioZmqSocket]:
    """A connected (push, pull) pair: pull binds, push connects."""
    if transport == "ipc":
        pull = make_pull(ctx, ipc_endpoint(), bind=True, hwm=hwm)
    else:
        pull = make_pull(ctx, "tcp://127.0.0.1:0", bind=True, hwm=hwm)
    endpoint = pull.getsockopt_string(zmq.LAST_ENDPOINT)
    push = make_push(ctx, endpoint, bind=False, hwm=hwm)
    return TrioZmqSocket(push), TrioZmqSocket(pull)


def inproc_pipe(ctx: zmq.Context[zmq.Socket[bytes]]) -> tuple[TrioZmqSocket, TrioZmqSocket]:
    """A (push, pull) pair over inproc, where a sent message is queued at the peer the
    moment ``send`` returns: for tests that need "the message is already there"."""
    name = f"inproc://lmprefetch-test-{uuid.uuid4().hex}"
    pull = ctx.socket(zmq.PULL)
    pull.bind(name)
    push = ctx.socket(zmq.PUSH)
    push.connect(name)
    return TrioZmqSocket(push), TrioZmqSocket(pull)


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
async def test_send_recv(ctx: zmq.Context[zmq.Socket[bytes]], transport: str) -> None:
    with trio.fail_after(LIMIT_S):
        push, pull = pipe(ctx, transport)
        with push, pull:
            await push.send(b"hello")
            await push.send(memoryview(b"world"))
            assert await pull.recv() == b"hello"
            assert await pull.recv() == b"world"


async def test_push_binds_pull_connects(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    with trio.fail_after(LIMIT_S):
        raw_push = make_push(ctx, "tcp://127.0.0.1:0", bind=True, hwm=10)
        endpoint = raw_push.getsockopt_string(zmq.LAST_ENDPOINT)
        push = TrioZmqSocket(raw_push)
        pull = TrioZmqSocket(make_pull(ctx, endpoint, bind=False, hwm=10))
        with push, pull:
            await push.send(b"x")
            assert await pull.recv() == b"x"


async def test_wraps_a_socket_bound_to_a_random_port(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    with trio.fail_after(LIMIT_S):
        raw_pull: zmq.Socket[bytes] = ctx.socket(zmq.PULL)
        port = raw_pull.bind_to_random_port("tcp://127.0.0.1")
        pull = TrioZmqSocket(raw_pull)
        push = TrioZmqSocket(make_push(ctx, f"tcp://127.0.0.1:{port}", bind=False, hwm=10))
        with push, pull:
            await push.send(b"y")
            assert await pull.recv() == b"y"


async def test_socket_options(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    push = make_push(ctx, ipc_endpoint(), bind=True, hwm=123)
    pull = make_pull(ctx, ipc_endpoint(), bind=True, hwm=45)
    try:
        assert push.getsockopt(zmq.LINGER) == 0
        assert push.getsockopt(zmq.SNDHWM) == 123
        assert push.getsockopt(zmq.RCVHWM) == 123
        assert pull.getsockopt(zmq.RCVHWM) == 45
        assert pull.getsockopt(zmq.SNDHWM) == 45
        assert push.getsockopt(zmq.TYPE) == zmq.PUSH
        assert pull.getsockopt(zmq.TYPE) == zmq.PULL
    finally:
        push.close(linger=0)
        pull.close(linger=0)


async def test_recv_waits_for_a_message(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    with trio.fail_after(LIMIT_S):
        push, pull = pipe(ctx, "ipc")
        with push, pull:
            got: list[bytes] = []

            async def receiver() -> None:
                got.append(await pull.recv())

            async with trio.open_nursery() as nursery:
                nursery.start_soon(receiver)
                await trio.testing.wait_all_tasks_blocked()
                assert got == []
                await push.send(b"late")
            assert got == [b"late"]


async def test_cancelled_recv_loses_nothing(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    with trio.fail_after(LIMIT_S):
        push, pull = pipe(ctx, "ipc")
        with push, pull:
            # A receiver waiting on the socket is cancelled; the message sent afterwards
            # waits for the next recv.
            async with trio.open_nursery() as nursery:

                async def receiver(task_status: trio.TaskStatus[trio.CancelScope]) -> None:
                    with trio.CancelScope() as scope:
                        task_status.started(scope)
                        await pull.recv()
                    assert scope.cancelled_caught

                scope = await nursery.start(receiver)
                await trio.testing.wait_all_tasks_blocked()
                scope.cancel()
            await push.send(b"kept")
            assert await pull.recv() == b"kept"

            # A recv entered already cancelled raises before taking the queued message.
            await push.send(b"queued")
            with trio.CancelScope() as scope:
                scope.cancel()
                await pull.recv()
            assert scope.cancelled_caught
            assert await pull.recv() == b"queued"


async def test_recv_and_send_are_checkpoints(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    with trio.fail_after(LIMIT_S):
        push, pull = inproc_pipe(ctx)
        with push, pull:
            with trio.testing.assert_checkpoints():
                await push.send(b"a")
            with trio.testing.assert_checkpoints():  # fast path: already queued
                assert await pull.recv() == b"a"
            async with trio.open_nursery() as nursery:
                nursery.start_soon(push.send, b"b")
                with trio.testing.assert_checkpoints():  # slow path: waits for it
                    assert await pull.recv() == b"b"


async def test_fast_path_message_survives_pending_cancel(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    # A cancel that lands while recv's fast path is at its final schedule point must not
    # drop the message it took: recv returns it (cancel_shielded_checkpoint), and the cancel
    # is delivered at the next checkpoint instead.  Whether the canceller runs during that
    # schedule point depends on Trio's (randomised) batch order, so try many times; with a
    # plain checkpoint() there, about half the rounds would lose their message.
    rounds = 64
    with trio.fail_after(LIMIT_S):
        push, pull = inproc_pipe(ctx)
        with push, pull:
            got: list[bytes] = []

            async def canceller(scope: trio.CancelScope) -> None:
                scope.cancel()

            async with trio.open_nursery() as nursery:
                for i in range(rounds):
                    await push.send(bytes([i]))  # queued at the peer at once (inproc)
                    with trio.CancelScope() as scope:
                        nursery.start_soon(canceller, scope)
                        got.append(await pull.recv())
                        await trio.lowlevel.checkpoint()
                    assert scope.cancelled_caught
            assert got == [bytes([i]) for i in range(rounds)]
            assert drain(pull, 1) == []


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
async def test_pipelined_in_order(ctx: zmq.Context[zmq.Socket[bytes]], transport: str) -> None:
    # A tiny HWM makes both sides wait on the FD many times (send at HWM, recv when empty).
    n = 2000
    with trio.fail_after(LIMIT_S):
        push, pull = pipe(ctx, transport, hwm=4)
        with push, pull:
            got: list[bytes] = []

            async def sender() -> None:
                for i in range(n):
                    await push.send(i.to_bytes(4, "big"))

            async def receiver() -> None:
                for _ in range(n):
                    got.append(await pull.recv())

            async with trio.open_nursery() as nursery:
                nursery.start_soon(receiver)
                nursery.start_soon(sender)
            assert [int.from_bytes(b, "big") for b in got] == list(range(n))


async def test_close_wakes_waiter(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    with trio.fail_after(LIMIT_S):
        push, pull = pipe(ctx, "ipc")
        with push:
            errors: list[BaseException] = []

            async def receiver() -> None:
                try:
                    await pull.recv()
                except trio.ClosedResourceError as exc:
                    errors.append(exc)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(receiver)
                await trio.testing.wait_all_tasks_blocked()
                pull.close()
            assert len(errors) == 1
            assert pull.closed
            pull.close()  # idempotent
            with pytest.raises(trio.ClosedResourceError):
                await pull.recv()
            with pytest.raises(trio.ClosedResourceError):
                pull.recv_nowait()


async def test_close_wakes_blocked_sender(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    with trio.fail_after(LIMIT_S):
        # A bound PUSH with no peer cannot send: the sender waits until it is closed.
        push = TrioZmqSocket(make_push(ctx, ipc_endpoint(), bind=True, hwm=1))
        errors: list[BaseException] = []

        async def sender() -> None:
            try:
                await push.send(b"x")
            except trio.ClosedResourceError as exc:
                errors.append(exc)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(sender)
            await trio.testing.wait_all_tasks_blocked()
            assert errors == []
            push.close()
        assert len(errors) == 1
        with pytest.raises(trio.ClosedResourceError):
            await push.send(b"y")
        with pytest.raises(trio.ClosedResourceError):
            push.send_nowait(b"y")


async def test_second_waiter_is_busy(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    with trio.fail_after(LIMIT_S):
        push, pull = pipe(ctx, "ipc")
        with push, pull:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(pull.recv)
                await trio.testing.wait_all_tasks_blocked()
                with pytest.raises(trio.BusyResourceError):
                    await pull.recv()
                nursery.cancel_scope.cancel()


async def test_nowait(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    with trio.fail_after(LIMIT_S):
        push, pull = pipe(ctx, "ipc")
        with push, pull:
            with pytest.raises(trio.WouldBlock):
                pull.recv_nowait()
            push.send_nowait(b"a")
            assert await pull.recv() == b"a"

        # No peer on a bound PUSH: nothing can be queued.
        lonely = TrioZmqSocket(make_push(ctx, ipc_endpoint(), bind=True, hwm=5))
        with lonely, pytest.raises(trio.WouldBlock):
            lonely.send_nowait(b"x")

        # A connected PUSH whose peer never reads fills up to its HWM, then refuses.
        stuck = TrioZmqSocket(make_push(ctx, ipc_endpoint(), bind=False, hwm=3))
        with stuck:
            sent = 0
            refused = False
            while not refused and sent < 1000:
                try:
                    stuck.send_nowait(b"x")
                    sent += 1
                except trio.WouldBlock:
                    refused = True
            assert refused
            assert 1 <= sent < 1000


async def test_send_nowait_sees_room_the_peer_made(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    # libzmq throttles command processing on the send path, so a bare send(NOBLOCK) right
    # after the peer drained the queue can still say "full"; send_nowait must not.
    with trio.fail_after(LIMIT_S):
        push, pull = pipe(ctx, "ipc", hwm=2)
        with push, pull:
            for i in range(50):
                push.send_nowait(bytes([i]))
                assert await pull.recv() == bytes([i])


async def test_drain(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    with trio.fail_after(LIMIT_S):
        push, pull = inproc_pipe(ctx)
        with push, pull:
            for i in range(10):
                await push.send(bytes([i]))
            assert await pull.recv() == bytes([0])
            assert drain(pull, 4) == [bytes([i]) for i in range(1, 5)]  # capped
            assert drain(pull.socket, 100) == [bytes([i]) for i in range(5, 10)]  # plain zmq
            assert drain(pull, 5) == []
            assert drain(pull, 0) == []


async def test_drain_over_ipc(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    # Over a real transport, messages may still be in flight: wait for one, then batch.
    with trio.fail_after(LIMIT_S):
        push, pull = pipe(ctx, "ipc")
        with push, pull:
            for i in range(100):
                await push.send(bytes([i]))
            got: list[bytes] = []
            while len(got) < 100:
                got.append(await pull.recv())
                got.extend(drain(pull, 100 - len(got)))
            assert got == [bytes([i]) for i in range(100)]


def test_close_outside_trio() -> None:
    ctx = open_context()
    sock = TrioZmqSocket(make_pull(ctx, ipc_endpoint(), bind=True, hwm=1))
    sock.close()  # no Trio run: nothing to notify
    assert sock.closed
    close_context(ctx, [sock])
    assert ctx.closed
    sock.close()
    close_context(ctx)  # idempotent


def test_close_context_closes_forgotten_sockets() -> None:
    ctx = open_context()
    sock = make_pull(ctx, ipc_endpoint(), bind=True, hwm=1)
    close_context(ctx)  # would hang in term() if the socket were left open
    assert sock.closed
    assert ctx.closed


def test_open_context_is_fresh() -> None:
    a = open_context()
    b = open_context()
    try:
        assert a is not b
        assert a.linger == 0
    finally:
        close_context(a)
        close_context(b)


@pytest.mark.parametrize(
    "url",
    [
        "ipc:///tmp/lmprefetch.sock",
        "ipc://relative.sock",
        "ipc://@lmprefetch-abstract",
        "ipc://@" + "a" * 106,  # 107 bytes with the "@"
        "tcp://127.0.0.1:5555",
        "tcp://127.0.0.1:0",
        "tcp://localhost:65535",
        "tcp://*:5555",
        "tcp://127.0.0.1:*",
        "tcp://[::1]:5555",
    ],
)
def test_check_endpoint_accepts(url: str) -> None:
    assert check_endpoint(url) == url


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("inproc://x", "expected ipc"),
        ("udp://127.0.0.1:5", "expected ipc"),
        ("127.0.0.1:5555", "expected ipc"),
        ("", "expected ipc"),
        ("ipc://", "empty"),
        ("ipc://@", "empty"),
        ("ipc://@" + "a" * 107, "108 bytes"),
        ("ipc:///" + "a" * 107, "108 bytes"),
        ("ipc:///tmp/" + "é" * 52, "109 bytes"),
        ("tcp://127.0.0.1", "expected tcp://host:port"),
        ("tcp://127.0.0.1:", "expected tcp://host:port"),
        ("tcp://127.0.0.1:abc", "expected tcp://host:port"),
        ("tcp://:5555", "expected tcp://host:port"),
        ("tcp://127.0.0.1:70000", "out of range"),
    ],
)
def test_check_endpoint_rejects(url: str, problem: str) -> None:
    with pytest.raises(ValueError, match="endpoint") as info:
        check_endpoint(url)
    assert problem in str(info.value)


def test_make_socket_validates(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    with pytest.raises(ValueError, match="endpoint"):
        make_push(ctx, "inproc://x", bind=True, hwm=1)
    with pytest.raises(ValueError, match="hwm"):
        make_pull(ctx, ipc_endpoint(), bind=True, hwm=-1)


def test_bind_conflict_closes_the_socket(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    url = ipc_endpoint()
    first = make_pull(ctx, url, bind=True, hwm=1)
    try:
        with pytest.raises(zmq.ZMQError):
            make_pull(ctx, url, bind=True, hwm=1)
    finally:
        first.close(linger=0)


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
async def test_recv_batch_pipelined_in_order(
    ctx: zmq.Context[zmq.Socket[bytes]], transport: str
) -> None:
    n = 3000
    with trio.fail_after(LIMIT_S):
        push, pull = pipe(ctx, transport, hwm=16)
        with push, pull:
            got: list[bytes] = []
            sizes: list[int] = []

            async def sender() -> None:
                for i in range(n):
                    await push.send(i.to_bytes(4, "big"))

            async def receiver() -> None:
                while len(got) < n:
                    batch = await pull.recv_batch(64)
                    assert 1 <= len(batch) <= 64
                    sizes.append(len(batch))
                    got.extend(batch)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(receiver)
                nursery.start_soon(sender)
            assert [int.from_bytes(b, "big") for b in got] == list(range(n))


async def test_cancelled_recv_batch_loses_nothing(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    with trio.fail_after(LIMIT_S):
        push, pull = inproc_pipe(ctx)
        with push, pull:
            async with trio.open_nursery() as nursery:

                async def receiver(task_status: trio.TaskStatus[trio.CancelScope]) -> None:
                    with trio.CancelScope() as scope:
                        task_status.started(scope)
                        await pull.recv_batch(8)
                    assert scope.cancelled_caught

                scope = await nursery.start(receiver)
                await trio.testing.wait_all_tasks_blocked()
                scope.cancel()
            await push.send(b"a")
            await push.send(b"b")
            with trio.CancelScope() as scope:  # entered cancelled: takes nothing
                scope.cancel()
                await pull.recv_batch(8)
            assert scope.cancelled_caught
            assert await pull.recv_batch(8) == [b"a", b"b"]
            pull.close()
            with pytest.raises(trio.ClosedResourceError):
                await pull.recv_batch(1)
