"""The connector's configuration: ``kv_connector_extra_config`` to a :class:`PrefetchConfig`,
the endpoint names derived from vLLM's engine id, and the ranks read off vLLM's config."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ...config import PrefetchConfig

if TYPE_CHECKING:
    from vllm.config import VllmConfig

#: The abstract ipc name prefix; an engine id longer than this many bytes, or with other
#: characters than ``[A-Za-z0-9._-]``, is replaced by a hash so names stay far below the
#: 107-byte limit of a Unix socket address.
_ENDPOINT_PREFIX = "lmprefetch"
_MAX_ENGINE_TAG = 48
_SAFE_TAG = re.compile(r"^[A-Za-z0-9._-]+$")


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


def kv_events_wanted(vllm_config: VllmConfig, config: PrefetchConfig) -> bool:
    """Emit KV events: vLLM publishes them (``--kv-events-config`` with
    ``enable_kv_cache_events``) and ``kv_events`` is not turned off."""
    kvc = getattr(vllm_config, "kv_events_config", None)
    return bool(config.kv_events and kvc is not None and kvc.enable_kv_cache_events)


def _world_size(vllm_config: VllmConfig) -> int:
    pc = vllm_config.parallel_config
    for name in ("prefill_context_parallel_size", "decode_context_parallel_size"):
        if int(getattr(pc, name, 1) or 1) > 1:
            raise ValueError(
                f"LMPrefetchConnector: {name} > 1 is not supported (each rank's KV slice "
                "would have to follow vLLM's context-parallel token interleaving)"
            )
    return int(pc.tensor_parallel_size) * int(pc.pipeline_parallel_size)


def _worker_rank(vllm_config: VllmConfig) -> int:
    """This worker's rank among the engine's tensor × pipeline parallel ranks (0 when vLLM's
    parallel state is not initialised, as in unit tests)."""
    from vllm.distributed import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return 0
    tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
    return int(ps.get_pp_group().rank_in_group) * tp_size + int(ps.get_tensor_model_parallel_rank())
