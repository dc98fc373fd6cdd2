"""The remote tier: chunks in Redis or Redis Cluster, shared by every engine that points at it.

Several engines on several machines (each with its own CPU and disk tiers) share one Redis
deployment: a chunk one engine stored is a hit for every other engine with the same model,
world size, rank and dtype.  Each chunk is one Redis string under ``"lmprefetch:" +
key.to_string()``; the key names the model, so two models never collide.  The value is a
20-byte header (magic, payload length, xxh3-64 checksum of the payload) followed by the
payload, so a truncated, foreign or corrupted value is recognised and treated as a miss.  The
magic says what follows: ``LMP\\x01`` a payload as it is, ``LMP\\x02`` what the tier's codec
stage made of it (an encoded or sealed chunk); a release that predates codecs knows only the
first, so it takes an encoded value for a corrupt one (a miss), never for a payload.

**Why redis-py's synchronous client in worker threads, not ``redis.asyncio``.**  ``redis.asyncio``
runs on asyncio's event loop; this engine runs on Trio, which cannot drive asyncio coroutines
without a bridge (trio-asyncio or a second loop in a thread), each of which costs a thread hop
anyway and adds a second scheduler whose cancellation semantics do not compose with Trio's cancel
scopes.  The sync client is thread-safe (a connection pool per node), supports standalone and
Cluster with the same pipeline API, and each call runs in ``trio.to_thread.run_sync`` under a
:class:`trio.CapacityLimiter` of ``threads`` tokens, so the Trio thread never blocks and the
number of concurrent Redis calls (and pooled connections) is bounded.

**Deadlines.**  Every call has two bounds: redis-py's ``socket_timeout`` /
``socket_connect_timeout`` (``timeout_s``, enforced in the thread) and a Trio-side
``trio.move_on_after(timeout_s)`` around the thread.  Threads that talk to Redis never touch
arena memory, so they run with ``abandon_on_cancel=True``: a deadline or a cancellation returns at
once and the abandoned thread finishes within its socket timeout (it keeps its limiter token
until it does, so abandoned threads still count against ``threads``).  Copies between Redis bytes
and arena buffers run in separate, short, memory-only threads with ``abandon_on_cancel=False``,
so no write into (or read from) a buffer happens after :meth:`RedisTier.load` returns or after a
buffer is released.

**Faults (D05).**  A refused connection, a timeout, a cluster error or any other failure of a
remote call is caught inside the tier, counted in ``stats.errors`` and starts a *backoff*
(:mod:`lmprefetch.tiers.remote`: ``backoff_initial_s`` doubling up to ``backoff_max_s``).
While backing off the tier answers "no more hits" at once without touching the network and
drops writes (counted in ``stats.writes_dropped``).  A lookup therefore gets the prefix found
before the failure (0 from a down server), promptly, and never an exception.

**Holes (D13).**  :meth:`RedisTier.contains_prefix` and :meth:`RedisTier.load` both stop at the
first missing or invalid value: LMCache's Redis connector dropped ``None`` results from a batch
GET, which shifted later values onto the wrong keys.  A corrupt value is deleted (best effort) so
that the next store rewrites it.

**Pins.**  Nothing is pinned remotely (Redis evicts by its own policy, see ``docs/redis.md``);
the tier keeps :class:`~lmprefetch.tiers.base.BaseTier`'s pin bookkeeping so
``pinned_count()`` shows what the engine still has to unpin.

**Write-behind.**  :meth:`RedisTier.enqueue_write` is synchronous and never blocks: it takes a
reference on the buffer and queues it, or drops the write (and counts it) when the queue is full
or the tier is backing off.  One writer task batches what is queued, copies the payloads out of
the arena (releasing each buffer reference exactly once, in a ``finally``) and pipelines the SETs
of the chunks Redis does not hold already (a pipelined ``EXISTS`` first, in the same thread: a
chunk computed again, because a load policy recomputed it or another engine stored it, is not
sent over the link again; counted in ``stats.writes_skipped``).

**Codecs.**  The tier's :class:`~lmprefetch.codec.ChunkStage` (``redis_codec``, encryption;
docs/codecs.md) runs in those copy threads: the writer's copy out of the arena is the encoding
(the value holds the encoded chunk after its header), and the load's copy into the arena is the
decoding (zstd and numpy release the GIL).  Values are read into buffers of
:meth:`~lmprefetch.codec.ChunkStage.max_read_bytes`, so chunks written under any codec stay
readable; a value the stage refuses (damaged, unknown, another tenant's or another key's,
plaintext where encryption is on) is a miss, counted in ``stats.codec_misses``, and deleted.

The ``Dnn`` codes are LMCache's defects, the rows of the defect table in
``docs/cancellation.md`` ("The defects"), each with its ``test_dNN_`` regression tests.
"""

