"""Wire fuzzing: hostile frames against the decoders, the worker's server and the client bridge.

The frames come from ``tests/fuzz/frames.py`` (raw msgpack built byte by byte: every type in
every field, edge integers, invalid UTF-8, lying lengths, nesting up to 100,000 deep, mutated
valid frames); the checks from ``tests/fuzz/targets.py``, which the coverage-guided fuzzer
(``nox -s fuzz``) shares.  Example counts are modest here so the suite stays fast; set
``LMPF_FUZZ_SCALE`` (a factor, e.g. 50) to run more.

Real sockets (abstract ipc), real clock; every wait is on a socket or the client's condition
under a deadline, never a sleep.
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import pytest
import trio
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmprefetch import LookupClient, PrefetchConfig, open_engine, serve_lookups
from lmprefetch.protocol import (
    LookupRequestMsg,
    LookupResponseMsg,
    decode_response,
    decode_worker_message,
    encode,
)
from lmprefetch.transport import TrioZmqSocket, make_pull

from .fakes import FakeTier
from .fuzz import budget
from .fuzz.frames import (
    TAGS,
    cleanup_frames,
    deep_nesting,
    hostile_frames,
    request_frames,
    response_frames,
    weighted,
)
from .fuzz.targets import (
    CHUNK,
    HandleHarness,
    Outcome,
    assert_idle,
    check_response_frame,
    check_worker_frame,
    classify_response_frame,
    classify_worker_frame,
    fill_stored_prompts,
    harness_config,
    join_frames,
    known_hashes,
)

pytestmark = pytest.mark.filterwarnings(
    # A failing example holding a 100,000-deep frame has a long repr; show the failure anyway.
    "ignore:Generating overly large repr:hypothesis.errors.HypothesisWarning"
)

LIMIT_S = 60.0  # a deadline that only a lost message reaches


def fuzz_settings(examples: int) -> settings:
    return budget.fuzz_settings(examples, HealthCheck.data_too_large)


_hashes = st.one_of(st.sampled_from(known_hashes()), st.integers(-(2**63), 2**64 - 1))
#: Frames for a worker: valid requests (often for cached prompts) and cleanups, and everything
#: a hostile peer could make of them.
worker_frames = hostile_frames(
    weighted((3, request_frames(_hashes)), (1, cleanup_frames)), hashes=_hashes
)
#: Frames for the client: valid answers (for other lookups) and everything made of them.
answer_frames = hostile_frames(response_frames)


# -- (a) the decoders -------------------------------------------------------------------------
@fuzz_settings(400)
@given(worker_frames)
def test_worker_decoder_only_raises_decode_error_and_whatever_decodes_can_be_answered(
    frame: bytes,
) -> None:
    check_worker_frame(frame)
    check_response_frame(frame)  # the wrong decoder for it: still only DecodeError


@fuzz_settings(400)
@given(st.one_of(answer_frames, hostile_frames(response_frames, tags=("LookupResponseMsg",))))
def test_response_decoder_only_raises_decode_error_and_whatever_decodes_re_encodes(
    frame: bytes,
) -> None:
    check_response_frame(frame)
    check_worker_frame(frame)


@fuzz_settings(30)
@given(deep_nesting(min_depth=900, max_depth=100_000), st.sampled_from(TAGS))
def test_nesting_up_to_100_000_deep_is_a_decode_error_anywhere(nest: bytes, tag: str) -> None:
    """As the whole frame or as the tag it is malformed; as the value of an unknown field it
    is skipped or malformed (msgspec's recursion limit), and never anything else."""
    for frame in (nest, b"\x81\xa4type" + nest):
        assert check_worker_frame(frame).kind == "malformed"
        assert check_response_frame(frame).kind == "malformed"
    head = msgspec.msgpack.encode({"type": tag, "lookup_id": "x", "num_hit_tokens": 0})
    frame = bytes([head[0] + 1]) + head[1:] + b"\xa1j" + nest
    assert check_worker_frame(frame).kind in ("malformed", "cleanup", "invalid")
    assert check_response_frame(frame).kind in ("malformed", "response")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        (field, value)
        for field in ("seq", "deadline_ms", "skip_chunks", "num_hit_tokens", "worker_id")
        for value in (-(2**63), -1, 2**31, 2**63 - 1, 2**63, 2**64 - 1)
    ]
    + [("hashes", [-(2**63), 2**64 - 1]), ("offsets", [2**63, 2**63]), ("offsets", [0])],
)
def test_integer_extremes_in_every_field_decode_only_to_answerable_messages(
    field: str, value: object
) -> None:
    for tag in TAGS:
        fields = {"type": tag, "lookup_id": "x", "hashes": [1, 2], "offsets": [4, 4]}
        fields["num_hit_tokens"] = 4
        check_worker_frame(msgspec.msgpack.encode({**fields, field: value}))
        check_response_frame(msgspec.msgpack.encode({**fields, field: value}))


