"""lmprefetch on vLLM's OpenAI server (CPU build), over HTTP, as a user runs it.

Servers are child processes (``python -m vllm.entrypoints.openai.api_server``) on free loopback
ports, started and stopped by their own process group (``lmprefetch.bench.serve.procs``), with a
tiny random-weight Llama and token-id prompts.  vLLM's own prefix cache is off in every server
here, so every cached token a response reports was served by lmprefetch.  The checks are
structural (tokens, hit counts); nothing is timed.

* the same tokens with and without the connector, and a repeat served from lmprefetch: its
  ``usage.prompt_tokens_details.cached_tokens`` covers every whole chunk, and ``/metrics``
  counts them as external (connector) tokens;
* two servers sharing one Redis serve each other's prompts;
* ``lmprefetch bench-serve --quick`` runs every scenario and leaves no file or process behind.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio

pytest.importorskip("vllm")
httpx = pytest.importorskip("httpx")

from lmprefetch.bench.serve.client import Completion, scrape_metrics  # noqa: E402
from lmprefetch.bench.serve.procs import ManagedProcess, ProcessSet, free_port  # noqa: E402

from .vllm_servers import (  # noqa: E402
    CHUNK,
    FILLERS,
    P1,
    P2,
    P3,
    connector_config,
    vllm_servers,
    whole_chunks,
)

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parent.parent
REDIS_SERVER = shutil.which("redis-server")
needs_redis = pytest.mark.skipif(
    REDIS_SERVER is None, reason="needs redis-server (apt-get install redis-server)"
)


@asynccontextmanager
async def redis_server(tmp: Path) -> AsyncIterator[str]:
    assert REDIS_SERVER is not None
    port = free_port()
    workdir = tmp / "redis"
    workdir.mkdir()
    argv = [
        REDIS_SERVER, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
        "--appendonly", "no", "--dir", str(workdir),
    ]  # fmt: skip
    async with trio.open_nursery() as nursery:
        procs = ProcessSet(nursery)
        try:
            await procs.start(
                ManagedProcess("redis", argv, dict(os.environ), "Ready to accept connections"),
                60.0,
            )
            yield f"redis://127.0.0.1:{port}"
        finally:
            await procs.stop_all()


async def test_same_tokens_with_and_without_lmprefetch_and_repeats_served_from_it(
    tmp_path: Path,
) -> None:
    async with vllm_servers(tmp_path, [None, connector_config()]) as (plain, cached):
        rounds: dict[str, list[list[Completion]]] = {"plain": [], "cached": []}
        deltas = []
        for _ in range(2):
            before = await scrape_metrics(cached.client)
            for name, server in (("plain", plain), ("cached", cached)):
                rounds[name].append([await server.complete(p) for p in (P1, P2)])
            deltas.append(await cached.metrics_after(before, 2))
            for server in (plain, cached):
                for filler in FILLERS:
                    await server.complete(filler)
        delta = {k: deltas[0][k] + deltas[1][k] for k in deltas[0]}

    reference = [c.output_ids for c in rounds["plain"][0]]
    assert all(len(ids) == 8 for ids in reference)
    for name in ("plain", "cached"):
        assert [[c.output_ids for c in rnd] for rnd in rounds[name]] == [reference, reference]
    assert [c.cached_tokens for rnd in rounds["plain"] for c in rnd] == [0, 0, 0, 0]
    # Round 1: P2 already finds the 3 chunks it shares with P1 (stored by P1's request);
    # round 2: every whole chunk of both prompts is served by lmprefetch.
    cached_tokens = [[c.cached_tokens for c in rnd] for rnd in rounds["cached"]]
    assert cached_tokens == [[0, 192], [whole_chunks(P1), whole_chunks(P2)]]
    # vLLM's own counters agree: all of it came through the connector.
    assert delta["external_kv_transfer"] == 192 + whole_chunks(P1) + whole_chunks(P2)
    assert delta["local_cache_hit"] == 0


@needs_redis
async def test_two_servers_sharing_one_redis_serve_each_others_prompts(tmp_path: Path) -> None:
    import redis

    from lmprefetch.hashing import ChunkHasher
    from lmprefetch.keys import ChunkKey
    from lmprefetch.tiers.redis import redis_key

    hasher = ChunkHasher(CHUNK)

    async def landed(url: str, prompt: Sequence[int]) -> None:
        """Wait until Redis holds every whole chunk of ``prompt`` (writes are write-behind)."""
        names = [
            redis_key(ChunkKey("bench", 1, 0, h, "float32")) for h in hasher.hash(list(prompt))
        ]
        client = redis.Redis.from_url(url)
        try:
            with trio.fail_after(120):
                while True:
                    if await trio.to_thread.run_sync(client.exists, *names) == len(names):
                        return
                    await trio.sleep(0.05)
        finally:
            await trio.to_thread.run_sync(client.close)

    async with redis_server(tmp_path) as url:
        config = connector_config(redis_url=url, model_name="bench", kv_dtype="float32")
        async with vllm_servers(tmp_path, [config, config]) as (a, b):
            first_a = await a.complete(P2)
            await landed(url, P2)
            from_redis_b = await b.complete(P2)
            first_b = await b.complete(P3)
            await landed(url, P3)
            from_redis_a = await a.complete(P3)

    assert first_a.cached_tokens == 0 and first_b.cached_tokens == 0
    # Each server serves the prompt only the other one computed, from Redis: every whole
    # chunk, and the same tokens.
    assert from_redis_b.cached_tokens == whole_chunks(P2)
    assert from_redis_a.cached_tokens == whole_chunks(P3)
    assert from_redis_b.output_ids == first_a.output_ids
    assert from_redis_a.output_ids == first_b.output_ids


@pytest.mark.slow
@needs_redis
def test_bench_serve_quick_runs_every_scenario_and_leaves_nothing_behind(tmp_path: Path) -> None:
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    out = tmp_path / "result.json"
    figure = tmp_path / "figure.png"
    # A long TMPDIR: the servers' sockets must still fit a Unix socket path (they then go to a
    # short private directory in /tmp, removed like the rest).
    env = dict(os.environ, TMPDIR=str(tmpdir))
    assert len(str(tmpdir)) > 60
    short_dirs_before = set(Path("/tmp").glob("lmpbs-*"))
    argv = [
        sys.executable, "-m", "lmprefetch", "bench-serve", "--quick", "--no-progress", "--model",
        "random",  # its structure; the trained model: tests/test_vllm_trained_e2e.py
        "--json", str(out), "--plot", str(figure),
    ]  # fmt: skip
    proc = subprocess.run(
        argv, capture_output=True, text=True, env=env, cwd=ROOT, timeout=3600, check=False
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    # Nothing left: no file in the temporary directory, no process started with its model.
    assert list(tmpdir.iterdir()) == []
    assert set(Path("/tmp").glob("lmpbs-*")) <= short_dirs_before
    leftovers = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                seen = (entry / "cmdline").read_bytes() + (entry / "environ").read_bytes()
            except OSError:
                continue
            if str(tmpdir).encode() in seen:  # every child got TMPDIR (or a path) under it
                leftovers.append((entry / "cmdline").read_bytes())
    assert leftovers == []
    assert figure.stat().st_size > 0
    for word in ("TTFT p50", "recompute", "shared_redis", "Goals"):
        assert word in proc.stdout

    result = json.loads(out.read_text())
    scenarios = result["scenarios"]
    assert list(scenarios) == [
        "recompute",
        "apc",
        "lmprefetch_cpu",
        "lmprefetch_disk_restart",
        "shared_redis",
        "shared_mooncake",
        "lmprefetch_hybrid",
        "lmcache",
        "lmcache_mp",
    ]
    settings = result["settings"]
    doc_tokens = settings["long_doc_qa"]["doc_tokens"]
    measured_docs = settings["long_doc_qa"]["docs"] * (settings["rounds"] - 1)
    for name, entry in scenarios.items():
        if name.startswith("lmcache") and "error" in entry:
            assert entry["error"]  # the reason it cannot run here, in words
            continue
        if name == "shared_mooncake" and entry.get("unavailable"):
            # Not in a private network namespace (or no Mooncake): tests/test_vllm_mooncake.py
            # covers two servers sharing Mooncake there.
            assert "Mooncake" in entry["error"]
            continue
        assert "error" not in entry, entry
        for figures in (entry, entry["chat"]):
            for key in ("ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "req_per_s", "hit_tokens"):
                assert figures[key] is not None, (name, key)
            # The answers' usage and vLLM's /metrics count the same hit tokens.
            assert figures["hit_tokens"] == figures["hit_tokens_metrics"], name
    for figures in (scenarios["recompute"], scenarios["recompute"]["chat"]):
        assert figures["hit_tokens"] == 0
    # Every measured long-document question finds its whole document cached (vLLM's pool is
    # too small to keep it, so lmprefetch serves it).
    shared_tiers = ["shared_redis"]
    if not scenarios["shared_mooncake"].get("unavailable"):
        shared_tiers.append("shared_mooncake")
    for name in ("lmprefetch_cpu", "lmprefetch_disk_restart", *shared_tiers, "lmprefetch_hybrid"):
        entry = scenarios[name]
        assert entry["hit_tokens"] == measured_docs * doc_tokens, name
        assert entry["metrics"]["external_kv_transfer"] > 0, name
        probe = entry["probe"]
        assert probe["tier_hit"]["cached_tokens"] == [probe["full_hit_tokens"]] * len(
            probe["tier_hit"]["cached_tokens"]
        ), name
    # The hybrid scenario ran a sliding-window model (two KV cache groups).
    assert scenarios["lmprefetch_hybrid"]["model"].startswith("sliding-window hybrid")
    assert {g["key"] for g in result["goals"]} == {
        "long_doc_p50_vs_apc",
        "cpu_hit_vs_apc_hit",
        "disk_hit_vs_apc_hit",
    }
    assert all(g["met"] is not None for g in result["goals"])


@pytest.mark.slow
@pytest.mark.slow_link
@needs_redis
def test_bench_serve_redis_link_scenarios_serve_every_hit_from_redis(tmp_path: Path) -> None:
    """bench-serve's six Redis link scenarios (issue 20), ``--quick``: the slow link is set
    up in a private network namespace of the benchmark's own, the measured server's hits all
    come from Redis, and the figures and goals are in the JSON.  (``nox -s slow_link``: not
    in ``ci``; nothing is timed here, the goals are benchmark figures.)"""
    from lmprefetch.bench.serve.link_scenario import has_load_policy
    from lmprefetch.bench.serve.options import LINK_SCENARIOS

    names = list(LINK_SCENARIOS.values())
    out = tmp_path / "result.json"
    argv = [
        sys.executable, "-m", "lmprefetch", "bench-serve", "--quick", "--no-progress", "--model",
        "random",  # its structure; the trained model: tests/test_vllm_trained_e2e.py
        "--scenarios", ",".join(names), "--json", str(out),
    ]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=3600, check=False)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads(out.read_text())
    scenarios = result["scenarios"]
    assert list(scenarios) == names
    policy = has_load_policy()
    for name in names:
        entry = scenarios[name]
        if not policy and not name.endswith("_always"):
            assert entry.get("unavailable") and "load_policy" in entry["error"], entry
            continue
        assert "error" not in entry, entry
        assert entry["ttft_p50_ms"] is not None and entry["requests"] >= 3, name
        assert entry["hit_tokens"] == entry["hit_tokens_metrics"], name
        if entry["load_policy"] == "never":
            assert entry["hit_tokens"] == 0, name
        if entry["load_policy"] == "always":
            # Every measured document loaded whole, and all of it from Redis: what Redis
            # sent is the hit tokens' KV bytes (and a little framing).
            doc_tokens = result["settings"]["long_doc_qa"]["doc_tokens"]
            assert entry["hit_tokens"] == entry["requests"] * doc_tokens, name
            assert 1.0 <= entry["redis_sent_vs_hit_bytes"] < 1.05, name
        # The measured server's decision log, joined with the questions: one row each, every
        # question computed in at least one step, a lookup wherever the policy looks up.
        rows = entry["decisions"]
        assert len(rows) == entry["requests"], name
        assert all(r["steps"] >= 1 for r in rows), name
        decided = {r["decision"] for r in rows}
        if entry["load_policy"] == "never":
            assert decided == {"no lookup"}, name
        else:
            assert decided <= {"loaded", "truncated", "skipped", "not probed"}, name
        link = entry["link"]
        if name.startswith("slow"):
            assert link["mechanism"] in ("netem", "htb+proxy"), link
            # Detected: without netem, tc's own words say why.
            assert (link["mechanism"] == "netem") is ("netem_unavailable" not in link), link
        else:
            assert link["kind"] == "fast"
    goals = {g["key"]: g for g in result["goals"]}
    for key in ("slow_remote_cost_vs_best", "fast_remote_cost_vs_always"):
        assert goals[key]["limit"] == 1.1
        assert (goals[key]["met"] is not None) is policy
    assert "Redis link scenarios" in proc.stdout


@pytest.mark.slow
@pytest.mark.slow_link
@needs_redis
def test_bench_serve_side_by_side_serves_every_policy_on_one_server(tmp_path: Path) -> None:
    """``--side-by-side`` (what ``tools/link_runs.py`` runs): the unthrottled link's scenarios
    share one Redis fill and one measured server (configured ``cost``), every measured
    question is sent once per policy, each request naming its scenario's policy, the server
    computed its fresh documents first, and each scenario's figures are its own requests'
    (the hits of ``always`` all from Redis, none for ``never``; each lookup decided by the
    policy its request named)."""
    from lmprefetch.bench.serve.link_scenario import SETTLE_DOCS, has_load_policy

    if not has_load_policy():
        pytest.skip("this lmprefetch has no load_policy setting")
    names = ["fast_remote_always", "fast_remote_recompute", "fast_remote_cost"]
    out = tmp_path / "result.json"
    argv = [
        sys.executable, "-m", "lmprefetch", "bench-serve", "--quick", "--no-progress", "--model",
        "random", "--side-by-side", "--scenarios", ",".join(names), "--json", str(out),
    ]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=3600, check=False)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["settings"]["side_by_side"] == [names]
    scenarios = result["scenarios"]
    requests = {scenarios[n]["requests"] for n in names}
    assert len(requests) == 1 and requests.pop() >= 3  # every question on every server
    for name in names:
        entry = scenarios[name]
        assert "error" not in entry, entry
        assert len(entry["settle_ms"]) == SETTLE_DOCS, name
        assert len(entry["decisions"]) == entry["requests"], name
        assert entry["server_load_policy"] == "cost", name
    always, never = scenarios["fast_remote_always"], scenarios["fast_remote_recompute"]
    cost = scenarios["fast_remote_cost"]
    assert {r["decision"] for r in always["decisions"]} == {"loaded"}
    assert {r.get("policy") for r in always["decisions"]} == {"AlwaysLoad"}
    assert {r["decision"] for r in never["decisions"]} == {"no lookup"}
    assert {r.get("policy") for r in cost["decisions"]} == {"CostPolicy"}
    doc_tokens = result["settings"]["long_doc_qa"]["doc_tokens"]
    assert always["hit_tokens"] == always["requests"] * doc_tokens
    assert 1.0 <= always["redis_sent_vs_hit_bytes"] < 1.05
    assert never["hit_tokens"] == 0 and never["redis_sent_bytes"] < doc_tokens * 4096
    assert "Side by side (--side-by-side): " + " + ".join(names) in proc.stdout
