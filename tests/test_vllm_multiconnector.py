"""lmprefetch configured by name alone, and beside another connector in vLLM's
``MultiConnector``, on vLLM's OpenAI server (CPU build), over HTTP.

vLLM rebuilds each ``MultiConnector`` child's statistics in the API server process by the
child's class name, from its connector registry only: a child not registered under exactly its
class name broke the API server (HTTP 500) as soon as it reported statistics.  lmprefetch's
vLLM plugin registers ``LMPrefetchConnector`` in every vLLM process, so:

* a server configured with ``"kv_connector": "LMPrefetchConnector"`` alone serves a repeated
  prompt from lmprefetch;
* a ``MultiConnector`` of lmprefetch (first) and vLLM's ``ExampleConnector`` starts, serves the
  repeat from lmprefetch, its counters reach ``/metrics``, and the server stays up.

vLLM's own prefix cache is off: every cached token is a connector's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from .vllm_support import needs_plugin, skip_without_vllm

skip_without_vllm()
pytest.importorskip("httpx")

from lmprefetch.bench.serve.client import scrape_metrics  # noqa: E402

from .vllm_servers import P1, P3, connector_config, vllm_servers, whole_chunks  # noqa: E402

pytestmark = [pytest.mark.vllm, needs_plugin]


def multi_connector(example_dir: Path) -> dict[str, Any]:
    """lmprefetch by name first (its hits win), vLLM's ExampleConnector second."""
    return {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "connectors": [
                connector_config(by_name=True),
                {
                    "kv_connector": "ExampleConnector",
                    "kv_role": "kv_both",
                    "kv_connector_extra_config": {"shared_storage_path": str(example_dir)},
                },
            ]
        },
    }


async def test_by_name_and_inside_multiconnector_over_http(tmp_path: Path) -> None:
    example_dir = tmp_path / "example-connector"
    example_dir.mkdir()
    configs = [connector_config(by_name=True), multi_connector(example_dir)]
    async with vllm_servers(tmp_path, configs) as servers:
        for name, server in zip(("by name", "MultiConnector"), servers):
            before = await scrape_metrics(server.client)
            first = await server.complete(P1)
            again = await server.complete(P1)
            delta = await server.metrics_after(before, 2)
            assert (first.cached_tokens, again.cached_tokens) == (0, whole_chunks(P1)), name
            assert again.output_ids == first.output_ids, name
            # lmprefetch served it, and its counters reached vLLM's /metrics.
            assert delta["lmprefetch_hit_tokens"] == whole_chunks(P1), name
            assert delta["lmprefetch_lookup_hits"] == 1, name
            assert delta["external_kv_transfer"] == whole_chunks(P1), name
            # The server stays up: more requests, the health check.
            for _ in range(2):
                assert len((await server.complete(P3)).output_ids) == 8, name
            health = await server.client.get("/health")
            assert health.status_code == 200, name
        # The ExampleConnector saved beside lmprefetch (both children ran).
        assert any(example_dir.rglob("*.safetensors"))
