"""A schedule explorer for the engine, in the spirit of Rust's ``loom``.

Random cancellation points and soak runs rarely reach the narrow windows in which two operations
interleave.  This module runs small *scenarios* — two to four concurrent operations on one engine
(lookups of overlapping prefixes, claims, stores, a task holding limiter weight) — under many
schedules, and checks every invariant after each run.  A schedule is decided by three things:

* **Trio's scheduler, made deterministic per seed.**  Trio shuffles each batch of runnable tasks
  with a module-level ``random.Random`` (``trio._core._run._r``); with
  ``_ALLOW_DETERMINISTIC_SCHEDULING`` set (what Trio's Hypothesis plugin does) it sorts the batch
  by spawn order first, so a seed fixes the order.  Time is a ``MockClock`` that jumps when
  every task is blocked.  Both names are in trio 0.22 through 0.35.
* **Worker threads, stepped in lockstep.**  ``trio.to_thread.run_sync`` is replaced by
  :class:`SimulatedThreads`: the function still runs in a real thread (its locks and blocking
  calls behave), but only while the Trio thread waits for it, from one pause point to the next
  (``trio.from_thread.check_cancelled``, which the disk tier calls before every chunk), and a
  seeded number of Trio steps pass between two pieces.  So when a read lands relative to the
  Trio tasks is part of the explored schedule, and is reproducible.
* **A disturbance after task step k.**  :class:`Stepper`, a ``trio.abc.Instrument``, counts the
  steps of every task once the operations start and, after step ``k``, runs one synchronous
  disturbance: ``Engine.cancel``, cancelling a caller, reusing a lookup id, closing the engine,
  jumping the clock past ``claim_ttl_s``, a tier failing, a chunk file deleted, truncated or
  replaced, the arena taken.

:func:`explore` first runs each seed undisturbed to count its steps, then once per step ``k``
(the first ``k`` steps are the same as in the counting run, so the disturbance lands at the
same point).  After every run it checks (:meth:`World.check`):

* every started lookup answered exactly once, and a lookup cancelled (by any path) before its
  answer answered 0;
* an answer above 0 was claimable when it was given: the record was HELD (the known-bad outcome
  is a positive answer nobody can claim);
* every claimed buffer holds exactly the bytes stored under its key, the chunks are a contiguous
  prefix from the first looked-up chunk, and a claim by the answer's receiver got every chunk
  the answer counted;
* at quiescence (every operation done, held results expired): nothing loading or held, no pin on
  any tier, no limiter weight, no arena byte outside the CPU tier; after close, the arena empty;
* every state transition the lookup records made is a row of the state table in the record's
  docstring (read from the docstring itself).

A violation names its scenario, seed, step and disturbance; :func:`run_once` with the same
arguments replays it (``LMPF_SCHEDULE=scenario:seed:step:disturbance pytest
tests/test_schedules.py -k replay``).

Residual nondeterminism: Trio delivers a cancellation to the tasks of a cancel scope in ``set``
order (by object id); when that order matters (two waiters of the limiter cancelled at once) a
replay may take another path.  The checks hold on every path either way.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import math
import os
import random
import shutil
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import outcome
import trio
import trio.testing
from trio._core import _run as trio_run  # the scheduler's seed and determinism flag

from lmprefetch import PrefetchConfig, open_engine
from lmprefetch.keys import ChunkKey
from lmprefetch.lookup import LookupState, _Lookup
from lmprefetch.memory import Buffer
from lmprefetch.tiers.base import BaseTier
from lmprefetch.tiers.disk import DiskTier

from .fakes import FakeTier

CHUNK = 4  # tokens per chunk
CHUNK_BYTES = 256
#: Mock-clock seconds after which a run counts as hung.
HANG_S = 100_000.0
CLAIM_TTL_S = 50.0
DEADLINE_S = 5.0  # load_deadline_s where a scenario sets it


# -- deterministic scheduling ----------------------------------------------------------------
@contextlib.contextmanager
def deterministic_scheduler(seed: int) -> Iterator[None]:
    """Make Trio's batch order a function of ``seed`` for the runs inside the block."""
    flag, state = trio_run._ALLOW_DETERMINISTIC_SCHEDULING, trio_run._r.getstate()
    trio_run._ALLOW_DETERMINISTIC_SCHEDULING = True  # type: ignore[misc]
    trio_run._r.seed(seed)
    try:
        yield
    finally:
        trio_run._ALLOW_DETERMINISTIC_SCHEDULING = flag  # type: ignore[misc]
        trio_run._r.setstate(state)


class _ThreadCancelled(Exception):
    """Raised at a simulated thread's pause point once its task was cancelled."""


_local = threading.local()


