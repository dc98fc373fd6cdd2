"""The trained model (SmolLM2-135M) on vLLM's OpenAI server (CPU build), through
LMPrefetchConnector, over HTTP: a prompt restored from lmprefetch's disk tier after a server
restart gives exactly the tokens vLLM's own prefix-cache hit of the same length gives, with
exactly the same log-probabilities (a KV cache off by one unit in the last place of every value
leaves greedy tokens alone, but not those).

A random-weight model cannot show this (its output hardly depends on the KV); a trained one's
greedy continuation of English text does.  Comparing tokens needs the same numerics on both
sides, so both hits leave the same split point (vLLM's block size equals the chunk size, and
the prompt is a whole number of chunks plus one token: both caches supply every whole block),
and every server runs with the same OpenMP thread count: with a KV connector configured,
vLLM's CPU build reserves one more core for it, which on a 2-core machine changes the bf16
results of the model even without any hit, so ``VLLM_CPU_NUM_OF_RESERVED_CPU=1`` is set for
every server here (docs/vllm.md, "Comparing tokens on a CPU").

The same holds with the disk tier's ``lossless`` codec, with and without encryption
(docs/codecs.md): what is restored is exactly what was computed.  The lossy codecs are
measured through vLLM too (:mod:`lmprefetch.bench.vllm_quality`): a continuation scored from
vLLM's prompt log-probabilities through the KV they restore, against the codec ``none``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import pytest
import trio

pytest.importorskip("vllm")
httpx = pytest.importorskip("httpx")

from lmprefetch.bench.serve.client import scrape_metrics  # noqa: E402
from lmprefetch.bench.serve.model import english_corpus, kv_bytes_per_token  # noqa: E402
from lmprefetch.bench.serve.procs import ManagedProcess, ProcessSet, free_port  # noqa: E402
from lmprefetch.bench.serve.servers import base_env, private_dirs, server_argv  # noqa: E402
from lmprefetch.bench.trained import SMOLLM2_CONFIG  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.trained, pytest.mark.slow]

CHUNK = 64  # lmprefetch's chunk size, and vLLM's block size
CHUNKS = 5
GENERATED = 24
STARTUP_TIMEOUT_S = 900.0
REQUEST_TIMEOUT_S = 600.0


def kv_transfer_config(disk: Path, codec: str = "none") -> dict[str, object]:
    name, _, sealed = codec.partition("+")
    extra: dict[str, object] = {"disk_codec": name}
    if sealed:
        key = disk.parent / "key"
        key.write_bytes(bytes(range(32)))
        extra["encryption_key_file"] = str(key)
    return {
        "kv_connector": "LMPrefetchConnector",
        "kv_connector_module_path": "lmprefetch.integration.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "chunk_size": CHUNK,
            "cpu_bytes": 64 << 20,
            "disk_path": str(disk),
            "lookup_timeout_s": 120.0,  # a busy machine must not turn a hit into a miss
            **extra,
        },
    }


class Generated(NamedTuple):
    """One greedy completion: its tokens, their log-probabilities (floats computed from the
    logits: equal only when the KV they attended to was), and the prompt tokens not computed."""

    token_ids: list[int]
    logprobs: list[float]
    cached_tokens: int


async def generate(client: httpx.AsyncClient, prompt: Sequence[int]) -> Generated:
    body = {
        "model": "bench", "prompt": list(prompt), "max_tokens": GENERATED, "temperature": 0.0,
        "ignore_eos": True, "logprobs": 1, "return_token_ids": True,
    }  # fmt: skip
    response = await client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text[:500]
    answer = response.json()
    choice = answer["choices"][0]
    details = answer["usage"].get("prompt_tokens_details") or {}
    return Generated(
        list(choice["token_ids"]),
        list(choice["logprobs"]["token_logprobs"]),
        int(details.get("cached_tokens") or 0),
    )


async def serve_once(
    tmp: Path,
    runtime: Path,
    model: Path,
    disk: Path,
    prompts: Sequence[Sequence[int]],
    codec: str = "none",
) -> list[tuple[Generated, dict[str, float]]]:
    """Start one server, send ``prompts`` one after the other, stop it (its connector flushes
    the disk tier's writes when it closes); each answer with the metrics' change it made."""
    port = free_port()
    argv = server_argv(
        sys.executable,
        model,
        port,
        max_model_len=1024,
        block_size=CHUNK,
        kv_pool_bytes=2048 * kv_bytes_per_token(SMOLLM2_CONFIG),
        prefix_caching=True,
        kv_transfer_config=kv_transfer_config(disk, codec),
    )
    argv.remove("--skip-tokenizer-init")  # log-probabilities need the tokenizer (it has one)
    env = base_env(runtime)
    env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "1"  # the same thread count as a server without one
    out = []
    async with trio.open_nursery() as nursery:
        procs = ProcessSet(nursery)
        try:
            await procs.start(
                ManagedProcess(
                    "server", argv, env, "Application startup complete", cwd=tmp, port=port
                ),
                STARTUP_TIMEOUT_S,
            )
            async with httpx.AsyncClient(
                base_url=f"http://127.0.0.1:{port}", timeout=REQUEST_TIMEOUT_S, trust_env=False
            ) as client:
                for prompt in prompts:
                    before = await scrape_metrics(client)
                    with trio.fail_after(REQUEST_TIMEOUT_S):
                        done = await generate(client, prompt)
                    with trio.fail_after(60):
                        while True:  # vLLM records a request just after its stream ends
                            after = await scrape_metrics(client)
                            if after["prompt_tokens"] - before["prompt_tokens"] >= len(prompt):
                                break
                            await trio.sleep(0.05)
                    out.append((done, {k: after[k] - before.get(k, 0.0) for k in after}))
        except BaseException:
            # A server that went away: what it said last, in the test's captured stderr.
            print(procs.post_mortem(), file=sys.stderr)
            raise
        finally:
            await procs.stop_all()
    return out


@pytest.mark.parametrize("codec", ["none", "lossless", "lossless+aes"])
async def test_a_prompt_restored_from_disk_after_a_restart_gives_the_prefix_cache_hits_tokens(
    tmp_path: Path, trained_model: Path, codec: str
) -> None:
    model = trained_model
    corpus = english_corpus(model)
    prompt = list(corpus[: CHUNKS * CHUNK + 1])  # whole chunks plus the token to compute
    hit = CHUNKS * CHUNK
    disk = tmp_path / "disk"
    async with private_dirs() as (tmp, runtime):
        # Server 1: computed once (lmprefetch stores every chunk), then served by vLLM's own
        # prefix cache.
        (cold, _), (apc, apc_metrics) = await serve_once(
            tmp, runtime, model, disk, [prompt, prompt], codec
        )
        # Server 2, a fresh process on the same disk tier: its own prefix cache is empty, so
        # the whole prefix comes from lmprefetch's disk.
        ((restored, restored_metrics),) = await serve_once(
            tmp, runtime, model, disk, [prompt], codec
        )
    assert cold.cached_tokens == 0
    assert apc.cached_tokens == hit and apc_metrics["local_cache_hit"] == hit
    assert restored.cached_tokens == hit and restored_metrics["external_kv_transfer"] == hit
    assert len(apc.token_ids) == GENERATED
    assert restored.token_ids == apc.token_ids
    assert restored.logprobs == apc.logprobs  # exactly: the restored KV is the computed KV
    if codec != "none":  # the chunks on disk are encoded (and sealed): none holds the KV as is
        stored = sum(f.stat().st_size for f in disk.glob("*.kv"))
        raw = CHUNKS * CHUNK * kv_bytes_per_token(SMOLLM2_CONFIG)
        assert stored < raw if codec == "lossless" else stored > 0


def test_lossy_codecs_through_vllm_cost_little_and_lossless_nothing(trained_model: Path) -> None:
    """Each codec's KV restored inside vLLM from lmprefetch's disk tier, a continuation
    scored through it (prompt log-probabilities), against the codec ``none``: ``lossless``
    changes nothing at all; the recommended lossy codec, ``bitround3``, stores at most half
    the bytes for a small perplexity change; ``int4`` a quarter for a larger one."""
    from lmprefetch.bench.vllm_quality import run

    corpus = english_corpus(trained_model)
    window = list(corpus[: 4 * CHUNK + 2 * CHUNK])
    figures = {
        f.codec: f
        for f in run(
            model_dir=trained_model,
            codecs=["lossless", "bitround3", "int4"],
            windows=[window],
            hit=4 * CHUNK,
            chunk_size=CHUNK,
            generated=8,
        )
    }
    none, lossless = figures["none"], figures["lossless"]
    assert none.hit_tokens == 4 * CHUNK and none.scored_tokens == 2 * CHUNK - 1
    assert none.ratio == 1.0
    assert lossless.logprobs_exact and lossless.tokens_equal == lossless.tokens_total == 8
    assert lossless.ratio < 0.75
    bitround3, int4 = figures["bitround3"], figures["int4"]
    assert bitround3.ratio < 0.5 and int4.ratio < 0.35
    assert not bitround3.logprobs_exact  # it did change the KV
    assert abs(bitround3.ppl_change_pct) < 3.0
    assert abs(int4.ppl_change_pct) < 10.0


def test_bench_serve_with_the_trained_model_restores_english_documents_from_disk(
    tmp_path: Path, trained_model: Path
) -> None:
    """``lmprefetch bench-serve --model trained``: English prompts on SmolLM2, every measured
    document of the disk scenario served from lmprefetch's disk after the restarts."""
    import json
    import subprocess

    out = tmp_path / "result.json"
    argv = [
        sys.executable, "-m", "lmprefetch", "bench-serve", "--quick", "--no-progress",
        "--model", "trained", "--scenarios", "lmprefetch_disk_restart", "--json", str(out),
    ]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=3600, check=False)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "SmolLM2-135M-Instruct (trained)" in proc.stdout and "English text" in proc.stdout
    result = json.loads(out.read_text())
    settings = result["settings"]
    assert settings["model_kind"] == "trained" and settings["prompts"] == "English text"
    entry = result["scenarios"]["lmprefetch_disk_restart"]
    assert "error" not in entry, entry
    doc_tokens = settings["long_doc_qa"]["doc_tokens"]
    measured_docs = settings["long_doc_qa"]["docs"] * (settings["rounds"] - 1)
    assert entry["hit_tokens"] == measured_docs * doc_tokens
    assert entry["metrics"]["external_kv_transfer"] > 0
