"""The vLLM connector against vLLM's real scheduler, on CPU, with a real lmprefetch worker.

The harness follows vLLM's own connector unit tests: a ``VllmConfig`` with ``DeviceConfig("cpu")``
and a local tiny Llama ``config.json`` (``skip_tokenizer_init``), vLLM's ``Scheduler`` (which
builds the SCHEDULER-role connector), a separate WORKER-role connector given plain CPU KV
tensors, and a fabricated ``ModelRunnerOutput`` per step.  A fake forward writes, for every
computed token, a value derived from the token id, its position and the layer into the token's
slot, so a loaded block can be checked byte for byte.

Every wait is on a condition with a deadline: ``LookupClient.wait`` blocks on the client's
condition variable, ``Engine.wait_quiet`` on a Trio event.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .vllm_support import (
    assert_worker_idle,
    expected_sources,
    model_runner_output,
    vllm_imports,
    wait_worker_quiet,
)

with vllm_imports():
    import torch
    from vllm import SamplingParams
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVEventsConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.forward_context import ForwardContext
    from vllm.lora.request import LoRARequest
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import (
        get_request_block_hasher,
        init_none_hash,
        maybe_convert_block_hash,
    )
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request, RequestStatus
    from vllm.v1.structured_output import StructuredOutputManager

    from lmprefetch.hashing import ChunkHasher
    from lmprefetch.integration.vllm import (
        ConnectorStatistics,
        KeyBlocks,
        LMPrefetchConnector,
        LMPrefetchConnectorStats,
        LoadSpec,
        PagedKVLayout,
        endpoint_names,
        load_prefetch_config,
    )
    from lmprefetch.worker_statistics import WorkerStatistics

pytestmark = pytest.mark.vllm

BLOCK = 16
CHUNK = 32  # two blocks per chunk
HEADS = 1
ROW = 128  # the CPU backend's last dim: K and V of one head (2 x head_dim 64)
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
WAIT_S = 20.0

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


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama")
    (path / "config.json").write_text(json.dumps(TINY_LLAMA))
    init_none_hash(sha256)
    return path


def make_vllm_config(
    model_dir: Path,
    *,
    prefix_caching: bool = False,
    policy: str = "recompute",
    extra: dict[str, Any] | None = None,
    block_size: int = BLOCK,
    role: str = "kv_both",
    kv_events: bool = False,
) -> VllmConfig:
    return VllmConfig(
        model_config=ModelConfig(
            model=str(model_dir),
            dtype="float32",
            seed=42,
            skip_tokenizer_init=True,
            max_model_len=1024,
        ),
        scheduler_config=SchedulerConfig(
            max_num_seqs=16,
            max_num_batched_tokens=512,
            max_model_len=1024,
            enable_chunked_prefill=True,
            async_scheduling=False,
            is_encoder_decoder=False,
        ),
        cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=prefix_caching),
        kv_transfer_config=KVTransferConfig(
            kv_connector="LMPrefetchConnector",
            kv_connector_module_path="lmprefetch.integration.vllm",
            kv_role=role,
            kv_load_failure_policy=policy,
            kv_connector_extra_config={"chunk_size": CHUNK, "cpu_bytes": 1 << 22, **(extra or {})},
        ),
        device_config=DeviceConfig("cpu"),
        # KV events on: the scheduler publishes what connector.take_events() yields (the test
        # swaps vLLM's null publisher for a recorder).
        kv_events_config=(
            KVEventsConfig(enable_kv_cache_events=True, publisher="null") if kv_events else None
        ),
    )


class RecordingPublisher:
    """Stands in for vLLM's event publisher: keeps every batch the scheduler publishes."""

    def __init__(self) -> None:
        self.batches: list[KVEventBatch] = []

    def publish(self, batch: KVEventBatch) -> None:
        self.batches.append(batch)

    def shutdown(self) -> None:
        return

    def take(self) -> list[Any]:
        events = [e for b in self.batches for e in b.events]
        self.batches.clear()
        return events


def kv_value(token: Any, pos: Any, layer: int) -> Any:
    """What the fake forward writes for a token: exact in float32."""
    return token * 1024.0 + pos + layer * float(1 << 21)


