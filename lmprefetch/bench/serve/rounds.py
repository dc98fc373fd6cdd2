"""bench-serve's measurements: the workloads' rounds and the same-prompt probes.

A round's requests go out in order, ``concurrency`` in flight, each timed by the client (time
to first token) and, through vLLM's ``/metrics``, by the server; a probe is one request alone on
its server, so the server's timing histograms moved by exactly its figures.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import trio

from .client import (
    TIMINGS,
    Completion,
    RequestFailed,
    complete,
    metrics_delta,
    reset_prefix_cache,
    scrape_metrics,
)
from .servers import SERVED_MODEL, Context, Server
from .workloads import Request

__all__ = [
    "Observed",
    "ProbeResult",
    "WorkloadStats",
    "probe_cold",
    "probe_cpu",
    "probe_pairs",
    "run_round",
    "send_request",
    "warm_up",
]


@dataclass
class WorkloadStats:
    """What one scenario measured on one workload (its measured rounds only)."""

    ttft_s: list[float] = field(default_factory=list)
    requests: int = 0
    completion_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    elapsed_s: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)
    #: The wall clock when each measured request was sent (in ``ttft_s``'s order).
    sent_at: list[float] = field(default_factory=list)

    def add_metrics(self, delta: dict[str, float]) -> None:
        for k, v in delta.items():
            self.metrics[k] = self.metrics.get(k, 0.0) + v


async def send_request(
    ctx: Context,
    server: Server,
    prompt: Sequence[int],
    max_tokens: int,
    kv_transfer_params: Mapping[str, Any] | None = None,
) -> Completion:
    with trio.fail_after(ctx.opts.request_timeout_s):
        return await complete(server.client, SERVED_MODEL, prompt, max_tokens, kv_transfer_params)


async def run_round(
    ctx: Context,
    requests: Sequence[Request],
    servers: Sequence[Server],
    route: Callable[[Request], int],
    concurrency: int,
    stats: WorkloadStats,
    kv_transfer_params: Mapping[str, Any] | None = None,
) -> None:
    """Send one round's requests (``concurrency`` in flight, in order, each with
    ``kv_transfer_params``) and record them."""
    measured = any(r.measured for r in requests)
    before = [await scrape_metrics(s.client) for s in servers]
    send, receive = trio.open_memory_channel[Request](len(requests))
    for req in requests:
        send.send_nowait(req)
    send.close()
    results: list[tuple[Request, Completion]] = []

    failures: list[Exception] = []

    async def worker(cancel_scope: trio.CancelScope) -> None:
        # Failures are values here (and re-raised below), so that no exception group leaves
        # the nursery.
        async for req in receive:
            try:
                result = await send_request(
                    ctx, servers[route(req)], req.prompt, req.max_tokens, kv_transfer_params
                )
            except (RequestFailed, httpx.HTTPError, trio.TooSlowError) as exc:
                failures.append(exc)
                cancel_scope.cancel()
                return
            results.append((req, result))
            ctx.progress.step()

    t0 = time.perf_counter()
    async with receive, trio.open_nursery() as nursery:
        for _ in range(max(1, concurrency)):
            nursery.start_soon(worker, nursery.cancel_scope)
    elapsed = time.perf_counter() - t0
    if failures:
        raise failures[0]
    if not measured:
        return
    stats.elapsed_s += elapsed
    for req, c in results:
        if not req.measured:
            continue
        stats.ttft_s.append(c.ttft_s)
        stats.sent_at.append(c.sent_at)
        stats.requests += 1
        stats.completion_tokens += c.completion_tokens
        stats.prompt_tokens += c.prompt_tokens
        stats.cached_tokens += c.cached_tokens
    for i, (server, b) in enumerate(zip(servers, before)):
        served = sum(1 for req, _ in results if route(req) == i)
        stats.add_metrics(await _metrics_since(server, b, served))


async def _metrics_since(
    server: Server, before: dict[str, float], requests: int
) -> dict[str, float]:
    """The change of ``server``'s metrics since ``before``, once they count ``requests`` more
    finished requests: vLLM records a request when it processes its last output, which can be
    just after the client saw the stream end (a deadline bounds the wait; the counts may then
    be short)."""
    delta: dict[str, float] = {}
    with trio.move_on_after(10.0):
        while True:
            delta = metrics_delta(before, await scrape_metrics(server.client))
            if all(delta.get(f"{t}_count", 0) >= requests for t in TIMINGS.values()):
                break
            await trio.sleep(0.02)
    return delta


@dataclass
class Observed:
    """One probe request: the client's time to first token and vLLM's own view of it."""

    ttft_ms: float
    cached_tokens: int
    server_ttft_ms: float
    queue_ms: float
    prefill_ms: float


@dataclass
class ProbeResult:
    kind: str
    cold: list[Observed] = field(default_factory=list)
    apc_hit: list[Observed] = field(default_factory=list)
    tier_hit: list[Observed] = field(default_factory=list)


async def _observe(ctx: Context, server: Server, prompt: Sequence[int]) -> Observed:
    """One request, timed by the client and by vLLM's timing histograms (its only request in
    flight, so the histograms' sums moved by exactly its figures)."""
    before = await scrape_metrics(server.client)
    done = await send_request(ctx, server, prompt, ctx.opts.long_doc.answer_tokens)
    ctx.progress.step()
    delta = await _metrics_since(server, before, 1)

    def ms(name: str) -> float:
        return delta[f"{name}_s_sum"] * 1e3 if delta.get(f"{name}_count") == 1 else math.nan

    return Observed(
        done.ttft_s * 1e3, done.cached_tokens, ms("server_ttft"), ms("queue"), ms("prefill")
    )


async def probe_cold(ctx: Context, server: Server, result: ProbeResult) -> None:
    """Each probe prompt once, cold: computed, and stored by lmprefetch."""
    for prompt in ctx.probe_prompts:
        result.cold.append(await _observe(ctx, server, prompt))


async def probe_pairs(ctx: Context, server: Server, result: ProbeResult) -> None:
    """Each probe prompt twice, back to back: served by an lmprefetch tier (vLLM's prefix
    cache does not hold it on this server), then by vLLM's prefix cache (which the first
    request filled).  Each pair ran on one server within a second, so the machine's load
    affects both alike."""
    for prompt in ctx.probe_prompts:
        result.tier_hit.append(await _observe(ctx, server, prompt))
        result.apc_hit.append(await _observe(ctx, server, prompt))


async def probe_cpu(ctx: Context, server: Server) -> ProbeResult:
    """Each probe prompt cold, then ``probe_repeats`` pairs: empty vLLM's prefix cache (the
    connector's tiers keep everything), then the prompt from lmprefetch's CPU tier, then
    from vLLM's prefix cache."""
    result = ProbeResult("cpu")
    await probe_cold(ctx, server, result)
    for _ in range(ctx.opts.probe_repeats):
        for prompt in ctx.probe_prompts:
            await reset_prefix_cache(server.client)
            result.tier_hit.append(await _observe(ctx, server, prompt))
            result.apc_hit.append(await _observe(ctx, server, prompt))
    return result


async def warm_up(ctx: Context, server: Server) -> None:
    """One short request that nothing caches, so that a freshly started server's first-run
    costs do not land on a measured request."""
    prompt = [3 + (i * 7919) % (ctx.opts.vocab - 3) for i in range(2 * ctx.opts.chunk_size)]
    await send_request(ctx, server, prompt, 1)
