"""`PrefetchConfig`: every knob of lmprefetch, validated, flat, with defaults.

A config is a frozen msgspec ``Struct``.  Build it directly (``PrefetchConfig(chunk_size=128)``),
from a mapping (:meth:`PrefetchConfig.from_dict`), from a TOML file
(:meth:`PrefetchConfig.from_file`) or from ``LMPREFETCH_*`` environment variables
(:meth:`PrefetchConfig.from_env`).  Every path validates every field and raises
:class:`ValueError` whose message starts with the field's name, so a bad deployment
fails at start-up with a sentence a person can act on.

Sizes are in bytes (``*_bytes``), durations in seconds (``*_s``).

Nothing here does I/O except :meth:`PrefetchConfig.from_file` (one read at start-up).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

__all__ = ["HASH_ALGORITHMS", "KV_DTYPES", "ConfigFileError", "PrefetchConfig"]

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

#: Hash functions :class:`~lmprefetch.hashing.ChunkHasher` knows.
HASH_ALGORITHMS = ("blake2b", "sha256")
#: KV dtypes a key may name (the name only travels in keys; payloads are opaque bytes).
KV_DTYPES = (
    "bfloat16",
    "float16",
    "float32",
    "float8_e4m3fn",
    "float8_e5m2",
    "int8",
    "uint8",
)
_BUFFER_BACKENDS = ("bytes", "torch")


class ConfigFileError(OSError, ValueError):
    """A config file that does not exist, is a directory or cannot be read.

    An ``OSError`` (with ``errno``) for what it is, and a ``ValueError`` like every other bad
    configuration, so one ``except ValueError`` handles every start-up mistake.  Its message
    names the file and the problem.
    """

    def __str__(self) -> str:
        return str(self.strerror)


class PrefetchConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """All settings of an lmprefetch engine and of the scheduler-side client.

    Each field has a default, so ``PrefetchConfig()`` is a working CPU-only setup.
    """

    # -- chunking and keys ------------------------------------------------------------
    #: Tokens per chunk; one key (one per layer in layerwise mode) per chunk.
    chunk_size: int = 256
    #: Also store and look up a trailing chunk shorter than ``chunk_size``
    #: (LMCache's ``save_unfull_chunk``).
    save_partial_chunks: bool = False
    #: ``blake2b`` (default) or ``sha256``; deterministic across processes.
    hash_algorithm: str = "blake2b"
    #: Names the model in every key, so engines serving different models never share
    #: chunks; must not contain ``@``.  The vLLM connector sets it to the model path.
    model_name: str = "model"
    #: Names the KV dtype in every key (payloads are opaque bytes; the name only keeps
    #: dtypes apart).  The vLLM connector sets it from the KV cache tensors.
    kv_dtype: str = "bfloat16"
    #: Layerwise mode: every chunk has ``num_layers`` keys, one per layer.
    layerwise: bool = False
    #: Layers per chunk in layerwise mode (ignored otherwise); ``chunk_bytes`` must be a
    #: multiple of it.
    num_layers: int = 1

    # -- time -------------------------------------------------------------------------
    #: The scheduler gives up on a lookup after this long, answers 0 and cancels it.
    lookup_timeout_s: float = 3.0
    #: A prefetched result nobody claims is released after this long.
    claim_ttl_s: float = 30.0
    #: Bound on one tier operation (probe or load) inside a lookup; a tier slower than
    #: this ends the lookup's prefix at that tier.
    tier_timeout_s: float = 2.0

    # -- memory -----------------------------------------------------------------------
    #: Size of the host-memory arena (the CPU tier and all prefetch buffers).
    cpu_bytes: int = 1 * GiB
    #: Size of one chunk's payload (all layers); the arena's slot size in
    #: non-layerwise mode.
    chunk_bytes: int = 2 * MiB
    #: ``bytes`` (plain anonymous memory) or ``torch`` (a uint8 tensor, pinned when
    #: CUDA is available; needs the ``torch`` extra).
    buffer_backend: str = "bytes"
    #: Bytes of the arena (from its first slot: the slots handed out first) mapped into
    #: memory when the engine opens, so the first loads into them do not page-fault (a fresh
    #: slot's first load is several times slower otherwise).  Costs start-up time, about
    #: 0.3–1 s per GiB on a small VM, and makes that much memory resident at once; 0 maps
    #: every slot lazily on first use.  Capped at ``cpu_bytes``.
    arena_prefault_bytes: int = 1 * GiB

    # -- disk tier --------------------------------------------------------------------
    #: Directory of the disk tier; ``None`` disables it.
    disk_path: str | None = None
    #: Disk tier capacity; least recently used unpinned files are evicted past it.
    disk_bytes: int = 16 * GiB
    #: Read chunk files with ``O_DIRECT`` when sizes and alignment allow it.
    disk_o_direct: bool = False
    #: Worker threads reading chunk files at once.
    disk_read_threads: int = 4
    #: Chunks waiting for their write-behind to disk; past this, stores are dropped
    #: from the disk tier (and counted), never blocking the caller.
    disk_write_queue: int = 1024

    # -- remote tier ------------------------------------------------------------------
    #: ``redis://host:port`` for a standalone server, or a comma-separated list of
    #: such URLs for a Redis Cluster; ``None`` disables the remote tier.
    redis_url: str | None = None
    #: Deadline of one Redis call.
    redis_timeout_s: float = 1.0
    #: Chunks waiting for their write-behind to Redis (full queue: drop and count).
    redis_write_queue: int = 1024
    #: Concurrent Redis calls (threads) per worker.
    redis_threads: int = 4
    #: After a failed Redis call the tier answers "miss" without touching the network for
    #: this long, doubling up to ``redis_backoff_max_s`` while failures go on.
    redis_backoff_initial_s: float = 0.5
    #: The longest backoff after repeated Redis failures.
    redis_backoff_max_s: float = 30.0

    # -- Mooncake tier ----------------------------------------------------------------
    #: ``host:port`` of a running ``mooncake_master`` (its RPC port); ``None`` disables the
    #: Mooncake tier.  Probed after the disk and Redis tiers; shared by every engine that
    #: points at the same master.  Needs the ``mooncake`` extra.
    mooncake_master: str | None = None
    #: Where Mooncake clients find each other's memory: ``P2PHANDSHAKE`` (no server: peers
    #: exchange it directly), ``http://host:port/metadata`` (the master's
    #: ``--enable_http_metadata_server``), or an etcd or Redis address.
    mooncake_metadata_server: str = "P2PHANDSHAKE"
    #: Mooncake's transfer protocol: ``tcp`` or ``rdma``.
    mooncake_protocol: str = "tcp"
    #: The address other Mooncake clients reach this worker at: its address on the network
    #: the workers share (``127.0.0.1`` serves one machine only).
    mooncake_local_hostname: str = "127.0.0.1"
    #: Memory this worker gives Mooncake's pool (0, or at least 16 MiB): chunks (its own and
    #: other workers') live in it and go when the worker stops.  0 for the standalone-store
    #: deployment, where a ``mooncake_client`` process holds the pool.
    mooncake_segment_bytes: int = 1 * GiB
    #: Deadline of one Mooncake call; it also sets Mooncake's own RPC and transfer timeouts
    #: (at most 10 s: Mooncake waits on a transfer batch for a fixed 60 s at most).
    mooncake_timeout_s: float = 1.0

    # -- transport --------------------------------------------------------------------
    #: ZeroMQ high-water mark (messages) on every lookup socket.
    socket_hwm: int = 10_000
    #: Largest lookup message a worker or client accepts; a peer that sends a larger frame
    #: is disconnected.  A request costs about 12 bytes per chunk, so the default holds a
    #: prompt of over 300 million tokens at the default chunk size.
    max_message_bytes: int = 16 * MiB

    # -- KV events ----------------------------------------------------------------------
    #: Emit KV events (``BlockStored`` / ``BlockRemoved``) for what the tiers hold, where a
    #: consumer asks for them (vLLM's ``--kv-events-config``, ``lmprefetch worker
    #: --events-endpoint``); ``False`` turns them off everywhere.
    kv_events: bool = True
    #: Events waiting for their consumer; past this, new events are dropped (and counted).
    kv_events_max_pending: int = 100_000

    def __post_init__(self) -> None:
        _validate(self)

    # -- loading ----------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PrefetchConfig:
        """Build a config from a mapping of field names to values.

        Strings are accepted for numbers and booleans (``"256"``, ``"true"``), so values
        from environment variables or command lines work.

        Raises:
            ValueError: a field is unknown, has the wrong type or an invalid value; the
                message names the field.
        """
        if not isinstance(data, Mapping):
            raise ValueError(
                f"config: expected a mapping of field names, got {type(data).__name__}"
            )
        known = set(cls.__struct_fields__)
        for name, value in data.items():
            if name not in known:
                raise ValueError(
                    f"{_shown(name)}: unknown PrefetchConfig field (known: {sorted(known)})"
                )
            if isinstance(value, str) and name != "disk_path" and not _is_utf8(value):
                # Lone surrogates: an environment variable that is not UTF-8.  msgspec would
                # fail on them with an error that names no field.
                raise ValueError(f"{name}: must be valid UTF-8 text, got {value!r}")
        try:
            return msgspec.convert(dict(data), cls, strict=False)
        except msgspec.ValidationError as exc:
            raise ValueError(_field_message(str(exc))) from None

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> PrefetchConfig:
        """Load a TOML file: top-level fields, or a ``[lmprefetch]`` table.

        Raises:
            ValueError: the file is not valid TOML or holds an invalid field (the message names
                the file or the field), or it cannot be read: then it is a
                :class:`ConfigFileError`, both an ``OSError`` and a ``ValueError``.
        """
        try:
            raw = Path(path).read_bytes()
        except OSError as exc:
            if isinstance(exc, FileNotFoundError):
                what = "config file not found"
            elif isinstance(exc, IsADirectoryError):
                what = "is a directory, not a config file"
            else:
                what = f"cannot read the config file ({exc.strerror})"
            raise ConfigFileError(exc.errno or 0, f"{_shown(str(path))}: {what}") from None
        except ValueError as exc:  # a NUL, or a surrogate the file system cannot encode
            raise ValueError(f"{_shown(str(path))}: not a usable file name ({exc})") from None
        try:
            doc = tomllib.loads(raw.decode("utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{_shown(str(path))}: not a valid TOML file: {exc}") from None
        except RecursionError:  # tomllib is recursive: arrays or tables nested ~500 deep
            raise ValueError(
                f"{_shown(str(path))}: not a valid TOML file: values nested too deeply"
            ) from None
        table = doc.get("lmprefetch", doc)
        if not isinstance(table, dict):
            raise ValueError(f"{_shown(str(path))}: [lmprefetch] must be a table")
        return cls.from_dict(table)

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, *, prefix: str = "LMPREFETCH_"
    ) -> PrefetchConfig:
        """Build a config from ``LMPREFETCH_<FIELD>`` variables (e.g. ``LMPREFETCH_CHUNK_SIZE``).

        ``LMPREFETCH_CONFIG`` names a TOML file read first; single variables override it.
        An empty value for an optional field (``disk_path``, ``redis_url``,
        ``mooncake_master``) means ``None``.

        Raises:
            ValueError: a variable with the prefix names no field (a typo must not be
                ignored silently), or a value is invalid; the message names it.
        """
        env = os.environ if environ is None else environ
        known = {prefix + name.upper() for name in cls.__struct_fields__} | {prefix + "CONFIG"}
        for var in sorted(env):
            if var.startswith(prefix) and var not in known:
                raise ValueError(
                    f"{_shown(var)}: unknown variable: no PrefetchConfig field is called "
                    f"{var[len(prefix):].lower()!r} (known: {prefix}CONFIG and "
                    f"{prefix}<FIELD> for the fields {sorted(cls.__struct_fields__)})"
                )
        base: dict[str, Any] = {}
        config_file = env.get(prefix + "CONFIG")
        if config_file:
            base = msgspec.structs.asdict(cls.from_file(config_file))
        for name in cls.__struct_fields__:
            value = env.get(prefix + name.upper())
            if value is None:
                continue
            base[name] = None if (value == "" and name in _OPTIONAL_FIELDS) else value
        return cls.from_dict(base)

    # -- derived ----------------------------------------------------------------------
    @property
    def keys_per_chunk(self) -> int:
        """Keys per chunk: ``num_layers`` in layerwise mode, else 1."""
        return self.num_layers if self.layerwise else 1

    @property
    def slot_bytes(self) -> int:
        """Size of one arena slot: one key's payload."""
        return self.chunk_bytes // self.keys_per_chunk

    @property
    def arena_slots(self) -> int:
        """Number of slots in the arena."""
        return self.cpu_bytes // self.slot_bytes

    def replace(self, **changes: Any) -> PrefetchConfig:
        """A copy with some fields changed (validated)."""
        return msgspec.structs.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return msgspec.structs.asdict(self)