class Harness:
    """vLLM's scheduler + a worker-role connector with CPU KV tensors, stepped by hand."""

    def __init__(self, vllm_config: VllmConfig, num_blocks: int, *, register: bool = True):
        self.vllm_config = vllm_config
        self.num_blocks = num_blocks
        self.kv_cache_config = KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[
                KVCacheGroupSpec(
                    list(LAYERS),
                    FullAttentionSpec(
                        block_size=BLOCK, num_kv_heads=HEADS, head_size=64, dtype=torch.float32
                    ),
                )
            ],
        )
        vllm_config.cache_config.num_gpu_blocks = num_blocks
        self.scheduler = Scheduler(
            vllm_config,
            self.kv_cache_config,
            StructuredOutputManager(vllm_config),
            block_size=BLOCK,
            log_stats=True,
        )
        self.connector: LMPrefetchConnector = self.scheduler.connector
        self.client = self.connector.scheduler_side.client
        self.worker = LMPrefetchConnector(vllm_config, KVConnectorRole.WORKER, self.kv_cache_config)
        # The CPU attention backend's layout: [num_blocks, kv_heads, block_size, 2 * head_dim].
        self.caches = {name: torch.zeros(num_blocks, HEADS, BLOCK, ROW) for name in LAYERS}
        self.invalid_history: list[set[int]] = []
        self.stats = LMPrefetchConnectorStats()
        self.published = RecordingPublisher()
        self.scheduler.kv_event_publisher = self.published
        self._probes = 0
        if register:
            self.register()

    def register(self) -> None:
        self.worker.register_kv_caches(self.caches)

    @property
    def runtime(self) -> Any:
        return self.worker.worker_side.runtime

    @property
    def statistics(self) -> ConnectorStatistics:
        """The connector's counters as vLLM collected them (scheduler side and worker)."""
        return self.stats.statistics()

    def add(
        self,
        req_id: str,
        tokens: list[int],
        max_tokens: int = 1,
        kv_transfer_params: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> Request:
        """Add a request; ``kwargs`` go to vLLM's ``Request`` (``cache_salt``, ``lora_request``);
        ``kv_transfer_params`` travel as a client's do (the sampling params' ``extra_args``)."""
        extra_args = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None
        request = Request(
            request_id=req_id,
            prompt_token_ids=tokens,
            sampling_params=SamplingParams(
                max_tokens=max_tokens, ignore_eos=True, extra_args=extra_args
            ),
            pooling_params=None,
            block_hasher=get_request_block_hasher(BLOCK, sha256),
            **kwargs,
        )
        self.scheduler.add_request(request)
        return request

    def block_ids(self, req_id: str) -> list[int]:
        return list(self.scheduler.kv_cache_manager.get_block_ids(req_id)[0])

    def step(self, *, before_forward: Any = None, loads_after_forward: bool = False) -> Any:
        """One engine step: schedule, load, (fake) forward, save, report back.

        ``loads_after_forward``: vLLM's order for a step without synchronous loads (it calls
        ``start_load_kv`` after launching the forward)."""
        out = self.scheduler.schedule()
        worker = self.worker
        worker.bind_connector_metadata(out.kv_connector_metadata)
        context = ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={})
        if not loads_after_forward:
            worker.start_load_kv(context)
        if before_forward is not None:
            before_forward(out)
        self.fake_forward(out)
        if loads_after_forward:
            worker.start_load_kv(context)
        for name in LAYERS:
            worker.wait_for_layer_load(name)
            worker.save_kv_layer(name, self.caches[name], None)
        worker.wait_for_save()
        results = worker.get_transfer_results(out.finished_req_ids)
        invalid = worker.get_block_ids_with_load_errors()
        self.invalid_history.append(set(invalid))
        stats = worker.get_kv_connector_stats()
        worker.clear_connector_metadata()
        ids = list(out.num_scheduled_tokens)
        mro = model_runner_output(
            req_ids=ids,
            req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=[[7] for _ in ids],
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=[],
            kv_connector_output=KVConnectorOutput(
                finished_sending=results.finished_sending or None,
                finished_recving=results.finished_recving or None,
                invalid_block_ids=invalid,
                kv_connector_stats=stats,
                kv_cache_events=worker.get_kv_connector_kv_cache_events(),
            ),
        )
        engine_outputs = self.scheduler.update_from_output(out, mro)
        # vLLM merges the worker's and the scheduler-side connector's stats into its own
        # SchedulerStats (as a dict), as it would for the stats logger.
        for eco in engine_outputs.values():
            sched_stats = eco.scheduler_stats
            if sched_stats is not None and sched_stats.kv_connector_stats:
                self.stats.aggregate(
                    LMPrefetchConnector.build_kv_connector_stats(sched_stats.kv_connector_stats)
                )
        return out

    def fake_forward(self, out: Any) -> None:
        """Write each scheduled token's value into its slot (as attention would write K/V)."""
        for req_id, n in out.num_scheduled_tokens.items():
            request = self.scheduler.requests[req_id]
            end = request.num_computed_tokens  # already advanced by schedule()
            start = end - n
            tokens = torch.tensor(list(request.all_token_ids[start:end]), dtype=torch.float32)
            self.write_tokens(req_id, start, tokens)

    def write_tokens(self, req_id: str, start: int, tokens: Any) -> None:
        pos = torch.arange(start, start + len(tokens))
        blocks = torch.tensor(self.block_ids(req_id))[pos // BLOCK]
        for layer, name in enumerate(LAYERS):
            values = kv_value(tokens, pos.to(torch.float32), layer)
            self.caches[name][blocks, :, pos % BLOCK, :] = values[:, None, None]

    def assert_loaded(self, req_id: str, tokens: list[int], start: int, end: int) -> None:
        """Slots of tokens ``[start, end)`` hold exactly what the fake forward wrote."""
        pos = torch.arange(start, end)
        blocks = torch.tensor(self.block_ids(req_id))[pos // BLOCK]
        toks = torch.tensor(tokens[start:end], dtype=torch.float32)
        for layer, name in enumerate(LAYERS):
            got = self.caches[name][blocks, :, pos % BLOCK, :]
            want = kv_value(toks, pos.to(torch.float32), layer)[:, None, None].expand_as(got)
            assert torch.equal(got, want), f"layer {layer}: wrong KV in tokens [{start}, {end})"

    def run_until_finished(self, req_id: str, max_steps: int = 50) -> None:
        for _ in range(max_steps):
            if req_id not in self.scheduler.requests:
                return
            self.step()
        raise AssertionError(f"{req_id} did not finish in {max_steps} steps")

    def wait_answer(self, req_id: str) -> int:
        """The request's hit (tokens from 0), once its lookup answered."""
        request = self.connector.scheduler_side.request(req_id)
        assert request is not None, f"{req_id} is not a request the connector knows"
        hit = request.wait(WAIT_S)
        assert hit is not None, f"lookup {req_id} not answered within {WAIT_S} s"
        return hit

    def wait_worker_quiet(self) -> WorkerStatistics:
        """The worker's statistics once it handled everything sent so far and is quiet
        (:func:`~tests.vllm_support.wait_worker_quiet`)."""
        self._probes += 1
        return wait_worker_quiet(self.client, self.runtime, f"probe-{self._probes}", WAIT_S)

    def close(self) -> None:
        self.scheduler.shutdown()
        self.worker.shutdown()


@pytest.fixture
def make_harness(model_dir: Path) -> Iterator[Any]:
    made: list[Harness] = []

    def make(num_blocks: int = 64, *, register: bool = True, **kwargs: Any) -> Harness:
        h = Harness(make_vllm_config(model_dir, **kwargs), num_blocks, register=False)
        made.append(h)  # closed at teardown even if registering fails
        if register:
            h.register()
        return h

    yield make
    for h in made:
        h.close()


def tokens_of(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 997 + 3 for i in range(n)]


def load_keys(load: LoadSpec) -> list[KeyBlocks]:
    """Every key a load claims, in order."""
    return [k for claim in load.claims for k in claim.keys]


def chain(tokens: list[int]) -> list[int]:
    """The chunk hashes of a prompt (unsalted): a legacy model's keys."""
    return ChunkHasher(CHUNK).hash(tokens)


# -- scheduling -----------------------------------------------------------------------------
def test_pending_lookup_keeps_request_waiting_and_others_run(make_harness: Any) -> None:
    # No worker is registered yet, so the lookup cannot be answered: deterministic "pending".
    h = make_harness(register=False)
    long_req = h.add("long", tokens_of(1, 100))
    short_req = h.add("short", tokens_of(2, CHUNK - 5))  # no whole chunk: answered 0 at once
    for _ in range(3):
        out = h.scheduler.schedule()
        scheduled = {r.req_id for r in out.scheduled_new_reqs}
        assert "long" not in scheduled
        h.scheduler.update_from_output(
            out,
            model_runner_output(
                req_ids=list(out.num_scheduled_tokens),
                req_id_to_index={r: i for i, r in enumerate(out.num_scheduled_tokens)},
                sampled_token_ids=[[7] for _ in out.num_scheduled_tokens],
            ),
        )
    assert long_req.status == RequestStatus.WAITING
    assert long_req.num_computed_tokens == 0
    assert short_req.request_id not in h.scheduler.requests or short_req.num_computed_tokens > 0
    # The worker comes up, answers (a miss), and the request is scheduled.
    h.register()
    assert h.wait_answer("long") == 0
    out = h.step()
    assert out.num_scheduled_tokens.get("long") == 100
    assert not out.has_sync_kv_loads


def test_miss_then_hit_loads_the_right_bytes_into_the_right_blocks(make_harness: Any) -> None:
    h = make_harness()
    prompt = tokens_of(3, 100)  # 3 whole chunks (96 tokens) + 4
    h.add("first", prompt)
    assert h.wait_answer("first") == 0
    out = h.step()
    assert out.num_scheduled_tokens["first"] == 100
    [save] = out.kv_connector_metadata.saves
    assert [k.chunk_hash for k in save.keys] == chain(prompt)
    assert [len(k.block_ids) for k in save.keys] == [2, 2, 2]
    h.run_until_finished("first")
    stats = h.wait_worker_quiet()
    assert stats.engine.store.chunks_stored == 3
    assert_worker_idle(stats)

    # Wipe the paged cache (a fresh worker memory): only lmprefetch can bring the KV back.
    for t in h.caches.values():
        t.zero_()
    second = prompt[:96] + tokens_of(4, 40)
    req = h.add("second", second)
    assert h.wait_answer("second") == 96

    def check(out: Any) -> None:  # after start_load_kv, before the forward writes anything
        assert out.has_sync_kv_loads
        [load] = out.kv_connector_metadata.loads
        assert (load.start_token, load.end_token) == (0, 96)
        assert [k.chunk_hash for k in load_keys(load)] == chain(second)[:3]
        h.assert_loaded("second", second, 0, 96)

    out = h.step(before_forward=check)
    assert out.num_scheduled_tokens["second"] == len(second) - 96
    assert req.num_computed_tokens == len(second)  # 96 loaded + 40 computed
    assert h.invalid_history[-1] == set()
    stats = h.wait_worker_quiet()
    assert stats.engine.lookups.claimed == 1
    assert_worker_idle(stats)
    assert h.statistics.hit_tokens == 96
    assert h.statistics.lookup_hits == 1
    assert h.statistics.loaded_chunks == 3
    assert h.statistics.loaded_bytes == 3 * 2 * len(LAYERS) * BLOCK * ROW * 4
    # The second request's new whole chunk (tokens 96..127) is saved after its forward.
    [save] = out.kv_connector_metadata.saves
    assert [k.chunk_hash for k in save.keys] == chain(second)[3:4]


@pytest.mark.parametrize(
    ("extra", "n_tokens"),
    [
        ({}, 64),
        # One key per layer and chunk: the payload is split into the layers' rows.
        ({"layerwise": True}, 64),
        # The trailing 16 tokens are a partial chunk of one block, stored and loaded too.
        ({"save_partial_chunks": True}, 80),
    ],
    ids=["whole-chunks", "layerwise", "partial-chunk"],
)
def test_full_hit_keeps_one_token_to_compute(
    make_harness: Any, extra: dict[str, Any], n_tokens: int
) -> None:
    h = make_harness(extra=extra)
    prompt = tokens_of(5, n_tokens)
    h.add("a", prompt)
    h.wait_answer("a")
    h.run_until_finished("a")
    h.wait_worker_quiet()
    for t in h.caches.values():
        t.zero_()
    req = h.add("b", prompt)
    assert h.wait_answer("b") == n_tokens

    def check(out: Any) -> None:
        [load] = out.kv_connector_metadata.loads
        assert (load.start_token, load.end_token) == (0, n_tokens - 1)
        h.assert_loaded("b", prompt, 0, n_tokens - 1)

    out = h.step(before_forward=check)
    assert out.num_scheduled_tokens["b"] == 1
    assert req.num_computed_tokens == n_tokens
    stats = h.wait_worker_quiet()
    assert stats.engine.lookups.claimed == 1
    assert_worker_idle(stats)


@pytest.mark.parametrize("role", ["kv_producer", "kv_consumer"])
def test_producer_only_saves_and_consumer_only_loads(make_harness: Any, role: str) -> None:
    h = make_harness(role=role)
    prompt = tokens_of(18, 64)
    h.add("a", prompt)
    if role == "kv_producer":
        out = h.step()
        assert out.num_scheduled_tokens["a"] == 64  # no lookup to wait for
        [save] = out.kv_connector_metadata.saves
        assert [k.chunk_hash for k in save.keys] == chain(prompt)
    else:
        assert h.wait_answer("a") == 0
        out = h.step()
        assert out.num_scheduled_tokens["a"] == 64
        assert out.kv_connector_metadata.saves == []
    h.run_until_finished("a")
    stats = h.wait_worker_quiet()
    assert stats.engine.store.chunks_stored == (2 if role == "kv_producer" else 0)
    # + the probe:
    assert stats.server.requests_received == (1 if role == "kv_producer" else 2)


def test_d15_local_prefix_cache_hit_is_skipped_and_the_rest_loaded_by_chunk(
    make_harness: Any,
) -> None:
    h = make_harness(prefix_caching=True)
    prompt = tokens_of(6, 128)
    # Store all four chunks, then drop vLLM's own cache of them.
    h.add("warm", prompt)
    h.wait_answer("warm")
    h.run_until_finished("warm")
    assert h.scheduler.reset_prefix_cache()
    h.wait_worker_quiet()
    # vLLM now caches only the first 64 tokens (the blocks of a request for them).
    h.add("half", prompt[:64] + tokens_of(7, 3))
    h.wait_answer("half")
    h.run_until_finished("half")
    for t in h.caches.values():
        t.zero_()
    req = h.add("rest", prompt + tokens_of(8, 5))
    # The lookup skipped the two chunks vLLM holds: workers probe and load chunks 2 and 3.
    assert h.wait_answer("rest") == 128

    def check(out: Any) -> None:
        [load] = out.kv_connector_metadata.loads
        assert (load.start_token, load.end_token) == (64, 128)
        # Claimed from chunk 2 on: the two chunks vLLM holds were never probed.
        assert [k.chunk_hash for k in load_keys(load)] == chain(prompt)[2:4]
        h.assert_loaded("rest", prompt, 64, 128)

    h.step(before_forward=check)
    assert req.num_computed_tokens == 133
    assert h.statistics.loaded_chunks >= 2
    assert_worker_idle(h.wait_worker_quiet())


def test_vllm_cache_shrinking_below_the_skipped_prefix_restarts_the_lookup(
    make_harness: Any,
) -> None:
    h = make_harness(prefix_caching=True)
    prompt = tokens_of(16, 128)
    h.add("warm", prompt)
    h.wait_answer("warm")
    h.run_until_finished("warm")  # stored in lmprefetch, and cached by vLLM
    req = h.add("again", [*prompt, 3, 4])
    # vLLM holds all four chunks: nothing to look up past them.
    again = h.connector.scheduler_side.request("again")
    assert again is not None and again.skip * CHUNK == 128
    assert h.scheduler.reset_prefix_cache()  # ... until its cache is dropped
    h.wait_worker_quiet()
    for t in h.caches.values():
        t.zero_()
    loads: list[Any] = []

    def check(out: Any) -> None:
        loads.extend(out.kv_connector_metadata.loads)
        if loads:
            [load] = loads
            assert (load.start_token, load.end_token) == (0, 128)
            assert [k.chunk_hash for k in load_keys(load)] == chain(prompt)
            h.assert_loaded("again", prompt, 0, 128)

    # vLLM now has 0 < 128 skipped: a gap, so the lookup starts again from chunk 0.  The
    # fresh answer may arrive within the step that restarts it (the worker runs on its own
    # thread) or later; until it does, the request waits.
    for _ in range(2):
        out = h.step(before_forward=check)
        if loads:
            break
        assert "again" not in out.num_scheduled_tokens
        assert h.wait_answer("again") == 128
    assert loads
    assert req.num_computed_tokens == 130
    assert h.statistics.lookup_restarts == 1
    assert_worker_idle(h.wait_worker_quiet())


def test_an_answer_too_old_to_trust_is_looked_up_again(
    make_harness: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import lmprefetch.integration.vllm.request as request_module

    h = make_harness(extra={"claim_ttl_s": 10})
    prompt = tokens_of(17, 64)
    h.add("a", prompt)
    h.wait_answer("a")
    h.run_until_finished("a")
    h.add("b", [*prompt, 1])
    assert h.wait_answer("b") == 64
    h.step()  # polls the answer: b is scheduled with it ...
    h.run_until_finished("b")
    h.add("c", [*prompt, 2])
    assert h.wait_answer("c") == 64
    # ... but c's answer is polled only after more than half of claim_ttl_s: the workers may
    # drop the prefetch before the step claims it, so it is cancelled and looked up again.
    later = request_module._now() + 6
    monkeypatch.setattr(request_module, "_now", lambda: later)
    loads: list[Any] = []
    for _ in range(3):
        out = h.step()
        loads += out.kv_connector_metadata.loads
        if loads:
            break
        assert h.wait_answer("c") == 64  # the fresh lookup (the old answer was dropped)
    assert [s.req_id for s in loads] == ["c"]
    assert h.statistics.lookup_restarts == 1
    stats = h.wait_worker_quiet()
    assert stats.engine.lookups.cancelled == 1
    assert stats.engine.lookups.claimed == 2
    assert_worker_idle(stats)


# -- abort, preemption, failures ------------------------------------------------------------
def test_abort_while_lookup_pending_reaches_the_worker(make_harness: Any) -> None:
    h = make_harness(register=False)
    h.add("gone", tokens_of(9, 100))
    h.scheduler.schedule()  # pending: no worker yet
    h.scheduler.finish_requests("gone", RequestStatus.FINISHED_ABORTED)
    assert "gone" not in h.scheduler.requests
    assert h.client.statistics().cancels == 1
    h.register()
    # The request and its cleanup were queued (in this order) before the worker existed.
    stats = h.wait_worker_quiet()
    assert stats.server.requests_received == 2  # "gone" and the sync probe
    assert stats.server.cleanups_received == 1
    assert_worker_idle(stats)


def test_abort_of_an_answered_never_scheduled_request_releases_the_prefetch(
    make_harness: Any,
) -> None:
    h = make_harness()
    prompt = tokens_of(11, 96)
    h.add("a", prompt)
    h.wait_answer("a")
    h.run_until_finished("a")
    h.wait_worker_quiet()
    h.add("b", [*prompt, 5])
    assert h.wait_answer("b") == 96  # the worker now holds three prefetched chunks
    assert h.runtime.statistics().engine.lookups.held == 1
    h.scheduler.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    stats = h.wait_worker_quiet()
    assert stats.engine.lookups.cancelled == 1
    assert stats.engine.lookups.claimed == 0
    assert_worker_idle(stats)


def test_preempted_request_is_looked_up_again(make_harness: Any) -> None:
    # 8 usable blocks: two 64-token prompts fill them, the first decode step preempts one.
    h = make_harness(num_blocks=9)
    pa, pb = tokens_of(12, 64), tokens_of(13, 64)
    h.add("a", pa, max_tokens=4)
    rb = h.add("b", pb, max_tokens=2)
    h.wait_answer("a")
    h.wait_answer("b")
    out = h.step()
    assert set(out.num_scheduled_tokens) == {"a", "b"}  # both prefilled, both saved
    out = h.step()
    assert rb.status == RequestStatus.PREEMPTED
    assert "b" in out.preempted_req_ids
    # b comes back through get_num_new_matched_tokens: forget, then a fresh lookup.
    h.step()
    assert h.statistics.lookup_restarts >= 1
    assert h.wait_answer("b") == 64  # its chunks were stored before the preemption
    h.run_until_finished("a")
    for t in h.caches.values():
        t.zero_()
    resumed: list[Any] = []

    def check(out: Any) -> None:
        loads = [s for s in out.kv_connector_metadata.loads if s.req_id == "b"]
        if loads:
            resumed.append(loads[0])
            h.assert_loaded("b", pb, 0, loads[0].end_token)

    for _ in range(5):
        if resumed:
            break
        h.step(before_forward=check)
    assert resumed
    assert resumed[0].end_token == 64
    h.run_until_finished("b")
    stats = h.wait_worker_quiet()
    assert stats.engine.lookups.claimed == 1
    assert_worker_idle(stats)


class ShortClaims:
    """A runtime whose claims yield only the first ``keep`` chunks (the rest were lost)."""

    def __init__(self, runtime: Any, keep: int) -> None:
        self._runtime = runtime
        self._keep = keep

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runtime, name)

    def claim(self, lookup_id: str) -> Any:
        from contextlib import contextmanager

        @contextmanager
        def short() -> Iterator[list[Any]]:
            with self._runtime.claim(lookup_id) as items:
                yield items[: self._keep]

        return short()


def test_short_claim_reports_the_missing_blocks_and_vllm_recomputes(make_harness: Any) -> None:
    h = make_harness()
    prompt = tokens_of(14, 100)
    h.add("a", prompt)
    h.wait_answer("a")
    h.run_until_finished("a")
    h.wait_worker_quiet()
    for t in h.caches.values():
        t.zero_()
    req = h.add("b", prompt)
    assert h.wait_answer("b") == 96
    real = h.worker.worker_side._runtime
    h.worker.worker_side._runtime = ShortClaims(real, keep=1)
    try:
        out = h.step()
    finally:
        h.worker.worker_side._runtime = real
    [load] = out.kv_connector_metadata.loads
    blocks = [b for k in load_keys(load) for b in k.block_ids]
    lost = set(blocks[2:6])  # chunks 1 and 2: blocks 2..5 of the request
    assert h.invalid_history[-1] == lost
    assert req.status == RequestStatus.RUNNING  # "recompute": not failed
    assert req.num_computed_tokens == 2 * BLOCK  # truncated to the first lost block
    h.assert_loaded("b", prompt, 0, 2 * BLOCK)
    out = h.step()
    assert out.num_scheduled_tokens["b"] == len(prompt) - 2 * BLOCK  # recomputed
    h.run_until_finished("b")
    assert h.statistics.load_failures == 1
    assert h.statistics.failed_blocks == 4
    assert_worker_idle(h.wait_worker_quiet())


def test_claim_lost_under_fail_policy_ends_the_request_with_an_error(make_harness: Any) -> None:
    h = make_harness(policy="fail")
    prompt = tokens_of(15, 64)
    h.add("a", prompt)
    h.wait_answer("a")
    h.run_until_finished("a")
    h.wait_worker_quiet()
    req = h.add("b", [*prompt, 9])
    assert h.wait_answer("b") == 64
    h.runtime.cancel("b")  # the worker lost the prefetch (as after claim_ttl_s)
    h.step()
    assert req.status == RequestStatus.FINISHED_ERROR
    assert_worker_idle(h.wait_worker_quiet())


# -- tenants: cache_salt and LoRA ----------------------------------------------------------------
def saved_hashes(out: Any, req_id: str) -> list[int]:
    return [k.chunk_hash for spec in out.kv_connector_metadata.saves if spec.req_id == req_id
            for k in spec.keys]  # fmt: skip


def serve(h: Any, req_id: str, prompt: list[int], **kwargs: Any) -> tuple[int, list[int]]:
    """Run one request to the end; its lookup answer and the chunk hashes it saved."""
    h.add(req_id, prompt, **kwargs)
    answer = h.wait_answer(req_id)
    saved: list[int] = []
    for _ in range(50):
        if req_id not in h.scheduler.requests:
            break
        saved += saved_hashes(h.step(), req_id)
    assert req_id not in h.scheduler.requests
    h.wait_worker_quiet()
    return answer, saved


def test_cache_salt_requests_are_cached_in_their_own_name_space(make_harness: Any) -> None:
    h = make_harness()
    prompt = tokens_of(21, 100)  # three whole chunks
    answer, saved_a = serve(h, "a1", prompt, cache_salt="tenant-a")
    assert answer == 0 and len(saved_a) == 3
    # Another tenant and the unsalted name space share none of A's chunks.
    answer, saved_b = serve(h, "b1", prompt, cache_salt="tenant-b")
    assert answer == 0 and len(saved_b) == 3
    answer, saved_u = serve(h, "u1", prompt)
    assert answer == 0 and len(saved_u) == 3
    assert not set(saved_a) & set(saved_b) and not set(saved_a) & set(saved_u)
    assert not set(saved_b) & set(saved_u)
    # Each one's repeat is served from lmprefetch, with the right bytes.
    for req_id, kwargs in (("a2", {"cache_salt": "tenant-a"}), ("b2", {"cache_salt": "tenant-b"}),
                           ("u2", {})):  # fmt: skip
        for t in h.caches.values():
            t.zero_()
        h.add(req_id, prompt, **kwargs)
        assert h.wait_answer(req_id) == 96, req_id

        def check(out: Any, req_id: str = req_id) -> None:
            [load] = out.kv_connector_metadata.loads
            assert (load.start_token, load.end_token) == (0, 96)
            h.assert_loaded(req_id, prompt, 0, 96)

        h.step(before_forward=check)
        h.run_until_finished(req_id)
    assert_worker_idle(h.wait_worker_quiet())
    assert h.statistics.lookup_hits == 3


def write_adapter(path: Path, weights: bytes) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text('{"r": 8, "target_modules": ["q_proj"]}')
    (path / "adapter_model.safetensors").write_bytes(weights)
    return path


def test_lora_adapters_are_cached_by_name_and_content(make_harness: Any, tmp_path: Path) -> None:
    """A LoRA request is keyed by the adapter's name and a digest of its files: the same
    adapter at another path shares the cache, another adapter under the same name does not,
    nor does the base model, and an adapter replaced in place (``load_inplace``) starts over."""
    one = write_adapter(tmp_path / "one", b"weights-1" * 100)
    one_copy = write_adapter(tmp_path / "copy-of-one", b"weights-1" * 100)
    other = write_adapter(tmp_path / "other", b"weights-2" * 100)
    h = make_harness()
    prompt = tokens_of(22, 64)
    assert serve(h, "l1", prompt, lora_request=LoRARequest("sql", 1, str(one)))[0] == 0
    assert serve(h, "l2", prompt, lora_request=LoRARequest("sql", 1, str(one)))[0] == 64
    assert serve(h, "l3", prompt, lora_request=LoRARequest("sql", 2, str(one_copy)))[0] == 64
    assert serve(h, "l4", prompt, lora_request=LoRARequest("sql", 3, str(other)))[0] == 0
    assert serve(h, "l5", prompt, lora_request=LoRARequest("chat", 4, str(one)))[0] == 0
    assert serve(h, "base", prompt)[0] == 0
    salted = LoRARequest("sql", 1, str(one))
    assert serve(h, "l6", prompt, lora_request=salted, cache_salt="t")[0] == 0
    # New weights under the same name and path, loaded in place: a new name space.
    write_adapter(one, b"weights-3" * 100)
    inplace = LoRARequest("sql", 1, str(one), load_inplace=True)
    assert serve(h, "l7", prompt, lora_request=inplace)[0] == 0
    assert serve(h, "l8", prompt, lora_request=LoRARequest("sql", 1, str(one)))[0] == 64
    assert_worker_idle(h.wait_worker_quiet())


def test_multimodal_and_prompt_embeds_requests_stay_uncached(make_harness: Any) -> None:
    h = make_harness()
    st = h.connector.scheduler_side
    plain = Request("p", tokens_of(23, 64), SamplingParams(max_tokens=1), None)
    assert st._eligibility(plain) == (True, True)
    embeds = Request("e", None, SamplingParams(max_tokens=1), None,
                     prompt_embeds=torch.zeros(64, 128))  # fmt: skip
    assert st._eligibility(embeds) == (False, False)
    plain.mm_features = [object()]  # any multimodal input
    assert st._eligibility(plain) == (False, False)


# -- KV events -------------------------------------------------------------------------------
def vllm_names(request: Any, chunk: int) -> list[Any]:
    """vLLM's own block hashes of a chunk, as its events carry them."""
    per = CHUNK // BLOCK
    hashes = request.block_hashes[chunk * per : (chunk + 1) * per]
    return [maybe_convert_block_hash(b) for b in hashes]


def test_kv_events_name_chunks_by_vllm_block_hashes_and_follow_evictions(
    make_harness: Any,
) -> None:
    chunk_bytes = 2 * len(LAYERS) * BLOCK * ROW * 4  # two blocks, two layers, float32
    h = make_harness(
        kv_events=True, extra={"cpu_bytes": 4 * chunk_bytes, "chunk_bytes": chunk_bytes}
    )
    first = tokens_of(24, 100)
    ra = h.add("a", first, cache_salt="t1")
    h.wait_answer("a")
    h.run_until_finished("a")
    events = h.published.take()
    assert [type(e) for e in events] == [BlockStored] * 3
    for c, ev in enumerate(events):
        assert ev.medium == "CPU" and ev.locality == "LOCAL" and ev.ownership == "lmprefetch"
        assert ev.block_hashes == vllm_names(ra, c)  # salted by vLLM itself: the same names
        assert ev.block_size == BLOCK
        assert ev.token_ids == first[c * CHUNK : (c + 1) * CHUNK]
        assert ev.parent_block_hash == (None if c == 0 else vllm_names(ra, c - 1)[-1])
        assert ev.lora_name is None
    # Three more chunks through a four-slot CPU tier: a's two oldest chunks are evicted.
    rb = h.add("b", tokens_of(25, 100))
    h.wait_answer("b")
    h.run_until_finished("b")
    events = h.published.take()
    stored = [e for e in events if isinstance(e, BlockStored)]
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert [e.block_hashes for e in stored] == [vllm_names(rb, c) for c in range(3)]
    assert sorted(e.block_hashes for e in removed) == sorted([vllm_names(ra, 0), vllm_names(ra, 1)])
    assert all(e.medium == "CPU" for e in removed)
    # A repeat that hits stores nothing new: a load is not a store.
    h.add("b2", tokens_of(25, 100))
    assert h.wait_answer("b2") == 96
    h.run_until_finished("b2")
    assert h.published.take() == []


def test_restarted_worker_names_its_disk_chunks_when_a_request_loads_them(
    make_harness: Any, tmp_path: Path
) -> None:
    """vLLM's block hashes are not kept with a chunk, so a restarted connector announces a
    disk chunk from before once a request that loads it names it."""
    extra = {"disk_path": str(tmp_path / "disk")}
    prompt = tokens_of(26, 100)
    before = make_harness(kv_events=True, extra=extra)
    before.add("a", prompt)
    before.wait_answer("a")
    before.run_until_finished("a")
    before.runtime.call(before.runtime.engine.flush)  # on disk now
    before.step()  # the disk stores are published at the next step
    names = {tuple(e.block_hashes) for e in before.published.take() if e.medium == "STORAGE"}
    assert len(names) == 3
    before.close()

    after = make_harness(kv_events=True, extra=extra)
    after.step()
    assert after.published.take() == []  # nothing announced: no names yet
    rb = after.add("b", [*prompt, 1, 2, 3])
    assert after.wait_answer("b") == 96  # from disk
    after.step()
    events = after.published.take()
    disk = [e for e in events if isinstance(e, BlockStored) and e.medium == "STORAGE"]
    assert [e.block_hashes for e in disk] == [vllm_names(rb, c) for c in range(3)]
    assert {tuple(e.block_hashes) for e in disk} == names


def test_lmprefetch_event_batches_are_vllm_event_batches() -> None:
    """A standalone worker's payload decodes with vLLM's own decoder, field for field, and
    vLLM's decodes with lmprefetch's."""
    import msgspec

    from lmprefetch import events as ours

    batch = ours.KVEventBatch(
        ts=12.5,
        events=[
            ours.AllBlocksCleared(),
            ours.BlockStored(
                [1, b"\x02" * 32], 7, [5, 6], 2, 3, "CPU", "ad", locality="LOCAL",
                ownership="lmprefetch",
            ),
            ours.BlockRemoved([1, b"\x02" * 32], "STORAGE", locality="REMOTE",
                              ownership="lmprefetch"),
        ],
    )  # fmt: skip
    theirs = msgspec.msgpack.Decoder(KVEventBatch).decode(ours.encode_batch(batch))
    assert theirs.ts == 12.5 and len(theirs.events) == 3
    for mine, vllms in zip(batch.events, theirs.events):
        assert type(mine).__name__ == type(vllms).__name__
        common = set(mine.__struct_fields__) & set(vllms.__struct_fields__)
        assert {k: getattr(mine, k) for k in common} == {k: getattr(vllms, k) for k in common}
    assert ours.decode_batch(msgspec.msgpack.encode(theirs)) == batch
    # The mirror is complete: every field of vLLM's events is in lmprefetch's schema (vLLM
    # 0.34's); an older vLLM lacks only the fields newer releases added.
    for mine_cls, vllm_cls in ((ours.BlockStored, BlockStored), (ours.BlockRemoved, BlockRemoved)):
        assert set(vllm_cls.__struct_fields__) <= set(mine_cls.__struct_fields__)
        assert set(mine_cls.__struct_fields__) - set(vllm_cls.__struct_fields__) <= NEWER_FIELDS


#: Event fields of lmprefetch's schema (vLLM 0.34's) that older supported vLLMs lack.
NEWER_FIELDS = {"lookahead_token_ids"}  # vLLM 0.33


def test_events_reach_vllm_without_the_fields_it_lacks() -> None:
    """The connector hands vLLM its own event classes with the fields that vLLM has: a field
    newer than the installed vLLM is left out, not passed to a constructor that rejects it."""
    from lmprefetch import events as ours
    from lmprefetch.integration.vllm.connector import _to_vllm_event

    event = ours.BlockStored([1], None, [5], 2, None, "CPU", None, lookahead_token_ids=None)
    converted = _to_vllm_event(event)
    assert type(converted) is BlockStored
    assert converted.block_hashes == [1] and converted.medium == "CPU"


def test_kv_events_can_be_turned_off(make_harness: Any) -> None:
    h = make_harness(kv_events=True, extra={"kv_events": False})
    h.add("a", tokens_of(27, 64))
    h.wait_answer("a")
    h.run_until_finished("a")
    assert h.worker.get_kv_connector_kv_cache_events() is None
    assert h.published.batches == []
    assert h.runtime.engine.kv_events is None


# -- configuration and the byte codec -------------------------------------------------------
def test_chunk_size_must_be_a_multiple_of_the_block_size(model_dir: Path) -> None:
    config = make_vllm_config(model_dir, extra={"chunk_size": 24})
    with pytest.raises(ValueError, match="chunk_size: 24 is not a multiple of vLLM's block size"):
        LMPrefetchConnector(config, KVConnectorRole.WORKER, KVCacheConfig(1, [], []))


def test_unknown_extra_config_field_is_named(model_dir: Path) -> None:
    config = make_vllm_config(model_dir, extra={"chunk_sise": 64})
    with pytest.raises(ValueError, match="chunk_sise: unknown PrefetchConfig field"):
        LMPrefetchConnector(config, KVConnectorRole.WORKER, KVCacheConfig(1, [], []))


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ({"redis_codec": "zip"}, "redis_codec: must be one of"),
        ({"disk_codec": "int4", "codec_group": 63}, "codec_group: the int4 codec"),
        ({"encryption_key_file": "/nonexistent/key"}, "encryption_key_file: cannot read"),
    ],
)
def test_a_bad_codec_or_key_setting_stops_the_connector_with_its_field(
    model_dir: Path, extra: dict[str, object], words: str
) -> None:
    """Start-up, in every role: one sentence that names the field (vLLM reports it and
    exits), before anything is stored."""
    config = make_vllm_config(model_dir, extra=extra)
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(ValueError, match=re.escape(words)):
            LMPrefetchConnector(config, role, KVCacheConfig(1, [], []))


