"""Running bench-serve: options, scenarios, servers, rounds and probes.

One scenario at a time (they would disturb each other's timings): start its servers, replay
both workloads round by round (long-document QA round ``r``, then chat round ``r``), run the
same-prompt probes, stop everything.  The results are plain dicts; :mod:`.report` turns them
into the table, the JSON and the figure.

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
import importlib.util
import json
import math
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import trio

from ...keys import ChunkKey
from .client import (
    TIMINGS,
    Completion,
    RequestFailed,
    complete,
    metrics_delta,
    reset_prefix_cache,
    scrape_metrics,
)
from .hybrid_models import sliding_window_variant
from .model import kv_bytes_per_token, serving_flags, write_model
from .options import SCENARIOS, Scenario, ServeBenchOptions
from .procs import ManagedProcess, ProcessSet, ServerError, free_port
from .workloads import Request, chat_rounds, long_doc_rounds, probe_prompts

__all__ = [
    "Context",
    "ProbeResult",
    "Server",
    "WorkloadStats",
    "base_env",
    "private_dirs",
    "run_bench_serve",
    "server_argv",
]

GiB = 1 << 30
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_SERVED_MODEL = "bench"


# -- progress ------------------------------------------------------------------------------
class Progress:
    """A one-line progress bar on stderr (only on a terminal)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled and sys.stderr.isatty()
        self.label = ""
        self.total = 0
        self.done = 0
        self.note = ""

    def begin(self, label: str, total: int) -> None:
        self.label, self.total, self.done, self.note = label, total, 0, ""
        self._draw()

    def status(self, note: str) -> None:
        self.note = note
        self._draw()

    def step(self, n: int = 1) -> None:
        self.done += n
        self._draw()

    def end(self) -> None:
        if self.enabled:
            sys.stderr.write("\r\x1b[2K")
            sys.stderr.flush()

    def _draw(self) -> None:
        if not self.enabled:
            return
        frac = self.done / max(1, self.total)
        bar = "#" * int(frac * 24)
        sys.stderr.write(
            f"\r\x1b[2K{self.label:<24} [{bar:<24}] {self.done:>4}/{self.total:<4} {self.note}"
        )
        sys.stderr.flush()


# -- servers ------------------------------------------------------------------------------
@dataclass
class Server:
    """A running vLLM server and its HTTP client."""

    proc: ManagedProcess
    port: int
    client: httpx.AsyncClient
    startup_s: float


@dataclass
class Context:
    """What every scenario shares: options, the temporary directory, the plan."""

    opts: ServeBenchOptions
    tmp: Path
    runtime_dir: Path
    model_dir: Path
    long_doc: list[list[Request]]
    chat: list[list[Request]]
    probe_prompts: list[tuple[int, ...]]
    progress: Progress


def base_env(tmp: Path) -> dict[str, str]:
    """The environment of every server: the CPU platform, offline, loopback only, and every
    temporary file inside ``tmp`` (vLLM's ipc sockets and caches included: keep its path
    short, see :func:`private_dirs`)."""
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    env.update(
        VLLM_TARGET_DEVICE="cpu",
        HF_HUB_OFFLINE="1",
        VLLM_HOST_IP="127.0.0.1",
        VLLM_SERVER_DEV_MODE="1",  # POST /reset_prefix_cache, for the probes
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        TMPDIR=str(tmp),
        VLLM_RPC_BASE_PATH=str(tmp),
        VLLM_CACHE_ROOT=str(tmp / "vllm-cache"),
        VLLM_CONFIG_ROOT=str(tmp / "vllm-config"),
    )
    return env


