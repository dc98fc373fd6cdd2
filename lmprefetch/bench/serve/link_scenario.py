"""bench-serve's Redis link scenarios (``slow_remote_*``, ``fast_remote_*``).

A first server fills Redis over loopback; a second one, with the load policy under test and a
CPU tier too small to keep a document, reads every hit through the link (:mod:`.link` shapes
the slow one).  The link as a client sees it is measured before the server uses it.  Side by
side, the second server runs several scenarios' policies, each request naming its own.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import trio

from .model import kv_bytes_per_token
from .options import Scenario, ServeBenchOptions
from .procs import ManagedProcess, ProcessSet, ServerError, free_port
from .rounds import WorkloadStats, run_round, send_request, warm_up
from .servers import (
    Context,
    ScenarioUnavailable,
    lmprefetch_kv_config,
    start_server,
    stop_server,
)
from .stores import chunk_keys, start_redis, wait_in_redis
from .workloads import long_doc_rounds, probe_prompts

__all__ = ["has_load_policy", "link_cpu_bytes", "run_link_scenario", "run_link_scenarios"]


#: A lookup, a tier operation and a Redis call on the measured server of a link scenario may
#: take this long: "always" must load every hit, however slow the link, not give up and
#: recompute (the policy under test decides that, not a deadline).
_LINK_TIMEOUTS = {"lookup_timeout_s": 120.0, "tier_timeout_s": 120.0, "redis_timeout_s": 60.0}


#: Fresh documents each measured server computes before the measured rounds.  A server's
#: steps keep getting faster over its first dozen long prefills (measured on the 2-vCPU
#: machine, one server recomputing every question: 1,035, 936, 884, 833, 888, 785 ms, then
#: 760-820 ms), and the prefill model keeps the fastest of a size's last four steps
#: (:class:`lmprefetch.policy.PrefillModel`): with two, a server that then loads every
#: question priced recomputing at its second, cold prefill (943 ms against 790) for the
#: whole scenario.
SETTLE_DOCS = 6


def has_load_policy() -> bool:
    """Whether this lmprefetch has the ``load_policy`` setting (the servers run this code)."""
    from ...config import PrefetchConfig

    return "load_policy" in PrefetchConfig().to_dict()


def has_decision_log() -> bool:
    """Whether this lmprefetch has the ``decision_log`` setting (issue 31's trace)."""
    from ...config import PrefetchConfig

    return "decision_log" in PrefetchConfig().to_dict()


def read_decision_logs(directory: Path) -> list[dict[str, Any]]:
    """The trace records the measured server's ranks wrote (``decisions-<rank>.jsonl``), as
    plain data, ordered by wall clock (blocking: call it in a thread)."""
    import msgspec

    from ...trace import decode_records

    records: list[dict[str, Any]] = []
    for path in sorted(directory.glob("decisions-*.jsonl")):
        records.extend(msgspec.to_builtins(r) for r in decode_records(path.read_bytes()))
    records.sort(key=lambda r: float(r["wall"]))
    return records


def shared_server_policy(policies: Sequence[str]) -> str:
    """The ``load_policy`` configured on the one measured server of link scenarios side by
    side, whose requests each name their own: ``cost`` when one of them runs it (the policy
    then keeps its state across its requests, as on a server of its own), else the first
    that loads (a server configured ``never`` sends no lookups, whatever a request says).

    Raises:
        ScenarioUnavailable: a policy is not a built-in one (only those can be named per
            request).
    """
    from ...policy import BUILTIN_POLICIES

    for policy in policies:
        if policy not in BUILTIN_POLICIES:
            raise ScenarioUnavailable(
                f"side by side, every policy goes with the requests, and only the built-in "
                f"ones {BUILTIN_POLICIES} can: not {policy!r}"
            )
    if "cost" in policies:
        return "cost"
    return next((p for p in policies if p != "never"), "never")


def link_cpu_bytes(opts: ServeBenchOptions) -> int:
    """The measured server's CPU tier (all of lmprefetch's host memory) in a link scenario:
    twice one request's load (every whole chunk of a document, and one more), since a lookup
    may hold at most half the arena (the prefetch limiter); that is less than three
    documents, so with four or more a document is evicted before it comes back (every other
    document passes in between) and every hit is read from Redis."""
    chunk_bytes = opts.chunk_size * kv_bytes_per_token(opts.model)
    chunks = opts.long_doc.doc_tokens // opts.chunk_size + 1
    return 2 * chunks * chunk_bytes


def _redis_sent_bytes(redis_url: str) -> int:
    """Redis's ``total_net_output_bytes`` (blocking: call it in a thread)."""
    import redis

    client = redis.Redis.from_url(redis_url)
    try:
        return int(client.info("stats")["total_net_output_bytes"])
    finally:
        client.close()


def _time_link(redis_url: str, name: bytes, repeats: int = 3) -> dict[str, float]:
    """The link as a client sees it, measured before the server uses it: the best of a few
    ``PING`` round trips and ``GET`` of one chunk (blocking: call it in a thread)."""
    import redis

    client = redis.Redis.from_url(redis_url)
    try:
        ping, get, size = math.inf, math.inf, 0
        for _ in range(repeats):
            t0 = time.perf_counter()
            client.ping()
            ping = min(ping, time.perf_counter() - t0)
            t0 = time.perf_counter()
            value = client.get(name)
            get = min(get, time.perf_counter() - t0)
            size = len(value) if isinstance(value, bytes) else 0
        return {"ping_ms": ping * 1e3, "chunk_get_ms": get * 1e3, "chunk_bytes": size}
    finally:
        client.close()


async def _open_link(
    procs: ProcessSet, ctx: Context, sc: Scenario, redis_port: int, stack: contextlib.AsyncExitStack
) -> tuple[int, dict[str, Any]]:
    """The port the measured server reads Redis through, and what the link is (for the
    report): Redis's own port for the fast link; for the slow one, the port ``tc`` shapes,
    Redis's own with ``netem``, else a :class:`.link.DelayProxy`'s in front of it."""
    from ..netns import loopback_only
    from .link import PROXY_READY, LinkSpec, Shaper

    if sc.link == "fast":
        return redis_port, {"kind": "fast", "mechanism": "none (loopback, unthrottled)"}
    opts = ctx.opts
    spec = LinkSpec(opts.slow_link_rate, opts.slow_link_delay_s)
    if not loopback_only():
        raise ScenarioUnavailable(
            "the slow link is shaped with tc on the loopback interface of a private network "
            "namespace; bench-serve enters one itself where unshare is allowed (here it did "
            "not: run it as root, or where user namespaces are allowed)"
        )
    shaper = Shaper()
    netem, why = await trio.to_thread.run_sync(shaper.netem_available)
    port = redis_port
    if not netem:
        port = free_port()
        argv = [
            sys.executable, "-m", "lmprefetch.bench.serve.link", "proxy",
            "--listen", str(port), "--target", str(redis_port),
            "--delay-ms", f"{spec.delay_s * 1e3:g}",
        ]  # fmt: skip
        proxy = ManagedProcess("delay proxy", argv, dict(os.environ), PROXY_READY)
        await procs.start(proxy, 60.0)
    try:
        await trio.to_thread.run_sync(partial(shaper.install, port, spec, netem=netem))
    except OSError as exc:
        raise ScenarioUnavailable(f"tc cannot shape the loopback interface here: {exc}") from None

    async def remove() -> None:
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(shaper.remove)

    stack.push_async_callback(remove)
    info: dict[str, Any] = {
        "kind": "slow",
        "mechanism": "netem" if netem else "htb+proxy",
        "rate_bytes_per_s": spec.rate_bytes_per_s,
        "delay_ms": spec.delay_s * 1e3,
        "shaped_port": port,
        "redis_port": redis_port,
    }
    if not netem:
        info["netem_unavailable"] = why
    return port, info


async def run_link_scenario(
    ctx: Context, sc: Scenario, procs: ProcessSet, scenario_tmp: Path
) -> dict[str, Any]:
    """A Redis link scenario (:class:`.options.Scenario` ``link``): a first server computes
    every document once (long-document QA round 0) and so fills Redis, over loopback; once
    Redis holds every chunk it stops, the link is set up, and a second server (its own
    ``load_policy``, a CPU tier too small to keep a document until it comes back, no disk)
    serves the measured rounds, reading Redis through the link.  Chat and probes are not
    run."""
    return (await run_link_scenarios(ctx, [sc], procs, scenario_tmp))[sc.name]


async def run_link_scenarios(
    ctx: Context, scenarios: Sequence[Scenario], procs: ProcessSet, scenario_tmp: Path
) -> dict[str, dict[str, Any]]:
    """Link scenarios of one link and codec side by side (``--side-by-side``): Redis is
    filled once and the link set up once, as in :func:`run_link_scenario`; then **one**
    measured server serves them all, each request naming its scenario's load policy
    (lmprefetch's per-request ``load_policy``, :func:`shared_server_policy` configured) and
    saving nothing (``skip_save``: Redis holds every chunk already, and a saved document
    would stay in the CPU tier for the next policy's request of it).
    Each round goes to every scenario in turn, a block of its questions each, the first
    block's scenario changing from round to round.  Every policy then runs at the same
    process's pace, and what the machine does over minutes falls on all of them alike: two
    servers doing the same work side by side kept a 5-15 % difference for their whole life on
    the 2-vCPU machine of docs/benchmarks.md, as large as the margin of the cost policy's
    goal.  Before the next request, Redis holds every whole chunk of the last one's prompt
    (its writes are not on the link).  One scenario: :func:`run_link_scenario`.  Results by
    scenario name."""
    opts = ctx.opts
    first = scenarios[0]
    if any((sc.link, sc.codec) != (first.link, first.codec) for sc in scenarios):
        raise ValueError("side by side: link scenarios of one link and one codec only")
    policies = [sc.load_policy or "always" for sc in scenarios]
    supported = await trio.to_thread.run_sync(has_load_policy)
    for policy in policies:
        if policy != "always" and not supported:
            raise ScenarioUnavailable(
                f"this lmprefetch has no load_policy setting, so load_policy {policy!r} cannot "
                "be set (issue 20's policy)"
            )
    redis_url = await start_redis(procs, ctx, scenario_tmp)
    redis_port = int(redis_url.rsplit(":", 1)[1])
    # At least 3 measured rounds (the same documents, more questions): cheap here, and the
    # p50s of the goals come from these alone.
    rounds = long_doc_rounds(
        opts.long_doc, max(opts.rounds, 4), opts.vocab, opts.seed, opts.prompt_corpus
    )
    label = first.name if len(scenarios) == 1 else " + ".join(sc.name for sc in scenarios)
    ctx.progress.begin(label, sum(len(r) for r in rounds[1:]) * len(scenarios) + len(rounds[0]))
    startups: list[float] = []
    async with contextlib.AsyncExitStack() as stack:
        ctx.progress.status("filling Redis")
        warm_config = lmprefetch_kv_config(opts, redis_url=redis_url)
        if first.codec is not None:  # Redis holds the chunks as the codec stores them
            warm_config["kv_connector_extra_config"]["redis_codec"] = first.codec
        warm = await start_server(
            procs,
            ctx,
            f"{label} server filling Redis",
            prefix_caching=True,
            kv_transfer_config=warm_config,
        )
        startups.append(warm.startup_s)
        await run_round(ctx, rounds[0], [warm], lambda _: 0, 1, WorkloadStats())
        docs = [req.prompt for req in rounds[0]]
        if not await wait_in_redis(ctx, redis_url, docs):
            raise ServerError("the documents' chunks did not all reach Redis within 60 s")
        await stop_server(procs, warm)

        port, link = await _open_link(procs, ctx, first, redis_port, stack)
        from ...tiers.redis import redis_key

        first_chunk = redis_key(chunk_keys(ctx, docs[:1])[0])
        link["measured"] = await trio.to_thread.run_sync(
            _time_link, f"redis://127.0.0.1:{port}", first_chunk
        )
        traced = await trio.to_thread.run_sync(has_decision_log)
        # One measured server for every scenario: the scenario's own policy is its configured
        # one, several scenarios' go with each request (lmprefetch's ``load_policy`` in
        # ``kv_transfer_params``), so that they share one process's pace.
        server_policy = policies[0] if len(scenarios) == 1 else shared_server_policy(policies)
        kv_config = lmprefetch_kv_config(opts, redis_url=f"redis://127.0.0.1:{port}")
        extra = kv_config["kv_connector_extra_config"]
        extra.update(_LINK_TIMEOUTS, cpu_bytes=link_cpu_bytes(opts))
        if supported:
            extra["load_policy"] = server_policy
        if first.codec is not None:
            extra["redis_codec"] = first.codec
        log_dir = scenario_tmp / "decisions"
        log_dir.mkdir()
        if traced:
            extra["decision_log"] = str(log_dir / "decisions-{rank}.jsonl")
        ctx.progress.status(f"starting the measured server of {label}")
        server = await start_server(
            procs, ctx, f"{label} server", prefix_caching=True, kv_transfer_config=kv_config
        )
        try:
            ctx.progress.status("")
            # First-run costs off the measured requests, and the engine's prefill measured at a
            # document's length (the cost policy's input): fresh documents, computed,
            # :data:`SETTLE_DOCS` of them.  Their chunks are stored to Redis through the link;
            # wait until they are there, so their writes do not share the link with the first
            # measured loads.
            fresh = probe_prompts(
                SETTLE_DOCS, opts.long_doc.doc_tokens, opts.vocab, opts.seed + 1, opts.prompt_corpus
            )
            await warm_up(ctx, server)
            settle_ms = []
            for prompt in fresh:
                settle_ms.append((await send_request(ctx, server, prompt, 1)).ttft_s * 1e3)
            await wait_in_redis(ctx, redis_url, fresh)
            stats = [WorkloadStats() for _ in scenarios]
            sent = [0] * len(scenarios)
            n = len(scenarios)
            for r, requests in enumerate(rounds[1:]):
                # Each scenario's block of the round's questions in turn, the first block's
                # scenario changing from round to round; between two requests for the same
                # document every other document passes, as on a server of its own, so neither
                # vLLM's prefix cache nor the CPU tier holds it (see link_cpu_bytes).
                for k in [(r + j) % n for j in range(n)]:
                    # Side by side, a request names its policy and is not saved: a document
                    # one policy's request recomputed and saved would stay in the CPU tier (a
                    # load frees the arena slots it takes, so only saves evict) and serve the
                    # next policy's request of it, which must read Redis through the link.
                    params = (
                        None if n == 1 else {"load_policy": policies[k], "skip_save": True}
                    )
                    for req in requests:
                        before = await trio.to_thread.run_sync(_redis_sent_bytes, redis_url)
                        await run_round(ctx, [req], [server], lambda _: 0, 1, stats[k], params)
                        # The prompt's chunks in Redis before the next request: its writes
                        # are not on the link while the next one loads.
                        if not await wait_in_redis(ctx, redis_url, [req.prompt]):
                            raise ServerError(
                                f"{scenarios[k].name}: a prompt's chunks did not reach Redis "
                                "within 60 s"
                            )
                        after = await trio.to_thread.run_sync(_redis_sent_bytes, redis_url)
                        sent[k] += after - before
            records = (
                await trio.to_thread.run_sync(read_decision_logs, log_dir) if traced else None
            )
        finally:
            await server.client.aclose()
            ctx.progress.end()
    together = [sc.name for sc in scenarios] if len(scenarios) > 1 else None
    return {
        sc.name: {
            "long_doc_qa": stats[k],
            "chat": None,
            "startup_s": [startups[0], server.startup_s],
            "link": link,
            "load_policy": policies[k],
            "load_policy_set": supported,
            "redis_codec": sc.codec or "none",
            "lmprefetch_cpu_bytes": link_cpu_bytes(opts),
            "redis_sent_bytes": sent[k],
            # The server's whole trace (a question's records are those of its time window: one
            # request is in flight at a time).
            "trace": records,
            "settle_ms": settle_ms,
            **({"side_by_side": together, "server_load_policy": server_policy} if together else {}),
        }
        for k, sc in enumerate(scenarios)
    }
