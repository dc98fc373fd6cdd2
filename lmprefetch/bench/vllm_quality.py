"""``lmprefetch bench-codecs --vllm``: what each codec costs in quality *through vLLM*, on the
trained model, with the KV restored by lmprefetch.

For each codec, one child process runs vLLM's offline ``LLM`` (the CPU build) on SmolLM2-135M
with ``LMPrefetchConnector`` and a disk tier whose ``disk_codec`` is that codec.  For each
window of an English text (``hit`` tokens, then ``continuation`` tokens):

1. the ``hit`` tokens (and one more) are computed once: lmprefetch stores their chunks, encoded;
2. the disk tier's writes are flushed, lmprefetch's CPU tier forgets every chunk, and vLLM's own
   prefix cache is reset: the next hit can only come from lmprefetch's disk, decoded;
3. the whole window is sent with ``prompt_logprobs`` (and ``skip_reading_prefix_cache`` off, so
   that vLLM asks the connector despite them): the ``hit`` tokens come from the restored KV
   (checked: ``num_cached_tokens``), and the log-probabilities of the continuation's tokens are
   computed through it; a greedy continuation of ``generated`` tokens too.

The figures per codec: the perplexity of the continuation (from those log-probabilities), its
change against the codec ``none`` (the same split point, the same numerics: a restore with
``none`` is the KV vLLM computed, bit for bit), how many greedy tokens equal ``none``'s, and the
bytes the disk tier stored against the payloads (vLLM's own KV layout).  Lossless codecs must
give exactly ``none``'s log-probabilities and tokens.

Every child runs with ``VLLM_CPU_NUM_OF_RESERVED_CPU=1`` (docs/vllm.md, "Comparing tokens on a
CPU") and vLLM's block size equal to the chunk size.  A child prints one line, ``RESULT {json}``.
Needs vllm (the CPU build), the ``codecs`` extra, and the ``encryption`` extra for ``+aes``.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["VllmCodecFigures", "child_main", "run"]

RESULT = "RESULT "


@dataclass
class VllmCodecFigures:
    """One codec's figures through vLLM."""

    codec: str
    windows: int
    hit_tokens: int
    scored_tokens: int
    nll: float
    stored_bytes: int
    payload_bytes: int
    logprobs: list[float] = field(repr=False, default_factory=list)
    tokens: list[list[int]] = field(repr=False, default_factory=list)
    #: Against ``none``: perplexity change in percent, whether the log-probabilities and the
    #: greedy tokens are exactly ``none``'s, and how many greedy tokens are.
    ppl_change_pct: float = math.nan
    logprobs_exact: bool = False
    tokens_equal: int = 0
    tokens_total: int = 0

    @property
    def ratio(self) -> float:
        return self.stored_bytes / self.payload_bytes if self.payload_bytes else math.nan


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        VLLM_TARGET_DEVICE="cpu",
        HF_HUB_OFFLINE="1",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",  # scheduler and worker here: the runtime is reachable
        VLLM_CPU_NUM_OF_RESERVED_CPU="1",  # the same thread count in every child (see above)
    )
    return env


def run(
    *,
    model_dir: Path,
    codecs: Sequence[str],
    windows: Sequence[Sequence[int]],
    hit: int,
    chunk_size: int,
    generated: int = 16,
    timeout_s: float = 1800.0,
    log: Any = None,
) -> list[VllmCodecFigures]:
    """Run one child per codec (``none`` first, the reference) on ``windows`` (token ids,
    each ``hit`` + the continuation); the figures, compared with ``none``'s.

    Raises:
        RuntimeError: a child failed (its output's tail in the message).
    """
    names = ["none", *(c for c in codecs if c != "none")]
    out: list[VllmCodecFigures] = []
    with tempfile.TemporaryDirectory(prefix="lmprefetch-vllm-quality-") as tmp:
        key = Path(tmp) / "key"
        key.write_bytes(os.urandom(32))
        for name in names:
            codec, _, sealed = name.partition("+")
            spec = {
                "model": str(model_dir),
                "codec": codec,
                "key_file": str(key) if sealed == "aes" else None,
                "disk_path": str(Path(tmp) / name.replace("+", "-")),
                "windows": [list(w) for w in windows],
                "hit": hit,
                "chunk_size": chunk_size,
                "generated": generated,
            }
            if log is not None:
                log(f"vLLM child for {name} ...")
            proc = subprocess.run(
                [sys.executable, "-m", "lmprefetch.bench.vllm_quality", json.dumps(spec)],
                env=_child_env(),
                capture_output=True,
                text=True,
                timeout=timeout_s,
                check=False,
                cwd=tmp,
            )
            lines = [x for x in proc.stdout.splitlines() if x.startswith(RESULT)]
            if proc.returncode != 0 or not lines:
                tail = (proc.stdout + proc.stderr)[-3000:]
                raise RuntimeError(f"the vLLM child for {name} failed ({proc.returncode}): {tail}")
            r = json.loads(lines[-1][len(RESULT) :])
            out.append(
                VllmCodecFigures(
                    codec=name,
                    windows=len(windows),
                    hit_tokens=r["hit_tokens"],
                    scored_tokens=len(r["logprobs"]),
                    nll=-sum(r["logprobs"]) / len(r["logprobs"]),
                    stored_bytes=r["stored_bytes"],
                    payload_bytes=r["payload_bytes"],
                    logprobs=r["logprobs"],
                    tokens=r["tokens"],
                )
            )
    reference = out[0]
    for f in out:
        f.ppl_change_pct = (math.exp(f.nll - reference.nll) - 1) * 100
        f.logprobs_exact = f.logprobs == reference.logprobs
        pairs = [(a, b) for x, y in zip(f.tokens, reference.tokens) for a, b in zip(x, y)]
        f.tokens_total = len(pairs)
        f.tokens_equal = sum(a == b for a, b in pairs)
    return out


