"""The model bench-serve serves: a small Llama with random weights, generated locally.

Nothing is downloaded: the model directory holds only a ``config.json``; vLLM builds the model
from it and fills the weights with its deterministic dummy initialisation
(``--load-format dummy``), and prompts are token ids (``--skip-tokenizer-init``), so no
tokenizer is needed either.  The outputs are meaningless; the work per token is a real Llama's.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "BENCH_LLAMA",
    "TINY_LLAMA",
    "describe",
    "kv_bytes_per_token",
    "parameter_count",
    "write_model",
]

#: The benchmark's model: 4 layers, hidden size 512, 8 query heads and 2 KV heads of 64
#: dimensions (grouped-query attention, as in Llama 3), MLP 1536, a 32k vocabulary, float32.
#: About 30 M parameters; a 4k-token prefill takes on the order of a second on a 2-core x86
#: machine (vLLM's CPU build), and its KV cache is 4 KiB per token (16 MiB for 4k tokens).
BENCH_LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_hidden_layers": 4,
    "vocab_size": 32000,
    "max_position_embeddings": 16384,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}

#: A tiny model for structural tests: 2 layers, hidden size 128, one KV head of 64 dimensions
#: (the CPU attention backend rejects 16), 512 bytes of KV per token.
TINY_LLAMA: dict[str, Any] = {
    **BENCH_LLAMA,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "num_hidden_layers": 2,
    "vocab_size": 1000,
    "max_position_embeddings": 8192,
}

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def kv_bytes_per_token(config: Mapping[str, Any]) -> int:
    """Bytes of KV cache one token takes in vLLM's pool (K and V, every layer)."""
    head_dim = int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
    return (
        2
        * int(config["num_hidden_layers"])
        * int(config["num_key_value_heads"])
        * head_dim
        * _DTYPE_BYTES[str(config.get("torch_dtype", "float32"))]
    )


def parameter_count(config: Mapping[str, Any]) -> int:
    """Parameters of a Llama with this config (embeddings and LM head untied)."""
    h = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    kv = int(config["num_key_value_heads"])
    d = int(config.get("head_dim") or h // heads)
    inter = int(config["intermediate_size"])
    vocab = int(config["vocab_size"])
    per_layer = h * heads * d * 2 + h * kv * d * 2 + 3 * h * inter + 2 * h
    return int(config["num_hidden_layers"]) * per_layer + 2 * vocab * h + h


def describe(config: Mapping[str, Any]) -> str:
    """One line: the model's dimensions."""
    d = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return (
        f"random-weight Llama, {config['num_hidden_layers']} layers, hidden "
        f"{config['hidden_size']}, {config['num_attention_heads']} heads / "
        f"{config['num_key_value_heads']} KV heads x {d}, MLP {config['intermediate_size']}, "
        f"vocab {config['vocab_size']}, {config.get('torch_dtype', 'float32')}, "
        f"{parameter_count(config) / 1e6:.0f} M parameters, "
        f"KV {kv_bytes_per_token(config) / 1024:g} KiB/token"
    )


def write_model(directory: Path, config: Mapping[str, Any]) -> Path:
    """Write the model (its ``config.json``) into ``directory``; returns the directory."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(dict(config), indent=1))
    return directory