class _SimThread:
    """A worker thread that runs only while the Trio thread waits for it: from one pause point
    (``trio.from_thread.check_cancelled``) to the next, or to its end."""

    def __init__(self, fn: Callable[..., Any], args: Sequence[Any]) -> None:
        self._go = threading.Semaphore(0)
        self._paused = threading.Semaphore(0)
        self.finished = False
        self.result: outcome.Outcome[Any] | None = None
        self.cancel_requested = False
        self._thread = threading.Thread(
            target=self._main, args=(fn, args), name="lmprefetch-sim-thread", daemon=True
        )
        self._thread.start()

    def _main(self, fn: Callable[..., Any], args: Sequence[Any]) -> None:
        _local.sim = self
        self._go.acquire()
        try:
            self.result = outcome.capture(fn, *args)
        finally:
            self.finished = True
            self._paused.release()

    def pause_point(self) -> None:
        """In the thread: hand control back to the Trio thread until the next :meth:`step`."""
        self._paused.release()
        self._go.acquire()
        if self.cancel_requested:
            raise _ThreadCancelled

    def step(self) -> None:
        """In the Trio thread: run the thread to its next pause point, or to its end."""
        self._go.release()
        self._paused.acquire()
        if self.finished:
            self._thread.join()

    def run_to_end(self) -> None:
        while not self.finished:
            self.step()


class SimulatedThreads:
    """Replaces ``trio.to_thread.run_sync`` (and ``trio.from_thread.check_cancelled``) with
    lockstep threads; ``max_delay`` Trio steps at most pass between two pieces of a thread."""

    def __init__(
        self, rng: random.Random, max_delay: int = 3, clock: Callable[[], int] = lambda: 0
    ) -> None:
        self.rng = rng
        self.max_delay = max_delay
        self.calls = 0
        self._clock = clock
        #: The task step (``clock()``) at which each piece of a thread ran.
        self.pieces: list[int] = []

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        run_sync, check = trio.to_thread.run_sync, trio.from_thread.check_cancelled

        def check_cancelled() -> None:
            sim: _SimThread | None = getattr(_local, "sim", None)
            if sim is None:
                check()
            else:
                sim.pause_point()

        trio.to_thread.run_sync = self.run_sync  # type: ignore[assignment]
        trio.from_thread.check_cancelled = check_cancelled
        try:
            yield
        finally:
            trio.to_thread.run_sync = run_sync
            trio.from_thread.check_cancelled = check

    async def run_sync(
        self,
        sync_fn: Callable[..., Any],
        *args: Any,
        thread_name: str | None = None,
        abandon_on_cancel: bool | None = None,
        cancellable: bool | None = None,
        limiter: trio.CapacityLimiter | None = None,
    ) -> Any:
        abandon = bool(abandon_on_cancel if abandon_on_cancel is not None else cancellable)
        if limiter is None:
            limiter = trio.to_thread.current_default_thread_limiter()
        self.calls += 1
        await trio.lowlevel.checkpoint_if_cancelled()
        token = object()
        await limiter.acquire_on_behalf_of(token)
        try:
            sim = _SimThread(sync_fn, args)
            try:
                while not sim.finished:
                    for _ in range(self.rng.randrange(self.max_delay + 1)):
                        await trio.lowlevel.cancel_shielded_checkpoint()
                    if trio.current_effective_deadline() == -math.inf:
                        sim.cancel_requested = True
                        if abandon:  # an abandoned thread finishes on its own; nobody waits
                            sim.run_to_end()
                            await trio.lowlevel.checkpoint()  # raises Cancelled
                    self.pieces.append(self._clock())
                    sim.step()
            finally:
                sim.run_to_end()  # never leave a thread half-way
            assert sim.result is not None
            if isinstance(sim.result, outcome.Error) and isinstance(
                sim.result.error, _ThreadCancelled
            ):
                await trio.lowlevel.checkpoint()  # raises the task's Cancelled
                raise AssertionError("a simulated thread was cancelled but its task was not")
            return sim.result.unwrap()
        finally:
            limiter.release_on_behalf_of(token)


# -- the instrument --------------------------------------------------------------------------
class Stepper(trio.abc.Instrument):
    """Counts task steps while armed; after step ``k`` runs ``disturbance`` (once)."""

    def __init__(self, k: int | None, disturbance: Callable[[], None] | None) -> None:
        self.k = k
        self.disturbance = disturbance
        self.armed = False
        self.steps = 0
        self.fired = False
        self.trace: list[str] = []  # the names of the tasks stepped, for reproducibility checks
        self.error: BaseException | None = None

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        if not self.armed:
            return
        self.steps += 1
        self.trace.append(task.name.rsplit(".", 1)[-1])
        if self.steps == self.k and not self.fired and self.disturbance is not None:
            self.fired = True
            try:
                self.disturbance()
            except BaseException as exc:  # an instrument that raises is disabled: keep it
                self.error = exc


