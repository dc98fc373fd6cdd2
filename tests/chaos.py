"""The chaos session: real worker processes killed, paused, their chunk files damaged and their
disk filled, while one `LookupClient` is used from 8 threads; invariants checked all along.

Run it from the repository root::

    python -m tests.chaos                      # 180 s of faults, seed 1
    python -m tests.chaos --seconds 600 --seed 7 --report docs/reliability.md
    python -m tests.chaos --smoke              # the short scripted run the test suite uses
    python -m tests.chaos --smoke --mooncake   # ... with the Mooncake tier in it

With ``--mooncake`` every rank also has the Mooncake tier (after the disk), on a
``mooncake_master`` and a standalone store process the driver starts (each rank also gives
the pool a small segment of its own), all in a private network namespace; part of the corpus
is kept in Mooncake only (forgotten by the CPU and disk tiers), so the traffic's lookups load
from Mooncake and their claims check its bytes; and one more fault kind comes in: **master**
(SIGKILL of the master, targeted while a lookup's Mooncake load is held before its transfer,
or blind, then a restart: the restarted master has lost its index, so the Mooncake-only corpus
is stored again once every rank's tier works again).

(``nox -s chaos`` runs the first form and writes the figures to ``docs/reliability.md``.)

What runs:

* Two worker processes (``Settings.ranks``), each a :class:`~lmprefetch.WorkerRuntime` serving
  lookups over ipc, with a CPU tier several times smaller than the data and a disk tier; both
  ranks share one ``disk_path`` (each indexes, evicts and cleans up only its own files).  A
  control pipe per worker stores prompts, claims held lookups and reads stats.  Every chunk's
  payload is a pure function of ``(rank, chunk hash)``, so the driver knows the right bytes of
  every chunk.
* Eight traffic threads share **one** `LookupClient`: they look prompts up (whole, partial,
  with unknown tails; half with precomputed hashes, which sends from the calling thread),
  cancel some mid-lookup, claim answered ones on every rank and check the claimed bytes, or
  cancel them; now and then they store a prompt.
* A fault thread injects faults on a seeded random schedule for ``--seconds`` (or, with
  ``--smoke``, a fixed list with one to three of each kind): **kill** (SIGKILL, then a restart
  as a supervisor would: the new process must index exactly the chunk files the old one left
  and remove exactly its stale temporary files; rank 0 is never killed, so one process lives
  through the whole run), **pause** (SIGSTOP until every thread stopped, then SIGCONT),
  **delete**, **truncate** and **corrupt** a chunk file (a flipped payload or header byte, or
  another chunk's file in its place), and **full disk** (the shared directory is a small
  tmpfs, filled to the last page).  Half the faults are *targeted*: they set up a case whose
  outcome is known exactly (a worker killed while a disk read is held inside a lookup's load,
  or while a chunk file is half written; a file damaged while the load that reads it waits
  before its first read; a lookup sent to a stopped worker; a store while the disk is full)
  and check that outcome.  The others are *blind*: a random rank or file at a random moment.
* A monitor thread reads every live worker's stats twice a second and checks the invariants
  that must hold at any time; the traffic threads check every answer and every claimed chunk.

Checked at the end: every lookup was submitted once and answered or timed out to 0 at most
once (the client's counters against the driver's, no duplicate answer, none pending); no chunk
with wrong bytes; on every live worker ``answers_sent == requests_accepted``, the conservation
invariant (no lookup in flight or held, no pin, limiter 0, arena bytes = CPU tier bytes),
``lookups_failed == 0``, ``lookups_expired == 0`` (every held result was claimed or cancelled:
one that expired had its cleanup lost) and no error logged; no file descriptor, thread or
ZeroMQ thread left after closing the client and the workers; RSS growth of the processes that
were never killed (reported; bounded in a full run).

The full disk needs a tmpfs.  The driver re-executes itself under ``unshare --mount`` (as
root) or ``unshare --user --map-root-user --mount`` (as a normal user, where the kernel allows
user namespaces), so the tmpfs is private to this run and disappears with it; inside, it mounts
``tmpfs -o size=…`` and puts ``disk_path`` there.  ``ENOSPC`` then comes from the real
``write`` calls of the disk tier.  Without a tmpfs the run goes on with ``disk_path`` in a
normal temporary directory, and says that the full-disk fault was not run, and why.

Waits: every wait is on a pipe, a condition or a process, with a deadline that only bounds a
hang.  The only ``time.sleep`` calls are in the fault thread of this driver process (spacing
faults and holding a blind pause), never in a worker and never on a Trio thread.
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import multiprocessing as mp
import os
import platform
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import xxhash

from lmprefetch import ChunkHasher, LookupClient, PrefetchConfig
from lmprefetch.tiers.chunkfile import FILE_SUFFIX, HEADER, HEADER_BYTES, TEMP_SUFFIX, parse_name

CHUNK = 16  # tokens per chunk
CHUNK_BYTES = 4096  # payload bytes per chunk (a chunk file is 4 KiB of header + this)
FILE_BYTES = HEADER_BYTES + CHUNK_BYTES
MiB = 1 << 20
_IN_NAMESPACE = "LMPF_CHAOS_NAMESPACE"
KINDS = ("kill", "pause", "delete", "truncate", "corrupt", "full_disk", "master")
#: The smoke run's faults, in this order: (kind[:variant], targeted).
SMOKE_FAULTS: list[tuple[str, bool]] = [
    ("kill", True),  # with a disk read held inside a load
    ("kill", True),  # with a chunk file half written
    ("pause", True),
    ("delete", True),
    ("truncate", True),
    ("corrupt:payload", True),  # each check of a chunk file read once: the checksum,
    ("corrupt:header", True),  # the header's fields,
    ("corrupt:other-key", True),  # the key
    ("full_disk", True),
    ("kill", False),
    ("pause", False),
    ("delete", False),
    ("truncate", False),
    ("corrupt", False),
]
#: Added to the smoke run with ``--mooncake``.
SMOKE_MOONCAKE_FAULTS: list[tuple[str, bool]] = [("master", True), ("master", False)]


def payload(rank: int, chunk_hash: int) -> bytes:
    """The one right payload of a chunk on a rank."""
    return random.Random((rank << 64) | chunk_hash).randbytes(CHUNK_BYTES)


def digest(data: Any) -> int:
    return xxhash.xxh3_64_intdigest(data)


def prompt(space: int, index: int, n_chunks: int) -> list[int]:
    """Token ids of a prompt; ``(space, index)`` pairs never share a first token."""
    base = (space << 48) + (index << 16)
    return [base + j for j in range(n_chunks * CHUNK)]


# ---------------------------------------------------------------------------------------------
# The worker process
# ---------------------------------------------------------------------------------------------
def _worker_main(
    conn: Connection,
    config_dict: dict[str, Any],
    rank: int,
    world_size: int,
    request_endpoint: str,
    response_endpoint: str,
    preload: list[list[int]],
    hang_s: float,
) -> None:
    """One rank: a WorkerRuntime serving lookups, driven through ``conn``."""
    import logging

    import trio

    from lmprefetch import WorkerRuntime

    log_counts: Counter[str] = Counter()
    log_errors: list[str] = []

    class _Count(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            log_counts[record.levelname] += 1
            if record.levelno >= logging.ERROR and len(log_errors) < 20:
                log_errors.append(self.format(record))

    root = logging.getLogger()
    root.setLevel(logging.WARNING)
    root.addHandler(_Count())
    to_stderr = logging.StreamHandler()
    to_stderr.setLevel(logging.ERROR)
    root.addHandler(to_stderr)

    config = PrefetchConfig.from_dict(config_dict)
    failures: list[BaseException] = []
    runtime = WorkerRuntime.start(
        config,
        rank=rank,
        world_size=world_size,
        request_endpoint=request_endpoint,
        response_endpoint=response_endpoint,
        on_failure=failures.append,
    )
    engine = runtime.engine
    (disk,) = [t for t in engine.tiers if t.name == "disk"]
    mooncake = next((t for t in engine.tiers if t.name == "mooncake"), None)
    hasher = ChunkHasher(config.chunk_size, config.hash_algorithm)
    gate: dict[str, threading.Event] = {}
    gets: dict[str, Any] = {}

    def store(prompts: list[list[int]], where: bool | str) -> int:
        """Store prompts on every tier; ``where`` ``True`` (the disk) or ``"mooncake"``: the
        next lookup of these must load them from there (the tiers before it forget them)."""
        stored = 0
        for tokens in prompts:
            hashes = hasher.hash(tokens)
            stored += runtime.store_hashes(hashes, [payload(rank, h) for h in hashes])
        runtime.call(engine.flush)  # on disk (or dropped, counted) before this returns
        if where:

            async def forget() -> None:
                for tokens in prompts:
                    for key in engine.keys.keys(hasher.hash(tokens)):
                        engine.cpu.discard(key)
                        if where == "mooncake":
                            await disk.remove(key)

            runtime.call(forget)
        return stored

    async def settle_mooncake(prompts: list[list[int]], timeout_s: float) -> bool:
        """Store ``prompts`` Mooncake-only until every chunk of them is in Mooncake (after a
        master restart the client mounts its segment again, and the tier may be backing
        off: each new try waits for the end of the backoff).  ``False`` past the deadline."""
        assert mooncake is not None
        with trio.move_on_after(timeout_s):
            await mooncake.wait_connected()
            while True:
                keys = [k for t in prompts for k in engine.keys.keys(hasher.hash(t))]
                if await mooncake.contains_prefix(keys, pin=False) == len(keys):
                    return True
                await trio.sleep_until(mooncake.retry_at)
                await trio.to_thread.run_sync(store, prompts, "mooncake")
        return False

    def hold_gets() -> None:
        """Every Mooncake get-into waits in its thread until ``release_gets``: a lookup that
        loads from Mooncake is then held inside its load."""
        from lmprefetch.tiers import mooncake as mooncake_module

        reached, opened = threading.Event(), threading.Event()
        real = mooncake_module.calls.get_into

        def held(*args: Any) -> Any:
            reached.set()
            opened.wait(hang_s)
            return real(*args)

        mooncake_module.calls.get_into = held
        gets.update(reached=reached, opened=opened, real=real)

    def release_gets() -> None:
        from lmprefetch.tiers import mooncake as mooncake_module

        mooncake_module.calls.get_into = gets["real"]
        gets["opened"].set()

    def hold_reads(paths: list[str]) -> None:
        """Every read of one of these chunk files waits in its thread until ``release_reads``
        (other reads go on): the lookup that reads them is then held inside its load."""
        reached, opened, held_paths = threading.Event(), threading.Event(), set(paths)
        read = disk._read_chunk

        def held(path: str, *args: Any) -> Any:
            if path in held_paths:
                reached.set()
                opened.wait(hang_s)
            return read(path, *args)

        disk._read_chunk = held
        gate.update(reached=reached, opened=opened)

    def release_reads() -> None:
        gate["opened"].set()
        del disk._read_chunk  # the instance attribute: back to the class's method

    def store_with_held_write(tokens: list[int]) -> bool:
        """Store a prompt, and stop the first of its disk writes half-way: the temporary file
        holds a few bytes and the writer thread waits (until the process is killed).  Returns
        once that write is held.  One command, so no other command (a store that waits for
        its writes) can come in between on the pipe."""
        from lmprefetch.tiers import chunkfile

        reached, real = threading.Event(), chunkfile.write_file

        def held(
            final: str, temp: str, key_bytes: bytes, data: memoryview, **kwargs: Any
        ) -> None:
            chunkfile.write_file = real  # only this one write is held
            with open(temp, "wb") as f:
                f.write(b"LMPF")  # a torn write, as a crash leaves it
            reached.set()
            threading.Event().wait(hang_s)
            real(final, temp, key_bytes, data, **kwargs)

        def patch() -> None:
            chunkfile.write_file = held

        runtime.call(patch)
        hashes = hasher.hash(tokens)
        runtime.store_hashes(hashes, [payload(rank, h) for h in hashes])
        return reached.wait(hang_s)

    async def quiesce(timeout_s: float) -> bool:
        with trio.move_on_after(timeout_s):
            await engine.wait_quiet()
            return True
        return False

    def held_now() -> list[tuple[str, int, str]]:
        """The lookups the engine still tracks (a diagnostic for a failed end check)."""
        records = list(engine._lookups.by_id.values())
        return [(r.lookup_id, r.seq, r.state.name) for r in records]

    def claim(lookup_id: str) -> list[tuple[int, int, int]]:
        out = []
        with runtime.claim(lookup_id) as items:
            for key, buf in items:
                with buf.view() as view:
                    out.append((key.chunk_hash, view.nbytes, digest(view)))
        return out

    def stats() -> dict[str, Any]:
        s = runtime.stats()
        s["mooncake_connected"] = None if mooncake is None else mooncake.connected
        s["disk_chunks"] = runtime.call(len, disk)
        s["disk_used_bytes"] = disk.used_bytes
        s["disk_capacity_bytes"] = disk.capacity_bytes
        s["corrupt_files_removed"] = disk.corrupt_files_removed
        s["stale_temp_files_removed"] = disk.stale_temp_files_removed
        s["log_counts"] = dict(log_counts)
        s["log_errors"] = list(log_errors)
        s["runtime_failures"] = [repr(e) for e in failures]
        return s

    commands: dict[str, Callable[[Any], Any]] = {
        "stats": lambda _: stats(),
        "claim": claim,
        "store": lambda arg: store(arg[0], arg[1]),
        "store_with_held_write": store_with_held_write,
        "files": lambda tokens: [
            disk._file_path(k) for k in engine.keys.keys(hasher.hash(tokens))
        ],
        "hold_reads": lambda paths: runtime.call(hold_reads, paths),
        "wait_read_held": lambda t: gate["reached"].wait(float(t)),
        "release_reads": lambda _: runtime.call(release_reads),
        "quiesce": lambda t: runtime.call(quiesce, float(t)),
        "settle_mooncake": lambda arg: runtime.call(settle_mooncake, arg[0], float(arg[1])),
        "hold_gets": lambda _: runtime.call(hold_gets),
        "wait_get_held": lambda t: gets["reached"].wait(float(t)),
        "release_gets": lambda _: runtime.call(release_gets),
        "held": lambda _: runtime.call(held_now),
    }
    store(preload, False)
    conn.send((
        "ok",
        {
            "pid": os.getpid(),
            "disk_chunks": runtime.call(len, disk),
            "stale_temp_files_removed": disk.stale_temp_files_removed,
        },
    ))
    while True:
        try:
            cmd, arg = conn.recv()
        except EOFError:  # the driver is gone
            runtime.close()
            return
        if cmd == "close":
            arena = engine.arena
            runtime.close()
            conn.send(("ok", arena.used_slots))
            return
        try:
            conn.send(("ok", commands[cmd](arg)))
        except Exception as exc:
            conn.send(("err", f"{cmd}: {exc!r}\n{traceback.format_exc()}"))


# ---------------------------------------------------------------------------------------------
# The driver
# ---------------------------------------------------------------------------------------------
class WorkerGone(Exception):
    """The worker process died (killed) while or before it was asked."""


class Hang(Exception):
    """Something did not happen before a deadline that only bounds a hang."""


class Worker:
    """One rank's process, its control pipe, and what the driver knows about it."""

    def __init__(self, harness: Harness, rank: int, endpoint: str) -> None:
        self.h = harness
        self.rank = rank
        self.endpoint = endpoint
        self.lock = threading.Lock()  # one request/answer on the pipe at a time
        self.generation = 0
        self.killed = False  # ever killed (so never a "surviving" process)
        self.paused = False
        self.process: Any = None
        self.conn: Connection | None = None
        self.pid = 0
        self.rss_baseline_kib = 0
        self.rss_max_kib = 0

    def start(self, preload: list[list[int]]) -> dict[str, Any]:
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(
            target=_worker_main,
            args=(child, self.h.config.to_dict(), self.rank, self.h.s.ranks, self.endpoint,
                  self.h.response_endpoint, preload, self.h.s.hang_s),
            daemon=True,
            name=f"chaos-rank{self.rank}",
        )
        proc.start()
        child.close()
        if not parent.poll(self.h.s.hang_s + 60):
            proc.kill()
            raise Hang(f"rank {self.rank} did not start")
        try:
            status, ready = parent.recv()
        except EOFError:
            proc.join(self.h.s.hang_s)
            raise RuntimeError(
                f"rank {self.rank} failed to start (exit code {proc.exitcode}; see its stderr)"
            ) from None
        assert status == "ok", ready
        self.process, self.conn, self.pid = proc, parent, ready["pid"]
        self.generation += 1
        return dict(ready)

    def ask(self, cmd: str, arg: Any = None) -> Any:
        with self.lock:
            conn = self.conn
            if conn is None:
                raise WorkerGone(self.rank)
            try:
                conn.send((cmd, arg))
                if not conn.poll(self.h.s.hang_s):
                    self.h.abort(f"rank {self.rank} did not answer {cmd!r} in {self.h.s.hang_s} s")
                    raise Hang(cmd)
                status, value = conn.recv()
            except (EOFError, OSError) as exc:
                raise WorkerGone(self.rank) from exc
        if status != "ok":
            raise RuntimeError(f"rank {self.rank}: {value}")
        return value

    def kill_and_restart(self) -> dict[str, Any]:
        """SIGKILL, wait for the death, restart on the same disk, and check what it found."""
        os.kill(self.pid, signal.SIGKILL)
        self.process.join(self.h.s.hang_s)
        if self.process.is_alive():
            raise Hang(f"rank {self.rank} survived SIGKILL")
        self.paused = False
        self.killed = True
        with self.lock:
            assert self.conn is not None
            self.conn.close()
            self.conn = None
            self.process.close()
        kv, tmp = self.h.own_files(self.rank)
        ready = self.start([])
        self.h.count("restarts")
        if ready["disk_chunks"] != len(kv) or ready["stale_temp_files_removed"] != len(tmp):
            self.h.violation(
                f"rank {self.rank} restarted with {ready['disk_chunks']} chunks indexed and "
                f"{ready['stale_temp_files_removed']} temp files removed; the disk held "
                f"{len(kv)} chunk files and {len(tmp)} temp files of this rank"
            )
        else:
            self.h.count("restarts_found_disk")
            self.h.count("chunk_files_found_after_restart", len(kv))
            self.h.count("stale_temp_files_removed_on_restart", len(tmp))
        return ready

    def pause(self) -> None:
        """SIGSTOP, and wait until every thread of the process has stopped.

        ``kill`` only queues the signal: on a busy machine the thread that takes it may wait
        for a CPU while the process's other threads go on (and answer a lookup) for a few
        milliseconds.  ``waitpid(WUNTRACED)`` returns once the group stop is complete (the
        workers are this process's children; multiprocessing never asks for stop reports).
        """
        self.paused = True
        os.kill(self.pid, signal.SIGSTOP)
        waiter = threading.Thread(target=os.waitpid, args=(self.pid, os.WUNTRACED), daemon=True)
        waiter.start()
        waiter.join(self.h.s.hang_s)
        if waiter.is_alive():
            raise Hang(f"rank {self.rank} did not stop")

    def resume(self) -> None:
        os.kill(self.pid, signal.SIGCONT)
        self.paused = False

    def rss_kib(self) -> int:
        return _rss_kib(self.pid)

    def close(self) -> int | None:
        used = None
        with suppress(WorkerGone, Hang):
            used = self.ask("close")
        if self.process is not None:
            self.process.join(self.h.s.hang_s)
            if self.process.is_alive():
                self.process.kill()
                self.process.join(10)
            self.process.close()
        if self.conn is not None:
            self.conn.close()
            self.conn = None
        return used