from __future__ import annotations

import logging
import struct
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from functools import partial
from typing import Any, Final, Protocol, TypeVar

import redis
import trio
import xxhash
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.connection import SSLConnection, parse_url
from redis.exceptions import RedisClusterException
from redis.retry import Retry

from ..codec import ChunkStage, CodecMiss
from ..codec.stage import Decodes
from ..keys import ChunkKey
from ..memory import Buffer
from .remote import (
    CLOSE_TIMEOUT_S,
    CONNECT_SLACK_S,
    KEY_PREFIX,
    RemoteTier,
    Unavailable,
    load_batches,
)
from .writebehind import WriteEntry

__all__ = [
    "CLOSE_TIMEOUT_S",
    "CONNECT_SLACK_S",
    "HEADER_BYTES",
    "KEY_PREFIX",
    "RedisClient",
    "RedisTier",
    "decode_value",
    "encode_value",
    "open_redis_tier",
    "redis_key",
    "value_is_encoded",
]

log = logging.getLogger(__name__)

_T = TypeVar("_T")

_MAGIC: Final = b"LMP\x01"
#: The magic of a value the codec stage encoded (or sealed).
_MAGIC_ENCODED: Final = b"LMP\x02"
# magic, payload length, xxh3-64 of the payload; little-endian, no padding.
_HEADER: Final = struct.Struct("<4sQQ")
#: Bytes in front of the payload in every stored value.
HEADER_BYTES: Final = _HEADER.size

# Bounds on one pipelined call: keys per EXISTS pipeline, bytes per GET / SET pipeline (a
# batch also always holds at least one key).  One batch is one thread call under one deadline.
_EXISTS_BATCH_KEYS: Final = 256
_LOAD_BATCH_BYTES: Final = 32 * 1024 * 1024
_WRITE_BATCH_BYTES: Final = 16 * 1024 * 1024
_WRITE_BATCH_KEYS: Final = 64
_SOCKET_READ_BYTES: Final = 1024 * 1024


class RedisPipeline(Protocol):
    """What the tier uses of a redis-py pipeline (``transaction=False``): commands queue up,
    ``execute`` sends them at once and answers in command order."""

    def exists(self, *names: bytes) -> object: ...

    def get(self, name: bytes) -> object: ...

    def set(self, name: bytes, value: bytes) -> object: ...

    def execute(self, raise_on_error: bool = True) -> list[Any]: ...


class RedisClient(Protocol):
    """What the tier uses of redis-py's ``Redis`` and ``RedisCluster`` (both have it).  Calls
    block: worker threads only."""

    def pipeline(self, transaction: bool = ...) -> RedisPipeline: ...

    def exists(self, *names: bytes) -> int: ...

    def delete(self, *names: bytes) -> int: ...

    def ping(self) -> object: ...

    def close(self) -> None: ...


def redis_key(key: ChunkKey) -> bytes:
    """The Redis key ``key`` is stored under."""
    return (KEY_PREFIX + key.to_string()).encode()


def encode_value(payload: Any, *, encoded: bool = False) -> bytes:
    """Header plus ``payload`` (any bytes-like object): the value stored in Redis;
    ``encoded``: ``payload`` is what a codec stage made of one (docs/codecs.md)."""
    view = memoryview(payload).cast("B")
    magic = _MAGIC_ENCODED if encoded else _MAGIC
    header = _HEADER.pack(magic, view.nbytes, xxhash.xxh3_64_intdigest(view))
    return b"".join((header, view))


