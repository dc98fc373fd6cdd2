"""Small hybrid models written locally: sliding-window, mixed-head-size and Mamba / GDN
hybrids that vLLM's CPU build serves with its hybrid KV cache manager (nothing is downloaded).

* ``sw-llama``: a Llama whose first layer uses a sliding window (``layer_types``), the other
  full attention: two KV cache groups of the same geometry;
* ``gemma4``: Gemma-4 (text): a sliding-window layer of head size 64 and a full-attention
  layer of head size 128; vLLM gives the two groups different block sizes;
* ``qwen3-next``: Qwen3-Next: a gated delta-net (linear attention, a Mamba-style recurrent
  state) layer and a full-attention layer, 4 experts, bfloat16 (vLLM's CPU GDN kernels need
  bfloat16 and 128-wide heads); vLLM aligns its block size to the state's page (hundreds of
  tokens) and keeps states only with prefix caching on.

With ``weights=True`` the weights are transformers' own random initialisation, saved as
safetensors, so the output depends on the KV cache and the recurrent state: vLLM's
``--load-format dummy`` fills weights so small (about 1e-3) that a zeroed KV group gives the
same tokens.  Qwen3-Next's recurrent decay (``A_log``) is slowed so that the state carries
over hundreds of tokens.  Without weights only ``config.json`` is written (for
``--load-format dummy``: timing runs).

transformers (a vLLM dependency) is imported only when a model is written.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

__all__ = ["HYBRID_MODELS", "hybrid_config", "sliding_window_variant", "write_hybrid_model"]

_COMMON: dict[str, Any] = {
    "vocab_size": 1000,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "max_position_embeddings": 8192,
}

#: name -> (transformers model type, config overrides, dtype).
HYBRID_MODELS: dict[str, tuple[str, dict[str, Any], str]] = {
    "sw-llama": (
        "llama",
        {
            "layer_types": ["sliding_attention", "full_attention"],
            "sliding_window": 64,
            # Weights 5 times transformers' default spread: the attention then moves the
            # output enough that a window's few dozen restored tokens decide the next ones.
            "initializer_range": 0.1,
        },
        "float32",
    ),
    "gemma4": (
        "gemma4_text",
        {
            "layer_types": ["sliding_attention", "full_attention"],
            "sliding_window": 64,
            "global_head_dim": 128,
            "vocab_size_per_layer_input": 1000,
            "hidden_size_per_layer_input": 16,
            # Twice the default spread (more makes the outputs repeat one token).
            "initializer_range": 0.04,
        },
        "float32",
    ),
    "qwen3-next": (
        "qwen3_next",
        {
            "layer_types": ["linear_attention", "full_attention"],
            "num_experts": 4,
            "num_experts_per_tok": 1,
            "moe_intermediate_size": 64,
            "shared_expert_intermediate_size": 64,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 2,
            "initializer_range": 0.1,
        },
        "bfloat16",
    ),
}


def sliding_window_variant(llama: dict[str, Any], window: int = 512) -> dict[str, Any]:
    """A Llama ``config.json`` (a dict) with every other layer a sliding window of ``window``
    tokens, starting with the first (``layer_types``, which vLLM's Llama reads): the same work
    per token, two KV cache groups under vLLM's hybrid KV cache manager."""
    layers = int(llama["num_hidden_layers"])
    types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    return {**llama, "layer_types": types, "sliding_window": window}


#: Qwen3-Next's slowed decay: ``g = -exp(A_log) * softplus(...)`` per token, so a state keeps
#: about ``exp(-0.001 * 1.3 * n)`` of itself after ``n`` tokens (transformers draws A from
#: 0.01 .. 16: the state is forgotten within a few tokens).
_SLOW_A = 0.001


def _transformers_config(name: str, changes: dict[str, Any] | None = None) -> Any:
    from transformers import CONFIG_MAPPING

    model_type, overrides, dtype = HYBRID_MODELS[name]
    fields = {**_COMMON, **overrides, **(changes or {})}
    return CONFIG_MAPPING[model_type](**fields, dtype=dtype)


def hybrid_config(name: str, changes: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``config.json`` of model ``name`` (see :data:`HYBRID_MODELS`), with ``changes``
    to its fields (e.g. ``{"num_key_value_heads": 2}`` for two tensor-parallel ranks).

    Raises:
        KeyError: an unknown name.
    """
    config = _transformers_config(name, changes)
    out: dict[str, Any] = config.to_dict()
    out["architectures"] = [_ARCHITECTURES[name]]
    return out


_ARCHITECTURES = {
    "sw-llama": "LlamaForCausalLM",
    "gemma4": "Gemma4ForCausalLM",
    "qwen3-next": "Qwen3NextForCausalLM",
}


def write_hybrid_model(
    directory: Path,
    name: str,
    *,
    weights: bool = False,
    seed: int = 0,
    changes: dict[str, Any] | None = None,
) -> Path:
    """Write model ``name`` into ``directory`` (created); returns the directory.

    Args:
        directory: where ``config.json`` (and with ``weights`` the safetensors) go.
        name: one of :data:`HYBRID_MODELS`.
        weights: also write random weights (transformers' initialisation, seeded).
        seed: the weights' seed.
        changes: changes to the model's config fields.
    """
    directory.mkdir(parents=True, exist_ok=True)
    if not weights:
        config_json = hybrid_config(name, changes)
        (directory / "config.json").write_text(json.dumps(config_json, indent=1))
        return directory
    import torch
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, HYBRID_MODELS[name][2])
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_transformers_config(name, changes), dtype=dtype)
    if name == "qwen3-next":
        with torch.no_grad():
            for param_name, param in model.named_parameters():
                if param_name.endswith("A_log"):
                    param.fill_(math.log(_SLOW_A))
    model.save_pretrained(directory)
    config = json.loads((directory / "config.json").read_text())
    config["architectures"] = [_ARCHITECTURES[name]]
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    return directory