def test_config_file_and_overrides(tmp_path: Path) -> None:
    path = tmp_path / "lmprefetch.toml"
    path.write_text('[lmprefetch]\nchunk_size = 128\nmodel_name = "m"\nclaim_ttl_s = 5\n')
    config, explicit = load_prefetch_config({"config_file": str(path), "chunk_size": 64})
    assert (config.chunk_size, config.model_name, config.claim_ttl_s) == (64, "m", 5)
    assert {"chunk_size", "model_name", "claim_ttl_s"} <= explicit
    assert "kv_dtype" not in explicit
    assert "chunk_bytes" not in explicit


def test_derived_fields_and_explicit_chunk_bytes(make_harness: Any) -> None:
    h = make_harness()
    config = h.runtime.config
    assert config.kv_dtype == "float32"
    assert config.chunk_bytes == 2 * len(LAYERS) * BLOCK * ROW * 4  # exactly one chunk
    assert config.model_name == str(h.vllm_config.model_config.model)
    # The lossy codecs' scales: one per token and head.
    assert config.codec_group == h.vllm_config.model_config.get_head_size()
    with pytest.raises(ValueError, match="chunk_bytes: 1024 is smaller than one chunk"):
        make_harness(extra={"chunk_bytes": 1024})


def test_endpoint_names_stay_short() -> None:
    workers, sched = endpoint_names("0f9c1d8e-2b7a-4c55-9d7e-3a1b2c3d4e5f_dp3", 2)
    assert workers == [
        "ipc://@lmprefetch-0f9c1d8e-2b7a-4c55-9d7e-3a1b2c3d4e5f_dp3-w0",
        "ipc://@lmprefetch-0f9c1d8e-2b7a-4c55-9d7e-3a1b2c3d4e5f_dp3-w1",
    ]
    assert sched.endswith("-sched")
    long_workers, long_sched = endpoint_names("x/" * 200, 1024)
    assert all(len(url) - len("ipc://") <= 107 for url in [*long_workers, long_sched])
    assert long_workers[0] != endpoint_names("y/" * 200, 1)[0][0]


