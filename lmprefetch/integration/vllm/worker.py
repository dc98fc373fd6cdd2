"""The worker side of the connector: one :class:`~lmprefetch.runtime.WorkerRuntime` per rank;
claims copied into the paged cache before the forward, new chunks saved after it.

A hybrid model's KV cache groups each get their own :class:`PagedKVLayout` (their layers,
their block size); a hybrid load is all or nothing, and the rank reports the request in
``finished_recving`` in the step it ran (and in ``failed_recving`` when it failed)."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from ...config import KV_DTYPES, PrefetchConfig
from ...trace import StepTrace
from .config import _worker_rank, _world_size, endpoint_names, kv_events_wanted
from .groups import KVGroups, read_groups
from .layout import PagedKVLayout
from .metadata import (
    GroupClaim,
    HybridLoadSpec,
    HybridSaveSpec,
    LMPrefetchConnectorMetadata,
    LMPrefetchConnectorStats,
    LMPrefetchKVEvents,
    LoadSpec,
    SaveSpec,
    _Counters,
)

if TYPE_CHECKING:
    from ...runtime import WorkerRuntime

log = logging.getLogger("lmprefetch.integration.vllm")

#: Chunks copied out of the paged cache per store (the size of the worker's staging tensor).
_SAVE_BATCH_CHUNKS = 8


# -- worker side ----------------------------------------------------------------------------
class _WorkerSide:
    def __init__(
        self,
        vllm_config: Any,
        kv_cache_config: Any,
        config: PrefetchConfig,
        explicit: frozenset[str],
        groups: KVGroups | None = None,
    ) -> None:
        ktc = vllm_config.kv_transfer_config
        if groups is None:
            groups = read_groups(kv_cache_config, int(vllm_config.cache_config.block_size))
        self._groups = groups
        self._vllm_config = vllm_config
        self._kv_cache_config = kv_cache_config
        self._config = config
        self._explicit = explicit
        self._block_size = groups.block_size
        self._world_size = _world_size(vllm_config)
        self._rank = _worker_rank(vllm_config)
        workers, response = endpoint_names(str(ktc.engine_id), self._world_size)
        self._request_endpoint = workers[self._rank]
        self._response_endpoint = response
        self._runtime: WorkerRuntime | None = None
        self._layout: PagedKVLayout | None = None
        #: Hybrid models: one layout per KV cache group (by vLLM's group id).
        self._group_layouts: dict[int, PagedKVLayout] = {}
        self._load_errors: set[int] = set()
        #: Hybrid loads run this step (reported as finished_recving), and those that failed.
        self._recved: set[str] = set()
        self._recv_failed: set[str] = set()
        self._staging: torch.Tensor | None = None
        self._kv_events = kv_events_wanted(vllm_config, config)
        self.counters = _Counters()
        self._step_began: float | None = None
        self._step_cpu_began = 0.0  # the process's CPU time then (decision_log's steps)
        self._step_load_s = 0.0  # time this step spent in start_load_kv
        #: The engine's policy counters as last reported (stats report the increase).
        self._policy_seen: dict[str, int] = {}

    @property
    def runtime(self) -> WorkerRuntime | None:
        """The rank's :class:`~lmprefetch.runtime.WorkerRuntime` (after ``register_kv_caches``)."""
        return self._runtime

    @property
    def layout(self) -> PagedKVLayout | None:
        return self._layout

    @property
    def group_layouts(self) -> dict[int, PagedKVLayout]:
        """Hybrid models: each KV cache group's layout, by vLLM's group id."""
        return self._group_layouts

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        from ...runtime import WorkerRuntime

        if self._runtime is not None:
            raise RuntimeError("register_kv_caches: called twice")
        num_blocks = int(self._kv_cache_config.num_blocks)
        if self._groups.hybrid:
            layouts = {}
            for group in self._groups.groups:
                missing = [n for n in group.layer_names if n not in kv_caches]
                if missing:
                    raise ValueError(
                        f"register_kv_caches: no KV cache tensor for layers {missing} of KV "
                        f"cache group {group.index}"
                    )
                tensors = {n: kv_caches[n] for n in group.layer_names}
                layouts[group.index] = PagedKVLayout(tensors, num_blocks, group.block_size)
            self._group_layouts = layouts
            layout = next(iter(layouts.values()))
            config = self._finalize_hybrid_config(layouts)
        else:
            layout = PagedKVLayout(kv_caches, num_blocks, self._block_size)
            config = self._finalize_config(layout)
        self._layout = layout
        self._config = config
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
            self._rank, self._world_size,
            sum(len(x.layers) for x in self._group_layouts.values()) or len(layout.layers),
            config.chunk_bytes, self._request_endpoint,
            f", KV cache groups: {self._groups.describe()}" if self._groups.hybrid else "",
        )  # fmt: skip

    def _finalize_hybrid_config(self, layouts: Mapping[int, PagedKVLayout]) -> PrefetchConfig:
        """:meth:`_finalize_config` for a hybrid model: a key's payload is one group's chunk
        (or one Mamba state), so ``chunk_bytes`` is the largest of them, and ``kv_dtype`` (a
        name in the keys) is the attention groups' dtype."""
        cs = self._config.chunk_size
        sizes = {
            g.index: layouts[g.index].payload_bytes(1 if g.kind == "mamba" else cs // g.block_size)
            for g in self._groups.groups
        }
        attention = [layouts[g.index] for g in self._groups.groups if g.kind != "mamba"]
        dtype_layout = attention[0] if attention else next(iter(layouts.values()))
        largest = max(sizes.values())
        return self._finalize_config(
            dtype_layout, largest, f"{cs} tokens of the largest KV cache group"
        )

    def _finalize_config(
        self, layout: PagedKVLayout, payload: int | None = None, what: str | None = None
    ) -> PrefetchConfig:
        """Fill in the fields derived from vLLM that the user left unset."""
        config, explicit = self._config, self._explicit
        changes: dict[str, Any] = {}
        if payload is None:
            payload = layout.payload_bytes(config.chunk_size // self._block_size)
            what = f"{config.chunk_size} tokens x {len(layout.layers)} layers"
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
        if config.layerwise:
            sizes = {layer.row_bytes for layer in layout.layers}
            if len(sizes) != 1:
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

    # -- loads ----------------------------------------------------------------------------
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
            self._load(spec)
        for hybrid in meta.hybrid_loads:
            self._load_hybrid(hybrid)
        self._step_load_s += time.perf_counter() - t0

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

    def _load_hybrid(self, spec: HybridLoadSpec) -> None:
        """Load a hybrid request: every planned key, or none counts (all or nothing); the
        request is reported finished either way, and failed when anything was missing."""
        runtime = self._runtime
        ok = bool(spec.claims) and runtime is not None and bool(self._group_layouts)
        if ok and runtime is not None:
            if spec.described and self._kv_events:
                try:
                    runtime.describe_chunks(
                        [h for h, _ in spec.described], [b for _, b in spec.described]
                    )
                except RuntimeError as exc:
                    log.warning("request %s: naming chunks for KV events failed: %s",
                                spec.req_id, exc)  # fmt: skip
            for claim in spec.claims:
                # Every claim is taken (and its buffers released) even after a failure.
                try:
                    ok = self._claim_group_keys(spec.req_id, claim, runtime) and ok
                except (ValueError, RuntimeError) as exc:
                    log.warning("request %s: loading prefetched KV failed: %s", spec.req_id, exc)
                    ok = False
        self._recved.add(spec.req_id)
        if not ok:
            self._recv_failed.add(spec.req_id)
            self.counters.add("load_failures")
            log.info(
                "request %s: loading tokens [%d, %d) failed; vLLM recomputes them "
                '(kv_load_failure_policy "recompute") or fails the request',
                spec.req_id, spec.start_token, spec.end_token,
            )  # fmt: skip

    def _claim_group_keys(self, req_id: str, claim: GroupClaim, runtime: WorkerRuntime) -> bool:
        """Claim one lookup's keys and copy their rows in; ``False`` if any key is missing."""
        layouts = self._group_layouts
        with runtime.claim(claim.lookup_id) as items:
            try:
                if len(items) < len(claim.keys):
                    log.info("request %s: lookup %s yielded %d of %d keys", req_id,
                             claim.lookup_id, len(items), len(claim.keys))  # fmt: skip
                    return False
                for (key, buf), want in zip(items, claim.keys):
                    if key.chunk_hash != want.chunk_hash:
                        log.warning("request %s: claimed key of lookup %s has another hash",
                                    req_id, claim.lookup_id)  # fmt: skip
                        return False
                    if not want.rows:
                        continue
                    layout = layouts[want.group]
                    layout.inject_rows([buf.view()], want.rows, want.block_ids)
                    self.counters.add("loaded_chunks")
                    self.counters.add("loaded_bytes", layout.payload_bytes(len(want.rows)))
                return True
            finally:
                for layout in layouts.values():
                    layout.synchronize()

    def take_finished_recving(self) -> tuple[set[str], set[str]]:
        """Asynchronous loads (hybrid, or queued by ``may_load_async``) run since the last
        call, and the hybrid ones of them that failed."""
        done, failed = self._recved, self._recv_failed
        self._recved, self._recv_failed = set(), set()
        return done, failed

    def _load(self, spec: LoadSpec) -> None:
        bs = self._block_size
        start_block = spec.start_token // bs
        end_block = -(-spec.end_token // bs)
        loaded_to = start_block
        runtime, layout = self._runtime, self._layout
        if runtime is not None and layout is not None:
            if spec.blocks and self._kv_events:
                try:
                    runtime.describe_chunks(spec.chunk_hashes, spec.blocks)
                except RuntimeError as exc:
                    log.warning("request %s: naming chunks for KV events failed: %s",
                                spec.req_id, exc)  # fmt: skip
            try:
                loaded_to = self._claim_and_copy(spec, runtime, layout, start_block, end_block)
            except (ValueError, RuntimeError) as exc:
                log.warning("request %s: loading prefetched KV failed: %s", spec.req_id, exc)
        if loaded_to < end_block:
            failed = spec.block_ids[loaded_to:end_block]
            self._load_errors.update(failed)
            self.counters.add("load_failures")
            self.counters.add("failed_blocks", len(failed))
            log.info(
                "request %s: loaded %d of %d blocks; vLLM recomputes the rest",
                spec.req_id, loaded_to - start_block, end_block - start_block,
            )  # fmt: skip
        if spec.asynchronous:
            self._recved.add(spec.req_id)

    def _claim_and_copy(
        self,
        spec: LoadSpec,
        runtime: WorkerRuntime,
        layout: PagedKVLayout,
        start_block: int,
        end_block: int,
    ) -> int:
        """Claim the prefetch and copy it in; returns the block index loaded up to."""
        bpc = self._config.chunk_size // self._block_size
        kpc = self._config.keys_per_chunk
        loaded_to = start_block
        with runtime.claim(spec.lookup_id) as items:
            try:
                for i in range(len(items) // kpc):
                    c = spec.first_chunk + i
                    first = c * bpc
                    if first >= end_block or i >= len(spec.chunk_hashes):
                        break
                    group = items[i * kpc : (i + 1) * kpc]
                    if group[0][0].chunk_hash != spec.chunk_hashes[i]:
                        log.warning("request %s: claimed chunk %d has another hash", spec.req_id, c)
                        break
                    parts = [buf.view() for _, buf in group]
                    rows = sum(p.nbytes for p in parts) // layout.row_bytes
                    lo = max(start_block - first, 0)
                    hi = min(rows, end_block - first)
                    if hi > lo:
                        layout.inject(parts, lo, hi, spec.block_ids[first + lo : first + hi])
                        self.counters.add("loaded_chunks")
                        self.counters.add("loaded_bytes", layout.payload_bytes(hi - lo))
                    loaded_to = max(loaded_to, first + hi)
                    if rows < bpc:  # a trailing partial chunk ends the prefix
                        break
            finally:
                # Device copies read the claimed buffers: finish them before release.
                layout.synchronize()
        return loaded_to

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    # -- saves ----------------------------------------------------------------------------
    def wait_for_save(self, meta: LMPrefetchConnectorMetadata) -> None:
        self._observe_step(meta)
        for spec in meta.saves:
            self._save(spec)
        for hybrid in meta.hybrid_saves:
            self._save_hybrid(hybrid)

    def _save_hybrid(self, spec: HybridSaveSpec) -> None:
        """Store a hybrid request's keys, each one group's rows (see :class:`HybridSaveSpec`),
        a batch at a time through the staging tensor."""
        runtime, layouts = self._runtime, self._group_layouts
        if runtime is None or not layouts or not spec.chunk_hashes:
            return
        staging = self._staging_for(next(iter(layouts.values())))
        n = len(spec.chunk_hashes)
        for first in range(0, n, _SAVE_BATCH_CHUNKS):
            last = min(first + _SAVE_BATCH_CHUNKS, n)
            try:
                payloads = []
                offset = 0
                for i in range(first, last):
                    layout = layouts[spec.groups[i]]
                    [part] = layout.extract([spec.block_ids[i]], out=staging[offset:])
                    payloads.append(part)
                    offset += int(part.numel())
                stored = self._store_described(runtime, spec, first, last, payloads)
            except (ValueError, RuntimeError, KeyError) as exc:
                self.counters.add("save_errors")
                log.warning("request %s: storing KV keys failed: %s", spec.req_id, exc)
                return
            self.counters.add("saved_chunks", stored)
            self.counters.add("saved_bytes", sum(int(p.numel()) for p in payloads[:stored]))
            if stored < last - first:  # the CPU tier is full (everything pinned): stop here
                return

    def _store_described(
        self,
        runtime: WorkerRuntime,
        spec: HybridSaveSpec,
        first: int,
        last: int,
        payloads: list[torch.Tensor],
    ) -> int:
        """Store keys ``[first, last)`` of ``spec``: the ones KV events announce with their
        names, the others (other groups, Mamba states) unnamed, so never announced."""
        blocks = spec.blocks if self._kv_events else None
        if blocks is None:
            return runtime.store_hashes(
                spec.chunk_hashes[first:last], [p.numpy() for p in payloads], tenant=spec.tenant
            )
        stored = 0
        named = [i for i in range(first, last) if blocks[i] is not None]
        unnamed = [i for i in range(first, last) if blocks[i] is None]
        for indices, names in ((named, True), (unnamed, False)):
            if not indices:
                continue
            hashes = [spec.chunk_hashes[i] for i in indices]
            parts = [payloads[i - first].numpy() for i in indices]
            described = [blocks[i] for i in indices] if names else None
            got = runtime.store_hashes(
                hashes, parts, blocks=described, tenant=spec.tenant  # type: ignore[arg-type]
            )
            stored += got
            if got < len(indices):
                break
        return stored

    def _save(self, spec: SaveSpec) -> None:
        runtime, layout = self._runtime, self._layout
        if runtime is None or layout is None or not spec.chunk_hashes:
            return
        chunks: list[list[int]] = []
        offset = 0
        for rows in spec.chunk_rows:
            chunks.append(spec.block_ids[offset : offset + rows])
            offset += rows
        # At most _SAVE_BATCH_CHUNKS chunks at a time through one reusable staging tensor:
        # ``store_hashes`` copies them into the arena before it returns.
        for first in range(0, len(chunks), _SAVE_BATCH_CHUNKS):
            batch = chunks[first : first + _SAVE_BATCH_CHUNKS]
            hashes = spec.chunk_hashes[first : first + _SAVE_BATCH_CHUNKS]
            blocks = None
            if spec.blocks is not None and self._kv_events:
                blocks = spec.blocks[first : first + _SAVE_BATCH_CHUNKS]
            try:
                payloads = layout.extract(batch, out=self._staging_for(layout))
                stored = runtime.store_hashes(
                    hashes, [p.numpy() for p in payloads], blocks=blocks, tenant=spec.tenant
                )
            except (ValueError, RuntimeError) as exc:
                self.counters.add("save_errors")
                log.warning("request %s: storing KV chunks failed: %s", spec.req_id, exc)
                return
            self.counters.add("saved_chunks", stored)
            self.counters.add("saved_bytes", sum(int(p.numel()) for p in payloads[:stored]))
            if stored < len(batch):  # the CPU tier is full (everything pinned): stop here
                return

    def _staging_for(self, layout: PagedKVLayout) -> torch.Tensor:
        if self._staging is None:
            if self._group_layouts:
                size = _SAVE_BATCH_CHUNKS * self._config.chunk_bytes  # the largest key
            else:
                size = _SAVE_BATCH_CHUNKS * layout.payload_bytes(
                    self._config.chunk_size // self._block_size
                )
            pin = layout.device.type == "cuda"
            self._staging = torch.empty(size, dtype=torch.uint8, pin_memory=pin)
        return self._staging

    def kv_cache_events(self) -> LMPrefetchKVEvents | None:
        """The KV events the rank's tiers produced since the last call (``None`` if none)."""
        if not self._kv_events or self._runtime is None:
            return None
        try:
            events = self._runtime.take_kv_events()
        except RuntimeError:  # the runtime failed (reported when it happened)
            return None
        return LMPrefetchKVEvents(self._rank, events) if events else None

    def stats(self) -> LMPrefetchConnectorStats | None:
        if self._runtime is not None:
            try:
                decisions = self._runtime.engine.policy_counters()
            except RuntimeError:  # the runtime failed (reported when it happened)
                decisions = {}
            for key, total in decisions.items():
                delta = total - self._policy_seen.get(key, 0)
                if delta > 0:
                    self.counters.add(key, delta)
                    self._policy_seen[key] = total
        return self.counters.take()

    def shutdown(self) -> None:
        if self._runtime is not None:
            self._runtime.close()
