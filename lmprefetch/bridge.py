"""The scheduler client's bridge thread: it owns the sockets, sends, and records answers.

:class:`~lmprefetch.client.LookupClient` is what the scheduler calls; this module is what runs
behind it.  The two share one :class:`ResultTable` (the lookups in flight, their answers, the
counters and the command queue, under one lock), and nothing else:

* The scheduler's thread registers a lookup in the table, appends a command and wakes the
  bridge (:meth:`ResultTable.post`).  That is all a submit costs it.
* The **bridge thread** (:class:`Bridge`) owns the ZeroMQ context and every socket from birth
  to close.  It blocks in a ``zmq.Poller`` over the answer socket and the :class:`Waker`'s file
  descriptor (an ``eventfd``), never sleeps, hashes prompts, pushes each request to every
  worker, and records each rank's answer; when every rank answered, the minimum is published
  on the entry and waiters are notified.
* A caller that has the chunk hashes already sends its request itself, under
  :attr:`ResultTable.send_lock` (the only other use of the push sockets), saving the hop.

Failure is never silent: if the bridge thread dies, the exception is logged with its traceback
and stored in :attr:`ResultTable.failure`, which makes every later ``lookup`` raise.  A frame
that does not decode can never kill it (it is counted as malformed).

Cancellation does not apply here (no Trio): the bridge thread stops when the client posts
:class:`Stop` (:meth:`LookupClient.close`, which joins it), or when the main thread has ended.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from typing import Any, Final, TypeAlias

import msgspec
import zmq

from .codec import tenant_id
from .config import PrefetchConfig
from .hashing import ChunkHasher
from .protocol import (
    LookupCleanupMsg,
    LookupRequestMsg,
    LookupResponseMsg,
    decode_response,
    encode,
)
from .transport import close_context, make_pull, make_push, open_context, try_send

__all__ = [
    "Bridge",
    "Cleanup",
    "ClientCounters",
    "Command",
    "Entry",
    "Request",
    "ResultTable",
    "Stop",
    "Waker",
]

logger = logging.getLogger("lmprefetch.client")

_monotonic = time.monotonic

#: How many forgotten ids remember their last ``seq`` for a later cancel; past it the oldest
#: are dropped and such a cancel sends ``seq=0`` ("whatever is held").
REMEMBERED_SEQS: Final = 65_536
#: Answers the bridge thread takes off the socket per batch before it looks at commands again.
_ANSWER_BATCH: Final = 4_096
#: The bridge thread's poll timeout when idle, only to notice that the main thread ended
#: without ``close`` (so the process can still exit).  Not on any hot path.
_IDLE_CHECK_MS: Final = 500


# Commands for the bridge thread.  They are built on the scheduler's thread, where every
# nanosecond counts: frozen msgspec Structs cost about 0.1-0.2 µs to build (a NamedTuple about
# 1 µs), a few percent of a submit (examples/bench_hot_path.py measures it).
class Request(msgspec.Struct, frozen=True, gc=False):
    """Send one lookup request to every worker (hashing the prompt first if needed)."""

    lookup_id: str
    seq: int
    #: The prompt (read only up to ``n_tokens``); unused when ``hashes`` is given.
    token_ids: Any
    n_tokens: int
    skip_tokens: int
    request_configs: dict[str, str] | None
    #: Precomputed chunk hashes and tokens per chunk, or ``None`` (hash ``token_ids``).
    hashes: list[int] | None
    offsets: list[int] | None
    #: Absolute wall-clock deadline in milliseconds.
    deadline_ms: int
    #: The tenant's salt for hashing (and naming the tenant), or ``None``.
    salt: bytes | None
    #: The request's own load policy (a built-in one's name), or ``""``: the workers'.
    load_policy: str = ""


class Cleanup(msgspec.Struct, frozen=True, gc=False):
    """Send a cleanup for ``lookup_id`` (``seq`` 0: whatever is held) to every worker."""

    lookup_id: str
    seq: int


class Stop(msgspec.Struct, frozen=True, gc=False):
    """Close the sockets and end the bridge thread."""


Command: TypeAlias = Request | Cleanup | Stop


class Entry:
    """One lookup in the result table.

    ``result`` is written under the table's lock and read without it (a single attribute read
    is atomic); everything else is only touched under the lock.
    """

    __slots__ = (
        "answered_at",
        "answers",
        "deadline",
        "expected",
        "result",
        "seq",
        "submitted_at",
        "tier_tokens",
        "timed_out",
    )

    def __init__(self, seq: int, deadline: float, expected: int) -> None:
        self.seq = seq
        #: ``time.monotonic()`` after which a poll answers 0.
        self.deadline = deadline
        #: Ranks that must answer.
        self.expected = expected
        #: worker_id → hit tokens; LMCache answers get fresh negative keys.
        self.answers: dict[int, int] = {}
        self.result: int | None = None
        #: worker_id → the tiers that served its hit (``[(tier, tokens), ...]``), where said;
        #: once answered, the split of the rank whose answer is the result.
        self.tier_tokens: dict[int, list[tuple[str, int]]] = {}
        self.timed_out = False
        #: ``time.monotonic()`` at submit, and when the last rank's answer arrived.
        self.submitted_at = 0.0
        self.answered_at: float | None = None

    def __repr__(self) -> str:
        return (
            f"<lookup seq={self.seq} answers={len(self.answers)}/{self.expected} "
            f"result={self.result}>"
        )


class Waker:
    """A file descriptor other threads make readable to wake the bridge thread's poll."""

    _ONE = (1).to_bytes(8, sys.byteorder)

    def __init__(self) -> None:
        eventfd = getattr(os, "eventfd", None)
        if eventfd is not None:
            fd: int = eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            self.read_fd, self._write_fd = fd, fd
        else:  # pragma: no cover - non-Linux
            self.read_fd, self._write_fd = os.pipe()
            os.set_blocking(self.read_fd, False)
            os.set_blocking(self._write_fd, False)
        self.closed = False

    def wake(self) -> None:
        try:
            os.write(self._write_fd, self._ONE)
        except BlockingIOError:
            pass  # the pipe is full: it is readable already

    def clear(self) -> None:
        try:
            while os.read(self.read_fd, 4096):
                pass
        except BlockingIOError:
            pass  # drained

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            os.close(self.read_fd)
            if self._write_fd != self.read_fd:
                os.close(self._write_fd)


