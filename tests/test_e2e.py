"""End to end: a real `LookupClient` and real worker processes over ipc.

Every wait is on a condition with a deadline: ``LookupClient.wait`` blocks on the client's
condition variable, and worker state is read through the control pipe.
"""

from __future__ import annotations

import logging
import re
import threading
import urllib.request
import uuid
from pathlib import Path

import pytest
import zmq

from lmprefetch import ChunkHasher, LookupClient, PrefetchConfig, WorkerRuntime

from .resources import Snapshot, needs_proc
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
            assert w.ask("stats")["lookups"]["cancelled"] == 1


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
        timeouts = [r for r in caplog.records if r.name == "lmprefetch.client"]
        assert len(timeouts) == 1  # one warning, however often the id is polled after
        assert timeouts[0].levelno == logging.WARNING
        assert re.fullmatch(
            r"lookup 't' \(seq \d+\): 1 of 2 workers answered within 0\.5 s; "
            r"answering 0 and cancelling it on every worker",
            timeouts[0].getMessage(),
        ), timeouts[0].getMessage()
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


def scrape(port: int | None, rank: int = 0, world_size: int = 1) -> dict[str, float]:
    """The worker's /metrics, as ``{"name{labels}": value}``.  Every lmprefetch sample must
    carry ``rank`` and ``world_size``; they are checked and left out of the keys."""
    assert port is not None
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    samples = {}
    for line in text.decode().splitlines():
        if not line.startswith("lmprefetch_"):
            continue
        sample, value = line.rsplit(" ", 1)
        name, _, label_text = sample.partition("{")
        labels = dict(re.findall(r'(\w+)="([^"]*)"', label_text))
        assert labels.pop("rank") == str(rank), line
        assert labels.pop("world_size") == str(world_size), line
        rest = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        samples[f"{name}{{{rest}}}" if rest else name] = float(value)
    return samples


def test_d18_metrics_count_async_lookups(config: PrefetchConfig, tmp_path: Path) -> None:
    """Lookups that went through the async path (the lookup server) show in the metrics:
    hits and misses, bytes and chunks per tier, and the in-flight gauge while a disk load is
    held in its thread."""
    cfg = config.replace(disk_path=str(tmp_path))
    cpu_toks, disk_toks = prompt(2), prompt(3, salt=5)
    cpu_data, disk_data = chunk_payloads(2, 0), [bytes([9, i]) * 20 for i in range(3)]
    with WorkerRuntime.start(cfg) as writer:  # onto the disk; this engine's CPU tier goes
        assert writer.store(disk_toks, disk_data) == 3
    cpu_bytes, disk_bytes = sum(map(len, cpu_data)), sum(map(len, disk_data))
    with (
        start_workers(cfg, [[(cpu_toks, cpu_data)]], metrics=True) as (eps, resp, workers),
        LookupClient(cfg, eps, resp) as client,
    ):
        worker = workers[0]
        for i in range(5):
            client.lookup(f"h{i}", cpu_toks)
            assert client.wait(f"h{i}", 10) == 8
            client.cancel(f"h{i}")
        client.lookup("miss", prompt(2, salt=9))
        assert client.wait("miss", 10) == 0
        client.lookup("d", disk_toks)
        assert client.wait("d", 10) == 12
        assert worker.ask("claim", "d") == disk_data
        m = scrape(worker.metrics_port)
        assert m['lmprefetch_lookups_total{result="hit"}'] == 6
        assert m['lmprefetch_lookups_total{result="miss"}'] == 1
        assert m["lmprefetch_lookup_latency_seconds_count"] == 7
        assert m["lmprefetch_hit_tokens_total"] == 5 * 8 + 12
        assert m['lmprefetch_tier_loaded_bytes_total{tier="cpu"}'] == 5 * cpu_bytes
        assert m['lmprefetch_tier_loaded_chunks_total{tier="cpu"}'] == 5 * 2
        assert m['lmprefetch_tier_loaded_bytes_total{tier="disk"}'] == disk_bytes
        assert m['lmprefetch_tier_loaded_chunks_total{tier="disk"}'] == 3
        assert m["lmprefetch_inflight_lookups"] == 0
        assert m["lmprefetch_pinned_chunks"] == 0

        # A disk lookup held in flight: its read waits in the worker's disk thread.
        worker.ask("hold_disk_reads")
        try:
            client.lookup("slow", disk_toks)
            assert worker.ask("wait_read_held", 10)
            m = scrape(worker.metrics_port)
            assert m["lmprefetch_inflight_lookups"] == 1
            assert m["lmprefetch_pinned_chunks"] == 3  # the probe's pins, until the load ends
            assert m["lmprefetch_limiter_used"] == 3
            assert m['lmprefetch_tier_loaded_bytes_total{tier="disk"}'] == disk_bytes
        finally:
            worker.ask("release_disk_reads")
        assert client.wait("slow", 10) == 12
        client.cancel("slow")
        assert worker.ask("wait_idle", 10)
        m = scrape(worker.metrics_port)
        assert m["lmprefetch_inflight_lookups"] == 0
        assert m["lmprefetch_held_lookups"] == 0
        assert m["lmprefetch_pinned_chunks"] == 0
        assert m['lmprefetch_tier_loaded_bytes_total{tier="disk"}'] == 2 * disk_bytes
        assert m['lmprefetch_lookups_total{result="hit"}'] == 7
        assert m['lmprefetch_lookups_total{result="claimed"}'] == 1
        assert m['lmprefetch_lookups_total{result="cancelled"}'] == 6


@needs_proc
def test_d19_close_joins_threads_and_leaves_other_contexts_alone(
    config: PrefetchConfig,
) -> None:
    """Closing a worker runtime that holds a prefetch, and a client: everything is released —
    the held buffers and pins, the arena, the runtime's and the bridge's threads, both ZeroMQ
    contexts (their native I/O threads end when terminated) and every file descriptor they
    opened — and a context that belongs to someone else keeps working."""
    other = zmq.Context()
    a, b = other.socket(zmq.PAIR), other.socket(zmq.PAIR)
    a.bind("inproc://other")
    b.connect("inproc://other")
    before = Snapshot.take()
    threads_before = set(threading.enumerate())
    tag = uuid.uuid4().hex[:8]
    worker_ep, sched_ep = f"ipc://@lmp-d19-w-{tag}", f"ipc://@lmp-d19-s-{tag}"
    worker = WorkerRuntime.start(config, request_endpoint=worker_ep, response_endpoint=sched_ep)
    engine = worker.engine
    client = LookupClient(config, [worker_ep], sched_ep)
    toks = prompt(2)
    worker.store(toks, chunk_payloads(2, 0))
    client.lookup("x", toks)
    assert client.wait("x", 10) == 8
    assert worker.statistics().engine.lookups.held == 1  # the prefetch holds the cached buffers
    client.close()
    worker.close()
    worker.close()  # idempotent
    after = engine.statistics()
    assert after.lookups.held == after.lookups.inflight == 0
    assert after.lookups.cancelled == 1  # closing cancelled the held prefetch
    assert after.pinned_chunks == 0
    assert after.arena.used_bytes == after.cpu_resident_bytes == 0  # the arena is free
    assert set(threading.enumerate()) == threads_before  # runtime and bridge threads joined
    assert before.new_zmq_threads() == {}  # both contexts terminated: no ZMQbg thread left
    assert before.new_fds() == set()  # every socket, eventfd, epoll fd and pipe closed
    a.send(b"still works")
    assert b.recv() == b"still works"
    a.close()
    b.close()
    other.term()