@pytest.mark.parametrize(
    ("shape", "make"),
    [
        ("cpu [B, H, N, 2D] float32", lambda nb: torch.randn(nb, 2, 16, 128)),
        ("flash [2, B, N, H, D] bfloat16", lambda nb: torch.randn(2, nb, 16, 4, 64).bfloat16()),
        (
            "kernel blocks [2B, H, N/2, C]",
            lambda nb: torch.randn(nb * 2, 2, 8, 32),
        ),
        (
            "strided block-outermost view",
            lambda nb: torch.randn(nb, 3, 2, 16, 32)[:, 1],
        ),
        ("odd-sized uint8 rows", lambda nb: torch.randint(1, 255, (nb, 3, 5), dtype=torch.uint8)),
    ],
)
def test_layout_extract_inject_round_trip(shape: str, make: Any) -> None:
    nb = 12
    caches = {"l0": make(nb), "l1": make(nb)}
    layout = PagedKVLayout(caches, nb, 16)
    originals = {k: v.clone() for k, v in caches.items()}
    # Scattered blocks (indexed copies) and a run of consecutive blocks (slice copies).
    sources = [[3, 7], [1], [4, 5, 6, 7]]
    targets = [[5, 2], [3], [8, 9, 10, 11]]
    staging = torch.empty(layout.payload_bytes(7), dtype=torch.uint8)
    payloads = [bytes(p.numpy()) for p in layout.extract(sources, out=staging)]
    assert [len(p) for p in payloads] == [layout.payload_bytes(len(ids)) for ids in sources]
    for t in caches.values():
        t.zero_()
    for payload, ids in zip(payloads, targets, strict=True):
        layout.inject([bytearray(payload)], 0, len(ids), ids)
    dst = PagedKVLayout(caches, nb, 16)
    src = PagedKVLayout(originals, nb, 16)
    for a, b in zip(dst.layers, src.layers, strict=True):
        for s_ids, t_ids in zip(sources, targets, strict=True):
            assert torch.equal(a.rows[t_ids], b.rows[s_ids])
        assert int(a.rows[[0, 1, 4, 6, 7]].count_nonzero()) == 0
    # A payload part that is not whole rows, or too short, is refused.
    with pytest.raises(ValueError, match="not 2 or more rows"):
        layout.inject([bytearray(payloads[1])], 0, 2, [0, 1])