_OPTIONAL_FIELDS = frozenset({"disk_path", "redis_url", "mooncake_master"})


def _shown(name: object) -> str:
    """A name as an error message starts with it: as is if it is printable text, else its
    ``repr`` (so that a message is always one line)."""
    return name if isinstance(name, str) and name.isprintable() and name else repr(name)


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _field_message(text: str) -> str:
    # msgspec says "Expected `int`, got `str` - at `$.chunk_size`"; put the field first.
    if " - at `$." in text:
        msg, _, where = text.rpartition(" - at `$.")
        return f"{where.rstrip('`')}: {msg}"
    field = text.partition(":")[0]
    return text if field in PrefetchConfig.__struct_fields__ else f"config: {text}"


def _check_type(
    name: str, value: object, types: tuple[type, ...], *, allow_none: bool = False
) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) and bool not in types:
        raise ValueError(f"{name}: expected {types[0].__name__}, got bool")
    if not isinstance(value, types):
        raise ValueError(
            f"{name}: expected {types[0].__name__}, got {type(value).__name__} {value!r}"
        )


#: Upper bounds of the integer fields: far beyond any real deployment, low enough that a typo
#: (an extra digit or ten) is an error naming the field instead of a failed allocation.
_INT_MAX = {
    "chunk_size": 1 << 20,
    "num_layers": 4096,
    "cpu_bytes": 1 << 48,  # 256 TiB
    "arena_prefault_bytes": 1 << 48,
    "chunk_bytes": 1 << 32,  # 4 GiB
    "disk_bytes": 1 << 56,  # 64 PiB
    "disk_read_threads": 1024,
    "disk_write_queue": 1 << 24,
    "redis_write_queue": 1 << 24,
    "redis_threads": 1024,
    "socket_hwm": (1 << 31) - 1,  # a C int in libzmq
    "max_message_bytes": 1 << 30,
    "kv_events_max_pending": 1 << 24,
}
#: The longest duration any ``*_s`` field may have (a year): past it a typo is more likely
#: than intent, and deadlines stay well inside every clock's range.
_SECONDS_MAX = 365 * 24 * 3600.0