# -- tiers for scenarios ---------------------------------------------------------------------
class SteppedTier(FakeTier):
    """A fake remote tier with a checkpoint per chunk read that can start failing at any step
    (``failing``): the read in progress raises, as a connection dropped mid-load would."""

    def __init__(self, name: str = "remote") -> None:
        super().__init__(name)
        self.failing = False

    async def contains(self, key: ChunkKey) -> bool:
        await trio.lowlevel.checkpoint()
        if self.failing:
            raise ConnectionError("the tier went away")
        return key in self.data

    async def load(self, keys: Sequence[ChunkKey], buffers: Sequence[Buffer]) -> int:
        n = 0
        for key, buf in zip(keys, buffers):
            await trio.lowlevel.checkpoint()
            if self.failing:
                raise ConnectionError("the tier went away")
            payload = self.data.get(key)
            if payload is None:
                break
            buf.write(payload)
            n += 1
        self.stats.chunks_loaded += n
        return n


# -- one run's world -------------------------------------------------------------------------
@dataclass
class Tracked:
    """One started lookup, as seen from outside."""

    lookup_id: str
    seq: int
    skip: int
    hashes: list[int]
    answers: list[int] = field(default_factory=list)
    cancelled_unanswered: str | None = None  # how it was cancelled before its answer
    held_at_answer: bool | None = None


