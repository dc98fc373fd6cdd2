"""Remote-tier prefetch throughput over loopback, beside ``redis-benchmark`` GET throughput.

Starts its own ``redis-server`` on a free port on 127.0.0.1 (nothing persisted), stores
``--chunks`` chunks of ``--chunk-bytes`` through the tier's write-behind path, then repeats a
prefetch: probe (pipelined EXISTS, pinning), load into arena buffers (pipelined GET, checksum
verified, copied into the buffers), unpin, release.  In the same run it measures
``redis-benchmark -t get -d <value size> -P 16`` on a key holding a value of the same size, and
prints both and their ratio.

    python examples/bench_redis.py                      # 16 x 2 MiB, 20 prefetches x 3 rounds
    python examples/bench_redis.py --chunks 4 --chunk-bytes 65536 --repeat 3 --rounds 1  # quick
"""

from __future__ import annotations

import argparse
import os
import re
import selectors
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from statistics import median

import trio

try:
    import redis
    from redis.utils import HIREDIS_AVAILABLE
except ImportError:
    print(
        "bench_redis.py needs the redis extra: python -m pip install 'lmprefetch[redis]'",
        file=sys.stderr,
    )
    raise SystemExit(2) from None

from lmprefetch.keys import ChunkKey
from lmprefetch.memory import Arena
from lmprefetch.tiers.redis import HEADER_BYTES, encode_value, open_redis_tier, redis_key

MiB = 1024 * 1024


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextmanager
def redis_server(workdir: str) -> Iterator[int]:
    """A private redis-server; yields its port once it logged that it accepts connections."""
    binary = shutil.which("redis-server")
    if binary is None:
        sys.exit("redis-server is not on PATH")
    port = free_port()
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--dir", workdir, "--logfile", ""]  # fmt: skip
    proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)  # fmt: skip
    assert proc.stdout is not None
    try:
        log = b""
        deadline = time.monotonic() + 20
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout.fileno(), selectors.EVENT_READ)
            while b"Ready to accept connections" not in log:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    sys.exit(f"redis-server did not start:\n{log.decode(errors='replace')}")
                if not sel.select(remaining):
                    continue  # the deadline check ends the wait
                chunk = os.read(proc.stdout.fileno(), 65536)
                if not chunk:
                    sys.exit(f"redis-server exited:\n{log.decode(errors='replace')}")
                log += chunk
        proc.stdout.close()  # redis ignores SIGPIPE; later log lines are dropped
        yield port
    finally:
        proc.terminate()
        proc.wait()
        if not proc.stdout.closed:
            proc.stdout.close()


_printed_command: list[bool] = []


def redis_benchmark_gbps(port: int, value_bytes: int, requests: int, clients: int) -> float:
    """``redis-benchmark -t get -d value_bytes -P 16`` GB/s (payload bytes per second)."""
    binary = shutil.which("redis-benchmark")
    if binary is None:
        sys.exit("redis-benchmark is not on PATH")
    # redis-benchmark's GET reads the literal key "key:__rand_int__" (no -r): give it a value
    # of the size we measure, or it would time tiny nil replies.
    with redis.Redis(host="127.0.0.1", port=port) as client:
        client.set("key:__rand_int__", b"v" * value_bytes)
    cmd = [binary, "-h", "127.0.0.1", "-p", str(port), "-t", "get", "-d", str(value_bytes),
           "-n", str(requests), "-c", str(clients), "-P", "16", "-q", "--csv"]  # fmt: skip
    out = subprocess.run(cmd, check=True, capture_output=True, timeout=600).stdout.decode()
    match = re.search(r'^"GET","([0-9.]+)"', out, re.MULTILINE)
    if match is None:
        sys.exit(f"cannot parse redis-benchmark output:\n{out}")
    shown = " ".join(["redis-benchmark", *cmd[5:]])
    if not _printed_command:
        print(f"  peer: {shown}")
        _printed_command.append(True)
    return float(match.group(1)) * value_bytes / 1e9


