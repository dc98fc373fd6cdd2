"""The Mooncake Store tier: chunks in a Mooncake distributed store, shared by every engine
pointed at the same ``mooncake_master``.

Mooncake Store (https://github.com/kvcache-ai/Mooncake) keeps objects in memory that its
clients contribute ("segments"), indexed by one master process; a client reads and writes other
clients' segments directly over TCP (or RDMA).  Every engine with this tier is such a client: it
may contribute ``segment_bytes`` of its own memory to the pool (0 for the standalone-store
deployment, where a ``mooncake_client`` process holds the pool), and its arena is registered
with Mooncake once, so that loads land in arena buffers without a copy (``batch_get_into``) and
stores are sent from them (``batch_put_from``).  A chunk is one object under ``"lmprefetch:" +
key.to_string()``, the same key every tier uses: models, ranks, dtypes, groups and salts stay
apart.  The object is the payload itself, nothing around it (see "Integrity" below).

**Threads.**  Mooncake's Python client is a blocking C++ library; every call that can wait on
the network releases the GIL (``py::gil_scoped_release`` in its bindings; other Python threads
run meanwhile).  So every call runs in ``trio.to_thread.run_sync`` under a
:class:`trio.CapacityLimiter` of ``threads`` tokens, and the Trio thread never blocks.  Calls
that touch no arena memory (the probe's ``batch_is_exist``, ``remove``, setting the client up)
are abandoned at their deadline (``timeout_s``) or on cancellation, like the Redis tier's; an
abandoned call keeps its limiter token until it really ends.

**Deadlines of calls that touch the arena.**  ``batch_get_into`` writes into arena buffers and
``batch_put_from`` reads them, so those threads are *never* abandoned: an abandoned get could
write into a slot after the caller freed it and the arena gave it to another chunk, and an
abandoned put could store the bytes of whatever chunk reuses the slot.  Instead they are kept
short, and Mooncake's own deadlines bound them:

* loads go in batches of at most ``_LOAD_BATCH_KEYS`` keys / ``_LOAD_BATCH_BYTES`` bytes, one
  thread call each, so a cancelled load waits for one batch at most and then raises;
* before the first client is made, the tier sets Mooncake's timeouts from ``timeout_s`` where
  the environment has not set them: ``MC_RPC_TIMEOUT_MS`` and ``MC_RPC_CONNECT_TIMEOUT_MS``
  (calls to the master; Mooncake's default is 30 s), ``MC_TCP_PROGRESS_TIMEOUT_SEC`` and
  ``MC_TCP_STATUS_TIMEOUT_SEC`` (a TCP transfer that stops moving is dropped; default 30 s) and
  ``MC_STORE_CLIENT_SETUP_RETRIES=1`` (Mooncake retries a failed setup 20 times, 90 s against
  a master that is down; the tier retries on its own backoff instead).

A master that dies mid-load costs nothing extra: transfers go from segment to segment, so the
ones already submitted complete, and the next call to the master fails at once (refused) or
within ``MC_RPC_TIMEOUT_MS`` (a master that hangs).  A segment owner that hangs (a stopped
process, a dead host) is the slow case: each stalled transfer is dropped after
``MC_TCP_PROGRESS_TIMEOUT_SEC``, four at a time per peer, so a batch of ``_LOAD_BATCH_KEYS``
chunks ends within about ``_LOAD_BATCH_KEYS / 4`` of those; the lookup's own deadline has
answered long before.  (Mooncake also gives up waiting on a batch after a fixed 60 s without
ending its transfers; the short batches and the progress deadline keep every transfer far
inside that.)

**Faults.**  A failed or timed-out call, a negative result code other than "not found", and a
client that cannot be set up are counted in ``stats.errors`` and start a *backoff*
(``backoff_initial_s`` doubling to ``backoff_max_s``); while backing off, or before the client
is set up, the tier answers "no more hits" at once without a thread and drops writes (counted in
``stats.writes_dropped``).  A lookup gets the prefix found before the failure, never an
exception.  If the master is unreachable when the tier opens, the tier starts without a client
and a background task sets one up, on the same backoff, until it succeeds.  Once set up, the
Mooncake client finds a restarted master by itself (it pings it and mounts its segment again);
the restarted master has lost its index, so everything stored before is a miss from then on.

**Holes (D13).**  The probe is one ``batch_is_exist`` call and counts the leading ``1``\\ s; a
``0`` ends it (the object was evicted or removed), a negative value ends it and is an error.
``batch_get_into`` answers per key; the load keeps the leading keys that were filled and stops
at the first one that was not (not found, larger than its buffer, or failed).

**Leases.**  Mooncake grants a reader a lease (the master's ``default_kv_lease_ttl``, 10 s by
default) while it reads an object, and checks after the transfer that the lease had not
expired (``LEASE_EXPIRED``, an error here, so a transfer that outlived it is not counted).  The
tier relies on the lease for nothing after that: once ``load`` returns, the bytes are in the
arena and Mooncake may evict the object.  The probe takes no lease, so a chunk evicted between
probe and load is a hole.  ``remove`` cannot delete an object under a lease (it would pull the
memory from under a reader); it retries until the lease ends, for at most
``REMOVE_LEASE_WAIT_S``.

**Integrity.**  Objects are immutable (a put of an existing key leaves it as it is), visible
only once wholly written, and read under a lease that is checked after the transfer; the length
Mooncake returns is the object's own.  So unlike a Redis value, an object needs no header: the
payload is stored as is, which keeps loads and stores zero-copy.

**Pins.**  Nothing is pinned remotely; the tier keeps :class:`~lmprefetch.tiers.base.BaseTier`'s
bookkeeping so ``pinned_count()`` shows what the engine still has to unpin.

**Codecs.**  See :mod:`lmprefetch.tiers.mooncake_calls`: zero-copy with the passthrough stage;
through a small staging arena of the tier's own with a codec or encryption.

The ``Dnn`` codes are LMCache's defects, the rows of the defect table in
``docs/cancellation.md`` ("The defects"), each with its ``test_dNN_`` regression tests.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from functools import partial
from typing import Any, Final, TypeVar

import trio

from ..codec import ChunkStage, CodecMiss
from ..codec.stage import Decodes
from ..config import MOONCAKE_SEGMENT_MIN, PrefetchConfig, parse_host_port
from ..keys import ChunkKey
from ..limiter import WeightedCapacityLimiter
from ..memory import Arena, Buffer
from . import mooncake_calls as calls
from .mooncake_store import (
    INVALID_PARAMS,
    MISSING,
    OBJECT_ALREADY_EXISTS,
    OBJECT_HAS_LEASE,
    MooncakeStore,
    code_name,
    set_environment,
)
from .remote import (
    CLOSE_TIMEOUT_S,
    CONNECT_SLACK_S,
    KEY_PREFIX,
    RemoteTier,
    Unavailable,
    load_batches,
    timed,
)
from .writebehind import WriteEntry

__all__ = [
    "CLOSE_TIMEOUT_S",
    "CONNECT_SLACK_S",
    "KEY_PREFIX",
    "MooncakeStore",
    "MooncakeTier",
    "mooncake_key",
    "open_mooncake_tier",
    "open_mooncake_tier_from_config",
]

log = logging.getLogger(__name__)

_T = TypeVar("_T")

# One load batch: one thread call, waited for whole when the load is cancelled.
_LOAD_BATCH_KEYS: Final = 16
_LOAD_BATCH_BYTES: Final = 32 * 1024 * 1024
# One write batch: one batch_put_from.
_WRITE_BATCH_KEYS: Final = 16
_WRITE_BATCH_BYTES: Final = 32 * 1024 * 1024
#: Slots of the staging arena (a codec or encryption on), and the most one batch takes.
_STAGING_SLOTS: Final = 16
_STAGED_BATCH_KEYS: Final = 8

#: Threads (concurrent Mooncake calls) per tier.
DEFAULT_THREADS: Final = 4
#: Chunks waiting for their write-behind; past it writes are dropped and counted.
DEFAULT_WRITE_QUEUE: Final = 1024
# Opening the tier waits CONNECT_SLACK_S on top of ``timeout_s`` for a client to be set up (it
# connects to the master and mounts the segment; against a master that is down, Mooncake
# spends about 4.5 s on it); past it the tier opens without one and sets it up meanwhile.
#: The longest :meth:`MooncakeTier.remove` waits for readers' leases on the object to end.
REMOVE_LEASE_WAIT_S: Final = 15.0
_REMOVE_POLL_S: Final = 0.05


def mooncake_key(key: ChunkKey) -> str:
    """The Mooncake object key ``key`` is stored under."""
    return KEY_PREFIX + key.to_string()


class _SetupFailed(Exception):
    """Setting a client up failed (the message says how)."""


class MooncakeTier(RemoteTier):
    """Chunks in Mooncake Store, through one Mooncake client.

    Open it with :func:`open_mooncake_tier`, which sets the client up, registers the arena and
    runs the write-behind and reconnecting tasks.  Constructing a tier does no I/O.

    Args:
        master: ``host:port`` of ``mooncake_master``'s RPC service.
        metadata_server: where clients find each other's segments: ``"P2PHANDSHAKE"`` (no
            server: peers exchange descriptors directly), an ``http://host:port/metadata``
            URL (the master's ``--enable_http_metadata_server``), or an ``etcd://`` /
            ``redis://`` address.
        protocol: ``"tcp"`` or ``"rdma"``.
        local_hostname: the address other clients reach this one's transfer engine at.
        segment_bytes: memory this client contributes to the pool (0: none; the
            standalone-store deployment).
        timeout_s: deadline of one call (see the module docstring for the calls that are
            bounded by Mooncake's own timeouts instead).
        threads: concurrent Mooncake calls (worker threads).
        write_queue: writes waiting for the writer; past it writes are dropped and counted.
        backoff_initial_s: first backoff after a failure; doubles on every further failure.
        backoff_max_s: ceiling of the backoff.
        rdma_devices: RDMA devices (``protocol="rdma"``; empty: Mooncake chooses).
        store_factory: makes a client (default: a ``MooncakeDistributedStore``; tests pass a
            fake).
        stage: the codec stage (``mooncake_codec``, encryption); ``None``: payloads as they
            are (zero-copy).

    Raises:
        ValueError: a setting is out of range (``master`` not ``host:port``, ...).
    """

    name = "mooncake"
    write_batch_keys = _WRITE_BATCH_KEYS
    write_batch_bytes = _WRITE_BATCH_BYTES

    def __init__(
        self,
        master: str,
        *,
        metadata_server: str = "P2PHANDSHAKE",
        protocol: str = "tcp",
        local_hostname: str = "127.0.0.1",
        segment_bytes: int = 0,
        timeout_s: float = 1.0,
        threads: int = DEFAULT_THREADS,
        write_queue: int = DEFAULT_WRITE_QUEUE,
        backoff_initial_s: float = 0.5,
        backoff_max_s: float = 30.0,
        rdma_devices: str = "",
        store_factory: Callable[[], MooncakeStore] | None = None,
        stage: ChunkStage | None = None,
    ) -> None:
        parse_host_port(master)
        super().__init__(
            timeout_s=timeout_s,
            threads=threads,
            write_queue=write_queue,
            backoff_initial_s=backoff_initial_s,
            backoff_max_s=backoff_max_s,
            stage=stage,
        )
        if segment_bytes != 0 and segment_bytes < MOONCAKE_SEGMENT_MIN:
            raise ValueError(
                f"segment_bytes: must be 0 or at least {MOONCAKE_SEGMENT_MIN} (Mooncake's "
                f"least), got {segment_bytes}"
            )
        self.master = master.strip()
        self.metadata_server = metadata_server
        self.protocol = protocol
        self.local_hostname = local_hostname
        self.segment_bytes = segment_bytes
        self.rdma_devices = rdma_devices
        self._factory = store_factory or calls.new_store
        self._setup_limiter = trio.CapacityLimiter(1)
        # The client, published under self._lock by the thread that set it up (unless the
        # tier closed meanwhile: then that thread closes it itself); the lock also guards the
        # registered arenas.
        self._store: MooncakeStore | None = None
        self._connected = trio.Event()  # set on the Trio thread once a client is set up
        self._arenas: list[Arena] = []  # registered (to be registered) with every client
        self._registered: dict[int, Arena] = {}  # id(arena) -> arena, on the current client
        # Staging (a codec or encryption on): made on first use, slots handed out in FIFO
        # order; keys whose object the stage refused, until the writer replaces it.
        self._staging: Arena | None = None
        self._staging_slots = WeightedCapacityLimiter(_STAGING_SLOTS)
        self._refused: set[ChunkKey] = set()

    # -- state -------------------------------------------------------------------------
    @property
    def connected(self) -> bool:
        """A client is set up (the master may still be down: calls then fail and back off)."""
        return self._store is not None

    async def wait_connected(self) -> None:
        """Wait until a client is set up (the tier's own task keeps trying meanwhile)."""
        await self._connected.wait()

    def _usable(self) -> bool:
        return self._store is not None and super()._usable()

    def _limiters(self) -> Sequence[trio.CapacityLimiter]:
        return (self._limiter, self._setup_limiter)

    # -- the client ----------------------------------------------------------------------
    def add_arena(self, arena: Arena) -> None:
        """Register ``arena`` with the client (now, or when one is set up), so transfers go
        straight into and out of its slots.  The engine's arena is added when the tier opens;
        a buffer of another arena is registered on its first load or store."""
        with self._lock:
            if all(a is not arena for a in self._arenas):
                self._arenas.append(arena)

    def _register(self, store: MooncakeStore, arenas: Sequence[Arena]) -> None:
        """(Worker thread.)  Register each of ``arenas`` that is not yet registered with the
        client.  Raises :class:`_SetupFailed` when Mooncake refuses."""
        with self._lock:
            for arena in arenas:
                if id(arena) in self._registered:
                    continue
                rc = int(store.register_buffer(arena.address, arena.total_bytes))
                if rc != 0:
                    raise _SetupFailed(f"register_buffer of an arena returned {code_name(rc)}")
                self._registered[id(arena)] = arena
                if all(a is not arena for a in self._arenas):
                    self._arenas.append(arena)

    def _set_up(self) -> None:
        """(Worker thread.)  Make a client, set it up, register the arenas and publish it.
        The client is closed here if anything fails or the tier closed meanwhile."""
        if self._store is not None or self._closed:  # an earlier attempt got there, or closed
            return
        store = self._factory()
        try:
            rc = int(
                store.setup(
                    self.local_hostname,
                    self.metadata_server,
                    self.segment_bytes,
                    0,  # local_buffer_size: every transfer goes to or from a registered arena
                    self.protocol,
                    self.rdma_devices,
                    self.master,
                )
            )
            if rc != 0:
                raise _SetupFailed(f"setup returned {code_name(rc)}")
            with self._lock:
                arenas = list(self._arenas)
            for arena in arenas:
                rc = int(store.register_buffer(arena.address, arena.total_bytes))
                if rc != 0:
                    raise _SetupFailed(f"register_buffer of the arena returned {code_name(rc)}")
            with self._lock:
                if not self._closed:
                    self._store = store
                    self._registered = {id(a): a for a in arenas}
                    return
        except BaseException:
            store.close()
            raise
        store.close()  # the tier closed meanwhile: nobody will use this client

    async def connect(self, *, deadline_s: float = math.inf) -> bool:
        """Set a client up (in a worker thread): ``True`` once one is.  ``False`` (and a
        backoff) when setting up failed; ``False`` (no backoff) when ``deadline_s`` passed
        first, the attempt going on in its thread.  Never raises for an unreachable master.

        A setup is one attempt at a time: a call made while an earlier, abandoned attempt still
        runs waits for it (and returns ``True`` at once if it succeeded).

        Cancellation (or the deadline) abandons the thread: it touches no arena memory, and if
        it sets a client up after all, it publishes it (or closes it, once the tier closed)."""
        if self._store is not None or self._closed:
            await trio.lowlevel.checkpoint()
            return self._store is not None
        host = (
            self.local_hostname.rpartition(":")[0]
            if self.local_hostname.count(":") == 1
            else self.local_hostname
        )
        set_environment(self._timeout_s, self.metadata_server, host)
        connected = await self._try_set_up(deadline_s)
        if connected:
            self._connected.set()
        return connected

    async def _try_set_up(self, deadline_s: float) -> bool:
        with trio.move_on_after(deadline_s):
            try:
                await trio.to_thread.run_sync(
                    self._set_up, abandon_on_cancel=True, limiter=self._setup_limiter
                )
            except Exception as exc:
                self._failed(f"setting up a client of {self.master}", exc)
                return False
            if self._store is None:  # the tier closed meanwhile
                return False
            self._succeeded()
            log.info("mooncake tier: connected to %s", self.master)
            return True
        log.info("mooncake tier: no client of %s yet after %.3g s; still trying", self.master,
                 deadline_s)  # fmt: skip
        return self._store is not None

    async def run_connector(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Until a client is set up: wait out the backoff, try again (runs until cancelled
        or connected).  Each attempt is bounded by Mooncake's own timeouts."""
        task_status.started()
        while self._store is None and not self._closed:
            await trio.sleep_until(max(self._retry_at, trio.current_time()))
            await self.connect()

    async def _call(self, what: str, op: Callable[..., _T], *args: Any, touches_arena: bool) -> _T:
        """Run ``op(store, *args)`` in a worker thread under the limiter.

        Returns ``op``'s result.  Raises :class:`~lmprefetch.tiers.remote.Unavailable` after a
        checkpoint, without a thread, while there is no client, the tier is closed or backing
        off; and after counting the failure and starting a backoff when ``op`` raises or
        (``touches_arena`` false) misses the ``timeout_s`` deadline.

        ``touches_arena``: ``op`` reads or writes arena buffers: the thread is never
        abandoned (a cancellation waits for it; Mooncake's own timeouts bound it).  Otherwise
        a deadline or a cancellation abandons it (:meth:`_call_abandoning`).
        """
        store = self._store
        if not touches_arena or store is None:
            return await self._call_abandoning(what, partial(op, store, *args))
        if not self._usable():
            await trio.lowlevel.checkpoint()
            raise Unavailable
        try:
            return await trio.to_thread.run_sync(
                op, store, *args, abandon_on_cancel=False, limiter=self._limiter
            )
        except Exception as exc:  # a Mooncake binding error: count, back off
            self._failed(what, exc)
            raise Unavailable from None

    async def _transfer(
        self,
        what: str,
        op: Callable[..., _T],
        names: list[str],
        bufs: Sequence[Buffer],
        sizes: list[int],
        *args: Any,
    ) -> _T:
        """``op(store, names, addresses, sizes, *args)`` (``calls.get_decoded``, ``calls.put_from``,
        ``calls.encode_put``) on ``bufs``' slots, in a thread that is never abandoned, after
        registering any arena of theirs the client does not know yet.  Raises
        :class:`~lmprefetch.tiers.remote.Unavailable` as :meth:`_call` does."""
        arenas = self._unregistered(bufs)
        if arenas:
            await self._call("register_buffer", self._register, arenas, touches_arena=False)
        addresses = [calls.slot_address(buf) for buf in bufs]
        return await self._call(what, op, names, addresses, sizes, *args, touches_arena=True)

    @contextlib.asynccontextmanager
    async def _staging_buffers(self, n: int, capacity: int) -> AsyncIterator[list[Buffer]]:
        """Up to ``n`` staging slots, each holding a stored chunk of a payload of
        ``capacity`` bytes, for the block (waiting, in FIFO order, while others use them;
        fewer only when ``n`` is more than the staging arena has).  Released on exit."""
        async with self._staging_slots.hold(n) as granted:
            if self._staging is None:
                slot_bytes = -(-self.stage.max_read_bytes(capacity) // 4096) * 4096
                self._staging = Arena(slot_bytes, _STAGING_SLOTS)
            staging = self._staging
            bufs = staging.allocate_many(granted)  # never short: the limiter counts them
            try:
                yield bufs
            finally:
                staging.release_all(bufs)

    def _unregistered(self, bufs: Sequence[Buffer]) -> list[Arena]:
        seen: list[Arena] = []
        for buf in bufs:
            arena = buf.arena
            if id(arena) not in self._registered and all(a is not arena for a in seen):
                seen.append(arena)
        return seen

    # -- probe and load ------------------------------------------------------------------
    def contains_now(self, key: ChunkKey) -> bool | None:
        """``False`` while the tier cannot answer anything but "no" (no client yet, backing
        off, closed): the engine then need not start a task for it.  Else ``None``."""
        return None if self._usable() else False

    async def contains(self, key: ChunkKey) -> bool:
        """Whether ``key`` is in the store (``False`` while unavailable or on failure)."""
        return await self._exist_prefix([key]) == 1

    async def contains_prefix(self, keys: Sequence[ChunkKey], *, pin: bool) -> int:
        """How many leading ``keys`` are in the store: one ``batch_is_exist`` call, stopping at
        the first key that is not; 0 at once while unavailable.  Pins (bookkeeping only) are
        taken after the last checkpoint.  On cancellation raises ``Cancelled``, pins nothing."""
        self.stats.probes += 1
        n = await self._exist_prefix(keys)
        # no checkpoint from here: the pins are taken synchronously with the answer
        if pin and n:
            self.pin(keys[:n])
        if n:
            self.stats.hits += 1
        return n

    async def _exist_prefix(self, keys: Sequence[ChunkKey]) -> int:
        """The leading count of ``keys`` that ``batch_is_exist`` says are there (a checkpoint
        whatever happens; failures counted, never raised)."""
        if not keys:
            await trio.lowlevel.checkpoint()
            return 0
        names = [mooncake_key(key) for key in keys]
        try:
            found = await self._call("batch_is_exist", calls.exist, names, touches_arena=False)
        except Unavailable:
            return 0
        n = 0
        while n < len(found) and found[n] == 1 and keys[n] not in self._refused:
            n += 1
        if n < len(found) and found[n] == 1:  # a key whose object the stage refused
            self._succeeded()
        elif n < len(found):
            if found[n] == 0:
                # Evicted by Mooncake, or removed by another engine: a probe is how we learn.
                self._note_removed(keys[n])
                self._succeeded()
            else:
                self._failed("batch_is_exist", f"answered {code_name(found[n])} for {names[n]}")
        elif len(found) != len(names):
            self._failed("batch_is_exist", f"{len(found)} answers for {len(names)} keys")
            return 0
        else:
            self._succeeded()
        return n

    async def load(
        self, keys: Sequence[ChunkKey], buffers: Sequence[Buffer], *, tenant: bytes = b""
    ) -> int:
        """Fill ``buffers[i]`` with ``keys[i]``'s payload from the store (straight into the
        buffers, or through staging slots with a codec or encryption on; sealed chunks opened
        for ``tenant``); the contiguous count filled.

        ``batch_get_into`` in batches of at most ``_LOAD_BATCH_KEYS`` keys
        (``_STAGED_BATCH_KEYS`` staged) and ``_LOAD_BATCH_BYTES`` of buffer capacity, in
        order.  Stops at the first key that is missing, larger than its buffer, refused by the
        codec stage or failed (D13) and returns the count before it; a down or slow store ends
        the prefix there (counted, backing off), never raises.

        On cancellation raises ``Cancelled`` once the batch in flight has finished (its thread
        writes into the buffers and is never abandoned), so nothing writes into a buffer after
        this returns or raises.
        """
        total = min(len(keys), len(buffers))
        n = 0
        loaded_bytes = 0
        staged = not self.stage.passthrough
        batches = load_batches(
            buffers[:total],
            max_bytes=_LOAD_BATCH_BYTES,
            max_keys=_STAGED_BATCH_KEYS if staged else _LOAD_BATCH_KEYS,
        )
        for start, end in batches:
            bufs = buffers[start:end]
            names = [mooncake_key(key) for key in keys[start:end]]
            key_names = [key.to_string().encode() for key in keys[start:end]]
            try:
                results, done = await self._get_batch(names, bufs, key_names, tenant, staged=staged)
            except Unavailable:
                break
            self.stats.observe_decoded(
                done.payload_bytes, done.stored_bytes, done.seconds, decoded=done.decoded
            )
            filled = len(done.lengths)
            for buf, payload_bytes in zip(bufs, done.lengths, strict=False):
                buf.length = payload_bytes
            loaded_bytes += done.payload_bytes
            if done.miss is not None:
                self._refuse(keys[start + filled], names[filled], done.miss)
            elif filled < len(results):
                rc = results[filled]
                if rc in MISSING:
                    self._note_removed(keys[start + filled])
                elif rc != INVALID_PARAMS:  # larger than the buffer: a miss that stays there
                    self._failed("batch_get_into", f"answered {code_name(rc)} for {names[filled]}")
            elif len(results) != len(bufs):
                self._failed("batch_get_into", f"{len(results)} answers for {len(bufs)} keys")
            else:
                self._succeeded()
            n += filled
            if filled < len(bufs):
                break
        if total == 0:
            await trio.lowlevel.checkpoint()
        self.stats.chunks_loaded += n
        self.stats.bytes_loaded += loaded_bytes
        return n

    async def _get_batch(
        self,
        names: list[str],
        bufs: Sequence[Buffer],
        key_names: list[bytes],
        tenant: bytes,
        *,
        staged: bool,
    ) -> tuple[list[int], Decodes]:
        """One ``batch_get_into`` and the decoding of what it got (see :func:`calls.get_decoded`),
        through staging slots when ``staged``."""
        if not staged:
            return await self._transfer(
                "batch_get_into", calls.get_decoded, names, bufs, [buf.capacity for buf in bufs],
                bufs, None, self.stage, key_names, tenant,
            )  # fmt: skip
        async with self._staging_buffers(len(bufs), max(b.capacity for b in bufs)) as staging:
            return await self._transfer(
                "batch_get_into", calls.get_decoded, names, staging, [s.capacity for s in staging],
                bufs, staging, self.stage, key_names, tenant,
            )  # fmt: skip

    def _refuse(self, key: ChunkKey, name: str, why: CodecMiss) -> None:
        """The codec stage refused the object under ``key``: a miss from now on (probes stop
        there), until the writer replaces the object (objects are immutable)."""
        self.stats.codec_misses += 1
        self._refused.add(key)
        log.warning("mooncake tier: object %s refused (%s)", name, why)

    async def remove(self, key: ChunkKey) -> bool:
        """Delete ``key`` from the store (and drop its queued write); ``True`` if it was there.

        An object a reader holds a lease on cannot be deleted: this retries until the lease
        ends, for at most ``REMOVE_LEASE_WAIT_S`` (then ``False``, and the object stays).
        ``False`` too while the store is unavailable."""
        found = self._writes.remove(key)
        removed = await self._remove_remote(key)
        return removed or found

    async def _remove_remote(self, key: ChunkKey) -> bool:
        name = mooncake_key(key)
        deadline = trio.current_time() + REMOVE_LEASE_WAIT_S
        while True:
            try:
                rc = await self._call("remove", calls.remove, name, touches_arena=False)
            except Unavailable:
                return False
            if rc == 0 or rc in MISSING:
                self._succeeded()
                self._note_removed(key)  # gone now, whoever deleted it
                return rc == 0
            if rc != OBJECT_HAS_LEASE:
                self._failed("remove", f"answered {code_name(rc)} for {name}")
                return False
            if trio.current_time() >= deadline:
                log.info("mooncake tier: %s is still leased by a reader; not removed", name)
                return False
            await trio.sleep(_REMOVE_POLL_S)

    # -- write-behind ------------------------------------------------------------------
    async def _write_batch(self, batch: list[WriteEntry]) -> None:
        live: list[tuple[WriteEntry, Buffer]] = []
        for entry in batch:
            entry.written = True  # accounted below, or counted dropped by the loop if cancelled
            buf = entry.buffer
            if entry.removed or buf is None:
                continue
            if buf.length == 0:  # Mooncake stores no empty object
                self.stats.writes_dropped += 1
                continue
            live.append((entry, buf))
        if not live:
            await trio.lowlevel.checkpoint()
            return
        # An object the stage refused stays until removed (objects are immutable): remove it
        # here, off the model's path, before a good one is put under its key.
        for entry, _ in live:
            if entry.key in self._refused and await self._remove_remote(entry.key):
                self._refused.discard(entry.key)
        if self.stage.passthrough:
            await self._put_batch(live)
            return
        for first in range(0, len(live), _STAGED_BATCH_KEYS):
            await self._put_batch(live[first : first + _STAGED_BATCH_KEYS])

    async def _put_batch(self, live: list[tuple[WriteEntry, Buffer]]) -> None:
        """One ``batch_put_from``: from the arena buffers (a passthrough stage), or from
        staging slots the writer's thread encodes them into."""
        bufs = [buf for _, buf in live]
        names = [mooncake_key(entry.key) for entry, _ in live]
        # The entries keep their buffer references until the loop releases them after this
        # returns: the thread reads the arena, and it is never abandoned.
        spent: list[float] = []  # the call's own seconds (less its encoding): the link's
        try:
            if self.stage.passthrough:
                sizes = [buf.length for buf in bufs]
                put = timed(calls.put_from, spent)
                results = await self._transfer("batch_put_from", put, names, bufs, sizes)
            else:
                capacity = max(buf.capacity for buf in bufs)
                async with self._staging_buffers(len(bufs), capacity) as staging:
                    results, sizes, seconds = await self._transfer(
                        "batch_put_from", timed(calls.encode_put, spent), names, staging,
                        [s.capacity for s in staging], bufs, staging, self.stage,
                        [entry.key.to_string().encode() for entry, _ in live],
                        [entry.tenant for entry, _ in live],
                    )  # fmt: skip
                self.stats.encode_seconds += seconds
                spent[0] -= seconds
        except BaseException as exc:
            self.stats.writes_dropped += len(live)
            if isinstance(exc, Unavailable):
                return
            raise
        error: str | None = None
        undo: list[ChunkKey] = []
        for (entry, buf), rc, size in zip(live, results, sizes, strict=False):
            if rc in (0, OBJECT_ALREADY_EXISTS):
                self.stats.chunks_stored += 1
                self.stats.bytes_stored += buf.length
                self.stats.encoded_bytes_stored += size
                if entry.removed:  # remove(key) came while it was being stored
                    undo.append(entry.key)
                else:
                    self._note_stored(entry.key)
            else:
                self.stats.writes_dropped += 1
                if size >= 0:  # (an encoding larger than its staging slot is no error)
                    error = error or f"answered {code_name(rc)} for {mooncake_key(entry.key)}"
        self.stats.writes_dropped += max(0, len(live) - len(results))
        if error is not None:
            self._failed("batch_put_from", error)
        elif spent:  # the link's throughput, before any load measures it
            self.stats.observe_store(sum(b.length for b in bufs), spent[0])
        else:
            self._succeeded()
        for key in undo:
            await self._remove_remote(key)

    # -- shutdown ----------------------------------------------------------------------
    async def _close_client(self, *, threads_ended: bool) -> None:
        """Unregister the arenas and close the client, in a thread (bounded); a client that a
        call still uses (``threads_ended`` false) is left to the process's exit."""
        with self._lock:
            store, self._store = self._store, None
            arenas, self._registered = list(self._registered.values()), {}
        if store is None:
            return
        if not threads_ended:
            # A call is still inside the client: closing it now would pull it from under
            # that call.
            log.warning("mooncake tier: calls still running after %.0f s; the client is left "
                        "open", CLOSE_TIMEOUT_S)  # fmt: skip
            return
        with trio.move_on_after(CLOSE_TIMEOUT_S) as closing:
            await trio.to_thread.run_sync(calls.close_store, store, arenas, abandon_on_cancel=True)
        if closing.cancelled_caught:
            log.warning("mooncake tier: closing the client took over %.0f s; left to finish on "
                        "its own", CLOSE_TIMEOUT_S)  # fmt: skip
            return
        staging, self._staging = self._staging, None
        if staging is not None and staging.used_slots == 0:
            staging.close()  # unregistered, and no thread uses it any more


@asynccontextmanager
async def open_mooncake_tier(
    master: str,
    *,
    metadata_server: str = "P2PHANDSHAKE",
    protocol: str = "tcp",
    local_hostname: str = "127.0.0.1",
    segment_bytes: int = 0,
    timeout_s: float = 1.0,
    arena: Arena | None = None,
    threads: int = DEFAULT_THREADS,
    write_queue: int = DEFAULT_WRITE_QUEUE,
    backoff_initial_s: float = 0.5,
    backoff_max_s: float = 30.0,
    store_factory: Callable[[], MooncakeStore] | None = None,
    stage: ChunkStage | None = None,
) -> AsyncIterator[MooncakeTier]:
    """Open the Mooncake tier and run its writer (and, until a client is set up, its
    reconnecting task) until the block exits.

    The client is set up (connecting to the master, mounting ``segment_bytes`` into the pool)
    and ``arena`` registered in a worker thread.  A master that cannot be reached does not fail
    the caller: the tier answers misses and a background task tries again on the backoff.  On
    exit, queued writes are flushed (shielded, at most ``CLOSE_TIMEOUT_S``), anything still
    queued is released, the arena is unregistered and the client closed.

    Raises:
        ValueError: a setting is out of range (see :class:`MooncakeTier`).
    """
    tier = MooncakeTier(
        master,
        metadata_server=metadata_server,
        protocol=protocol,
        local_hostname=local_hostname,
        segment_bytes=segment_bytes,
        timeout_s=timeout_s,
        threads=threads,
        write_queue=write_queue,
        backoff_initial_s=backoff_initial_s,
        backoff_max_s=backoff_max_s,
        store_factory=store_factory,
        stage=stage,
    )
    if arena is not None:
        tier.add_arena(arena)
    connect = partial(tier.connect, deadline_s=timeout_s + CONNECT_SLACK_S)
    async with tier.running(connect, tier.run_connector):
        yield tier


def open_mooncake_tier_from_config(
    config: PrefetchConfig, arena: Arena, stage: ChunkStage | None = None
) -> contextlib.AbstractAsyncContextManager[MooncakeTier]:
    """:func:`open_mooncake_tier` with the ``mooncake_*`` fields of ``config``, registering
    the engine's ``arena``, with the codec ``stage``."""
    assert config.mooncake_master is not None
    return open_mooncake_tier(
        config.mooncake_master,
        metadata_server=config.mooncake_metadata_server,
        protocol=config.mooncake_protocol,
        local_hostname=config.mooncake_local_hostname,
        segment_bytes=config.mooncake_segment_bytes,
        timeout_s=config.mooncake_timeout_s,
        arena=arena,
        stage=stage,
    )
