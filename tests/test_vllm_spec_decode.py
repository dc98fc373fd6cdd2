"""Speculative decoding with lmprefetch, on vLLM's OpenAI server (CPU build), over HTTP.

vLLM's ngram speculation (no draft model) proposes draft tokens from the prompt and verifies
them with the target model, so a step schedules several tokens per request and rejected drafts
are rolled back.  Checked here: a repeated prompt is served from lmprefetch (vLLM's own prefix
cache off) and generates exactly the tokens vLLM generates without the connector.

Each comparison is like for like: the cold requests with each other, and the repeat restored
by lmprefetch with the repeat vLLM serves from its own prefix cache (on in the reference
server) over the same number of tokens; a prefix computed afresh and one read from a cache may
round differently.  Both servers run with the same CPU settings: with any KV connector
configured vLLM's CPU build reserves one more core for itself, which on a 2-core machine
changes the thread count, so the reserve (and the binding) is pinned in both.

The hybrid model (a sliding-window Llama under vLLM's hybrid KV cache manager) runs in the
``hybrid`` session; Mamba hybrids are not run (see docs/vllm.md, "Speculative decoding").
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import trio

from .vllm_support import skip_without_vllm

skip_without_vllm()
httpx = pytest.importorskip("httpx")

from lmprefetch.bench.serve.client import complete, scrape_metrics  # noqa: E402
from lmprefetch.bench.serve.hybrid_models import write_hybrid_model  # noqa: E402

from .vllm_servers import (  # noqa: E402
    CHUNK,
    REQUEST_TIMEOUT_S,
    ServerOptions,
    connector_config,
    vllm_servers,
)

pytestmark = pytest.mark.vllm

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4,
         "prompt_lookup_min": 2}  # fmt: skip
#: The same CPU settings for every server compared (see the module docstring).
SAME_CPU = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
#: Three whole chunks with repeats in them (so ngram finds drafts), plus one token: both caches
#: serve exactly the three chunks (vLLM's blocks of 32 tokens, lmprefetch's chunks of 64).
PROMPT = [(i * 37) % 991 + 3 for i in range(CHUNK)] * 2 + [(i * 11) % 991 + 3 for i in range(CHUNK)]
PROMPT = [*PROMPT, 5]
HIT = 3 * CHUNK
MAX_TOKENS = 24


async def draft_tokens(client: Any) -> float:
    """``vllm:spec_decode_num_draft_tokens_total`` (0 without speculative decoding)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = (await client.get("/metrics")).text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "vllm:spec_decode_num_draft_tokens_total"
    )


async def check_same_tokens(tmp_path: Path, model: Path | None = None) -> None:
    spec = ("--speculative-config", json.dumps(NGRAM))
    configs = [None, connector_config()]
    options = [
        ServerOptions(prefix_caching=True, args=spec, env=SAME_CPU),  # vLLM alone
        ServerOptions(prefix_caching=False, args=spec, env=SAME_CPU),  # with lmprefetch
    ]
    runs: dict[str, list[Any]] = {}
    async with vllm_servers(tmp_path, configs, options=options, model=model) as servers:
        for name, server in zip(("vllm", "lmprefetch"), servers):
            before = await scrape_metrics(server.client)
            with trio.fail_after(REQUEST_TIMEOUT_S * 2):
                runs[name] = [
                    await complete(server.client, "bench", PROMPT, MAX_TOKENS) for _ in range(2)
                ]
            delta = await server.metrics_after(before, 2)
            if name == "lmprefetch":
                assert delta["lmprefetch_hit_tokens"] == HIT
                assert delta["local_cache_hit"] == 0
            assert await draft_tokens(server.client) > 0, f"{name}: no speculation ran"
    (cold, repeat), (cold_ref, repeat_ref) = runs["lmprefetch"], runs["vllm"]
    assert [cold_ref.cached_tokens, repeat_ref.cached_tokens] == [0, HIT]  # vLLM's own hit
    assert [cold.cached_tokens, repeat.cached_tokens] == [0, HIT]  # lmprefetch's
    assert len(repeat.output_ids) == MAX_TOKENS
    assert cold.output_ids == cold_ref.output_ids
    assert repeat.output_ids == repeat_ref.output_ids


async def test_ngram_speculation_is_served_from_lmprefetch_with_the_same_tokens(
    tmp_path: Path,
) -> None:
    await check_same_tokens(tmp_path)


@pytest.mark.hybrid
async def test_ngram_speculation_on_a_sliding_window_hybrid(tmp_path: Path) -> None:
    model = write_hybrid_model(tmp_path / "sw-llama", "sw-llama", weights=True)
    await check_same_tokens(tmp_path, model)
