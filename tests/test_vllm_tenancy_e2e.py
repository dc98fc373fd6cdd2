"""Tenants and KV events on real vLLM (CPU build): one engine with lmprefetch as its connector,
LoRA enabled and ``--kv-events-config`` publishing on a loopback (ipc) endpoint, driven by
``tests/vllm_tenancy_child.py`` (one child process, shared by the tests below).

The calls, in order (prompt P has two whole chunks; vLLM's own prefix cache is off, so every
cached token is lmprefetch's):

====  ==========================  =====================================================
call  request                     expected
====  ==========================  =====================================================
0-1   P, cache_salt A, twice      0 cached, then both chunks served
2     P, cache_salt B             0: A's chunks are not B's
3     P, no salt                  0: nor the unsalted name space's
4-5   P, salt B; P, no salt       each one's own repeat is served
6-7   P, LoRA "x" (weights 1)     0, then served
8-9   P, LoRA "x" (weights 2)     0: same name, other adapter; then served
10+   four other prompts          fill the small CPU tier: lmprefetch evicts chunks
====  ==========================  =====================================================
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parent.parent
CHILD = Path(__file__).resolve().parent / "vllm_tenancy_child.py"
TIMEOUT_S = 900
BLOCK = 32
CHUNK = 64
CHUNK_BYTES = 2 * 2 * BLOCK * 2 * 64 * 4  # two blocks, two layers, K and V of one 64-wide head

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "num_hidden_layers": 2,
    "vocab_size": 1000,
    "max_position_embeddings": 2048,
    "torch_dtype": "float32",
}


def write_adapter(path: Path, seed: int) -> str:
    """A LoRA adapter for the tiny Llama (v_proj changes the KV, down_proj the output)."""
    path.mkdir(parents=True)
    modules = {"self_attn.v_proj": (64, 128), "mlp.down_proj": (128, 256)}
    (path / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "r": 8,
                "lora_alpha": 16,
                "target_modules": [name.split(".")[1] for name in modules],
                "bias": "none",
            }
        )
    )
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(2):
        for name, (out, inp) in modules.items():
            prefix = f"base_model.model.model.layers.{layer}.{name}"
            tensors[prefix + ".lora_A.weight"] = torch.randn(8, inp, generator=gen) * 3
            tensors[prefix + ".lora_B.weight"] = torch.randn(out, 8, generator=gen) * 3
    safetensors_torch.save_file(tensors, str(path / "adapter_model.safetensors"))
    return str(path)


def tokens(n: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 991 + 3 for i in range(n)]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("tenancy-e2e")
    model = tmp / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY_LLAMA))
    one = write_adapter(tmp / "adapter-1", seed=1)
    two = write_adapter(tmp / "adapter-2", seed=2)
    prompts = [tokens(2 * CHUNK + 12, 1)] + [tokens(2 * CHUNK + 2, s) for s in (2, 3, 4, 5)]
    calls: list[dict[str, Any]] = [
        {"prompt": 0, "cache_salt": "tenant-a"},
        {"prompt": 0, "cache_salt": "tenant-a"},
        {"prompt": 0, "cache_salt": "tenant-b"},
        {"prompt": 0},
        {"prompt": 0, "cache_salt": "tenant-b"},
        {"prompt": 0},
        {"prompt": 0, "lora": ["x", 1, one]},
        {"prompt": 0, "lora": ["x", 1, one]},
        {"prompt": 0, "lora": ["x", 2, two]},
        {"prompt": 0, "lora": ["x", 2, two]},
        *({"prompt": p} for p in (1, 2, 3, 4)),
    ]
    # The ipc path must be short (a Unix socket address); the directory is removed after.
    with tempfile.TemporaryDirectory(prefix="lmp-ev-") as sockets:
        spec = {
            "model": str(model),
            "block_size": BLOCK,
            "chunk_size": CHUNK,
            "max_tokens": 6,
            "prompts": prompts,
            "calls": calls,
            "events_endpoint": f"ipc://{sockets}/events",
            "kv_transfer_config": {
                "kv_connector": "LMPrefetchConnector",
                "kv_connector_module_path": "lmprefetch.integration.vllm",
                "kv_role": "kv_both",
                "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {
                    "chunk_size": CHUNK,
                    "chunk_bytes": CHUNK_BYTES,
                    "cpu_bytes": 16 * CHUNK_BYTES,  # room for the tenants' chunks, not more
                    "disk_path": str(tmp / "disk"),
                },
            },
        }
        env = dict(os.environ)
        env.update(
            VLLM_TARGET_DEVICE="cpu",
            HF_HUB_OFFLINE="1",
            VLLM_CPU_OMP_THREADS_BIND="nobind",
            VLLM_ENABLE_V1_MULTIPROCESSING="0",
            PYTHONWARNINGS="ignore",
        )
        proc = subprocess.run(
            [sys.executable, str(CHILD), json.dumps(spec)],
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
            env=env,
            cwd=ROOT,
            check=False,
        )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, out[-6000:]
    result: dict[str, Any] = json.loads(lines[-1][len("RESULT ") :])
    result["prompts"] = prompts
    return result


def chunk_names(call: dict[str, Any]) -> list[tuple[str, ...]]:
    """vLLM's block hashes of the call's whole chunks, chunk by chunk."""
    per = CHUNK // BLOCK
    hashes = call["block_hashes"]
    return [tuple(hashes[c * per : (c + 1) * per]) for c in range(len(hashes) // per)]


def test_salted_requests_are_served_per_tenant_with_identical_tokens(run: dict[str, Any]) -> None:
    calls = run["calls"][:6]
    assert [c["cached_tokens"] for c in calls] == [0, 2 * CHUNK, 0, 0, 2 * CHUNK, 2 * CHUNK]
    assert all(c["output"] == calls[0]["output"] for c in calls)


def test_lora_requests_are_served_per_adapter_with_identical_tokens(run: dict[str, Any]) -> None:
    """vLLM's CPU build runs LoRA adapters: each adapter's repeat is served from lmprefetch;
    another adapter under the same name is not, nor the base model."""
    base, x1, x1_again, x2, x2_again = (run["calls"][i] for i in (3, 6, 7, 8, 9))
    assert [c["cached_tokens"] for c in (x1, x1_again, x2, x2_again)] == [0, 128, 0, 128]
    assert x1_again["output"] == x1["output"]
    assert x2_again["output"] == x2["output"]
    # The adapters change what the model computes, so sharing KV would be wrong.
    assert x1["output"] != base["output"] and x2["output"] != x1["output"]


def test_subscriber_sees_stores_and_evictions_under_vllm_block_hashes(run: dict[str, Any]) -> None:
    assert run["handed_over"] == len(run["events"])  # the subscriber got every event
    present: dict[tuple[Any, ...], dict[str, Any]] = {}
    stored_cpu: list[tuple[str, ...]] = []  # during the calls
    removed_cpu: list[tuple[str, ...]] = []
    stored_disk: set[tuple[str, ...]] = set()
    for i, ev in enumerate(run["events"]):
        assert ev["ownership"] == "lmprefetch"  # vLLM's own cache is off: no GPU events
        ident = (ev["medium"], ev["locality"], tuple(ev["block_hashes"]))
        if ev["type"] == "BlockStored":
            assert ident not in present, f"stored twice: {ident}"
            present[ident] = ev
            assert ev["block_size"] == BLOCK
            if ev["medium"] == "CPU":
                if i >= run["calls_start"]:
                    stored_cpu.append(ident[2])
            else:
                assert (ev["medium"], ev["locality"]) == ("STORAGE", "LOCAL")
                stored_disk.add(ident[2])
        else:
            assert ev["type"] == "BlockRemoved"
            assert ident in present, f"removed, never stored: {ident}"
            del present[ident]
            if ev["medium"] == "CPU":
                removed_cpu.append(ident[2])
    calls = run["calls"]
    # Every first store of a name space was announced on the CPU tier under vLLM's own
    # (salted, adapter-specific) block hashes, with its tokens; repeats stored nothing new.
    first_stores = [0, 2, 3, 6, 8, 10, 11, 12, 13]
    expected = [name for i in first_stores for name in chunk_names(calls[i])]
    assert stored_cpu == expected
    assert len(set(expected)) == len(expected)  # every tenant's chunks have their own names
    by_name = {tuple(e["block_hashes"]): e for e in run["events"] if e["type"] == "BlockStored"}
    prompt = run["prompts"][0]
    second = by_name[chunk_names(calls[0])[1]]
    assert second["token_ids"] == prompt[CHUNK : 2 * CHUNK]
    assert second["parent_block_hash"] == calls[0]["block_hashes"][1]
    assert by_name[chunk_names(calls[0])[0]]["parent_block_hash"] is None
    assert by_name[chunk_names(calls[6])[0]]["lora_name"] == "x"
    assert by_name[chunk_names(calls[0])[0]]["lora_name"] is None
    # The last prompts overflowed the 16-chunk CPU tier: the oldest chunks were evicted, and
    # what the subscriber believes the CPU tier holds is what it holds.
    assert len(removed_cpu) >= 3
    on_cpu = [ident for ident in present if ident[0] == "CPU"]
    assert len(on_cpu) == run["runtime"]["cpu_resident_chunks"] == 16
    # Every chunk reached the disk tier too (flushed before the last step).
    assert set(expected) <= stored_disk
    assert run["runtime"]["kv_events"]["dropped"] == 0