def _rss_kib(pid: int | str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def _open_fds() -> dict[int, str]:
    out = {}
    for name in os.listdir("/proc/self/fd"):
        with suppress(FileNotFoundError):
            out[int(name)] = os.readlink(f"/proc/self/fd/{name}")
    return out


@dataclass
class Settings:
    seconds: float = 180.0
    seed: int = 1
    smoke: bool = False
    ranks: int = 2
    threads: int = 8
    corpus_prompts: int = 64  # stored by every rank at start
    pool_prompts: int = 16  # stored by the traffic threads during the run (misses until then)
    prompt_chunks: int = 8
    lookup_timeout_s: float = 2.0
    hang_s: float = 120.0
    #: Per rank.  The data a default run writes (corpus, pool and the scenarios' fresh
    #: prompts: some 8 MiB) stays below it, so the tier evicts nothing and a full file system
    #: refuses every write of the full-disk fault (longer runs may reach it: see full_disk).
    disk_bytes: int = 12 * MiB
    #: The arena.  Every lookup either loads or is held, with at most 10 chunks, and each rank
    #: has at most ~12 at once (8 threads, a scenario, late ones): 120 slots even if no CPU
    #: entry could be evicted, so a load never finds the arena full (which would shorten an
    #: answer the scenarios check exactly).  The corpus is several times larger, so most
    #: lookups load from disk.
    cpu_chunks: int = 192
    rss_bound_mib: float = 64.0
    #: The Mooncake tier on every rank (``--mooncake``), with this many prompts kept in
    #: Mooncake only.
    mooncake: bool = False
    mooncake_prompts: int = 16

    @classmethod
    def smoke_run(cls, seed: int) -> Settings:
        return cls(seconds=0, seed=seed, smoke=True, corpus_prompts=40, pool_prompts=4,
                   prompt_chunks=6, hang_s=60.0, disk_bytes=4 * MiB, mooncake_prompts=6)


@dataclass
class Tally:
    """What one traffic thread did (merged at the end)."""

    lookups: int = 0
    answered: int = 0
    timed_out: int = 0
    cancelled_pending: int = 0
    cancelled_answered: int = 0
    claims: int = 0
    claims_lost_to_restart: int = 0
    chunks_verified: int = 0
    bytes_verified: int = 0
    wrong_chunks: int = 0
    wrong_bytes: int = 0
    hit_tokens: int = 0
    stores: int = 0

    def add(self, other: Tally) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))