def lmprefetch_kv_config(
    opts: ServeBenchOptions,
    disk_path: Path | None = None,
    redis_url: str | None = None,
    mooncake_master: str | None = None,
) -> dict[str, Any]:
    """The ``--kv-transfer-config`` for lmprefetch's connector."""
    extra: dict[str, Any] = {
        "chunk_size": opts.chunk_size,
        "cpu_bytes": opts.cpu_bytes,
        # Fixed (not derived from the model path and the KV tensors), so that the benchmark
        # can name the keys the Redis tier stores.
        "model_name": _SERVED_MODEL,
        "kv_dtype": _kv_dtype(opts),
    }
    if disk_path is not None:
        extra["disk_path"] = str(disk_path)
    if redis_url is not None:
        extra["redis_url"] = redis_url
    if mooncake_master is not None:
        extra.update(mooncake_master=mooncake_master, mooncake_segment_bytes=MOONCAKE_SEGMENT_BYTES)
    return {
        "kv_connector": "LMPrefetchConnector",
        "kv_connector_module_path": "lmprefetch.integration.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }


def server_argv(
    python: str,
    model_dir: Path,
    port: int,
    *,
    max_model_len: int,
    block_size: int,
    kv_pool_bytes: int,
    prefix_caching: bool,
    kv_transfer_config: dict[str, Any] | None,
    load_format: str | None = None,
) -> list[str]:
    """The command that starts one vLLM OpenAI server (the CPU build's CLI: ``vllm serve``
    looks up a distribution named ``vllm``, which ``vllm-cpu`` is not).  ``load_format``
    (default: from the directory, :func:`.model.serving_flags`) ``dummy``: random weights from
    the ``config.json`` alone."""
    flags = serving_flags(model_dir)
    if load_format is not None:
        flags[1] = load_format
    argv = [
        python, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir), "--served-model-name", _SERVED_MODEL,
        "--host", "127.0.0.1", "--port", str(port),
        *flags, "--skip-tokenizer-init",
        "--enforce-eager", "--seed", "0",
        "--max-model-len", str(max_model_len), "--block-size", str(block_size),
        "--kv-cache-memory-bytes", str(kv_pool_bytes),
        "--enable-prompt-tokens-details", "--disable-uvicorn-access-log",
        "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching",
    ]  # fmt: skip
    if kv_transfer_config is not None:
        argv += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
    return argv


async def start_server(
    procs: ProcessSet,
    ctx: Context,
    name: str,
    *,
    prefix_caching: bool,
    kv_transfer_config: dict[str, Any] | None,
    python: str | None = None,
    extra_env: dict[str, str] | None = None,
) -> Server:
    """Start one vLLM server on a free loopback port and wait until it serves."""
    opts = ctx.opts
    port = free_port()
    argv = server_argv(
        python or opts.python,
        ctx.model_dir,
        port,
        max_model_len=opts.max_model_len(),
        block_size=opts.block_size,
        kv_pool_bytes=opts.kv_pool_bytes,
        prefix_caching=prefix_caching,
        kv_transfer_config=kv_transfer_config,
    )
    env = base_env(ctx.runtime_dir)
    env.update(extra_env or {})
    proc = ManagedProcess(name, argv, env, "Application startup complete", cwd=ctx.tmp)
    t0 = time.perf_counter()
    await procs.start(proc, opts.startup_timeout_s)
    client = httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{port}",
        timeout=httpx.Timeout(opts.request_timeout_s, connect=30.0),
        trust_env=False,  # loopback: never through a proxy from the environment
    )
    return Server(proc, port, client, time.perf_counter() - t0)


async def stop_server(procs: ProcessSet, server: Server) -> None:
    await server.client.aclose()
    await procs.stop(server.proc)


# -- measuring -------------------------------------------------------------------------------
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

    def add_metrics(self, delta: dict[str, float]) -> None:
        for k, v in delta.items():
            self.metrics[k] = self.metrics.get(k, 0.0) + v


async def _send(ctx: Context, server: Server, prompt: Sequence[int], max_tokens: int) -> Completion:
    with trio.fail_after(ctx.opts.request_timeout_s):
        return await complete(server.client, _SERVED_MODEL, prompt, max_tokens)


async def run_round(
    ctx: Context,
    requests: Sequence[Request],
    servers: Sequence[Server],
    route: Callable[[Request], int],
    concurrency: int,
    stats: WorkloadStats,
) -> None:
    """Send one round's requests (``concurrency`` in flight, in order) and record them."""
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
                result = await _send(ctx, servers[route(req)], req.prompt, req.max_tokens)
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
    done = await _send(ctx, server, prompt, ctx.opts.long_doc.answer_tokens)
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
    await _send(ctx, server, prompt, 1)


