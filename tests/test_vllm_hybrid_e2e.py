"""Hybrid models end to end on real vLLM (CPU build), with vLLM's hybrid KV cache manager on.

Three tiny models written here with random weights (``lmprefetch.bench.serve.hybrid_models``):
a Llama with a sliding-window layer, a Gemma-4 whose sliding-window and full-attention layers
have different head sizes (vLLM gives their groups different block sizes) and a bfloat16
Qwen3-Next (gated delta-net + full attention; a block of a few hundred tokens).  For each, two
vLLM engines run side by side in subprocesses (``tests/vllm_hybrid_child.py``): vLLM alone (the
reference tokens) and vLLM with lmprefetch, which runs

1. prompt 0 alone, then prompt 1 alone (computed, stored);
2. both, with vLLM's KV cache zeroed first (and its prefix cache reset where the model needs
   it on): served from lmprefetch, the same tokens;
3. both again with the restore of one group kind broken on purpose (its rows dropped): the
   tokens must change, which shows the weights make the output depend on what is restored.

A third engine then starts on the same disk directory (a restarted server) and is served from
disk.  Prompts end a few tokens after the last chunk boundary, inside the sliding window, so
the restored window reaches the next token directly.  vLLM's prefix cache is off except for
Qwen3-Next (vLLM keeps no recurrent states without it); there it is reset before each served
round, so every cached token is lmprefetch's.

The sliding-window Llama runs in the ``vllm`` nox session; the rest (``hybrid`` marker) in
the ``hybrid`` session.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")
pytest.importorskip("transformers")

from lmprefetch.bench.serve.hybrid_models import write_hybrid_model

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parent.parent
CHILD = Path(__file__).resolve().parent / "vllm_hybrid_child.py"
TIMEOUT_S = 900
MAX_TOKENS = 6


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        VLLM_TARGET_DEVICE="cpu",
        HF_HUB_OFFLINE="1",
        VLLM_CPU_OMP_THREADS_BIND="nobind",
        PYTHONWARNINGS="ignore",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
    )
    return env


def start(spec: dict[str, Any]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(CHILD), json.dumps(spec)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=child_env(),
        cwd=ROOT,
    )


def finish(proc: subprocess.Popen[str]) -> tuple[dict[str, Any], str]:
    """The child's RESULT and its whole output (vLLM's log)."""
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise AssertionError(f"vLLM child timed out after {TIMEOUT_S} s:\n{out[-6000:]}") from None
    assert proc.returncode == 0, out[-6000:]
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert lines, out[-6000:]
    result: dict[str, Any] = json.loads(lines[-1][len("RESULT ") :])
    return result, out


def kv_capacity_tokens(log: str) -> int:
    """The KV cache capacity vLLM logs at start-up ("CPU KV cache size: 64,527 tokens")."""
    found = re.findall(r"KV cache size: ([\d,]+) tokens", log)
    assert found, log[-3000:]
    return int(found[-1].replace(",", ""))


def prompts_for(n: int) -> list[list[int]]:
    return [[(i * 31 + 7) % 997 + 3 for i in range(n)], [(i * 17 + 5) % 991 + 3 for i in range(n)]]


def connector_config(disk: Path) -> dict[str, Any]:
    return {
        "kv_connector": "LMPrefetchConnector",
        "kv_connector_module_path": "lmprefetch.integration.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"cpu_bytes": 64 << 20, "disk_path": str(disk)},
    }


def check_model(
    tmp_path: Path,
    name: str,
    *,
    dtype: str,
    prompt_tokens: int,
    prefix_caching: bool,
    broken_kind: str,
    group_specs: list[str],
) -> dict[str, Any]:
    """Run the reference, the connector's rounds and the restarted engine; check them all.
    Returns figures for the report."""
    model = write_hybrid_model(tmp_path / name, name, weights=True)
    prompts = prompts_for(prompt_tokens)
    disk = tmp_path / "disk"
    base = {
        "model": str(model),
        "dtype": dtype,
        "prompts": prompts,
        "max_tokens": MAX_TOKENS,
        "prefix_caching": prefix_caching,
    }
    served = {"prompts": [0, 1], "reset": prefix_caching, "wipe": True}
    reference_proc = start({**base, "rounds": [{"prompts": [0, 1]}]})
    connector_proc = start(
        {
            **base,
            "kv_transfer_config": connector_config(disk),
            "rounds": [
                {"prompts": [0]},
                {"prompts": [1]},
                served,
                {**served, "break": broken_kind},
            ],
        }
    )
    reference, reference_log = finish(reference_proc)
    run, run_log = finish(connector_proc)
    # A restarted server (lmprefetch's CPU tier empty): served from the disk tier.
    restarted, restarted_log = finish(
        start({**base, "kv_transfer_config": connector_config(disk), "rounds": [served]})
    )

    for result, log in ((reference, reference_log), (run, run_log), (restarted, restarted_log)):
        assert "Turning off hybrid" not in log
        assert result["hma_disabled"] is False
        assert [g["spec"] for g in result["groups"]] == group_specs
    expected = [r["output"] for r in reference["rounds"][0]]
    cs = run["chunk_size"]
    assert cs % max(g["block_size"] for g in run["groups"]) == 0
    hit = (prompt_tokens - 1) // cs * cs
    assert hit > 0
    rounds = run["rounds"]
    assert [rounds[0][0]["output"], rounds[1][0]["output"]] == expected
    assert [r["cached_tokens"] for r in rounds[0] + rounds[1]] == [0, 0]
    # Served from lmprefetch: every cached token is its, and the tokens are the same.
    assert [r["output"] for r in rounds[2]] == expected
    assert [r["cached_tokens"] for r in rounds[2]] == [hit, hit]
    # The restore broken on purpose: the same hits, other tokens.
    assert [r["cached_tokens"] for r in rounds[3]] == [hit, hit]
    assert [r["output"] for r in rounds[3]] != expected, "a broken restore went unnoticed"
    assert [r["output"] for r in restarted["rounds"][0]] == expected
    assert [r["cached_tokens"] for r in restarted["rounds"][0]] == [hit, hit]
    assert run["worker_counters"].get("load_failures", 0) == 0
    assert run["runtime"]["held_lookups"] == 0
    assert run["runtime"]["pinned_chunks"] == 0
    return {
        "groups": run["groups"],
        "chunk_size": cs,
        "hit_tokens": hit,
        "kv_capacity_tokens": kv_capacity_tokens(run_log),
    }


def test_sliding_window_llama_served_from_lmprefetch_and_from_disk(tmp_path: Path) -> None:
    check_model(
        tmp_path,
        "sw-llama",
        dtype="float32",
        prompt_tokens=530,
        prefix_caching=False,
        broken_kind="sliding_window",
        group_specs=["SlidingWindowSpec", "FullAttentionSpec"],
    )


@pytest.mark.hybrid
def test_gemma4_mixed_head_sizes_served_from_lmprefetch_and_from_disk(tmp_path: Path) -> None:
    figures = check_model(
        tmp_path,
        "gemma4",
        dtype="float32",
        prompt_tokens=530,
        prefix_caching=False,
        broken_kind="sliding_window",
        group_specs=["SlidingWindowSpec", "FullAttentionSpec"],
    )
    # Head size 64 with sliding window, 128 with full attention: vLLM pads pages to one size,
    # so the sliding-window group's blocks hold twice the tokens.
    sizes = [g["block_size"] for g in figures["groups"]]
    assert sizes[0] == 2 * sizes[1]


@pytest.mark.hybrid
def test_qwen3_next_recurrent_state_served_from_lmprefetch_and_from_disk(tmp_path: Path) -> None:
    figures = check_model(
        tmp_path,
        "qwen3-next",
        dtype="bfloat16",
        prompt_tokens=1170,
        prefix_caching=True,  # vLLM keeps Mamba states (align mode) only with it
        broken_kind="mamba",
        group_specs=["MambaSpec", "FullAttentionSpec"],
    )
    assert figures["chunk_size"] >= 256  # the block is aligned to the state's page


@pytest.mark.hybrid
def test_tensor_parallel_ranks_each_restore_their_slice_of_every_group(tmp_path: Path) -> None:
    """TP=2: two worker processes, two lmprefetch runtimes with per-rank keys; vLLM's KV cache
    is zeroed and the restore broken in the workers (``collective_rpc``)."""
    model = write_hybrid_model(
        tmp_path / "m", "sw-llama", weights=True, changes={"num_key_value_heads": 2}
    )
    served = {"prompts": [0, 1], "wipe": True}
    spec = {
        "model": str(model),
        "dtype": "float32",
        "prompts": prompts_for(530),
        "max_tokens": MAX_TOKENS,
        "prefix_caching": False,
        "tensor_parallel_size": 2,
        "kv_transfer_config": connector_config(tmp_path / "disk"),
        "rounds": [
            {"prompts": [0]},
            {"prompts": [1]},
            served,
            {**served, "break": "sliding_window"},
        ],
    }
    proc = subprocess.Popen(
        [sys.executable, str(CHILD), json.dumps(spec)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={
            **{k: v for k, v in child_env().items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"},
            # collective_rpc sends the wipe and break functions to the workers (pickled).
            "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
        },
        cwd=ROOT,
    )
    result, log = finish(proc)
    assert "Turning off hybrid" not in log
    rounds = result["rounds"]
    computed = [rounds[0][0]["output"], rounds[1][0]["output"]]
    assert [r["output"] for r in rounds[2]] == computed
    assert [r["cached_tokens"] for r in rounds[2]] == [512, 512]
    assert [r["output"] for r in rounds[3]] != computed


@pytest.mark.hybrid
def test_kv_cache_capacity_with_hma_on_and_off(
    tmp_path: Path, record_property: pytest.RecordProperty
) -> None:
    """vLLM's KV cache capacity (tokens, as it logs it) for the same 64 MiB with its hybrid
    manager on and off: a sliding-window layer keeps only its window with HMA on.  Qwen3-Next
    does not start with HMA off at all."""
    figures: dict[str, dict[str, int]] = {}
    for name, dtype in (("sw-llama", "float32"), ("gemma4", "float32")):
        model = write_hybrid_model(tmp_path / name, name)  # config only: dummy weights
        spec = {
            "model": str(model),
            "dtype": dtype,
            "prompts": prompts_for(64),
            "max_tokens": 1,
            "prefix_caching": False,
            "rounds": [{"prompts": [0]}],
            "load_format": "dummy",
            # vLLM reserves a sliding-window group's blocks for the tokens in flight.
            "max_num_batched_tokens": 512,
        }
        on, off = start({**spec, "disable_hma": False}), start({**spec, "disable_hma": True})
        (on_result, on_log), (off_result, off_log) = finish(on), finish(off)
        assert on_result["hma_disabled"] is False
        assert off_result["hma_disabled"] is True
        assert len(on_result["groups"]) == 2
        assert len(off_result["groups"]) == 1
        figures[name] = {
            "hma_on": kv_capacity_tokens(on_log),
            "hma_off": kv_capacity_tokens(off_log),
        }
        assert figures[name]["hma_on"] > figures[name]["hma_off"]
    model = write_hybrid_model(tmp_path / "qwen3-next", "qwen3-next")
    proc = start(
        {
            "model": str(model),
            "dtype": "bfloat16",
            "prompts": prompts_for(64),
            "max_tokens": 1,
            "prefix_caching": True,
            "rounds": [{"prompts": [0]}],
            "load_format": "dummy",
            "disable_hma": True,
        }
    )
    out, _ = proc.communicate(timeout=TIMEOUT_S)
    assert proc.returncode != 0
    assert "Failed to promote" in out or "unified type" in out, out[-3000:]
    record_property("kv_capacity_tokens", json.dumps(figures))
    print("KV capacity (tokens, 64 MiB):", json.dumps(figures))
