"""Compatibility with LMCache 0.5.6 itself (``nox -s lmcache``; skipped without ``lmcache``).

* Wire: LMCache's real message classes (``lmcache.v1.lookup_client.async_lookup_message``)
  against ours, both directions, through each side's own decoder types.
* Interop over real ipc sockets: LMCache's scheduler-side ``LMCacheAsyncLookupClient`` against
  an lmprefetch worker (``WorkerRuntime`` serving lookups), and our ``LookupClient`` against
  LMCache's ``LMCacheAsyncLookupServer`` in front of a stand-in engine.
* The side-by-side benchmark (``examples/bench_lmcache_peer.py``) with tiny settings.

Waits are on events and conditions with deadlines.  The one loop is LMCache's own client API
driven as vLLM's scheduler drives it, one ``lookup_cache`` per step; LMCache paces it with its
``lookup_backoff_time`` (set to 1 ms here).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from lmprefetch import ChunkHasher, LookupClient, PrefetchConfig, WorkerRuntime
from lmprefetch.protocol import (
    LookupCleanupMsg,
    LookupRequestMsg,
    LookupResponseMsg,
    decode_response,
    decode_worker_message,
    encode,
)

# Before LMCache is imported or builds anything: no usage telemetry, only its warnings logged.
os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")

# LMCache's loggers attach opentelemetry's deprecated LoggingHandler when its modules are
# imported, which the suite's ``filterwarnings = error`` would turn into a collection error.
_LOGGING_HANDLER_WARNING = "ignore:.*LoggingHandler.*:DeprecationWarning"
with warnings.catch_warnings():
    warnings.filterwarnings("ignore", ".*LoggingHandler.*", DeprecationWarning)
    pytest.importorskip("lmcache")
    import torch
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.lookup_client import async_lookup_message as lmc
    from lmcache.v1.lookup_client.lmcache_async_lookup_client import (
        LMCacheAsyncLookupClient,
        LMCacheAsyncLookupServer,
    )
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.rpc_utils import get_zmq_rpc_path_lmcache

pytestmark = [pytest.mark.lmcache, pytest.mark.filterwarnings(_LOGGING_HANDLER_WARNING)]

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
CHUNK = 4
TIMEOUT_S = 20.0

# LMCache's decoders, built the way its server and client build them.
THEIR_WORKER_DECODER = msgspec.msgpack.Decoder(lmc.LookupRequestMsg | lmc.LookupCleanupMsg)
THEIR_RESPONSE_DECODER = msgspec.msgpack.Decoder(lmc.LookupResponseMsg)

lookup_ids = st.text(max_size=40)
hashes = st.lists(st.integers(min_value=-(2**63), max_value=2**64 - 1), max_size=40)
configs = st.none() | st.dictionaries(st.text(max_size=10), st.text(max_size=10), max_size=4)


# -- wire ------------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", ["LookupRequestMsg", "LookupResponseMsg", "LookupCleanupMsg"])
def test_same_tags_and_field_order(cls: str) -> None:
    theirs, ours = getattr(lmc, cls), globals()[cls]
    assert theirs.__struct_config__.tag_field == ours.__struct_config__.tag_field == "type"
    assert theirs.__struct_config__.tag == ours.__struct_config__.tag == cls
    # Their fields are ours, in the same order; ours only append.
    assert ours.__struct_fields__[: len(theirs.__struct_fields__)] == theirs.__struct_fields__


@settings(max_examples=200, deadline=None)
@given(lookup_ids, hashes, configs)
def test_their_request_decodes_here(lookup_id: str, hs: list[int], rc: Any) -> None:
    offsets = [CHUNK] * len(hs)
    buf = msgspec.msgpack.encode(lmc.LookupRequestMsg(lookup_id, hs, offsets, rc))
    msg = decode_worker_message(buf)
    assert msg == LookupRequestMsg(lookup_id, hs, offsets, rc)
    assert (msg.seq, msg.deadline_ms, msg.skip_chunks) == (0, 0, 0)


@settings(max_examples=100, deadline=None)
@given(lookup_ids)
def test_their_cleanup_decodes_here(lookup_id: str) -> None:
    msg = decode_worker_message(msgspec.msgpack.encode(lmc.LookupCleanupMsg(lookup_id)))
    assert msg == LookupCleanupMsg(lookup_id, seq=0)


@settings(max_examples=100, deadline=None)
@given(lookup_ids, st.integers(min_value=0, max_value=2**40))
def test_their_response_decodes_here(lookup_id: str, n: int) -> None:
    msg = decode_response(msgspec.msgpack.encode(lmc.LookupResponseMsg(lookup_id, n)))
    assert msg == LookupResponseMsg(lookup_id, n, seq=0, worker_id=-1)


@settings(max_examples=200, deadline=None)
@given(
    lookup_ids,
    hashes,
    configs,
    st.integers(min_value=0, max_value=2**63 - 1),
    st.integers(min_value=0, max_value=2**63 - 1),
)
def test_our_request_decodes_in_lmcache(
    lookup_id: str, hs: list[int], rc: Any, seq: int, deadline_ms: int
) -> None:
    offsets = [CHUNK] * len(hs)
    ours = LookupRequestMsg(
        lookup_id, hs, offsets, rc, seq=seq, deadline_ms=deadline_ms, skip_chunks=len(hs) // 2
    )
    theirs = THEIR_WORKER_DECODER.decode(encode(ours))
    assert theirs == lmc.LookupRequestMsg(lookup_id, hs, offsets, rc)


@settings(max_examples=100, deadline=None)
@given(lookup_ids, st.integers(min_value=0, max_value=2**63 - 1))
def test_our_cleanup_decodes_in_lmcache(lookup_id: str, seq: int) -> None:
    theirs = THEIR_WORKER_DECODER.decode(encode(LookupCleanupMsg(lookup_id, seq=seq)))
    assert theirs == lmc.LookupCleanupMsg(lookup_id)


@settings(max_examples=100, deadline=None)
@given(
    lookup_ids,
    st.integers(min_value=0, max_value=2**40),
    st.integers(min_value=0, max_value=2**63 - 1),
    st.integers(min_value=-1, max_value=1024),
)
def test_our_response_decodes_in_lmcache(lookup_id: str, n: int, seq: int, rank: int) -> None:
    theirs = THEIR_RESPONSE_DECODER.decode(
        encode(LookupResponseMsg(lookup_id, n, seq=seq, worker_id=rank))
    )
    assert theirs == lmc.LookupResponseMsg(lookup_id, n)


def test_map_keys_start_with_theirs() -> None:
    """Same msgpack map layout: the tag, then LMCache's fields in its order, then ours."""
    pairs = [
        (lmc.LookupRequestMsg("r", [1, -2], [4, 4], None), LookupRequestMsg("r", [1, -2], [4, 4])),
        (lmc.LookupResponseMsg("r", 8), LookupResponseMsg("r", 8)),
        (lmc.LookupCleanupMsg("r"), LookupCleanupMsg("r")),
    ]
    for theirs, ours in pairs:
        their_map = msgspec.msgpack.decode(msgspec.msgpack.encode(theirs))
        our_map = msgspec.msgpack.decode(encode(ours))
        assert list(our_map)[: len(their_map)] == list(their_map)
        assert {k: our_map[k] for k in their_map} == their_map