def decode_value(raw: bytes) -> memoryview | None:
    """The payload of a stored value, or ``None`` when ``raw`` is not a valid value (too short,
    wrong magic, wrong length, bad checksum)."""
    checked = _check_value(raw)
    return None if checked is None else checked[0]


def value_is_encoded(raw: bytes) -> bool:
    """Whether a stored value holds what a codec stage made of a payload (its magic)."""
    return raw[: len(_MAGIC_ENCODED)] == _MAGIC_ENCODED


def _check_value(raw: bytes) -> tuple[memoryview, bool] | None:
    """A valid value's payload, and whether it is encoded; ``None`` for an invalid one."""
    if len(raw) < HEADER_BYTES:
        return None
    magic, length, checksum = _HEADER.unpack_from(raw)
    if magic not in (_MAGIC, _MAGIC_ENCODED) or length != len(raw) - HEADER_BYTES:
        return None
    payload = memoryview(raw)[HEADER_BYTES:]
    if xxhash.xxh3_64_intdigest(payload) != checksum:
        return None
    return payload, magic == _MAGIC_ENCODED


# -- what runs in worker threads (never touches arena memory) ------------------------------
def _exists_prefix(client: RedisClient, names: Sequence[bytes]) -> tuple[int, BaseException | None]:
    """Pipelined EXISTS; the leading count that exist, and the error that stopped it (if any).

    A cluster pipeline routes each command to its slot's node (keys of one lookup land on
    different slots) and returns the answers in command order."""
    pipe = client.pipeline(transaction=False)
    for name in names:
        pipe.exists(name)
    results = pipe.execute(raise_on_error=False)
    n = 0
    for result in results:
        if isinstance(result, BaseException):
            return n, result
        if not result:
            break
        n += 1
    return n, None


def _get_prefix(
    client: RedisClient, names: Sequence[bytes], capacities: Sequence[int]
) -> tuple[list[tuple[memoryview, bool]], BaseException | None, bool]:
    """Pipelined GET; the verified payloads of the leading values (each with whether it is
    encoded), the error that stopped them (if any), and whether a corrupt value stopped them
    (it is then deleted, best effort).  A valid value larger than its buffer also stops them
    (a miss here; it stays in Redis for engines with larger slots)."""
    pipe = client.pipeline(transaction=False)
    for name in names:
        pipe.get(name)
    results = pipe.execute(raise_on_error=False)
    payloads: list[tuple[memoryview, bool]] = []
    for name, capacity, raw in zip(names, capacities, results, strict=True):
        if isinstance(raw, BaseException):
            return payloads, raw, False
        if raw is None:  # a hole: stop, never pair later values with earlier keys (D13)
            break
        checked = _check_value(raw)
        if checked is None:
            try:
                client.delete(name)
            except redis.RedisError:
                pass  # best effort: the value is a miss either way
            return payloads, None, True
        if checked[0].nbytes > capacity:
            break
        payloads.append(checked)
    return payloads, None, False


def _set_missing(
    client: RedisClient, items: Sequence[tuple[bytes, bytes]]
) -> tuple[list[bool], list[bool], BaseException | None, float]:
    """Send the values Redis does not hold yet: a pipelined ``EXISTS`` of every name, then a
    pipelined ``SET`` of the others.  Which are in Redis now, which of those it held already
    (not sent), the first error, and the seconds the ``SET`` took (``0.0`` when nothing was
    sent)."""
    pipe = client.pipeline(transaction=False)
    for name, _ in items:
        pipe.exists(name)
    try:
        answers = pipe.execute(raise_on_error=False)
    except (redis.RedisError, RedisClusterException):
        # Not answered: every value is sent (a failing server fails the SET too, reported).
        answers = [0] * len(items)
    held = [isinstance(r, int) and r > 0 for r in answers]
    ok = list(held)
    error: BaseException | None = None
    send = [i for i, h in enumerate(held) if not h]
    if not send:
        return ok, held, None, 0.0
    t0 = time.perf_counter()
    pipe = client.pipeline(transaction=False)
    for i in send:
        pipe.set(*items[i])
    results = pipe.execute(raise_on_error=False)
    seconds = time.perf_counter() - t0
    for i, result in zip(send, results, strict=True):
        if isinstance(result, BaseException):
            error = error or result
        else:
            ok[i] = True
    return ok, held, error, seconds


