"""The measurements of ``lmprefetch bench``: round trips, scheduler costs, throughput, the chat
replay, and the transport breakdown (the disk and cancel figures are measured inside the worker
processes, :mod:`.processes`)."""

from __future__ import annotations

import collections
import contextlib
import itertools
import math
import multiprocessing as mp
import os
import random
import shutil
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from multiprocessing.process import BaseProcess
from typing import Any, TextIO

import zmq

from .. import _stopping
from ..client import LookupClient
from ..config import PrefetchConfig
from .processes import echo_main, start_process, stop_processes, trio_echo_main, worker_main
from .workload import BenchOptions, Workload

__all__ = [
    "Progress",
    "endpoint_for",
    "free_tcp_endpoint",
    "load_avg",
    "measure_echo",
    "measure_miss_rtt",
    "measure_miss_throughput",
    "measure_raw_rtt",
    "measure_submit_and_poll",
    "measure_transport",
    "measure_worker_rtt",
    "percentile",
    "replay",
]

KiB = 1024
MiB = 1024 * KiB


# -- measurements -----------------------------------------------------------------------
def load_avg() -> float:
    """The machine's 1-minute load average now (NaN where the OS does not say)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return math.nan


def endpoint_for(opts: BenchOptions, name: str) -> str:
    if opts.transport == "tcp":
        return "tcp://127.0.0.1:0"
    return f"ipc://@lmprefetch-bench-{os.getpid()}-{uuid.uuid4().hex[:8]}-{name}"


def free_tcp_endpoint() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def measure_raw_rtt(
    opts: BenchOptions, ctx: mp.context.SpawnContext, peers: int = 1, *, trio_echo: bool = False
) -> float:
    """Median round trip to ``peers`` echo processes (send to all, wait all): blocking pyzmq,
    or (``trio_echo``) lmprefetch's Trio-native sockets."""
    return measure_echo(opts, ctx, peers, trio_echo=trio_echo)["median"]


def measure_echo(
    opts: BenchOptions,
    ctx: mp.context.SpawnContext,
    peers: int = 1,
    *,
    trio_echo: bool = False,
    pipelined: int = 0,
) -> dict[str, float]:
    """:func:`measure_raw_rtt`, with ``first``: the very first round trip, sent as soon as
    the echo processes are ready and connected to (so it pays what a first message on a new
    connection pays, as the first lookup to a fresh worker does); and with ``pipelined``
    messages, ``per_s``: messages echoed per second per peer when sent in windows, as
    :func:`measure_miss_throughput` sends lookups (no high-water mark: nothing waits on a full
    queue but the echo itself)."""
    procs: list[BaseProcess] = []
    zctx = zmq.Context()
    zctx.setsockopt(zmq.SNDHWM, 0)
    zctx.setsockopt(zmq.RCVHWM, 0)
    if opts.transport == "tcp":
        back = free_tcp_endpoint()
        fronts = [free_tcp_endpoint() for _ in range(peers)]
    else:
        back = endpoint_for(opts, "echo-back")
        fronts = [endpoint_for(opts, f"echo-{i}") for i in range(peers)]
    pull = zctx.socket(zmq.PULL)
    pull.bind(back)
    pushes = []
    try:
        for front in fronts:
            target = trio_echo_main if trio_echo else echo_main
            ready, ready_child = ctx.Pipe(duplex=False)
            with ready, ready_child:
                start_process(ctx, target, (front, back, ready_child), procs)
                if not ready.poll(120):
                    raise RuntimeError("an echo process did not start")
                ready.recv()
            s = zctx.socket(zmq.PUSH)
            s.connect(front)
            pushes.append(s)
        msg = b"x" * 64
        samples = []
        first = math.nan
        for i in range(opts.rtt_samples + 100):
            t0 = time.perf_counter()
            for s in pushes:
                s.send(msg)
            for _ in pushes:
                pull.recv()
            if i == 0:
                first = time.perf_counter() - t0
            if i >= 100:
                samples.append(time.perf_counter() - t0)
        per_s = math.nan
        if pipelined:
            t0 = time.perf_counter()
            for start in range(0, pipelined, THROUGHPUT_WINDOW):
                n = min(THROUGHPUT_WINDOW, pipelined - start)
                for _ in range(n):
                    for s in pushes:
                        s.send(msg)
                for _ in range(n * len(pushes)):
                    pull.recv()
            per_s = pipelined / (time.perf_counter() - t0)
        return {"median": statistics.median(samples), "first": first, "per_s": per_s}
    finally:
        for s in pushes:  # every echo is told to stop, on every path (it exits in a moment)
            with contextlib.suppress(zmq.ZMQError):
                s.send(b"stop", zmq.NOBLOCK)
        stop_processes(procs, grace_s=5.0)
        for s in pushes:
            s.close(0)
        pull.close(0)
        zctx.term()