# -- scenarios ------------------------------------------------------------------------------
class ScenarioUnavailable(Exception):
    """The scenario cannot run here (the reason is the message)."""


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
                return await _run_link_scenario(ctx, sc, procs, scenario_tmp)
            if sc.tier == "redis":
                redis_url = await _start_redis(procs, ctx, scenario_tmp)
            elif sc.tier == "mooncake":
                mooncake_master = await _start_mooncake(procs, ctx)
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
            outcome = {"error": f"{type(exc).__name__}: {exc}"}
        finally:
            await procs.stop_all()
    return outcome


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


async def _start_redis(procs: ProcessSet, ctx: Context, tmp: Path) -> str:
    binary = ctx.opts.redis_server or shutil.which("redis-server")
    if binary is None:
        raise ScenarioUnavailable(
            "redis-server is not installed (e.g. apt-get install redis-server, or pass "
            "--redis-server PATH)"
        )
    if importlib.util.find_spec("redis") is None:
        raise ScenarioUnavailable(
            "lmprefetch's Redis tier needs redis-py beside vLLM: pip install 'lmprefetch[redis]'"
        )
    port = free_port()
    workdir = tmp / "redis"
    workdir.mkdir()
    argv = [
        binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
        "--appendonly", "no", "--dir", str(workdir), "--protected-mode", "yes",
    ]  # fmt: skip
    proc = ManagedProcess("redis-server", argv, dict(os.environ), "Ready to accept connections")
    await procs.start(proc, 60.0)
    return f"redis://127.0.0.1:{port}"


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
            await _wait_in_redis(ctx, shared)
            await probe_pairs(ctx, servers[1], probe)
        elif sc.probe == "mooncake":
            probe = ProbeResult("mooncake")
            await probe_cold(ctx, servers[0], probe)
            assert shared is not None
            await _wait_in_mooncake(ctx, shared)
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


async def _wait_in_redis(
    ctx: Context, redis_url: str, prompts: Sequence[Sequence[int]] | None = None
) -> bool:
    """Wait (at most 60 s) until every whole chunk of the probe prompts (or of ``prompts``)
    is in Redis, under the keys lmprefetch's Redis tier gives them (model and dtype are set in
    the connector's configuration, see :func:`lmprefetch_kv_config`); whether they all are."""
    import redis

    from ...tiers.redis import redis_key

    names = [redis_key(key) for key in _probe_keys(ctx, prompts)]
    found = False
    client = redis.Redis.from_url(redis_url)
    try:
        with trio.move_on_after(60.0):
            while True:
                if await trio.to_thread.run_sync(client.exists, *names) == len(names):
                    found = True
                    break
                await trio.sleep(0.05)
    finally:
        await trio.to_thread.run_sync(client.close)
    return found


#: Memory each server gives the Mooncake pool (the chunks it stores live there).
MOONCAKE_SEGMENT_BYTES = 512 << 20


def _probe_keys(ctx: Context, prompts: Sequence[Sequence[int]] | None = None) -> list[ChunkKey]:
    """The keys of every whole chunk of the probe prompts (or of ``prompts``), as lmprefetch's
    tiers name them (model and dtype are set in the connector's configuration, see
    :func:`lmprefetch_kv_config`)."""
    from ...hashing import ChunkHasher

    opts = ctx.opts
    hasher = ChunkHasher(opts.chunk_size)
    return [
        ChunkKey(_SERVED_MODEL, 1, 0, h, _kv_dtype(opts))
        for prompt in (ctx.probe_prompts if prompts is None else prompts)
        for h in hasher.hash(list(prompt))
    ]


def _mooncake_master_binary() -> str | None:
    """``mooncake_master`` on ``PATH``, or beside this Python (the package installs it there)."""
    found = shutil.which("mooncake_master")
    beside = Path(sys.executable).with_name("mooncake_master")
    return found or (str(beside) if beside.is_file() else None)


