"""What the scheduler side sends the workers every step (pickled by vLLM), and the
connector's stats."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_events import KVConnectorKVEvents
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from ...events import ChunkBlocks, KVEvent


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
    #: vLLM's names of the chunks (KV events on): a worker announces a chunk it held
    #: unannounced (from before a restart) once a request loads it.
    blocks: list[ChunkBlocks] | None = None
    #: Asynchronous for vLLM (a request queued by ``may_load_async``): the worker reports the
    #: request in ``finished_recving`` in the step it ran; failed blocks go the usual way.
    asynchronous: bool = False


@dataclass
class SaveSpec:
    """Store chunks ``first_chunk …`` of one request, whose KV is complete after this step.

    ``chunk_rows[i]`` is the number of blocks chunk ``first_chunk + i`` spans (fewer than
    ``chunk_size // block_size`` only for a trailing partial chunk); ``block_ids`` are those
    blocks, chunk after chunk.  ``blocks[i]`` (KV events on) is what vLLM calls chunk
    ``first_chunk + i``: its block hashes, tokens, parent and LoRA adapter.
    """

    req_id: str
    first_chunk: int
    chunk_hashes: list[int]
    chunk_rows: list[int]
    block_ids: list[int]
    blocks: list[ChunkBlocks] | None = None
    #: The request's tenant (a digest of its salt): whom a worker that encrypts seals the
    #: chunks for (``b""``: the shared name space).
    tenant: bytes = b""


@dataclass
class GroupRows:
    """One key a hybrid load claims: its hash (checked against the claimed key), its KV cache
    group, and where its payload's rows go: row ``rows[i]`` into block ``block_ids[i]`` of the
    group (never vLLM's null block 0).  A key with no rows is claimed but not copied (it lies
    before what this load needs)."""

    chunk_hash: int
    group: int
    rows: list[int]
    block_ids: list[int]


@dataclass
class GroupClaim:
    """The keys one lookup of a hybrid request loads, in the claim's order (the first key
    after the lookup's skipped ones)."""

    lookup_id: str
    keys: list[GroupRows]


@dataclass
class HybridLoadSpec:
    """Load tokens ``[start_token, end_token)`` of a request on a hybrid model.

    Every claim must yield every key it lists, else the request's load failed as a whole
    (reported by request: ``failed_recving``).  The load is asynchronous for vLLM: the worker
    reports the request in ``finished_recving`` in the step it ran, failed or not.  ``described``
    names chunks for KV events, as in :class:`LoadSpec`: ``(hash, blocks)`` pairs."""

    req_id: str
    start_token: int
    end_token: int
    claims: list[GroupClaim]
    described: list[tuple[int, ChunkBlocks]] | None = None


@dataclass
class HybridSaveSpec:
    """Store keys of a request on a hybrid model whose KV is complete after this step.

    Key ``i`` is ``chunk_hashes[i]``, of KV cache group ``groups[i]``; its payload is the rows
    of blocks ``block_ids[i]`` of that group (a chunk's blocks, or one Mamba state block).
    ``blocks[i]`` (KV events on) names key ``i`` when it is a full-attention chunk that is
    announced, else ``None``."""

    req_id: str
    chunk_hashes: list[int]
    groups: list[int]
    block_ids: list[list[int]]
    blocks: list[ChunkBlocks | None] | None = None
    #: The request's tenant, as :attr:`SaveSpec.tenant`.
    tenant: bytes = b""


@dataclass
class LMPrefetchConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """One step's plan: the loads to do before the forward, the saves after it (hybrid models
    use the ``hybrid_`` lists)."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    hybrid_loads: list[HybridLoadSpec] = field(default_factory=list)
    hybrid_saves: list[HybridSaveSpec] = field(default_factory=list)
    #: Tokens the step computes (every request's scheduled tokens): with the step's time,
    #: the workers calibrate the prefill cost the ``cost`` load policy uses.
    scheduled_tokens: int = 0
    #: Their attention work: ``Σ((c+n)² − c²)`` over the step's requests (``n`` tokens after
    #: ``c`` computed), the quadratic term of the prefill model.
    scheduled_attention: int = 0


# -- KV events (workers → scheduler; pickled every step) ------------------------------------
class LMPrefetchKVEvents(KVConnectorKVEvents):  # type: ignore[misc]
    """One step's KV events of the workers, each as ``(rank, event)``.

    vLLM gathers every worker's object into one (``add_events`` with the others'
    ``get_all_events()``, ``increment_workers``) and hands it to the scheduler side's
    ``update_connector_output``, which merges the ranks (an event is published once every rank
    agrees; see :class:`~lmprefetch.events.RankEventMerger`).
    """

    def __init__(self, rank: int = 0, events: list[KVEvent] | None = None) -> None:
        self._records: list[tuple[int, KVEvent]] = [(rank, e) for e in events or ()]
        self._workers = 1

    def add_events(self, events: list[Any]) -> None:
        self._records.extend(events)

    def aggregate(self) -> LMPrefetchKVEvents:
        return self  # the scheduler side merges ranks itself

    def increment_workers(self, count: int = 1) -> None:
        self._workers += count

    def get_all_events(self) -> list[Any]:
        return list(self._records)

    def get_number_of_workers(self) -> int:
        return self._workers

    def clear_events(self) -> None:
        self._records.clear()

    def __repr__(self) -> str:
        return f"<LMPrefetchKVEvents workers={self._workers} events={len(self._records)}>"


# -- stats --------------------------------------------------------------------------------
class LMPrefetchConnectorStats(KVConnectorStats):  # type: ignore[misc]
    """Counters since the last collection, summed over the scheduler and every worker rank.

    Scheduler side: ``lookups`` (started), ``lookup_hits`` (requests that loaded tokens),
    ``hit_tokens`` (tokens loaded instead of computed), ``lookup_restarts``,
    ``save_chunks_planned``, ``kv_events`` (KV events handed to vLLM's publisher).  Worker
    side (summed over ranks): ``loaded_chunks``, ``loaded_bytes``, ``load_failures`` (requests
    whose claim came back short), ``failed_blocks``, ``saved_chunks``, ``saved_bytes``,
    ``save_errors``.  Hybrid models count keys (one per group and chunk, or Mamba state) in
    ``loaded_chunks``, ``saved_chunks`` and ``save_chunks_planned``, and the lookups a request's
    hit is built from (:mod:`.hits`) in ``group_lookups``.

    Load or recompute (``docs/policy.md``): the scheduler side counts ``load_skipped``
    (requests with ``skip_load`` or ``max_load_tokens`` 0: not looked up), ``load_capped``
    (requests with a ``max_load_tokens`` cap) and ``load_cap_cut`` (hits the cap shortened);
    the workers count the load policy's decisions, ``policy_loaded``, ``policy_truncated``,
    ``policy_skipped``, ``policy_unprobed`` (lookups for which it ruled a tier out before
    probing it), and ``deadline_cut`` (lookups whose loads the deadline cut).
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


#: The counters :func:`build_prom_metrics` exports (``vllm:lmprefetch_<key>``), with their help.
PROM_COUNTERS: dict[str, str] = {
    "lookups": "Requests looked up in lmprefetch",
    "lookup_hits": "Requests that loaded tokens from lmprefetch",
    "hit_tokens": "Tokens loaded from lmprefetch instead of computed",
    "load_skipped": "Requests that asked to load nothing (skip_load, max_load_tokens 0)",
    "load_capped": "Requests with a max_load_tokens cap",
    "load_cap_cut": "Hits shortened by a request's max_load_tokens",
    "policy_loaded": "Lookups whose whole hit the load policy loaded",
    "policy_truncated": "Lookups whose hit the load policy truncated",
    "policy_skipped": "Lookups whose hit the load policy skipped (recomputed)",
    "policy_unprobed": "Lookups for which the load policy ruled a tier out before probing it",
    "deadline_cut": "Lookups whose loads the load deadline cut short",
    "loaded_chunks": "Chunks copied into vLLM's KV cache",
    "loaded_bytes": "Bytes copied into vLLM's KV cache",
    "load_failures": "Requests whose load came back short",
    "saved_chunks": "Chunks saved to lmprefetch",
    "saved_bytes": "Bytes saved to lmprefetch",
}


def build_prom_metrics(
    vllm_config: Any,
    metric_types: dict[Any, Any],
    labelnames: list[str],
    per_engine_labelvalues: dict[int, list[object]],
) -> Any:
    """An instance of vLLM's ``KVConnectorPromMetrics`` exporting :data:`PROM_COUNTERS`, or
    ``None`` where the installed vLLM lacks the classes."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics
        from vllm.v1.metrics.utils import create_metric_per_engine
    except ImportError:  # pragma: no cover - an older vLLM
        return None

    class LMPrefetchPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
            self.counters = {
                key: create_metric_per_engine(
                    self._counter_cls(
                        name=f"vllm:lmprefetch_{key}", documentation=doc, labelnames=labelnames
                    ),
                    self.per_engine_labelvalues,
                )
                for key, doc in PROM_COUNTERS.items()
            }

        def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
            for key, value in transfer_stats_data.items():
                per_engine = self.counters.get(key)
                if per_engine is not None and value and engine_idx in per_engine:
                    per_engine[engine_idx].inc(value)

    return LMPrefetchPromMetrics()
