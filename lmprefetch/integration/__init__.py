"""Integrations of lmprefetch into serving engines.

Each integration lives in its own module and imports its engine only when that module is
imported, so ``import lmprefetch`` never needs an engine installed:

* :mod:`lmprefetch.integration.vllm` — the vLLM v1 KV connector ``LMPrefetchConnector``.
"""
