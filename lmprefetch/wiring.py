"""Putting an engine together: :func:`open_engine` builds one rank's engine from a configuration.

It checks what only this machine can tell (is there that much memory, are the Redis and
Mooncake extras installed), makes the arena, opens the tiers the configuration names (CPU, then
disk, then Redis, then Mooncake, then any given ones), each with its codec stage (its codec,
and the one cipher every tier shares when ``encryption_key_file`` is set: the master key is
read once, here), and the KV-event tracker that listens to them, and runs the engine in a
nursery of its own.  Leaving it cancels every lookup, flushes
pending writes, closes the tiers and drops the CPU tier; the engine's own logic is in
:mod:`lmprefetch.prefetch`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Final

import trio

from .codec import ChunkStage, TenantCipher, get_codec, load_master_key
from .config import PrefetchConfig
from .events import EventMode, KVEventTracker
from .keys import ChunkKey, KeyMaker
from .memory import Arena
from .policy import make_policy
from .prefetch import Engine
from .tiers.base import Tier
from .tiers.cpu import CpuTier
from .trace import decision_log_path, open_decision_log

__all__ = ["open_engine"]

log = logging.getLogger("lmprefetch.engine")

#: An arena pre-fault this small runs on the Trio thread (a few hundred pages, well under a
#: millisecond): a thread hop would cost more.
_PREFAULT_INLINE_BYTES: Final = 1 << 20


@asynccontextmanager
async def open_engine(
    config: PrefetchConfig,
    *,
    rank: int = 0,
    world_size: int = 1,
    extra_tiers: Sequence[Tier] = (),
    kv_events: EventMode = "off",
) -> AsyncIterator[Engine]:
    """Open one rank's engine: arena, tiers, and the nursery its lookups run in.

    ``extra_tiers`` are probed after the configured ones (CPU, disk, Redis, Mooncake), in
    order; those that are a :class:`~lmprefetch.tiers.base.WriteBehindTier` (``enqueue_write``
    and ``flush``) also get write-behind copies of stored chunks.  The engine does not close
    them.

    ``kv_events`` turns on KV events (:mod:`lmprefetch.events`; ``config.kv_events = False``
    keeps them off): ``"chunks"`` starts the stream with ``AllBlocksCleared`` and announces
    what the disk tier holds, named by chunk hash; ``"described"`` (the vLLM connector) only
    announces chunks named with :meth:`Engine.describe_chunks` or ``store_hashes(blocks=…)``.

    On exit every lookup is cancelled and releases what it owns, pending disk and remote writes
    are flushed, and the CPU tier is dropped.  A new engine on the same ``disk_path`` finds the
    chunks the old one stored.

    Raises:
        TypeError: ``config`` is not a :class:`PrefetchConfig`.
        ValueError: a setting this machine cannot honour, naming it: ``rank`` out of range,
            ``cpu_bytes`` more than the machine's memory, ``disk_path`` not a writable
            directory, ``redis_url`` without the ``redis`` extra installed (or
            ``mooncake_master`` without the ``mooncake`` extra), a ``load_policy`` class that
            cannot be imported or built, a codec or ``encryption_key_file`` this machine
            cannot honour (a library missing, the key file gone since the configuration was
            read).
    """
    if not isinstance(config, PrefetchConfig):
        raise TypeError(f"config: expected PrefetchConfig, got {type(config).__name__}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank: must be in [0, world_size={world_size}), got {rank}")
    _check_machine_memory(config.cpu_bytes)
    _check_extras(config)
    stages = _codec_stages(config)
    policy = make_policy(config.load_policy)  # a custom policy is imported here
    log_path = None
    if config.decision_log is not None:
        log_path = await decision_log_path(config.decision_log, rank)  # ValueError if unusable
    try:
        arena = Arena(config.slot_bytes, config.arena_slots, backend=config.buffer_backend)
    except (MemoryError, OSError) as exc:
        raise ValueError(f"cpu_bytes: cannot allocate {config.cpu_bytes} bytes ({exc})") from None
    cpu = CpuTier(arena)
    try:
        await _prefault(arena, config.arena_prefault_bytes)
        async with AsyncExitStack() as stack:
            tiers: list[Tier] = [cpu]
            tiers.extend(
                await _open_configured_tiers(stack, config, arena, rank, world_size, stages)
            )
            tiers.extend(extra_tiers)
            tracker = _open_tracker(config, rank, world_size, kv_events, tiers)
            async with trio.open_nursery() as nursery:
                engine = Engine(
                    config,
                    rank=rank,
                    world_size=world_size,
                    nursery=nursery,
                    arena=arena,
                    cpu=cpu,
                    tiers=tiers,
                    kv_events=tracker,
                    policy=policy,
                )
                try:
                    if log_path is None:
                        yield engine
                    else:
                        async with open_decision_log(engine.trace, log_path, nursery):
                            yield engine
                finally:
                    engine._close()
    finally:
        cpu.clear()
        if arena.used_slots == 0:
            arena.close()
        else:  # buffers still claimed by someone: leave the memory to the GC
            log.warning("engine closed with %d arena slots still claimed", arena.used_slots)


def _check_machine_memory(cpu_bytes: int) -> None:
    """A ``cpu_bytes`` larger than the machine's memory is a configuration error, said at
    start-up: the arena would be created lazily and fail much later, inside a lookup."""
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # pragma: no cover - not POSIX
        return
    if physical > 0 and cpu_bytes > physical:
        raise ValueError(
            f"cpu_bytes: {cpu_bytes} bytes is more than this machine's memory "
            f"({physical} bytes); lower cpu_bytes"
        )


def _check_extras(config: PrefetchConfig) -> None:
    """A tier the configuration names needs its optional dependency installed."""
    if config.redis_url is not None:
        try:
            import redis  # noqa: F401  (only to say which extra is missing)
        except ImportError:
            raise ValueError(
                "redis_url: the Redis tier needs the redis extra: "
                "python -m pip install 'lmprefetch[redis]'"
            ) from None
    if config.buffer_backend == "torch":
        try:
            import torch  # noqa: F401  (the arena imports it again: no second cost)
        except ImportError:
            raise ValueError(
                'buffer_backend: "torch" needs the torch extra: '
                "python -m pip install 'lmprefetch[torch]'"
            ) from None
    if config.mooncake_master is not None:
        from .tiers.mooncake_store import check_installed

        check_installed()  # ValueError naming the extra


async def _prefault(arena: Arena, nbytes: int) -> None:
    """Map the first ``nbytes`` of the arena now (in a worker thread unless it is tiny)."""
    prefault = min(nbytes, arena.total_bytes)
    if prefault > _PREFAULT_INLINE_BYTES:
        t0 = trio.current_time()
        done = await trio.to_thread.run_sync(arena.prefault, prefault)
        log.info(
            "arena: %d of %d bytes pre-faulted in %.3f s",
            done, arena.total_bytes, trio.current_time() - t0,
        )  # fmt: skip
    elif prefault:  # a few pages: less than a thread hop costs
        arena.prefault(prefault)


def _codec_stages(config: PrefetchConfig) -> dict[str, ChunkStage]:
    """Each stored tier's codec stage (``disk_codec``, ``redis_codec``, ``mooncake_codec``),
    sharing one cipher when ``encryption_key_file`` is set (the master key read once, here).

    Raises:
        ValueError: a codec or the key file that cannot be used (the message names the
            field).
    """
    cipher: TenantCipher | None = None
    if config.encryption_key_file is not None:
        try:
            cipher = TenantCipher(load_master_key(config.encryption_key_file))
        except ValueError as exc:  # KeyFileError names the field; a missing library does not
            text = str(exc)
            raise ValueError(
                text if text.startswith("encryption_key_file") else f"encryption_key_file: {text}"
            ) from None
    stages = {}
    for tier in ("disk", "redis", "mooncake"):
        field = f"{tier}_codec"
        name = getattr(config, field)
        try:  # the payloads' dtype: byte planes of its width, a lossy codec's values, and
            # what a reader expects any chunk it decodes to hold
            codec = get_codec(name, dtype=config.kv_dtype, group=config.codec_group)
        except ValueError as exc:
            raise ValueError(f"{field}: {str(exc).partition(': ')[2] or exc}") from None
        stages[tier] = ChunkStage(codec, cipher)
    return stages


async def _open_configured_tiers(
    stack: AsyncExitStack,
    config: PrefetchConfig,
    arena: Arena,
    rank: int,
    world_size: int,
    stages: dict[str, ChunkStage],
) -> list[Tier]:
    """The disk, Redis and Mooncake tiers ``config`` names, in probe order, each with its
    codec stage (:func:`_codec_stages`); ``stack`` closes them.  The Mooncake tier registers
    ``arena`` with Mooncake (it reads and writes chunks in place)."""
    tiers: list[Tier] = []
    if config.disk_path is not None:
        from .tiers.disk import open_disk_tier

        disk = await stack.enter_async_context(
            open_disk_tier(
                config.disk_path,
                capacity_bytes=config.disk_bytes,
                read_threads=config.disk_read_threads,
                write_queue=config.disk_write_queue,
                o_direct=config.disk_o_direct,
                owns=_key_owner(config, rank, world_size),
                stage=stages["disk"],
            )
        )
        tiers.append(disk)
    if config.redis_url is not None:
        from .tiers.redis import open_redis_tier

        remote = await stack.enter_async_context(
            open_redis_tier(
                config.redis_url,
                timeout_s=config.redis_timeout_s,
                threads=config.redis_threads,
                write_queue=config.redis_write_queue,
                backoff_initial_s=config.redis_backoff_initial_s,
                backoff_max_s=config.redis_backoff_max_s,
                stage=stages["redis"],
            )
        )
        tiers.append(remote)
    if config.mooncake_master is not None:
        from .tiers.mooncake import open_mooncake_tier_from_config

        mooncake = open_mooncake_tier_from_config(config, arena, stages["mooncake"])
        tiers.append(await stack.enter_async_context(mooncake))
    return tiers


def _key_owner(config: PrefetchConfig, rank: int, world_size: int) -> Callable[[ChunkKey], bool]:
    """Which chunk keys are this engine's: the ranks of one engine (and other models) may share
    a ``disk_path``; each indexes and evicts only its own files."""
    mine = (config.model_name, world_size, rank, config.kv_dtype)

    def owns(key: ChunkKey) -> bool:
        return (key.model_name, key.world_size, key.rank, key.kv_dtype) == mine

    return owns


def _open_tracker(
    config: PrefetchConfig, rank: int, world_size: int, mode: EventMode, tiers: Sequence[Tier]
) -> KVEventTracker | None:
    """The KV-event tracker, listening to every tier that reports its changes; ``None`` when
    events are off.  What the disk tier holds already is registered (and announced in
    ``"chunks"`` mode, after ``AllBlocksCleared``)."""
    if mode == "off" or not config.kv_events:
        return None
    tracker = KVEventTracker(
        KeyMaker.from_config(config, rank=rank, world_size=world_size),
        chunk_size=config.chunk_size,
        mode=mode,
        max_pending=config.kv_events_max_pending,
        # A chunk on no tier may still be landed by a write-behind: keep the names of as many
        # (a size with some slack, not a rule a test could pin down).
        orphan_limit=config.disk_write_queue + config.redis_write_queue + 64,  # pragma: no mutate
    )
    if mode == "chunks":
        tracker.clear_all()
    for tier in tiers:
        if hasattr(tier, "listener"):  # a tier that reports its changes (BaseTier's rule)
            tier.listener = tracker
            existing = getattr(tier, "keys", None)
            if callable(existing):  # the disk tier's index, rebuilt from its directory
                for key in existing():  # least recently used first
                    tracker.stored(tier.name, key)
    return tracker
