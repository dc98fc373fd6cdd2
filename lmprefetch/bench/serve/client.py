"""The HTTP client side of bench-serve: streamed completions and vLLM's ``/metrics``.

A request is what an OpenAI client sends to ``/v1/completions``, streamed: the prompt as a list
of token ids, greedy, a fixed number of generated tokens (``ignore_eos``), the usage block at
the end (``stream_options.include_usage``; with vLLM's ``--enable-prompt-tokens-details`` it
carries ``prompt_tokens_details.cached_tokens``: prompt tokens not computed, whether vLLM's own
prefix cache or a KV connector supplied them) and the generated token ids
(``return_token_ids``; with no tokenizer the text is empty).  The time to first token is taken
when the first event carrying a generated token arrives.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

__all__ = [
    "METRIC_SOURCES",
    "TIMINGS",
    "Completion",
    "RequestFailed",
    "complete",
    "metrics_delta",
    "reset_prefix_cache",
    "scrape_metrics",
]


class RequestFailed(RuntimeError):
    """The server answered with an error, or the stream ended without a token."""


@dataclass
class Completion:
    """One streamed completion, timed on the client."""

    ttft_s: float
    latency_s: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    output_ids: list[int] = field(default_factory=list)
    #: The wall clock when the request was sent (the servers' trace records are joined on it).
    sent_at: float = 0.0


async def complete(
    client: httpx.AsyncClient,
    model: str,
    prompt: Sequence[int],
    max_tokens: int,
    kv_transfer_params: Mapping[str, Any] | None = None,
) -> Completion:
    """Send one streamed completion and time it (``kv_transfer_params``: the request's, for
    the KV connector: lmprefetch's per-request ``load_policy``, for one).

    Raises:
        RequestFailed: an HTTP error status, an error event, or no generated token.
    """
    body = {
        "model": model,
        "prompt": list(prompt),
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = dict(kv_transfer_params)
    first: float | None = None
    usage: dict[str, object] | None = None
    output: list[int] = []
    sent_at = time.time()
    t0 = time.perf_counter()
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            text = (await response.aread()).decode(errors="replace")
            raise RequestFailed(f"HTTP {response.status_code}: {text[:500]}")
        # Read to the end of the stream (past "[DONE]"): leaving the line iterator early
        # would leave httpx's async generators to the garbage collector.
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RequestFailed(f"error event: {event['error']}")
            for choice in event.get("choices") or ():
                ids = choice.get("token_ids") or ()
                if ids and first is None:
                    first = time.perf_counter()
                output.extend(ids)
            if event.get("usage"):
                usage = event["usage"]
    end = time.perf_counter()
    if first is None or usage is None:
        raise RequestFailed("the stream ended without a generated token or a usage block")
    details = usage.get("prompt_tokens_details") or {}
    cached = int(details.get("cached_tokens") or 0) if isinstance(details, dict) else 0
    return Completion(
        ttft_s=first - t0,
        latency_s=end - t0,
        prompt_tokens=int(str(usage.get("prompt_tokens", 0))),
        cached_tokens=cached,
        completion_tokens=int(str(usage.get("completion_tokens", 0))),
        output_ids=output,
        sent_at=sent_at,
    )


async def reset_prefix_cache(client: httpx.AsyncClient) -> None:
    """Empty vLLM's own prefix cache (not the connector's); needs ``VLLM_SERVER_DEV_MODE=1``.

    Raises:
        RequestFailed: the server refused (e.g. blocks still in use).
    """
    response = await client.post("/reset_prefix_cache")
    if response.status_code != 200 or not response.json().get("success"):
        raise RequestFailed(f"reset_prefix_cache: HTTP {response.status_code} {response.text}")


#: ``vllm:prompt_tokens_by_source_total`` sources: where each prompt token came from.
METRIC_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")

#: vLLM's per-request timing histograms (sum and count of each are scraped): the server's own
#: time to first token, the time a request waited before its first step (this includes a KV
#: connector's pending lookup), and the time from its first step to its first token (this
#: includes the connector's load into the paged cache and the forward).
TIMINGS = {
    "vllm:time_to_first_token_seconds": "server_ttft",
    "vllm:request_queue_time_seconds": "queue",
    "vllm:request_prefill_time_seconds": "prefill",
}


async def scrape_metrics(client: httpx.AsyncClient) -> dict[str, float]:
    """vLLM's prompt-token counters by source (see :data:`METRIC_SOURCES`), ``prompt_tokens``,
    for each of :data:`TIMINGS` ``<name>_s_sum`` and ``<name>_count``, and lmprefetch's
    connector counters where vLLM exports them (``vllm:lmprefetch_<key>``, as
    ``lmprefetch_<key>``); summed over engines."""
    response = await client.get("/metrics")
    response.raise_for_status()
    out = dict.fromkeys((*METRIC_SOURCES, "prompt_tokens"), 0.0)
    for name in TIMINGS.values():
        out[f"{name}_s_sum"] = out[f"{name}_count"] = 0.0
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            if sample.name == "vllm:prompt_tokens_by_source_total":
                source = sample.labels.get("source", "")
                if source in out:
                    out[source] += sample.value
            elif sample.name == "vllm:prompt_tokens_total":
                out["prompt_tokens"] += sample.value
            elif sample.name.startswith("vllm:lmprefetch_") and sample.name.endswith("_total"):
                # lmprefetch's connector counters (vLLM's Prometheus hook), as lmprefetch_<key>.
                key = sample.name[len("vllm:") : -len("_total")]
                out[key] = out.get(key, 0.0) + sample.value
            elif sample.name.endswith(("_sum", "_count")):
                base, _, kind = sample.name.rpartition("_")
                short = TIMINGS.get(base)
                if short is not None:
                    out[f"{short}_s_sum" if kind == "sum" else f"{short}_count"] += sample.value
    return out


def metrics_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
