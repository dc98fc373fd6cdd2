"""Hybrid models (vLLM's hybrid KV cache manager) against vLLM's real scheduler, on CPU.

The harness is ``test_vllm_connector.py``'s with one KV tensor per layer and several KV cache
groups: sliding window + full attention, Mamba + full attention, and three groups of mixed
kinds, block sizes and head sizes.  The fake forward writes, for every computed token, a value
of the token, its position and the layer into the token's slot in every attention group, and
keeps a Mamba group's "recurrent state" the way vLLM's align mode does: the state after token
``p`` is a running sum over the tokens so far, read from the block that holds the previous
step's state and written into the running block (``cdiv(p, block) - 1``).  Reading a state
that is not the running sum of the tokens before it is recorded as a wrong state, so a wrong
block, a missing state or a state restored into the wrong block fails the test.  vLLM's null
block 0 must stay all zeros throughout.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
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
    import trio
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
    from vllm.distributed.kv_events import BlockStored, KVEventBatch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorRole,
        SupportsHMA,
        supports_hma,
    )
    from vllm.forward_context import ForwardContext
    from vllm.lora.request import LoRARequest
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import (
        CrossAttentionSpec,
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
        SlidingWindowSpec,
        UniformTypeKVCacheSpecs,
    )
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request, RequestStatus
    from vllm.v1.structured_output import StructuredOutputManager

    from lmprefetch.hashing import ChunkHasher
    from lmprefetch.integration.vllm import (
        ConnectorStatistics,
        LMPrefetchConnector,
        LMPrefetchConnectorStats,
    )
    from lmprefetch.integration.vllm.groups import group_hash, read_groups
    from lmprefetch.integration.vllm.request import STATE_CANDIDATES
    from lmprefetch.keys import ChunkKey
    from lmprefetch.worker_statistics import WorkerStatistics

from .redis_servers import HAVE_REDIS, RedisServer

pytestmark = pytest.mark.vllm

WAIT_S = 20.0
NO_FORWARD = ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={})
STATE_WIDTH = 16  # floats per Mamba state row
STATE_MOD = 1_000_003.0  # the running sum stays an exact float32 integer below 2**24

TINY_SW_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "num_hidden_layers": 3,
    "vocab_size": 1000,
    "max_position_embeddings": 2048,
    "torch_dtype": "float32",
    "layer_types": ["sliding_attention", "full_attention", "full_attention"],
    "sliding_window": 40,
}


@dataclass(frozen=True)
class G:
    """One KV cache group of a harness configuration."""

    kind: str  # "full", "sliding_window", "mamba"
    layers: tuple[str, ...]
    block: int
    head: int = 64  # attention head size (K and V: the row is 2 x head)
    window: int = 0

    def spec(self) -> Any:
        if self.kind == "mamba":
            return MambaSpec(
                block_size=self.block,
                shapes=((STATE_WIDTH,),),
                dtypes=(torch.float32,),
                mamba_cache_mode="align",
            )
        common = {
            "block_size": self.block,
            "num_kv_heads": 1,
            "head_size": self.head,
            "dtype": torch.float32,
        }
        if self.kind == "sliding_window":
            return SlidingWindowSpec(**common, sliding_window=self.window)
        return FullAttentionSpec(**common)


L = [f"model.layers.{i}.self_attn.attn" for i in range(4)]

CONFIGS: dict[str, tuple[G, ...]] = {
    # Window 40 with 16-token blocks: a hit at 96 needs tokens 57..95, blocks 3..5.
    "sw+full": (G("sliding_window", (L[0],), 16, window=40), G("full", (L[1],), 16)),
    "mamba+full": (G("mamba", (L[0],), 16), G("full", (L[1],), 16)),
    # Three groups: a sliding window of 32-token blocks with head size 64, full attention with
    # head size 128 in 16-token blocks, and another full-attention group of two layers.
    "mixed-3": (
        G("sliding_window", (L[0],), 32, head=64, window=40),
        G("full", (L[1],), 16, head=128),
        G("full", (L[2], L[3]), 16, head=64),
    ),
    "mamba+sw+full": (
        G("mamba", (L[0],), 16),
        G("sliding_window", (L[1],), 16, window=24),
        G("full", (L[2],), 16),
    ),
}
CHUNK = 32


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-sw-llama")
    (path / "config.json").write_text(json.dumps(TINY_SW_LLAMA))
    init_none_hash(sha256)
    return path


def make_vllm_config(
    model_dir: Path,
    groups: tuple[G, ...],
    *,
    policy: str = "recompute",
    extra: dict[str, Any] | None = None,
    kv_events: bool = False,
    prefix_caching: bool | None = None,
    batched_tokens: int = 512,
) -> VllmConfig:
    has_mamba = any(g.kind == "mamba" for g in groups)
    # Mamba groups need vLLM's prefix caching (align mode); the tests reset it between rounds.
    caching = has_mamba if prefix_caching is None else prefix_caching
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
            max_num_batched_tokens=batched_tokens,
            max_model_len=1024,
            enable_chunked_prefill=True,
            async_scheduling=False,
            is_encoder_decoder=False,
        ),
        cache_config=CacheConfig(
            block_size=min(g.block for g in groups),
            enable_prefix_caching=caching,
            mamba_cache_mode="align" if has_mamba else "none",
        ),
        kv_transfer_config=KVTransferConfig(
            kv_connector="LMPrefetchConnector",
            kv_connector_module_path="lmprefetch.integration.vllm",
            kv_role="kv_both",
            kv_load_failure_policy=policy,
            kv_connector_extra_config={"chunk_size": CHUNK, "cpu_bytes": 1 << 23, **(extra or {})},
        ),
        device_config=DeviceConfig("cpu"),
        kv_events_config=(
            KVEventsConfig(enable_kv_cache_events=True, publisher="null") if kv_events else None
        ),
    )


def kv_value(token: Any, pos: Any, layer: int) -> Any:
    """What the fake forward writes for a token: exact in float32."""
    return token * 1024.0 + pos + layer * float(1 << 21)


def state_after(tokens: list[int], n: int) -> float:
    """The fake Mamba state after the first ``n`` tokens."""
    total = 0
    for i, t in enumerate(tokens[:n]):
        total = (total + t * (i % 7 + 1)) % int(STATE_MOD)
    return float(total)


class Recorder:
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


class HybridHarness:
    """vLLM's scheduler + a worker-role connector with per-layer CPU tensors, stepped by hand."""

    def __init__(self, vllm_config: VllmConfig, groups: tuple[G, ...], num_blocks: int):
        self.vllm_config = vllm_config
        self.groups = groups
        self.num_blocks = num_blocks
        self.hash_block = min(g.block for g in groups)
        self.kv_cache_config = KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(list(g.layers), g.spec()) for g in groups],
        )
        vllm_config.cache_config.num_gpu_blocks = num_blocks
        self.scheduler = Scheduler(
            vllm_config,
            self.kv_cache_config,
            StructuredOutputManager(vllm_config),
            block_size=max(g.block for g in groups),
            hash_block_size=self.hash_block,
            log_stats=True,
        )
        self.connector: LMPrefetchConnector = self.scheduler.connector
        self.side = self.connector.scheduler_side
        self.client = self.side.client
        self.worker = LMPrefetchConnector(vllm_config, KVConnectorRole.WORKER, self.kv_cache_config)
        self.caches: dict[str, Any] = {}
        for g in groups:
            for name in g.layers:
                if g.kind == "mamba":
                    self.caches[name] = torch.zeros(num_blocks, 1, 1, STATE_WIDTH)
                else:
                    self.caches[name] = torch.zeros(num_blocks, 1, g.block, 2 * g.head)
        self.layer_index = {name: i for i, name in enumerate(L)}
        self.wrong_states: list[tuple[str, int, float, float]] = []
        #: Tokens the fake forward computed per request.
        self.computed: dict[str, int] = {}
        self.transfer_history: list[Any] = []
        self.invalid_history: list[set[int]] = []
        self.stats = LMPrefetchConnectorStats()
        self.published = Recorder()
        self.scheduler.kv_event_publisher = self.published
        self._probes = 0
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
        extra_args = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None
        request = Request(
            request_id=req_id,
            prompt_token_ids=tokens,
            sampling_params=SamplingParams(
                max_tokens=max_tokens, ignore_eos=True, extra_args=extra_args
            ),
            pooling_params=None,
            block_hasher=get_request_block_hasher(self.hash_block, sha256),
            **kwargs,
        )
        self.scheduler.add_request(request)
        return request

    def block_ids(self, req_id: str, group: int) -> list[int]:
        return list(self.scheduler.kv_cache_manager.get_block_ids(req_id)[group])

    def step(self, *, before_forward: Any = None) -> Any:
        out = self.scheduler.schedule()
        worker = self.worker
        worker.bind_connector_metadata(out.kv_connector_metadata)
        worker.start_load_kv(NO_FORWARD)
        if before_forward is not None:
            before_forward(out)
        self.fake_forward(out)
        worker.wait_for_save()
        results = worker.get_transfer_results(out.finished_req_ids)
        self.transfer_history.append(results)
        invalid = worker.get_block_ids_with_load_errors()
        self.invalid_history.append(set(invalid))
        stats = worker.get_kv_connector_stats()
        worker.clear_connector_metadata()
        ids = list(out.num_scheduled_tokens)
        # A step that ends inside the prompt samples nothing (as vLLM's model runner).
        reqs = self.scheduler.requests
        sampled = [[7] if reqs[r].num_computed_tokens >= reqs[r].num_tokens else [] for r in ids]
        mro = model_runner_output(
            req_ids=ids,
            req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=sampled,
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=[],
            kv_connector_output=KVConnectorOutput(
                finished_sending=results.finished_sending or None,
                finished_recving=results.finished_recving or None,
                failed_recving=results.failed_recving,
                invalid_block_ids=invalid,
                kv_connector_stats=stats,
                kv_cache_events=worker.get_kv_connector_kv_cache_events(),
            ),
        )
        engine_outputs = self.scheduler.update_from_output(out, mro)
        for eco in engine_outputs.values():
            sched_stats = eco.scheduler_stats
            if sched_stats is not None and sched_stats.kv_connector_stats:
                self.stats.aggregate(
                    LMPrefetchConnector.build_kv_connector_stats(sched_stats.kv_connector_stats)
                )
        self.assert_null_block_untouched()
        return out

    def fake_forward(self, out: Any) -> None:
        """Write each scheduled token into every attention group's slot; carry every Mamba
        group's state from the previous step's block into the running block."""
        for req_id, n in out.num_scheduled_tokens.items():
            request = self.scheduler.requests[req_id]
            end = request.num_computed_tokens  # already advanced by schedule()
            start = end - n
            self.computed[req_id] = self.computed.get(req_id, 0) + n
            tokens = list(request.all_token_ids)
            for index, g in enumerate(self.groups):
                ids = self.block_ids(req_id, index)
                if g.kind == "mamba":
                    self._step_state(req_id, g, ids, tokens, start, end)
                    continue
                pos = torch.arange(start, end)
                blocks = torch.tensor(ids)[pos // g.block]
                assert bool((blocks != 0).all()), f"{req_id}: a computed token in the null block"
                toks = torch.tensor(tokens[start:end], dtype=torch.float32)
                for name in g.layers:
                    values = kv_value(toks, pos.to(torch.float32), self.layer_index[name])
                    self.caches[name][blocks, :, pos % g.block, :] = values[:, None, None]

    def _step_state(
        self, req_id: str, g: G, ids: list[int], tokens: list[int], start: int, end: int
    ) -> None:
        for name in g.layers:
            cache = self.caches[name]
            if start > 0:
                prev = ids[(start - 1) // g.block]
                got = float(cache[prev, 0, 0, 0])
                want = state_after(tokens, start)
                if prev == 0 or got != want:
                    self.wrong_states.append((req_id, start, got, want))
            cur = ids[-(-end // g.block) - 1]
            assert cur != 0, f"{req_id}: the running Mamba state in the null block"
            cache[cur, 0, 0, :] = state_after(tokens, end)

    def assert_null_block_untouched(self) -> None:
        for name, cache in self.caches.items():
            assert not bool(cache[0].any()), f"{name}: vLLM's null block 0 was written"

    def assert_loaded(self, req_id: str, tokens: list[int], start: int, end: int) -> None:
        """Every group holds what the fake forward wrote for tokens ``[start, end)`` — as far
        as the group needs them to go on from ``end``."""
        for index, g in enumerate(self.groups):
            ids = self.block_ids(req_id, index)
            if g.kind == "mamba":
                block = ids[end // g.block - 1]
                for name in g.layers:
                    got = float(self.caches[name][block, 0, 0, 0])
                    assert got == state_after(tokens, end), f"{name}: wrong state at {end}"
                continue
            first = start if g.kind == "full" else max(start, end - g.window + 1)
            pos = torch.arange(first, end)
            blocks = torch.tensor(ids)[pos // g.block]
            assert bool((blocks != 0).all()), f"group {index}: needed tokens in the null block"
            toks = torch.tensor(tokens[first:end], dtype=torch.float32)
            for name in g.layers:
                got = self.caches[name][blocks, :, pos % g.block, :]
                want = kv_value(toks, pos.to(torch.float32), self.layer_index[name])
                want = want[:, None, None].expand_as(got)
                assert torch.equal(got, want), f"{name}: wrong KV in tokens [{first}, {end})"

    def wipe(self) -> None:
        """A fresh KV cache: only lmprefetch can bring the KV back."""
        for t in self.caches.values():
            t.zero_()
        if self.vllm_config.cache_config.enable_prefix_caching:
            assert self.scheduler.reset_prefix_cache()

    def wait_hit(self, req_id: str) -> int:
        """The request's converged hybrid hit (tokens), waiting on each pending lookup."""
        r = self.side.request(req_id)
        assert r is not None, req_id
        hit = r.wait(WAIT_S)
        assert hit is not None, f"{req_id}: no hit within {WAIT_S} s"
        return hit

    def run_until_finished(self, req_id: str, max_steps: int = 50) -> None:
        for _ in range(max_steps):
            if req_id not in self.scheduler.requests:
                return
            out = self.step()
            r = self.side.request(req_id)
            if req_id not in out.num_scheduled_tokens and r is not None and r.result is None:
                self.wait_hit(req_id)  # looked up again (after a failed load): wait for it
        raise AssertionError(f"{req_id} did not finish in {max_steps} steps")

    def serve(self, req_id: str, tokens: list[int], **kwargs: Any) -> int:
        """Run one request to the end; its hit."""
        self.add(req_id, tokens, **kwargs)
        hit = self.wait_hit(req_id)
        self.run_until_finished(req_id)
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
    made: list[HybridHarness] = []

    def make(config: str, num_blocks: int = 96, **kwargs: Any) -> HybridHarness:
        groups = CONFIGS[config]
        h = HybridHarness(make_vllm_config(model_dir, groups, **kwargs), groups, num_blocks)
        made.append(h)
        return h

    yield make
    for h in made:
        h.close()


def tokens_of(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 997 + 3 for i in range(n)]


def group_key(h: HybridHarness, index: int, chunk_hash: int) -> ChunkKey:
    """The key group ``index``'s chunk with chain hash ``chunk_hash`` is stored under."""
    config = h.runtime.config
    identity = h.side.groups.groups[index].identity
    return ChunkKey(config.model_name, 1, 0, group_hash(identity, chunk_hash), config.kv_dtype)


def discard(h: HybridHarness, key: ChunkKey) -> None:
    engine = h.runtime.engine

    async def drop() -> None:
        assert engine.cpu.contains_now(key), f"{key} is not stored"
        engine.cpu.discard(key)

    h.runtime.call(drop)


# -- HMA stays on ---------------------------------------------------------------------------
def test_the_connector_supports_hma_so_vllm_keeps_it_on(
    model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    assert supports_hma(LMPrefetchConnector)
    assert issubclass(LMPrefetchConnector, SupportsHMA)
    with caplog.at_level(logging.WARNING):
        config = make_vllm_config(model_dir, CONFIGS["sw+full"])
    assert config.scheduler_config.disable_hybrid_kv_cache_manager is False
    assert "Turning off hybrid" not in caplog.text


# -- miss, then hit: the bytes in every group ---------------------------------------------------
@pytest.mark.parametrize("config", list(CONFIGS))
def test_miss_then_hit_restores_every_group(make_harness: Any, config: str) -> None:
    h = make_harness(config)
    prompt = tokens_of(1, 100)  # 3 whole chunks (96 tokens) + 4
    assert h.serve("first", prompt) == 0
    stats = h.wait_worker_quiet()
    assert_worker_idle(stats)
    groups = h.side.groups
    n_full_sw = sum(1 for g in groups.groups if g.kind != "mamba")
    n_mamba = sum(1 for g in groups.groups if g.kind == "mamba")
    # Every attention group's 3 chunks, and the Mamba states vLLM handed over at 96.
    assert stats.engine.store.chunks_stored == 3 * n_full_sw + n_mamba
    h.wipe()

    req = h.add("second", prompt)
    # What vLLM 0.34 asks on arrival (the lookups are pending): the saved chunks say a hit.
    assert h.connector.may_load_async(req) is True
    assert h.wait_hit("second") == 96
    loads: list[Any] = []

    def check(out: Any) -> None:  # after start_load_kv, before the forward writes anything
        loads.extend(out.kv_connector_metadata.loads)
        if loads:
            h.assert_loaded("second", prompt, 0, 96)

    out = h.step(before_forward=check)
    [load] = loads
    assert (load.start_token, load.end_token) == (0, 96)
    assert "second" not in out.num_scheduled_tokens  # asynchronous: loaded this step
    assert h.transfer_history[-1].finished_recving == {"second"}
    assert h.transfer_history[-1].failed_recving == set()
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    out = h.step()
    assert out.num_scheduled_tokens["second"] == 4  # the rest is computed
    h.run_until_finished("second")
    assert h.wrong_states == []
    assert h.statistics.hit_tokens == 96
    assert h.statistics.lookup_hits == 1
    stats = h.wait_worker_quiet()
    assert_worker_idle(stats)
    assert stats.engine.lookups.claimed == len(load.claims)
    # What was loaded is not saved again (neither the chunks nor the state at 96).
    assert stats.engine.store.chunks_stored == 3 * n_full_sw + n_mamba
    assert h.statistics.save_chunks_planned == 3 * n_full_sw + n_mamba


@pytest.mark.parametrize("config", ["sw+full", "mamba+full"])
def test_max_load_tokens_caps_a_hybrid_hit_at_a_chunk_boundary(
    make_harness: Any, config: str
) -> None:
    h = make_harness(config)
    prompt = tokens_of(5, 100)
    h.serve("first", prompt)
    h.wipe()
    # 70 (rounded to 64, two chunks): the boundary stays at 64.
    req = h.add("capped", prompt, kv_transfer_params={"max_load_tokens": 70})
    hit = h.wait_hit("capped")
    loads: list[Any] = []

    def check(out: Any) -> None:
        loads.extend(out.kv_connector_metadata.loads)
        if loads:
            h.assert_loaded("capped", prompt, 0, 64)
            sources = h.connector.get_external_cache_hit_sources(req, 64)
            assert sources == expected_sources(HOST=64)

    h.step(before_forward=check)
    if config == "mamba+full":
        # vLLM handed a Mamba state over at 96 only (the prompt's last chunk boundary), so
        # no boundary under the cap has one: nothing is loaded.
        assert (hit, loads) == (0, [])
    else:
        [load] = loads
        assert (hit, load.start_token, load.end_token) == (64, 0, 64)
    h.run_until_finished("capped")
    assert h.wrong_states == []
    h.wipe()
    # 0: no lookup, nothing loaded.
    submitted = h.client.statistics().submitted
    h.add("none", prompt, kv_transfer_params={"max_load_tokens": 0})
    out = h.step()
    assert out.kv_connector_metadata.loads == []
    assert h.client.statistics().submitted == submitted
    h.run_until_finished("none")
    assert_worker_idle(h.wait_worker_quiet())


def test_a_restore_into_the_wrong_place_is_caught(make_harness: Any) -> None:
    """The harness bites: a load that puts the state into the running block only (not the
    boundary block) is a wrong state; one that skips a group's rows is wrong KV."""
    from lmprefetch.integration.vllm import worker as worker_module

    h = make_harness("mamba+full")
    prompt = tokens_of(2, 100)
    h.serve("first", prompt)
    h.wipe()
    h.add("second", prompt)
    assert h.wait_hit("second") == 96
    real = worker_module._WorkerSide._claim

    def skip_states(self: Any, req_id: str, claim: Any, runtime: Any) -> int:
        for key in claim.keys:
            if self._groups.groups[0].index == key.group:
                key.rows, key.block_ids = [], []  # "forget" the Mamba state
        return int(real(self, req_id, claim, runtime))

    worker_module._WorkerSide._claim = skip_states  # type: ignore[method-assign]
    try:
        h.step()
    finally:
        worker_module._WorkerSide._claim = real  # type: ignore[method-assign]
    h.run_until_finished("second")
    assert h.wrong_states, "a missing state went unnoticed"


# -- sliding window: only the window, never the null block ------------------------------------
def test_sliding_window_hit_needs_only_the_window(make_harness: Any) -> None:
    h = make_harness("sw+full")
    prompt = tokens_of(3, 164)  # 5 whole chunks
    h.serve("first", prompt)
    chain = ChunkHasher(CHUNK).hash(prompt)
    # Out of the window of every hit: the sliding-window key of chunk 0 is not needed.
    discard(h, group_key(h, 0, chain[0]))
    h.wipe()
    loads: list[Any] = []

    def check(out: Any) -> None:
        loads.extend(out.kv_connector_metadata.loads)
        if loads:
            h.assert_loaded("b", prompt, 0, 160)

    h.add("b", prompt)
    assert h.wait_hit("b") == 160
    h.step(before_forward=check)
    [load] = loads
    window_claim = [c for c in load.claims if "|lmp-w" in c.lookup_id]
    [claim] = window_claim
    # Window 40 before 160: tokens 121..159, blocks 7..9: chunks 3 and 4 only.
    assert [k.group for k in claim.keys] == [0, 0]
    assert sorted(r for k in claim.keys for r in k.rows) == [0, 1, 1]
    assert all(b != 0 for k in claim.keys for b in k.block_ids)
    h.run_until_finished("b")
    assert_worker_idle(h.wait_worker_quiet())

    # A sliding-window chunk inside the window is missing: the hit drops below it, and the
    # window there is checked again (chunks 1 and 2 for a hit at 96).
    discard(h, group_key(h, 0, chain[3]))
    h.wipe()
    h.add("c", prompt)
    assert h.wait_hit("c") == 96
    h.run_until_finished("c")
    assert_worker_idle(h.wait_worker_quiet())


# -- Mamba: the state at the boundary or nothing -----------------------------------------------
def test_mamba_hit_is_a_boundary_with_a_state_or_none(make_harness: Any) -> None:
    h = make_harness("mamba+full")
    prompt = tokens_of(4, 100)
    h.serve("first", prompt)  # vLLM hands over the state at 96 (its first step's end)
    h.wipe()
    # Shares 96 tokens, goes on to 200: the full prefix is 3 chunks, the state at 96 exists.
    longer = [*prompt[:96], *tokens_of(5, 104)]
    assert h.serve("longer", longer) == 96
    assert h.wrong_states == []
    h.wipe()
    # Shares only 64 tokens: the full-attention prefix would allow 64, but no state exists
    # there (nor at 32): nothing is loaded, never a wrong state.
    other = [*prompt[:64], *tokens_of(6, 60)]
    h.add("other", other)
    assert h.wait_hit("other") == 0
    h.run_until_finished("other")
    assert h.computed["other"] == len(other)
    assert h.wrong_states == []
    assert_worker_idle(h.wait_worker_quiet())


def test_chunked_prefill_saves_a_state_at_every_step_boundary(make_harness: Any) -> None:
    """With 64-token steps vLLM hands over the state at 64, 128 and 192: a later prompt that
    shares only the first 130 tokens is served up to 128 (a state exists there)."""
    h = make_harness("mamba+full", batched_tokens=64)
    prompt = tokens_of(19, 200)
    h.serve("first", prompt)
    stats = h.wait_worker_quiet()
    # 6 full-attention chunks, states at 2, 4 and 6
    assert stats.engine.store.chunks_stored == 6 + 3
    h.wipe()
    other = [*prompt[:130], *tokens_of(20, 70)]
    assert h.serve("other", other) == 128
    assert h.computed["other"] == len(other) - 128
    assert h.wrong_states == []
    assert_worker_idle(h.wait_worker_quiet())


def test_mamba_candidates_are_probed_in_batches_from_the_top(make_harness: Any) -> None:
    h = make_harness("mamba+full", num_blocks=200)
    short = tokens_of(7, 40)  # its state at 32 (chunk boundary 1)
    h.serve("short", short)
    # A long prompt sharing the first chunk: its 13 chunks and its state at 13 are stored...
    longer = [*short[:32], *tokens_of(8, 32 * 12 + 8)]
    h.serve("long", longer)
    chain = ChunkHasher(CHUNK).hash(longer)
    # ... and its state at 13 is lost: the hit must fall back to the state at 1.
    discard(h, group_key(h, 0, chain[12]))
    h.wipe()
    h.add("again", longer)
    assert h.wait_hit("again") == 32
    again = h.side.request("again")
    assert again is not None
    probed = [s.lookup_id.rsplit("-s", 1)[1] for s in again.lookups if "|lmp-s" in s.lookup_id]
    # The top boundary first (with the prefix), then a batch of 8 below it, then the rest.
    assert [int(p) for p in probed] == [13, *range(12, 4, -1), *range(4, 0, -1)]
    assert STATE_CANDIDATES == 8
    h.run_until_finished("again")
    assert h.computed["again"] == len(longer) - 32
    assert h.wrong_states == []
    assert_worker_idle(h.wait_worker_quiet())


# -- failures are reported by request ----------------------------------------------------------
@contextmanager
def lost_claims(h: HybridHarness, lost: Callable[[str], bool]) -> Iterator[None]:
    """The worker finds nothing for lookups whose id is ``lost`` (lost, expired)."""
    side = h.worker.worker_side
    real = side._runtime

    class Losing:
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        @contextmanager
        def claim(self, lookup_id: str) -> Iterator[list[Any]]:
            with real.claim(lookup_id) as items:
                yield [] if lost(lookup_id) else items

    side._runtime = Losing()
    try:
        yield
    finally:
        side._runtime = real


@pytest.mark.parametrize("config", ["sw+full", "mamba+full"])
def test_a_lost_load_is_reported_by_request_and_recomputed(make_harness: Any, config: str) -> None:
    h = make_harness(config)
    prompt = tokens_of(9, 100)
    h.serve("first", prompt)
    h.wipe()
    req = h.add("b", prompt)
    assert h.wait_hit("b") == 96
    lost = "|lmp-w" if config == "sw+full" else "|lmp-s"
    with lost_claims(h, lambda lookup_id: lost in lookup_id):
        h.step()
    results = h.transfer_history[-1]
    assert results.failed_recving == {"b"}
    assert results.finished_recving == {"b"}
    assert h.invalid_history[-1] == set()  # never by block: vLLM raises on that with groups
    assert req.status != RequestStatus.FINISHED_ERROR
    h.run_until_finished("b")
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert h.wrong_states == []
    assert h.statistics.load_failures == 1
    assert_worker_idle(h.wait_worker_quiet())


def test_a_lost_load_under_the_fail_policy_ends_the_request(make_harness: Any) -> None:
    h = make_harness("sw+full", policy="fail")
    prompt = tokens_of(10, 100)
    h.serve("first", prompt)
    h.wipe()
    req = h.add("b", prompt)
    assert h.wait_hit("b") == 96
    with lost_claims(h, lambda lookup_id: lookup_id == "b"):  # the prefix lookup
        h.step()
    assert req.status == RequestStatus.FINISHED_ERROR
    assert_worker_idle(h.wait_worker_quiet())


def test_a_load_vllms_blocks_do_not_fit_is_reported_by_request_and_recomputed(
    make_harness: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's blocks do not fit the planned load (here: every group's rows refused): nothing is
    claimed, what the lookups hold is released, and the load is reported failed by request;
    vLLM takes the request back, and it is looked up (and served) again."""
    from lmprefetch.integration.vllm import request as request_module

    h = make_harness("sw+full")
    prompt = tokens_of(21, 100)
    h.serve("first", prompt)
    h.wipe()
    req = h.add("b", prompt)
    assert h.wait_hit("b") == 96
    monkeypatch.setattr(request_module, "rows_to_load", lambda *args: None)
    out = h.step()
    [load] = out.kv_connector_metadata.loads
    assert load.claims == []
    results = h.transfer_history[-1]
    assert results.failed_recving == results.finished_recving == {"b"}
    assert h.statistics.lookup_hits == 0
    # Released, not left to claim_ttl_s.
    assert h.wait_worker_quiet().engine.lookups.held == 0
    monkeypatch.undo()
    h.run_until_finished("b")
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert h.computed["b"] == len(prompt) - 96  # the second load went through
    assert h.wrong_states == []
    assert h.statistics.load_failures == 1
    assert h.statistics.lookup_restarts == 1
    assert h.statistics.lookup_hits == 1
    assert_worker_idle(h.wait_worker_quiet())


# -- cancelled and finished requests release everything ---------------------------------------
def test_abort_releases_every_lookup_of_the_request(make_harness: Any) -> None:
    h = make_harness("mamba+sw+full")
    prompt = tokens_of(11, 100)
    h.serve("first", prompt)
    h.wipe()
    h.add("b", prompt)
    assert h.wait_hit("b") == 96
    # The full, window and state lookups hold keys.
    assert h.runtime.statistics().engine.lookups.held >= 2
    h.scheduler.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    stats = h.wait_worker_quiet()
    assert stats.engine.lookups.claimed == 0
    assert_worker_idle(stats)
    # Aborted while its lookups are pending: they are cancelled too.
    h.add("c", prompt)
    h.scheduler.finish_requests("c", RequestStatus.FINISHED_ABORTED)
    assert_worker_idle(h.wait_worker_quiet())
    # Aborted after its load was planned (waiting for it): the load still runs and is
    # reported, so vLLM frees the blocks it held for it.
    req = h.add("d", prompt)
    assert h.wait_hit("d") == 96
    out = h.scheduler.schedule()
    assert out.kv_connector_metadata.loads
    h.scheduler.finish_requests("d", RequestStatus.FINISHED_ABORTED)
    h.worker.bind_connector_metadata(out.kv_connector_metadata)
    h.worker.start_load_kv(NO_FORWARD)
    results = h.worker.get_transfer_results(out.finished_req_ids)
    h.worker.clear_connector_metadata()
    assert results.finished_recving == {"d"}
    assert req.status == RequestStatus.FINISHED_ABORTED
    assert_worker_idle(h.wait_worker_quiet())


# -- saves ------------------------------------------------------------------------------------
def test_saves_skip_null_blocks_and_name_full_attention_chunks(make_harness: Any) -> None:
    h = make_harness("sw+full", kv_events=True)
    prompt = tokens_of(12, 100)
    h.add("a", prompt)
    h.wait_hit("a")
    out = h.step()
    [save] = out.kv_connector_metadata.saves
    assert sorted({k.group for k in save.keys}) == [0, 1]
    assert all(0 not in k.block_ids for k in save.keys)
    h.run_until_finished("a")
    h.wait_worker_quiet()
    h.step()  # the scheduler publishes what the worker reported
    stored = [e for e in h.published.take() if isinstance(e, BlockStored)]
    # Only the full-attention group's chunks are announced, named by vLLM's block hashes.
    assert len(stored) == 3
    request_hashes = []
    for e in stored:
        assert e.block_size == h.hash_block
        request_hashes.extend(e.block_hashes)
    assert len(request_hashes) == 3 * CHUNK // h.hash_block


# -- keys ---------------------------------------------------------------------------------------
def test_group_keys_differ_by_group_layout_and_from_hma_off_keys(model_dir: Path) -> None:
    def groups_of(*specs: tuple[list[str], Any]) -> Any:
        kcc = KVCacheConfig(1, [], [KVCacheGroupSpec(names, spec) for names, spec in specs])
        return read_groups(kcc, 16)

    full = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.float32)
    sw = SlidingWindowSpec(
        block_size=16, num_kv_heads=1, head_size=64, dtype=torch.float32, sliding_window=40
    )
    hma_on = groups_of(([L[0]], sw), ([L[1]], full))
    hma_off = groups_of(([L[0], L[1]], full))
    assert hma_on.hybrid
    assert hma_off.legacy  # plain chain hashes: the keys of every earlier release
    on_ids = {g.identity for g in hma_on.groups}
    assert len(on_ids) == 2
    variants = [
        groups_of(([L[1]], FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=128,
                                             dtype=torch.float32))),
        groups_of(([L[1]], FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=64,
                                             dtype=torch.bfloat16))),
        groups_of(([L[2]], full)),
        groups_of(([L[1]], FullAttentionSpec(block_size=32, num_kv_heads=1, head_size=64,
                                             dtype=torch.float32))),
    ]  # fmt: skip
    # A lone full-attention group is legacy whatever its geometry; its identity (were it
    # hybrid) still tells the variants apart.
    ids = {v.groups[0].identity for v in variants} | on_ids
    assert len(ids) == len(variants) + 2
    chain = ChunkHasher(CHUNK).hash(tokens_of(13, 64))
    hashed = {group_hash(i, h) for i in ids for h in chain}
    assert len(hashed) == len(ids) * len(chain)
    assert hashed.isdisjoint(chain)
    uniform = groups_of(([L[0], L[1]], UniformTypeKVCacheSpecs(
        block_size=16, kv_cache_specs={L[0]: full, L[1]: full})))  # fmt: skip
    assert uniform.legacy


def test_cache_salt_and_lora_keep_hybrid_requests_apart(make_harness: Any, tmp_path: Path) -> None:
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"r": 8, "target_modules": ["q_proj"]}')
    (adapter / "adapter_model.safetensors").write_bytes(b"weights" * 100)
    h = make_harness("mamba+sw+full")
    prompt = tokens_of(14, 100)
    h.serve("a", prompt, cache_salt="tenant-a")
    h.wipe()
    assert h.serve("b", prompt, cache_salt="tenant-b") == 0
    h.wipe()
    assert h.serve("base", prompt) == 0
    h.wipe()
    lora = LoRARequest("sql", 1, str(adapter))
    assert h.serve("l1", prompt, lora_request=lora) == 0
    h.wipe()
    assert h.serve("c", prompt, cache_salt="tenant-a") == 96
    h.wipe()
    assert h.serve("l2", prompt, lora_request=LoRARequest("sql", 2, str(adapter))) == 96
    assert h.wrong_states == []
    assert_worker_idle(h.wait_worker_quiet())


# -- configuration ----------------------------------------------------------------------------
def test_chunk_size_must_fit_every_group_and_says_what_fits(model_dir: Path) -> None:
    groups = (G("sliding_window", (L[0],), 48, window=64), G("full", (L[1],), 16))
    kcc = KVCacheConfig(1, [], [KVCacheGroupSpec(list(g.layers), g.spec()) for g in groups])
    config = make_vllm_config(model_dir, groups, extra={"chunk_size": 64})
    with pytest.raises(ValueError, match=r"^chunk_size: 64 is not a multiple of .*lcm 48\); "
                       r"set chunk_size to 96 \(or a multiple of it\)$"):  # fmt: skip
        LMPrefetchConnector(config, KVConnectorRole.WORKER, kcc)
    config = make_vllm_config(model_dir, groups)
    extra = dict(config.kv_transfer_config.kv_connector_extra_config)
    del extra["chunk_size"]
    config.kv_transfer_config.kv_connector_extra_config = extra
    worker = LMPrefetchConnector(config, KVConnectorRole.WORKER, kcc)
    assert worker.worker_side._config.chunk_size == 288  # the default 256, rounded up to 48s
    for field, value in (("save_partial_chunks", True), ("layerwise", True)):
        config = make_vllm_config(model_dir, groups, extra={"chunk_size": 96, field: value})
        with pytest.raises(ValueError, match=f"^{field}: not supported for hybrid models"):
            LMPrefetchConnector(config, KVConnectorRole.WORKER, kcc)


def test_a_group_lmprefetch_cannot_restore_turns_it_off(
    model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    groups = (G("full", (L[1],), 16),)
    cross = CrossAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.float32)
    kcc = KVCacheConfig(
        64,
        [],
        [KVCacheGroupSpec([L[1]], groups[0].spec()), KVCacheGroupSpec([L[0]], cross)],
    )
    config = make_vllm_config(model_dir, groups)
    with caplog.at_level(logging.WARNING, logger="lmprefetch.integration.vllm"):
        connector = LMPrefetchConnector(config, KVConnectorRole.SCHEDULER, kcc)
    try:
        assert "cross attention" in caplog.text
        assert "neither looks up nor saves" in caplog.text
        side = connector.scheduler_side
        assert not side._do_load
        assert not side._do_save
    finally:
        connector.shutdown()


# -- tiers and restarts -------------------------------------------------------------------------
@pytest.mark.parametrize("tier", ["disk", "redis"])
def test_another_server_is_served_from_the_shared_tier(
    make_harness: Any, tmp_path: Path, tier: str
) -> None:
    """A restarted server (disk) or a second server (Redis) loads every group's keys and the
    Mamba state from the tier: lmprefetch's CPU tier there is empty."""
    with contextlib.ExitStack() as stack:
        if tier == "disk":
            extra = {"disk_path": str(tmp_path / "disk")}
        else:
            if not HAVE_REDIS:
                pytest.skip("redis-server is not installed")
            server = stack.enter_context(started_redis(tmp_path / "redis"))
            extra = {"redis_url": server.url}
        first = make_harness("mamba+sw+full", extra=extra)
        prompt = tokens_of(15, 100)
        first.serve("a", prompt)
        flush(first)
        first.close()
        second = make_harness("mamba+sw+full", extra=extra)
        assert second.runtime.statistics().engine.cpu_resident_chunks == 0
        second.add("b", prompt)
        assert second.wait_hit("b") == 96
        loads: list[Any] = []

        def check(out: Any) -> None:
            loads.extend(out.kv_connector_metadata.loads)
            if loads:
                second.assert_loaded("b", prompt, 0, 96)

        second.step(before_forward=check)
        assert loads
        second.run_until_finished("b")
        assert second.wrong_states == []
        assert_worker_idle(second.wait_worker_quiet())


@contextmanager
def started_redis(workdir: Path) -> Iterator[Any]:
    server = RedisServer(workdir).start()
    try:
        yield server
    finally:
        server.stop()


def flush(h: HybridHarness) -> None:
    """Wait until every write-behind of the worker is on its tier."""
    engine = h.runtime.engine

    async def flushed() -> None:
        with trio.fail_after(WAIT_S):
            await engine.flush()

    h.runtime.call(flushed)


# -- preemption ------------------------------------------------------------------------------
def test_a_preempted_hybrid_request_is_looked_up_and_loaded_again(make_harness: Any) -> None:
    h = make_harness("sw+full", num_blocks=17)  # both prefill; the first decode preempts one
    pa, pb = tokens_of(16, 64), tokens_of(17, 64)
    h.add("a", pa, max_tokens=8)
    rb = h.add("b", pb, max_tokens=8)
    h.wait_hit("a")
    h.wait_hit("b")
    preempted = False
    for _ in range(20):
        out = h.step()
        if "b" in out.preempted_req_ids or "a" in out.preempted_req_ids:
            preempted = True
            break
    assert preempted
    victim = "b" if rb.status == RequestStatus.PREEMPTED else "a"
    prompt = pb if victim == "b" else pa
    resumed: list[Any] = []

    def check(out: Any) -> None:
        loads = [s for s in out.kv_connector_metadata.loads if s.req_id == victim]
        if loads:
            resumed.append(loads[0])
            h.assert_loaded(victim, prompt, 0, loads[0].end_token)

    for _ in range(30):
        if resumed:
            break
        r = h.side.request(victim)
        if r is not None and r.result is None and r.lookups:
            h.wait_hit(victim)
        h.step(before_forward=check)
    assert resumed, "the preempted request was not served from lmprefetch"
    assert resumed[0].end_token == 64  # its chunks were stored before the preemption
    assert h.statistics.lookup_restarts >= 1
    h.run_until_finished("a")
    h.run_until_finished("b")
    assert_worker_idle(h.wait_worker_quiet())


def test_a_hybrid_answer_too_old_to_trust_is_looked_up_again(
    make_harness: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import lmprefetch.integration.vllm.request as request_module

    h = make_harness("sw+full", extra={"claim_ttl_s": 10})
    prompt = tokens_of(18, 100)
    h.serve("a", prompt)
    h.wipe()
    h.add("c", prompt)
    assert h.wait_hit("c") == 96
    c = h.side.request("c")
    assert c is not None
    old = list(c.lookups)
    # Polled only after more than half of claim_ttl_s: the workers may drop what they hold
    # before the step claims it, so every lookup is cancelled and the request looked up again.
    later = request_module._now() + 6
    monkeypatch.setattr(request_module, "_now", lambda: later)
    loads: list[Any] = []
    for _ in range(3):
        out = h.step()
        loads += out.kv_connector_metadata.loads
        if loads:
            break
        assert h.wait_hit("c") == 96
    [load] = loads
    assert h.statistics.lookup_restarts == 1
    new = c.lookups
    assert not any(n is o for n in new for o in old)
    assert {c.lookup_id for c in load.claims} <= {n.lookup_id for n in new}
    h.run_until_finished("c")
    stats = h.wait_worker_quiet()
    assert stats.engine.lookups.cancelled >= 2  # the old prefix and window lookups
    assert_worker_idle(stats)


# -- plans and imports ------------------------------------------------------------------------
def test_a_state_goes_into_the_boundary_block_and_every_block_after_it() -> None:
    """vLLM copies the boundary state into the running block before a synchronous load, so a
    restored state lands in both; vLLM's null block gets nothing, and a sliding-window chunk
    gets only its rows under the window."""
    from lmprefetch.integration.vllm.groups import KVGroup
    from lmprefetch.integration.vllm.request import rows_to_load

    mamba = KVGroup(0, "mamba", 16, (L[0],), None, 0, b"m" * 16)
    sw = KVGroup(1, "sliding_window", 16, (L[1],), 40, 0, b"s" * 16)
    state_blocks, window_blocks = [0, 0, 0, 0, 0, 7, 9], [0, 0, 0, 4, 5, 6, 8]
    # The state after chunk 2 (boundary 96 = block 5) goes into blocks 5 and 6.
    assert rows_to_load(mamba, 2, CHUNK, state_blocks, 0, 96) == ([0, 0], [7, 9])
    # Window 40 before 96: tokens 57..95, blocks 3..5 (chunk 1 row 1, chunk 2 rows 0 and 1).
    assert rows_to_load(sw, 0, CHUNK, window_blocks, 0, 96) == ([], [])
    assert rows_to_load(sw, 1, CHUNK, window_blocks, 0, 96) == ([1], [4])
    assert rows_to_load(sw, 2, CHUNK, window_blocks, 0, 96) == ([0, 1], [5, 6])
    # The boundary's state block is vLLM's null block: the load cannot be planned.
    assert rows_to_load(mamba, 2, CHUNK, [0] * 7, 0, 96) is None
    # A full-attention chunk loaded up to a token inside it (a legacy model's last token):
    # every block up to the one holding the last token loaded, from vLLM's hit on.
    full = KVGroup(0, "full", 16, (L[1],), None, 0, b"f" * 16)
    assert rows_to_load(full, 1, CHUNK, [1, 2, 3, 4], 16, 63) == ([0, 1], [3, 4])
    assert rows_to_load(full, 0, CHUNK, [1, 2, 3, 4], 16, 63) == ([1], [2])
    assert rows_to_load(full, 1, CHUNK, [1, 2, 0, 4], 16, 63) is None  # a null block


def test_the_connector_module_imports_on_a_vllm_without_hma_support() -> None:
    """Without ``SupportsHMA`` the connector is a plain connector (vLLM then turns HMA off);
    a vLLM without request-level failures is refused instead (test_vllm_compat.py)."""
    code = (
        "import vllm.distributed.kv_transfer.kv_connector.v1.base as base\n"
        "del base.SupportsHMA\n"
        "from lmprefetch.integration.vllm import LMPrefetchConnector\n"
        "assert 'request_finished_all_groups' in vars(LMPrefetchConnector)\n"
        "assert 'SupportsHMA' not in [c.__name__ for c in LMPrefetchConnector.__mro__]\n"
        "print('imported')\n"
    )
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("imported")


def test_speculative_blocks_in_a_mamba_group_turn_lookups_and_saves_off() -> None:
    """Under speculative decoding (any method, ngram included) vLLM gives every Mamba group
    blocks for the drafts' states (``num_speculative_blocks``: the draft tokens) and hands over
    no boundary states: such a model is neither looked up nor saved, and says why."""
    full = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.float32)
    mamba = MambaSpec(block_size=16, shapes=((STATE_WIDTH,),), dtypes=(torch.float32,),
                      mamba_cache_mode="align", num_speculative_blocks=3)  # fmt: skip
    groups = read_groups(
        KVCacheConfig(1, [], [KVCacheGroupSpec([L[0]], mamba), KVCacheGroupSpec([L[1]], full)]),
        16,
    )
    assert groups.unsupported is not None
    assert "speculative decoding blocks in a Mamba group are not supported" in groups.unsupported
    plain = MambaSpec(block_size=16, shapes=((STATE_WIDTH,),), dtypes=(torch.float32,),
                      mamba_cache_mode="align")  # fmt: skip
    kcc = KVCacheConfig(1, [], [KVCacheGroupSpec([L[0]], plain), KVCacheGroupSpec([L[1]], full)])
    assert read_groups(kcc, 16).unsupported is None