def test_stats_aggregate_and_rebuild() -> None:
    a = LMPrefetchConnector.build_kv_connector_stats({"lookups": 2, "lookup_hits": 1})
    b = LMPrefetchConnector.build_kv_connector_stats({"lookups": 2, "loaded_bytes": 10})
    merged = a.aggregate(b)
    assert merged.reduce() == {
        "lookups": 4,
        "lookup_hits": 1,
        "loaded_bytes": 10,
        "hit_rate": 0.25,
    }
    assert not merged.is_empty()
    assert merged.statistics() == ConnectorStatistics(lookups=4, lookup_hits=1, loaded_bytes=10)
    merged.reset()
    assert merged.is_empty()
    assert LMPrefetchConnector.build_kv_connector_stats(None).is_empty()


# -- load or recompute (docs/policy.md) ---------------------------------------------------------
def _stored(h: Any, seed: int, n: int = 100) -> list[int]:
    """A prompt whose 3 whole chunks (96 tokens) lmprefetch holds, vLLM's cache wiped."""
    prompt = tokens_of(seed, n)
    h.add(f"warm-{seed}", prompt)
    h.wait_answer(f"warm-{seed}")
    h.run_until_finished(f"warm-{seed}")
    h.wait_worker_quiet()
    for t in h.caches.values():
        t.zero_()
    return prompt