# -- (b) the worker's server, over real sockets ----------------------------------------------------
class Scheduler:
    """The scheduler's end of one worker: a blocking PUSH for requests (never at its high-water
    mark here) and a Trio-native PULL for answers, so a wait for an answer is cancelled at once
    when the server fails instead of running into its deadline."""

    def __init__(self, request_ep: str, response_ep: str) -> None:
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.linger = 0
        self.push.connect(request_ep)
        self.pull = TrioZmqSocket(make_pull(self.ctx, response_ep, bind=True, hwm=100_000))

    def send(self, frame: bytes) -> None:
        self.push.send(frame)

    async def answers_until(
        self, done: Callable[[list[LookupResponseMsg]], bool]
    ) -> list[LookupResponseMsg]:
        got: list[LookupResponseMsg] = []
        while not done(got):
            got.append(decode_response(await self.pull.recv()))  # every answer decodes
        return got

    def close(self) -> None:
        self.push.close()
        self.pull.close()
        self.ctx.term()


async def _serve_hostile_frames(frames: list[bytes]) -> None:
    oracle = [classify_worker_frame(f) for f in frames]
    kinds = Counter(o.kind for o in oracle)
    sent: Counter[tuple[str, int]] = Counter()
    for o in oracle:
        if o.kind in ("request", "invalid"):
            sent[(o.msg.lookup_id, o.msg.seq)] += 1
    tag = uuid.uuid4().hex
    req, resp = f"ipc://@lmp-fuzz-{tag}-req", f"ipc://@lmp-fuzz-{tag}-resp"
    sentinel, last = f"sentinel-{tag}", f"last-{tag}"
    slow = FakeTier("slow")
    peer = Scheduler(req, resp)
    try:
        with trio.fail_after(LIMIT_S):
            async with (
                open_engine(harness_config(), rank=1, world_size=2, extra_tiers=[slow]) as engine,
                serve_lookups(engine, req, resp) as server,
            ):
                await fill_stored_prompts(engine, slow)
                for frame in frames:
                    peer.send(frame)
                peer.send(encode(LookupRequestMsg(sentinel, [1], [CHUNK], seq=1)))
                # One connection keeps order: once the sentinel is answered, every frame before
                # it has been handled (answers of lookups still loading may come later).
                answers = await peer.answers_until(
                    lambda got: any(a.lookup_id == sentinel for a in got)
                )
                stats = server.statistics()
                received = kinds["request"] + kinds["invalid"] + 1
                assert stats.cleanups_received == kinds["cleanup"]
                assert stats.requests_received == received
                assert stats.requests_accepted + stats.requests_stale == received
                # A stale request is dropped before it is checked (the receive-path test
                # checks which, frame by frame).
                most_malformed = kinds["malformed"] + kinds["invalid"]
                assert 0 <= most_malformed - stats.messages_malformed <= stats.requests_stale
                # Every lookup still running or held answers now (a cancelled one: 0).
                engine.cancel_all()
                await engine.wait_quiet()
                stats = server.statistics()
                accepted = stats.requests_accepted
                # Every answer exists now: sent, or queued for the send task.
                assert stats.answers_sent + stats.answers_queued == accepted, stats
                assert engine.statistics().lookups.failed == 0
                answers += await peer.answers_until(lambda got: len(answers) + len(got) >= accepted)
                peer.send(encode(LookupRequestMsg(last, [1], [CHUNK], seq=1)))
                after = await peer.answers_until(bool)
                assert [a.lookup_id for a in after] == [last], "more answers than requests"
                seen = Counter((a.lookup_id, a.seq) for a in answers if a.lookup_id != sentinel)
                for key, n in seen.items():
                    assert n <= sent[key], f"{key} answered {n} times for {sent[key]} requests"
                assert all(a.worker_id == 1 for a in answers)
                stats = server.statistics()
                assert stats.answers_sent == stats.requests_accepted == accepted + 1
                assert stats.answers_queued == 0
                assert server.failure is None
                await engine.wait_quiet()
                assert_idle(engine)
    finally:
        peer.close()


@fuzz_settings(8)
@given(st.lists(worker_frames, min_size=1, max_size=60))
def test_the_server_survives_hostile_frames_and_answers_each_accepted_request_once(
    frames: list[bytes],
) -> None:
    trio.run(_serve_hostile_frames, frames)


@fuzz_settings(40)
@given(st.lists(worker_frames, min_size=1, max_size=12))
def test_the_receive_path_keeps_count_and_answers_once_on_a_live_engine(
    harness: HandleHarness, frames: list[bytes]
) -> None:
    """``LookupServer._handle`` straight on a live engine (no sockets): many more frames."""
    harness.run(join_frames(frames))


@pytest.fixture(scope="module")
def harness() -> Iterator[HandleHarness]:
    with HandleHarness() as h:
        yield h


