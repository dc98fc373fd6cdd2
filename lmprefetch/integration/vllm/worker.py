"""The worker side of the connector: one :class:`~lmprefetch.runtime.WorkerRuntime` per rank;
each request's :class:`~.metadata.LoadSpec` copied into the paged cache before the forward
(:meth:`_WorkerSide.load`), its :class:`~.metadata.SaveSpec` saved after it
(:meth:`_WorkerSide.save`).

Every KV cache group gets its own :class:`PagedKVLayout` (a legacy model's one group: every
layer vLLM registers).  A failed load is reported by block for a legacy model (vLLM recomputes
from the first lost block) and by request for a hybrid one (``failed_recving``: all or
nothing); an asynchronous load is reported finished (``finished_recving``) in the step it ran.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from ...config import KV_DTYPES, PrefetchConfig
from ...trace import StepTrace
from .config import _worker_rank, _world_size, endpoint_names, kv_events_wanted
from .groups import KVGroups
from .layout import PagedKVLayout
from .metadata import (
    KeyBlocks,
    LMPrefetchConnectorMetadata,
    LMPrefetchKVEvents,
    LoadSpec,
    LookupClaim,
    SaveSpec,
)
from .stats import ConnectorStatistics, LMPrefetchConnectorStats

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from ...runtime import WorkerRuntime

log = logging.getLogger("lmprefetch.integration.vllm")

#: Keys copied out of the paged cache per store (the size of the worker's staging tensor).
_SAVE_BATCH_CHUNKS = 8


# -- worker side ----------------------------------------------------------------------------
class _WorkerSide:
    def __init__(
        self,
        vllm_config: VllmConfig,
        kv_cache_config: KVCacheConfig,
        config: PrefetchConfig,
        explicit: frozenset[str],
        groups: KVGroups,
    ) -> None:
        ktc = vllm_config.kv_transfer_config
        self._groups = groups
        self._vllm_config = vllm_config
        self._kv_cache_config = kv_cache_config
        self._config = config
        self._explicit = explicit
        self._world_size = _world_size(vllm_config)
        self._rank = _worker_rank(vllm_config)
        workers, response = endpoint_names(str(ktc.engine_id), self._world_size)
        self._request_endpoint = workers[self._rank]
        self._response_endpoint = response
        self._runtime: WorkerRuntime | None = None
        #: One layout per KV cache group, by vLLM's group id.
        self._layouts: dict[int, PagedKVLayout] = {}
        #: The largest key's payload (the staging tensor holds a batch of them).
        self._key_bytes = 0
        self._load_errors: set[int] = set()
        #: Asynchronous loads run this step (reported as finished_recving), and the hybrid
        #: ones that failed.
        self._recved: set[str] = set()
        self._recv_failed: set[str] = set()
        self._staging: torch.Tensor | None = None
        self._kv_events = kv_events_wanted(vllm_config, config)
        self._statistics = ConnectorStatistics()
        self._reported = ConnectorStatistics()
        self._step_began: float | None = None
        self._step_cpu_began = 0.0  # the process's CPU time then (decision_log's steps)
        self._step_load_s = 0.0  # time this step spent in start_load_kv

    @property
    def runtime(self) -> WorkerRuntime | None:
        """The rank's :class:`~lmprefetch.runtime.WorkerRuntime` (after ``register_kv_caches``)."""
        return self._runtime

    @property
    def layouts(self) -> dict[int, PagedKVLayout]:
        """Each KV cache group's layout, by vLLM's group id (after ``register_kv_caches``)."""
        return self._layouts

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        from ...runtime import WorkerRuntime

        if self._runtime is not None:
            raise RuntimeError("register_kv_caches: called twice")
        num_blocks = int(self._kv_cache_config.num_blocks)
        layouts = {}
        for group in self._groups.groups:
            if self._groups.legacy:  # one group: every layer vLLM has
                tensors = dict(kv_caches)
            else:
                missing = [n for n in group.layer_names if n not in kv_caches]
                if missing:
                    raise ValueError(
                        f"register_kv_caches: no KV cache tensor for layers {missing} of KV "
                        f"cache group {group.index}"
                    )
                tensors = {n: kv_caches[n] for n in group.layer_names}
            layouts[group.index] = PagedKVLayout(tensors, num_blocks, group.block_size)
        self._layouts = layouts
        self._config = config = self._finalize_config(layouts)
        self._runtime = WorkerRuntime.start(
            config,
            rank=self._rank,
            world_size=self._world_size,
            request_endpoint=self._request_endpoint,
            response_endpoint=self._response_endpoint,
            # Chunks are announced under vLLM's block hashes, which only the scheduler knows.
            kv_events="described" if self._kv_events else "off",
        )
        log.info(
            "lmprefetch worker rank %d/%d: %d layers, %d-byte chunk payloads, endpoint %s%s",
            self._rank, self._world_size, sum(len(x.layers) for x in layouts.values()),
            config.chunk_bytes, self._request_endpoint,
            f", KV cache groups: {self._groups.describe()}" if self._groups.hybrid else "",
        )  # fmt: skip

    def _finalize_config(self, layouts: Mapping[int, PagedKVLayout]) -> PrefetchConfig:
        """Fill in the fields derived from vLLM that the user left unset: ``chunk_bytes`` (the
        largest key: a group's chunk, or a Mamba state), ``kv_dtype`` (a name in the keys:
        the attention groups'), ``model_name``, and in layerwise mode ``num_layers``."""
        config, explicit, groups = self._config, self._explicit, self._groups.groups
        cs = config.chunk_size
        sizes = [
            layouts[g.index].payload_bytes(1 if g.kind == "mamba" else cs // g.block_size)
            for g in groups
        ]
        self._key_bytes = payload = max(sizes)
        attention = [layouts[g.index] for g in groups if g.kind != "mamba"]
        layout = attention[0] if attention else layouts[groups[0].index]
        what = (
            f"{cs} tokens x {len(layout.layers)} layers"
            if len(layouts) == 1
            else f"{cs} tokens of the largest KV cache group"
        )
        changes: dict[str, Any] = {}
        if "chunk_bytes" not in explicit:
            changes["chunk_bytes"] = payload
        elif config.chunk_bytes < payload:
            raise ValueError(
                f"chunk_bytes: {config.chunk_bytes} is smaller than one chunk's KV on this "
                f"rank ({payload} bytes: {what}); raise it or leave it unset to derive it"
            )
        if "model_name" not in explicit:
            model = str(getattr(self._vllm_config.model_config, "model", "") or "model")
            changes["model_name"] = model.replace("@", "_")
        if "codec_group" not in explicit:
            # A scale per token and head for the fp8/int8/int4 codecs (docs/codecs.md): every
            # row's innermost dimension is the head size (K and V side by side on the CPU).
            head_size = getattr(self._vllm_config.model_config, "get_head_size", None)
            if callable(head_size) and int(head_size()) % 2 == 0:
                changes["codec_group"] = int(head_size())
        if "kv_dtype" not in explicit:
            name = layout.kv_dtype_name
            if name is None:
                raise ValueError(
                    f"kv_dtype: cannot derive it from the KV cache dtype {layout.dtype}; set "
                    f"kv_dtype to one of {KV_DTYPES} in kv_connector_extra_config"
                )
            changes["kv_dtype"] = name
        if config.layerwise:  # (a legacy model's: hybrid models refuse it)
            if len({layer.row_bytes for layer in layout.layers}) != 1:
                raise ValueError(
                    "layerwise: the KV cache layers differ in size; layerwise mode needs "
                    "equal layers"
                )
            if "num_layers" not in explicit:
                changes["num_layers"] = len(layout.layers)
            elif config.num_layers != len(layout.layers):
                raise ValueError(
                    f"num_layers: {config.num_layers} set, but the KV cache has "
                    f"{len(layout.layers)} layers"
                )
        try:
            return config.replace(**changes) if changes else config
        except ValueError as exc:
            raise ValueError(f"LMPrefetchConnector (derived {sorted(changes)}): {exc}") from None

    # -- the step -------------------------------------------------------------------------
    def step_began(self) -> None:
        """vLLM bound this step's metadata: its forward follows (the step's compute time
        runs from here to :meth:`wait_for_save`, less the loads in between).  vLLM calls
        ``start_load_kv`` before the forward only when the step has synchronous loads, and
        after it otherwise, so that call cannot mark the forward's start."""
        self._step_began = time.perf_counter()
        self._step_load_s = 0.0
        if self._config.decision_log is not None:  # the step's CPU time, for its record
            self._step_cpu_began = time.process_time()

    def start_load_kv(self, meta: LMPrefetchConnectorMetadata) -> None:
        t0 = time.perf_counter()
        for spec in meta.loads:
            self.load(spec)
        self._step_load_s += time.perf_counter() - t0

    def wait_for_save(self, meta: LMPrefetchConnectorMetadata) -> None:
        self._observe_step(meta)
        for spec in meta.saves:
            self.save(spec)

    def _observe_step(self, meta: LMPrefetchConnectorMetadata) -> None:
        """Feed the engine's prefill model (the ``cost`` load policy) with the step's tokens
        and the time its forward took.  On a GPU the forward is asynchronous, so this is the
        time until the save path first waits on it; on a CPU it is the forward itself."""
        began, self._step_began = self._step_began, None
        if began is None or self._runtime is None or meta.scheduled_tokens <= 0:
            return
        try:
            engine = self._runtime.engine
        except RuntimeError:  # the runtime failed (reported when it happened)
            return
        seconds = time.perf_counter() - began - self._step_load_s
        tokens, attention = meta.scheduled_tokens, meta.scheduled_attention
        trace = engine.trace
        if trace.enabled and self._config.decision_log is not None:
            # decision_log: the step, beside what the prefill model expected of it.
            predicted = engine.prefill.step_seconds(tokens, attention)
            trace.emit(
                StepTrace(
                    trace.rank, time.time() - seconds - self._step_load_s, tokens, attention,
                    seconds, self._step_load_s, predicted,
                    time.process_time() - self._step_cpu_began,
                )
            )  # fmt: skip
        engine.prefill.observe_step(tokens, seconds, attention)

    # -- a request's load -----------------------------------------------------------------
    def load(self, spec: LoadSpec) -> None:
        """Claim each lookup the load names and copy its keys' rows in; every claim is taken
        (and its buffers released) even after a failure.  What was not loaded is reported:
        by block for a legacy model, by request for a hybrid one."""
        runtime = self._runtime
        loaded = [0] * len(spec.claims)  # keys loaded per claim, from its first
        if runtime is not None and self._layouts:
            named = [
                (k.chunk_hash, k.name) for c in spec.claims for k in c.keys if k.name is not None
            ]
            if named and self._kv_events:
                try:
                    runtime.describe_chunks([h for h, _ in named], [n for _, n in named])
                except RuntimeError as exc:
                    log.warning("request %s: naming chunks for KV events failed: %s",
                                spec.req_id, exc)  # fmt: skip
            for i, claim in enumerate(spec.claims):
                try:
                    loaded[i] = self._claim(spec.req_id, claim, runtime)
                except RuntimeError as exc:  # the runtime failed (reported when it happened)
                    log.warning("request %s: loading prefetched KV failed: %s", spec.req_id, exc)
        lost = [k for claim, n in zip(spec.claims, loaded) for k in claim.keys[n:]]
        if lost or not spec.claims:
            self._statistics.load_failures += 1
            if self._groups.legacy:
                blocks = [b for k in lost for b in k.block_ids]
                self._load_errors.update(blocks)
                self._statistics.failed_blocks += len(blocks)
            else:
                self._recv_failed.add(spec.req_id)
            log.info(
                "request %s: %d of %d keys not loaded (tokens [%d, %d)); vLLM recomputes "
                'them (kv_load_failure_policy "recompute") or fails the request',
                spec.req_id, len(lost), sum(len(c.keys) for c in spec.claims),
                spec.start_token, spec.end_token,
            )  # fmt: skip
        if spec.asynchronous:
            self._recved.add(spec.req_id)

    def _claim(self, req_id: str, claim: LookupClaim, runtime: WorkerRuntime) -> int:
        """Claim one lookup's keys and copy their rows in; returns how many keys, from the
        first, were there (with the planned hash) and copied."""
        kpc = self._config.keys_per_chunk  # (layerwise: one key per layer and chunk)
        with runtime.claim(claim.lookup_id) as items:
            try:
                for i, want in enumerate(claim.keys):
                    parts = items[i * kpc : (i + 1) * kpc]
                    if len(parts) < kpc:
                        log.info("request %s: lookup %s yielded %d of %d keys", req_id,
                                 claim.lookup_id, len(items) // kpc, len(claim.keys))  # fmt: skip
                        return i
                    if parts[0][0].chunk_hash != want.chunk_hash:
                        log.warning("request %s: claimed key %d of lookup %s has another hash",
                                    req_id, i, claim.lookup_id)  # fmt: skip
                        return i
                    if not want.rows:
                        continue
                    layout = self._layouts[want.group]
                    try:
                        layout.inject_rows([buf.view() for _, buf in parts], want.rows,
                                           want.block_ids)  # fmt: skip
                    except ValueError as exc:
                        log.warning("request %s: loading prefetched KV failed: %s", req_id, exc)
                        return i
                    self._statistics.loaded_chunks += 1
                    self._statistics.loaded_bytes += layout.payload_bytes(len(want.rows))
                return len(claim.keys)
            finally:
                # Device copies read the claimed buffers: finish them before release.
                for layout in self._layouts.values():
                    layout.synchronize()

    def take_finished_recving(self) -> tuple[set[str], set[str]]:
        """Asynchronous loads run since the last call, and the hybrid ones that failed."""
        done, failed = self._recved, self._recv_failed
        self._recved, self._recv_failed = set(), set()
        return done, failed

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    # -- a request's save -----------------------------------------------------------------
    def save(self, spec: SaveSpec) -> None:
        """Store a request's keys, a batch at a time through the staging tensor (the tier
        copies them before ``store_hashes`` returns); stops at a failure or a full CPU tier."""
        runtime = self._runtime
        if runtime is None or not self._layouts or not spec.keys:
            return
        for first in range(0, len(spec.keys), _SAVE_BATCH_CHUNKS):
            batch = spec.keys[first : first + _SAVE_BATCH_CHUNKS]
            try:
                payloads = self._extract(batch)
                stored = self._store(runtime, batch, payloads, spec.tenant)
            except (ValueError, RuntimeError, KeyError) as exc:
                self._statistics.save_errors += 1
                log.warning("request %s: storing KV keys failed: %s", spec.req_id, exc)
                return
            self._statistics.saved_chunks += stored
            self._statistics.saved_bytes += sum(int(p.numel()) for p in payloads[:stored])
            if stored < len(batch):  # the CPU tier is full (everything pinned): stop here
                return

    def _extract(self, keys: list[KeyBlocks]) -> list[torch.Tensor]:
        """The keys' payloads, views into the staging tensor: one copy out of the paged cache
        per run of keys of the same group."""
        if self._staging is None:
            pin = next(iter(self._layouts.values())).device.type == "cuda"
            size = _SAVE_BATCH_CHUNKS * self._key_bytes
            self._staging = torch.empty(size, dtype=torch.uint8, pin_memory=pin)
        payloads: list[torch.Tensor] = []
        offset = i = 0
        while i < len(keys):
            j = i + 1
            while j < len(keys) and keys[j].group == keys[i].group:
                j += 1
            run = self._layouts[keys[i].group].extract(
                [k.block_ids for k in keys[i:j]], out=self._staging[offset:]
            )
            payloads += run
            offset += sum(int(p.numel()) for p in run)
            i = j
        return payloads

    def _store(
        self,
        runtime: WorkerRuntime,
        keys: list[KeyBlocks],
        payloads: list[torch.Tensor],
        tenant: bytes,
    ) -> int:
        """Store the keys for ``tenant``: the ones KV events announce with their names, the
        others (other groups, Mamba states) unnamed, so never announced; returns how many were
        stored."""
        if not self._kv_events or all(k.name is None for k in keys):
            hashes = [k.chunk_hash for k in keys]
            return runtime.store_hashes(hashes, [p.numpy() for p in payloads], tenant=tenant)
        stored = 0
        named = [i for i, k in enumerate(keys) if k.name is not None]
        unnamed = [i for i, k in enumerate(keys) if k.name is None]
        for indices in (named, unnamed):
            if not indices:
                continue
            names = [n for n in (keys[i].name for i in indices) if n is not None]
            got = runtime.store_hashes(
                [keys[i].chunk_hash for i in indices],
                [payloads[i].numpy() for i in indices],
                blocks=names or None,
                tenant=tenant,
            )
            stored += got
            if got < len(indices):
                break
        return stored

    # -- KV events, statistics ------------------------------------------------------------
    def kv_cache_events(self) -> LMPrefetchKVEvents | None:
        """The KV events the rank's tiers produced since the last call (``None`` if none)."""
        if not self._kv_events or self._runtime is None:
            return None
        try:
            events = self._runtime.take_kv_events()
        except RuntimeError:  # the runtime failed (reported when it happened)
            return None
        return LMPrefetchKVEvents(self._rank, events) if events else None

    def statistics(self) -> ConnectorStatistics:
        """The rank's counters since start (a snapshot), with the load policy's decisions as
        the engine counts them (under the same names: a name the connector does not declare
        is a ``TypeError``, not a counter silently lost)."""
        decisions: dict[str, int] = {}
        if self._runtime is not None:
            try:
                decisions = self._runtime.engine.policy_counters()
            except RuntimeError:  # the runtime failed (reported when it happened)
                pass
        return dataclasses.replace(self._statistics, **decisions)

    def take_stats(self) -> LMPrefetchConnectorStats | None:
        """What grew since the last call (``get_kv_connector_stats``)."""
        now = self.statistics()
        grown, self._reported = LMPrefetchConnectorStats.between(self._reported, now), now
        return grown

    def shutdown(self) -> None:
        if self._runtime is not None:
            self._runtime.close()