def redis_py_pipeline_gbps(port: int, args: argparse.Namespace) -> float:
    """The client library alone: redis-py pipelined GETs of the tier's own keys, no checks,
    no copies into buffers, one connection (the same parser and socket settings as the tier)."""
    names = [redis_key(ChunkKey("bench-model", 1, 0, i, "bfloat16")) for i in range(args.chunks)]
    with redis.Redis(host="127.0.0.1", port=port, socket_read_size=1024 * 1024) as client:
        start = time.perf_counter()
        for _ in range(args.repeat):
            pipe = client.pipeline(transaction=False)
            for name in names:
                pipe.get(name)
            values = pipe.execute()
            assert all(v is not None for v in values)
        elapsed = time.perf_counter() - start
    moved: int = args.repeat * args.chunks * args.chunk_bytes
    return moved / elapsed / 1e9


async def tier_prefetch_gbps(port: int, args: argparse.Namespace) -> float:
    chunks: int = args.chunks
    chunk_bytes: int = args.chunk_bytes
    repeat: int = args.repeat
    keys = [ChunkKey("bench-model", 1, 0, i, "bfloat16") for i in range(chunks)]
    arena = Arena(chunk_bytes, 2 * chunks)
    try:
        async with open_redis_tier(
            f"redis://127.0.0.1:{port}",
            timeout_s=10.0,
            threads=args.threads,
            write_queue=4 * chunks,
        ) as tier:
            for i, key in enumerate(keys):
                buf = arena.allocate()
                assert buf is not None
                buf.write(bytes([i % 251]) * chunk_bytes)
                tier.enqueue_write(key, buf)
                buf.release()
            await tier.flush()
            assert tier.stats.chunks_stored == chunks, tier.stats.statistics()

            async def prefetch() -> None:
                n = await tier.contains_prefix(keys, pin=True)
                try:
                    bufs = arena.allocate_many(n)
                    try:
                        loaded = await tier.load(keys[:n], bufs)
                    finally:
                        for buf in bufs:
                            buf.release()
                finally:
                    tier.unpin(keys[:n])
                assert loaded == chunks, (n, loaded, tier.stats.statistics())

            await prefetch()  # warm up connections
            start = trio.current_time()
            for _ in range(repeat):
                await prefetch()
            elapsed = trio.current_time() - start
        return repeat * chunks * chunk_bytes / elapsed / 1e9
    finally:
        arena.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunks", type=int, default=16)
    parser.add_argument("--chunk-bytes", type=int, default=2 * MiB)
    parser.add_argument("--repeat", type=int, default=20, help="prefetches per measurement")
    parser.add_argument("--rounds", type=int, default=3,
                        help="interleaved measurements of each; medians are compared")  # fmt: skip
    parser.add_argument("--threads", type=int, default=4, help="tier threads")
    parser.add_argument("--requests", type=int, default=0,
                        help="redis-benchmark -n (default: the tier's GET count)")  # fmt: skip
    parser.add_argument("--clients", type=int, default=4, help="redis-benchmark -c")
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()
    value_bytes = args.chunk_bytes + HEADER_BYTES
    assert len(encode_value(b"x" * args.chunk_bytes)) == value_bytes
    requests = args.requests or max(args.repeat * args.chunks, 64)
    kind = "hiredis" if HIREDIS_AVAILABLE else "pure Python"
    with tempfile.TemporaryDirectory(dir=args.workdir) as workdir, redis_server(workdir) as port:
        print(f"remote tier over loopback: {args.chunks} chunks x {args.chunk_bytes} B, "
              f"{args.repeat} prefetches x {args.rounds} rounds, {args.threads} threads, "
              f"redis-py parser: {kind}")  # fmt: skip
        tier: list[float] = []
        library: list[float] = []
        peer: list[float] = []
        for _ in range(args.rounds):  # interleaved, so drift in a shared machine hits all three
            tier.append(trio.run(tier_prefetch_gbps, port, args))
            library.append(redis_py_pipeline_gbps(port, args))
            peer.append(redis_benchmark_gbps(port, value_bytes, requests, args.clients))
        rows = [
            ("lmprefetch redis tier prefetch (EXISTS + GET + verify + copy)", tier),
            ("redis-py pipelined GET, same values (no checks, no copy)", library),
            ("redis-benchmark GET, same value size (C client)", peer),
        ]
        for label, values in rows:
            each = " ".join(f"{v:.3f}" for v in values)
            print(f"  {label:<62} median {median(values):.3f} GB/s  ({each})")
        print(f"  ratio tier / redis-benchmark: {median(tier) / median(peer):.2f}   "
              f"tier / redis-py: {median(tier) / median(library):.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