class ClientCounters(msgspec.Struct, gc=False):
    """What a scheduler-side client did and saw (every count since it started)."""

    #: Lookups submitted (a request to every rank), and answered (by every rank).
    submitted: int = 0
    answered: int = 0
    #: Lookups given up after ``lookup_timeout_s`` (answered 0), and cancels.
    timeouts: int = 0
    cancels: int = 0
    #: Answers for an unknown, older, answered or timed-out lookup; a rank's second answer;
    #: answers that do not decode.
    stale_answers_dropped: int = 0
    duplicate_answers: int = 0
    malformed_answers: int = 0
    #: Requests not sent: a worker's queue was at its high-water mark.
    sends_dropped: int = 0
    #: Prompts that could not be hashed (answered 0).
    hash_errors: int = 0


class ResultTable:
    """What the scheduler's threads and the bridge thread share, under :attr:`lock`."""

    def __init__(self) -> None:
        #: lookup id → its entry.  Read without the lock on the poll path; written under it.
        self.entries: dict[str, Entry] = {}
        #: The last ``seq`` of forgotten ids, for a later cancel.
        self.last_seq: OrderedDict[str, int] = OrderedDict()
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        #: Callers append under the lock; only the bridge thread pops.
        self.commands: deque[Command] = deque()
        #: True while a wake-up is written and not yet consumed: later commands need not pay
        #: for another ``write()`` (the bridge clears it before it drains the commands).
        self.wake_pending = False
        self.waker = Waker()
        #: The push sockets while the bridge has them; sends on them happen under
        #: :attr:`send_lock`, which also orders them with the bridge closing them.
        self.pushes: list[zmq.Socket[bytes]] | None = None
        self.send_lock = threading.Lock()
        #: Why the bridge thread died, if it did (read without the lock on every lookup).
        self.failure: BaseException | None = None
        #: The client's counters (changed under :attr:`lock`).
        self.counters = ClientCounters()

    def post(self, command: Command) -> None:
        """Queue a command for the bridge and wake it (call with :attr:`lock` held)."""
        self.commands.append(command)
        if not self.wake_pending:
            self.wake_pending = True
            self.waker.wake()

    def remember_seq(self, lookup_id: str, seq: int) -> None:
        """Keep a forgotten id's ``seq`` for a later cancel (call with :attr:`lock` held)."""
        self.last_seq[lookup_id] = seq
        self.last_seq.move_to_end(lookup_id)
        if len(self.last_seq) > REMEMBERED_SEQS:
            self.last_seq.popitem(last=False)


