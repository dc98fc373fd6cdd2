"""The decision trace: what each lookup decided, on what inputs, and what it then measured.

A load policy decides from estimates (each tier's latency and throughput, the prefill model);
when a run loads where it should have recomputed, the question is which estimate was wrong and
when.  The engine answers it with one record per lookup (:class:`LookupTrace`: the hit tier by
tier with each tier's cost as the policy saw it, the prefill model's coefficients, the predicted
load and recompute times, what was kept, and the measured probe and load times), one per model
step the vLLM worker timed (:class:`StepTrace`: its tokens, its measured time and the time the
prefill model predicted for it), one per slow garbage collection of the process
(:class:`GcTrace`, in the ``decision_log`` file only), and one per background measurement of a
tier (:class:`CalibrationTrace`).

Records go to every subscriber of the engine's :class:`DecisionTrace` (``engine.trace``); with
none, the engine builds no record (a lookup pays one attribute test).  ``decision_log`` (a
configuration field) subscribes a :class:`JsonLinesWriter`: each record becomes one JSON line
(with a ``"kind"`` field) appended to that file, written by a task of its own in a worker
thread, so neither the engine's Trio thread nor the model runner's thread waits on the disk.
``lmprefetch bench-serve`` sets it on the measured server of its link scenarios and joins the
records with the questions it sent.

Threads: :meth:`DecisionTrace.emit` may be called from any thread (the vLLM worker emits step
records from the model runner's).  Subscribers must be quick and must not block.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Final

import msgspec
import trio

__all__ = [
    "CalibrationTrace",
    "DecisionTrace",
    "GcTrace",
    "JsonLinesWriter",
    "LookupTrace",
    "PartTrace",
    "ProbeTrace",
    "StepTrace",
    "TraceRecord",
    "decision_log_path",
    "decode_records",
    "open_decision_log",
]

log = logging.getLogger("lmprefetch.trace")

#: Records a :class:`JsonLinesWriter` keeps while its writer is behind; past it the oldest are
#: dropped (and counted).
MAX_PENDING_RECORDS: Final = 65536
#: A garbage collection shorter than this, of a generation below 2, is not recorded.
GC_RECORD_S: Final = 0.002


class ProbeTrace(msgspec.Struct, frozen=True, gc=False):
    """One tier's probe in a lookup: its time and the whole chunks it found."""

    tier: str
    seconds: float
    chunks: int


class PartTrace(msgspec.Struct, frozen=True, gc=False):
    """One tier's share of a hit as the policy saw it (``latency_s``, ``bytes_per_s``:
    ``None`` where not measured yet; ``age_s``: seconds since the throughput was last
    measured)."""

    tier: str
    chunks: int
    bytes: int
    zero_copy: bool
    latency_s: float | None
    bytes_per_s: float | None
    age_s: float | None = None


class LookupTrace(msgspec.Struct, frozen=True, gc=False, tag="lookup", tag_field="kind"):
    """One lookup, from its start to its answer (times in seconds from ``wall``, the wall
    clock at its start).

    ``decision`` is ``"loaded"`` (the whole hit), ``"truncated"``, ``"skipped"`` (none of it)
    or ``"miss"`` (nothing found past the skipped chunks).  The predictions are the engine's
    cost model (:func:`lmprefetch.policy.predict`), whatever the policy: ``predicted_load_s``
    and ``predicted_recompute_s`` are what loading the kept chunks and recomputing the dropped
    ones were expected to cost; ``*_all_s`` the same for the whole hit (always loading, never
    loading).  ``load_s`` is measured: from the loads' start to their end (``None`` when
    nothing was loaded).  ``not_probed`` names the tiers the policy ruled out before probing;
    ``calibrating`` the tiers whose dropped chunks are loaded in the background to measure
    them."""

    rank: int
    lookup_id: str
    wall: float
    policy: str
    prompt_tokens: int
    computed_tokens: int
    hit_chunks: int
    hit_tokens: int
    kept_chunks: int
    kept_tokens: int
    decision: str
    parts: tuple[PartTrace, ...]
    probes: tuple[ProbeTrace, ...]
    prefill_a: float | None
    prefill_b: float | None
    prefill_source: str | None
    predicted_load_s: float | None
    predicted_recompute_s: float | None
    predicted_load_all_s: float | None
    predicted_recompute_all_s: float | None
    decided_s: float | None
    load_s: float | None
    answered_s: float
    answer_tokens: int
    not_probed: tuple[str, ...] = ()
    calibrating: tuple[str, ...] = ()