def test_max_load_tokens_caps_the_load_on_the_scheduler_and_the_workers(
    make_harness: Any,
) -> None:
    h = make_harness()
    prompt = _stored(h, 40)
    submitted = h.client.statistics().submitted
    req = h.add("capped", prompt, kv_transfer_params={"max_load_tokens": 64})
    # Only the chunks under the cap were looked up (and loaded) on the workers.
    assert h.wait_answer("capped") == 64

    def check(out: Any) -> None:
        [load] = out.kv_connector_metadata.loads
        assert (load.start_token, load.end_token) == (0, 64)
        assert len(load_keys(load)) == 2
        h.assert_loaded("capped", prompt, 0, 64)
        sources = h.connector.get_external_cache_hit_sources(req, 64)
        assert sources == expected_sources(HOST=64)  # served by the CPU tier

    out = h.step(before_forward=check)
    assert out.num_scheduled_tokens["capped"] == len(prompt) - 64
    assert h.client.statistics().submitted == submitted + 1
    # A cap inside a chunk: rounded down to vLLM's 16-token blocks (50 -> 48), the chunks
    # under it looked up (2), and the hit cut to it.
    h.add("odd", prompt, kv_transfer_params={"max_load_tokens": 50})

    def check_odd(out: Any) -> None:
        [load] = out.kv_connector_metadata.loads
        assert (load.start_token, load.end_token) == (0, 48)
        h.assert_loaded("odd", prompt, 0, 48)

    h.wait_answer("odd")
    h.step(before_forward=check_odd)
    stats = h.wait_worker_quiet()
    assert_worker_idle(stats)
    assert h.statistics.load_capped == 2
    assert h.statistics.load_cap_cut == 1  # "odd": 64 found, 48 loaded
    assert h.statistics.policy_loaded >= 2