class World:
    """What the operations and disturbances of one run share, and the checks."""

    def __init__(self, scenario: Scenario, tmp: Path | None) -> None:
        self.scenario = scenario
        self.tmp = tmp
        self.engine: Any = None
        self.clock: trio.testing.MockClock | None = None
        self.remote: SteppedTier | None = None
        self.tracked: list[Tracked] = []
        self.current: dict[str, Tracked] = {}
        self.violations: list[str] = []
        self.scopes: dict[str, trio.CancelScope] = {}
        self.payloads: dict[ChunkKey, bytes] = {}  # what was stored under each key
        self.pressure: list[Buffer] = []
        self.transitions: set[tuple[str, str, str]] = set()
        self.by_record: dict[Any, Tracked] = {}
        self._starting: Tracked | None = None

    # -- data ------------------------------------------------------------------------------
    def tokens(self, prompt: str) -> list[int]:
        return self.scenario.prompts[prompt]

    def hashes(self, prompt: str) -> list[int]:
        return list(self.engine.hasher.hash(self.tokens(prompt)))

    def payload(self, chunk_hash: int) -> bytes:
        """Chunk ``chunk_hash``'s payload: its own bytes, of its own length (a multiple of 4,
        so that layerwise chunks split evenly)."""
        rng = random.Random(chunk_hash)
        return rng.randbytes(4 * (CHUNK_BYTES // 8 + rng.randrange(CHUNK_BYTES // 8)))

    def payload_list(self, prompt: str) -> list[bytes]:
        return [self.payload(h) for h in self.hashes(prompt)]

    def key_payloads(self, hashes: Sequence[int]) -> list[tuple[ChunkKey, bytes]]:
        """Each key of ``hashes`` and the bytes stored under it (a layer's part of its
        chunk's payload, in layerwise mode)."""
        kpc = self.engine.config.keys_per_chunk
        keys = self.engine.keys.keys(hashes)
        out = []
        for i, h in enumerate(hashes):
            data = self.payload(h)
            part = len(data) // kpc
            for layer in range(kpc):
                out.append((keys[i * kpc + layer], data[layer * part : (layer + 1) * part]))
        return out

    def note_stored(self, hashes: Sequence[int]) -> None:
        self.payloads.update(self.key_payloads(hashes))

    # -- tracking lookups ------------------------------------------------------------------
    def install(self, engine: Any) -> None:
        """Wrap ``start_lookup`` (an instance attribute: the engine's own calls, e.g. from
        ``lookup_and_prefetch``, go through it too) and watch every record's transitions."""
        self.engine = engine
        start = engine.start_lookup
        engine._lookups.observer = self.observe

        def start_lookup(lookup_id: str, hashes: Sequence[int], offsets: Sequence[int], *,
                         on_answer: Callable[[int], None], **kw: Any) -> Any:  # fmt: skip
            t = Tracked(lookup_id, kw.get("seq", 0), kw.get("skip_chunks", 0), list(hashes))
            self.tracked.append(t)
            self.current[lookup_id] = t

            def answered(hit_tokens: int) -> None:
                t.answers.append(hit_tokens)
                if hit_tokens > 0 and self.current.get(lookup_id) is t:
                    t.held_at_answer = engine.lookup_state(lookup_id) is LookupState.HELD
                on_answer(hit_tokens)

            self._starting = t
            rec = start(lookup_id, hashes, offsets, on_answer=answered, **kw)
            self._starting = None
            return rec

        engine.start_lookup = start_lookup

    def observe(self, rec: Any, frm: LookupState | None, event: str, to: LookupState) -> None:
        """Every transition of every record: in the state table, and a cancel while loading
        noted (the lookup must then answer 0)."""
        if (frm, event, to) not in STATE_TABLE:
            name = "none" if frm is None else frm.name
            self.violations.append(
                f"{rec.lookup_id}: {name} -{event}-> {to.name} is not in the state table"
            )
        self.transitions.add((str(frm and frm.name), event, to.name))
        if event == "start":
            if self._starting is not None:
                self.by_record[rec] = self._starting
            return
        t = self.by_record.get(rec)
        if t is not None and event == "cancel" and frm is LookupState.LOADING:
            t.cancelled_unanswered = "cancelled while loading"

    # -- claims ----------------------------------------------------------------------------
    def check_claim(self, t: Tracked | None, items: list[tuple[ChunkKey, Buffer]],
                    whole: bool) -> None:  # fmt: skip
        """The claimed pairs are a contiguous prefix of ``t``'s chunks with the stored bytes;
        with ``whole``, every chunk its answer counted."""
        if t is None:
            if items:
                self.violations.append(f"a claim of an untracked id got {len(items)} chunks")
            return
        kpc = self.engine.config.keys_per_chunk
        keys = [k for k, _ in items]
        want = self.engine.keys.keys(t.hashes[t.skip : t.skip + len(keys) // kpc])
        if len(keys) % kpc or keys != want:
            self.violations.append(f"{t.lookup_id}: claimed keys are not a contiguous prefix")
        for key, buf in items:
            if key not in self.payloads:
                self.violations.append(f"{t.lookup_id}: claimed a chunk nobody stored")
            elif bytes(buf.view()) != self.payloads[key]:
                self.violations.append(f"{t.lookup_id}: claimed bytes differ from the stored")
        if whole and t.answers and t.answers[0] > 0:
            chunks = len(keys) // kpc
            got = sum(self.scenario.offsets(t)[t.skip : t.skip + chunks])
            skipped = sum(self.scenario.offsets(t)[: t.skip])
            if got + skipped != t.answers[0]:
                self.violations.append(
                    f"{t.lookup_id}: answered {t.answers[0]} tokens but the claim right after "
                    f"the answer got {got + skipped}"
                )

    # -- the end checks --------------------------------------------------------------------
    def check_answers(self) -> None:
        for t in self.tracked:
            name = f"lookup {t.lookup_id!r} seq {t.seq}"
            if len(t.answers) != 1:
                self.violations.append(f"{name}: {len(t.answers)} answers {t.answers}")
                continue
            if t.cancelled_unanswered is not None and t.answers[0] != 0:
                self.violations.append(
                    f"{name}: cancelled ({t.cancelled_unanswered}) before its answer, but "
                    f"answered {t.answers[0]}"
                )
            if t.answers[0] > 0 and t.held_at_answer is False:
                self.violations.append(
                    f"{name}: answered {t.answers[0]} but nothing was held to claim"
                )

    def check_quiescent(self) -> None:
        s = self.engine.statistics()
        now = {
            "inflight_lookups": s.lookups.inflight,
            "held_lookups": s.lookups.held,
            "pinned_chunks": s.pinned_chunks,
            "limiter_used": s.limiter.used,
        }
        for key, value in now.items():
            if value != 0:
                self.violations.append(f"at quiescence: {key} = {value}")
        for tier in self.engine.tiers:
            if tier.pinned_count():
                self.violations.append(f"at quiescence: tier {tier.name} holds pins")
        lookups = self.engine.statistics().lookups
        if lookups.failed:
            self.violations.append("a lookup failed (a bug in lmprefetch passed as a miss)")
        if lookups.started != len(self.tracked):
            self.violations.append(f"{lookups.started} lookups counted, {len(self.tracked)} made")
        if lookups.hits + lookups.misses != lookups.started:
            self.violations.append("answers counted do not add up to the lookups started")
        for key, buf in self.engine.cpu._entries.items():
            if buf.owners != 1:  # the cache's own reference, nobody else's
                self.violations.append(
                    f"at quiescence: cached chunk {key.chunk_hash:x} has {buf.owners} owners"
                )
        outside = s.arena.used_bytes - s.cpu_resident_bytes
        if outside:
            self.violations.append(f"at quiescence: {outside} arena bytes outside the CPU tier")

    def check_closed(self, arena: Any) -> None:
        if arena.used_slots:
            self.violations.append(f"after close: {arena.used_slots} arena slots still in use")


# -- the state table ---------------------------------------------------------------------------
def parse_state_table(doc: str) -> frozenset[tuple[LookupState | None, str, LookupState]]:
    """The ``(from, event, to)`` rows of the Markdown table in a record's docstring: the
    first code span of the event cell is the event; ``(none)`` is "before the record"."""
    rows = set()
    for line in doc.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 4 or cells[0] in ("from", "") or set(cells[0]) <= {"-"}:
            continue
        frm = None if cells[0] == "(none)" else LookupState[cells[0]]
        event = cells[1].split("`")[1]
        rows.add((frm, event, LookupState[cells[2]]))
    return frozenset(rows)


STATE_TABLE = parse_state_table(_Lookup.__doc__ or "")


# -- scenarios -------------------------------------------------------------------------------
Operation = Callable[[World], Awaitable[None]]
Disturbance = Callable[[World], None]


@dataclass
class Scenario:
    """Two to four concurrent operations on one engine, and the disturbances to try."""

    name: str
    prompts: dict[str, list[int]]
    operations: dict[str, Operation]
    disturbances: dict[str, Disturbance]
    cpu: dict[str, int] = field(default_factory=dict)  # prompt -> chunks stored in the CPU tier
    disk: dict[str, int] = field(default_factory=dict)  # prompt -> chunks on disk
    remote: dict[str, int] = field(default_factory=dict)  # prompt -> chunks in a stepped tier
    config: dict[str, Any] = field(default_factory=dict)

    def offsets(self, t: Tracked) -> list[int]:
        return [CHUNK] * len(t.hashes)

    def make_config(self, disk_path: str | None) -> PrefetchConfig:
        base = PrefetchConfig(
            chunk_size=CHUNK,
            chunk_bytes=CHUNK_BYTES,
            cpu_bytes=CHUNK_BYTES * 32,
            arena_prefault_bytes=0,
            lookup_timeout_s=HANG_S / 10,
            tier_timeout_s=HANG_S / 10,
            claim_ttl_s=CLAIM_TTL_S,
            disk_path=disk_path,
            disk_read_threads=2,
        )
        return base.replace(**self.config)


def prompt(first: int, n_chunks: int, shared: Sequence[int] = ()) -> list[int]:
    """``shared`` tokens, then ``n_chunks`` chunks' worth of fresh ones."""
    return [*shared, *range(first, first + n_chunks * CHUNK - len(shared))]


# Operations -----------------------------------------------------------------------------------
def await_lookup(lookup_id: str, name: str, *, claim: bool = True, scope: str | None = None,
                 skip: int = 0) -> Operation:  # fmt: skip
    """``lookup_and_prefetch`` (in the cancel scope ``scope``), then claim the result."""

    async def op(w: World) -> None:
        engine = w.engine
        hashes = w.hashes(name)
        cs = w.scopes.setdefault(scope, trio.CancelScope()) if scope else trio.CancelScope()
        got: list[int] = []
        with cs:
            got.append(
                await engine.lookup_and_prefetch(
                    lookup_id, hashes, [CHUNK] * len(hashes), skip_chunks=skip
                )
            )
        if got and claim:
            t = w.current.get(lookup_id)
            with engine.claim(lookup_id) as items:
                w.check_claim(t, items, whole=False)

    return op


def start_lookup(lookup_id: str, name: str, *, claim_on_answer: bool = True,
                 seq: int = 0) -> Operation:  # fmt: skip
    """``start_lookup`` whose answer callback claims at once (the server's pattern: whoever
    the answer reaches may claim immediately), then wait for the answer."""

    async def op(w: World) -> None:
        engine = w.engine
        hashes = w.hashes(name)
        done = trio.Event()

        def on_answer(hit_tokens: int) -> None:
            done.set()
            if claim_on_answer and hit_tokens > 0:
                t = w.current.get(lookup_id)
                items = engine.take(lookup_id)
                try:
                    w.check_claim(t, items, whole=True)
                finally:
                    engine.arena.release_all([b for _, b in items])

        engine.start_lookup(lookup_id, hashes, [CHUNK] * len(hashes), on_answer=on_answer,
                            seq=seq)  # fmt: skip
        await done.wait()

    return op


def store(name: str, *, scope: str | None = None) -> Operation:
    async def op(w: World) -> None:
        cs = w.scopes.setdefault(scope, trio.CancelScope()) if scope else trio.CancelScope()
        with cs:
            w.note_stored(w.hashes(name))  # the bytes a claim may see from now on
            await w.engine.store(w.tokens(name), w.payload_list(name))

    return op


def hold_limiter(weight: int, checkpoints: int) -> Operation:
    async def op(w: World) -> None:
        async with w.engine.limiter.hold(weight):
            for _ in range(checkpoints):
                await trio.lowlevel.checkpoint()

    return op


def idle(checkpoints: int) -> Operation:
    async def op(w: World) -> None:
        for _ in range(checkpoints):
            await trio.lowlevel.checkpoint()

    return op


# Disturbances ---------------------------------------------------------------------------------
def cancel(lookup_id: str) -> Disturbance:
    return lambda w: w.engine.cancel(lookup_id)


def cancel_scope(name: str) -> Disturbance:
    return lambda w: w.scopes.setdefault(name, trio.CancelScope()).cancel()


def reuse(lookup_id: str, name: str) -> Disturbance:
    """Start a new lookup under a running id (a preempted request that comes back)."""

    def act(w: World) -> None:
        hashes = w.hashes(name)

        def on_answer(hit_tokens: int) -> None:  # the new lookup's result is left to expire
            pass

        w.engine.start_lookup(lookup_id, hashes, [CHUNK] * len(hashes), on_answer=on_answer,
                              seq=99)  # fmt: skip

    return act


def close_engine(w: World) -> None:
    w.engine._close()


def expire(w: World) -> None:
    assert w.clock is not None
    w.clock.jump(CLAIM_TTL_S + 1)


def fail_remote(w: World) -> None:
    assert w.remote is not None
    w.remote.failing = True


def disk_file(name: str, chunk: int, how: str) -> Disturbance:
    """Delete, truncate, or replace (by another chunk's file) one chunk file."""

    def act(w: World) -> None:
        disk = next(t for t in w.engine.tiers if isinstance(t, DiskTier))
        hashes = w.hashes(name)
        path = Path(disk._file_path(w.engine.keys.keys([hashes[chunk]])[0]))
        if how == "delete":
            path.unlink(missing_ok=True)
        elif how == "truncate":
            if path.exists():
                os.truncate(path, path.stat().st_size // 2)
        else:  # replace by the file of chunk 0, which names another key
            other = Path(disk._file_path(w.engine.keys.keys([hashes[0]])[0]))
            if other.exists():
                shutil.copyfile(other, path)

    return act


def pass_load_deadline(w: World) -> None:
    """Jump the clock past every running lookup's ``load_deadline_s`` (:data:`DEADLINE_S`)."""
    assert w.clock is not None
    w.clock.jump(DEADLINE_S + 1)


class DropLast:
    """A load policy that always drops the hit's last chunk (named in a scenario's config as
    ``tests.schedules:DropLast``): every lookup truncates, so the explorer walks the path
    where loads start after the policy decided and dropped chunks' pins are released."""

    def chunks_to_load(self, request: Any) -> int:
        return max(0, int(request.hit_chunks) - 1)


def take_arena(w: World) -> None:
    """Take every free arena slot (released when the operations end)."""
    w.pressure.extend(w.engine.arena.allocate_many(w.engine.arena.free_slots))


# -- running ---------------------------------------------------------------------------------
@dataclass
class RunReport:
    scenario: str
    seed: int
    k: int | None
    disturbance: str | None
    steps: int
    violations: list[str]
    trace: list[str]
    thread_steps: list[int]

    def describe(self) -> str:
        where = f"{self.scenario}:{self.seed}:{self.k}:{self.disturbance}"
        return f"[{where}] " + "; ".join(self.violations)


class _DiskTemplates:
    """Per scenario, a disk directory written once (by a real engine) and copied per run."""

    def __init__(self) -> None:
        self._root = Path(tempfile.mkdtemp(prefix="lmprefetch-schedules-"))
        self._made: dict[str, Path] = {}
        # One set of templates per process, kept for its whole life: removed as it exits
        # (the suite left one directory in the system's temporary directory per run).
        atexit.register(self.close)

    def get(self, scenario: Scenario) -> Path:
        if scenario.name not in self._made:
            path = self._root / scenario.name
            config = scenario.make_config(str(path))

            async def write() -> None:
                async with open_engine(config) as engine:
                    w = World(scenario, None)
                    w.engine = engine
                    for name, n in scenario.disk.items():
                        await engine.store(w.tokens(name)[: n * CHUNK], w.payload_list(name)[:n])
                    await engine.flush()

            trio.run(write)
            self._made[scenario.name] = path
        return self._made[scenario.name]

    def close(self) -> None:
        shutil.rmtree(self._root, ignore_errors=True)


_templates: _DiskTemplates | None = None


def _disk_template(scenario: Scenario) -> Path:
    global _templates
    if _templates is None:
        _templates = _DiskTemplates()
    return _templates.get(scenario)


@contextlib.contextmanager
def _quiet_logs() -> Iterator[None]:
    """Tier failures and corrupt files are logged as warnings; thousands of runs need not
    print them (a lookup that failed is still caught: ``lookups_failed`` is checked)."""
    logger = logging.getLogger("lmprefetch")
    level = logger.level
    logger.setLevel(logging.DEBUG if os.environ.get("LMPF_SCHEDULE_LOGS") else logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def run_once(scenario: Scenario, seed: int, k: int | None = None,
             disturbance: str | None = None) -> RunReport:  # fmt: skip
    """Run ``scenario`` under ``seed``, disturbed by ``disturbance`` after step ``k``."""
    rng = random.Random(seed * 7919 + 1)
    stepper = Stepper(k, None)
    threads = SimulatedThreads(rng, clock=lambda: stepper.steps)
    with contextlib.ExitStack() as stack:
        run_dir: Path | None = None
        if scenario.disk:
            run_dir = Path(stack.enter_context(tempfile.TemporaryDirectory()))
            shutil.copytree(_disk_template(scenario), run_dir / "disk")
        w = World(scenario, run_dir)
        act = scenario.disturbances[disturbance] if disturbance is not None else None
        stepper.disturbance = (lambda: act(w)) if act is not None else None
        clock = trio.testing.MockClock(autojump_threshold=0)
        w.clock = clock
        stack.enter_context(deterministic_scheduler(seed))
        stack.enter_context(_quiet_logs())
        stack.enter_context(threads.installed())
        try:
            trio.run(_main, w, stepper, clock=clock, instruments=[stepper])
        except BaseException as exc:  # a failed check or a hang, with its schedule
            if isinstance(exc, KeyboardInterrupt):
                raise
            w.violations.append(f"the run raised {exc!r}")
        if stepper.error is not None:
            w.violations.append(f"the disturbance raised {stepper.error!r}")
        if k is not None and act is not None and not stepper.fired:
            w.violations.append(f"step {k} was never reached")
    return RunReport(scenario.name, seed, k, disturbance, stepper.steps, w.violations,
                     stepper.trace, threads.pieces)  # fmt: skip


async def _main(w: World, stepper: Stepper) -> None:
    scenario = w.scenario
    disk_path = str(w.tmp / "disk") if w.tmp is not None and scenario.disk else None
    config = scenario.make_config(disk_path)
    extra: list[BaseTier] = []
    if scenario.remote:
        w.remote = SteppedTier()
        extra.append(w.remote)
    with trio.fail_after(HANG_S):
        async with open_engine(config, extra_tiers=extra) as engine:
            w.install(engine)
            arena = engine.arena
            for name, n in scenario.cpu.items():
                hashes = w.hashes(name)[:n]
                w.note_stored(hashes)
                await engine.store_hashes(hashes, w.payload_list(name)[:n])
            await engine.flush()
            for name in scenario.disk:
                w.note_stored(w.hashes(name))
            if w.remote is not None:
                for name, n in scenario.remote.items():
                    hashes = w.hashes(name)[:n]
                    w.note_stored(hashes)
                    w.remote.data.update(w.key_payloads(hashes))
            stepper.armed = True
            try:
                async with trio.open_nursery() as nursery:
                    for op_name, op in scenario.operations.items():
                        nursery.start_soon(op, w, name=op_name)
            finally:
                stepper.armed = False
            engine.arena.release_all(w.pressure)
            w.pressure.clear()
            # Quiescence: held results expire, every task ends.
            await trio.sleep(CLAIM_TTL_S + 1)
            await engine.wait_quiet()
            w.check_answers()
            w.check_quiescent()
    w.check_closed(arena)


@dataclass
class Exploration:
    runs: int = 0
    schedules: int = 0
    wall_s: float = 0.0
    violations: list[RunReport] = field(default_factory=list)
    per_scenario: dict[str, int] = field(default_factory=dict)


def explore(scenarios: Sequence[Scenario], seeds: Sequence[int], *, every_disturbance: bool,
            stride: int = 1, stop_after: int = 5) -> Exploration:  # fmt: skip
    """Run each scenario under each seed: undisturbed, then disturbed after every
    ``stride``-th step (with every disturbance, or one per step in turn)."""
    result = Exploration()
    t0 = time.perf_counter()
    for scenario in scenarios:
        names = list(scenario.disturbances)
        runs = 0
        for seed in seeds:
            base = run_once(scenario, seed)
            runs += 1
            if base.violations:
                result.violations.append(base)
            for k in range(1, base.steps + 1, stride):
                chosen = names if every_disturbance else [names[(seed + k) % len(names)]]
                for name in chosen:
                    report = run_once(scenario, seed, k, name)
                    runs += 1
                    if report.violations:
                        result.violations.append(report)
                        if len(result.violations) >= stop_after:
                            break
                if len(result.violations) >= stop_after:
                    break
            if len(result.violations) >= stop_after:
                break
        result.per_scenario[scenario.name] = runs
        result.runs += runs
        if len(result.violations) >= stop_after:
            break
    result.schedules = result.runs
    result.wall_s = time.perf_counter() - t0
    return result


# -- the scenarios ---------------------------------------------------------------------------
P = prompt(1000, 6)
Q = prompt(5000, 5, shared=P[: 3 * CHUNK])  # shares P's first 3 chunks
R = prompt(9000, 10)


def scenarios() -> list[Scenario]:
    return [
        Scenario(
            "overlap_cpu_disk",
            prompts={"P": P, "Q": Q},
            cpu={"P": 2},
            disk={"P": 5},
            operations={
                "A": await_lookup("a", "P", scope="a"),
                "B": start_lookup("b", "Q"),
            },
            disturbances={
                "cancel_a": cancel("a"),
                "cancel_b": cancel("b"),
                "caller_a": cancel_scope("a"),
                "reuse_b": reuse("b", "Q"),
                "close": close_engine,
                "delete_3": disk_file("P", 3, "delete"),
                "truncate_2": disk_file("P", 2, "truncate"),
                "replace_4": disk_file("P", 4, "replace"),
                "expire": expire,
            },
        ),
        Scenario(
            "remote_fails",
            prompts={"P": P},
            cpu={"P": 1},
            remote={"P": 6},
            operations={
                "A": start_lookup("a", "P"),
                "B": await_lookup("b", "P", scope="b"),
            },
            disturbances={
                "fail": fail_remote,
                "cancel_a": cancel("a"),
                "caller_b": cancel_scope("b"),
                "reuse_a": reuse("a", "P"),
                "close": close_engine,
            },
        ),
        Scenario(
            "cpu_hit_claim_expiry",
            prompts={"P": P, "Q": Q},
            cpu={"P": 6},
            operations={
                "A": start_lookup("a", "P", claim_on_answer=False),
                "B": await_lookup("b", "Q", scope="b"),
                "C": idle(3),
            },
            disturbances={
                "expire": expire,
                "cancel_a": cancel("a"),
                "caller_b": cancel_scope("b"),
                "reuse_a": reuse("a", "P"),
                "close": close_engine,
            },
        ),
        Scenario(
            "store_during_lookup",
            prompts={"P": P, "Q": Q},
            disk={"P": 4},
            operations={
                "S": store("Q", scope="s"),
                "A": await_lookup("a", "P", scope="a"),
                "B": start_lookup("b", "Q"),
            },
            disturbances={
                "caller_s": cancel_scope("s"),
                "cancel_b": cancel("b"),
                "take_arena": take_arena,
                "close": close_engine,
                "delete_1": disk_file("P", 1, "delete"),
            },
        ),
        Scenario(
            "pressure",
            prompts={"P": P, "R": R},
            disk={"P": 6, "R": 10},
            config={"cpu_bytes": CHUNK_BYTES * 16},  # a limiter of 8 chunks
            operations={
                "A": await_lookup("a", "P", scope="a"),
                "B": start_lookup("b", "R"),
                "L": hold_limiter(6, 4),
            },
            disturbances={
                "take_arena": take_arena,
                "cancel_b": cancel("b"),
                "caller_a": cancel_scope("a"),
                "close": close_engine,
                "replace_7": disk_file("R", 7, "replace"),
            },
        ),
        Scenario(
            "layerwise_skip",
            prompts={"P": P, "Q": Q},
            cpu={"P": 2},
            disk={"P": 5},
            config={"layerwise": True, "num_layers": 2},
            operations={
                "A": await_lookup("a", "P", scope="a", skip=1),
                "B": start_lookup("b", "Q"),
                "C": await_lookup("c", "P", scope="c"),
            },
            disturbances={
                "cancel_a": cancel("a"),
                "caller_c": cancel_scope("c"),
                "reuse_b": reuse("b", "Q"),
                "delete_3": disk_file("P", 3, "delete"),
                "take_arena": take_arena,
                "close": close_engine,
            },
        ),
        Scenario(
            "policy_deadline",
            prompts={"P": P, "Q": Q},
            cpu={"P": 2},
            disk={"P": 5},
            remote={"P": 6},
            config={"load_policy": "tests.schedules:DropLast", "load_deadline_s": DEADLINE_S},
            operations={
                "A": await_lookup("a", "P", scope="a"),
                "B": start_lookup("b", "Q"),
            },
            disturbances={
                "deadline": pass_load_deadline,
                "cancel_a": cancel("a"),
                "caller_a": cancel_scope("a"),
                "reuse_b": reuse("b", "Q"),
                "fail": fail_remote,
                "close": close_engine,
                "delete_3": disk_file("P", 3, "delete"),
            },
        ),
        Scenario(
            "id_reuse",
            prompts={"P": P, "Q": Q},
            disk={"P": 6},
            operations={
                "A": start_lookup("x", "P", seq=1),
                "B": start_lookup("x", "Q", seq=2),
            },
            disturbances={
                "cancel_x": cancel("x"),
                "reuse_x": reuse("x", "P"),
                "close": close_engine,
                "expire": expire,
            },
        ),
    ]


def by_name(name: str) -> Scenario:
    return next(s for s in scenarios() if s.name == name)


__all__ = [
    "Exploration",
    "RunReport",
    "Scenario",
    "by_name",
    "explore",
    "run_once",
    "scenarios",
]
