"""What ``may_load_async`` buys on vLLM 0.34's real scheduler: scheduler steps from a request's
arrival to its first token, with lmprefetch's hook and without it.

vLLM 0.34 asks a connector ``may_load_async(request)`` when a request arrives; with
``--max-num-inflight-kv-loads`` set, a request it says True for waits in a queue of its own,
whose loads vLLM starts while the running batch is full, and a request holding loaded KV is
admitted before every other waiting request once a running slot frees.  lmprefetch says True
when it knows a hit for the request (the chunks past vLLM's own hit were found by a lookup or
saved since).

The run: vLLM's ``Scheduler`` with ``LMPrefetchConnector`` (scheduler side, and a worker side
with CPU KV tensors and a real lmprefetch worker runtime), stepped by hand with a model that
computes nothing (each step samples one token per request), so a step count is exact and the
same on every machine.  A long prompt is computed once (lmprefetch stores it); then the running
batch is filled with decodes that finish one after another, ``--queued`` other requests (misses)
wait, and the *hit* request (the stored prompt plus a question) arrives.  Its lookup is
answered before the next step (the script waits on it, with a deadline): a real engine steps on
meanwhile, which only helps the hook.  Counted: steps from the hit request's arrival to the
step that loads its hit and to the step that samples its first token, and the prompt tokens
vLLM computed for it (the rest were loaded from lmprefetch).

    python examples/bench_may_load_async.py                  # the table (vLLM 0.34)
    python examples/bench_may_load_async.py --queued 0 --json -

On vLLM without the hook (0.33 and older) it says so and exits with status 2.  On a CPU-only
machine without Triton-CPU vLLM 0.34 refuses to build a config; the test suite runs this script
under its shims: ``python -m tests.vllm_support examples/bench_may_load_async.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

BLOCK = 16
CHUNK = 32
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
WAIT_S = 60.0


def tokens(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 997 + 3 for i in range(n)]


@dataclasses.dataclass
class Scenario:
    running: int = 2  # vLLM's max_num_seqs: the running batch
    queued: int = 3  # requests waiting before the hit request arrives (misses)
    inflight_loads: int = 1  # --max-num-inflight-kv-loads
    prompt_tokens: int = 512  # the hit request's stored prefix
    decode_tokens: int = 6  # steps between two running requests finishing


def run(scenario: Scenario, hook: bool, workdir: Path) -> dict[str, Any]:
    """One run; ``hook`` False stands for a connector without ``may_load_async`` (vLLM's
    default: False for anything but P/D remote prefill)."""
    import torch
    from vllm import SamplingParams
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.forward_context import ForwardContext
    from vllm.plugins import load_general_plugins
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager

    from lmprefetch.bench.serve.model import TINY_LLAMA
    from lmprefetch.integration.vllm import LMPrefetchConnector

    # What vLLM's engine does first: its plugins register lmprefetch's connector by name.
    load_general_plugins()
    s = scenario
    model = workdir / "tiny-llama"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(TINY_LLAMA))
    init_none_hash(sha256)
    max_len = 4096  # (TINY_LLAMA: 2 layers, 1 KV head of 64)
    config = VllmConfig(
        model_config=ModelConfig(
            model=str(model), dtype="float32", seed=0, skip_tokenizer_init=True,
            max_model_len=max_len,
        ),
        scheduler_config=SchedulerConfig(
            max_num_seqs=s.running, max_num_batched_tokens=2048, max_model_len=max_len,
            enable_chunked_prefill=True, async_scheduling=False, is_encoder_decoder=False,
            max_num_inflight_kv_loads=s.inflight_loads,
        ),
        # vLLM's own prefix cache is off: every cached token is lmprefetch's.
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=False),
        kv_transfer_config=KVTransferConfig(
            kv_connector="LMPrefetchConnector",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={"chunk_size": CHUNK, "cpu_bytes": 1 << 24},
        ),
        device_config=DeviceConfig("cpu"),
    )  # fmt: skip
    num_blocks = 1024
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                list(LAYERS),
                FullAttentionSpec(
                    block_size=BLOCK, num_kv_heads=1, head_size=64, dtype=torch.float32
                ),
            )
        ],
    )
    config.cache_config.num_gpu_blocks = num_blocks
    scheduler = Scheduler(
        config, kv_cache_config, StructuredOutputManager(config), block_size=BLOCK
    )
    connector = scheduler.connector
    if not hook:
        # What a connector without the hook answers (vLLM's base class).
        connector.may_load_async = lambda request: False  # type: ignore[method-assign]
    worker = LMPrefetchConnector(config, KVConnectorRole.WORKER, kv_cache_config)
    worker.register_kv_caches({n: torch.zeros(num_blocks, 1, BLOCK, 128) for n in LAYERS})
    context = ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={})
    known_fields = {f.name for f in dataclasses.fields(ModelRunnerOutput)}
    first_token_step: dict[str, int] = {}
    computed: dict[str, int] = {}
    computed_then: dict[str, int] = {}  # tokens computed up to the first token
    load_step: dict[str, int] = {}  # the step whose metadata loads the request
    step_no = 0

    def add(req_id: str, prompt: list[int], max_tokens: int) -> None:
        scheduler.add_request(
            Request(
                request_id=req_id,
                prompt_token_ids=prompt,
                sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                pooling_params=None,
                block_hasher=get_request_block_hasher(BLOCK, sha256),
            )
        )

    def answered(req_id: str) -> None:
        request = connector.scheduler_side.request(req_id)
        if request is None or request.wait(WAIT_S) is None:
            raise RuntimeError(f"lookup {req_id} not answered within {WAIT_S} s")

    def step() -> None:
        nonlocal step_no
        step_no += 1
        out = scheduler.schedule()
        for load in out.kv_connector_metadata.loads:
            load_step.setdefault(load.req_id, step_no)
        worker.bind_connector_metadata(out.kv_connector_metadata)
        worker.start_load_kv(context)
        worker.wait_for_save()
        results = worker.get_transfer_results(out.finished_req_ids)
        invalid = worker.get_block_ids_with_load_errors()
        worker.clear_connector_metadata()
        ids = list(out.num_scheduled_tokens)
        for r in ids:
            computed[r] = computed.get(r, 0) + int(out.num_scheduled_tokens[r])
        fields = {
            "req_ids": ids,
            "req_id_to_index": {r: i for i, r in enumerate(ids)},
            "sampled_token_ids": [[7] for _ in ids],
            "logprobs": None,
            "prompt_logprobs_dict": {},
            "pooler_output": [],
            "kv_connector_output": KVConnectorOutput(
                finished_sending=results.finished_sending or None,
                finished_recving=results.finished_recving or None,
                invalid_block_ids=invalid,
            ),
        }
        mro = ModelRunnerOutput(**{k: v for k, v in fields.items() if k in known_fields})
        for outputs in scheduler.update_from_output(out, mro).values():
            for o in outputs.outputs:
                if o.new_token_ids and o.request_id not in first_token_step:
                    first_token_step[o.request_id] = step_no
                    computed_then[o.request_id] = computed.get(o.request_id, 0)

    def run_until_finished(req_ids: list[str], max_steps: int = 400) -> None:
        for _ in range(max_steps):
            if not any(r in scheduler.requests for r in req_ids):
                return
            step()
        raise RuntimeError(f"{req_ids} did not finish in {max_steps} steps")

    try:
        # lmprefetch stores the long prompt.
        prefix = tokens(1, s.prompt_tokens)
        add("seed", prefix, 1)
        answered("seed")
        run_until_finished(["seed"])
        # The running batch fills with decodes that finish one after another...
        for i in range(s.running):
            add(f"run{i}", tokens(100 + i, 40), s.decode_tokens * (i + 1))
            answered(f"run{i}")
        while len(scheduler.running) < s.running:
            step()
        # ...others queue behind it, then the hit request arrives.
        for i in range(s.queued):
            add(f"queued{i}", tokens(200 + i, 40), 4)
            answered(f"queued{i}")
        arrived = step_no
        add("hit", [*prefix, *tokens(300, 8)], 4)
        answered("hit")
        run_until_finished(["hit"])
        stats = connector.scheduler_side.statistics()
    finally:
        scheduler.shutdown()
        worker.shutdown()
    return {
        "hook": hook,
        "steps_to_first_token": first_token_step["hit"] - arrived,
        "steps_to_load": load_step["hit"] - arrived,
        "prompt_tokens_computed": computed_then["hit"],
        "prompt_tokens": s.prompt_tokens + 8,
        "lmprefetch_hit_tokens": stats.hit_tokens,
    }


def measure(scenario: Scenario) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="bench-may-load-async-") as tmp:
        return [run(scenario, hook, Path(tmp)) for hook in (False, True)]


def table(scenario: Scenario, rows: list[dict[str, Any]]) -> str:
    lines = [
        f"running batch {scenario.running}, {scenario.queued} requests queued before the hit, "
        f"--max-num-inflight-kv-loads {scenario.inflight_loads}, "
        f"hit prompt {rows[0]['prompt_tokens']} tokens",
        f"{'may_load_async':<16}{'steps to load':>15}{'steps to first token':>22}"
        f"{'prompt tokens computed':>24}{'loaded':>8}",
    ]
    for r in rows:
        lines.append(
            f"{'on' if r['hook'] else 'off':<16}{r['steps_to_load']:>15}"
            f"{r['steps_to_first_token']:>22}"
            f"{r['prompt_tokens_computed']:>24}{r['lmprefetch_hit_tokens']:>8}"
        )
    return "\n".join(lines)


def _positive(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    defaults = Scenario()
    parser.add_argument("--running", type=_positive, default=defaults.running,
                        help="requests in the running batch (max_num_seqs)")  # fmt: skip
    parser.add_argument("--queued", type=_positive, default=defaults.queued,
                        help="requests waiting before the hit request arrives")  # fmt: skip
    parser.add_argument("--inflight-loads", type=_positive, default=defaults.inflight_loads,
                        help="--max-num-inflight-kv-loads")  # fmt: skip
    parser.add_argument("--json", metavar="FILE", help="also write the rows as JSON ('-': print)")
    args = parser.parse_args(argv)
    if args.running < 1 or args.inflight_loads < 1:
        parser.error("--running and --inflight-loads must be at least 1")
    scenario = Scenario(
        running=args.running, queued=args.queued, inflight_loads=args.inflight_loads
    )
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            from vllm.config import SchedulerConfig
        except ImportError as exc:
            print(f"bench_may_load_async: vLLM is not installed ({exc})", file=sys.stderr)
            return 2
        from lmprefetch.integration.vllm.compat import vllm_version

        if "max_num_inflight_kv_loads" not in {f.name for f in dataclasses.fields(SchedulerConfig)}:
            print(
                f"bench_may_load_async: vLLM {vllm_version()} has no max_num_inflight_kv_loads "
                "(may_load_async, vLLM 0.34): nothing to measure",
                file=sys.stderr,
            )
            return 2
        rows = measure(scenario)
    if args.json == "-":
        print(json.dumps(rows, indent=2))
    else:
        print(f"vLLM {vllm_version()}")
        print(table(scenario, rows))
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