@pytest.mark.parametrize(
    "params",
    [{"max_load_tokens": 0}, {"skip_load": True}, {"load_policy": "never"}],
    ids=["max_load_tokens-0", "skip", "policy-never"],
)
def test_a_request_can_ask_to_load_nothing(make_harness: Any, params: dict[str, Any]) -> None:
    h = make_harness()
    prompt = _stored(h, 41)
    submitted = h.client.statistics().submitted
    h.add("none", prompt, kv_transfer_params=params)
    out = h.step()
    assert out.num_scheduled_tokens["none"] == len(prompt)  # computed, not loaded
    assert out.kv_connector_metadata.loads == []
    assert h.client.statistics().submitted == submitted  # not even looked up
    assert_worker_idle(h.wait_worker_quiet())
    assert h.statistics.load_skipped == 1


def test_bad_load_params_are_ignored_with_a_warning(
    make_harness: Any, caplog: pytest.LogCaptureFixture
) -> None:
    h = make_harness()
    prompt = _stored(h, 42)
    h.add("bad", prompt, kv_transfer_params={"max_load_tokens": "64", "skip_load": 1})
    assert h.wait_answer("bad") == 96
    assert "max_load_tokens must be an int >= 0" in caplog.text
    assert "skip_load must be true or false" in caplog.text
    h.run_until_finished("bad")
    assert_worker_idle(h.wait_worker_quiet())


