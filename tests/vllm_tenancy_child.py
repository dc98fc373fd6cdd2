"""A child process for ``tests/test_vllm_tenancy_e2e.py``: one vLLM ``LLM`` (in-process engine)
with lmprefetch as its connector, LoRA enabled and KV events published over ZeroMQ.

Run as ``python tests/vllm_tenancy_child.py '<json spec>'``.  It

1. subscribes to vLLM's KV-event publisher with a pyzmq SUB socket, and generates one-chunk
   warm-up prompts until the first batch arrives (a SUB socket misses what is published
   before its subscription reaches the publisher; waiting for a batch proves it did);
2. runs the spec's calls one at a time (a prompt, with an optional ``cache_salt`` and LoRA
   adapter), recording the cached tokens, the generated tokens and vLLM's own block hashes of
   the prompt (computed by vLLM's block hasher for that request);
3. flushes lmprefetch's disk writes and generates once more so that the disk tier's events are
   published, then reads the SUB socket until it has every event the connector handed to vLLM;

and prints one JSON line, prefixed ``RESULT ``.  Block hashes are printed as hex strings.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import zmq

WAIT_MS = 60_000


def hexed(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, int):
        return format(value, "x")
    return value


def main() -> int:
    spec: dict[str, Any] = json.loads(sys.argv[1])
    import msgspec
    from vllm import LLM, SamplingParams
    from vllm.config import KVEventsConfig, KVTransferConfig
    from vllm.distributed.kv_events import KVEventBatch
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, maybe_convert_block_hash
    from vllm.v1.request import Request

    events_config = KVEventsConfig(
        enable_kv_cache_events=True,
        publisher="zmq",
        endpoint=spec["events_endpoint"],
        topic="kv",
    )
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
        distributed_executor_backend="uni",
        enable_lora=True,
        max_lora_rank=8,
        max_loras=2,
        kv_transfer_config=KVTransferConfig(**spec["kv_transfer_config"]),
        kv_events_config=events_config,
    )
    params = SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0, detokenize=False)
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler.connector.scheduler_side
    runtime = get_kv_transfer_group().worker_side.runtime

    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(spec["events_endpoint"])
    received: list[Any] = []
    decoder = msgspec.msgpack.Decoder(KVEventBatch)

    def receive(timeout_ms: int) -> bool:
        if not sub.poll(timeout_ms):
            return False
        topic, _seq, payload = sub.recv_multipart()
        assert topic == b"kv"
        for ev in decoder.decode(payload).events:
            fields = msgspec.structs.asdict(ev)
            fields["type"] = type(ev).__name__
            fields["block_hashes"] = [hexed(h) for h in fields.get("block_hashes", [])]
            fields["parent_block_hash"] = hexed(fields.get("parent_block_hash"))
            fields.pop("extra_keys", None)
            received.append(fields)
        return True

    def generate(prompt: list[int], salt: str | None, lora: list[Any] | None) -> Any:
        request = TokensPrompt(prompt_token_ids=prompt)
        if salt is not None:
            request["cache_salt"] = salt
        lora_request = LoRARequest(*lora) if lora else None
        [out] = llm.generate([request], params, use_tqdm=False, lora_request=lora_request)
        return out

    # 1. Warm up until the subscription is live.
    warmups = 0
    while not received:
        assert warmups < 20, "no KV event batch reached the subscriber"
        warm = [(warmups * 131 + i * 7) % 991 + 3 for i in range(spec["chunk_size"])]
        generate(warm, None, None)
        warmups += 1
        receive(5_000)
    while receive(0):
        pass
    before_calls = len(received)

    # 2. The calls.
    calls = []
    for call in spec["calls"]:
        prompt = spec["prompts"][call["prompt"]]
        salt, lora = call.get("cache_salt"), call.get("lora")
        out = generate(prompt, salt, lora)
        probe = Request(
            "probe",
            prompt,
            SamplingParams(max_tokens=1),
            None,
            cache_salt=salt,
            lora_request=LoRARequest(*lora) if lora else None,
            block_hasher=get_request_block_hasher(spec["block_size"], sha256),
        )
        calls.append(
            {
                "cached_tokens": out.num_cached_tokens or 0,
                "output": list(out.outputs[0].token_ids),
                "block_hashes": [hexed(maybe_convert_block_hash(h)) for h in probe.block_hashes],
            }
        )

    # 3. Publish the disk tier's stores: flush, and one more step (a prompt of no whole chunk).
    runtime.call(runtime.engine.flush)
    generate([5, 6, 7], None, None)
    handed_over = scheduler.statistics().kv_events
    while len(received) < handed_over:
        assert receive(WAIT_MS), f"{len(received)} of {handed_over} events arrived"
    sub.close(0)
    ctx.term()
    result = {
        "calls": calls,
        "events": received,
        "calls_start": before_calls,
        "handed_over": handed_over,
        "runtime": {k: v for k, v in runtime.stats().items() if k != "tiers"},
    }
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