def measure_miss_rtt(
    client: LookupClient, n: int, rng: random.Random, *, warmup: int = 100
) -> dict[str, float]:
    """Full-miss lookups one at a time, after ``warmup`` unmeasured ones: the median time from
    ``lookup()`` until the answer is in the client's table (what the scheduler's next poll
    sees), and until a thread blocked in ``wait()`` has woken up with it.  ``first`` is the
    first warm-up lookup's visible time."""
    visible, woken = [], []
    first = math.nan
    for i in range(n + warmup):
        lid = f"rtt-{i}"
        hashes = [rng.getrandbits(64)]
        t0 = time.perf_counter()
        client.lookup(lid, (), hashes=hashes, offsets=[1])
        result = client.wait(lid, 5.0)
        dt = time.perf_counter() - t0
        timing = client.timing(lid)
        if result is None or timing is None or timing[1] is None:
            raise RuntimeError("a miss lookup was not answered within 5 s")
        client.forget(lid)
        if i == 0:
            first = timing[1] - timing[0]
        if i >= warmup:
            woken.append(dt)
            visible.append(timing[1] - timing[0])
    return {
        "visible": statistics.median(visible) if visible else math.nan,
        "woken": statistics.median(woken) if woken else math.nan,
        "first": first,
    }


def measure_worker_rtt(
    config: PrefetchConfig, request_endpoint: str, response_endpoint: str, n: int
) -> float:
    """Median full-miss round trip to a worker from a blocking pyzmq client (no
    :class:`LookupClient`): an encoded request out, the encoded answer back.  The worker's own
    cost over the echo, without the scheduler-side client's."""
    from ..protocol import LookupRequestMsg, encode

    zctx = zmq.Context()
    pull = zctx.socket(zmq.PULL)
    push = zctx.socket(zmq.PUSH)
    try:
        pull.bind(response_endpoint)
        push.connect(request_endpoint)
        pull.setsockopt(zmq.RCVTIMEO, 5000)
        samples = []
        for i in range(n + 100):
            msg = encode(LookupRequestMsg(f"raw-{i}", [i + 1], [1], None, seq=1))
            t0 = time.perf_counter()
            push.send(msg)
            pull.recv()
            if i >= 100:
                samples.append(time.perf_counter() - t0)
        return statistics.median(samples)
    finally:
        push.close(0)
        pull.close(0)
        zctx.term()