class StepTrace(msgspec.Struct, frozen=True, gc=False, tag="step", tag_field="kind"):
    """One model step the vLLM worker timed: ``tokens`` (``T``) and ``attention`` (``Q``)
    computed in ``seconds`` (from the binding of its metadata to its save, less
    ``load_s`` spent in its loads), and the seconds the prefill model predicted for it before
    it was added (``None`` while not calibrated).  ``cpu_s``: the CPU time the whole process
    (every thread) used meanwhile, loads included: far below ``(seconds + load_s)`` times the
    threads computing, the step waited for the machine (other processes had its cores); far
    above, other threads of the process were busy too."""

    rank: int
    wall: float
    tokens: int
    attention: int
    seconds: float
    load_s: float
    predicted_s: float | None
    cpu_s: float | None = None


class GcTrace(msgspec.Struct, frozen=True, gc=False, tag="gc", tag_field="kind"):
    """A garbage collection in the engine's process (any thread) that took ``seconds``."""

    rank: int
    wall: float
    generation: int
    seconds: float


class CalibrationTrace(msgspec.Struct, frozen=True, gc=False, tag="calibration", tag_field="kind"):
    """A background load that measured a tier: ``chunks`` (``bytes``) in ``seconds``; the
    tier's throughput estimate after it (``None``: nothing arrived)."""

    rank: int
    wall: float
    tier: str
    chunks: int
    bytes: int
    seconds: float
    bytes_per_s: float | None


TraceRecord = LookupTrace | StepTrace | GcTrace | CalibrationTrace
_ENCODER: Final = msgspec.json.Encoder()
_DECODER: Final = msgspec.json.Decoder(TraceRecord)


def decode_records(lines: bytes) -> list[TraceRecord]:
    """The records of a ``decision_log`` file's contents (a line that does not decode, such
    as a last line cut short, is left out)."""
    out: list[TraceRecord] = []
    for line in lines.splitlines():
        if line.strip():
            try:
                out.append(_DECODER.decode(line))
            except msgspec.DecodeError:
                continue
    return out


Subscriber = Callable[[TraceRecord], None]


class DecisionTrace:
    """Where one engine's trace records go (see the module docstring).

    ``enabled`` is true while anyone subscribes; code that builds a record tests it first.
    """

    def __init__(self, rank: int = 0) -> None:
        self.rank = rank
        self._subscribers: tuple[Subscriber, ...] = ()
        self.enabled = False

    def subscribe(self, subscriber: Subscriber) -> Callable[[], None]:
        """Send every record to ``subscriber`` from now on (any thread may call it); returns
        the function that stops that."""
        self._subscribers = (*self._subscribers, subscriber)
        self.enabled = True

        def unsubscribe() -> None:
            self._subscribers = tuple(s for s in self._subscribers if s is not subscriber)
            self.enabled = bool(self._subscribers)

        return unsubscribe

    def emit(self, record: TraceRecord) -> None:
        """Hand ``record`` to every subscriber (any thread)."""
        for subscriber in self._subscribers:
            subscriber(record)

    @staticmethod
    def wall() -> float:
        """The wall clock (records from several processes are joined on it)."""
        return time.time()