# -- (c) the client's bridge thread ---------------------------------------------------------------
@fuzz_settings(15)
@given(st.lists(answer_frames, max_size=40), st.integers(0, 2**63 - 1))
def test_hostile_answers_never_stop_the_client_bridge(frames: list[bytes], hit: int) -> None:
    """Garbage and answers for other lookups are counted (malformed or stale) and dropped; a
    later valid answer still resolves the lookup."""
    oracle: list[Outcome] = [classify_response_frame(f) for f in frames]
    target = f"target-{uuid.uuid4().hex}"  # no generated frame can name it
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    worker_ep = f"ipc://@lmp-fuzz-{uuid.uuid4().hex}"
    pull = ctx.socket(zmq.PULL)
    pull.linger = 0
    pull.bind(worker_ep)
    push = ctx.socket(zmq.PUSH)
    push.linger = 0
    config = PrefetchConfig(chunk_size=CHUNK, lookup_timeout_s=LIMIT_S)
    try:
        with LookupClient(config, [worker_ep], f"ipc://@lmp-fuzz-{uuid.uuid4().hex}") as client:
            push.connect(client.response_endpoint)
            assert client.lookup(target, list(range(8))) is None
            assert pull.poll(int(LIMIT_S * 1000))
            request = decode_worker_message(pull.recv())
            for frame in frames:
                push.send(frame)
            push.send(encode(LookupResponseMsg(target, hit, seq=request.seq, worker_id=0)))
            assert client.wait(target, LIMIT_S) == hit
            stats = client.statistics()
            assert stats.malformed_answers == sum(o.kind == "malformed" for o in oracle)
            assert stats.stale_answers_dropped == sum(o.kind == "response" for o in oracle)
            assert client._table.failure is None and client._bridge.thread.is_alive()
    finally:
        pull.close()
        push.close()
        ctx.term()


# Lookup ids as an engine might hand them over: any text, now and then with lone surrogates
# (a str that cannot be encoded: what os.fsdecode makes of bytes that are not UTF-8).
_lookup_ids = weighted(
    (6, st.text(max_size=8)),
    (1, st.binary(min_size=1, max_size=4).map(lambda b: b.decode("utf-8", "surrogateescape"))),
)
_wide_ints = st.one_of(st.integers(-(2**70), 2**70), st.sampled_from([-(2**63), 2**64 - 1]))
_client_calls = st.one_of(
    st.tuples(
        st.just("lookup"),
        _lookup_ids,
        st.one_of(st.lists(st.integers(0, 50_000), max_size=12), st.lists(_wide_ints, max_size=5)),
        st.one_of(st.just(0), st.integers(-3, 16)),
        st.one_of(st.none(), st.lists(_wide_ints, max_size=4)),
        st.one_of(st.none(), st.lists(_wide_ints, max_size=4)),
    ),
    st.tuples(st.sampled_from(["cancel", "forget"]), _lookup_ids),
)


@fuzz_settings(25)
@given(st.lists(_client_calls, min_size=1, max_size=8), st.integers(0, 2**63 - 1))
def test_any_lookup_arguments_never_stop_the_client_bridge(
    calls: list[tuple[Any, ...]], hit: int
) -> None:
    """Whatever the engine passes to ``lookup``, ``cancel`` and ``forget`` (ids that cannot be
    encoded, tokens or hashes outside 64 bits, bad ``skip_tokens``), a call either works or
    raises ``ValueError``, and the bridge thread lives on: a later lookup is still answered."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    worker_ep = f"ipc://@lmp-fuzz-{uuid.uuid4().hex}"
    pull = ctx.socket(zmq.PULL)
    pull.linger = 0
    pull.bind(worker_ep)
    push = ctx.socket(zmq.PUSH)
    push.linger = 0
    config = PrefetchConfig(chunk_size=CHUNK, lookup_timeout_s=LIMIT_S)
    probe = f"probe-{uuid.uuid4().hex}"
    died = pull.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    try:
        with LookupClient(config, [worker_ep], f"ipc://@lmp-fuzz-{uuid.uuid4().hex}") as client:
            push.connect(client.response_endpoint)
            for op, lookup_id, *args in calls:
                if op == "lookup":
                    tokens, skip, hashes, offsets = args
                    try:
                        client.lookup(
                            lookup_id, tokens, skip_tokens=skip, hashes=hashes, offsets=offsets
                        )
                    except ValueError:
                        pass
                else:
                    getattr(client, op)(lookup_id)
            assert client.lookup(probe, list(range(8))) is None
            # The bridge sends the probe's request after everything the calls above queued;
            # if it dies on the way it closes its sockets, which the monitor reports at once.
            poller = zmq.Poller()
            poller.register(pull, zmq.POLLIN)
            poller.register(died, zmq.POLLIN)
            while True:
                ready = dict(poller.poll(int(LIMIT_S * 1000)))
                assert ready, "neither the probe's request nor a disconnect came"
                assert died not in ready, f"the bridge thread died: {client._table.failure!r}"
                msg = decode_worker_message(pull.recv())
                if isinstance(msg, LookupRequestMsg) and msg.lookup_id == probe:
                    break
            push.send(encode(LookupResponseMsg(probe, hit, seq=msg.seq, worker_id=0)))
            assert client.wait(probe, LIMIT_S) == hit
            assert client._table.failure is None and client._bridge.thread.is_alive()
    finally:
        pull.disable_monitor()
        died.close()
        pull.close()
        push.close()
        ctx.term()