def test_wrong_message_is_rejected_alike() -> None:
    """Each side's decoder rejects the other direction's message with a ValidationError."""
    request = msgspec.msgpack.encode(lmc.LookupRequestMsg("r", [1], [4]))
    response = encode(LookupResponseMsg("r", 4))
    with pytest.raises(msgspec.ValidationError):
        decode_response(request)
    with pytest.raises(msgspec.ValidationError):
        THEIR_WORKER_DECODER.decode(response)
    with pytest.raises(msgspec.ValidationError):
        THEIR_RESPONSE_DECODER.decode(encode(LookupRequestMsg("r", [1], [4])))


# -- interop over ipc ------------------------------------------------------------------------


def _lmcache_parts(engine_id: str) -> tuple[Any, Any]:
    config = LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK,
        enable_async_loading=True,
        lookup_timeout_ms=int(TIMEOUT_S * 1000),
        extra_config={"lookup_backoff_time": 0.001},
    )
    metadata = LMCacheMetadata(
        model_name="m",
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=torch.bfloat16,
        kv_shape=(1, 2, CHUNK, 1, 8),
        role="scheduler",
        engine_id=engine_id,
        kv_connector_extra_config={"lmcache_rpc_port": 0},
    )
    return config, metadata


def _lmcache_endpoints(engine_id: str) -> tuple[str, str]:
    """(worker request endpoint, scheduler answer endpoint) where LMCache puts them."""
    worker = get_zmq_rpc_path_lmcache(engine_id, "lookup_worker", 0, 0)
    scheduler = get_zmq_rpc_path_lmcache(engine_id, "lookup_scheduler", 0, 0)
    return f"ipc://{worker}", f"ipc://{scheduler}"


