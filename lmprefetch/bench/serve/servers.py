"""bench-serve's vLLM servers and what every scenario shares.

The options, the run's temporary directories and the workloads travel in one :class:`Context`;
each vLLM OpenAI server is started on a free loopback port by :func:`start_server` (the CPU
platform, offline, every temporary file inside the run's directory) and stopped by
:func:`stop_server`.  The connector's configuration names the chunks under a fixed model name,
so that the shared-store scenarios (:mod:`.stores`) can ask Redis or Mooncake for them.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import trio

from .model import serving_flags
from .options import ServeBenchOptions
from .procs import ManagedProcess, ProcessSet, free_port
from .workloads import Request

__all__ = [
    "MOONCAKE_SEGMENT_BYTES",
    "SERVED_MODEL",
    "Context",
    "Progress",
    "ScenarioUnavailable",
    "Server",
    "base_env",
    "kv_dtype",
    "lmprefetch_kv_config",
    "private_dirs",
    "server_argv",
    "start_server",
    "stop_server",
]

#: The model name every server serves, and the one lmprefetch's keys carry.
SERVED_MODEL = "bench"


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


def model_threads() -> int:
    """The OpenMP threads every server's model runs with (unless ``OMP_NUM_THREADS`` is set):
    one per CPU this process may use, less one for everything else (at least one).

    The servers run with ``VLLM_CPU_OMP_THREADS_BIND=nobind`` (the CPU build's own binding
    would leave no core for the model on a small machine once a connector reserves one), and
    unbound OpenMP starts a thread per CPU: on 2 vCPUs, the model's 2 threads then share the
    machine with the engine core, the connector's threads, Redis and the client, and a step
    waits at OpenMP's barriers for whichever thread was put off its core.  Measured with
    ``bench-serve --quick --side-by-side`` on the fast link scenarios: 32-token steps of
    20-330 ms (two modes, ~25 and ~250 ms, from question to question on one server) with 2
    threads, 19-43 ms with 1, and recomputing a whole document no slower (968 ms p50 against
    1,088)."""
    return max(1, len(os.sched_getaffinity(0)) - 1)


def base_env(tmp: Path) -> dict[str, str]:
    """The environment of every server: the CPU platform, offline, loopback only, the model's
    threads (:func:`model_threads`), and every temporary file inside ``tmp`` (vLLM's ipc
    sockets and caches included: keep its path short, see :func:`private_dirs`)."""
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    env.setdefault("OMP_NUM_THREADS", str(model_threads()))
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
        "model_name": SERVED_MODEL,
        "kv_dtype": kv_dtype(opts),
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
        "--model", str(model_dir), "--served-model-name", SERVED_MODEL,
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
    proc = ManagedProcess(name, argv, env, "Application startup complete", cwd=ctx.tmp, port=port)
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


class ScenarioUnavailable(Exception):
    """The scenario cannot run here (the reason is the message)."""


def kv_dtype(opts: ServeBenchOptions) -> str:
    return str(opts.model.get("torch_dtype", "float32"))


#: Memory each server gives the Mooncake pool (the chunks it stores live there).
MOONCAKE_SEGMENT_BYTES = 512 << 20


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
