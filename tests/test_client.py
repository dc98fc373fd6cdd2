"""`LookupClient`, against workers played by plain blocking pyzmq sockets in the test thread.

Real clock; every wait has a deadline and waits on something (a worker socket's poll, the
client's condition, or the scheduler API polled the way a scheduler would); nothing sleeps.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

import lmprefetch.bridge as bridge_module
import lmprefetch.client as client_module
from lmprefetch.client import LookupClient
from lmprefetch.config import PrefetchConfig
from lmprefetch.hashing import ChunkHasher
from lmprefetch.protocol import (
    LookupCleanupMsg,
    LookupRequestMsg,
    LookupResponseMsg,
    decode_worker_message,
    encode,
)

from .resources import Snapshot, needs_proc

LIMIT_S = 5.0
CHUNK = 4


def ipc_endpoint() -> str:
    return f"ipc://@lmprefetch-test-{uuid.uuid4().hex}"


class FakeWorker:
    """One worker rank: a PULL bound on its request endpoint, a PUSH to the client."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], rank: int) -> None:
        self.ctx = ctx
        self.rank = rank
        self.endpoint = ipc_endpoint()
        self.pull: zmq.Socket[bytes] = ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.LINGER, 0)
        self.pull.bind(self.endpoint)
        self.push: zmq.Socket[bytes] | None = None

    def connect(self, response_endpoint: str) -> None:
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.LINGER, 0)
        self.push.connect(response_endpoint)

    def recv(self, timeout_s: float = LIMIT_S) -> LookupRequestMsg | LookupCleanupMsg:
        """The next message from the client; fails the test after ``timeout_s``."""
        if not self.pull.poll(int(timeout_s * 1000), zmq.POLLIN):
            raise AssertionError(f"worker {self.rank}: nothing received in {timeout_s} s")
        return decode_worker_message(self.pull.recv())

    def recv_request(self) -> LookupRequestMsg:
        msg = self.recv()
        assert isinstance(msg, LookupRequestMsg), msg
        return msg

    def recv_cleanup(self) -> LookupCleanupMsg:
        msg = self.recv()
        assert isinstance(msg, LookupCleanupMsg), msg
        return msg

    def send_raw(self, buf: bytes) -> None:
        assert self.push is not None
        self.push.send(buf)

    def answer(
        self, lookup_id: str, hit_tokens: int, *, seq: int, worker_id: int | None = None
    ) -> None:
        wid = self.rank if worker_id is None else worker_id
        self.send_raw(encode(LookupResponseMsg(lookup_id, hit_tokens, seq=seq, worker_id=wid)))

    def close(self) -> None:
        self.pull.close(linger=0)
        if self.push is not None:
            self.push.close(linger=0)


Cluster = Callable[..., tuple[LookupClient, list[FakeWorker]]]


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    """Build a client and its fake workers; everything is closed after the test."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    clients: list[LookupClient] = []
    workers: list[FakeWorker] = []

    def make(
        n_workers: int = 2,
        *,
        response_endpoint: str | None = None,
        extra_endpoints: tuple[str, ...] = (),
        **config: Any,
    ) -> tuple[LookupClient, list[FakeWorker]]:
        config.setdefault("chunk_size", CHUNK)
        config.setdefault("lookup_timeout_s", 30.0)
        mine = [FakeWorker(ctx, rank) for rank in range(n_workers)]
        workers.extend(mine)
        client = LookupClient(
            PrefetchConfig(**config),
            [*extra_endpoints, *(w.endpoint for w in mine)],
            response_endpoint or ipc_endpoint(),
        )
        clients.append(client)
        for w in mine:
            w.connect(client.response_endpoint)
        return client, mine

    try:
        yield make
    finally:
        for client in clients:
            client.close()
        for w in workers:
            w.close()
        ctx.term()


def tokens(n_chunks: int, extra: int = 0, start: int = 0) -> list[int]:
    return list(range(start, start + n_chunks * CHUNK + extra))


def assert_no_other_traffic(client: LookupClient, workers: list[FakeWorker]) -> None:
    """Whatever the client queued before this call has already been received: send a marker
    cleanup, which travels behind it on every worker's FIFO pipe, and expect it next."""
    marker = f"marker-{uuid.uuid4().hex}"
    client.cancel(marker)
    for w in workers:
        msg = w.recv()
        assert msg == LookupCleanupMsg(marker, seq=0), f"worker {w.rank} got {msg}"


