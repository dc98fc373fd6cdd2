"""`LookupClient`: the scheduler-side lookup client (synchronous API, one bridge thread).

Engine schedulers are synchronous and run once per step, so the client's contract is: the
scheduler asks :meth:`LookupClient.lookup` as often as it likes, it answers at once (``None``:
still pending; an ``int``: leading tokens the workers have ready), and **no call ever sleeps
or waits for the network**.  LMCache's client sleeps 10 ms per submit and per pending poll,
under a lock (D08); here a pending poll is a dictionary read and a clock read.

How a lookup travels:

1. The first :meth:`~LookupClient.lookup` of an id registers an entry in the result table
   (before anything is sent, so no answer can arrive for an unknown entry), appends a command
   to a thread-safe deque and wakes the bridge thread.  That is all the scheduler pays.
2. The **bridge thread** owns every socket and the ZeroMQ context.  It hashes the prompt
   (:class:`~lmprefetch.hashing.ChunkHasher`), encodes one ``LookupRequestMsg`` and pushes the
   same frame to every worker.  It blocks in a ``zmq.Poller`` over the response socket and a
   wake-up file descriptor (an ``eventfd``, or a pipe where there is none); it never sleeps.
3. Every worker rank answers with a ``LookupResponseMsg``.  The bridge thread records each
   rank's answer once (by ``worker_id``; an LMCache answer has none and counts as one rank),
   and when all ranks answered, publishes the **minimum** and notifies waiters.
4. Later polls return that integer until the engine calls :meth:`~LookupClient.forget` (it
   scheduled the request; the workers keep the prefetch for the model step to claim) or
   :meth:`~LookupClient.cancel` (abort: a cleanup goes to every worker at once, D03).

Timeouts are noticed by the poll itself: the first poll after ``lookup_timeout_s`` answers 0,
logs one warning and sends a cleanup to every worker; later polls keep answering 0 without
raising (D07).  Every lookup gets a client-wide sequence number that travels in the request
and comes back in the answers, so answers to an earlier lookup of a reused id are dropped
(D06); the request also carries its absolute deadline so workers stop when the scheduler has
given up (D16).

Threads: :meth:`lookup`, :meth:`cancel`, :meth:`forget`, :meth:`stats` and :meth:`close` may be
called from any thread.  The client owns its own ``zmq.Context`` and closing it terminates
only that (D19).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from types import TracebackType
from typing import Any, Final

import msgspec
import zmq

from .config import PrefetchConfig
from .hashing import ChunkHasher
from .protocol import (
    LookupCleanupMsg,
    LookupRequestMsg,
    LookupResponseMsg,
    decode_response,
    encode,
)
from .transport import (
    check_endpoint,
    close_context,
    make_pull,
    make_push,
    open_context,
    try_send,
)

__all__ = ["LookupClient", "LookupClientError"]

logger = logging.getLogger("lmprefetch.client")

_monotonic = time.monotonic

#: How many forgotten ids remember their last ``seq`` for a later :meth:`LookupClient.cancel`;
#: past it the oldest are dropped and such a cancel sends ``seq=0`` ("whatever is held").
_REMEMBERED_SEQS: Final = 65_536
#: Answers the bridge thread takes off the socket per batch before it looks at commands again.
_ANSWER_BATCH: Final = 4_096
#: The bridge thread's poll timeout when idle, only to notice that the main thread ended
#: without :meth:`LookupClient.close` (so the process can still exit).  Not on any hot path.
_IDLE_CHECK_MS: Final = 500

# Commands for the bridge thread.  Plain tuples: they are built on the scheduler's thread,
# where every nanosecond counts.
#   (_REQUEST, lookup_id, seq, token_ids, n_tokens, skip_tokens, request_configs,
#    hashes, offsets, deadline_ms)
#   (_CLEANUP, lookup_id, seq)
#   (_STOP,)
_REQUEST: Final = 0
_CLEANUP: Final = 1
_STOP: Final = 2


class LookupClientError(RuntimeError):
    """The client's bridge thread died, so no lookup can be answered any more.

    Raised by every later :meth:`LookupClient.lookup` and :meth:`LookupClient.wait` (never a
    silent 0), with the thread's exception as ``__cause__``; the traceback was also logged
    when the thread died.  Close the client and make a new one (or restart the process).
    """


class _Entry:
    """One lookup in the result table.

    ``result`` is written under the client's lock and read without it (a single attribute
    read is atomic); everything else is only touched under the lock.
    """

    __slots__ = (
        "answered_at",
        "answers",
        "deadline",
        "expected",
        "result",
        "seq",
        "submitted_at",
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
        self.timed_out = False
        #: ``time.monotonic()`` at submit, and when the last rank's answer arrived.
        self.submitted_at = 0.0
        self.answered_at: float | None = None


class _Waker:
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


class LookupClient:
    """Ask every worker rank how much of a prompt is cached, without ever blocking.

    Args:
        config: chunking, hashing, ``lookup_timeout_s`` and ``socket_hwm`` are used.
        worker_endpoints: each worker rank's request endpoint (the client connects a PUSH
            socket to each); the number of ranks that must answer is their count.
        response_endpoint: where the client binds its PULL socket for answers
            (``tcp://host:0`` picks a free port; see :attr:`response_endpoint`).

    Raises:
        ValueError: no worker endpoints, or an endpoint fails
            :func:`~lmprefetch.transport.check_endpoint`.
        zmq.ZMQError: the response endpoint cannot be bound (e.g. it is in use).
    """

    def __init__(
        self, config: PrefetchConfig, worker_endpoints: list[str], response_endpoint: str
    ) -> None:
        if not worker_endpoints:
            raise ValueError("worker_endpoints: at least one worker endpoint is needed")
        self._worker_endpoints = [check_endpoint(url) for url in worker_endpoints]
        self._response_endpoint = check_endpoint(response_endpoint)
        self._config = config
        self._timeout_s = float(config.lookup_timeout_s)
        self._chunk_size = config.chunk_size
        self._expected = len(self._worker_endpoints)
        self._hasher = ChunkHasher(
            config.chunk_size, config.hash_algorithm, config.save_partial_chunks
        )

        # The result table.  Read without the lock on the poll path; written under it.
        self._entries: dict[str, _Entry] = {}
        self._last_seq: OrderedDict[str, int] = OrderedDict()
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        # The PUSH sockets, once the bridge made them.  Sends on them (from the bridge, or
        # from a caller submitting precomputed hashes) happen under ``_send_lock``, which
        # also orders them with the bridge closing the sockets (it sets this to None).
        self._pushes: list[zmq.Socket[bytes]] | None = None
        self._send_lock = threading.Lock()
        self._next_seq = 1
        self._next_anonymous_rank = -2
        self._closed = False

        # Callers append under the lock; only the bridge thread pops.
        self._commands: deque[tuple[Any, ...]] = deque()
        # True while a wake-up is written and not yet consumed: later commands need not
        # pay for another write() (the bridge clears the flag before it drains the deque).
        self._wake_pending = False
        self._waker = _Waker()

        self._counters = dict.fromkeys(
            (
                "submitted",
                "answered",
                "timeouts",
                "cancels",
                "stale_answers_dropped",
                "duplicate_answers",
                "malformed_answers",
                "sends_dropped",
                "hash_errors",
            ),
            0,
        )

        self._startup_error: BaseException | None = None
        #: Why the bridge thread died, if it did (read without the lock on every lookup).
        self._failure: BaseException | None = None
        ready = threading.Event()
        self._thread = threading.Thread(
            target=self._bridge, args=(ready,), name="lmprefetch-client-bridge", daemon=False
        )
        self._thread.start()
        ready.wait()
        if self._startup_error is not None:
            self._closed = True
            self._thread.join()
            self._waker.close()
            raise self._startup_error

    # -- the scheduler's API ------------------------------------------------------------

    def lookup(
        self,
        lookup_id: str,
        token_ids: Sequence[int] | Any,
        *,
        skip_tokens: int = 0,
        request_configs: dict[str, str] | None = None,
        hashes: list[int] | None = None,
        offsets: list[int] | None = None,
    ) -> int | None:
        """How many leading tokens of this prompt the workers have ready; never blocks.

        The first call for an id starts the lookup and returns ``None``.  Later calls return
        ``None`` while some rank has not answered, then the minimum over the ranks (kept
        until :meth:`forget` or :meth:`cancel`).  After ``lookup_timeout_s`` without every
        answer, the call returns 0, logs one warning and sends a cleanup to every worker;
        later calls keep returning 0.  Only the first call reads the arguments after
        ``lookup_id``.

        The first call is O(1): hashing and sending happen on the bridge thread, which reads
        the first ``len(token_ids)`` tokens later, so those must not be changed in place
        until the lookup is answered (appending is fine).  With precomputed ``hashes`` there
        is nothing to hash, and the request is sent from the calling thread at once (a few
        microseconds per worker), saving the hop to the bridge thread.

        Args:
            lookup_id: the engine's request id.
            token_ids: the prompt (a list of ints, ``array``, numpy array or torch tensor);
                ignored when ``hashes`` is given.
            skip_tokens: leading tokens the engine already holds; rounded down to whole
                chunks, which workers count as hit without probing or loading them.
            request_configs: passed through to the workers (LMCache's per-request settings).
            hashes: pre-computed chunk hashes (skips hashing); give ``offsets`` with them.
            offsets: tokens per chunk, one per hash.

        Raises:
            LookupClientError: the bridge thread died (see its ``__cause__``).
            RuntimeError: the client is closed.
            ValueError: ``skip_tokens`` is negative, or only one of ``hashes`` / ``offsets``
                is given, or they differ in length.
        """
        if self._failure is not None:
            self._raise_failure()
        e = self._entries.get(lookup_id)
        if e is not None:
            result = e.result
            if result is not None:
                return result
            if _monotonic() < e.deadline:
                return None
            return self._expire(lookup_id, e)
        return self._submit(lookup_id, token_ids, skip_tokens, request_configs, hashes, offsets)

    def cancel(self, lookup_id: str) -> None:
        """Abort a lookup: drop it here and send a cleanup to every worker now.

        Idempotent, never blocks, and does not depend on any other traffic (D03).  The
        cleanup names the lookup's ``seq`` (the last one known for a forgotten id, else 0:
        "whatever is held under this id").  A no-op after :meth:`close`.
        """
        with self._lock:
            if self._closed:
                return
            e = self._entries.pop(lookup_id, None)
            seq = e.seq if e is not None else self._last_seq.get(lookup_id, 0)
            if seq:
                self._remember_seq(lookup_id, seq)
            self._counters["cancels"] += 1
            self._commands.append((_CLEANUP, lookup_id, seq))
            self._wake_locked()
            self._cond.notify_all()

    def forget(self, lookup_id: str) -> None:
        """The engine used the answer: drop the id here; the workers keep its prefetch.

        The next :meth:`lookup` of this id starts afresh with a new ``seq``, so answers still
        in flight for the old one are dropped.  A later :meth:`cancel` still reaches the old
        prefetch (its ``seq`` is remembered).  Idempotent, never blocks.
        """
        with self._lock:
            e = self._entries.pop(lookup_id, None)
            if e is not None:
                self._remember_seq(lookup_id, e.seq)
                self._cond.notify_all()

    def wait(self, lookup_id: str, timeout_s: float) -> int | None:
        """Block until the lookup is answered, times out, or ``timeout_s`` passes.

        A helper for tests, benchmarks and synchronous callers; the scheduler path never uses
        it.  It waits on a condition the bridge thread notifies (no polling).  When the
        lookup's own deadline passes first, it behaves as a poll after the timeout would
        (answers 0, one warning, cleanup sent).

        Returns:
            The result, or ``None`` if ``timeout_s`` passed first or the lookup was
            cancelled, forgotten or the client closed meanwhile.

        Raises:
            KeyError: no lookup with this id is known.
            LookupClientError: the bridge thread died (before or during the wait).
        """
        end = _monotonic() + timeout_s
        with self._cond:
            e = self._entries.get(lookup_id)
            if e is None:
                raise KeyError(lookup_id)
            while True:
                if self._failure is not None:
                    self._raise_failure()
                if self._entries.get(lookup_id) is not e:
                    return None
                if e.result is not None:
                    return e.result
                now = _monotonic()
                if now >= e.deadline:
                    break
                if now >= end:
                    return None
                self._cond.wait(min(end, e.deadline) - now)
        return self._expire(lookup_id, e)

    def timing(self, lookup_id: str) -> tuple[float, float | None] | None:
        """``(submitted_at, answered_at)`` in ``time.monotonic()`` seconds for a known lookup;
        ``answered_at`` is when the last rank's answer arrived (``None`` if it has not, or the
        lookup timed out).  For benchmarks and metrics; ``None`` for an unknown id."""
        e = self._entries.get(lookup_id)
        if e is None:
            return None
        return e.submitted_at, e.answered_at

    def stats(self) -> dict[str, int]:
        """Counters: ``submitted``, ``answered``, ``timeouts``, ``cancels``,
        ``stale_answers_dropped`` (for an unknown, older, answered or timed-out lookup),
        ``duplicate_answers`` (a rank answered twice), ``malformed_answers``,
        ``sends_dropped`` (a worker's queue was at its high-water mark), ``hash_errors``
        (unhashable prompts, answered 0) and ``pending`` (lookups awaiting answers).
        """
        with self._lock:
            out = dict(self._counters)
            out["pending"] = sum(1 for e in self._entries.values() if e.result is None)
        return out

    @property
    def response_endpoint(self) -> str:
        """The bound response endpoint (with the real port after binding ``tcp://…:0``)."""
        return self._response_endpoint

    @property
    def worker_endpoints(self) -> list[str]:
        return list(self._worker_endpoints)

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Stop the bridge thread and close the sockets and the client's own context.

        Joins the bridge thread; sockets close with ``linger=0`` (queued messages are
        dropped: workers release unclaimed prefetches after ``claim_ttl_s``).  Pending
        :meth:`wait` calls return ``None``.  Idempotent; later :meth:`lookup` calls raise
        :class:`RuntimeError`.  Terminates only this client's ``zmq.Context`` (D19).
        """
        with self._lock:
            if not self._closed:
                self._closed = True
                self._commands.append((_STOP,))
                self._waker.wake()
        self._thread.join()
        with self._lock:
            self._entries.clear()
            self._cond.notify_all()
            self._waker.close()

    def __enter__(self) -> LookupClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    # -- scheduler-thread helpers -------------------------------------------------------

    def _submit(
        self,
        lookup_id: str,
        token_ids: Any,
        skip_tokens: int,
        request_configs: dict[str, str] | None,
        hashes: list[int] | None,
        offsets: list[int] | None,
    ) -> int | None:
        if skip_tokens < 0:
            raise ValueError(f"skip_tokens: must be >= 0, got {skip_tokens}")
        if hashes is None:
            if offsets is not None:
                raise ValueError("offsets: give hashes with them")
            n_tokens = len(token_ids)
        else:
            if offsets is None or len(offsets) != len(hashes):
                raise ValueError("hashes and offsets: give both, one offset per hash")
            n_tokens = 0
        deadline_ms = int((time.time() + self._timeout_s) * 1000)
        with self._lock:
            if self._closed:
                raise RuntimeError("LookupClient is closed")
            e = self._entries.get(lookup_id)
            if e is not None:  # another thread submitted it meanwhile
                return e.result
            seq = self._next_seq
            self._next_seq = seq + 1
            # Register before the request can leave, so even an instant answer finds it.
            now = _monotonic()
            e = _Entry(seq, now + self._timeout_s, self._expected)
            e.submitted_at = now
            self._entries[lookup_id] = e
            self._counters["submitted"] += 1
            cmd = (
                _REQUEST,
                lookup_id,
                seq,
                token_ids,
                n_tokens,
                skip_tokens,
                request_configs,
                hashes,
                offsets,
                deadline_ms,
            )
            if hashes is None:
                self._commands.append(cmd)
                self._wake_locked()
        if hashes is not None:
            # Precomputed hashes: nothing to hash, so send from this thread at once and save
            # the hop to the bridge thread (a few microseconds per worker).
            self._send_request(cmd, None)
        return None

    def _expire(self, lookup_id: str, e: _Entry) -> int:
        """The poll after the deadline: answer 0, once warn and cancel on every worker."""
        with self._lock:
            if e.result is not None:  # answered, or expired by another thread, meanwhile
                return e.result
            e.result = 0
            e.timed_out = True
            self._cond.notify_all()
            if self._closed or self._entries.get(lookup_id) is not e:
                return 0
            self._counters["timeouts"] += 1
            answered = len(e.answers)
            self._commands.append((_CLEANUP, lookup_id, e.seq))
            self._wake_locked()
        logger.warning(
            "lookup %r (seq %d): %d of %d workers answered within %.3g s; "
            "answering 0 and cancelling it on every worker",
            lookup_id,
            e.seq,
            answered,
            e.expected,
            self._timeout_s,
        )
        return 0

    def _raise_failure(self) -> None:
        raise LookupClientError(
            f"the LookupClient's bridge thread died ({self._failure!r}); no lookup can be "
            "answered: close this client and make a new one"
        ) from self._failure

    def _wake_locked(self) -> None:
        if not self._wake_pending:
            self._wake_pending = True
            self._waker.wake()

    def _remember_seq(self, lookup_id: str, seq: int) -> None:
        self._last_seq[lookup_id] = seq
        self._last_seq.move_to_end(lookup_id)
        if len(self._last_seq) > _REMEMBERED_SEQS:
            self._last_seq.popitem(last=False)

    # -- the bridge thread --------------------------------------------------------------

    def _bridge(self, ready: threading.Event) -> None:
        """The bridge thread: owns the context and every socket from birth to close."""
        ctx = open_context()
        pushes: list[zmq.Socket[bytes]] = []
        pull: zmq.Socket[bytes] | None = None
        try:
            try:
                hwm = self._config.socket_hwm
                pull = make_pull(
                    ctx,
                    self._response_endpoint,
                    bind=True,
                    hwm=hwm,
                    max_message_bytes=self._config.max_message_bytes,
                )
                self._response_endpoint = pull.getsockopt_string(zmq.LAST_ENDPOINT)
                for url in self._worker_endpoints:
                    pushes.append(make_push(ctx, url, bind=False, hwm=hwm))
                self._pushes = pushes
            except Exception as exc:
                self._startup_error = exc
                return
            finally:
                ready.set()
            self._serve(pull, pushes)
        except BaseException as exc:
            # Never silent: the traceback goes to the log now, and every later lookup() and
            # wait() raises LookupClientError instead of quietly answering 0 forever.
            logger.critical(
                "lmprefetch client bridge thread failed; every later lookup raises",
                exc_info=True,
            )
            with self._lock:
                self._failure = exc
                self._cond.notify_all()
        finally:
            with self._send_lock:
                self._pushes = None
                close_context(ctx, [*pushes, *([pull] if pull is not None else [])])

    def _serve(self, pull: zmq.Socket[bytes], pushes: list[zmq.Socket[bytes]]) -> None:
        poller = zmq.Poller()
        poller.register(pull, zmq.POLLIN)
        poller.register(self._waker.read_fd, zmq.POLLIN)
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
                    self._waker.clear()
                    self._wake_pending = False
            if self._run_commands(pushes):
                return

    def _run_commands(self, pushes: list[zmq.Socket[bytes]]) -> bool:
        """Carry out queued commands in order; True when told to stop."""
        commands = self._commands
        while commands:
            cmd = commands.popleft()
            op = cmd[0]
            if op == _REQUEST:
                self._send_request(cmd, pushes)
            elif op == _CLEANUP:
                self._send_to_all(pushes, encode(LookupCleanupMsg(cmd[1], seq=cmd[2])))
            else:
                return True
        return False

    def _send_request(self, cmd: tuple[Any, ...], pushes: list[zmq.Socket[bytes]] | None) -> None:
        (_, lookup_id, seq, token_ids, n_tokens, skip_tokens, configs, hashes, offsets,
         deadline_ms) = cmd  # fmt: skip
        try:
            if hashes is None:
                if len(token_ids) != n_tokens:
                    token_ids = token_ids[:n_tokens]
                hashes = self._hasher.hash(token_ids)
                offsets = self._hasher.offsets(n_tokens)
            msg = LookupRequestMsg(
                lookup_id,
                hashes,
                offsets,
                configs,
                seq=seq,
                deadline_ms=deadline_ms,
                skip_chunks=min(skip_tokens // self._chunk_size, len(hashes)),
            )
            buf = encode(msg)
        except (ValueError, TypeError, OverflowError, msgspec.EncodeError) as exc:
            self._fail(lookup_id, seq, exc)
            return
        self._send_to_all(pushes, buf)

    def _send_to_all(self, pushes: list[zmq.Socket[bytes]] | None, buf: bytes) -> None:
        dropped = 0
        with self._send_lock:
            if self._pushes is None:  # closed meanwhile
                return
            for sock in self._pushes:
                if not try_send(sock, buf):
                    # At the high-water mark: the worker is gone or far behind.  Never block
                    # on it; the lookup times out to 0 if it mattered.
                    dropped += 1
        if dropped:
            with self._lock:
                self._counters["sends_dropped"] += dropped

    def _fail(self, lookup_id: str, seq: int, exc: Exception) -> None:
        # Log before publishing the 0, so whoever sees the 0 also finds the reason.
        logger.warning("lookup %r: cannot build the request (%s); answering 0", lookup_id, exc)
        with self._lock:
            self._counters["hash_errors"] += 1
            e = self._entries.get(lookup_id)
            if e is not None and e.seq == seq and e.result is None:
                e.result = 0
                self._cond.notify_all()

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
            except Exception:  # DecodeError by contract; whatever the bytes, never fatal
                malformed += 1
        with self._lock:
            counters = self._counters
            counters["malformed_answers"] += malformed
            completed = False
            for msg in msgs:
                e = self._entries.get(msg.lookup_id)
                # seq 0: an LMCache worker, which does not echo it; match the current entry.
                if e is None or e.result is not None or (msg.seq and msg.seq != e.seq):
                    counters["stale_answers_dropped"] += 1
                    continue
                if msg.num_hit_tokens < 0:
                    counters["malformed_answers"] += 1
                    continue
                rank = msg.worker_id
                if rank < 0:  # an LMCache worker does not say which rank it is
                    rank = self._next_anonymous_rank
                    self._next_anonymous_rank -= 1
                elif rank in e.answers:
                    counters["duplicate_answers"] += 1
                    continue
                e.answers[rank] = msg.num_hit_tokens
                if len(e.answers) >= e.expected:
                    e.result = min(e.answers.values())
                    e.answered_at = _monotonic()
                    counters["answered"] += 1
                    completed = True
            if completed:
                self._cond.notify_all()