def _copy_into(
    payloads: Sequence[tuple[memoryview, bool]],
    buffers: Sequence[Buffer],
    stage: ChunkStage,
    key_names: Sequence[bytes],
    tenant: bytes,
) -> Decodes:
    """Decode each stored value (with whether it is encoded) into its buffer, in order, until
    one is refused or is a payload larger than its buffer (the thread that writes arena
    memory); what it did."""
    done = Decodes(stage)
    for (payload, encoded), buf, name in zip(payloads, buffers, key_names, strict=False):
        with buf.slot() as slot:
            if stage.is_raw(payload, encoded) and payload.nbytes > slot.nbytes:
                break  # a payload larger than this engine's slots: a miss, left in Redis
            if not done.into(payload, slot, key_name=name, tenant=tenant, encoded=encoded):
                break
        buf.length = done.lengths[-1]
    return done


def _encode_all(
    stage: ChunkStage, items: Sequence[tuple[bytes, bytes, Buffer, bytes]]
) -> tuple[list[tuple[bytes, bytes]], list[int], float]:
    """The values to SET for ``(redis key, chunk key name, buffer, tenant)`` items (the thread
    that reads arena memory), the stored bytes of each, and the seconds encoding took."""
    t0 = time.perf_counter()
    values: list[tuple[bytes, bytes]] = []
    sizes: list[int] = []
    encoded = stage.encodes()
    for name, key_name, buf, tenant in items:
        with buf.view() as payload:
            stored = stage.encode(payload, key_name=key_name, tenant=tenant)
            sizes.append(memoryview(stored).nbytes)
            values.append((name, encode_value(stored, encoded=encoded)))
    seconds = 0.0 if stage.passthrough else time.perf_counter() - t0
    return values, sizes, seconds


def _parse_endpoints(url: str) -> list[dict[str, Any]]:
    urls = [part.strip() for part in url.split(",")]
    if not url.strip() or any(not part for part in urls):
        raise ValueError(f"redis url: expected redis://host:port[,redis://...], got {url!r}")
    out = []
    for part in urls:
        if not part.startswith(("redis://", "rediss://")):
            raise ValueError(f"redis url: entries must start with redis:// or rediss://: {part!r}")
        out.append(parse_url(part))
    return out