# -- requests -------------------------------------------------------------------------


def test_first_lookup_sends_one_request_to_every_worker(cluster: Cluster) -> None:
    client, workers = cluster(2, lookup_timeout_s=7.0)
    toks = tokens(5, extra=2)  # the partial tail chunk is not looked up
    before_ms = time.time() * 1000
    assert client.lookup("req-1", toks) is None
    after_ms = time.time() * 1000
    assert client.lookup("req-1", toks) is None  # pending: no second request

    expected = ChunkHasher(CHUNK).hash(toks)
    assert len(expected) == 5
    for w in workers:
        req = w.recv_request()
        assert req.lookup_id == "req-1"
        assert req.hashes == expected
        assert req.offsets == [CHUNK] * 5
        assert req.seq == 1
        assert req.skip_chunks == 0
        assert req.request_configs is None
        assert before_ms + 7000 - 1 <= req.deadline_ms <= after_ms + 7000
    assert_no_other_traffic(client, workers)
    assert client.statistics().submitted == 1
    assert client.statistics().pending == 1


def test_sequence_numbers_increase(cluster: Cluster) -> None:
    client, [w] = cluster(1)
    for i in range(3):
        assert client.lookup(f"r{i}", tokens(1)) is None
    assert [w.recv_request().seq for _ in range(3)] == [1, 2, 3]


def test_partial_chunks_and_options(cluster: Cluster) -> None:
    client, [w] = cluster(1, save_partial_chunks=True, hash_algorithm="sha256")
    toks = tokens(2, extra=3)
    client.lookup("p", toks, skip_tokens=CHUNK * 2 - 1, request_configs={"tag": "x"})
    req = w.recv_request()
    assert req.hashes == ChunkHasher(CHUNK, "sha256", save_partial_chunks=True).hash(toks)
    assert req.offsets == [CHUNK, CHUNK, 3]
    assert req.skip_chunks == 1  # rounded down to whole chunks
    assert req.request_configs == {"tag": "x"}


def test_precomputed_hashes_skip_hashing(cluster: Cluster) -> None:
    client, [w] = cluster(1)
    client.lookup("h", None, hashes=[7, -1, 2**64 - 1], offsets=[4, 4, 2], skip_tokens=100)
    req = w.recv_request()
    assert (req.hashes, req.offsets) == ([7, -1, 2**64 - 1], [4, 4, 2])
    assert req.skip_chunks == 3  # clamped to the number of chunks


def test_lookup_argument_errors(cluster: Cluster) -> None:
    client, _ = cluster(1)
    with pytest.raises(ValueError, match="skip_tokens"):
        client.lookup("a", tokens(1), skip_tokens=-1)
    with pytest.raises(ValueError, match="hashes"):
        client.lookup("a", None, hashes=[1])
    with pytest.raises(ValueError, match="hashes"):
        client.lookup("a", None, hashes=[1], offsets=[4, 4])
    with pytest.raises(ValueError, match="offsets"):
        client.lookup("a", tokens(1), offsets=[4])
    with pytest.raises(ValueError, match=r"^load_policy: must be one of .* got 'x:Y'$"):
        client.lookup("a", tokens(1), load_policy="x:Y")
    assert client.statistics().submitted == 0


@pytest.mark.parametrize("precomputed", [False, True], ids=["hashed", "precomputed"])
def test_a_lookups_own_load_policy_reaches_every_worker(
    cluster: Cluster, precomputed: bool
) -> None:
    client, workers = cluster(2)
    if precomputed:
        client.lookup("p", None, hashes=[7], offsets=[4], load_policy="always")
    else:
        client.lookup("p", tokens(2), load_policy="always")
    client.lookup("q", tokens(2))
    for w in workers:
        assert w.recv_request().load_policy == "always"
        assert w.recv_request().load_policy == ""  # the workers' own


