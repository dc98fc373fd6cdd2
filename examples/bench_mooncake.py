"""Mooncake-tier hits through the engine, beside Mooncake's own ``batch_get_into`` of the same
bytes, in the same run.

Starts ``mooncake_master`` and a standalone store process (``mooncake_client``, which holds the
pool) on loopback, in a private network namespace (it re-runs itself under ``python -m
lmprefetch.bench.netns`` when needed: Mooncake's clients listen on every interface).  An engine
with the Mooncake tier (contributing no memory: the standalone-store deployment) stores
``--chunks`` chunks of ``--chunk-bytes``; then, interleaved, ``--rounds`` times:

* **engine hit**: ``--repeat`` lookups of the prompt whose chunks only Mooncake holds (the
  engine's CPU tier forgets them before each one): probe (``batch_is_exist``), load straight
  into arena buffers (``batch_get_into``), answer, claim, release; timed from the lookup's
  start to the release;
* **direct get**: ``--repeat`` calls of ``batch_get_into`` of the same objects into a
  registered buffer by a plain Mooncake client in this process: the transfer alone, the peer
  figure.

It prints the medians, GB/s, the ratio engine / direct and the load average before and after
(timings on a busy machine are not conclusions)::

    python examples/bench_mooncake.py                      # 16 x 2 MiB, 20 lookups x 3 rounds
    python examples/bench_mooncake.py --chunks 4 --chunk-bytes 65536 --repeat 3 --rounds 1
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from statistics import median
from typing import Any

import trio

from lmprefetch import PrefetchConfig, open_engine
from lmprefetch.bench.netns import bring_loopback_up, loopback_only, unshare_argv
from lmprefetch.tiers.mooncake import MooncakeTier, mooncake_key

MiB = 1024 * 1024
#: Mooncake's own timeouts for this run (the tier would set them from mooncake_timeout_s).
os.environ.setdefault("MC_RPC_TIMEOUT_MS", "10000")
os.environ.setdefault("MC_TCP_PROGRESS_TIMEOUT_SEC", "10")


def _program(name: str) -> str:
    found = shutil.which(name) or str(Path(sys.executable).with_name(name))
    if not Path(found).is_file():
        sys.exit(f"{name} is not installed: python -m pip install 'lmprefetch[mooncake]'")
    return found


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextmanager
def _process(argv: list[str], ready: str, workdir: str) -> Iterator[subprocess.Popen[bytes]]:
    """Run ``argv`` with its output in a file; yield once the output holds ``ready``."""
    log_path = Path(workdir) / f"{Path(argv[0]).name}-{_free_port()}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 60
        while ready.encode() not in log_path.read_bytes():
            if proc.poll() is not None or time.monotonic() > deadline:
                sys.exit(f"{argv[0]} did not start:\n{log_path.read_text(errors='replace')}")
            time.sleep(0.02)  # a start-up wait on a file (this is a benchmark script)
        yield proc
    finally:
        proc.kill()
        proc.wait()


@contextmanager
def _mooncake(pool_bytes: int, workdir: str) -> Iterator[str]:
    """A master and a standalone store holding ``pool_bytes``; yields the master's address."""
    port = _free_port()
    master = [_program("mooncake_master"), "--rpc_address=127.0.0.1", f"--rpc_port={port}",
              "--metrics_host=127.0.0.1", f"--metrics_port={_free_port()}"]  # fmt: skip
    with _process(master, "Master admin server started", workdir):
        deadline = time.monotonic() + 60
        while True:  # its RPC service starts just after that line
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    sys.exit("mooncake_master does not accept connections")
                time.sleep(0.01)
        store = [_program("mooncake_client"), f"--global_segment_size={pool_bytes // MiB}MB",
                 "--host=127.0.0.1", f"--port={_free_port()}",
                 f"--master_server_address=127.0.0.1:{port}", "--metadata_server=P2PHANDSHAKE",
                 "--protocol=tcp"]  # fmt: skip
        with _process(store, "Starting real client service", workdir):
            yield f"127.0.0.1:{port}"


class DirectClient:
    """A plain Mooncake client with a registered buffer: ``batch_get_into`` and nothing else."""

    def __init__(self, master: str, nbytes: int) -> None:
        from mooncake.store import MooncakeDistributedStore

        self.store = MooncakeDistributedStore()
        rc = self.store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 0, "tcp", "", master)
        if rc != 0:
            sys.exit(f"a direct Mooncake client could not be set up ({rc})")
        self.buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self.buffer))
        self.buffer[:] = b"\0" * nbytes  # fault it in, as the engine pre-faults its arena
        assert self.store.register_buffer(self.address, nbytes) == 0

    def get(self, names: list[str], chunk_bytes: int) -> float:
        """Seconds for one ``batch_get_into`` of ``names``."""
        addresses = [self.address + i * chunk_bytes for i in range(len(names))]
        start = time.perf_counter()
        got = self.store.batch_get_into(names, addresses, [chunk_bytes] * len(names))
        elapsed = time.perf_counter() - start
        assert list(got) == [chunk_bytes] * len(names), got
        return elapsed

    def close(self) -> None:
        self.store.unregister_buffer(self.address)
        self.store.close()


