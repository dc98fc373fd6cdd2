"""End to end: a real `LookupClient` and real worker processes over ipc.

Every wait is on a condition with a deadline: ``LookupClient.wait`` blocks on the client's
condition variable, and worker state is read through the control pipe.
"""

from __future__ import annotations

import logging
import threading
import urllib.request

import pytest
import zmq

from lmprefetch import ChunkHasher, LookupClient, PrefetchConfig

from .workers import start_workers

CHUNK = 4

pytestmark = pytest.mark.slow


def prompt(n_chunks: int, salt: int = 0) -> list[int]:
    return [salt * 1000 + i for i in range(n_chunks * CHUNK)]


def chunk_payloads(n: int, rank: int) -> list[bytes]:
    return [bytes([rank, i]) * 16 for i in range(n)]


@pytest.fixture
def config() -> PrefetchConfig:
    return PrefetchConfig(chunk_size=CHUNK, chunk_bytes=64, cpu_bytes=64 * 64, lookup_timeout_s=5)


def test_d14_two_ranks_min_rule_and_claim(config: PrefetchConfig) -> None:
    toks = prompt(6)
    preloads = [
        [(toks[: 5 * CHUNK], chunk_payloads(5, 0))],  # rank 0 has 5 chunks
        [(toks[: 3 * CHUNK], chunk_payloads(3, 1))],  # rank 1 has 3
    ]
    with (
        start_workers(config, preloads) as (eps, resp, workers),
        LookupClient(config, eps, resp) as client,
    ):
        assert client.lookup("a", toks) is None
        assert client.wait("a", 10) == 3 * CHUNK  # the minimum over ranks
        assert client.lookup("a", toks) == 3 * CHUNK  # cached until forgotten
        assert workers[0].ask("claim", "a") == chunk_payloads(5, 0)
        assert workers[1].ask("claim", "a") == chunk_payloads(3, 1)
        client.forget("a")
        for w in workers.values():
            assert w.ask("wait_idle", 10)


def test_d03_cancel_releases_on_every_worker_with_no_other_traffic(
    config: PrefetchConfig,
) -> None:
    toks = prompt(4)
    preloads = [[(toks, chunk_payloads(4, r))] for r in range(2)]
    with (
        start_workers(config, preloads) as (eps, resp, workers),
        LookupClient(config, eps, resp) as client,
    ):
        client.lookup("c", toks)
        assert client.wait("c", 10) == 4 * CHUNK
        assert all(w.ask("stats")["held_lookups"] == 1 for w in workers.values())
        client.cancel("c")
        client.cancel("c")  # idempotent
        for w in workers.values():
            assert w.ask("wait_idle", 10)
            assert w.ask("stats")["lookups_cancelled"] == 1


def test_d06_reused_id_gets_a_fresh_answer(config: PrefetchConfig) -> None:
    first, second = prompt(4, salt=1), prompt(2, salt=2)
    preloads = [[(first, chunk_payloads(4, 0)), (second, chunk_payloads(2, 0))]]
    with (
        start_workers(config, preloads) as (eps, resp, workers),
        LookupClient(config, eps, resp) as client,
    ):
        client.lookup("r", first)
        assert client.wait("r", 10) == 16
        client.forget("r")  # scheduled, then preempted: the id comes back
        assert client.lookup("r", second) is None
        assert client.wait("r", 10) == 8
        assert workers[0].ask("claim", "r") == chunk_payloads(2, 0)
        client.cancel("r")
        assert workers[0].ask("wait_idle", 10)


