"""The ``lmprefetch`` command.

* ``lmprefetch bench`` — the main job: the whole system under a synthetic chat workload
  (see :mod:`lmprefetch.bench`); runs with no arguments right after install.
* ``lmprefetch bench-engine`` — the engine alone: CPU hit, disk hit, miss and concurrent disk
  lookups, beside the raw read time of the same files.
* ``lmprefetch bench-disk`` — every disk figure that has a goal (against LMCache where it can
  be imported), alone and with CPU-bound processes beside it (see :mod:`lmprefetch.bench.disk`).
* ``lmprefetch bench-serve`` — time to first token on vLLM's OpenAI server (CPU build) with
  lmprefetch, against recomputing, vLLM's own prefix cache and LMCache (needs the ``vllm``
  extra; see :mod:`lmprefetch.bench.serve`).
* ``lmprefetch worker`` — a standalone worker process serving lookups for one rank.

Start-up errors (bad options, configuration, endpoints or ports in use) print one line naming
the problem and exit with status 2; a worker that fails while running exits with status 1 after
logging the traceback.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from collections.abc import Sequence
from typing import NoReturn

from .config import PrefetchConfig

__all__ = ["main"]


def _worker(args: argparse.Namespace) -> int:
    """Run one worker rank until SIGTERM/SIGINT (exit 0) or until it fails (exit 1)."""
    import zmq

    from .publisher import EventsEndpointError
    from .runtime import WorkerRuntime
    from .transport import check_endpoint

    if args.world_size < 1:
        raise ValueError(f"--world-size: must be at least 1, got {args.world_size}")
    if not 0 <= args.rank < args.world_size:
        raise ValueError(
            f"--rank: must be between 0 and --world-size minus 1 ({args.world_size - 1}), "
            f"got {args.rank}"
        )
    if args.metrics_port is not None and not 0 <= args.metrics_port <= 65535:
        raise ValueError(f"--metrics-port: must be 0 … 65535, got {args.metrics_port}")
    for option, url in (
        ("--request-endpoint", args.request_endpoint),
        ("--response-endpoint", args.response_endpoint),
    ):
        try:
            check_endpoint(url)
        except ValueError as exc:
            raise ValueError(f"{option}: {exc}") from None
    if args.events_endpoint is not None:
        try:
            check_endpoint(args.events_endpoint)
        except ValueError as exc:
            raise ValueError(f"--events-endpoint: {exc}") from None
    config = PrefetchConfig.from_file(args.config) if args.config else PrefetchConfig.from_env()
    if args.events_endpoint is not None and not config.kv_events:
        raise ValueError(
            "--events-endpoint: KV events are off in the configuration (kv_events = false)"
        )
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        stop.set()

    def on_failure(_exc: BaseException) -> None:
        stop.set()  # the traceback is logged already; main() below exits non-zero

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        runtime = WorkerRuntime.start(
            config,
            rank=args.rank,
            world_size=args.world_size,
            request_endpoint=args.request_endpoint,
            response_endpoint=args.response_endpoint,
            metrics_port=args.metrics_port,
            metrics_host=args.metrics_host,
            on_failure=on_failure,
            events_endpoint=args.events_endpoint,
            events_topic=args.events_topic,
        )
    except EventsEndpointError as exc:
        raise ValueError(f"--events-endpoint: {exc}") from None
    except zmq.ZMQError as exc:
        if exc.errno == zmq.EADDRINUSE:
            raise ValueError(
                f"--request-endpoint: {args.request_endpoint} is already in use "
                "(another worker bound it?)"
            ) from None
        raise ValueError(
            f"--request-endpoint {args.request_endpoint} / --response-endpoint "
            f"{args.response_endpoint}: cannot open the lookup sockets ({exc})"
        ) from None
    except OSError as exc:  # the metrics server's bind
        raise ValueError(
            f"--metrics-port: cannot serve metrics on {args.metrics_host}:{args.metrics_port} "
            f"({exc.strerror or exc})"
        ) from None
    try:
        msg = (
            f"lmprefetch worker rank {args.rank}/{args.world_size} serving {args.request_endpoint}"
        )
        if runtime.metrics_port is not None:
            msg += f", metrics on {args.metrics_host}:{runtime.metrics_port}"
        if runtime.publisher is not None:
            msg += f", KV events on {runtime.publisher.endpoint}"
        print(msg, flush=True)
        stop.wait()
    finally:
        runtime.close()
    if runtime.failure is not None:
        print(f"lmprefetch worker: stopped by a failure: {runtime.failure!r}", file=sys.stderr)
        return 1
    return 0


def _bench(args: argparse.Namespace) -> int:
    from . import bench

    return bench.main(args)


def _bench_engine(args: argparse.Namespace) -> int:
    from .bench import engine

    return engine.main(args)


def _one_line(text: str) -> str:
    """``text`` with every character that is not printable (newlines, other line breaks,
    control characters, lone surrogates) escaped, so that it prints as exactly one line."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (naming the option) and exit code 2."""

    def error(self, message: str) -> NoReturn:
        # argparse quotes most values it complains about, but not unrecognized arguments.
        self.exit(2, f"{self.prog}: {_one_line(message)} (see {self.prog} --help)\n")


def _bench_disk(args: argparse.Namespace) -> int:
    from .bench import disk

    return disk.main(args)


def _bench_serve(args: argparse.Namespace) -> int:
    from .bench import serve as bench_serve

    return bench_serve.main(args)


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = _Parser(
        prog="lmprefetch", description="Asynchronous KV-cache lookup and prefetch, on Trio."
    )
    parser.add_argument("--version", action="version", version=f"lmprefetch {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    w = sub.add_parser("worker", help="run a worker process serving lookups for one rank")
    w.add_argument("--rank", type=int, default=0, help="this worker's rank (default: 0)")
    w.add_argument(
        "--world-size", type=int, default=1, help="number of worker ranks (default: 1)"
    )
    w.add_argument("--request-endpoint", required=True, help="bound here, e.g. ipc://@w0")
    w.add_argument("--response-endpoint", required=True, help="the scheduler's answer endpoint")
    w.add_argument("--config", help="TOML file with PrefetchConfig fields (else LMPREFETCH_* env)")
    w.add_argument(
        "--metrics-port", type=int, help="serve Prometheus metrics on this port (0: any free)"
    )
    w.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        help="address the metrics server binds (default: 127.0.0.1; 0.0.0.0 for all)",
    )
    w.add_argument(
        "--events-endpoint",
        help="publish KV events (vLLM's BlockStored/BlockRemoved format) on this bound ZeroMQ "
        "PUB endpoint, e.g. tcp://127.0.0.1:5557",
    )
    w.add_argument(
        "--events-topic", default="", help="topic frame of each KV-event message (default: '')"
    )
    w.set_defaults(func=_worker)

    from .bench import add_arguments

    b = sub.add_parser("bench", help="the main benchmark: workers over ipc, chat workload")
    add_arguments(b)
    b.set_defaults(func=_bench)

    from .bench.engine import add_arguments as add_engine_arguments

    e = sub.add_parser("bench-engine", help="the engine alone vs the raw read of its files")
    add_engine_arguments(e)
    e.set_defaults(func=_bench_engine)

    from .bench.disk import add_arguments as add_disk_arguments

    d = sub.add_parser(
        "bench-disk", help="the disk goals, alone and beside busy CPUs, against LMCache"
    )
    add_disk_arguments(d)
    d.set_defaults(func=_bench_disk)

    from .bench.serve import add_arguments as add_serve_arguments

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
        print(f"lmprefetch: {_one_line(str(exc))}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
