"""The worker side of the connector: one :class:`~lmprefetch.runtime.WorkerRuntime` per rank;
claims copied into the paged cache before the forward, new chunks saved after it."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from ...config import KV_DTYPES, PrefetchConfig
from .config import _worker_rank, _world_size, endpoint_names, kv_events_wanted
from .layout import PagedKVLayout
from .metadata import (
    LMPrefetchConnectorMetadata,
    LMPrefetchConnectorStats,
    LMPrefetchKVEvents,
    LoadSpec,
    SaveSpec,
    _Counters,
)

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
    ) -> None:
        ktc = vllm_config.kv_transfer_config
        self._vllm_config = vllm_config
        self._kv_cache_config = kv_cache_config
        self._config = config
        self._explicit = explicit
        self._block_size = int(vllm_config.cache_config.block_size)
        self._world_size = _world_size(vllm_config)
        self._rank = _worker_rank(vllm_config)
        workers, response = endpoint_names(str(ktc.engine_id), self._world_size)
        self._request_endpoint = workers[self._rank]
        self._response_endpoint = response
        self._runtime: Any = None
        self._layout: PagedKVLayout | None = None
        self._load_errors: set[int] = set()
        self._staging: torch.Tensor | None = None
        self._kv_events = kv_events_wanted(vllm_config, config)
        self.counters = _Counters()

    @property
    def runtime(self) -> Any:
        """The rank's :class:`~lmprefetch.runtime.WorkerRuntime` (after ``register_kv_caches``)."""
        return self._runtime

    @property
    def layout(self) -> PagedKVLayout | None:
        return self._layout

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        from ...runtime import WorkerRuntime

        if self._runtime is not None:
            raise RuntimeError("register_kv_caches: called twice")
        layout = PagedKVLayout(kv_caches, int(self._kv_cache_config.num_blocks), self._block_size)
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
            "lmprefetch worker rank %d/%d: %d layers, %d-byte chunk payloads, endpoint %s",
            self._rank, self._world_size, len(layout.layers),
            config.chunk_bytes, self._request_endpoint,
        )  # fmt: skip

    def _finalize_config(self, layout: PagedKVLayout) -> PrefetchConfig:
        """Fill in the fields derived from vLLM that the user left unset."""
        config, explicit = self._config, self._explicit
        changes: dict[str, Any] = {}
        payload = layout.payload_bytes(config.chunk_size // self._block_size)
        if "chunk_bytes" not in explicit:
            changes["chunk_bytes"] = payload
        elif config.chunk_bytes < payload:
            raise ValueError(
                f"chunk_bytes: {config.chunk_bytes} is smaller than one chunk's KV on this "
                f"rank ({payload} bytes: {config.chunk_size} tokens x {len(layout.layers)} "
                "layers); raise it or leave it unset to derive it"
            )
        if "model_name" not in explicit:
            model = str(getattr(self._vllm_config.model_config, "model", "") or "model")
            changes["model_name"] = model.replace("@", "_")
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
    def start_load_kv(self, meta: LMPrefetchConnectorMetadata) -> None:
        for spec in meta.loads:
            self._load(spec)

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

    def _claim_and_copy(
        self, spec: LoadSpec, runtime: Any, layout: PagedKVLayout, start_block: int, end_block: int
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
        for spec in meta.saves:
            self._save(spec)

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
                stored = runtime.store_hashes(hashes, [p.numpy() for p in payloads], blocks=blocks)
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
        return self.counters.take()

    def shutdown(self) -> None:
        if self._runtime is not None:
            self._runtime.close()