def _validate(c: PrefetchConfig) -> None:
    ints = (
        "chunk_size",
        "num_layers",
        "cpu_bytes",
        "arena_prefault_bytes",
        "chunk_bytes",
        "disk_bytes",
        "disk_read_threads",
        "disk_write_queue",
        "redis_write_queue",
        "redis_threads",
        "socket_hwm",
        "max_message_bytes",
        "kv_events_max_pending",
    )
    for name in ints:
        _check_type(name, getattr(c, name), (int,))
        value = getattr(c, name)
        if value > _INT_MAX[name]:
            raise ValueError(f"{name}: must be at most {_INT_MAX[name]}, got {value}")
    for name in (
        "lookup_timeout_s",
        "claim_ttl_s",
        "tier_timeout_s",
        "redis_timeout_s",
        "redis_backoff_initial_s",
        "redis_backoff_max_s",
    ):
        _check_type(name, getattr(c, name), (float, int))
        value = getattr(c, name)
        if not 0 < value <= _SECONDS_MAX:  # also rejects NaN and infinity
            raise ValueError(
                f"{name}: must be a positive number of seconds, at most {_SECONDS_MAX:.0f}, "
                f"got {value!r}"
            )
    for name in ("save_partial_chunks", "layerwise", "disk_o_direct", "kv_events"):
        _check_type(name, getattr(c, name), (bool,))
    for name in ("hash_algorithm", "model_name", "kv_dtype", "buffer_backend"):
        _check_type(name, getattr(c, name), (str,))
    _check_type("disk_path", c.disk_path, (str,), allow_none=True)
    _check_type("redis_url", c.redis_url, (str,), allow_none=True)
    # Keys (model_name) and URLs are written as UTF-8; a path may be any bytes but NUL.
    for name in ("model_name", "redis_url"):
        value = getattr(c, name)
        if value is not None and not _is_utf8(value):
            raise ValueError(f"{name}: must be valid UTF-8 text, got {value!r}")
    if c.disk_path is not None and "\x00" in c.disk_path:
        raise ValueError(f"disk_path: must not contain a NUL character, got {c.disk_path!r}")

    if c.chunk_size < 1:
        raise ValueError(f"chunk_size: must be at least 1 token, got {c.chunk_size}")
    if c.hash_algorithm not in HASH_ALGORITHMS:
        raise ValueError(
            f"hash_algorithm: must be one of {HASH_ALGORITHMS}, got {c.hash_algorithm!r}"
        )
    if not c.model_name or "@" in c.model_name:
        raise ValueError(f"model_name: must be non-empty and contain no '@', got {c.model_name!r}")
    if c.kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype: must be one of {KV_DTYPES}, got {c.kv_dtype!r}")
    if c.num_layers < 1:
        raise ValueError(f"num_layers: must be at least 1, got {c.num_layers}")
    if c.chunk_bytes < 1:
        raise ValueError(f"chunk_bytes: must be at least 1 byte, got {c.chunk_bytes}")
    if c.layerwise and c.chunk_bytes % c.num_layers:
        raise ValueError(
            f"chunk_bytes: in layerwise mode must be a multiple of num_layers "
            f"({c.num_layers}), got {c.chunk_bytes}"
        )
    if c.cpu_bytes < 2 * c.chunk_bytes:
        raise ValueError(
            f"cpu_bytes: must hold at least two chunks of chunk_bytes ({c.chunk_bytes}), "
            f"got {c.cpu_bytes}"
        )
    if c.arena_prefault_bytes < 0:
        raise ValueError(
            f"arena_prefault_bytes: must be 0 (no pre-faulting) or more, got "
            f"{c.arena_prefault_bytes}"
        )
    if c.buffer_backend not in _BUFFER_BACKENDS:
        raise ValueError(
            f"buffer_backend: must be one of {_BUFFER_BACKENDS}, got {c.buffer_backend!r}"
        )
    if c.disk_path is not None and not c.disk_path:
        raise ValueError("disk_path: must be a directory path or None, got an empty string")
    if c.disk_bytes < c.chunk_bytes:
        raise ValueError(
            f"disk_bytes: must hold at least one chunk ({c.chunk_bytes}), got {c.disk_bytes}"
        )
    for name in (
        "disk_read_threads",
        "disk_write_queue",
        "redis_write_queue",
        "redis_threads",
        "socket_hwm",
        "kv_events_max_pending",
    ):
        if getattr(c, name) < 1:
            raise ValueError(f"{name}: must be at least 1, got {getattr(c, name)}")
    if c.max_message_bytes < 1024:
        raise ValueError(f"max_message_bytes: must be at least 1024, got {c.max_message_bytes}")
    if c.redis_backoff_max_s < c.redis_backoff_initial_s:
        raise ValueError(
            f"redis_backoff_max_s: must be at least redis_backoff_initial_s "
            f"({c.redis_backoff_initial_s}), got {c.redis_backoff_max_s}"
        )
    if c.redis_url is not None:
        urls = [u.strip() for u in c.redis_url.split(",")]
        for url in urls:
            if not (url.startswith("redis://") or url.startswith("rediss://")):
                raise ValueError(
                    f"redis_url: each entry must start with redis:// or rediss://, got {url!r}"
                )
    _validate_mooncake(c)