def test_a_request_names_its_own_built_in_load_policy(
    make_harness: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """``kv_transfer_params`` ``load_policy``: the request's lookup on every worker runs
    that built-in policy instead of the configured one (here a custom policy loading half
    the hit); a name that is not a built-in policy's is ignored, with a warning."""
    h = make_harness(extra={"load_policy": "tests.test_policy:HalfPolicy"})
    cases = [
        ("configured", None, CHUNK),  # half of 3 chunks, rounded down
        ("always", {"load_policy": "always"}, 3 * CHUNK),
        ("cost", {"load_policy": "cost"}, 3 * CHUNK),  # (not calibrated yet: it loads all)
        ("import", {"load_policy": "os:system"}, CHUNK),
    ]
    for seed, (name, params, hit) in enumerate(cases):
        prompt = _stored(h, 50 + seed)
        h.add(name, prompt, **({} if params is None else {"kv_transfer_params": params}))
        assert h.wait_answer(name) == hit, name
        h.run_until_finished(name)
    assert "load_policy must be one of ('always', 'never', 'cost'), got 'os:system'" in caplog.text
    stats = h.wait_worker_quiet()
    assert_worker_idle(stats)
    assert stats.engine.lookups.malformed == 0  # the scheduler side never sent the bad name


def test_a_request_can_ask_not_to_be_saved(
    make_harness: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """``kv_transfer_params`` ``skip_save``: none of the request's chunks are saved (a later
    request with the same prompt misses), while it is still looked up; a value that is not a
    bool is ignored, with a warning."""
    h = make_harness()
    prompt = tokens_of(44, 100)
    h.add("private", prompt, kv_transfer_params={"skip_save": True})
    assert h.wait_answer("private") == 0
    h.run_until_finished("private")
    stats = h.wait_worker_quiet()
    assert stats.engine.store.chunks_stored == 0
    assert h.statistics.save_skipped == 1
    h.add("again", prompt, kv_transfer_params={"skip_save": "yes"})
    assert h.wait_answer("again") == 0  # nothing was kept
    assert "skip_save must be true or false" in caplog.text
    h.run_until_finished("again")
    assert h.wait_worker_quiet().engine.store.chunks_stored == 3  # saved: the bad value ignored
    assert h.statistics.save_skipped == 1


def test_load_policy_never_looks_nothing_up(make_harness: Any) -> None:
    h = make_harness(extra={"load_policy": "never"})
    prompt = tokens_of(43, 100)
    for name in ("a", "b"):
        h.add(name, prompt)
        h.run_until_finished(name)
    assert h.client.statistics().submitted == 0
    stats = h.wait_worker_quiet()
    # Saves go on; without lookups neither request knows the chunks are stored: both save.
    assert stats.engine.store.chunks_stored == 6
    assert_worker_idle(stats)


def restarted_from_disk(make_harness: Any, tmp_path: Path, prompt: list[int]) -> Harness:
    """A fresh connector (both sides) whose disk tier holds ``prompt``'s chunks, stored by an
    earlier one: its CPU tier is empty and its scheduler side knows nothing."""
    extra = {"disk_path": str(tmp_path / "disk")}
    before = make_harness(extra=extra)
    before.add("warm", prompt)
    before.wait_answer("warm")
    before.run_until_finished("warm")
    before.runtime.call(before.runtime.engine.flush)  # on disk now
    before.close()
    after: Harness = make_harness(extra=extra)
    return after


def saved_tenants(h: Harness, req_id: str) -> set[bytes]:
    """Run a request to the end; the tenants its saves named."""
    tenants: set[bytes] = set()
    for _ in range(50):
        if req_id not in h.scheduler.requests:
            break
        saves = h.step().kv_connector_metadata.saves
        tenants |= {spec.tenant for spec in saves if spec.req_id == req_id}
    assert req_id not in h.scheduler.requests
    return tenants


def test_a_tenants_chunks_are_sealed_for_it_and_opened_by_its_lookups(
    make_harness: Any, tmp_path: Path
) -> None:
    """With ``encryption_key_file``, a salted request's saves name its tenant (the salt's
    digest, never the salt), so the disk tier seals its chunks for it, and its lookups name
    it, so a fresh connector opens them; an unsalted request's are the shared name space's."""
    from lmprefetch.codec import tenant_id
    from lmprefetch.integration.vllm.tenancy import LoraIdentities, request_salt

    key = tmp_path / "key"
    key.write_bytes(bytes(range(32)))
    extra = {"disk_path": str(tmp_path / "disk"), "encryption_key_file": str(key)}
    prompt = tokens_of(47, 100)
    before = make_harness(extra=extra)
    req = before.add("a1", prompt, cache_salt="tenant-a")
    assert before.wait_answer("a1") == 0
    tenant = tenant_id(request_salt(req, LoraIdentities()))
    assert tenant != b"" and saved_tenants(before, "a1") == {tenant}
    before.add("u1", prompt)
    assert before.wait_answer("u1") == 0
    assert saved_tenants(before, "u1") == {b""}
    before.runtime.call(before.runtime.engine.flush)  # on disk now
    before.close()
    after: Harness = make_harness(extra=extra)
    for req_id, kwargs in (("a2", {"cache_salt": "tenant-a"}), ("u2", {})):
        after.add(req_id, prompt, **kwargs)
        assert after.wait_answer(req_id) == 96, req_id  # opened from disk
        after.run_until_finished(req_id)
    assert after.statistics.lookup_hits == 2
    assert_worker_idle(after.wait_worker_quiet())


def test_hit_sources_say_disk_for_a_disk_hit(make_harness: Any, tmp_path: Path) -> None:
    prompt = tokens_of(44, 100)
    after = restarted_from_disk(make_harness, tmp_path, prompt)
    req = after.add("b", prompt)
    assert after.wait_answer("b") == 96

    def check(out: Any) -> None:
        assert after.connector.get_external_cache_hit_sources(req, 96) == expected_sources(DISK=96)

    after.step(before_forward=check)
    assert_worker_idle(after.wait_worker_quiet())


def test_the_workers_calibrate_the_prefill_model_from_their_steps(make_harness: Any) -> None:
    h = make_harness()
    prefill = h.runtime.engine.prefill
    assert prefill.samples == 0
    h.add("a", tokens_of(45, 100), max_tokens=3)
    h.wait_answer("a")
    meta = h.step().kv_connector_metadata  # the prefill: 100 tokens from 0
    assert (meta.scheduled_tokens, meta.scheduled_attention) == (100, 100**2)
    meta = h.step().kv_connector_metadata  # a decode step: 1 token after 100
    assert (meta.scheduled_tokens, meta.scheduled_attention) == (1, 101**2 - 100**2)
    h.run_until_finished("a")
    assert prefill.samples == 3  # the prefill step and two decode steps


def test_the_decision_log_records_each_step_beside_the_fits_prediction(
    make_harness: Any, tmp_path: Path
) -> None:
    """With ``decision_log``, each timed step is one record: its tokens and attention work,
    its time, the process's CPU time meanwhile, and what the prefill fit expected of it
    before the step was added (nothing until the fit is calibrated)."""
    from lmprefetch.trace import StepTrace, decode_records

    log = tmp_path / "decisions-{rank}.jsonl"
    h = make_harness(extra={"decision_log": str(log), "prefill_tokens_per_s": 1000.0})
    prefill = h.runtime.engine.prefill
    h.add("a", tokens_of(46, 100), max_tokens=4)
    h.wait_answer("a")
    h.step()  # the prefill: 100 tokens
    h.step()  # a decode step
    h.run_until_finished("a")
    samples = prefill.samples
    h.close()  # the writer flushes what is queued
    steps = [r for r in decode_records((tmp_path / "decisions-0.jsonl").read_bytes())
             if isinstance(r, StepTrace)]  # fmt: skip
    assert len(steps) == samples == 4
    assert [(s.tokens, s.attention) for s in steps[:2]] == [(100, 100**2), (1, 101**2 - 100**2)]
    assert all(s.seconds > 0 and s.cpu_s is not None and s.cpu_s >= 0 for s in steps)
    # Fitted once three steps of two sizes were seen: the fourth step has a prediction.
    assert [s.predicted_s is None for s in steps] == [True, True, True, False]
    assert steps[0].wall <= steps[1].wall <= steps[2].wall


def test_the_step_time_is_the_forward_whichever_side_of_it_vllm_starts_the_loads(
    make_harness: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM starts a step's loads after the forward when none of them is synchronous: the
    prefill model must still get the forward's time (it got ~0, and the cost policy took
    recomputing for free), measured from the metadata's binding, less the loads."""
    from types import SimpleNamespace

    from lmprefetch.integration.vllm import worker as worker_module

    now = [1000.0]
    monkeypatch.setattr(worker_module, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    h = make_harness()
    prefill = h.runtime.engine.prefill
    seen: list[tuple[int, float]] = []
    observe = prefill.observe_step

    def spy(tokens: int, seconds: float, attention: int = 0) -> None:
        seen.append((tokens, seconds))
        observe(tokens, seconds, attention)

    monkeypatch.setattr(prefill, "observe_step", spy)
    h.add("a", tokens_of(47, 100), max_tokens=3)
    h.wait_answer("a")

    def forward(out: Any) -> None:
        now[0] += 0.25

    h.step(before_forward=forward, loads_after_forward=True)  # the prefill
    h.step(before_forward=forward)  # a decode step, loads first
    assert seen == [(100, pytest.approx(0.25)), (1, pytest.approx(0.25))]
    h.run_until_finished("a")


def test_connector_counters_reach_vllms_prometheus_hook() -> None:
    from types import SimpleNamespace

    from prometheus_client import REGISTRY, Counter, Gauge, Histogram

    metrics = LMPrefetchConnector.build_prom_metrics(
        SimpleNamespace(kv_transfer_config=None),
        {Gauge: Gauge, Counter: Counter, Histogram: Histogram},
        ["engine"],
        {0: ["0"]},
    )
    assert metrics is not None
    metrics.observe({"policy_skipped": 2, "deadline_cut": 1, "hit_rate": 0.5}, 0)
    got = REGISTRY.get_sample_value("vllm:lmprefetch_policy_skipped_total", {"engine": "0"})
    assert got == 2
    got = REGISTRY.get_sample_value("vllm:lmprefetch_deadline_cut_total", {"engine": "0"})
    assert got == 1
    # Every counter the connector declares is exported, with its help.
    declared = ConnectorStatistics.counters()
    assert len(declared) == len(dataclasses.fields(ConnectorStatistics))
    for n, (name, doc) in enumerate(declared):
        before = REGISTRY.get_sample_value(f"vllm:lmprefetch_{name}_total", {"engine": "0"})
        metrics.observe({name: n + 1}, 0)
        after = REGISTRY.get_sample_value(f"vllm:lmprefetch_{name}_total", {"engine": "0"})
        assert after == (before or 0) + n + 1, name
        assert doc


# -- may_load_async (vLLM 0.34; called here directly, as vLLM does on arrival) -----------------
def test_may_load_async_is_true_for_a_hit_lmprefetch_knows_and_loads_it_asynchronously(
    make_harness: Any,
) -> None:
    """On arrival the lookup is pending, so the answer comes from what the workers last held:
    nothing for a fresh prompt, the saved chunks after a request computed them.  A request
    vLLM queued for asynchronous loads gets its hit loaded asynchronously: the load runs in
    the step that allocates its blocks, the worker reports it in ``finished_recving``, and the
    next step computes the rest from the right bytes."""
    h = make_harness()
    prompt = tokens_of(40, 100)  # 3 whole chunks + 4
    first = h.add("first", prompt)
    assert h.connector.may_load_async(first) is False  # nothing known yet
    assert h.wait_answer("first") == 0
    h.run_until_finished("first")
    h.wait_worker_quiet()

    for t in h.caches.values():
        t.zero_()
    second = prompt[:96] + tokens_of(41, 20)
    req = h.add("second", second)
    assert h.connector.may_load_async(req) is True  # pending, but its chunks were saved
    assert h.wait_answer("second") == 96
    assert h.connector.may_load_async(req) is True  # answered: a hit it will load
    out = h.step(loads_after_forward=True)
    assert not out.has_sync_kv_loads
    assert "second" not in out.num_scheduled_tokens  # only its load ran
    [load] = out.kv_connector_metadata.loads
    assert load.asynchronous and (load.start_token, load.end_token) == (0, 96)
    h.assert_loaded("second", second, 0, 96)
    out = h.step()
    assert out.num_scheduled_tokens["second"] == len(second) - 96
    assert req.num_computed_tokens == len(second)
    h.run_until_finished("second")
    assert h.statistics.hit_tokens == 96
    assert_worker_idle(h.wait_worker_quiet())


def test_may_load_async_learns_from_a_lookup_that_found_less(make_harness: Any) -> None:
    """A chunk believed held that a lookup does not find is forgotten: the wrong guess (which
    would hold vLLM's other asynchronous loads back) is made once."""
    h = make_harness(role="kv_consumer")  # loads only: no save tells it the chunk again
    prompt = tokens_of(42, 70)
    a = h.add("a", prompt)
    # Stale knowledge: the first chunk was held once (e.g. evicted since).
    side = h.connector.scheduler_side
    first = side.request("a")
    assert first is not None
    side._ctx.known.held(first.hashes[:1])
    b = h.add("b", prompt)
    assert h.connector.may_load_async(b) is True
    assert h.wait_answer("a") == 0 and h.wait_answer("b") == 0
    h.step()  # the answers are polled: the scheduler side learns the chunk is gone
    c = h.add("c", prompt)
    assert h.connector.may_load_async(c) is False
    for r in (a, b, c):
        h.scheduler.finish_requests(r.request_id, RequestStatus.FINISHED_ABORTED)


def test_may_load_async_knows_the_chunks_a_lookup_found(make_harness: Any, tmp_path: Path) -> None:
    """Chunks this scheduler side never had saved (on disk from before a restart) are known once
    a lookup found them: the next request with that prefix is queued for an asynchronous load
    on arrival."""
    prompt = tokens_of(46, 100)
    after = restarted_from_disk(make_harness, tmp_path, prompt)
    a = after.add("a", prompt)
    assert after.connector.may_load_async(a) is False
    assert after.wait_answer("a") == 96
    b = after.add("b", prompt)
    assert after.connector.may_load_async(b) is True
    for r in (a, b):
        after.scheduler.finish_requests(r.request_id, RequestStatus.FINISHED_ABORTED)
    assert_worker_idle(after.wait_worker_quiet())