class _PythonFloor:
    """The least a scheduler-side client can do in Python, measured beside the real one: a
    submit that registers the id under a lock and queues the prompt for another thread, and a
    pending poll that is one method call, one dict lookup and one clock read.  Whatever this
    machine's Python costs for those, no client can go below it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[str, float] = {}
        self._queue: collections.deque[tuple[str, Sequence[int]]] = collections.deque()

    def lookup(self, lookup_id: str, prompt: Sequence[int]) -> int | None:
        deadline = self._entries.get(lookup_id)
        if deadline is not None:
            return None if time.monotonic() < deadline else 0
        with self._lock:
            self._entries[lookup_id] = time.monotonic() + 3600.0
            self._queue.append((lookup_id, prompt))
        return None


def _time_submit_and_poll(
    lookup: Any, prompt: Sequence[int], n: int, polls: int
) -> tuple[float, float]:
    """Seconds per first call (``n`` new ids) and per repeated call of ``lookup``."""
    t0 = time.perf_counter()
    for i in range(n):
        lookup(f"s{i}", prompt)
    submit = (time.perf_counter() - t0) / n
    t0 = time.perf_counter()
    for _ in range(polls):
        lookup("s0", prompt)
    return submit, (time.perf_counter() - t0) / polls


def measure_submit_and_poll(
    config: PrefetchConfig, opts: BenchOptions, progress: Progress | None = None
) -> dict[str, float]:
    """Submit and pending-poll cost on a client whose (absent) worker never answers, and the
    same on :class:`_PythonFloor` (``floor_submit_us``, ``floor_poll_us``); two ``progress``
    steps."""
    progress = progress or Progress({}, enabled=False)
    dead = endpoint_for(opts, "nobody") if opts.transport == "ipc" else free_tcp_endpoint()
    resp = endpoint_for(opts, "dead-resp") if opts.transport == "ipc" else "tcp://127.0.0.1:0"
    cfg = config.replace(lookup_timeout_s=3600.0)
    prompt = list(range(128 * config.chunk_size))
    n, polls = 2000, 200_000
    with contextlib.ExitStack() as stack:
        client = _stopping.enter(stack, lambda: LookupClient(cfg, [dead], resp))
        submit, poll = _time_submit_and_poll(client.lookup, prompt, n, polls)
        for i in range(n):
            client.cancel(f"s{i}")
    progress.step()
    floor_submit, floor_poll = _time_submit_and_poll(_PythonFloor().lookup, prompt, n, polls)
    progress.step()
    return {
        "submit_us": submit * 1e6,
        "poll_us": poll * 1e6,
        "floor_submit_us": floor_submit * 1e6,
        "floor_poll_us": floor_poll * 1e6,
    }


#: Messages in flight at once when a throughput is measured (under the sockets' default
#: high-water mark with the answers on their way back).
THROUGHPUT_WINDOW = 2000


def measure_miss_throughput(client: LookupClient, n: int, rng: random.Random) -> float:
    """Full-miss lookups per second per worker, pipelined in windows under the socket HWM."""
    window = THROUGHPUT_WINDOW
    batches = [
        [(f"tp-{i}", [rng.getrandbits(64)]) for i in range(start, min(n, start + window))]
        for start in range(0, n, window)
    ]
    t0 = time.perf_counter()
    for batch in batches:
        for lid, hashes in batch:
            client.lookup(lid, (), hashes=hashes, offsets=[1])
        # Answers come back in order: wait for the last, then collect every one.
        if client.wait(batch[-1][0], 10.0) is None:
            raise RuntimeError("a pipelined miss lookup was not answered")
        for lid, _ in batch:
            if client.lookup(lid, ()) is None and client.wait(lid, 10.0) is None:
                raise RuntimeError("a pipelined miss lookup was not answered")
            client.forget(lid)
    return n / (time.perf_counter() - t0)


class Progress:
    """The run's progress on one line of stderr, only when stderr is a terminal: a bar over the
    whole run, how far it is, what it measures now and the seconds since it began.

    The run is cut into phases, each with its expected share of the run's time (``weights``);
    :meth:`phase` begins the next one with a number of steps, and each :meth:`step` moves the
    bar by that phase's share over its steps.  The line is redrawn at most ten times a second.
    :meth:`close` (or leaving the ``with`` block) erases it, however the run ends, so that what
    comes next (the report, or the one line of an interrupted command) starts on a clean line.
    """

    def __init__(
        self, weights: Mapping[str, float], enabled: bool, stream: TextIO | None = None
    ) -> None:
        self.stream = sys.stderr if stream is None else stream
        self.enabled = enabled and self.stream.isatty()
        total = sum(weights.values()) or 1.0
        # Where each phase begins and ends, 0 to 1 (one sum, so that a phase's end is exactly
        # the next one's beginning).
        ends = list(itertools.accumulate(w / total for w in weights.values()))
        self._spans = dict(zip(weights, zip([0.0, *ends], ends)))
        self._span = (0.0, 0.0)
        self._steps = 1
        self._done = 0
        self._label = ""
        self._t0 = time.monotonic()
        self._drawn_at = -math.inf
        self._drawn = False

    @property
    def fraction(self) -> float:
        """How much of the run is done, 0 to 1."""
        begin, end = self._span
        if self._done >= self._steps:
            return end
        return begin + (end - begin) * self._done / self._steps

    def phase(self, name: str, label: str, steps: int = 1) -> None:
        """Begin phase ``name`` (one of the weights' keys; the phases before it count as done),
        shown as ``label``, in ``steps`` steps."""
        self._span = self._spans[name]
        self._steps, self._done, self._label = max(1, steps), 0, label
        self._draw(force=True)

    def step(self, n: int = 1) -> None:
        self._done += n
        self._draw()

    def line(self, width: int) -> str:
        """The line as drawn, at most ``width`` columns."""
        frac = self.fraction
        bar_width = 24
        filled = int(frac * bar_width)
        text = (
            f"[{'#' * filled}{'.' * (bar_width - filled)}] {frac:4.0%}  "
            f"{time.monotonic() - self._t0:4.0f} s  {self._label}"
        )
        return text[: max(0, width - 1)]

    def _draw(self, *, force: bool = False) -> None:
        now = time.monotonic()
        if not self.enabled or (not force and now - self._drawn_at < 0.1):
            return
        self._drawn_at = now
        width = shutil.get_terminal_size().columns
        self.stream.write(f"\r\x1b[2K{self.line(width)}")
        self.stream.flush()
        self._drawn = True

    def close(self) -> None:
        """Erase the line (if one was drawn)."""
        if self._drawn:
            self._drawn = False
            with contextlib.suppress(OSError, ValueError):  # a terminal gone, a closed stream
                self.stream.write("\r\x1b[2K")
                self.stream.flush()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def replay(
    client: LookupClient,
    workload: Workload,
    opts: BenchOptions,
    rng: random.Random,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Replay the chat lookups with ``concurrency`` in flight and random aborts (one
    ``progress`` step per lookup)."""
    todo = list(enumerate(workload.lookups))
    pending: dict[str, tuple[int, list[int]]] = {}
    latencies: list[float] = []
    hit_tokens = total_tokens = aborted = timeouts = 0
    progress = progress or Progress({}, enabled=False)
    t_start = time.perf_counter()
    while todo or pending:
        while todo and len(pending) < opts.concurrency:
            i, prompt = todo.pop(0)
            lid = f"chat-{i}"
            client.lookup(lid, prompt)
            if rng.random() < opts.abort_ratio:
                client.cancel(lid)  # the user went away while the lookup was pending
                aborted += 1
                progress.step()
                continue
            pending[lid] = (i, prompt)
        oldest = next(iter(pending), None)
        if oldest is None:
            continue
        client.wait(oldest, 0.05)  # the "model step" between scheduler polls
        for lid, (_, prompt) in list(pending.items()):
            result = client.lookup(lid, prompt)
            if result is None:
                continue
            timing = client.timing(lid)
            if timing is not None and timing[1] is not None:
                latencies.append(timing[1] - timing[0])
            else:
                timeouts += 1
            n_full = len(prompt) // opts.chunk_size * opts.chunk_size
            hit_tokens += result
            total_tokens += n_full
            client.forget(lid)
            client.cancel(lid)  # the request finished: release what the workers hold
            del pending[lid]
            progress.step()
    elapsed = time.perf_counter() - t_start
    latencies.sort()
    return {
        "lookups": len(workload.lookups),
        "aborted": aborted,
        "timeouts": timeouts,
        "elapsed_s": elapsed,
        "latency_p50_ms": percentile(latencies, 50) * 1e3,
        "latency_p99_ms": percentile(latencies, 99) * 1e3,
        "latencies_ms": [x * 1e3 for x in latencies],
        "hit_ratio": hit_tokens / total_tokens if total_tokens else 0.0,
        "hit_tokens": hit_tokens,
        "prompt_tokens": total_tokens,
    }


def percentile(sorted_values: Sequence[float], p: float) -> float:
    if not sorted_values:
        return math.nan
    k = min(len(sorted_values) - 1, max(0, math.ceil(p / 100 * len(sorted_values)) - 1))
    return sorted_values[k]


#: The steps of :func:`measure_transport` (for a progress bar).
TRANSPORT_STEPS = 6


def measure_transport(
    config: PrefetchConfig,
    opts: BenchOptions,
    ctx: mp.context.SpawnContext,
    rng: random.Random,
    progress: Progress | None = None,
) -> dict[str, float]:
    """Round trip and throughput against one dedicated, otherwise idle worker process, beside
    the raw pyzmq round trip to one echo process: the same shape, so the ratio is fair
    (:data:`TRANSPORT_STEPS` ``progress`` steps)."""
    if opts.transport == "tcp":
        req, resp = free_tcp_endpoint(), free_tcp_endpoint()
    else:
        req, resp = endpoint_for(opts, "t-w"), endpoint_for(opts, "t-sched")
    progress = progress or Progress({}, enabled=False)
    procs: list[BaseProcess] = []
    parent, child = ctx.Pipe()
    out: dict[str, float] = {}
    try:
        with child:
            args = (child, config.to_dict(), 0, 1, req, resp, asdict(opts), False)
            start_process(ctx, worker_main, args, procs)
        if not parent.poll(120):
            raise RuntimeError("the transport worker did not start")
        parent.recv()
        progress.step()
        # The scheduler's client comes up after the worker is ready: its first lookup is the
        # first one this worker answers.
        with contextlib.ExitStack() as stack:
            client = _stopping.enter(stack, lambda: LookupClient(config, [req], resp))
            first = measure_miss_rtt(client, 0, rng, warmup=1)["first"]
            echo = measure_echo(opts, ctx, peers=1, pipelined=opts.miss_lookups)
            progress.step()
            out["raw_rtt_us"] = echo["median"] * 1e6
            out["raw_rtt_first_us"] = echo["first"] * 1e6
            out["raw_echo_per_s"] = echo["per_s"]
            out["trio_echo_rtt_us"] = measure_raw_rtt(opts, ctx, peers=1, trio_echo=True) * 1e6
            progress.step()
            rtt = measure_miss_rtt(client, opts.rtt_samples, rng)
            progress.step()
            out["miss_rtt_us"] = rtt["visible"] * 1e6
            out["miss_rtt_woken_us"] = rtt["woken"] * 1e6
            out["first_lookup_us"] = first * 1e6
            out["first_lookup_ratio"] = first / rtt["visible"]
            out["miss_rtt_ratio"] = out["miss_rtt_us"] / out["raw_rtt_us"]
            out["miss_lookups_per_s_per_worker"] = measure_miss_throughput(
                client, opts.miss_lookups, rng
            )
            progress.step()
        # The same worker from a blocking pyzmq client, for the breakdown.
        out["worker_rtt_us"] = measure_worker_rtt(config, req, resp, opts.rtt_samples) * 1e6
        progress.step()
    finally:
        # Told to stop on every path (a worker that is never told waits for its pipe to close).
        with contextlib.suppress(OSError):
            parent.send(("stop", None))
        stop_processes(procs, grace_s=30.0)
        parent.close()
    return out