async def _start_mooncake(procs: ProcessSet, ctx: Context) -> str:
    """Start ``mooncake_master`` on loopback; returns its address.  Mooncake's clients (the
    servers' workers) listen on every interface, so the scenario runs only where this process
    sees no interface but loopback (a private network namespace)."""
    from ..netns import loopback_only

    if importlib.util.find_spec("mooncake") is None:
        raise ScenarioUnavailable(
            "lmprefetch's Mooncake tier needs Mooncake beside vLLM: "
            "pip install 'lmprefetch[mooncake]' (and apt-get install libibverbs1)"
        )
    binary = _mooncake_master_binary()
    if binary is None:
        raise ScenarioUnavailable(
            "mooncake_master is not installed (pip install 'lmprefetch[mooncake]')"
        )
    if not loopback_only():
        raise ScenarioUnavailable(
            "Mooncake's clients listen on every network interface; run bench-serve in a "
            "private network namespace for this scenario: python -m lmprefetch.bench.netns "
            "lmprefetch bench-serve --scenarios shared_mooncake"
        )
    port, metrics_port = free_port(), free_port()
    argv = [
        binary, "--rpc_address=127.0.0.1", f"--rpc_port={port}",
        "--metrics_host=127.0.0.1", f"--metrics_port={metrics_port}",
    ]  # fmt: skip
    proc = ManagedProcess("mooncake_master", argv, dict(os.environ), "Master admin server started")
    await procs.start(proc, 60.0)
    # Its RPC service starts just after that line: wait until it accepts.
    with trio.fail_after(60.0):
        while True:
            try:
                stream = await trio.open_tcp_stream("127.0.0.1", port)
            except OSError:
                await trio.sleep(0.01)
                continue
            await stream.aclose()
            break
    return f"127.0.0.1:{port}"


async def _wait_in_mooncake(ctx: Context, master: str) -> None:
    """Wait (at most 60 s) until every whole chunk of the probe prompts is in Mooncake, asking
    as a client of its own that gives the pool nothing."""
    from mooncake.store import MooncakeDistributedStore

    from ...tiers.mooncake import mooncake_key

    names = [mooncake_key(key) for key in _probe_keys(ctx)]
    client = MooncakeDistributedStore()
    rc = await trio.to_thread.run_sync(
        client.setup, "127.0.0.1", "P2PHANDSHAKE", 0, 0, "tcp", "", master
    )
    if rc != 0:
        raise ScenarioUnavailable(f"a Mooncake client could not be set up ({rc})")
    try:
        with trio.move_on_after(60.0):
            while True:
                found = await trio.to_thread.run_sync(client.batch_is_exist, names)
                if list(found) == [1] * len(names):
                    break
                await trio.sleep(0.05)
    finally:
        await trio.to_thread.run_sync(client.close)


def _kv_dtype(opts: ServeBenchOptions) -> str:
    return str(opts.model.get("torch_dtype", "float32"))


# -- the Redis link scenarios -----------------------------------------------------------------
#: A lookup, a tier operation and a Redis call on the measured server of a link scenario may
#: take this long: "always" must load every hit, however slow the link, not give up and
#: recompute (the policy under test decides that, not a deadline).
_LINK_TIMEOUTS = {"lookup_timeout_s": 120.0, "tier_timeout_s": 120.0, "redis_timeout_s": 60.0}


def has_load_policy() -> bool:
    """Whether this lmprefetch has the ``load_policy`` setting (the servers run this code)."""
    from ...config import PrefetchConfig

    return "load_policy" in PrefetchConfig().to_dict()


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


