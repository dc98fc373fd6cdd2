"""The shared stores of bench-serve's ``shared_redis`` and ``shared_mooncake`` scenarios.

Each store runs as a process of the scenario on loopback; the scenario waits until the chunks
it needs have landed there (lmprefetch writes to both behind the request), asking the store
under the names lmprefetch's tiers give the chunks.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

import trio

from ...keys import ChunkKey
from .procs import ManagedProcess, ProcessSet, free_port
from .servers import SERVED_MODEL, Context, ScenarioUnavailable, kv_dtype

__all__ = ["chunk_keys", "start_mooncake", "start_redis", "wait_in_mooncake", "wait_in_redis"]


async def start_redis(procs: ProcessSet, ctx: Context, tmp: Path) -> str:
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


async def wait_in_redis(
    ctx: Context, redis_url: str, prompts: Sequence[Sequence[int]] | None = None
) -> bool:
    """Wait (at most 60 s) until every whole chunk of the probe prompts (or of ``prompts``)
    is in Redis, under the keys lmprefetch's Redis tier gives them (model and dtype are set in
    the connector's configuration, see :func:`.servers.lmprefetch_kv_config`); whether they
    all are."""
    import redis

    from ...tiers.redis import redis_key

    names = [redis_key(key) for key in chunk_keys(ctx, prompts)]
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


def chunk_keys(ctx: Context, prompts: Sequence[Sequence[int]] | None = None) -> list[ChunkKey]:
    """The keys of every whole chunk of the probe prompts (or of ``prompts``), as lmprefetch's
    tiers name them (model and dtype are set in the connector's configuration, see
    :func:`.servers.lmprefetch_kv_config`)."""
    from ...hashing import ChunkHasher

    opts = ctx.opts
    hasher = ChunkHasher(opts.chunk_size)
    return [
        ChunkKey(SERVED_MODEL, 1, 0, h, kv_dtype(opts))
        for prompt in (ctx.probe_prompts if prompts is None else prompts)
        for h in hasher.hash(list(prompt))
    ]


def _mooncake_master_binary() -> str | None:
    """``mooncake_master`` on ``PATH``, or beside this Python (the package installs it there)."""
    found = shutil.which("mooncake_master")
    beside = Path(sys.executable).with_name("mooncake_master")
    return found or (str(beside) if beside.is_file() else None)


async def start_mooncake(procs: ProcessSet, ctx: Context) -> str:
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


async def wait_in_mooncake(ctx: Context, master: str) -> None:
    """Wait (at most 60 s) until every whole chunk of the probe prompts is in Mooncake, asking
    as a client of its own that gives the pool nothing."""
    from mooncake.store import MooncakeDistributedStore

    from ...tiers.mooncake import mooncake_key

    names = [mooncake_key(key) for key in chunk_keys(ctx)]
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