def _close_lmcache_peer(peer: Any, endpoint: str, wake_up: Any) -> None:
    """Close LMCache's client or server without crashing the process.

    In 0.5.6 their ``close()`` closes the socket that their receive thread is blocked on,
    from the calling thread; libzmq then aborts the process now and then.  So first stop the
    loop and wake the thread with one harmless frame on its own socket, join it, and only then
    let ``close()`` release the sockets and the context.
    """
    peer.running = False
    ctx = zmq.Context()
    try:
        push = ctx.socket(zmq.PUSH)
        push.linger = 1000
        push.connect(endpoint)
        push.send(encode(wake_up))
        peer.thread.join(TIMEOUT_S)
        assert not peer.thread.is_alive(), "LMCache's receive thread did not stop"
        push.close()
    finally:
        ctx.term()
    peer.close()


def _poll_lmcache(client: Any, lookup_id: str) -> int:
    """Ask LMCache's client once per 'scheduler step' until it has an answer."""
    deadline = time.monotonic() + TIMEOUT_S
    while (result := client.lookup_cache(lookup_id)) is None:
        assert time.monotonic() < deadline, f"LMCache's client got no answer for {lookup_id}"
    return int(result)


@pytest.fixture
def engine_id() -> Iterator[str]:
    """A fresh LMCache engine id; its ipc socket files (under LMCache's fixed base directory,
    ``/tmp/vllm_rpc`` without vLLM) are removed afterwards."""
    engine_id = f"lmprefetch-test-{uuid.uuid4().hex[:12]}"
    yield engine_id
    for endpoint in _lmcache_endpoints(engine_id):
        Path(endpoint.removeprefix("ipc://")).unlink(missing_ok=True)


@pytest.fixture
def lmcache_client_and_worker(engine_id: str) -> Iterator[tuple[Any, WorkerRuntime]]:
    request_ep, response_ep = _lmcache_endpoints(engine_id)
    config = PrefetchConfig(chunk_size=CHUNK, chunk_bytes=64, cpu_bytes=64 * 64)
    runtime = WorkerRuntime.start(
        config, request_endpoint=request_ep, response_endpoint=response_ep
    )
    try:
        client = LMCacheAsyncLookupClient(*_lmcache_parts(engine_id))
        try:
            yield client, runtime
        finally:
            _close_lmcache_peer(client, response_ep, LookupResponseMsg("wake-up", 0))
    finally:
        runtime.close()


def _watch_cancels(runtime: WorkerRuntime) -> dict[str, threading.Event]:
    """Events set when the worker's engine is asked to cancel (a cleanup message arrived)."""
    engine = runtime.engine
    original = engine.cancel
    seen: dict[str, threading.Event] = {}

    def cancel(lookup_id: str, *, seq: int | None = None) -> None:
        original(lookup_id, seq=seq)
        seen.setdefault(lookup_id, threading.Event()).set()

    engine.cancel = cancel  # type: ignore[method-assign]
    return seen


def test_lmcache_client_against_lmprefetch_worker(
    lmcache_client_and_worker: tuple[Any, WorkerRuntime],
) -> None:
    client, runtime = lmcache_client_and_worker
    tokens = list(range(10 * CHUNK + 2))  # 10 full chunks and a partial one LMCache drops
    their_hashes = [h for _, _, h in client.token_database.process_tokens(tokens, make_key=False)]
    assert len(their_hashes) == 10
    payloads = [bytes([i]) * 64 for i in range(10)]
    assert runtime.store_hashes(their_hashes[:6], payloads[:6]) == 6

    # The adapter's sequence: lookup_cache → -1 (unknown: submit) → lookup() → poll.
    assert client.lookup_cache("req-1") == -1  # unknown: registered, the caller submits
    assert client.lookup(tokens, "req-1") is None
    assert _poll_lmcache(client, "req-1") == 6 * CHUNK
    with runtime.claim("req-1") as chunks:
        assert [bytes(buf.view()) for _, buf in chunks] == payloads[:6]
    client.clear_lookup_status("req-1")

    # A miss, and a request LMCache's client aborts: its cleanup reaches our worker.
    assert client.lookup_cache("miss") == -1
    client.lookup([10_000 + t for t in range(3 * CHUNK)], "miss")
    assert _poll_lmcache(client, "miss") == 0
    client.clear_lookup_status("miss")

    cancels = _watch_cancels(runtime)
    assert client.lookup_cache("req-2") == -1
    client.lookup(tokens, "req-2")
    assert _poll_lmcache(client, "req-2") == 6 * CHUNK
    client.cancel_lookup("req-2")
    client.lookup_cache("any-later-poll")  # LMCache sends pending cleanups on its next poll
    assert cancels.setdefault("req-2", threading.Event()).wait(TIMEOUT_S)
    with runtime.claim("req-2") as chunks:
        assert chunks == []
    assert runtime.is_idle()


