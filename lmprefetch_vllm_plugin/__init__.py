"""lmprefetch's vLLM plugin: registers ``LMPrefetchConnector`` with vLLM by name.

vLLM calls every function of the ``vllm.general_plugins`` entry-point group once in each of its
processes (the API server, the engine core, every worker), whether or not lmprefetch is
configured, so this package is separate from ``lmprefetch`` and imports nothing at import time:
importing ``lmprefetch`` would start its engine's imports (Trio, ZeroMQ) in every vLLM process.
:func:`register` imports only vLLM's connector factory, which vLLM has loaded anyway.

With it, ``--kv-transfer-config '{"kv_connector": "LMPrefetchConnector", ...}'`` needs no
``kv_connector_module_path`` (which still works, and wins when given).  The name is the class
name exactly: vLLM's ``MultiConnector`` finds each child's statistics class by the child's
class name, in the registry only.  ``VLLM_PLUGINS``, when set, is an allow-list of plugin
names: include ``lmprefetch``.
"""

from __future__ import annotations

__all__ = ["CONNECTOR_MODULE", "CONNECTOR_NAME", "register"]

#: The name vLLM knows the connector by: its class name.
CONNECTOR_NAME = "LMPrefetchConnector"
#: Where the class lives (imported by vLLM only when a configuration names it).
CONNECTOR_MODULE = "lmprefetch.integration.vllm"


def register() -> None:
    """Register the connector with vLLM's ``KVConnectorFactory`` (lazily: vLLM imports the
    module only when a configuration names the connector).  Calling it again, or in a process
    where the name is taken already, is not an error; a vLLM without the factory is left
    alone."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except ImportError:
        return
    registry = getattr(KVConnectorFactory, "_registry", None)
    if isinstance(registry, dict) and CONNECTOR_NAME in registry:
        return
    try:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME)
    except ValueError:  # taken meanwhile (vLLM raises on a duplicate name)
        return