async def _run_link_scenario(
    ctx: Context, sc: Scenario, procs: ProcessSet, scenario_tmp: Path
) -> dict[str, Any]:
    """A Redis link scenario (:class:`.options.Scenario` ``link``): a first server computes
    every document once (long-document QA round 0) and so fills Redis, over loopback; once
    Redis holds every chunk it stops, the link is set up, and a second server (its own
    ``load_policy``, a CPU tier too small to keep a document until it comes back, no disk)
    serves the measured rounds, reading Redis through the link.  Chat and probes are not
    run."""
    opts = ctx.opts
    policy = sc.load_policy or "always"
    supported = await trio.to_thread.run_sync(has_load_policy)
    if policy != "always" and not supported:
        raise ScenarioUnavailable(
            f"this lmprefetch has no load_policy setting, so load_policy {policy!r} cannot be "
            "set (issue 20's policy)"
        )
    redis_url = await _start_redis(procs, ctx, scenario_tmp)
    redis_port = int(redis_url.rsplit(":", 1)[1])
    # At least 3 measured rounds (the same documents, more questions): cheap here, and the
    # p50s of the goals come from these alone.
    rounds = long_doc_rounds(
        opts.long_doc, max(opts.rounds, 4), opts.vocab, opts.seed, opts.prompt_corpus
    )
    ctx.progress.begin(sc.name, sum(len(r) for r in rounds))
    startups: list[float] = []
    async with contextlib.AsyncExitStack() as stack:
        ctx.progress.status("filling Redis")
        warm = await start_server(
            procs,
            ctx,
            f"{sc.name} server filling Redis",
            prefix_caching=True,
            kv_transfer_config=lmprefetch_kv_config(opts, redis_url=redis_url),
        )
        startups.append(warm.startup_s)
        await run_round(ctx, rounds[0], [warm], lambda _: 0, 1, WorkloadStats())
        docs = [req.prompt for req in rounds[0]]
        if not await _wait_in_redis(ctx, redis_url, docs):
            raise ServerError("the documents' chunks did not all reach Redis within 60 s")
        await stop_server(procs, warm)

        port, link = await _open_link(procs, ctx, sc, redis_port, stack)
        from ...tiers.redis import redis_key

        first_chunk = redis_key(_probe_keys(ctx, docs[:1])[0])
        link["measured"] = await trio.to_thread.run_sync(
            _time_link, f"redis://127.0.0.1:{port}", first_chunk
        )
        kv_config = lmprefetch_kv_config(opts, redis_url=f"redis://127.0.0.1:{port}")
        extra = kv_config["kv_connector_extra_config"]
        extra.update(_LINK_TIMEOUTS, cpu_bytes=link_cpu_bytes(opts))
        if supported:
            extra["load_policy"] = policy
        ctx.progress.status("starting the measured server")
        server = await start_server(
            procs, ctx, f"{sc.name} server", prefix_caching=True, kv_transfer_config=kv_config
        )
        startups.append(server.startup_s)
        ctx.progress.status("")
        try:
            # First-run costs off the measured requests, and the engine's prefill measured at
            # a document's length (the cost policy's input): two fresh documents, computed.
            # Their chunks are stored to Redis through the link; wait until they are there, so
            # their writes do not share the link with the first measured loads.
            fresh = probe_prompts(
                2, opts.long_doc.doc_tokens, opts.vocab, opts.seed + 1, opts.prompt_corpus
            )
            await warm_up(ctx, server)
            for prompt in fresh:
                await _send(ctx, server, prompt, 1)
            await _wait_in_redis(ctx, redis_url, fresh)
            stats = WorkloadStats()
            sent_before = await trio.to_thread.run_sync(_redis_sent_bytes, redis_url)
            for requests in rounds[1:]:
                await run_round(ctx, requests, [server], lambda _: 0, 1, stats)
            sent = await trio.to_thread.run_sync(_redis_sent_bytes, redis_url) - sent_before
        finally:
            await server.client.aclose()
            ctx.progress.end()
    return {
        "long_doc_qa": stats,
        "chat": None,
        "startup_s": startups,
        "link": link,
        "load_policy": policy,
        "load_policy_set": supported,
        "lmprefetch_cpu_bytes": link_cpu_bytes(opts),
        "redis_sent_bytes": sent,
    }


# -- the whole run ---------------------------------------------------------------------------
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
    }


#: Unix socket paths are limited to 107 bytes, and vLLM names its ipc sockets with 36-character
#: ids in its temporary directory: the servers' temporary directory must have a short path.
_MAX_RUNTIME_DIR_CHARS = 60


@contextlib.asynccontextmanager
async def private_dirs() -> AsyncIterator[tuple[Path, Path]]:
    """Two private temporary directories, removed at the end whatever happens: one for the
    run's files (model, disk tier, Redis), under ``TMPDIR``; one for the servers' own
    temporary files and sockets, inside the first, or in ``/tmp`` when the first one's path
    is too long for a socket path."""
    tmp = Path(tempfile.mkdtemp(prefix="lmprefetch-bench-serve-"))
    runtime = tmp / "rt"
    if len(str(runtime)) > _MAX_RUNTIME_DIR_CHARS:
        runtime = Path(tempfile.mkdtemp(prefix="lmpbs-", dir="/tmp"))
    runtime.mkdir(exist_ok=True)
    try:
        yield tmp, runtime
    finally:
        with trio.CancelScope(shield=True):
            for path in (runtime, tmp):
                await trio.to_thread.run_sync(partial(shutil.rmtree, path, ignore_errors=True))


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
        for sc in SCENARIOS:
            if sc.name not in opts.scenarios:
                continue
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