async def _run(master: str, args: argparse.Namespace) -> dict[str, Any]:
    chunks, chunk_bytes, chunk_tokens = args.chunks, args.chunk_bytes, 256
    config = PrefetchConfig(
        chunk_size=chunk_tokens,
        chunk_bytes=chunk_bytes,
        cpu_bytes=4 * chunks * chunk_bytes,
        arena_prefault_bytes=4 * chunks * chunk_bytes,
        mooncake_master=master,
        mooncake_segment_bytes=0,  # the standalone store holds the pool
        mooncake_timeout_s=10.0,
        lookup_timeout_s=60.0,
        tier_timeout_s=60.0,
    )
    tokens = list(range(chunks * chunk_tokens))
    payloads = [bytes([i % 251]) * chunk_bytes for i in range(chunks)]
    engine_s: list[float] = []
    direct_s: list[float] = []
    async with open_engine(config) as engine:
        tier = next(t for t in engine.tiers if isinstance(t, MooncakeTier))
        await tier.wait_connected()
        assert await engine.store(tokens, payloads) == chunks
        await engine.flush()
        assert tier.stats.chunks_stored == chunks, tier.stats.statistics()
        hashes = engine.hasher.hash(tokens)
        keys = engine.keys.keys(hashes)
        names = [mooncake_key(k) for k in keys]
        direct = await trio.to_thread.run_sync(DirectClient, master, chunks * chunk_bytes)
        try:

            async def engine_hit(i: int) -> float:
                for key in keys:  # only Mooncake holds them now
                    engine.cpu.discard(key)
                start = trio.current_time()
                hit = await engine.lookup_and_prefetch(f"b{i}", hashes, [chunk_tokens] * chunks)
                with engine.claim(f"b{i}") as claimed:
                    n = len(claimed)
                elapsed = trio.current_time() - start
                assert hit == chunks * chunk_tokens and n == chunks, (hit, n)
                return elapsed

            await engine_hit(-1)  # warm up: connections to the store's segment
            await trio.to_thread.run_sync(direct.get, names, chunk_bytes)
            i = 0
            for _ in range(args.rounds):  # interleaved, so drift on a shared machine hits both
                for _ in range(args.repeat):
                    engine_s.append(await engine_hit(i))
                    i += 1
                for _ in range(args.repeat):
                    direct_s.append(await trio.to_thread.run_sync(direct.get, names, chunk_bytes))
        finally:
            await trio.to_thread.run_sync(direct.close)
        assert engine.is_idle()
    moved = chunks * chunk_bytes
    return {
        "chunks": chunks,
        "chunk_bytes": chunk_bytes,
        "engine_hit_ms": median(engine_s) * 1e3,
        "engine_gbps": moved / median(engine_s) / 1e9,
        "direct_get_ms": median(direct_s) * 1e3,
        "direct_gbps": moved / median(direct_s) / 1e9,
        "ratio": median(engine_s) / median(direct_s),
        "samples": len(engine_s),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunks", type=int, default=16)
    parser.add_argument("--chunk-bytes", type=int, default=2 * MiB)
    parser.add_argument("--repeat", type=int, default=20, help="lookups per round and kind")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, help="write the figures as JSON here")
    args = parser.parse_args(argv)
    if not loopback_only():
        wrapped = unshare_argv([sys.executable, *sys.argv])
        if wrapped is None:
            sys.exit("unshare is not installed: cannot make a private network namespace")
        return subprocess.run(wrapped, check=False).returncode
    bring_loopback_up()
    load_before = os.getloadavg()
    pool = max(64 * MiB, 2 * args.chunks * args.chunk_bytes + 32 * MiB)
    with tempfile.TemporaryDirectory() as workdir, _mooncake(pool, workdir) as master:
        fig = trio.run(_run, master, args)
    fig["load_average"] = {"before": load_before, "after": os.getloadavg()}
    size = f"{args.chunks} chunks x {args.chunk_bytes / MiB:g} MiB"
    print(f"Mooncake over loopback TCP, standalone store, {size}, "
          f"{args.repeat} x {args.rounds} of each, medians:")  # fmt: skip
    print(f"  engine hit (probe + get-into + claim)  {fig['engine_hit_ms']:8.2f} ms  "
          f"{fig['engine_gbps']:6.2f} GB/s")  # fmt: skip
    print(f"  direct batch_get_into, same bytes      {fig['direct_get_ms']:8.2f} ms  "
          f"{fig['direct_gbps']:6.2f} GB/s")  # fmt: skip
    print(f"  ratio engine / direct: {fig['ratio']:.2f}   load average before "
          f"{load_before[0]:.2f}, after {fig['load_average']['after'][0]:.2f}")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(fig, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