#: ``mooncake_protocol`` values (the transports of Mooncake's non-CUDA build).
MOONCAKE_PROTOCOLS = ("tcp", "rdma")
#: The smallest segment Mooncake accepts (a smaller one fails the client's setup).
MOONCAKE_SEGMENT_MIN = 16 * MiB
_MOONCAKE_SEGMENT_MAX = 1 << 48  # 256 TiB
_MOONCAKE_TIMEOUT_MAX_S = 10.0


def parse_host_port(address: str) -> tuple[str, int]:
    """``"host:port"`` (``"[v6]:port"`` for IPv6) as ``(host, port)``.

    Raises:
        ValueError: not a host and a port in 1..65535.
    """
    host, sep, port = address.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if (
        not sep
        or not host
        or not (port.isascii() and port.isdigit())
        or not 0 < int(port) < 65536
        or any(ch.isspace() or ch in "/[]" for ch in host)
        or not host.isprintable()
    ):
        raise ValueError(f"expected host:port (mooncake_master's RPC service), got {address!r}")
    return host, int(port)


def _validate_mooncake(c: PrefetchConfig) -> None:
    """The ``mooncake_*`` fields (one block, so that it moves as one)."""
    _check_type("mooncake_master", c.mooncake_master, (str,), allow_none=True)
    for name in ("mooncake_metadata_server", "mooncake_protocol", "mooncake_local_hostname"):
        _check_type(name, getattr(c, name), (str,))
    _check_type("mooncake_segment_bytes", c.mooncake_segment_bytes, (int,))
    _check_type("mooncake_timeout_s", c.mooncake_timeout_s, (float, int))
    for name in (
        "mooncake_master",
        "mooncake_metadata_server",
        "mooncake_protocol",
        "mooncake_local_hostname",
    ):
        value = getattr(c, name)
        if value is None:
            continue
        if not _is_utf8(value):
            raise ValueError(f"{name}: must be valid UTF-8 text, got {value!r}")
        if not value or any(ch.isspace() for ch in value) or not value.isprintable():
            raise ValueError(f"{name}: must be non-empty, without spaces, got {value!r}")
    if c.mooncake_master is not None:
        try:
            parse_host_port(c.mooncake_master)
        except ValueError as exc:
            raise ValueError(f"mooncake_master: {exc}") from None
    if c.mooncake_protocol not in MOONCAKE_PROTOCOLS:
        raise ValueError(
            f"mooncake_protocol: must be one of {MOONCAKE_PROTOCOLS}, got {c.mooncake_protocol!r}"
        )
    segment = c.mooncake_segment_bytes
    if segment != 0 and not MOONCAKE_SEGMENT_MIN <= segment <= _MOONCAKE_SEGMENT_MAX:
        raise ValueError(
            f"mooncake_segment_bytes: must be 0 (contribute no memory) or "
            f"{MOONCAKE_SEGMENT_MIN} (16 MiB, Mooncake's least) to {_MOONCAKE_SEGMENT_MAX}, "
            f"got {segment}"
        )
    if not 0 < c.mooncake_timeout_s <= _MOONCAKE_TIMEOUT_MAX_S:  # also rejects NaN
        raise ValueError(
            f"mooncake_timeout_s: must be a positive number of seconds, at most "
            f"{_MOONCAKE_TIMEOUT_MAX_S:.0f}, got {c.mooncake_timeout_s!r}"
        )