class RedisTier(RemoteTier):
    """Chunks in Redis (one URL) or Redis Cluster (several URLs, the cluster's startup nodes).

    Open it with :func:`open_redis_tier`, which also runs the write-behind task.  Constructing a
    tier does no I/O; the client is built in a worker thread by :meth:`connect` (or by the first
    call), and a server that is down then only starts a backoff.

    Args:
        url: ``redis://host:port`` (standalone), or a comma-separated list of such URLs
            (cluster startup nodes; credentials and TLS are taken from the first one).
        timeout_s: deadline of one remote call (socket and Trio side).
        threads: concurrent remote calls (worker threads, and connections per node).
        write_queue: writes waiting for the writer; past it writes are dropped and counted.
        backoff_initial_s: first backoff after a failure; doubles on every further failure.
        backoff_max_s: ceiling of the backoff.
        stage: the codec stage (``redis_codec``, encryption); ``None``: payloads as they are.

    Raises:
        ValueError: ``url`` is not a Redis URL or list of them.
    """

    name = "redis"
    write_batch_keys = _WRITE_BATCH_KEYS
    write_batch_bytes = _WRITE_BATCH_BYTES

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 1.0,
        threads: int = 4,
        write_queue: int = 1024,
        backoff_initial_s: float = 0.5,
        backoff_max_s: float = 30.0,
        stage: ChunkStage | None = None,
    ) -> None:
        super().__init__(
            timeout_s=timeout_s,
            threads=threads,
            write_queue=write_queue,
            backoff_initial_s=backoff_initial_s,
            backoff_max_s=backoff_max_s,
            stage=stage,
        )
        self._endpoints = _parse_endpoints(url)
        self.cluster = len(self._endpoints) > 1
        self._client: RedisClient | None = None  # built in a worker thread, under self._lock

    # -- remote calls ------------------------------------------------------------------
    def _make_client(self) -> RedisClient:
        common: dict[str, Any] = {
            "socket_timeout": self._timeout_s,
            "socket_connect_timeout": self._timeout_s,
            "retry": Retry(NoBackoff(), 0),  # our deadline and backoff replace redis-py's retries
            # redis-py's pure-Python parser reads replies in recv()s of this size: the default
            # 64 KiB costs ~40 % of GET throughput on MiB-sized values.
            "socket_read_size": _SOCKET_READ_BYTES,
        }
        client: RedisClient
        if not self.cluster:
            client = redis.Redis(**{**self._endpoints[0], **common})
            return client
        options = {k: v for k, v in self._endpoints[0].items() if k not in ("host", "port", "db")}
        if options.pop("connection_class", None) is SSLConnection:
            options["ssl"] = True
        nodes = [
            ClusterNode(e.get("host") or "localhost", e.get("port") or 6379)
            for e in self._endpoints
        ]
        client = RedisCluster(startup_nodes=nodes, **options, **common)
        return client

    def _with_client(self, op: Callable[[RedisClient], _T]) -> _T:
        """Worker-thread side of :meth:`_remote`: build the client if needed, run ``op``."""
        client = self._client
        if client is None:
            with self._lock:  # one build at a time (a cluster build connects)
                if self._closed:
                    raise RuntimeError("redis tier is closed")
                if self._client is None:
                    self._client = self._make_client()
                client = self._client
        return op(client)

    async def _remote(
        self, what: str, op: Callable[[RedisClient], _T], *, deadline_s: float | None = None
    ) -> _T:
        """Run ``op(client)`` in a worker thread under the per-call deadline (or ``deadline_s``)
        and end the back-off once it succeeds (see :meth:`RemoteTier._call_abandoning
        <lmprefetch.tiers.remote.RemoteTier._call_abandoning>`: the thread touches no arena
        memory and is abandoned on cancellation or at the deadline, finishing within its
        socket timeout).

        Raises:
            Unavailable: the tier is closed or backing off (without I/O), or the call failed
                or missed its deadline (counted, backing off).
        """
        result = await self._call_abandoning(
            what, partial(self._with_client, op), deadline_s=deadline_s
        )
        self._succeeded()
        return result

    async def connect(self) -> bool:
        """Build the client and PING the server(s); ``False`` (and a backoff) when unreachable.

        Never raises for a down server: the engine starts without its remote tier and the tier
        retries after the backoff.  Building a cluster client reads the cluster's slot map and
        its command table (``COMMAND``, a large reply that redis-py parses in Python), so this
        one call gets a longer deadline: ``timeout_s`` per startup node plus
        ``CONNECT_SLACK_S``.  A refused connection still fails at once, and a black-holed one
        within the socket timeouts.  (A client first built by a later call instead, after a
        failed start, is built under that call's deadline; a build that outlives it finishes in
        its abandoned thread and serves the calls after the backoff.)"""
        deadline_s = self._timeout_s * len(self._endpoints) + CONNECT_SLACK_S
        try:
            await self._remote("connect", lambda client: client.ping(), deadline_s=deadline_s)
        except Unavailable:
            return False
        return True

    # -- probe and load ----------------------------------------------------------------
    async def contains(self, key: ChunkKey) -> bool:
        """Whether ``key`` is in Redis (``False`` while backing off or on failure)."""
        name = redis_key(key)
        try:
            found = bool(await self._remote("EXISTS", lambda client: client.exists(name)))
        except Unavailable:
            return False
        if not found:
            self._note_removed(key)  # evicted by Redis, or deleted by another engine
        return found

    async def contains_prefix(self, keys: Sequence[ChunkKey], *, pin: bool) -> int:
        """How many leading ``keys`` are in Redis (pipelined EXISTS, in batches, stopping at the
        first hole); 0 at once while backing off.  Pins (bookkeeping only) are taken after the
        last checkpoint.  On cancellation raises ``Cancelled`` and pins nothing."""
        self.stats.probes += 1
        names = [redis_key(key) for key in keys]
        n = 0
        try:
            for start in range(0, len(names), _EXISTS_BATCH_KEYS):
                batch = names[start : start + _EXISTS_BATCH_KEYS]
                hit, error = await self._remote("EXISTS", partial(_exists_prefix, names=batch))
                n += hit
                if error is not None:
                    self._failed("EXISTS", error)
                    break
                if hit < len(batch):
                    # Redis said this key is not there: evicted by its own policy, or deleted
                    # by another engine (Redis tells nobody; a probe is how we learn it).
                    self._note_removed(keys[n])
                    break
        except Unavailable:
            pass  # the prefix ends here; counted and backing off
        if not names:
            await trio.lowlevel.checkpoint()
        # no checkpoint below: the pins are taken synchronously with the answer
        if pin and n:
            self.pin(keys[:n])
        if n:
            self.stats.hits += 1
        return n

    async def load(
        self, keys: Sequence[ChunkKey], buffers: Sequence[Buffer], *, tenant: bytes = b""
    ) -> int:
        """Fill ``buffers[i]`` with ``keys[i]``'s payload; the contiguous count filled.

        Pipelined GETs in batches of at most 32 MiB of buffer capacity; every value is checked
        (magic, length, checksum) and decoded by the codec stage (sealed chunks opened for
        ``tenant``).  Stops at the first missing, corrupt, undecodable or failed value (D13)
        and returns the count before it; a down or slow server ends the prefix there (counted,
        backing off), it never raises.

        On cancellation raises ``Cancelled``; a fetch in flight is abandoned (its bytes are
        dropped), a copy into buffers in flight finishes first, so nothing writes into a buffer
        after this returns or raises.
        """
        total = min(len(keys), len(buffers))
        n = 0
        loaded_bytes = 0
        stage = self.stage
        for start, end in load_batches(buffers[:total], max_bytes=_LOAD_BATCH_BYTES):
            names = [redis_key(key) for key in keys[start:end]]
            capacities = [stage.max_read_bytes(buf.capacity) for buf in buffers[start:end]]
            try:
                payloads, error, corrupt = await self._remote(
                    "GET", partial(_get_prefix, names=names, capacities=capacities)
                )
            except Unavailable:
                break
            filled = 0
            refused: CodecMiss | None = None
            if payloads:
                got = keys[start : start + len(payloads)]
                key_names = [key.to_string().encode() for key in got]
                done = await trio.to_thread.run_sync(
                    _copy_into, payloads, buffers[start:end], stage, key_names, tenant,
                    abandon_on_cancel=False,
                )  # fmt: skip
                self.stats.observe_decoded(
                    done.payload_bytes, done.stored_bytes, done.seconds, decoded=done.decoded
                )
                filled = len(done.lengths)
                loaded_bytes += done.payload_bytes
                refused = done.miss
            n += filled
            complete = filled == len(payloads)
            del payloads
            if refused is not None:
                await self._refused(keys[n], names[n - start], refused)
                break
            if not complete:  # a value larger than this engine's buffers: left in Redis
                break
            if error is not None:
                self._failed("GET", error)
                break
            if corrupt:
                self.stats.errors += 1
                log.warning("redis tier: corrupt value under %s; dropped", names[n - start])
                self._note_removed(keys[n])
                break
            if n < end:
                break
        if total == 0:
            await trio.lowlevel.checkpoint()
        self.stats.chunks_loaded += n
        self.stats.bytes_loaded += loaded_bytes
        return n

    async def _refused(self, key: ChunkKey, name: bytes, why: CodecMiss) -> None:
        """The codec stage refused the value under ``key``: count it, and delete it (best
        effort) so that the next store writes a good one."""
        self.stats.codec_misses += 1
        log.warning("redis tier: value under %s refused (%s); dropped", name.decode(), why)
        try:
            await self._remote("DEL", lambda client: client.delete(name))
        except Unavailable:
            pass  # a miss either way
        self._note_removed(key)

    async def remove(self, key: ChunkKey) -> bool:
        """Delete ``key`` from Redis; ``False`` if it was not there or Redis is unavailable."""
        name = redis_key(key)
        try:
            deleted = bool(await self._remote("DEL", lambda client: client.delete(name)))
        except Unavailable:
            return False
        self._note_removed(key)  # gone now, whoever deleted it
        return deleted

    # -- write-behind: batch what is queued, copy it out of the arena (releasing each buffer
    # reference, exactly once), pipeline the SETs ----------------------------------------
    async def _write_batch(self, batch: list[WriteEntry]) -> None:
        live = [e for e in batch if not e.removed and e.buffer is not None]
        for entry in batch:
            entry.written = True  # accounted below, or counted dropped by the loop if cancelled
        # Copy out of the arena (encoding) in a thread that is never abandoned, then let go of
        # the buffers at once: the network part below may be abandoned and never sees arena
        # memory.
        taken = [(e.key, e.tenant, e.take_buffer()) for e in live]
        keys = [key for key, _, buf in taken if buf is not None]
        owned = [
            (redis_key(key), key.to_string().encode(), buf, tenant)
            for key, tenant, buf in taken
            if buf is not None
        ]
        payload_bytes = [buf.length for _, _, buf, _ in owned]
        try:
            if not self._usable():
                await trio.lowlevel.checkpoint()
                self.stats.writes_dropped += len(owned)
                return
            items, sizes, seconds = await trio.to_thread.run_sync(
                _encode_all, self.stage, owned, abandon_on_cancel=False
            )
        except BaseException:
            self.stats.writes_dropped += len(owned)
            raise
        finally:
            for _, _, buf, _ in owned:
                buf.release()
        self.stats.encode_seconds += seconds
        try:
            ok, held, error, set_s = await self._remote("SET", partial(_set_missing, items=items))
        except Unavailable:
            self.stats.writes_dropped += len(items)
            return
        except BaseException:
            self.stats.writes_dropped += len(items)
            raise
        moved = 0
        for key, done, was_held, n_payload, n_stored in zip(keys, ok, held, payload_bytes, sizes):
            if was_held:
                self.stats.writes_skipped += 1
                self._note_stored(key)
            elif done:
                moved += n_payload
                self.stats.chunks_stored += 1
                self.stats.bytes_stored += n_payload
                self.stats.encoded_bytes_stored += n_stored
                self._note_stored(key)
        if error is None and moved:  # the link's throughput, before any load measures it
            self.stats.observe_store(moved, set_s)
        if error is not None:
            self.stats.writes_dropped += len(items) - sum(ok)
            self._failed("SET", error)

    # -- shutdown ----------------------------------------------------------------------
    async def _close_client(self, *, threads_ended: bool) -> None:
        with self._lock:  # a thread abandoned mid-build may still hold it
            client, self._client = self._client, None
        if client is not None:
            await trio.to_thread.run_sync(client.close)


@asynccontextmanager
async def open_redis_tier(
    url: str,
    *,
    timeout_s: float,
    threads: int,
    write_queue: int,
    backoff_initial_s: float = 0.5,
    backoff_max_s: float = 30.0,
    stage: ChunkStage | None = None,
) -> AsyncIterator[RedisTier]:
    """Open the remote tier on ``url`` and run its writer until the block exits.

    The client is built (and the server PINGed) in a worker thread; a server that is down does
    not fail the caller: the tier starts backing off and answers misses until it can reach
    Redis.  On exit, queued writes are flushed (shielded, at most ``CLOSE_TIMEOUT_S``), anything
    still queued is released, and the client is closed.

    Raises:
        ValueError: ``url`` is not a Redis URL or list of them.
    """
    tier = RedisTier(
        url,
        timeout_s=timeout_s,
        threads=threads,
        write_queue=write_queue,
        backoff_initial_s=backoff_initial_s,
        backoff_max_s=backoff_max_s,
        stage=stage,
    )
    async with tier.running(tier.connect):
        yield tier
