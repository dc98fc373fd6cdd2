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
called from any thread.  The bridge thread, its sockets and how answers are recorded live in
:mod:`lmprefetch.bridge`; the client owns its own ``zmq.Context`` (through the bridge) and
closing it terminates only that (D19).

The ``Dnn`` codes are LMCache's defects, the rows of the defect table in
``docs/cancellation.md`` ("The defects"), each with its ``test_dNN_`` regression tests.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from types import TracebackType
from typing import Any

from ._stats import as_dict, snapshot
from .bridge import Bridge, Cleanup, ClientCounters, Entry, Request, ResultTable, Stop
from .config import PrefetchConfig
from .config_checks import LOAD_POLICIES
from .transport import check_endpoint

__all__ = ["ClientStatistics", "LookupClient", "LookupClientError"]


class ClientStatistics(ClientCounters, frozen=True, gc=False):  # type: ignore[misc]
    """A snapshot of a client's counters (see :class:`~lmprefetch.bridge.ClientCounters`), and
    the lookups awaiting answers now."""

    pending: int = 0


logger = logging.getLogger("lmprefetch.client")

_monotonic = time.monotonic


class LookupClientError(RuntimeError):
    """The client's bridge thread died, so no lookup can be answered any more.

    Raised by every later :meth:`LookupClient.lookup` and :meth:`LookupClient.wait` (never a
    silent 0), with the thread's exception as ``__cause__``; the traceback was also logged
    when the thread died.  Close the client and make a new one (or restart the process).
    """


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
        check_endpoint(response_endpoint)
        self._config = config
        self._timeout_s = float(config.lookup_timeout_s)
        self._expected = len(self._worker_endpoints)
        self._next_seq = 1
        self._closed = False
        # Shared with the bridge thread; the poll path reads ``entries`` without the lock.
        self._table = table = ResultTable()
        self._entries = table.entries
        self._lock = table.lock
        self._cond = table.cond
        self._bridge = Bridge(table, config, self._worker_endpoints, response_endpoint)
        try:
            self._bridge.start()
        except BaseException:
            self._closed = True
            table.waker.close()
            raise

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
        salt: bytes | None = None,
        load_policy: str = "",
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
            salt: the tenant's name space (:func:`~lmprefetch.hashing.tenant_salt`): the
                prompt is hashed under it, so only chunks stored under the same salt can hit,
                and the request names the tenant (a digest of the salt) for workers that
                encrypt per tenant.  With ``hashes`` given the prompt is not hashed (salt
                those yourself), but the salt still names the tenant.
            load_policy: this prompt's load policy on every worker, a built-in policy's
                name (``"always"``, ``"never"``, ``"cost"``); ``""``: each worker's
                configured ``load_policy``.

        Raises:
            LookupClientError: the bridge thread died (see its ``__cause__``).
            RuntimeError: the client is closed.
            ValueError: ``skip_tokens`` is negative, or only one of ``hashes`` / ``offsets``
                is given, or they differ in length, or ``load_policy`` names no built-in
                policy.
        """
        if self._table.failure is not None:
            self._raise_failure()
        e = self._entries.get(lookup_id)
        if e is not None:
            result = e.result
            if result is not None:
                return result
            if _monotonic() < e.deadline:
                return None
            return self._expire(lookup_id, e)
        return self._submit(
            lookup_id, token_ids, skip_tokens, request_configs, hashes, offsets, salt, load_policy
        )

    def cancel(self, lookup_id: str) -> None:
        """Abort a lookup: drop it here and send a cleanup to every worker now.

        Idempotent, never blocks, and does not depend on any other traffic (D03).  The
        cleanup names the lookup's ``seq`` (the last one known for a forgotten id, else 0:
        "whatever is held under this id").  A no-op after :meth:`close`.
        """
        with self._lock:
            if self._closed:
                return
            table = self._table
            e = self._entries.pop(lookup_id, None)
            seq = e.seq if e is not None else table.last_seq.get(lookup_id, 0)
            if seq:
                table.remember_seq(lookup_id, seq)
            table.counters.cancels += 1
            table.post(Cleanup(lookup_id, seq))
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
                self._table.remember_seq(lookup_id, e.seq)
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
                if self._table.failure is not None:
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

    def tier_tokens(self, lookup_id: str) -> list[tuple[str, int]]:
        """Which tiers served an answered lookup's hit: ``(tier name, tokens)`` pairs in
        prefix order, covering the hit past the skipped tokens, as the rank whose answer is
        the result reported it.  Empty for an unknown or unanswered id, a miss, or a worker
        that does not say (an LMCache worker)."""
        e = self._entries.get(lookup_id)
        if e is None or e.result is None:
            return []
        with self._lock:
            return [item for split in e.tier_tokens.values() for item in split]

    def statistics(self) -> ClientStatistics:
        """A snapshot of the client's counters (see :class:`~lmprefetch.bridge.ClientCounters`)
        and the lookups awaiting answers now."""
        with self._lock:
            pending = sum(1 for e in self._entries.values() if e.result is None)
            return snapshot(ClientStatistics, self._table.counters, pending=pending)

    def stats(self) -> dict[str, int]:
        """:meth:`statistics` as a dict."""
        return as_dict(self.statistics())

    @property
    def response_endpoint(self) -> str:
        """The bound response endpoint (with the real port after binding ``tcp://…:0``)."""
        return self._bridge.response_endpoint

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
                self._table.commands.append(Stop())
                self._table.waker.wake()
        self._bridge.thread.join()
        with self._lock:
            self._entries.clear()
            self._cond.notify_all()
            self._table.waker.close()

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
        salt: bytes | None = None,
        load_policy: str = "",
    ) -> int | None:
        if skip_tokens < 0:
            raise ValueError(f"skip_tokens: must be >= 0, got {skip_tokens}")
        if load_policy and load_policy not in LOAD_POLICIES:
            raise ValueError(
                f"load_policy: must be one of {LOAD_POLICIES} or empty, got {load_policy!r}"
            )
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
            e = Entry(seq, now + self._timeout_s, self._expected)
            e.submitted_at = now
            self._entries[lookup_id] = e
            self._table.counters.submitted += 1
            cmd = Request(
                lookup_id=lookup_id,
                seq=seq,
                token_ids=token_ids,
                n_tokens=n_tokens,
                skip_tokens=skip_tokens,
                request_configs=request_configs,
                hashes=hashes,
                offsets=offsets,
                deadline_ms=deadline_ms,
                salt=salt,
                load_policy=load_policy,
            )
            if hashes is None:
                self._table.post(cmd)
        if hashes is not None:
            # Precomputed hashes: nothing to hash, so send from this thread at once and save
            # the hop to the bridge thread (a few microseconds per worker).
            self._bridge.send_request(cmd)
        return None

    def _expire(self, lookup_id: str, e: Entry) -> int:
        """The poll after the deadline: answer 0, once warn and cancel on every worker."""
        with self._lock:
            if e.result is not None:  # answered, or expired by another thread, meanwhile
                return e.result
            e.result = 0
            e.timed_out = True
            self._cond.notify_all()
            if self._closed or self._entries.get(lookup_id) is not e:
                return 0
            self._table.counters.timeouts += 1
            answered = len(e.answers)
            self._table.post(Cleanup(lookup_id, e.seq))
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
        failure = self._table.failure
        raise LookupClientError(
            f"the LookupClient's bridge thread died ({failure!r}); no lookup can be "
            "answered: close this client and make a new one"
        ) from failure
