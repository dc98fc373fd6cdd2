"""What the scheduler side sends the workers every step (pickled by vLLM), and what the workers
send back (their KV events).

One spec per direction: a request's :class:`LoadSpec` (before the forward) and
:class:`SaveSpec` (after it), both lists of :class:`KeyBlocks`, one per key: a chunk of one KV
cache group, or a Mamba state.  A model with one full-attention group has one key per chunk;
a hybrid model one per group and chunk (see :mod:`.groups`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_events import KVConnectorKVEvents
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from ...events import ChunkBlocks, KVEvent


# -- metadata (scheduler → workers; pickled every step) ------------------------------------
@dataclass
class KeyBlocks:
    """One key of a request and vLLM's blocks of it, in the key's KV cache group.

    A load copies row ``rows[i]`` of the key's payload into block ``block_ids[i]`` (a row may
    go into several blocks: a Mamba state; a key with no rows is claimed but not copied, it
    lies before what the load needs).  A save's payload is the rows of ``block_ids`` in order
    (``rows`` is ``None``).  Never vLLM's null block 0.
    """

    chunk_hash: int
    group: int
    block_ids: list[int]
    rows: list[int] | None = None
    #: vLLM's name of the key's chunk (KV events on, and the key is of the group whose chunks
    #: events announce): the worker announces a saved chunk under it, and a loaded chunk it
    #: held unannounced (from before a restart).
    name: ChunkBlocks | None = None


@dataclass
class LookupClaim:
    """The keys one lookup of a request loads, in the lookup's order (the first key after the
    ones it skipped): the claim of ``lookup_id`` must yield each, with that hash."""

    lookup_id: str
    keys: list[KeyBlocks]


@dataclass
class LoadSpec:
    """Load tokens ``[start_token, end_token)`` of one request from what its lookups hold.

    ``claims`` is empty when the load could not be planned (vLLM's blocks do not match the
    hit): the load fails as a whole.  A failed synchronous load (a legacy model's) is
    reported by block, from the first key not loaded; an ``asynchronous`` one (a hybrid
    model's, or one vLLM queued through ``may_load_async``) is reported finished in the step
    it ran, and a hybrid one that failed also by request (``failed_recving``).
    """

    req_id: str
    start_token: int
    end_token: int
    claims: list[LookupClaim]
    asynchronous: bool = False


@dataclass
class SaveSpec:
    """Store keys of one request whose KV is complete after this step (chunks of every
    attention group, Mamba states vLLM handed over), chunk by chunk."""

    req_id: str
    keys: list[KeyBlocks]
    #: The request's tenant (a digest of its salt): whom a worker that encrypts seals the
    #: keys for (``b""``: the shared name space).
    tenant: bytes = b""


@dataclass
class LMPrefetchConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """One step's plan: the loads to do before the forward, the saves after it."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
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

    def add_events(self, events: list[tuple[int, KVEvent]]) -> None:
        self._records.extend(events)

    def aggregate(self) -> LMPrefetchKVEvents:
        return self  # the scheduler side merges ranks itself

    def increment_workers(self, count: int = 1) -> None:
        self._workers += count

    def get_all_events(self) -> list[tuple[int, KVEvent]]:
        return list(self._records)

    def get_number_of_workers(self) -> int:
        return self._workers

    def clear_events(self) -> None:
        self._records.clear()

    def __repr__(self) -> str:
        return f"<LMPrefetchKVEvents workers={self._workers} events={len(self._records)}>"
