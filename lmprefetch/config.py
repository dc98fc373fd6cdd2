"""`PrefetchConfig`: every knob of lmprefetch, validated, flat, with defaults.

A config is a frozen msgspec ``Struct``.  Build it directly (``PrefetchConfig(chunk_size=128)``),
from a mapping (:meth:`PrefetchConfig.from_dict`), from a TOML file
(:meth:`PrefetchConfig.from_file`) or from ``LMPREFETCH_*`` environment variables
(:meth:`PrefetchConfig.from_env`).  Every path validates every field and raises
:class:`ValueError` whose message starts with the field's name, so a bad deployment
fails at start-up with a sentence a person can act on.

Sizes are in bytes (``*_bytes``), durations in seconds (``*_s``).

**One declaration per field.**  Each field states its type, bounds and meaning in one place,
its annotation, e.g. ``Annotated[int, Meta(ge=1, le=4096, description="...")]``.  Everything else
is derived from that declaration by :func:`describe_fields` (the machinery is in
:mod:`lmprefetch.config_fields`): the checks (type, bounds, allowed
names, text rules), the parsing of TOML values and environment variables, the variable's name
(``LMPREFETCH_<FIELD>``), and the configuration reference in the documentation (type, default,
allowed values, unit, meaning).  A declaration the checks cannot be derived from (a number
without both bounds or without a unit, a field without a description or a default) fails
when this module is imported, naming the field.

Adding a field is one declaration in :class:`PrefetchConfig`, under the section comment it
belongs to::

    redis_threads: Annotated[
        int,
        Meta(ge=1, le=1024, extra={"unit": "threads"}, description="Concurrent Redis calls ..."),
    ] = 4

A number's unit comes from its name (``*_bytes``, ``*_s``) or ``Meta(extra={"unit": ...})``;
durations use ``Annotated[_Seconds, Meta(description=...)]``; a ``str | None`` is off when
unset (an empty variable means unset); a further rule of one field is a function in
``Meta(extra={"check": ...})`` (``mooncake_segment_bytes``: 0 or at least 16 MiB).  A rule that
relates two fields is a line in :func:`_check_rules`.  Code that needs the value reads
``config.redis_threads``.

Nothing here does I/O except :meth:`PrefetchConfig.from_file` (one read at start-up) and the
check of ``encryption_key_file`` (the key file is read where the configuration is built, so that
a missing or short key stops the start-up).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from . import config_checks as checks
from .config_checks import (
    LOAD_POLICIES,
    MOONCAKE_PROTOCOLS,
    MOONCAKE_SEGMENT_MIN,
    parse_host_port,
)
from .config_fields import (
    ENV_PREFIX,
    FieldSpec,
    GiB,
    KiB,
    MiB,
    PiB,
    TiB,
    close_name,
    describe_struct,
    located,
    shown,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

__all__ = [
    "ENV_PREFIX",
    "HASH_ALGORITHMS",
    "KV_DTYPES",
    "LOAD_POLICIES",
    "MOONCAKE_PROTOCOLS",
    "MOONCAKE_SEGMENT_MIN",
    "ConfigFileError",
    "FieldSpec",
    "PrefetchConfig",
    "describe_fields",
    "load_env",
    "parse_host_port",
]

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


#: The longest duration any ``*_s`` field may have (a year): past it a typo is more likely than
#: intent, and deadlines stay well inside every clock's range.
_YEAR_S = 365 * 24 * 3600.0
#: A duration: more than 0 seconds, at most a year (also rejects NaN and infinity).
_Seconds = Annotated[float, Meta(gt=0, le=_YEAR_S)]
#: Text that must not be empty.
_NonEmpty = Annotated[str, Meta(min_length=1)]


class PrefetchConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """All settings of an lmprefetch engine and of the scheduler-side client.

    Each field has a default, so ``PrefetchConfig()`` is a working CPU-only setup.  Each
    field's annotation declares its type, bounds and meaning (see the module's docstring); the
    configuration reference in the documentation is generated from them.
    """

    # -- chunking and keys ------------------------------------------------------------
    chunk_size: Annotated[
        int,
        Meta(
            ge=1,
            le=1 << 20,
            extra={"unit": "tokens"},
            description="Tokens per chunk; one key (one per layer in layerwise mode) per chunk.",
        ),
    ] = 256
    save_partial_chunks: Annotated[
        bool,
        Meta(
            description="Also store and look up a trailing chunk shorter than ``chunk_size`` "
            "(LMCache's ``save_unfull_chunk``)."
        ),
    ] = False
    hash_algorithm: Annotated[
        str,
        Meta(
            extra={"one_of": HASH_ALGORITHMS},
            description="The hash function of chunk hashes; deterministic across processes.",
        ),
    ] = "blake2b"
    model_name: Annotated[
        _NonEmpty,
        Meta(
            extra={"check": checks.no_at_sign},
            description="Names the model in every key, so engines serving different models "
            "never share chunks; must not contain ``@``.  The vLLM connector sets it to the "
            "model path.",
        ),
    ] = "model"
    kv_dtype: Annotated[
        str,
        Meta(
            extra={"one_of": KV_DTYPES},
            description="Names the KV dtype in every key (payloads are opaque bytes; the name "
            "only keeps dtypes apart).  The vLLM connector sets it from the KV cache tensors.",
        ),
    ] = "bfloat16"
    layerwise: Annotated[
        bool,
        Meta(description="Layerwise mode: every chunk has ``num_layers`` keys, one per layer."),
    ] = False
    num_layers: Annotated[
        int,
        Meta(
            ge=1,
            le=4096,
            extra={"unit": "layers"},
            description="Layers per chunk in layerwise mode (ignored otherwise); "
            "``chunk_bytes`` must be a multiple of it.",
        ),
    ] = 1

    # -- time -------------------------------------------------------------------------
    lookup_timeout_s: Annotated[
        _Seconds,
        Meta(
            description="The scheduler gives up on a lookup after this long, answers 0 and "
            "cancels it."
        ),
    ] = 3.0
    claim_ttl_s: Annotated[
        _Seconds,
        Meta(description="A prefetched result nobody claims is released after this long."),
    ] = 30.0
    tier_timeout_s: Annotated[
        _Seconds,
        Meta(
            description="Bound on one tier operation (probe or load) inside a lookup; a tier "
            "slower than this ends the lookup's prefix at that tier."
        ),
    ] = 2.0

    # -- load or recompute (lmprefetch.policy) -------------------------------------------
    load_policy: Annotated[
        _NonEmpty,
        Meta(
            extra={"check": checks.load_policy},
            description="How much of a hit a lookup loads: ``always`` (all of it), ``never`` "
            "(nothing: answer at once, recompute), ``cost`` (the prefix expected to reach the "
            "first token soonest, from measured tier and prefill costs), or "
            "``package.module:Class`` (a custom policy, imported when the engine opens).  See "
            "docs/policy.md.",
        ),
    ] = "always"
    load_deadline_s: Annotated[
        _Seconds | None,
        Meta(
            description="Load budget of one lookup, from its start: when its loads run past "
            "it, the lookup answers the prefix already loaded and cancels and releases the "
            "rest (counted as ``deadline_cut``).  Unset: only ``lookup_timeout_s`` bounds it."
        ),
    ] = None
    prefill_tokens_per_s: Annotated[
        Annotated[float, Meta(gt=0, le=1e9, extra={"unit": "tokens/s"})] | None,
        Meta(
            description="The engine's prefill rate for the ``cost`` policy until it is "
            "measured (the vLLM connector measures it from model steps).  Unset: until "
            "measured, ``cost`` loads the whole hit.",
        ),
    ] = None

    tier_cost_max_age_s: Annotated[
        _Seconds,
        Meta(
            description="A tier's measured load throughput older than this is measured again: "
            "when a load policy drops chunks of that tier (or of a tier never measured), two "
            "of them are loaded in the background, not for the lookup, to measure it.  The "
            "``cost`` policy does not trust a tier that has never been measured.",
        ),
    ] = 60.0
    decision_log: Annotated[
        _NonEmpty | None,
        Meta(
            extra={"path": True},
            description="A file to which every lookup's load decision (the hit tier by tier, "
            "each tier's measured cost, the prefill model, the predicted and the measured load "
            "and recompute times), every model step the vLLM worker timed and every slow "
            "garbage collection are appended, one JSON line each (``{rank}`` in the path is "
            "replaced by the worker's rank).  Unset: nothing is recorded.  See "
            "docs/policy.md.",
        ),
    ] = None

    # -- memory -----------------------------------------------------------------------
    cpu_bytes: Annotated[
        int,
        Meta(
            ge=2,
            le=256 * TiB,
            description="Size of the host-memory arena (the CPU tier and all prefetch "
            "buffers); at least two chunks of ``chunk_bytes``.",
        ),
    ] = 1 * GiB
    chunk_bytes: Annotated[
        int,
        Meta(
            ge=1,
            le=4 * GiB,
            description="Size of one chunk's payload (all layers); the arena's slot size in "
            "non-layerwise mode.",
        ),
    ] = 2 * MiB
    buffer_backend: Annotated[
        str,
        Meta(
            extra={"one_of": _BUFFER_BACKENDS},
            description="``bytes`` (plain anonymous memory) or ``torch`` (a uint8 tensor, "
            "pinned when CUDA is available; needs the ``torch`` extra).",
        ),
    ] = "bytes"
    arena_prefault_bytes: Annotated[
        int,
        Meta(
            ge=0,
            le=256 * TiB,
            description="Bytes of the arena (from its first slot: the slots handed out first) "
            "mapped into memory when the engine opens, so the first loads into them do not "
            "page-fault (a fresh slot's first load is several times slower otherwise).  Costs "
            "start-up time, about 0.3–1 s per GiB on a small VM, and makes that much memory "
            "resident at once; 0 maps every slot lazily on first use.  Capped at "
            "``cpu_bytes``.",
        ),
    ] = 1 * GiB

    # -- disk tier --------------------------------------------------------------------
    disk_path: Annotated[
        _NonEmpty | None,
        Meta(
            extra={"path": True},
            description="Directory of the disk tier; unset (``None``) disables it.",
        ),
    ] = None
    disk_bytes: Annotated[
        int,
        Meta(
            ge=1,
            le=64 * PiB,
            description="Disk tier capacity; least recently used unpinned files are evicted "
            "past it.  At least one chunk of ``chunk_bytes``.",
        ),
    ] = 16 * GiB
    disk_o_direct: Annotated[
        bool,
        Meta(description="Read chunk files with ``O_DIRECT`` when sizes and alignment allow it."),
    ] = False
    disk_read_threads: Annotated[
        int,
        Meta(
            ge=1,
            le=1024,
            extra={"unit": "threads"},
            description="Worker threads reading chunk files at once.",
        ),
    ] = 4
    disk_write_queue: Annotated[
        int,
        Meta(
            ge=1,
            le=1 << 24,
            extra={"unit": "chunks"},
            description="Chunks waiting for their write-behind to disk; past this, stores are "
            "dropped from the disk tier (and counted), never blocking the caller.",
        ),
    ] = 1024

    # -- remote tier ------------------------------------------------------------------
    redis_url: Annotated[
        str | None,
        Meta(
            extra={"check": checks.redis_urls},
            description="``redis://host:port`` for a standalone server, or a comma-separated "
            "list of such URLs for a Redis Cluster; unset (``None``) disables the remote tier.",
        ),
    ] = None
    redis_timeout_s: Annotated[_Seconds, Meta(description="Deadline of one Redis call.")] = 1.0
    redis_write_queue: Annotated[
        int,
        Meta(
            ge=1,
            le=1 << 24,
            extra={"unit": "chunks"},
            description="Chunks waiting for their write-behind to Redis (full queue: drop and "
            "count).",
        ),
    ] = 1024
    redis_threads: Annotated[
        int,
        Meta(
            ge=1,
            le=1024,
            extra={"unit": "threads"},
            description="Concurrent Redis calls (threads) per worker.",
        ),
    ] = 4
    redis_backoff_initial_s: Annotated[
        _Seconds,
        Meta(
            description='After a failed Redis call the tier answers "miss" without touching '
            "the network for this long, doubling up to ``redis_backoff_max_s`` while failures "
            "go on."
        ),
    ] = 0.5
    redis_backoff_max_s: Annotated[
        _Seconds,
        Meta(
            description="The longest backoff after repeated Redis failures; at least "
            "``redis_backoff_initial_s``."
        ),
    ] = 30.0

    # -- Mooncake tier ----------------------------------------------------------------
    mooncake_master: Annotated[
        str | None,
        Meta(
            extra={"check": checks.host_port},
            description="``host:port`` of a running ``mooncake_master`` (its RPC port); unset "
            "(``None``) disables the Mooncake tier.  Probed after the disk and Redis tiers; "
            "shared by every engine that points at the same master.  Needs the ``mooncake`` "
            "extra.",
        ),
    ] = None
    mooncake_metadata_server: Annotated[
        _NonEmpty,
        Meta(
            extra={"check": checks.no_spaces},
            description="Where Mooncake clients find each other's memory: ``P2PHANDSHAKE`` (no "
            "server: peers exchange it directly), ``http://host:port/metadata`` (the master's "
            "``--enable_http_metadata_server``), or an etcd or Redis address.",
        ),
    ] = "P2PHANDSHAKE"
    mooncake_protocol: Annotated[
        str,
        Meta(
            extra={"one_of": MOONCAKE_PROTOCOLS},
            description="Mooncake's transfer protocol: ``tcp`` or ``rdma``.",
        ),
    ] = "tcp"
    mooncake_local_hostname: Annotated[
        _NonEmpty,
        Meta(
            extra={"check": checks.no_spaces},
            description="The address other Mooncake clients reach this worker at: its address "
            "on the network the workers share (``127.0.0.1`` serves one machine only).",
        ),
    ] = "127.0.0.1"
    mooncake_segment_bytes: Annotated[
        int,
        Meta(
            ge=0,
            le=256 * TiB,
            extra={"check": checks.mooncake_segment},
            description="Memory this worker gives Mooncake's pool: 0, or at least 16 MiB "
            "(Mooncake's least).  Chunks (its own and other workers') live in it and go when "
            "the worker stops.  0 for the standalone-store deployment, where a "
            "``mooncake_client`` process holds the pool.",
        ),
    ] = 1 * GiB
    mooncake_timeout_s: Annotated[
        float,
        Meta(
            gt=0,
            le=10.0,
            description="Deadline of one Mooncake call; it also sets Mooncake's own RPC and "
            "transfer timeouts (at most 10 s: Mooncake waits on a transfer batch for a fixed "
            "60 s at most).",
        ),
    ] = 1.0

    # -- codecs and encryption of stored chunks (lmprefetch.codec) ----------------------
    disk_codec: Annotated[
        str,
        Meta(
            extra={"check": checks.codec_name},
            description="How the disk tier encodes the chunks it writes: ``none`` (as they "
            "are), ``lossless`` (byte planes + zstd), or a lossy codec a user opts into: "
            "``bitround<N>`` (mantissas rounded to N bits, e.g. ``bitround3``), ``fp8``, "
            "``int8``, ``int4`` (per-group scales).  Chunks written with another codec stay "
            "readable.  Lossy codecs need a floating-point ``kv_dtype``; codecs other than "
            "``none`` need the ``codecs`` extra.  See docs/codecs.md.",
        ),
    ] = "none"
    redis_codec: Annotated[
        str,
        Meta(
            extra={"check": checks.codec_name},
            description="How the Redis tier encodes the chunks it writes (as ``disk_codec``).",
        ),
    ] = "none"
    mooncake_codec: Annotated[
        str,
        Meta(
            extra={"check": checks.codec_name},
            description="How the Mooncake tier encodes the chunks it writes (as "
            "``disk_codec``).",
        ),
    ] = "none"
    codec_group: Annotated[
        int,
        Meta(
            ge=1,
            le=1 << 16,
            extra={"unit": "elements"},
            description="Elements per scale of the ``fp8``, ``int8`` and ``int4`` codecs (even "
            "for ``int4``): the head size of the model's attention, or a divisor of it, gives "
            "one scale per token and head (the payload's innermost dimension).  Chunks record "
            "their group, so changing it leaves stored chunks readable.",
        ),
    ] = 64
    encryption_key_file: Annotated[
        _NonEmpty | None,
        Meta(
            extra={"path": True, "check": checks.key_file},
            description="A file holding the operator's master key (at least 32 bytes, e.g. "
            "``head -c 32 /dev/urandom``), read at start-up: chunks on disk, in Redis and in "
            "Mooncake are then sealed with AES-256-GCM under a key per tenant (``cache_salt``, "
            "LoRA adapter) derived from it, and chunks that do not authenticate are misses.  "
            "Unset (``None``): no encryption.  Needs the ``encryption`` extra.",
        ),
    ] = None

    # -- transport --------------------------------------------------------------------
    socket_hwm: Annotated[
        int,
        Meta(
            ge=1,
            le=(1 << 31) - 1,  # a C int in libzmq
            extra={"unit": "messages"},
            description="ZeroMQ high-water mark (messages) on every lookup socket.",
        ),
    ] = 10_000
    max_message_bytes: Annotated[
        int,
        Meta(
            ge=1 * KiB,
            le=1 * GiB,
            description="Largest lookup message a worker or client accepts; a peer that sends "
            "a larger frame is disconnected.  A request costs about 12 bytes per chunk, so the "
            "default holds a prompt of over 300 million tokens at the default chunk size.",
        ),
    ] = 16 * MiB

    # -- KV events ----------------------------------------------------------------------
    kv_events: Annotated[
        bool,
        Meta(
            description="Emit KV events (``BlockStored`` / ``BlockRemoved``) for what the tiers "
            "hold, where a consumer asks for them (vLLM's ``--kv-events-config``, "
            "``lmprefetch worker --events-endpoint``); ``false`` turns them off everywhere."
        ),
    ] = True
    kv_events_max_pending: Annotated[
        int,
        Meta(
            ge=1,
            le=1 << 24,
            extra={"unit": "events"},
            description="Events waiting for their consumer; past this, new events are dropped "
            "(and counted).",
        ),
    ] = 100_000

    def __post_init__(self) -> None:
        for spec in _FIELDS.values():
            problem = spec.problem(getattr(self, spec.name))
            if problem is not None:
                if spec.name == "cpu_bytes":  # its bound, 2, is only the floor of its rule
                    problem = _cpu_bytes_problem(self) or problem
                raise ValueError(f"{spec.name}: {problem}")
        _check_rules(self)

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
        values: dict[str, Any] = {}
        for name, value in data.items():
            spec = _FIELDS.get(name) if isinstance(name, str) else None
            if spec is None:
                hint = close_name(name, _FIELDS)
                raise ValueError(f"{shown(name)}: unknown PrefetchConfig field{hint}")
            values[name] = spec.parse(value)
        return cls(**values)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> PrefetchConfig:
        """Load a TOML file: top-level fields, or a ``[lmprefetch]`` table.

        Raises:
            ValueError: the file is not valid TOML or holds an invalid field (the message names
                the field, then the file), or it cannot be read: then it is a
                :class:`ConfigFileError`, both an ``OSError`` and a ``ValueError``.
        """
        table = read_toml(path)
        where = f"in {shown(str(path))}"
        return located(cls.from_dict, table, dict.fromkeys(table, where))

    @classmethod
    def from_env(
        cls,
        environ: Mapping[str, str] | None = None,
        *,
        prefix: str = ENV_PREFIX,
        config_file: str | os.PathLike[str] | None = None,
    ) -> PrefetchConfig:
        """Build a config from ``LMPREFETCH_<FIELD>`` variables (e.g. ``LMPREFETCH_CHUNK_SIZE``).

        The TOML file ``config_file`` (default: the one ``LMPREFETCH_CONFIG`` names, if any)
        is read first; single variables override its fields, and the result is validated as
        a whole.  An empty value for an optional field (``disk_path``, ``redis_url``,
        ``mooncake_master``) means ``None``.

        Args:
            environ: the variables (default: ``os.environ``).
            prefix: the variables' common prefix.
            config_file: a TOML file to read instead of the one ``LMPREFETCH_CONFIG`` names
                (``lmprefetch worker --config``).

        Raises:
            ValueError: a variable with the prefix names no field (a typo must not be
                ignored silently), or a value is invalid; the message names the field (or
                the unknown variable) and says which variable or file set it.
        """
        return load_env(cls, environ, prefix=prefix, config_file=config_file)[0]

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
        changed = msgspec.structs.replace(self, **changes)
        changed.__post_init__()  # msgspec 0.18.0's replace() does not run it
        return changed

    def to_dict(self) -> dict[str, Any]:
        return msgspec.structs.asdict(self)


def load_env(
    cls: type[PrefetchConfig],
    environ: Mapping[str, str] | None = None,
    *,
    prefix: str = ENV_PREFIX,
    config_file: str | os.PathLike[str] | None = None,
) -> tuple[PrefetchConfig, dict[str, str]]:
    """:meth:`PrefetchConfig.from_env`, and where each field that was set came from: field →
    ``"in FILE"`` or ``"from LMPREFETCH_FIELD"`` (a variable wins over the file).  Fields
    neither sets keep their defaults and are not in the mapping."""
    env = os.environ if environ is None else environ
    config_var = prefix + "CONFIG"
    by_var = {prefix + name.upper(): name for name in _FIELDS}
    for var in sorted(env):
        if var.startswith(prefix) and var != config_var and var not in by_var:
            field = var[len(prefix) :].lower()
            hint = close_name(field, _FIELDS, prefix=prefix)
            raise ValueError(
                f"{shown(var)}: unknown variable: no PrefetchConfig field is called "
                f"{field!r}{hint}"
            )
    values: dict[str, Any] = {}
    where: dict[str, str] = {}
    if config_file is None:
        config_file = env.get(config_var) or None
    if config_file is not None:
        values = read_toml(config_file)
        where = dict.fromkeys(values, f"in {shown(str(config_file))}")
    for var, name in by_var.items():
        value = env.get(var)
        if value is None:
            continue
        values[name] = None if (value == "" and _FIELDS[name].optional) else value
        where[name] = f"from {shown(var)}"
    return located(cls.from_dict, values, where), where


def _check_rules(c: PrefetchConfig) -> None:
    """The rules that relate two fields (each field's own rules are in its declaration).  The
    message starts with the field to change."""
    if c.layerwise and c.chunk_bytes % c.num_layers:
        raise ValueError(
            f"chunk_bytes: in layerwise mode must be a multiple of num_layers "
            f"({c.num_layers}), got {c.chunk_bytes}"
        )
    problem = _cpu_bytes_problem(c)
    if problem is not None:
        raise ValueError(f"cpu_bytes: {problem}")
    if c.disk_bytes < c.chunk_bytes:
        raise ValueError(
            f"disk_bytes: must hold at least one chunk ({c.chunk_bytes}), got {c.disk_bytes}"
        )
    for name in ("disk_codec", "redis_codec", "mooncake_codec"):
        problem = _codec_for_dtype(getattr(c, name), c.kv_dtype)
        if problem is not None:
            raise ValueError(f"{name}: {problem}")
        if getattr(c, name) == "int4" and c.codec_group % 2:
            raise ValueError(
                f"codec_group: the int4 codec ({name}) packs two codes per byte: the group "
                f"must be even, got {c.codec_group}"
            )
    if c.redis_backoff_max_s < c.redis_backoff_initial_s:
        raise ValueError(
            f"redis_backoff_max_s: must be at least redis_backoff_initial_s "
            f"({c.redis_backoff_initial_s}), got {c.redis_backoff_max_s}"
        )


def _codec_for_dtype(name: str, kv_dtype: str) -> str | None:
    from .codec.registry import codec_problem

    return codec_problem(name, kv_dtype)


def _cpu_bytes_problem(c: PrefetchConfig) -> str | None:
    """What breaks ``cpu_bytes``'s rule (two chunks of ``chunk_bytes``), or ``None`` where it
    holds or cannot be judged (``chunk_bytes`` itself invalid, ``cpu_bytes`` not an int)."""
    chunk, cpu = c.chunk_bytes, c.cpu_bytes
    valid_chunk = _FIELDS["chunk_bytes"].problem(chunk) is None
    if not valid_chunk or isinstance(cpu, bool) or not isinstance(cpu, int) or cpu >= 2 * chunk:
        return None
    return f"must hold at least two chunks of chunk_bytes ({chunk}), got {cpu}"


#: The fields of :class:`PrefetchConfig`, by name, read once at import: a declaration the
#: checks cannot be derived from fails here, before any config is built.
_FIELDS: dict[str, FieldSpec] = {spec.name: spec for spec in describe_struct(PrefetchConfig)}


def describe_fields(cls: type[msgspec.Struct] | None = None) -> tuple[FieldSpec, ...]:
    """Every field of ``cls`` (default: :class:`PrefetchConfig`) as its declaration states it,
    in declaration order (see :func:`~lmprefetch.config_fields.describe_struct`).

    Raises:
        TypeError: a declaration that the checks and the documentation cannot be derived
            from; the message names the field and says what to declare.
    """
    return tuple(_FIELDS.values()) if cls is None else describe_struct(cls)


def read_toml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The table of fields in a TOML file: its top level, or its ``[lmprefetch]`` table."""
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        if isinstance(exc, FileNotFoundError):
            what = "config file not found"
        elif isinstance(exc, IsADirectoryError):
            what = "is a directory, not a config file"
        else:
            what = f"cannot read the config file ({exc.strerror})"
        raise ConfigFileError(exc.errno or 0, f"{shown(str(path))}: {what}") from None
    except ValueError as exc:  # a NUL, or a surrogate the file system cannot encode
        raise ValueError(f"{shown(str(path))}: not a usable file name ({exc})") from None
    try:
        doc = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{shown(str(path))}: not a valid TOML file: {exc}") from None
    except RecursionError:  # tomllib is recursive: arrays or tables nested ~500 deep
        raise ValueError(
            f"{shown(str(path))}: not a valid TOML file: values nested too deeply"
        ) from None
    table = doc.get("lmprefetch", doc)
    if not isinstance(table, dict):
        raise ValueError(f"{shown(str(path))}: [lmprefetch] must be a table")
    return table