@dataclass
class DiskSetup:
    root: Path
    tmpfs_bytes: int | None  # None: not a tmpfs
    how: str
    unavailable: str | None = None  # why the full-disk fault cannot run


class Harness:
    def __init__(self, s: Settings, disk: DiskSetup) -> None:
        self.s = s
        self.disk = disk
        self.disk_path = disk.root / "disk"
        tag = uuid.uuid4().hex[:8]
        self.response_endpoint = f"ipc://@lmp-chaos-{tag}-sched"
        self.config = PrefetchConfig(
            chunk_size=CHUNK,
            chunk_bytes=CHUNK_BYTES,
            cpu_bytes=s.cpu_chunks * CHUNK_BYTES,
            disk_path=str(self.disk_path),
            disk_bytes=s.disk_bytes,
            disk_read_threads=2,
            lookup_timeout_s=s.lookup_timeout_s,
            tier_timeout_s=s.hang_s,  # only the lookup's deadline may cut a load short
            # The default claim_ttl_s (30 s): every held result is claimed or cancelled, so one
            # that expires had its cleanup lost, and lookups_expired > 0 is a violation.
        )
        self.master: Any = None
        self.mooncake_store: Any = None
        if s.mooncake:
            from .mooncake_servers import MooncakeMaster, MooncakeStore

            self.master = MooncakeMaster()
            self.mooncake_store = MooncakeStore(self.master, segment_mib=32)
            self.config = self.config.replace(
                mooncake_master=self.master.address,
                mooncake_segment_bytes=16 * MiB,  # and the store process holds 32 MiB
                mooncake_timeout_s=s.lookup_timeout_s,
            )
        self.hasher = ChunkHasher(CHUNK, self.config.hash_algorithm)
        self.workers = [
            Worker(self, r, f"ipc://@lmp-chaos-{tag}-w{r}") for r in range(s.ranks)
        ]
        self.client: LookupClient | None = None
        self.rng = random.Random(s.seed)
        self._lock = threading.Lock()
        self.counters: Counter[str] = Counter()
        self.faults: Counter[str] = Counter()
        self.violations: list[str] = []
        self.violation_count = 0
        self.tally = Tally()
        self.tally_scenarios = Tally()
        self._digests: dict[tuple[int, int], int] = {}
        self.preload = [prompt(1, i, s.prompt_chunks) for i in range(s.corpus_prompts)]
        self.pool = [prompt(3, i, s.prompt_chunks) for i in range(s.pool_prompts)]
        # A bounded set of prompts (data on disk grows only by the fault scenarios' prompts,
        # so a default run stays below the disk tier's capacity: see full_disk).
        self.corpus = self.preload + self.pool
        # Kept in Mooncake only: the traffic's lookups of these load from Mooncake.
        self.mooncake_corpus = (
            [prompt(6, i, s.prompt_chunks) for i in range(s.mooncake_prompts)] if s.mooncake else []
        )
        self.corpus += self.mooncake_corpus
        self._next_prompt = 0
        self._next_id = 0
        self.stop_traffic = threading.Event()
        self.stop_monitor = threading.Event()
        self.aborted = threading.Event()
        self.traffic_open = threading.Event()
        self.traffic_open.set()
        self._progress = threading.Condition()
        self.completed = 0  # traffic lookups finished
        self.parked = 0  # traffic threads waiting at traffic_open
        self.driver_rss_baseline_kib = 0
        self.driver_rss_max_kib = 0
        self.final: dict[int, dict[str, Any]] = {}
        self.client_stats: dict[str, int] = {}
        self.leaks: dict[str, Any] = {}

    # -- bookkeeping --------------------------------------------------------------------
    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n

    def violation(self, what: str) -> None:
        with self._lock:
            self.violation_count += 1
            if len(self.violations) < 50:
                self.violations.append(what)
        print(f"chaos: VIOLATION: {what}", file=sys.stderr, flush=True)

    def abort(self, why: str) -> None:
        self.violation(why)
        self.aborted.set()
        self.stop_traffic.set()

    def new_id(self, prefix: str) -> str:
        with self._lock:
            self._next_id += 1
            return f"{prefix}-{self._next_id}"

    def fresh_prompt(self, space: int = 2) -> list[int]:
        with self._lock:
            self._next_prompt += 1
            n = self._next_prompt
        return prompt(space, n, self.s.prompt_chunks)

    def expected_digest(self, rank: int, chunk_hash: int) -> int:
        d = self._digests.get((rank, chunk_hash))
        if d is None:
            d = self._digests[(rank, chunk_hash)] = digest(payload(rank, chunk_hash))
        return d

    def own_files(self, rank: int) -> tuple[list[str], list[str]]:
        """This rank's chunk files and temporary files in the shared directory."""
        kv, tmp = [], []
        for name in os.listdir(self.disk_path):
            if name.endswith(TEMP_SUFFIX):
                key = parse_name(name[: -len(TEMP_SUFFIX)] + FILE_SUFFIX)
                if key is not None and key.rank == rank:
                    tmp.append(name)
            else:
                key = parse_name(name)
                if key is not None and key.rank == rank:
                    kv.append(name)
        return kv, tmp

    # -- lookups and claims -------------------------------------------------------------
    def verify_claim(
        self, tally: Tally, rank: int, hashes: list[int], items: list[Any], min_chunks: int,
        what: str,
    ) -> None:
        if len(items) > len(hashes):
            self.violation(f"{what}: rank {rank} gave {len(items)} chunks for {len(hashes)}")
        for i, (chunk_hash, length, got) in enumerate(items):
            want_hash = hashes[i] if i < len(hashes) else None
            if (
                chunk_hash != want_hash
                or length != CHUNK_BYTES
                or got != self.expected_digest(rank, chunk_hash)
            ):
                tally.wrong_chunks += 1
                tally.wrong_bytes += length
                self.violation(f"{what}: rank {rank} chunk {i}: wrong bytes or key")
            else:
                tally.chunks_verified += 1
                tally.bytes_verified += length
        if len(items) < min_chunks:
            self.violation(
                f"{what}: rank {rank} held {len(items)} chunks after answering "
                f"at least {min_chunks}"
            )

    def claim_everywhere(
        self, tally: Tally, lookup_id: str, hashes: list[int], result: int,
        generations: list[int], what: str, exact: dict[int, int] | None = None,
    ) -> None:
        """Claim a lookup answered ``result`` tokens on every rank and check every chunk."""
        tally.claims += 1
        for w, gen in zip(self.workers, generations):
            try:
                items = w.ask("claim", lookup_id)
            except WorkerGone:
                tally.claims_lost_to_restart += 1
                continue
            same_process = w.generation == gen
            if not same_process:
                tally.claims_lost_to_restart += 1
            need = result // CHUNK if same_process else 0
            self.verify_claim(tally, w.rank, hashes, items, need, what)
            want = (exact or {}).get(w.rank)
            if want is not None and same_process and len(items) != want:
                self.violation(f"{what}: rank {w.rank} held {len(items)} chunks, not {want}")

    def submit(self, lookup_id: str, tokens: list[int]) -> int | None:
        """A lookup of the fault scenarios (counted apart from the traffic's)."""
        assert self.client is not None
        self.count("scenario_lookups")
        return self.client.lookup(lookup_id, tokens)

    def answered_lookup(self, tokens: list[int], what: str) -> tuple[str, int, list[int]]:
        """A lookup every rank answered well before the deadline (so no load was cut short by
        it); a late or timed-out one is cancelled and asked again, until ``hang_s``."""
        client = self.client
        assert client is not None
        end = time.monotonic() + self.s.hang_s
        while True:
            lookup_id = self.new_id(what)
            generations = [w.generation for w in self.workers]
            result = self.submit(lookup_id, tokens)
            if result is None:
                result = client.wait(lookup_id, self.s.lookup_timeout_s + self.s.hang_s)
            if result is None:
                raise Hang(f"{what}: lookup {lookup_id} neither answered nor timed out")
            timing = client.timing(lookup_id)
            assert timing is not None
            submitted, answered = timing
            timely = answered is not None and answered - submitted < self.s.lookup_timeout_s / 2
            if timely and generations == [w.generation for w in self.workers]:
                return lookup_id, result, generations
            self.count("scenario_lookups_asked_again")
            client.cancel(lookup_id)
            if time.monotonic() > end:
                raise Hang(f"{what}: no timely answer in {self.s.hang_s} s")

    def doomed_lookup(self, tokens: list[int], what: str) -> None:
        """A lookup that one rank cannot answer (dead or stopped): it must end as 0."""
        client = self.client
        assert client is not None
        lookup_id = self.new_id(what)
        self.submit(lookup_id, tokens)
        result = client.wait(lookup_id, self.s.lookup_timeout_s + self.s.hang_s)
        if result != 0:
            entry = getattr(client, "_entries", {}).get(lookup_id)
            self.violation(f"{what}: a lookup a stopped rank could not answer gave {result!r} "
                           f"(answers by rank: {getattr(entry, 'answers', '?')})")
        client.cancel(lookup_id)
        self.count("doomed_lookups_zero")

    def store_everywhere(self, tokens: list[int], disk_only_rank: int | None = None) -> None:
        for w in self.workers:
            w.ask("store", ([tokens], w.rank == disk_only_rank))

    # -- traffic ------------------------------------------------------------------------
    def traffic(self, index: int) -> None:
        rng = random.Random(self.s.seed * 1000 + index)
        tally = Tally()
        client = self.client
        assert client is not None
        try:
            while not self.stop_traffic.is_set():
                if not self.traffic_open.is_set():
                    with self._progress:
                        self.parked += 1
                        self._progress.notify_all()
                    self.traffic_open.wait()
                    with self._progress:
                        self.parked -= 1
                    continue
                try:
                    if rng.random() < 0.04:
                        self._traffic_store(rng, tally)
                    else:
                        self._traffic_lookup(rng, tally, index)
                except WorkerGone:
                    self.count("traffic_ops_lost_to_kills")
                with self._progress:
                    self.completed += 1
                    self._progress.notify_all()
        except Hang as exc:
            self.abort(f"traffic thread {index}: {exc}")
        except Exception:
            self.abort(f"traffic thread {index} failed:\n{traceback.format_exc()}")
        finally:
            with self._lock:
                self.tally.add(tally)

    def _traffic_store(self, rng: random.Random, tally: Tally) -> None:
        tokens = rng.choice(self.pool)
        for w in self.workers:
            with suppress(WorkerGone):
                w.ask("store", ([tokens], False))
        tally.stores += 1

    def _traffic_lookup(self, rng: random.Random, tally: Tally, index: int) -> None:
        client = self.client
        assert client is not None
        base = rng.choice(self.corpus)
        known = rng.randint(1, len(base) // CHUNK)
        tokens = base[: known * CHUNK]
        if rng.random() < 0.3:  # a tail nobody stored
            tokens = tokens + [(4 << 48) + rng.randrange(1 << 40) for _ in range(CHUNK)]
        hashes = self.hasher.hash(tokens)
        lookup_id = self.new_id(f"t{index}")
        generations = [w.generation for w in self.workers]
        tally.lookups += 1
        if rng.random() < 0.5:
            first = client.lookup(lookup_id, tokens, hashes=hashes, offsets=[CHUNK] * len(hashes))
        else:
            first = client.lookup(lookup_id, tokens)
        if first is None and rng.random() < 0.08:  # the scheduler aborts it mid-lookup
            client.cancel(lookup_id)
            tally.cancelled_pending += 1
            return
        result = first
        if result is None:
            result = client.wait(lookup_id, self.s.lookup_timeout_s + self.s.hang_s)
        if result is None:
            raise Hang(f"lookup {lookup_id} neither answered nor timed out")
        timing = client.timing(lookup_id)
        assert timing is not None
        if timing[1] is None:
            tally.timed_out += 1
        else:
            tally.answered += 1
        if client.lookup(lookup_id, tokens) != result:
            self.violation(f"lookup {lookup_id}: the answer changed after it was given")
        if result % CHUNK or not 0 <= result <= known * CHUNK:
            self.violation(f"lookup {lookup_id}: answer {result} for {known} stored chunks")
        tally.hit_tokens += result
        if result == 0 or rng.random() < 0.15:
            client.cancel(lookup_id)  # a rank that answered more still holds its chunks
            if result:
                tally.cancelled_answered += 1
            return
        self.claim_everywhere(tally, lookup_id, hashes, result, generations, lookup_id)
        client.forget(lookup_id)

    def wait_progress(self, lookups: int) -> None:
        """Wait until the traffic finished ``lookups`` more operations (bounded)."""
        with self._progress:
            target = self.completed + lookups
            if not self._progress.wait_for(
                lambda: self.completed >= target or self.aborted.is_set(), self.s.hang_s
            ):
                raise Hang(f"traffic made no progress ({lookups} operations) in {self.s.hang_s} s")

    @contextmanager
    def traffic_parked(self) -> Iterator[None]:
        """Every traffic thread waits at the top of its loop while the block runs."""
        self.traffic_open.clear()
        try:
            with self._progress:
                if not self._progress.wait_for(
                    lambda: self.parked == self.s.threads or self.stop_traffic.is_set(),
                    self.s.hang_s,
                ):
                    raise Hang("the traffic threads did not park")
            yield
        finally:
            self.traffic_open.set()

    # -- monitor ------------------------------------------------------------------------
    def monitor(self) -> None:
        try:
            while not self.stop_monitor.wait(0.5):  # a sampling interval, not a wait for state
                for w in self.workers:
                    if w.paused or self.aborted.is_set():
                        continue
                    try:
                        rss = w.rss_kib()
                        s = w.ask("stats")
                    except (WorkerGone, FileNotFoundError, ProcessLookupError):
                        continue
                    w.rss_max_kib = max(w.rss_max_kib, rss)
                    self.check_live(w.rank, s, final=False)
                self.driver_rss_max_kib = max(self.driver_rss_max_kib, _rss_kib("self"))
                assert self.client is not None
                c = self.client.stats()
                for name in ("duplicate_answers", "malformed_answers", "hash_errors"):
                    if c[name]:
                        self.violation(f"client: {name} = {c[name]}")
        except Hang:
            pass
        except Exception:
            self.abort(f"monitor failed:\n{traceback.format_exc()}")

    def check_live(self, rank: int, s: dict[str, Any], *, final: bool) -> None:
        where = f"rank {rank}" + (" at the end" if final else "")
        problems = []
        server, lookups = s["server"], s["lookups"]
        if server["answers_sent"] > server["requests_accepted"]:
            problems.append("more answers sent than requests accepted")
        for name, value in (
            ("lookups failed", lookups["failed"]),
            ("lookups expired", lookups["expired"]),
            ("messages malformed", server["messages_malformed"]),
            ("answers dropped", server["answers_dropped"]),
        ):
            if value:
                problems.append(f"{name} = {value}")
        if s["runtime_failures"]:
            problems.append(f"runtime failed: {s['runtime_failures']}")
        if s["log_errors"]:
            problems.append(f"errors logged: {s['log_errors']}")
        if not 0 <= s["limiter_used"] <= s["limiter"]["total"]:
            problems.append(f"limiter {s['limiter_used']} of {s['limiter']['total']}")
        if s["arena_used_bytes"] < s["cpu_resident_bytes"]:
            problems.append("arena bytes below the CPU tier's")
        if final:
            for name in ("inflight_lookups", "held_lookups", "pinned_chunks", "limiter_used"):
                if s[name]:
                    problems.append(f"{name} = {s[name]}")
            if server["answers_queued"]:
                problems.append(f"answers_queued = {server['answers_queued']}")
            if s["arena_used_bytes"] != s["cpu_resident_bytes"]:
                problems.append(
                    f"arena {s['arena_used_bytes']} B != CPU tier {s['cpu_resident_bytes']} B"
                )
            if server["answers_sent"] != server["requests_accepted"]:
                problems.append(
                    f"answers_sent {server['answers_sent']} != requests_accepted "
                    f"{server['requests_accepted']}"
                )
        for p in problems:
            self.violation(f"{where}: {p}")

    # -- faults -------------------------------------------------------------------------
    def inject(self, kind: str, targeted: bool) -> None:
        kind, _, variant = kind.partition(":")
        # Rank 0 is never killed: one process lives through the whole run, so its counters,
        # its conservation at the end and its RSS growth cover all of it.
        low = 1 if kind in ("kill", "full_disk") else 0
        w = self.workers[self.rng.randrange(low, self.s.ranks)]
        label = f"{kind}-{'targeted' if targeted else 'blind'}"
        if kind == "kill" and targeted:
            # Alternately mid-load and mid-write.
            if self.faults["kill-targeted"] % 2:
                self.kill_mid_write(w)
            else:
                self.kill_targeted(w)
        elif kind == "kill":
            w.kill_and_restart()
        elif kind == "pause":
            self.pause_targeted(w) if targeted else self.pause_blind(w)
        elif kind in ("delete", "truncate", "corrupt"):
            if targeted:
                self.damage_targeted(w, kind, variant or None)
            elif not self.damage_blind(w, kind):
                return  # no file of this rank to damage right now
        elif kind == "full_disk":
            if self.disk.unavailable is not None:
                self.count("full_disk_not_run")
                return
            self.full_disk(w)
        elif kind == "master":
            self.kill_master_mid_load(w) if targeted else self.kill_master_blind()
        self.faults[label] += 1

    def kill_targeted(self, w: Worker) -> None:
        """Kill a worker while a lookup's disk read is held inside its load."""
        tokens = self.fresh_prompt()
        self.store_everywhere(tokens, disk_only_rank=w.rank)
        w.ask("hold_reads", w.ask("files", tokens))
        assert self.client is not None
        lookup_id = self.new_id("kill")
        self.submit(lookup_id, tokens)
        if not w.ask("wait_read_held", self.s.hang_s):
            raise Hang(f"rank {w.rank}: the load never reached its disk read")
        w.kill_and_restart()
        self.count("killed_mid_load")
        result = self.client.wait(lookup_id, self.s.lookup_timeout_s + self.s.hang_s)
        if result != 0:
            self.violation(f"kill: the lookup whose worker died gave {result!r}, not 0")
        self.client.cancel(lookup_id)
        # The restarted worker loads the prompt from the disk it found.
        lookup_id, result, gens = self.answered_lookup(tokens, "after-restart")
        if result != len(tokens):
            self.violation(f"kill: after the restart the prompt gave {result}, not {len(tokens)}")
        self.claim_everywhere(self.tally_scenarios, lookup_id, self.hasher.hash(tokens), result,
                              gens, "after-restart")
        self.client.forget(lookup_id)

    def kill_mid_write(self, w: Worker) -> None:
        """Kill a worker while its writer thread is half-way through a chunk file: the
        restarted worker must remove that temporary file (and index everything else)."""
        if not w.ask("store_with_held_write", self.fresh_prompt()):
            raise Hang(f"rank {w.rank}: the write-behind never started")
        if not self.own_files(w.rank)[1]:
            self.violation(f"rank {w.rank}: no temporary file while a write was held")
        ready = w.kill_and_restart()  # checks the count of stale files removed
        self.count("killed_mid_write")
        if ready["stale_temp_files_removed"] < 1:
            self.violation(f"rank {w.rank}: the restart removed no stale temporary file")

    def pause_targeted(self, w: Worker) -> None:
        tokens = self.fresh_prompt()
        self.store_everywhere(tokens)
        w.pause()
        try:
            self.doomed_lookup(tokens, "paused")
        finally:
            w.resume()
        lookup_id, result, gens = self.answered_lookup(tokens, "after-pause")
        if result != len(tokens):
            self.violation(f"pause: after SIGCONT the prompt gave {result}, not {len(tokens)}")
        self.claim_everywhere(self.tally_scenarios, lookup_id, self.hasher.hash(tokens), result,
                              gens, "after-pause")
        assert self.client is not None
        self.client.forget(lookup_id)

    def pause_blind(self, w: Worker) -> None:
        w.pause()
        try:
            # Hold the pause (this is the driver's fault thread, not a worker or Trio thread).
            time.sleep(self.rng.uniform(0.05, 1.5 * self.s.lookup_timeout_s))
        finally:
            w.resume()

    def damage(
        self, kind: str, path: str, rng: random.Random, others: list[str],
        variant: str | None = None,
    ) -> str:
        """Damage one chunk file in place; the variant applied."""
        size = os.path.getsize(path)
        if kind == "delete":
            os.unlink(path)
            return "delete"
        if kind == "truncate":
            os.truncate(path, rng.randrange(size))
            return "truncate"
        variants = ["payload", "header"] + (["other-key"] if others else [])
        variant = variant or rng.choice(variants)
        if variant == "other-key":  # another chunk's (valid) file under this name
            data = Path(rng.choice(others)).read_bytes()
            with open(path, "r+b") as f:
                f.write(data)
                f.truncate(len(data))
            return variant
        key_len = len(os.path.basename(path)) - len(FILE_SUFFIX)
        # A header byte the reader checks (magic … key string), or a payload byte.
        offset = (rng.randrange(HEADER.size + key_len) if variant == "header"
                  else rng.randrange(HEADER_BYTES, size))
        with open(path, "r+b") as f:
            f.seek(offset)
            old = f.read(1)[0]
            f.seek(offset)
            f.write(bytes([old ^ rng.randrange(1, 256)]))
        return variant

    def damage_targeted(self, w: Worker, kind: str, variant: str | None = None) -> None:
        """Damage chunk ``k`` of a prompt while the load that reads it waits before its first
        read: the answer must be exactly the ``k`` chunks before it."""
        assert self.client is not None
        tokens = self.fresh_prompt()
        n = len(tokens) // CHUNK
        self.store_everywhere(tokens, disk_only_rank=w.rank)
        files = w.ask("files", tokens)
        k = self.rng.randrange(n)
        errors_before = w.ask("stats")["tiers"]["disk"]["errors"]
        w.ask("hold_reads", files)
        lookup_id = self.new_id(kind)
        generations = [x.generation for x in self.workers]
        self.submit(lookup_id, tokens)
        try:
            if not w.ask("wait_read_held", self.s.hang_s):
                raise Hang(f"rank {w.rank}: the load never reached its disk read")
            others = [f for f in files if f != files[k]]
            variant = self.damage(kind, files[k], self.rng, others, variant)
            self.count(f"damage_{variant}")
        finally:
            w.ask("release_reads")
        result = self.client.wait(lookup_id, self.s.lookup_timeout_s + self.s.hang_s)
        timing = self.client.timing(lookup_id)
        assert timing is not None
        submitted, answered = timing
        if answered is not None and answered - submitted < self.s.lookup_timeout_s / 2:
            self.count("damage_seen_mid_load")
        else:  # late: the lookup's deadline may have cut the load; ask again
            self.client.cancel(lookup_id)
            lookup_id, result, generations = self.answered_lookup(tokens, f"{kind}-again")
        if result != k * CHUNK:
            self.violation(f"{kind} ({variant}) of chunk {k}: the answer was {result}, "
                           f"not {k * CHUNK}")
        if result:
            hashes = self.hasher.hash(tokens)
            self.claim_everywhere(self.tally_scenarios, lookup_id, hashes, result, generations,
                                  f"{kind}-claim", exact={w.rank: k})
            self.client.forget(lookup_id)
        else:
            self.client.cancel(lookup_id)
        if kind != "delete":
            if os.path.exists(files[k]):
                self.violation(f"{kind} ({variant}): the damaged file was not removed")
            if w.ask("stats")["tiers"]["disk"]["errors"] <= errors_before:
                self.violation(f"{kind} ({variant}): the disk tier counted no error")

    def damage_blind(self, w: Worker, kind: str) -> bool:
        """Damage 1-3 random chunk files of a rank, under load; ``False`` if none was left."""
        kv, _ = self.own_files(w.rank)
        paths = [str(self.disk_path / name) for name in kv]
        self.rng.shuffle(paths)
        want, done = self.rng.randint(1, 3), 0
        for path in paths:
            if done == want:
                break
            try:
                variant = self.damage(kind, path, self.rng, [p for p in paths if p != path])
            except FileNotFoundError:  # evicted, or dropped by a load, meanwhile
                self.count("damage_target_vanished")
                continue
            done += 1
            self.count(f"damage_{variant}")
            self.count("files_damaged_blind")
        return done > 0

    def full_disk(self, w: Worker) -> None:
        """Fill the tmpfs; stores must then drop their disk writes (counted, no temp file
        left), lookups still answer from memory, and a worker restarts on the full disk."""
        assert self.client is not None
        ballast = self.disk.root / "ballast"
        with self.traffic_parked():
            filled, files = _fill(ballast)
            self.count("ballast_bytes", filled)
            self.count("ballast_files", files)
            try:
                tokens = self.fresh_prompt()
                n = len(tokens) // CHUNK
                before = [x.ask("stats") for x in self.workers]
                self.store_everywhere(tokens)
                for x, b in zip(self.workers, before):
                    a = x.ask("stats")["tiers"]["disk"]
                    dropped = a["writes_dropped"] - b["tiers"]["disk"]["writes_dropped"]
                    stored = a["chunks_stored"] - b["tiers"]["disk"]["chunks_stored"]
                    evicted = a["evictions"] - b["tiers"]["disk"]["evictions"]
                    room = b["disk_capacity_bytes"] - b["disk_used_bytes"]
                    if room >= n * FILE_BYTES:
                        # Below its capacity the tier evicts nothing: the file system refuses
                        # every write (ENOSPC), and each is dropped and counted.
                        ok = dropped == n and stored == evicted == 0
                    else:
                        # At its capacity the tier evicts its own files to make room, which
                        # frees as much as a new file takes: writes fit where it evicted.
                        ok = dropped + stored == n and stored <= evicted
                        self.count("full_disk_rank_at_capacity")
                    if not ok:
                        self.violation(f"full disk: rank {x.rank}, {n} writes, {room} B below "
                                       f"capacity: dropped {dropped}, stored {stored}, "
                                       f"evicted {evicted}")
                    self.count("writes_refused_by_full_disk", dropped)
                    self.count("writes_on_full_disk_after_eviction", stored)
                    if self.own_files(x.rank)[1]:
                        self.violation(f"full disk: rank {x.rank} left a temporary file")
                lookup_id, result, gens = self.answered_lookup(tokens, "full-disk")
                if result != len(tokens):
                    self.violation(f"full disk: the prompt in memory gave {result}")
                self.claim_everywhere(self.tally_scenarios, lookup_id, self.hasher.hash(tokens),
                                      result, gens, "full-disk")
                self.client.forget(lookup_id)
                w.kill_and_restart()  # a supervisor restarts a worker on the full disk
                self.count("restarts_on_full_disk")
            finally:
                shutil.rmtree(ballast)
            tokens = self.fresh_prompt()
            before = [x.ask("stats")["tiers"]["disk"]["chunks_stored"] for x in self.workers]
            self.store_everywhere(tokens, disk_only_rank=w.rank)
            for x, b in zip(self.workers, before):
                stored = x.ask("stats")["tiers"]["disk"]["chunks_stored"] - b
                if stored != len(tokens) // CHUNK:
                    self.violation(f"full disk freed: rank {x.rank} stored {stored} chunks")
            lookup_id, result, gens = self.answered_lookup(tokens, "disk-freed")
            if result != len(tokens):
                self.violation(f"full disk freed: the prompt gave {result}")
            self.claim_everywhere(self.tally_scenarios, lookup_id, self.hasher.hash(tokens),
                                  result, gens, "disk-freed")
            self.client.forget(lookup_id)

    # -- Mooncake ----------------------------------------------------------------------------
    def settle_mooncake(self, prompts: list[list[int]]) -> None:
        """Store ``prompts`` Mooncake-only on every rank, once each rank's tier works (after
        a master restart: the client mounts its segment again, the tier's backoff ends)."""
        for w in self.workers:
            if not w.ask("settle_mooncake", (prompts, self.s.hang_s)):
                raise Hang(f"rank {w.rank}: Mooncake did not take the prompts again")

    def restart_master(self) -> None:
        self.master.start()  # the same port; an empty index
        self.count("master_restarts")
        self.settle_mooncake(self.mooncake_corpus)  # the traffic's Mooncake-only prompts

    def kill_master_mid_load(self, w: Worker) -> None:
        """Kill the master while a lookup's Mooncake load is held just before its transfer:
        the held load fails (the master is gone), so the answer is 0, on time; after the
        restart, Mooncake serves a prompt stored again, every byte checked."""
        assert self.client is not None
        tokens = self.fresh_prompt()
        self.settle_mooncake([tokens])
        w.ask("hold_gets")
        lookup_id = self.new_id("master")
        try:
            self.submit(lookup_id, tokens)
            if not w.ask("wait_get_held", self.s.hang_s):
                raise Hang(f"rank {w.rank}: the lookup never reached its Mooncake load")
            self.master.kill()
            self.count("master_killed_mid_load")
        finally:
            w.ask("release_gets")
        result = self.client.wait(lookup_id, self.s.lookup_timeout_s + self.s.hang_s)
        if result != 0:
            self.violation(f"master: the lookup whose Mooncake load lost its master gave "
                           f"{result!r}, not 0")
        self.client.cancel(lookup_id)
        self.restart_master()
        self.settle_mooncake([tokens])
        lookup_id, result, gens = self.answered_lookup(tokens, "after-master")
        if result != len(tokens):
            self.violation(f"master: after the restart the prompt gave {result}, "
                           f"not {len(tokens)}")
        self.claim_everywhere(self.tally_scenarios, lookup_id, self.hasher.hash(tokens), result,
                              gens, "after-master")
        self.client.forget(lookup_id)

    def kill_master_blind(self) -> None:
        self.master.kill()
        # Hold the outage (the driver's fault thread, not a worker or Trio thread).
        time.sleep(self.rng.uniform(0.05, 1.5 * self.s.lookup_timeout_s))
        self.restart_master()

    def faults_loop(self) -> None:
        try:
            if self.s.smoke:
                plan = SMOKE_FAULTS + (SMOKE_MOONCAKE_FAULTS if self.s.mooncake else [])
                for kind, targeted in plan:
                    if self.aborted.is_set():
                        return
                    self.wait_progress(10)
                    self.inject(kind, targeted)
                return
            end = time.monotonic() + self.s.seconds
            weights = [2, 2, 1, 1, 1, 0.5, 0.5 if self.s.mooncake else 0]
            while time.monotonic() < end and not self.aborted.is_set():
                # Space the faults out (the driver's fault thread; nothing waits on this).
                time.sleep(self.rng.uniform(0.2, 1.0))
                kind = self.rng.choices(KINDS, weights)[0]
                self.inject(kind, kind == "full_disk" or self.rng.random() < 0.5)
        except Hang as exc:
            self.abort(f"fault thread: {exc}")
        except Exception:
            self.abort(f"fault thread failed:\n{traceback.format_exc()}")
        finally:
            for w in self.workers:  # nobody stays stopped
                if w.paused:
                    w.resume()

    # -- the run ------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        from multiprocessing import resource_tracker

        resource_tracker.ensure_running()  # its pipe is not a leak of this run
        if self.s.mooncake:  # (their log threads and pipes are stopped before the leak check)
            self.master.start()
            self.mooncake_store.start()
        threads_at_start = set(threading.enumerate())
        fds_at_start = _open_fds()
        self.disk_path.mkdir(parents=True, exist_ok=True)
        t_start = time.monotonic()
        started = [threading.Thread(target=w.start, args=(self.preload,)) for w in self.workers]
        for t in started:
            t.start()
        for t in started:
            t.join()
        if any(w.conn is None for w in self.workers):
            raise Hang("a worker did not start")
        if self.s.mooncake:
            self.settle_mooncake(self.mooncake_corpus)
        startup_s = time.monotonic() - t_start
        zmq_threads_before = _native_threads()
        self.client = LookupClient(self.config, [w.endpoint for w in self.workers],
                                   self.response_endpoint)
        threads = [threading.Thread(target=self.traffic, args=(i,), name=f"traffic-{i}")
                   for i in range(self.s.threads)]
        monitor = threading.Thread(target=self.monitor, name="monitor")
        t0 = time.monotonic()
        for t in threads:
            t.start()
        monitor.start()
        try:
            self.wait_progress(5 * self.s.threads)  # warmed up: every path has run
            for w in self.workers:
                w.rss_baseline_kib = w.rss_max_kib = w.rss_kib()
            self.driver_rss_baseline_kib = self.driver_rss_max_kib = _rss_kib("self")
            self.faults_loop()
        except Hang as exc:
            self.abort(str(exc))
        fault_s = time.monotonic() - t0
        self.stop_traffic.set()
        self.traffic_open.set()
        for t in threads:
            t.join(self.s.hang_s + self.s.lookup_timeout_s)
            if t.is_alive():
                self.violation(f"{t.name} did not stop")
        self.stop_monitor.set()
        monitor.join(self.s.hang_s)
        rss_end = {w.rank: w.rss_kib() for w in self.workers if w.conn is not None}
        driver_rss_end = _rss_kib("self")
        if not self.aborted.is_set():
            self.finish()
        self.client_stats = self.client.stats()
        self.client.close()
        client_zmq = {t: n for t, n in _native_threads().items()
                      if t not in zmq_threads_before and n.startswith("ZMQ")}
        bridge_alive = self.client._bridge.thread.is_alive()
        used = {w.rank: w.close() for w in self.workers}
        for rank, slots in used.items():
            if slots:
                self.violation(f"rank {rank} closed with {slots} arena slots still used")
        if self.s.mooncake:
            self.mooncake_store.stop()
            self.master.stop()
        # With the client and every worker process closed, nothing made since the start may
        # be left: the client's sockets, eventfd, context and threads included.
        left_threads = sorted(t.name for t in set(threading.enumerate()) - threads_at_start)
        left_fds = {fd: what for fd, what in _open_fds().items()
                    if fds_at_start.get(fd) != what}
        self.leaks = {"fds": left_fds, "threads": left_threads, "zmq_threads": client_zmq,
                      "bridge_thread_alive": bridge_alive}
        if left_fds or left_threads or client_zmq or bridge_alive:
            self.violation(f"left after closing the client and the workers: {self.leaks}")
        return self.figures(startup_s, fault_s, rss_end, driver_rss_end)

    def finish(self) -> None:
        """Bring every live worker to rest and check it.

        The first barrier lookup (sent through the bridge's queue, behind every cleanup the
        threads sent) is answered only once every worker handled those cleanups; then the
        lookups' tasks end (``wait_quiet``); a second barrier's answer comes after every
        answer those tasks queued.  Both barriers are misses: they hold nothing."""
        assert self.client is not None
        lookup_id, _, _ = self.answered_lookup(prompt(5, 0, 2), "barrier")
        self.client.cancel(lookup_id)
        for w in self.workers:
            if not w.ask("quiesce", self.s.hang_s):
                self.violation(f"rank {w.rank}: lookup tasks still alive at the end")
        lookup_id, _, _ = self.answered_lookup(prompt(5, 1, 2), "barrier")
        self.client.cancel(lookup_id)
        for w in self.workers:
            s = w.ask("stats")
            self.final[w.rank] = s
            self.check_live(w.rank, s, final=True)
            if s["held_lookups"] or s["inflight_lookups"] or s["lookups"]["expired"]:
                self.violation(f"rank {w.rank}: lookups still tracked: {w.ask('held')}")

    # -- figures ------------------------------------------------------------------------
    def figures(
        self, startup_s: float, fault_s: float, rss_end: dict[int, int], driver_rss_end: int
    ) -> dict[str, Any]:
        t = Tally()
        t.add(self.tally)
        scen = self.tally_scenarios
        c = self.client_stats
        # The client's counters against the threads' own tallies: every lookup was submitted
        # once and ended once, answered or timed out, unless it was cancelled while pending.
        submitted = t.lookups + self.counters["scenario_lookups"]
        ended = c["answered"] + c["timeouts"]
        if c["submitted"] != submitted:
            self.violation(f"client: {c['submitted']} lookups submitted, the driver made "
                           f"{submitted}")
        if not submitted - t.cancelled_pending <= ended <= submitted:
            self.violation(f"client: {ended} lookups answered or timed out of {submitted} "
                           f"({t.cancelled_pending} cancelled while pending)")
        if c["timeouts"] < t.timed_out or c["answered"] < t.answered:
            self.violation("client: fewer answers or timeouts counted than the threads saw")
        if c["duplicate_answers"]:
            self.violation(f"client: {c['duplicate_answers']} duplicate answers")
        if c["pending"]:
            self.violation(f"client: {c['pending']} lookups still pending at the end")
        wrong_bytes = t.wrong_bytes + scen.wrong_bytes
        if wrong_bytes:
            self.violation(f"{wrong_bytes} wrong bytes claimed")
        workers = {}
        for w in self.workers:
            s = self.final.get(w.rank, {})
            growth = (rss_end.get(w.rank, 0) - w.rss_baseline_kib) if not w.killed else None
            if growth is not None and not self.s.smoke and growth > self.s.rss_bound_mib * 1024:
                self.violation(f"rank {w.rank}: RSS grew {growth} KiB")
            disk = s.get("tiers", {}).get("disk", {})
            mooncake = s.get("tiers", {}).get("mooncake")
            workers[w.rank] = {
                "restarts": w.generation - 1,
                "requests_accepted": s.get("server", {}).get("requests_accepted"),
                "answers_sent": s.get("server", {}).get("answers_sent"),
                "deadline_expired": s.get("lookups", {}).get("deadline_expired"),
                "disk_errors": disk.get("errors"),
                "disk_writes_dropped": disk.get("writes_dropped"),
                "mooncake": None if mooncake is None else {
                    k: mooncake[k] for k in ("chunks_loaded", "chunks_stored", "errors",
                                             "writes_dropped")
                },
                "corrupt_files_removed": s.get("corrupt_files_removed"),
                "warnings_logged": s.get("log_counts", {}).get("WARNING", 0),
                "rss_baseline_kib": w.rss_baseline_kib if not w.killed else None,
                "rss_end_kib": rss_end.get(w.rank),
                "rss_growth_kib": growth,
            }
        return {
            "settings": {k: getattr(self.s, k) for k in self.s.__dataclass_fields__},
            "disk": {"how": self.disk.how, "tmpfs_bytes": self.disk.tmpfs_bytes,
                     "full_disk_unavailable": self.disk.unavailable},
            "startup_s": round(startup_s, 2),
            "fault_phase_s": round(fault_s, 1),
            "traffic": {k: getattr(t, k) for k in t.__dataclass_fields__},
            "scenarios": {k: getattr(scen, k) for k in scen.__dataclass_fields__},
            "wrong_bytes": wrong_bytes,
            "faults": dict(sorted(self.faults.items())),
            "faults_by_kind": {k: sum(v for f, v in self.faults.items() if f.startswith(k))
                               for k in KINDS},
            "counters": dict(sorted(self.counters.items())),
            "client": c,
            "workers": workers,
            "driver_rss_growth_kib": driver_rss_end - self.driver_rss_baseline_kib,
            "leaks": self.leaks,
            "violations": self.violations,
            "violation_count": self.violation_count,
            "aborted": self.aborted.is_set(),
        }


def _native_threads() -> dict[int, str]:
    out = {}
    for tid in os.listdir("/proc/self/task"):
        with suppress(FileNotFoundError), open(f"/proc/self/task/{tid}/comm") as f:
            out[int(tid)] = f.read().strip()
    return out


def _fill(ballast: Path) -> tuple[int, int]:
    """Fill the file system: a file written until ``ENOSPC`` (every block), then empty files
    created until ``ENOSPC`` (every inode).  ``(bytes, files)``; remove ``ballast`` after."""
    ballast.mkdir()
    written = files = 0
    fd = os.open(ballast / "blocks", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for block in (1 << 20, 1 << 16, 1 << 12, 1):
            data = b"\xa5" * block
            while True:
                try:
                    written += os.write(fd, data)
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    break
    finally:
        os.close(fd)
    while True:
        try:
            os.close(os.open(ballast / str(files), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
            return written, files
        files += 1


# ---------------------------------------------------------------------------------------------
# The disk: a private tmpfs if this machine allows one
# ---------------------------------------------------------------------------------------------
def _unshare_prefix(*, net: bool = False) -> list[str] | None:
    """The ``unshare`` command that gives this run a private mount namespace (and, with
    ``net``, a private network namespace), if any works."""
    exe = shutil.which("unshare")
    if exe is None:
        return None
    more = ["--net"] if net else []
    options = [["--mount", *more]] if os.geteuid() == 0 else []
    options.append(["--user", "--map-root-user", "--mount", *more])
    for opts in options:
        probe = subprocess.run([exe, *opts, "true"], capture_output=True, timeout=30)
        if probe.returncode == 0:
            return [exe, *opts]
    return None


def _setup_disk(tmpfs_bytes: int, tmpfs_inodes: int) -> DiskSetup:
    root = Path(tempfile.mkdtemp(prefix="lmprefetch-chaos-"))
    if os.environ.get(_IN_NAMESPACE):
        options = f"size={tmpfs_bytes},nr_inodes={tmpfs_inodes}"
        cmd = ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(root)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        if done.returncode == 0:
            how = (f"a {tmpfs_bytes // MiB} MiB tmpfs (`mount -t tmpfs -o {options}`) in "
                   f"a private mount namespace (`{os.environ[_IN_NAMESPACE]}`)")
            return DiskSetup(root, tmpfs_bytes, how)
        reason = f"mount -t tmpfs failed: {done.stderr.strip() or done.returncode}"
    else:
        reason = "no private mount namespace (unshare is missing or refused)"
    return DiskSetup(root, None, f"a plain directory ({reason})", unavailable=reason)


def _teardown_disk(disk: DiskSetup) -> None:
    if disk.tmpfs_bytes is not None:
        subprocess.run(["umount", str(disk.root)], capture_output=True, timeout=30)
    shutil.rmtree(disk.root, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------
def _machine() -> str:
    model = "unknown CPU"
    with suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    mem = 0
    with suppress(OSError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                mem = int(line.split()[1]) // (1024 * 1024)
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return (f"{os.cpu_count()} × {model}, {mem} GiB, Linux {platform.release()}, "
            f"Python {platform.python_version()}; load average at the end {load}")


def summary(fig: dict[str, Any]) -> str:
    t, sc, c = fig["traffic"], fig["scenarios"], fig["client"]
    lines = [
        f"seed {fig['settings']['seed']}, {fig['fault_phase_s']} s of faults, "
        f"{fig['settings']['ranks']} ranks, {fig['settings']['threads']} threads on one client",
        f"disk: {fig['disk']['how']}",
        f"lookups: {t['lookups']} by the threads + {fig['counters'].get('scenario_lookups', 0)} "
        f"by the fault scenarios; answered {t['answered']}, timed out to 0 {t['timed_out']}, "
        f"cancelled mid-lookup {t['cancelled_pending']}",
        f"claims: {t['claims'] + sc['claims']}, chunks verified "
        f"{t['chunks_verified'] + sc['chunks_verified']} "
        f"({(t['bytes_verified'] + sc['bytes_verified']) / MiB:.1f} MiB), "
        f"wrong bytes {fig['wrong_bytes']}",
        f"stores: {t['stores']} prompts by the threads",
        "faults: " + ", ".join(f"{k} {v}" for k, v in fig["faults_by_kind"].items()),
        "  " + ", ".join(f"{k} {v}" for k, v in fig["faults"].items()),
        "counters: " + ", ".join(f"{k} {v}" for k, v in fig["counters"].items()),
        "client: " + ", ".join(f"{k} {v}" for k, v in c.items()),
    ]
    for rank, w in fig["workers"].items():
        growth = ("killed (not a surviving process)" if w["rss_growth_kib"] is None
                  else f"RSS {w['rss_baseline_kib'] / 1024:.1f} → {w['rss_end_kib'] / 1024:.1f} "
                       f"MiB ({w['rss_growth_kib'] / 1024:+.1f})")
        lines.append(
            f"rank {rank}: restarts {w['restarts']}, requests accepted "
            f"{w['requests_accepted']} / answers sent {w['answers_sent']} (this process), "
            f"deadline expired {w['deadline_expired']}, disk errors {w['disk_errors']}, "
            f"writes dropped {w['disk_writes_dropped']}, corrupt files removed "
            f"{w['corrupt_files_removed']}; {growth}"
            + ("" if w.get("mooncake") is None else
               "; mooncake " + ", ".join(f"{k} {v}" for k, v in w["mooncake"].items()))
        )
    lines.append(f"driver (client) RSS growth {fig['driver_rss_growth_kib'] / 1024:+.1f} MiB")
    lines.append(f"violations: {fig['violation_count']}")
    lines.extend(f"  {v}" for v in fig["violations"])
    return "\n".join(lines)


WORKER_TABLE_HEAD = (
    "| rank | restarts | requests accepted | answers sent | deadline expired | disk errors | "
    "disk writes dropped | RSS after warm-up → end |\n|---|---|---|---|---|---|---|---|"
)


def write_report(path: Path, fig: dict[str, Any], command: str) -> None:
    """Write the figures under the ``## Chaos`` heading of ``path`` (up to the next ``## ``
    heading), leaving the rest of the page alone; the page is created if missing."""
    t, sc, c, cn = fig["traffic"], fig["scenarios"], fig["client"], fig["counters"]
    kinds, faults = fig["faults_by_kind"], fig["faults"]

    def both(kind: str) -> str:
        return (f"{kinds[kind]} ({faults.get(kind + '-targeted', 0)} targeted, "
                f"{faults.get(kind + '-blind', 0)} blind)")

    verified_mib = (t["bytes_verified"] + sc["bytes_verified"]) / MiB
    figures = [
        ("fault phase", f"{fig['fault_phase_s']} s, seed {fig['settings']['seed']}"),
        (f"lookups by the {fig['settings']['threads']} threads",
         f"{t['lookups']} (answered {t['answered']}, timed out to 0 {t['timed_out']}, "
         f"cancelled mid-lookup {t['cancelled_pending']})"),
        ("lookups by the fault scenarios",
         f"{cn.get('scenario_lookups', 0)} ({cn.get('scenario_lookups_asked_again', 0)} asked "
         "again because the first answer came late)"),
        ("claims / chunks verified",
         f"{t['claims'] + sc['claims']} / {t['chunks_verified'] + sc['chunks_verified']} "
         f"({verified_mib:.1f} MiB)"),
        ("**wrong bytes**", f"**{fig['wrong_bytes']}**"),
        ("stores by the threads", f"{t['stores']} prompts"),
        ("kills", f"{both('kill')}; {cn.get('killed_mid_load', 0)} with a disk read held "
                  f"inside a load, {cn.get('killed_mid_write', 0)} with a chunk file half "
                  "written"),
        ("restarts that found their disk tier",
         f"{cn.get('restarts_found_disk', 0)} of {cn.get('restarts', 0)} "
         f"({cn.get('chunk_files_found_after_restart', 0)} chunk files indexed, "
         f"{cn.get('stale_temp_files_removed_on_restart', 0)} stale temporary files removed)"),
        ("pauses", both("pause")),
        ("files deleted", both("delete")),
        ("files truncated", both("truncate")),
        ("files corrupted", both("corrupt")),
        ("blind damage: files hit", str(cn.get("files_damaged_blind", 0))),
        ("targeted damage read by the load it was made under",
         str(cn.get("damage_seen_mid_load", 0))),
        ("full disk",
         f"{kinds['full_disk']}: {cn.get('writes_refused_by_full_disk', 0)} writes refused "
         f"(ENOSPC), {cn.get('writes_on_full_disk_after_eviction', 0)} written after evicting, "
         f"{cn.get('restarts_on_full_disk', 0)} restarts on the full disk"),
        ("client: answered / timeouts / stale answers dropped / duplicate answers",
         f"{c['answered']} / {c['timeouts']} / {c['stale_answers_dropped']} / "
         f"{c['duplicate_answers']}"),
        ("driver (client) RSS growth", f"{fig['driver_rss_growth_kib'] / 1024:+.1f} MiB"),
        ("violations", str(fig["violation_count"])),
    ]
    workers = []
    for rank, w in fig["workers"].items():
        rss = ("killed, restarted" if w["rss_growth_kib"] is None
               else f"{w['rss_baseline_kib'] / 1024:.1f} → {w['rss_end_kib'] / 1024:.1f} MiB "
                    f"({w['rss_growth_kib'] / 1024:+.1f})")
        workers.append(
            f"| {rank} | {w['restarts']} | {w['requests_accepted']} | {w['answers_sent']} | "
            f"{w['deadline_expired']} | {w['disk_errors']} | {w['disk_writes_dropped']} | {rss} |"
        )
    table = "\n".join(f"| {name} | {value} |" for name, value in figures)
    body = f"""## Chaos

`tests/chaos.py` runs whole worker processes under failure while one `LookupClient` is used
from {fig['settings']['threads']} threads at once, and checks the contract all along. The
worker ranks ({fig['settings']['ranks']}, each a `WorkerRuntime` serving lookups over ipc, with
a CPU tier much smaller than the data and a disk tier in one shared directory) hold prompts
whose every chunk has known bytes. The threads look prompts up (whole, partial, with unknown
tails; half with precomputed hashes, which sends from the calling thread), cancel some
mid-lookup, claim answered ones on every rank and compare every claimed byte, or cancel them,
and now and then store prompts. Meanwhile faults come on a seeded random schedule:

* **kill** — SIGKILL, then a restart as a supervisor would do it (rank 0 is never killed, so
  one process lives through the whole run); the new process must index exactly the chunk files
  the old one left and remove exactly its stale temporary files;
* **pause** — SIGSTOP (waiting until every thread of the process has stopped), then SIGCONT;
* **delete**, **truncate**, **corrupt** a chunk file (a flipped payload or header byte, or
  another chunk's file under its name);
* **full disk** — the directory is a small tmpfs, filled to the last page and the last inode:
  every rank's disk writes must fail and be dropped and counted, with no temporary file left
  (a rank at its capacity may first evict its own files, which frees exactly the room a new
  file takes); lookups still answer from memory; a worker restarts on the full disk and finds
  its files; once the space is back, writes succeed again.

Half of the faults are *targeted*: they set up a case whose outcome is known exactly — a
worker killed while a disk read of a lookup is held inside its load (that lookup ends as 0;
the restarted worker serves the prompt from disk), or while one of its chunk files is half
written (the restarted worker removes that temporary file); a file damaged while the load that
reads it is held before its first read (the answer is exactly the chunks before the damaged
one, a corrupt file is removed and counted); a lookup sent to a stopped worker (it times out
to 0). The other half are *blind*: a random rank or file at a random moment, under load.

Checked all along: every answer is a whole number of chunks within what was stored and never
changes once given; every claimed chunk has exactly the stored bytes under the right key; on
every live worker `answers_sent ≤ requests_accepted`, `lookups_failed = 0`,
`lookups_expired = 0` (every held result is claimed or cancelled, so one that expires lost its
cleanup), no malformed message, no error logged, the limiter within bounds. Checked at the
end, after a barrier lookup that every cleanup precedes: every live worker has
`answers_sent = requests_accepted`, nothing in flight or held, no pin, limiter 0, arena bytes
= CPU tier bytes; the client's counters match the driver's (every lookup submitted once,
answered or timed out at most once, no duplicate answer, none pending); after closing the
client and the workers no file descriptor, thread or ZeroMQ thread is left; RSS growth of the
processes never killed (the client's share includes its table of the last 65,536 forgotten
ids, kept for a late cancel, which fills as the run goes on).

Found by this session so far: a worker could not restart on a full disk — the start-up probe
file failed with `ENOSPC` (no free inode) and the disk tier took that for an unwritable
`disk_path`. Now a full file system at start-up is a warning, and the tier serves what it
holds.

Command: `{command}` (`nox -s chaos` runs it; `nox -s chaos -- --seconds 600 --seed 7`
changes the budget and the schedule; `--smoke` is the scripted short run in the test suite,
`tests/test_chaos.py`). Machine: {_machine()}. Disk: {fig['disk']['how']}.

| figure | value |
|---|---|
{table}

Per worker (counters of the process alive at the end; a killed process takes its own with it):

{WORKER_TABLE_HEAD}
{chr(10).join(workers)}
"""
    text = path.read_text() if path.exists() else "# Reliability\n"
    m = re.search(r"^## Chaos\n", text, flags=re.M)
    if m is None:
        text = text.rstrip("\n") + "\n\n" + body
    else:
        nxt = re.search(r"^## ", text[m.end():], flags=re.M)
        end = m.end() + nxt.start() if nxt else len(text)
        text = text[: m.start()] + body + ("\n" + text[end:] if nxt else "")
    path.write_text(text)


# ---------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.chaos", description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=180.0, help="fault phase (default 180)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--smoke", action="store_true", help="the short scripted run of the tests")
    p.add_argument("--lookup-timeout", type=float, default=2.0,
                   help="the client's lookup_timeout_s (default 2)")
    p.add_argument("--report", type=Path, help="write the figures under '## Chaos' in this file")
    p.add_argument("--json", type=Path, help="write the figures as JSON here")
    p.add_argument("--no-namespace", action="store_true",
                   help="do not re-run under unshare (no tmpfs unless already in one)")
    p.add_argument("--mooncake", action="store_true",
                   help="every rank also has the Mooncake tier (needs Mooncake installed; runs "
                        "in a private network namespace)")
    args = p.parse_args(argv)
    if not os.environ.get(_IN_NAMESPACE) and not args.no_namespace:
        prefix = _unshare_prefix(net=args.mooncake)
        if prefix is not None:
            env = dict(os.environ, **{_IN_NAMESPACE: " ".join(["unshare", *prefix[1:]])})
            cmd = [*prefix, sys.executable, "-m", "tests.chaos", *(argv or sys.argv[1:])]
            return subprocess.run(cmd, env=env).returncode
    logging.basicConfig(level=logging.ERROR)  # the client warns on every timeout
    if args.mooncake:
        from lmprefetch.bench.netns import bring_loopback_up, loopback_only

        from .mooncake_servers import missing

        if loopback_only():
            bring_loopback_up()
        problem = missing()
        if problem is not None:
            print(f"chaos: --mooncake: {problem}", file=sys.stderr)
            return 2
    if args.smoke:
        s = Settings.smoke_run(args.seed)
    else:
        s = Settings(seconds=args.seconds, seed=args.seed)
    s.lookup_timeout_s = args.lookup_timeout
    s.mooncake = args.mooncake
    # Room for every rank's tier at its capacity (so only the ballast makes the disk full),
    # and inodes for four times the files that fit.
    disk = _setup_disk(s.ranks * s.disk_bytes + 4 * MiB, 4 * s.ranks * s.disk_bytes // FILE_BYTES)
    try:
        h = Harness(s, disk)
        fig = h.run()
    finally:
        _teardown_disk(disk)
    print(summary(fig), flush=True)
    if args.json:
        args.json.write_text(json.dumps(fig, indent=1, default=str))
    if args.report and not args.smoke:
        command = f"python -m tests.chaos --seconds {s.seconds:g} --seed {s.seed}"
        if s.lookup_timeout_s != 2.0:
            command += f" --lookup-timeout {s.lookup_timeout_s:g}"
        write_report(args.report, fig, command)
    return 1 if fig["violation_count"] or fig["aborted"] else 0


if __name__ == "__main__":
    sys.exit(main())