class JsonLinesWriter:
    """Appends trace records to a file, one JSON line each, from a task of its own.

    :meth:`__call__` (a :class:`DecisionTrace` subscriber) queues a record from any thread and
    wakes the task through the Trio token; the task writes what is queued in a worker thread.
    Records beyond :data:`MAX_PENDING_RECORDS` waiting are dropped, oldest first, and counted
    in ``dropped``.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._pending: deque[TraceRecord] = deque()
        #: Records queued without the lock or a wake-up (garbage collections: a collection may
        #: run inside :meth:`__call__`, holding the lock); written with the next batch.
        self.unlocked: deque[TraceRecord] = deque(maxlen=MAX_PENDING_RECORDS)
        self._lock = threading.Lock()
        self._token = trio.lowlevel.current_trio_token()
        self._wakeup = trio.Event()
        self._poked = False
        self.dropped = 0
        self.written = 0

    def __call__(self, record: TraceRecord) -> None:
        with self._lock:
            if len(self._pending) >= MAX_PENDING_RECORDS:
                self._pending.popleft()
                self.dropped += 1
            self._pending.append(record)
            if self._poked:
                return
            self._poked = True
        try:
            self._token.run_sync_soon(self._wake)
        except trio.RunFinishedError:  # the engine's loop ended: nothing writes any more
            pass

    def _wake(self) -> None:
        self._wakeup.set()

    def _take(self) -> list[TraceRecord]:
        with self._lock:
            batch = list(self._pending)
            self._pending.clear()
            self._poked = False
        while self.unlocked:
            batch.append(self.unlocked.popleft())
        return batch

    def _write(self, batch: list[TraceRecord]) -> None:
        data = b"".join(_ENCODER.encode(r) + b"\n" for r in batch)
        with self.path.open("ab") as f:
            f.write(data)
        self.written += len(batch)

    async def run(self) -> None:
        """Write what is queued as it comes, until cancelled; then, shielded, what is left."""
        try:
            while True:
                await self._wakeup.wait()
                self._wakeup = trio.Event()
                batch = self._take()
                if batch:
                    await trio.to_thread.run_sync(self._write, batch)
        finally:
            with trio.CancelScope(shield=True):
                batch = self._take()
                if batch:
                    try:
                        await trio.to_thread.run_sync(self._write, batch)
                    except OSError as exc:
                        log.warning("decision_log: cannot write %s: %s", self.path, exc)


class _GcTimer:
    """Records garbage collections (``gc.callbacks``) longer than :data:`GC_RECORD_S`, or of
    generation 2, while installed, into ``sink`` (a deque: appending takes no lock, so a
    collection that runs while a thread holds the writer's lock cannot deadlock on it)."""

    def __init__(self, rank: int, sink: deque[TraceRecord]) -> None:
        self._rank = rank
        self._sink = sink
        self._started: dict[int, float] = {}

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        key = threading.get_ident()
        if phase == "start":
            self._started[key] = time.perf_counter()
            return
        t0 = self._started.pop(key, None)
        if t0 is None:
            return
        seconds = time.perf_counter() - t0
        generation = int(info.get("generation", 0))
        if seconds >= GC_RECORD_S or generation >= 2:
            self._sink.append(GcTrace(self._rank, time.time() - seconds, generation, seconds))


async def decision_log_path(path_template: str, rank: int) -> Path:
    """The ``decision_log`` file of ``rank`` (``{rank}`` replaced), checked by opening it for
    appending (in a worker thread).

    Raises:
        ValueError: the file cannot be opened for appending (naming ``decision_log``).
    """
    path = Path(path_template.replace("{rank}", str(rank)))
    try:
        await trio.to_thread.run_sync(lambda: path.open("ab").close())
    except OSError as exc:
        raise ValueError(f"decision_log: cannot append to {path}: {exc}") from None
    return path


@asynccontextmanager
async def open_decision_log(
    trace: DecisionTrace, path: Path, nursery: trio.Nursery
) -> AsyncIterator[JsonLinesWriter]:
    """Append ``trace``'s records to ``path`` (see :func:`decision_log_path`) from a task in
    ``nursery`` until the block exits (then the records still queued are written, shielded),
    and record the process's slow garbage collections meanwhile."""
    writer = JsonLinesWriter(path)
    stop = trace.subscribe(writer)
    gc_timer = _GcTimer(trace.rank, writer.unlocked)
    gc.callbacks.append(gc_timer)
    scope = trio.CancelScope()

    async def run() -> None:
        with scope:
            await writer.run()

    nursery.start_soon(run, name="lmprefetch-decision-log")
    try:
        yield writer
    finally:
        gc.callbacks.remove(gc_timer)
        stop()
        scope.cancel()