def test_tokens_appended_after_submit_are_not_hashed(cluster: Cluster) -> None:
    client, [w] = cluster(1)
    toks = tokens(2)
    client.lookup("grow", toks)
    toks.extend(tokens(3, start=1000))  # the engine appends before the bridge hashes
    assert w.recv_request().hashes == ChunkHasher(CHUNK).hash(tokens(2))


def test_unhashable_prompt_answers_zero(cluster: Cluster, caplog: pytest.LogCaptureFixture) -> None:
    client, [w] = cluster(1)
    caplog.set_level(logging.WARNING, logger="lmprefetch.client")
    client.lookup("bad", ["not", "tokens"])
    assert client.wait("bad", LIMIT_S) == 0
    assert client.lookup("bad", []) == 0
    assert client.statistics().hash_errors == 1
    assert "cannot build the request" in caplog.text
    assert_no_other_traffic(client, [w])  # nothing was sent for it


def test_cancel_of_an_id_that_cannot_be_encoded_leaves_the_bridge_alive(
    cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    """Found by fuzzing the client's arguments: an id that is not UTF-8 text (lone
    surrogates) cannot be encoded.  Its lookup answered 0, but cancel() then killed the bridge
    thread with UnicodeEncodeError, and every later lookup raised."""
    client, [w] = cluster(1)
    caplog.set_level(logging.WARNING, logger="lmprefetch.client")
    bad = "req-\udcff"
    client.lookup(bad, tokens(1))
    assert client.wait(bad, LIMIT_S) == 0
    client.cancel(bad)
    assert_no_other_traffic(client, [w])  # nothing could be sent for it; the bridge lives
    assert "nothing to clean up" in caplog.text
    client.lookup("ok", tokens(1))
    w.answer("ok", 4, seq=w.recv_request().seq)
    assert client.wait("ok", LIMIT_S) == 4


# -- answers --------------------------------------------------------------------------


def test_d14_min_over_ranks(cluster: Cluster) -> None:
    client, workers = cluster(2)
    toks = tokens(8)
    assert client.lookup("r", toks) is None
    seqs = [w.recv_request().seq for w in workers]
    workers[0].answer("r", 8 * CHUNK, seq=seqs[0])
    workers[1].answer("r", 3 * CHUNK, seq=seqs[1])
    assert client.wait("r", LIMIT_S) == 3 * CHUNK
    assert client.lookup("r", toks) == 3 * CHUNK  # cached until forget/cancel
    assert client.lookup("r", toks) == 3 * CHUNK
    stats = client.statistics()
    assert (stats.answered, stats.pending) == (1, 0)


def test_d14_duplicate_answer_is_not_double_counted(cluster: Cluster) -> None:
    client, workers = cluster(2)
    client.lookup("d", tokens(4))
    seq = workers[0].recv_request().seq
    # One pipe, so the client sees them in this order.  Were rank 0's duplicate counted as
    # a second rank, the answer would be min(16, 4) = 4 before rank 1 speaks.
    workers[0].answer("d", 16, seq=seq, worker_id=0)
    workers[0].answer("d", 4, seq=seq, worker_id=0)
    workers[0].answer("d", 12, seq=seq, worker_id=1)
    assert client.wait("d", LIMIT_S) == 12
    assert client.statistics().duplicate_answers == 1


def test_lmcache_answers_without_worker_id_count(cluster: Cluster) -> None:
    client, workers = cluster(2)
    client.lookup("l", tokens(4))
    for w in workers:
        w.recv_request()

    def lmcache_answer(lookup_id: str, hits: int) -> bytes:
        # LMCache 0.5.6's LookupResponseMsg: no seq, no worker_id.
        return msgspec.msgpack.encode(
            {"type": "LookupResponseMsg", "lookup_id": lookup_id, "num_hit_tokens": hits}
        )

    workers[0].send_raw(lmcache_answer("l", 16))
    workers[1].send_raw(lmcache_answer("l", 8))
    assert client.wait("l", LIMIT_S) == 8

    # Mixed: an LMCache rank and an lmprefetch rank.
    client.lookup("m", tokens(4))
    seq = workers[0].recv_request().seq
    workers[1].recv_request()
    workers[0].send_raw(lmcache_answer("m", 4))
    workers[1].answer("m", 12, seq=seq)
    assert client.wait("m", LIMIT_S) == 4


def test_d06_stale_answers_after_forget_and_relookup_are_dropped(cluster: Cluster) -> None:
    client, [w] = cluster(1)
    toks = tokens(4)
    client.lookup("reused", toks)
    old_seq = w.recv_request().seq
    client.forget("reused")  # e.g. the request was preempted
    assert client.lookup("reused", toks) is None  # a fresh lookup
    new_seq = w.recv_request().seq
    assert new_seq > old_seq

    w.answer("reused", 4, seq=old_seq)  # the old lookup's answer, arriving late
    w.answer("reused", 16, seq=new_seq)
    assert client.wait("reused", LIMIT_S) == 16
    assert client.statistics().stale_answers_dropped == 1


def test_answers_for_unknown_or_finished_lookups_are_dropped(cluster: Cluster) -> None:
    client, [w] = cluster(1)
    client.lookup("a", tokens(2))
    seq = w.recv_request().seq
    w.answer("nobody", 8, seq=99)
    w.answer("a", 8, seq=seq)
    w.answer("a", 4, seq=seq, worker_id=5)  # after the result: ignored
    client.lookup("b", tokens(2))  # a marker answer, behind the others on the pipe
    seq_b = w.recv_request().seq
    w.answer("b", 0, seq=seq_b)
    assert client.wait("b", LIMIT_S) == 0
    assert client.lookup("a", []) == 8
    assert client.statistics().stale_answers_dropped == 2


def test_malformed_answers_are_counted_and_survived(cluster: Cluster) -> None:
    client, [w] = cluster(1)
    client.lookup("x", tokens(2))
    seq = w.recv_request().seq
    w.send_raw(b"\xc1 not msgpack")
    w.send_raw(encode(LookupCleanupMsg("x")))  # the wrong direction
    w.send_raw(msgspec.msgpack.encode({"type": "LookupResponseMsg", "lookup_id": 3}))
    w.answer("x", -5, seq=seq)  # a negative count
    w.answer("x", 8, seq=seq)
    assert client.wait("x", LIMIT_S) == 8
    assert client.statistics().malformed_answers == 4


# -- timeouts -------------------------------------------------------------------------


def test_d07_timeout_answers_zero_once_then_keeps_answering_zero(
    cluster: Cluster, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.WARNING, logger="lmprefetch.client")
    client, workers = cluster(2, lookup_timeout_s=30.0)
    toks = tokens(4)
    assert client.lookup("slow", toks) is None
    seqs = [w.recv_request().seq for w in workers]
    assert client.lookup("slow", toks) is None  # pending: no answer yet

    # The client's clock moves past the lookup's deadline (nobody ever answers).
    later = time.monotonic() + 30.0
    monkeypatch.setattr(client_module, "_monotonic", lambda: later)
    assert client.lookup("slow", toks) == 0  # the deadline passed
    for w, seq in zip(workers, seqs, strict=True):
        assert w.recv_cleanup() == LookupCleanupMsg("slow", seq=seq)
    for _ in range(100):
        assert client.lookup("slow", toks) == 0  # no KeyError, no new lookup (D07)
    assert client.wait("slow", 0) == 0

    warnings = [r for r in caplog.records if r.name == "lmprefetch.client"]
    assert len(warnings) == 1
    assert warnings[0].levelno == logging.WARNING
    assert "'slow'" in warnings[0].getMessage()
    assert_no_other_traffic(client, workers)  # exactly one cleanup per worker

    # A late answer changes nothing.
    workers[0].answer("slow", 16, seq=seqs[0])
    workers[1].answer("slow", 16, seq=seqs[1])
    assert client.lookup("slow", toks) == 0
    stats = client.statistics()
    assert (stats.timeouts, stats.pending) == (1, 0)

    # forget: the id starts afresh.
    client.forget("slow")
    assert client.lookup("slow", toks) is None
    assert [w.recv_request().seq for w in workers] == [max(seqs) + 1] * 2


def test_wait_runs_into_the_lookup_deadline(
    cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="lmprefetch.client")
    client, [w] = cluster(1, lookup_timeout_s=0.05)
    client.lookup("t", tokens(1))
    seq = w.recv_request().seq
    assert client.wait("t", LIMIT_S) == 0
    assert w.recv_cleanup() == LookupCleanupMsg("t", seq=seq)
    assert client.statistics().timeouts == 1
    assert len(caplog.records) == 1


def test_wait(cluster: Cluster) -> None:
    client, [w] = cluster(1)
    with pytest.raises(KeyError):
        client.wait("unknown", 1)
    client.lookup("w", tokens(1))
    seq = w.recv_request().seq
    assert client.wait("w", 0.01) is None  # not answered yet
    w.answer("w", 4, seq=seq)
    assert client.wait("w", LIMIT_S) == 4


def test_wait_is_woken_by_cancel(cluster: Cluster) -> None:
    client, [w] = cluster(1)
    client.lookup("c", tokens(1))
    w.recv_request()
    results: list[int | None] = []
    waiter = threading.Thread(target=lambda: results.append(client.wait("c", 60)))
    waiter.start()
    client.cancel("c")
    waiter.join(LIMIT_S)
    assert not waiter.is_alive()
    assert results == [None]


# -- cancel and forget ----------------------------------------------------------------


def test_d03_cancel_sends_cleanup_to_every_worker_with_no_other_traffic(
    cluster: Cluster,
) -> None:
    client, workers = cluster(3)
    client.lookup("abort-me", tokens(4))
    seqs = [w.recv_request().seq for w in workers]
    client.cancel("abort-me")  # and nothing else happens on this client
    for w, seq in zip(workers, seqs, strict=True):
        assert w.recv_cleanup() == LookupCleanupMsg("abort-me", seq=seq)
    assert client.statistics().pending == 0

    client.cancel("abort-me")  # idempotent: harmless, same seq
    for w, seq in zip(workers, seqs, strict=True):
        assert w.recv_cleanup() == LookupCleanupMsg("abort-me", seq=seq)

    # After cancel the id starts afresh.
    assert client.lookup("abort-me", tokens(4)) is None
    assert all(w.recv_request().seq == max(seqs) + 1 for w in workers)


def test_cancel_of_unknown_and_forgotten_ids(cluster: Cluster) -> None:
    client, workers = cluster(2)
    client.cancel("never-seen")
    for w in workers:
        assert w.recv_cleanup() == LookupCleanupMsg("never-seen", seq=0)

    client.lookup("done", tokens(1))
    seq = workers[0].recv_request().seq
    workers[1].recv_request()
    workers[0].answer("done", 4, seq=seq, worker_id=0)
    workers[1].answer("done", 4, seq=seq, worker_id=1)
    assert client.wait("done", LIMIT_S) == 4
    client.forget("done")  # scheduled; the workers keep the prefetch
    client.forget("done")  # idempotent
    assert_no_other_traffic(client, workers)  # forget sends nothing
    client.cancel("done")  # the request is aborted later: cleanup with the old seq
    for w in workers:
        assert w.recv_cleanup() == LookupCleanupMsg("done", seq=seq)
    assert client.statistics().cancels == 3  # never-seen, the marker, done


# -- the scheduler never waits --------------------------------------------------------


class ThreadWatch:
    """Records, while :meth:`watching`, what the calling (scheduler) thread does through the
    wrapped functions and locks; other threads (the bridge) are not recorded."""

    def __init__(self) -> None:
        self.thread = threading.get_ident()
        self.active = False
        self.seen: list[str] = []

    def note(self, what: str) -> None:
        if self.active and threading.get_ident() == self.thread:
            self.seen.append(what)

    def wrap(self, what: str, func: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            self.note(what)
            return func(*args, **kwargs)

        return call

    @contextmanager
    def watching(self) -> Iterator[list[str]]:
        self.seen = []
        self.active = True
        try:
            yield self.seen
        finally:
            self.active = False


class LockSpy:
    """Stands in for a lock or condition: notes every use, then delegates."""

    def __init__(self, inner: Any, name: str, watch: ThreadWatch) -> None:
        self._inner, self._name, self._watch = inner, name, watch

    def __enter__(self) -> Any:
        self._watch.note(self._name)
        return self._inner.__enter__()

    def __exit__(self, *exc: Any) -> Any:
        return self._inner.__exit__(*exc)

    def __getattr__(self, attr: str) -> Any:
        self._watch.note(f"{self._name}.{attr}")
        return getattr(self._inner, attr)


class WatchedTokens(Sequence[int]):
    """Token ids whose reads by the watched thread are noted (taking the length is free)."""

    def __init__(self, ids: list[int], watch: ThreadWatch) -> None:
        self._ids, self._watch = ids, watch

    def __len__(self) -> int:
        return len(self._ids)

    def __getitem__(self, index: Any) -> Any:
        self._watch.note("token read")
        return self._ids[index]


def test_d08_pending_poll_is_cheap_and_never_sleeps(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pending poll reads one dict entry and the clock: no lock, no socket, no system call,
    no sleep.  A submit (without hashes) reads only the prompt's length and hands hashing
    and sending to the bridge thread.  (The cost in time is measured by ``lmprefetch bench``.)
    """
    client, [w] = cluster(1)
    watch = ThreadWatch()

    def no_sleep(_: float) -> None:
        raise AssertionError("the scheduler path slept")

    monkeypatch.setattr(time, "sleep", no_sleep)
    table = client._table  # what the client shares with its bridge thread
    for owner, name in (
        (client, "_lock"),
        (client, "_cond"),
        (table, "lock"),
        (table, "cond"),
        (table, "send_lock"),
    ):
        monkeypatch.setattr(owner, name, LockSpy(getattr(owner, name), name, watch))
    for name in ("write", "read"):
        monkeypatch.setattr(os, name, watch.wrap(f"os.{name}", getattr(os, name)))
    for name in ("send", "send_multipart", "recv", "recv_multipart", "poll"):
        method = getattr(zmq.Socket, name)
        monkeypatch.setattr(zmq.Socket, name, watch.wrap(f"socket.{name}", method))
    monkeypatch.setattr(ChunkHasher, "hash", watch.wrap("hash", ChunkHasher.hash))

    toks = WatchedTokens(tokens(128), watch)
    with watch.watching() as seen:
        assert client.lookup("pending", toks) is None
    # Registering takes the lock and wakes the bridge; the prompt is not read here.
    assert "hash" not in seen
    assert "token read" not in seen
    assert not [what for what in seen if what.startswith("socket.")], seen
    req = w.recv_request()  # hashed and sent by the bridge thread
    assert req.hashes == ChunkHasher(CHUNK).hash(tokens(128))

    lookup = client.lookup
    with watch.watching() as seen:
        for _ in range(1000):
            assert lookup("pending", toks) is None
    assert seen == []


def test_many_lookups_in_flight(cluster: Cluster) -> None:
    client, workers = cluster(2)
    n = 300
    for i in range(n):
        assert client.lookup(f"r{i}", tokens(2, start=i)) is None
    for w in workers:
        for i in range(n):
            req = w.recv_request()
            assert req.lookup_id == f"r{i}"
            w.answer(req.lookup_id, i % 9, seq=req.seq)
    for i in range(n):
        assert client.wait(f"r{i}", LIMIT_S) == i % 9
    stats = client.statistics()
    assert (stats.submitted, stats.answered, stats.pending) == (n, n, 0)


def test_dead_worker_at_hwm_drops_instead_of_blocking(cluster: Cluster) -> None:
    # The first endpoint has no worker behind it: its queue fills to the HWM, then the
    # bridge drops (and counts) further messages for it instead of blocking, so the live
    # worker keeps getting every request.
    dead = ipc_endpoint()
    client, [live] = cluster(1, extra_endpoints=(dead,), socket_hwm=2)
    n = 20
    for i in range(n):  # in lock-step, so the live worker's queue never fills
        client.lookup(f"r{i}", tokens(1))
        assert live.recv_request().lookup_id == f"r{i}"
    dropped = client.statistics().sends_dropped
    assert 1 <= dropped <= n - 2


# -- endpoints and lifecycle ----------------------------------------------------------


def test_tcp_response_endpoint_on_port_zero(cluster: Cluster) -> None:
    client, [w] = cluster(1, response_endpoint="tcp://127.0.0.1:0")
    assert client.response_endpoint.startswith("tcp://127.0.0.1:")
    assert not client.response_endpoint.endswith(":0")
    client.lookup("t", tokens(1))
    w.answer("t", 4, seq=w.recv_request().seq)
    assert client.wait("t", LIMIT_S) == 4


def test_constructor_errors() -> None:
    config = PrefetchConfig(chunk_size=CHUNK)
    with pytest.raises(ValueError, match="worker_endpoints"):
        LookupClient(config, [], ipc_endpoint())
    with pytest.raises(ValueError, match="endpoint"):
        LookupClient(config, ["inproc://x"], ipc_endpoint())
    with pytest.raises(ValueError, match="endpoint"):
        LookupClient(config, [ipc_endpoint()], "ipc://@" + "x" * 200)


def test_bind_conflict_raises_and_leaves_no_thread(cluster: Cluster) -> None:
    client, _ = cluster(1)
    threads_before = set(threading.enumerate())
    with pytest.raises(zmq.ZMQError):
        LookupClient(PrefetchConfig(), [ipc_endpoint()], client.response_endpoint)
    assert set(threading.enumerate()) <= threads_before


def test_d19_close_joins_is_idempotent_and_terms_only_its_own_context() -> None:
    other: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    pull = other.socket(zmq.PULL)
    pull.bind("inproc://lmprefetch-test-other")
    push = other.socket(zmq.PUSH)
    push.connect("inproc://lmprefetch-test-other")
    try:
        worker = FakeWorker(other, 0)
        try:
            with LookupClient(
                PrefetchConfig(chunk_size=CHUNK), [worker.endpoint], ipc_endpoint()
            ) as client:
                client.lookup("x", tokens(2))
                worker.recv_request()
                thread = client._bridge.thread
                assert thread.is_alive()
                assert not thread.daemon
            assert not thread.is_alive()  # joined by close()
            assert client.closed
            client.close()  # idempotent
            with pytest.raises(RuntimeError, match="closed"):
                client.lookup("y", tokens(1))
            with pytest.raises(RuntimeError, match="closed"):
                client.lookup("x", tokens(1))  # results are gone too
            client.cancel("x")  # a no-op, not an error
            client.forget("x")
            assert client.statistics().pending == 0
        finally:
            worker.close()

        # The other context and its sockets still work.
        assert not other.closed
        push.send(b"still alive")
        assert pull.poll(int(LIMIT_S * 1000))
        assert pull.recv() == b"still alive"
    finally:
        push.close(linger=0)
        pull.close(linger=0)
        other.term()


@needs_proc
def test_d19_close_releases_the_clients_threads_sockets_and_context() -> None:
    """What the client made is gone once close() returns: its bridge thread, its ZeroMQ
    context (whose I/O and reaper threads live until it is terminated) and every file
    descriptor it opened (sockets, eventfds, epoll).  (That another context survives is
    checked above.)"""
    before = Snapshot.take()
    threads_before = set(threading.enumerate())
    # Nobody listens on the worker endpoint: no peer in this process holds a connection.
    client = LookupClient(PrefetchConfig(chunk_size=CHUNK), [ipc_endpoint()], ipc_endpoint())
    try:
        client.lookup("x", tokens(2))
        assert before.new_fds()  # sockets and the context's eventfds are open now
    finally:
        client.close()
    assert set(threading.enumerate()) == threads_before  # the bridge thread was joined
    assert before.new_zmq_threads() == {}  # the context was terminated: no ZMQbg thread
    assert before.new_fds() == set()  # every socket, eventfd and epoll fd is closed
    client.close()  # idempotent


def test_close_wakes_waiters(cluster: Cluster) -> None:
    client, [w] = cluster(1)
    client.lookup("z", tokens(1))
    w.recv_request()
    results: list[int | None] = []
    waiter = threading.Thread(target=lambda: results.append(client.wait("z", 60)))
    waiter.start()
    client.close()
    waiter.join(LIMIT_S)
    assert not waiter.is_alive()
    assert results == [None]


def test_lookups_from_many_threads(cluster: Cluster) -> None:
    client, [w] = cluster(1)
    n_threads, per_thread = 4, 50
    barrier = threading.Barrier(n_threads)

    def submit(t: int) -> None:
        barrier.wait()
        for i in range(per_thread):
            client.lookup(f"t{t}-{i}", tokens(1, start=i))
            client.lookup(f"t{t}-{i}", tokens(1, start=i))

    threads = [threading.Thread(target=submit, args=(t,)) for t in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(LIMIT_S)
    seen = [w.recv_request() for _ in range(n_threads * per_thread)]
    assert len({r.lookup_id for r in seen}) == n_threads * per_thread
    assert sorted(r.seq for r in seen) == list(range(1, n_threads * per_thread + 1))
    assert_no_other_traffic(client, [w])


def test_process_exits_when_close_is_forgotten() -> None:
    # The bridge thread is not a daemon (close() joins it), so it must notice on its own
    # that the main thread ended, or a forgotten close() would hang interpreter exit.
    script = (
        "import uuid\n"
        "from lmprefetch.client import LookupClient\n"
        "from lmprefetch.config import PrefetchConfig\n"
        "c = LookupClient(PrefetchConfig(), ['ipc://@lmprefetch-test-' + uuid.uuid4().hex],"
        " 'ipc://@lmprefetch-test-' + uuid.uuid4().hex)\n"
        "c.lookup('a', list(range(1000)))\n"
    )
    done = subprocess.run(
        [sys.executable, "-W", "error", "-c", script],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "never closed" in done.stderr


def test_submit_racing_the_bridge_wake_up_is_not_lost(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lookup submitted while the bridge thread is consuming a wake-up must still wake it.

    The bridge's wake-up handling is run with a scheduler-side submit injected at its most
    dangerous point (just before it reads the wake-up fd).  Then a further lookup must reach
    the worker through its wake-up: the bridge's idle timeout is an hour here, so a lost
    wake-up shows as no request within the test's deadline.
    """
    monkeypatch.setattr(bridge_module, "_IDLE_CHECK_MS", 3_600_000)
    client, (worker,) = cluster(1)
    real_clear = client._table.waker.clear
    injected: list[str] = []

    def clear_with_a_racing_submit() -> None:
        if not injected:
            injected.append("race")
            client.lookup("race", list(range(CHUNK)))  # the scheduler thread, interleaved
        real_clear()

    client._table.waker.clear = clear_with_a_racing_submit  # type: ignore[method-assign]
    client.lookup("first", list(range(CHUNK)))
    ids = {worker.recv_request().lookup_id, worker.recv_request().lookup_id}
    assert ids == {"first", "race"}
    client.lookup("after", list(range(CHUNK)))
    assert worker.recv_request().lookup_id == "after"
