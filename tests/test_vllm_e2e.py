"""End to end on real vLLM (CPU build): a tiny random Llama with and without lmprefetch.

Three vLLM engines run side by side in subprocesses (vLLM starts its engine with the spawn
method, and each needs a fresh process):

* vLLM alone (in-process engine) — the reference tokens;
* vLLM with the connector (in-process engine: scheduler and worker in one process, so the
  child can report the connector's and the worker runtime's counters);
* ``examples/vllm_offline.py`` as a user runs it (engine core and worker in their own
  processes, lookups over ipc between them).

vLLM's prefix cache is off, so every cached token reported is lmprefetch's.

The two prompts share a 192-token prefix (three 64-token chunks).  When they run together for
the first time, what the second is served depends on whether the first had been computed (and
its chunks stored) before the second was looked up: scheduling order, not behaviour.  So the
children controlled here run the first round one prompt at a time (``BATCHES``), which makes
every count exact; the example, run as a user runs it (both prompts together), is held to
what holds in any order.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

pytest.importorskip("vllm")

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "vllm_offline.py"
CHILD = Path(__file__).resolve().parent / "vllm_child.py"
TIMEOUT_S = 600
#: Prompt 0 alone, then prompt 1 alone (served the shared prefix prompt 0 stored), then both
#: (each served all its whole chunks).
BATCHES = [[0], [1], [0, 1]]


def load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("vllm_offline_example", EXAMPLE)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def child_env(in_process: bool) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        VLLM_TARGET_DEVICE="cpu",
        HF_HUB_OFFLINE="1",
        # Several engines share the machine: do not pin them all to the same core.
        VLLM_CPU_OMP_THREADS_BIND="nobind",
        PYTHONWARNINGS="ignore",
    )
    if in_process:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return env


def start(args: list[str], *, in_process: bool) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=child_env(in_process),
        cwd=ROOT,
    )


def finish(
    proc: subprocess.Popen[str], marker: str, *, keep_marker: bool = False
) -> dict[str, Any]:
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise AssertionError(f"vLLM child timed out after {TIMEOUT_S} s:\n{out[-6000:]}") from None
    assert proc.returncode == 0, out[-6000:]
    lines = [line for line in out.splitlines() if line.startswith(marker)]
    assert lines, out[-6000:]
    line = lines[-1] if keep_marker else lines[-1][len(marker) :]
    result: dict[str, Any] = json.loads(line)
    return result


def test_same_tokens_with_and_without_lmprefetch_and_cached_tokens_served(
    tmp_path: Path,
) -> None:
    example = load_example()
    (tmp_path / "config.json").write_text(json.dumps(example.TINY_LLAMA))
    prompts = example.prompts()
    spec = {
        "model": str(tmp_path),
        "block_size": 32,
        "prompts": prompts,
        "batches": BATCHES,
        "max_tokens": 8,
    }
    baseline_proc = start([str(CHILD), json.dumps(spec)], in_process=True)
    connector_spec = {**spec, "kv_transfer_config": example.kv_transfer_config()}
    connector_proc = start([str(CHILD), json.dumps(connector_spec)], in_process=True)
    example_proc = start([str(EXAMPLE), "--json"], in_process=False)

    baseline = finish(baseline_proc, "RESULT ")
    with_connector = finish(connector_proc, "RESULT ")
    example_run = finish(example_proc, '{"connector"', keep_marker=True)  # one JSON object

    # Without lmprefetch nothing is cached (prefix caching is off).
    outputs = [[r["output"] for r in batch] for batch in baseline["batches"]]
    reference = [outputs[0][0], outputs[1][0]]
    assert outputs[2] == reference
    assert all(r["cached_tokens"] == 0 for batch in baseline["batches"] for r in batch)

    # With lmprefetch (in-process): the same tokens in every batch.  Prompt 0 alone computes
    # and stores its 3 whole chunks; prompt 1 alone is served the shared 192 tokens and stores
    # its 4th chunk; together, each is served all its whole chunks (64 tokens each).
    chunk = example.kv_transfer_config()["kv_connector_extra_config"]["chunk_size"]
    shared = 192
    expected_cached = [len(p) // chunk * chunk for p in prompts]  # [192, 256]
    batches = with_connector["batches"]
    assert [[r["output"] for r in batch] for batch in batches] == [
        [reference[0]],
        [reference[1]],
        reference,
    ]
    assert [[r["cached_tokens"] for r in batch] for batch in batches] == [
        [0],
        [shared],
        expected_cached,
    ]

    # The example (both prompts together, twice): the same tokens.  In the first round
    # whichever prompt is looked up after the other's chunks were stored may be served
    # some of the shared prefix (whole chunks); the second round is served every whole chunk.
    rounds = example_run["rounds"]
    assert [[r["output"] for r in rnd] for rnd in rounds] == [reference, reference]
    first_round = [r["cached_tokens"] for r in rounds[0]]
    assert all(c in range(0, shared + 1, chunk) for c in first_round), first_round
    assert 0 in first_round, first_round  # one of them computed the shared prefix
    assert [r["cached_tokens"] for r in rounds[1]] == expected_cached

    sched = with_connector["scheduler_counters"]
    worker = with_connector["worker_counters"]
    runtime = with_connector["runtime"]
    hit_tokens = shared + sum(expected_cached)
    assert sched["lookups"] == 4
    assert sched["lookup_hits"] == 3
    assert sched["hit_tokens"] == hit_tokens
    assert worker["loaded_chunks"] == hit_tokens // chunk
    assert worker.get("load_failures", 0) == 0
    assert runtime["lookups"]["claimed"] == 3
    assert runtime["cpu_resident_chunks"] == 4  # the shared prefix's 3 chunks + 1
    # Nothing is left in flight, held or pinned.
    assert runtime["inflight_lookups"] == 0
    assert runtime["held_lookups"] == 0
    assert runtime["pinned_chunks"] == 0
    assert runtime["arena_used_bytes"] == runtime["cpu_resident_bytes"]
    assert with_connector["client"]["pending"] == 0
    assert with_connector["client"]["timeouts"] == 0


def test_load_limits_per_request_and_hit_sources_by_tier(tmp_path: Path) -> None:
    """Real vLLM (CPU build) with the connector, a disk tier and the ``cost`` load policy: a
    request with ``max_load_tokens`` 64 gets 64 external tokens, 0 and ``skip_load`` get none,
    a request without limits gets every whole chunk; vLLM's prompt tokens by source say
    ``host`` for CPU tier hits and ``disk`` once only the disk tier holds the chunks."""
    example = load_example()
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(example.TINY_LLAMA))
    prompt = example.prompts()[0]  # 200 tokens: 3 whole 64-token chunks
    ktc = example.kv_transfer_config()
    ktc["kv_connector_extra_config"] = {
        **ktc["kv_connector_extra_config"],
        "disk_path": str(tmp_path / "disk"),
        "load_policy": "cost",  # not calibrated at first: loads like "always"
    }
    spec = {
        "model": str(model),
        "block_size": 32,
        "prompts": [prompt],
        "batches": [[0]] * 7,
        "batch_params": [
            None,  # computes and stores 3 chunks
            [{"max_load_tokens": 64}],
            [{"max_load_tokens": 0}],
            [{"skip_load": True}],
            None,  # every whole chunk, from the CPU tier
            [{"max_load_tokens": 64}],  # from disk (the CPU tier forgot)
            None,  # from disk
        ],
        # (Before the last one too: a recomputed request's saves fill the CPU tier again.)
        "drop_cpu_before": [5, 6],
        "max_tokens": 2,
        "record_sources": True,
        "kv_transfer_config": ktc,
    }
    run = finish(start([str(CHILD), json.dumps(spec)], in_process=True), "RESULT ")
    cached = [batch[0]["cached_tokens"] for batch in run["batches"]]
    # CPU tier hits are zero-copy: the cost policy always loads them.
    assert cached[:5] == [0, 64, 0, 0, 192]
    # Disk hits: the disk tier is not trusted before it is measured (the first one is
    # recomputed, and the tier measured in the background); then they are loaded only if that
    # is faster than recomputing on this machine now (the tiny model computes 200 tokens in
    # milliseconds), so either is right here.
    assert cached[5] in (0, 64) and cached[6] in (0, 192), cached
    outputs = {tuple(batch[0]["output"]) for batch in run["batches"]}
    assert len(outputs) == 1  # loaded or computed, the same tokens
    # vLLM asked the connector which tier served each load (those that loaded something).
    disk_sources = [{"disk": n} for n in cached[5:] if n]
    assert run["sources"] == [{"host": 64}, {"host": 192}, *disk_sources]
    sched = run["scheduler_counters"]
    assert sched["load_skipped"] == 2
    assert sched["load_capped"] == 2
    assert run["client"]["submitted"] == 5  # the skipped requests sent no lookup
    runtime = run["runtime"]
    assert runtime["held_lookups"] == 0
    assert runtime["pinned_chunks"] == 0
    decisions = runtime["lookups"]
    assert decisions["policy_loaded"] >= 2  # the CPU tier hits
    # Every lookup that could find chunks was decided once: the 4 hits (2 on disk, maybe
    # skipped, or, the disk measured too slow to pay, not even probed).
    unprobed = decisions["policy_unprobed"]
    assert decisions["policy_loaded"] + decisions["policy_skipped"] + unprobed == 4
    assert decisions["policy_skipped"] + unprobed == sum(1 for n in cached[5:] if n == 0)
    worker = run["worker_counters"]
    assert worker.get("policy_skipped", 0) == decisions["policy_skipped"]


@pytest.mark.slow
def test_tensor_parallel_ranks_each_store_and_load_their_slice(tmp_path: Path) -> None:
    """TP=2: two worker processes, two lmprefetch runtimes with per-rank keys, and the
    scheduler takes the minimum of two answers.  Prompt 0 alone is vLLM's own computation,
    prompt 1 alone is served the shared prefix and computes its 4th chunk (the test above
    shows the connector changes no token); together, both must produce the same tokens from
    KV that lmprefetch served, every whole chunk of it."""
    example = load_example()
    (tmp_path / "config.json").write_text(
        json.dumps({**example.TINY_LLAMA, "num_key_value_heads": 2})  # one KV head per rank
    )
    prompts = example.prompts()
    spec = {
        "model": str(tmp_path),
        "block_size": 32,
        "prompts": prompts,
        "batches": BATCHES,
        "max_tokens": 8,
        "tensor_parallel_size": 2,
        "kv_transfer_config": example.kv_transfer_config(),
    }
    result = finish(start([str(CHILD), json.dumps(spec)], in_process=False), "RESULT ")
    batches = result["batches"]
    chunk = example.kv_transfer_config()["kv_connector_extra_config"]["chunk_size"]
    assert [[r["cached_tokens"] for r in batch] for batch in batches] == [
        [0],
        [192],
        [len(p) // chunk * chunk for p in prompts],
    ]
    assert [r["output"] for r in batches[2]] == [batches[0][0]["output"], batches[1][0]["output"]]


def test_bench_vllm_copy_example_runs() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "bench_vllm_copy.py"),
            *("--layers", "4", "--kv-heads", "2", "--chunks", "4", "--num-blocks", "128"),
            *("--repeat", "2"),
        ],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env=child_env(in_process=True),
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "round trip check: OK" in proc.stdout
    assert "load into paged cache:" in proc.stdout
    assert "ratio" in proc.stdout
