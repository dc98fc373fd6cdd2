"""A child process for ``tests/test_vllm_e2e.py``: one vLLM ``LLM``.

Run as ``python tests/vllm_child.py '<json spec>'``; it generates the spec's prompts in batches
(``batches``: lists of prompt indices, one ``generate`` call each, one after the other) and
prints one JSON line (prefixed ``RESULT ``) with the outputs, batch by batch.  With one
rank and ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` the engine runs in this process, and with the
connector the line also carries the connector's and the worker runtime's counters (reachable
because scheduler and worker live here).  With ``tensor_parallel_size`` > 1 the ranks are
vLLM's worker processes.

Load or recompute (``docs/policy.md``): ``batch_params[b]`` gives each prompt of batch ``b`` its
``kv_transfer_params`` (or ``null``); ``drop_cpu_before`` lists batches before which the CPU
tier forgets every chunk (after the disk tier has them), so those batches are served from disk;
with ``record_sources`` vLLM's stats are on and the line carries what the connector answered to
vLLM's ``get_external_cache_hit_sources`` calls.
"""

from __future__ import annotations

import json
import sys
from typing import Any


def main() -> int:
    spec: dict[str, Any] = json.loads(sys.argv[1])
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    ktc = KVTransferConfig(**spec["kv_transfer_config"]) if spec.get("kv_transfer_config") else None
    tp = int(spec.get("tensor_parallel_size", 1))
    llm = LLM(
        model=spec["model"],
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="float32",
        enforce_eager=True,
        max_model_len=1024,
        block_size=spec["block_size"],
        seed=0,
        enable_prefix_caching=False,
        kv_cache_memory_bytes=64 << 20,
        tensor_parallel_size=tp,
        distributed_executor_backend="uni" if tp == 1 else "mp",
        kv_transfer_config=ktc,
        disable_log_stats=not spec.get("record_sources", False),
    )
    sources: list[dict[str, int]] = []
    if spec.get("record_sources"):
        connector = llm.llm_engine.engine_core.engine_core.scheduler.connector
        answer = connector.get_external_cache_hit_sources

        def recording(request: Any, num_external_tokens: int) -> Any:
            got = answer(request, num_external_tokens)
            sources.append({str(k.value): int(v) for k, v in got.items()})
            return got

        connector.get_external_cache_hit_sources = recording
    batch_params = spec.get("batch_params") or [None] * len(spec["batches"])
    batches = []
    for b, batch in enumerate(spec["batches"]):
        if b in spec.get("drop_cpu_before", ()):
            _drop_cpu_tier()
        prompts = [TokensPrompt(prompt_token_ids=spec["prompts"][i]) for i in batch]
        per_prompt = batch_params[b] or [None] * len(batch)
        params = [
            SamplingParams(
                max_tokens=spec["max_tokens"],
                temperature=0.0,
                detokenize=False,
                extra_args={"kv_transfer_params": p} if p else None,
            )
            for p in per_prompt
        ]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        batches.append(
            [
                {"cached_tokens": o.num_cached_tokens or 0, "output": list(o.outputs[0].token_ids)}
                for o in outputs
            ]
        )
    result: dict[str, Any] = {"batches": batches, "sources": sources}
    if ktc is not None and tp == 1:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        worker = get_kv_transfer_group().worker_side
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler.connector.scheduler_side
        result["runtime"] = {k: v for k, v in worker.runtime.stats().items() if k != "tiers"}
        result["worker_counters"] = worker.statistics().as_dict()
        result["scheduler_counters"] = scheduler.statistics().as_dict()
        result["client"] = scheduler.client.stats()
    print("RESULT " + json.dumps(result), flush=True)
    return 0


def _drop_cpu_tier() -> None:
    """Flush the write-behind to disk, then make the CPU tier forget every chunk."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    runtime = get_kv_transfer_group().worker_side.runtime
    runtime.call(runtime.engine.flush)

    def forget() -> None:
        cpu = runtime.engine.cpu
        held = cpu.keys()
        for key in held:
            cpu.discard(key)

    runtime.call(forget)


if __name__ == "__main__":
    sys.exit(main())