def test_d07_dead_worker_times_out_to_zero_and_keeps_answering_zero(
    config: PrefetchConfig, caplog: pytest.LogCaptureFixture
) -> None:
    toks = prompt(3)
    cfg = config.replace(lookup_timeout_s=0.5)
    preloads = [[(toks, chunk_payloads(3, 0))], [(toks, chunk_payloads(3, 1))]]
    with (
        start_workers(cfg, preloads, start=[0]) as (eps, resp, workers),
        LookupClient(cfg, eps, resp) as client,
        caplog.at_level(logging.WARNING, logger="lmprefetch.client"),
    ):
        client.lookup("t", toks)
        assert client.wait("t", 10) == 0  # rank 1 never answers
        for _ in range(3):
            assert client.lookup("t", toks) == 0
        assert len([r for r in caplog.records if "t" in r.getMessage()]) == 1
        assert workers[0].ask("wait_idle", 10)  # the timeout sent a cleanup


def test_worker_killed_mid_lookup(config: PrefetchConfig) -> None:
    toks = prompt(3)
    cfg = config.replace(lookup_timeout_s=1.0)
    preloads = [[(toks, chunk_payloads(3, 0))], [(toks, chunk_payloads(3, 1))]]
    with (
        start_workers(cfg, preloads) as (eps, resp, workers),
        LookupClient(cfg, eps, resp) as client,
    ):
        workers[1].kill()
        client.lookup("k", toks)
        assert client.wait("k", 10) == 0
        assert workers[0].ask("wait_idle", 10)
        client.lookup("k2", toks)
        assert client.wait("k2", 10) == 0  # still no answer from the dead rank, no hang


def test_close_under_load_releases_everything(config: PrefetchConfig) -> None:
    toks = prompt(4)
    preloads = [[(toks, chunk_payloads(4, r))] for r in range(2)]
    with start_workers(config, preloads) as (eps, resp, workers):
        client = LookupClient(config, eps, resp)
        hasher = ChunkHasher(CHUNK)
        hashes = hasher.hash(toks)
        for i in range(300):
            client.lookup(f"load-{i}", toks, hashes=hashes, offsets=[CHUNK] * 4)
        client.close()
        client.close()
        # Workers hold what they answered; closing them under load releases it all.
        for w in workers.values():
            assert w.ask("close", timeout_s=30) == 0


def test_d18_metrics_count_async_lookups(config: PrefetchConfig) -> None:
    toks = prompt(2)
    with (
        start_workers(config, [[(toks, chunk_payloads(2, 0))]], metrics=True) as (
            eps,
            resp,
            workers,
        ),
        LookupClient(config, eps, resp) as client,
    ):
        for i in range(5):
            client.lookup(f"h{i}", toks)
            assert client.wait(f"h{i}", 10) == 8
            client.cancel(f"h{i}")
        client.lookup("miss", prompt(2, salt=9))
        assert client.wait("miss", 10) == 0
        port = workers[0].metrics_port
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
        lines = text.decode().splitlines()
        assert 'lmprefetch_lookups_total{result="hit"} 5.0' in lines
        assert 'lmprefetch_lookups_total{result="miss"} 1.0' in lines
        assert "lmprefetch_lookup_latency_seconds_count 6.0" in lines
        assert any(line.startswith("lmprefetch_pinned_chunks ") for line in lines)


def test_d19_close_joins_threads_and_leaves_other_contexts_alone(
    config: PrefetchConfig,
) -> None:
    from lmprefetch import WorkerRuntime

    other = zmq.Context()
    a, b = other.socket(zmq.PAIR), other.socket(zmq.PAIR)
    a.bind("inproc://other")
    b.connect("inproc://other")
    before = set(threading.enumerate())
    worker = WorkerRuntime.start(
        config, request_endpoint="ipc://@lmp-d19-w", response_endpoint="ipc://@lmp-d19-s"
    )
    client = LookupClient(config, ["ipc://@lmp-d19-w"], "ipc://@lmp-d19-s")
    toks = prompt(2)
    worker.store(toks, chunk_payloads(2, 0))
    client.lookup("x", toks)
    assert client.wait("x", 10) == 8
    client.close()
    worker.close()
    worker.close()
    leftover = [t for t in threading.enumerate() if t not in before and t.is_alive()]
    assert leftover == []
    a.send(b"still works")
    assert b.recv() == b"still works"
    a.close()
    b.close()
    other.term()
