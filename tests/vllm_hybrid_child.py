"""A child process for ``tests/test_vllm_hybrid_e2e.py``: one vLLM ``LLM`` on a hybrid model.

Run as ``python tests/vllm_hybrid_child.py '<json spec>'``.  It runs the spec's ``rounds``
one after the other; each round generates every prompt (one ``generate`` call) and may first
reset vLLM's prefix cache (``reset``: so that a round's hits can only come from lmprefetch),
zero vLLM's KV cache (``wipe``: a stale block cannot stand in for a restored one) and break
lmprefetch's restore on purpose (``break``: the group kind whose restored rows are dropped).
It prints one JSON line prefixed ``RESULT ``: per round the outputs and cached tokens, the KV
cache groups vLLM built, whether HMA is off, and (one rank) the connector's counters.

Spec fields: ``model``, ``dtype``, ``prompts``, ``rounds`` (``[{"prompts": [...], "reset":
bool, "wipe": bool, "break": kind|null}]``), ``max_tokens``, ``prefix_caching``,
``kv_transfer_config`` (or null), ``disable_hma`` (null: vLLM decides),
``tensor_parallel_size``, ``kv_cache_memory_bytes``, ``load_format``,
``max_num_batched_tokens``.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any


# These run on every worker (``LLM.collective_rpc``: in this process with one rank, in vLLM's
# worker processes with several), and take the worker as their first argument.
def _break_restore(_worker: Any, kind: str) -> None:
    """Drop every restored row of the KV cache groups of ``kind`` (the test's deliberate bug)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    worker = get_kv_transfer_group().worker_side
    doomed = {g.index for g in worker._groups.groups if g.kind == kind}
    real = worker._claim

    def claim(req_id: str, claim: Any, runtime: Any) -> int:
        for key in claim.keys:
            if key.group in doomed:
                key.rows, key.block_ids = [], []
        return int(real(req_id, claim, runtime))

    worker._claim = claim


def _wipe_kv_cache(_worker: Any) -> None:
    """Zero vLLM's whole KV cache (through the connector's views of it): blocks freed by an
    earlier round may still hold the same prompt's KV, which would hide a restore that
    writes nothing."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    worker = get_kv_transfer_group().worker_side
    for layout in worker.layouts.values():
        for layer in layout.layers:
            layer.rows.zero_()


def _reset_prefix_cache(llm: Any) -> None:
    # It refuses while blocks are still held (e.g. freed a step later): wait for it.
    deadline = time.monotonic() + 60
    while not llm.reset_prefix_cache():
        if time.monotonic() > deadline:
            raise RuntimeError("vLLM's prefix cache could not be reset")
        time.sleep(0.05)


def main() -> int:
    spec: dict[str, Any] = json.loads(sys.argv[1])
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    ktc = KVTransferConfig(**spec["kv_transfer_config"]) if spec.get("kv_transfer_config") else None
    tp = int(spec.get("tensor_parallel_size", 1))
    kwargs: dict[str, Any] = {}
    if spec.get("disable_hma") is not None:
        kwargs["disable_hybrid_kv_cache_manager"] = bool(spec["disable_hma"])
    llm = LLM(
        model=spec["model"],
        skip_tokenizer_init=True,
        dtype=spec["dtype"],
        enforce_eager=True,
        max_model_len=4096,
        seed=0,
        enable_prefix_caching=bool(spec["prefix_caching"]),
        kv_cache_memory_bytes=int(spec.get("kv_cache_memory_bytes", 64 << 20)),
        tensor_parallel_size=tp,
        distributed_executor_backend="uni" if tp == 1 else "mp",
        kv_transfer_config=ktc,
        load_format=spec.get("load_format", "auto"),
        max_num_batched_tokens=spec.get("max_num_batched_tokens"),
        **kwargs,
    )
    params = SamplingParams(
        max_tokens=spec["max_tokens"], temperature=0.0, detokenize=False, ignore_eos=True
    )
    rounds = []
    for rnd in spec["rounds"]:
        if rnd.get("reset"):
            _reset_prefix_cache(llm)
        if rnd.get("wipe"):
            llm.collective_rpc(_wipe_kv_cache)
        if rnd.get("break"):
            llm.collective_rpc(_break_restore, args=(rnd["break"],))
        prompts = [TokensPrompt(prompt_token_ids=spec["prompts"][i]) for i in rnd["prompts"]]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        rounds.append(
            [
                {"cached_tokens": o.num_cached_tokens or 0, "output": list(o.outputs[0].token_ids)}
                for o in outputs
            ]
        )
    result: dict[str, Any] = {"rounds": rounds}
    vllm_config = llm.llm_engine.vllm_config
    result["hma_disabled"] = bool(vllm_config.scheduler_config.disable_hybrid_kv_cache_manager)
    if tp == 1:
        core = llm.llm_engine.engine_core.engine_core
        groups = core.scheduler.kv_cache_config.kv_cache_groups
        result["groups"] = [
            {"spec": type(g.kv_cache_spec).__name__, "block_size": g.kv_cache_spec.block_size}
            for g in groups
        ]
        if ktc is not None:
            from vllm.distributed.kv_transfer import get_kv_transfer_group

            worker = get_kv_transfer_group().worker_side
            side = core.scheduler.connector.scheduler_side
            result["chunk_size"] = worker.runtime.config.chunk_size
            result["runtime"] = {k: v for k, v in worker.runtime.stats().items() if k != "tiers"}
            result["worker_counters"] = worker.statistics().as_dict()
            result["scheduler_counters"] = side.statistics().as_dict()
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
