"""The ``lmprefetch`` command.

* ``lmprefetch bench`` — the main job: the whole system under a synthetic chat workload
  (see :mod:`lmprefetch.bench`); runs with no arguments right after install.
* ``lmprefetch bench-engine`` — the engine alone: CPU hit, disk hit, miss and concurrent disk
  lookups, beside the raw read time of the same files.
* ``lmprefetch bench-serve`` — time to first token on vLLM's OpenAI server (CPU build) with
  lmprefetch, against recomputing, vLLM's own prefix cache and LMCache (needs the ``vllm``
  extra; see :mod:`lmprefetch.bench_serve`).
* ``lmprefetch worker`` — a standalone worker process serving lookups for one rank.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from collections.abc import Sequence

from .config import PrefetchConfig

__all__ = ["main"]


def _worker(args: argparse.Namespace) -> int:
    from .runtime import WorkerRuntime

    config = PrefetchConfig.from_file(args.config) if args.config else PrefetchConfig.from_env()
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    runtime = WorkerRuntime.start(
        config,
        rank=args.rank,
        world_size=args.world_size,
        request_endpoint=args.request_endpoint,
        response_endpoint=args.response_endpoint,
        metrics_port=args.metrics_port,
    )
    try:
        msg = (
            f"lmprefetch worker rank {args.rank}/{args.world_size} serving {args.request_endpoint}"
        )
        if runtime.metrics_port is not None:
            msg += f", metrics on 127.0.0.1:{runtime.metrics_port}"
        print(msg, flush=True)
        stop.wait()
    finally:
        runtime.close()
    return 0


def _bench(args: argparse.Namespace) -> int:
    from . import bench

    return bench.main(args)


def _bench_engine(args: argparse.Namespace) -> int:
    from . import bench_engine

    return bench_engine.main(args)


def _bench_serve(args: argparse.Namespace) -> int:
    from . import bench_serve

    return bench_serve.main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lmprefetch", description="Asynchronous KV-cache lookup and prefetch, on Trio."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)

    w = sub.add_parser("worker", help="run a worker process serving lookups for one rank")
    w.add_argument("--rank", type=int, default=0)
    w.add_argument("--world-size", type=int, default=1)
    w.add_argument("--request-endpoint", required=True, help="bound here, e.g. ipc://@w0")
    w.add_argument("--response-endpoint", required=True, help="the scheduler's answer endpoint")
    w.add_argument("--config", help="TOML file with PrefetchConfig fields (else LMPREFETCH_* env)")
    w.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port")
    w.set_defaults(func=_worker)

    from .bench import add_arguments

    b = sub.add_parser("bench", help="the main benchmark: workers over ipc, chat workload")
    add_arguments(b)
    b.set_defaults(func=_bench)

    from .bench_engine import add_arguments as add_engine_arguments

    e = sub.add_parser("bench-engine", help="the engine alone vs the raw read of its files")
    add_engine_arguments(e)
    e.set_defaults(func=_bench_engine)

    from .bench_serve import add_arguments as add_serve_arguments

    s = sub.add_parser(
        "bench-serve", help="TTFT on vLLM's OpenAI server: lmprefetch vs prefix cache, LMCache"
    )
    add_serve_arguments(s)
    s.set_defaults(func=_bench_serve)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    try:
        return int(args.func(args))
    except ValueError as exc:
        print(f"lmprefetch: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