class Bridge:
    """The bridge thread: see the module docstring.

    Args:
        table: the state shared with the client.
        config: ``socket_hwm``, ``max_message_bytes`` and the hashing settings are used.
        worker_endpoints: one PUSH socket connects to each.
        response_endpoint: the PULL socket for answers binds here.
    """

    def __init__(
        self,
        table: ResultTable,
        config: PrefetchConfig,
        worker_endpoints: Sequence[str],
        response_endpoint: str,
    ) -> None:
        self._table = table
        self._config = config
        self._worker_endpoints = list(worker_endpoints)
        #: The bound response endpoint (with the real port after binding ``tcp://…:0``).
        self.response_endpoint = response_endpoint
        self._chunk_size = config.chunk_size
        self._hasher = ChunkHasher.from_config(config)
        self._next_anonymous_rank = -2
        self._startup_error: BaseException | None = None
        self.thread = threading.Thread(
            target=self._run, name="lmprefetch-client-bridge", daemon=False
        )
        self._ready = threading.Event()

    def __repr__(self) -> str:
        return f"<Bridge {self.response_endpoint} alive={self.thread.is_alive()}>"

    def start(self) -> None:
        """Start the thread and wait until its sockets are bound and connected.

        Raises:
            zmq.ZMQError: the response endpoint cannot be bound (the thread has ended).
        """
        self.thread.start()
        self._ready.wait()
        if self._startup_error is not None:
            self.thread.join()
            raise self._startup_error

    # -- the thread ----------------------------------------------------------------------
    def _run(self) -> None:
        """Own the context and every socket from birth to close."""
        table = self._table
        ctx = open_context()
        pushes: list[zmq.Socket[bytes]] = []
        pull: zmq.Socket[bytes] | None = None
        try:
            try:
                hwm = self._config.socket_hwm
                pull = make_pull(
                    ctx,
                    self.response_endpoint,
                    bind=True,
                    hwm=hwm,
                    max_message_bytes=self._config.max_message_bytes,
                )
                self.response_endpoint = pull.getsockopt_string(zmq.LAST_ENDPOINT)
                for url in self._worker_endpoints:
                    pushes.append(make_push(ctx, url, bind=False, hwm=hwm))
                table.pushes = pushes
            except Exception as exc:
                self._startup_error = exc
                return
            finally:
                self._ready.set()
            self._serve(pull)
        except BaseException as exc:
            # Never silent: the traceback goes to the log now, and every later lookup() and
            # wait() raises LookupClientError instead of quietly answering 0 forever.
            logger.critical(
                "lmprefetch client bridge thread failed; every later lookup raises",
                exc_info=True,
            )
            with table.lock:
                table.failure = exc
                table.cond.notify_all()
        finally:
            with table.send_lock:
                table.pushes = None
                close_context(ctx, [*pushes, *([pull] if pull is not None else [])])

    def _serve(self, pull: zmq.Socket[bytes]) -> None:
        table = self._table
        poller = zmq.Poller()
        poller.register(pull, zmq.POLLIN)
        poller.register(table.waker.read_fd, zmq.POLLIN)
        main_thread = threading.main_thread()
        while True:
            events = poller.poll(_IDLE_CHECK_MS)
            if not events and not main_thread.is_alive():
                logger.warning("LookupClient was never closed; closing it at interpreter exit")
                return
            for what, _ in events:
                if what is pull:
                    self._receive(pull)
                else:  # the waker (the poller reports a raw fd as an int)
                    # Clear the fd first, then the flag, then drain.  A command appended
                    # while the flag is still set wrote nothing, and is drained below; one
                    # appended after the flag is cleared writes the fd again.  (The other
                    # order loses wake-ups: a write made between clearing the flag and
                    # reading the fd is swallowed while the flag stays set, and every later
                    # command then waits for the idle timeout.)
                    table.waker.clear()
                    table.wake_pending = False
            if self._run_commands():
                return

    def _run_commands(self) -> bool:
        """Carry out queued commands in order; True when told to stop."""
        commands = self._table.commands
        while commands:
            cmd = commands.popleft()
            if type(cmd) is Request:
                self.send_request(cmd)
            elif type(cmd) is Cleanup:
                try:
                    buf = encode(LookupCleanupMsg(cmd.lookup_id, seq=cmd.seq))
                except (ValueError, msgspec.EncodeError) as exc:
                    # An id msgpack cannot hold (a str that is not UTF-8): its request could
                    # not be encoded either, so no worker holds anything under it.
                    logger.warning("cancel %r: nothing to clean up (%s)", cmd.lookup_id, exc)
                    continue
                self._send_to_all(buf)
            else:
                return True
        return False

    # -- sending (the bridge thread, or a caller with precomputed hashes) ----------------
    def send_request(self, cmd: Request) -> None:
        """Hash (if needed), encode and push one request to every worker."""
        hashes, offsets = cmd.hashes, cmd.offsets
        try:
            if hashes is None:
                n_tokens = cmd.n_tokens
                token_ids = cmd.token_ids
                if len(token_ids) != n_tokens:
                    token_ids = token_ids[:n_tokens]
                hashes = self._hasher.hash(token_ids, cmd.salt)
                offsets = self._hasher.offsets(n_tokens)
            assert offsets is not None  # given with the hashes (the client checks)
            msg = LookupRequestMsg(
                cmd.lookup_id,
                hashes,
                offsets,
                cmd.request_configs,
                seq=cmd.seq,
                deadline_ms=cmd.deadline_ms,
                skip_chunks=min(cmd.skip_tokens // self._chunk_size, len(hashes)),
                # The tenant for encryption at rest: a digest of the salt, never the salt.
                tenant=tenant_id(cmd.salt),
                load_policy=cmd.load_policy,
            )
            buf = encode(msg)
        except (ValueError, TypeError, OverflowError, msgspec.EncodeError) as exc:
            self._fail(cmd.lookup_id, cmd.seq, exc)
            return
        self._send_to_all(buf)

    def _send_to_all(self, buf: bytes) -> None:
        table = self._table
        dropped = 0
        with table.send_lock:
            if table.pushes is None:  # closed meanwhile
                return
            for sock in table.pushes:
                if not try_send(sock, buf):
                    # At the high-water mark: the worker is gone or far behind.  Never block
                    # on it; the lookup times out to 0 if it mattered.
                    dropped += 1
        if dropped:
            with table.lock:
                table.counters.sends_dropped += dropped

    def _fail(self, lookup_id: str, seq: int, exc: Exception) -> None:
        # Log before publishing the 0, so whoever sees the 0 also finds the reason.
        logger.warning("lookup %r: cannot build the request (%s); answering 0", lookup_id, exc)
        table = self._table
        with table.lock:
            table.counters.hash_errors += 1
            e = table.entries.get(lookup_id)
            if e is not None and e.seq == seq and e.result is None:
                e.result = 0
                table.cond.notify_all()

    # -- receiving (the bridge thread) ---------------------------------------------------
    def _receive(self, pull: zmq.Socket[bytes]) -> None:
        """Take a batch of answers off the socket and record them under one lock."""
        msgs: list[LookupResponseMsg] = []
        malformed = 0
        for _ in range(_ANSWER_BATCH):
            try:
                buf = pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                msgs.append(decode_response(buf))
            except msgspec.DecodeError:  # whatever the bytes (the fuzz tests try them)
                malformed += 1
        table = self._table
        with table.lock:
            counters = table.counters
            counters.malformed_answers += malformed
            completed = False
            for msg in msgs:
                e = table.entries.get(msg.lookup_id)
                # seq 0: an LMCache worker, which does not echo it; match the current entry.
                if e is None or e.result is not None or (msg.seq and msg.seq != e.seq):
                    counters.stale_answers_dropped += 1
                    continue
                rank = msg.worker_id
                if rank < 0:  # an LMCache worker does not say which rank it is
                    rank = self._next_anonymous_rank
                    self._next_anonymous_rank -= 1
                elif rank in e.answers:
                    counters.duplicate_answers += 1
                    continue
                e.answers[rank] = msg.num_hit_tokens
                if msg.tier_tokens:
                    e.tier_tokens[rank] = msg.tier_tokens
                if len(e.answers) >= e.expected:
                    e.result = min(e.answers.values())
                    lowest = min(e.answers, key=e.answers.__getitem__)
                    split = e.tier_tokens.get(lowest)
                    e.tier_tokens = {lowest: split} if split else {}
                    e.answered_at = _monotonic()
                    counters.answered += 1
                    completed = True
            if completed:
                table.cond.notify_all()