class StubLMCacheEngine:
    """What ``LMCacheAsyncLookupServer`` calls on an ``LMCacheEngine``; answers at once for the
    prefix of chunk hashes it 'has'."""

    def __init__(self, stored: set[int]) -> None:
        self.stored = stored
        self.server: Any = None
        self.requests: list[dict[str, Any]] = []
        self.cleaned: dict[str, threading.Event] = {}

    def async_lookup_and_prefetch(
        self,
        lookup_id: str,
        hashes: list[int],
        offsets: list[int],
        pin: bool,
        request_configs: dict[str, str] | None,
    ) -> None:
        self.requests.append(
            {
                "lookup_id": lookup_id,
                "hashes": hashes,
                "offsets": offsets,
                "configs": request_configs,
            }
        )
        hit = 0
        for h, n in zip(hashes, offsets):
            if h not in self.stored:
                break
            hit += n
        self.server.send_response_to_scheduler(lookup_id, hit)

    def cleanup_memory_objs(self, lookup_id: str) -> None:
        self.cleaned.setdefault(lookup_id, threading.Event()).set()


def test_lookup_client_against_lmcache_server(engine_id: str) -> None:
    config = PrefetchConfig(chunk_size=CHUNK, lookup_timeout_s=TIMEOUT_S)
    tokens = list(range(8 * CHUNK))
    request_ep, response_ep = _lmcache_endpoints(engine_id)
    metadata = _lmcache_parts(engine_id)[1]
    metadata.role = "worker"
    hs = ChunkHasher(config.chunk_size, config.hash_algorithm).hash(tokens)
    with LookupClient(config, [request_ep], response_ep) as client:
        stub = StubLMCacheEngine(set(hs[:5]))
        server = LMCacheAsyncLookupServer(stub, metadata)  # type: ignore[arg-type]
        stub.server = server
        try:
            assert client.lookup("r1", tokens, request_configs={"lmcache.tag": "x"}) is None
            # An LMCache answer carries no worker_id: it counts as the one rank.
            assert client.wait("r1", TIMEOUT_S) == 5 * CHUNK
            assert stub.requests[0] == {
                "lookup_id": "r1",
                "hashes": hs,
                "offsets": [CHUNK] * 8,
                "configs": {"lmcache.tag": "x"},
            }
            # skip_tokens travels as our extension; LMCache ignores it and sees every chunk.
            assert client.lookup("r2", tokens, skip_tokens=2 * CHUNK) is None
            assert client.wait("r2", TIMEOUT_S) == 5 * CHUNK
            assert stub.requests[1]["hashes"] == hs
            # cancel sends LookupCleanupMsg at once; LMCache's server hands it to the engine.
            client.cancel("r2")
            assert stub.cleaned.setdefault("r2", threading.Event()).wait(TIMEOUT_S)
        finally:
            _close_lmcache_peer(server, request_ep, LookupCleanupMsg("wake-up"))


def test_bench_lmcache_peer_tiny() -> None:
    env = dict(os.environ, LMCACHE_TRACK_USAGE="false", DO_NOT_TRACK="1")
    proc = subprocess.run(
        [
            sys.executable,
            str(EXAMPLES / "bench_lmcache_peer.py"),
            "--chunks",
            "2",
            "--chunk-bytes",
            "65536",
            "--repeats",
            "3",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    for case in ("CPU hit", "disk hit (page cache)", "full miss", "8 concurrent disk lookups"):
        assert case in out
    assert "answers correct: LMCache OK; lmprefetch leak check OK" in out