def table(figures: Sequence[VllmCodecFigures]) -> str:
    if not figures:
        return ""
    first = figures[0]
    per_hit, per_scored = first.hit_tokens // first.windows, first.scored_tokens // first.windows
    lines = [
        f"through vLLM (offline LLM, CPU): {first.windows} windows, each {per_hit} tokens "
        f"restored from lmprefetch's disk tier and {per_scored} scored after them (prompt "
        "log-probabilities); reference: the codec none",
        f"{'disk_codec':<14} {'on disk/raw':>11} {'perplexity':>11} {'change':>8} "
        f"{'logprobs':>9} {'greedy tokens = none':>21}",
    ]
    for f in figures:
        lines.append(
            f"{f.codec:<14} {f.ratio:>11.3f} {math.exp(f.nll):>11.3f} {f.ppl_change_pct:>+7.2f}% "
            f"{'exact' if f.logprobs_exact else 'differ':>9} "
            f"{f.tokens_equal:>12} of {f.tokens_total:<6}"
        )
    return "\n".join(lines)


# -- the child ---------------------------------------------------------------------------------
def child_main(spec: dict[str, Any]) -> dict[str, Any]:  # pragma: no cover - a vLLM process
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.inputs import TokensPrompt

    chunk = int(spec["chunk_size"])
    hit = int(spec["hit"])
    extra: dict[str, Any] = {
        "chunk_size": chunk,
        "cpu_bytes": 256 << 20,
        "disk_path": spec["disk_path"],
        "disk_codec": spec["codec"],
        "lookup_timeout_s": 300.0,  # a busy machine must not turn a hit into a miss
    }
    if spec.get("key_file"):
        extra["encryption_key_file"] = spec["key_file"]
    window_tokens = max(len(w) for w in spec["windows"])
    llm = LLM(
        model=spec["model"],
        dtype="bfloat16",
        enforce_eager=True,
        max_model_len=window_tokens + int(spec["generated"]) + chunk,
        block_size=chunk,
        seed=0,
        enable_prefix_caching=True,
        kv_cache_memory_bytes=256 << 20,
        distributed_executor_backend="uni",
        kv_transfer_config=KVTransferConfig(
            kv_connector="LMPrefetchConnector",
            kv_connector_module_path="lmprefetch.integration.vllm",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config=extra,
        ),
    )
    runtime = get_kv_transfer_group().worker_side.runtime

    def forget_cpu_tier() -> None:
        cpu = runtime.engine.cpu
        for key in list(cpu.keys()):  # (the CPU tier's keys, least recently used first)
            cpu.discard(key)

    logprobs: list[float] = []
    tokens: list[list[int]] = []
    hit_tokens = 0
    for window in spec["windows"]:
        window = list(window)
        stored = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        llm.generate([TokensPrompt(prompt_token_ids=window[: hit + 1])], stored, use_tqdm=False)
        runtime.call(runtime.engine.flush)  # every chunk on disk, encoded
        runtime.call(forget_cpu_tier)
        llm.reset_prefix_cache()
        scored = SamplingParams(
            max_tokens=int(spec["generated"]),
            temperature=0.0,
            detokenize=False,
            prompt_logprobs=0,
            skip_reading_prefix_cache=False,  # the hit must be read despite prompt_logprobs
        )
        (out,) = llm.generate([TokensPrompt(prompt_token_ids=window)], scored, use_tqdm=False)
        cached = int(out.num_cached_tokens or 0)
        if cached != hit:
            raise RuntimeError(f"{cached} tokens restored, expected {hit}")
        hit_tokens += cached
        plp = out.prompt_logprobs
        assert plp is not None
        # Token i's log-probability comes from position i - 1: those of tokens hit + 1 ... are
        # computed through the restored KV (token hit's would need the last cached position).
        logprobs += [float(plp[i][window[i]].logprob) for i in range(hit + 1, len(window))]
        tokens.append(list(out.outputs[0].token_ids))
    disk = runtime.engine.statistics().tier("disk")
    return {
        "hit_tokens": hit_tokens,
        "logprobs": logprobs,
        "tokens": tokens,
        "stored_bytes": disk.encoded_bytes_stored,
        "payload_bytes": disk.bytes_stored,
        "codec_misses": disk.codec_misses,
    }


if __name__ == "__main__":  # pragma: no cover - the child
    result = child_main(json.loads(sys.argv[1]))
    print(RESULT + json.dumps(result), flush=True)
