"""The calls the Mooncake tier makes in worker threads: each one blocking call (or a few) on
a Mooncake client, run by ``trio.to_thread.run_sync`` under the tier's limiter.

``get_into``/``get_decoded`` write arena memory and ``put_from``/``encode_put`` read it, so the
tier never abandons those threads (see :mod:`lmprefetch.tiers.mooncake`, "Deadlines of calls
that touch the arena"); ``exist`` and ``remove`` touch no arena memory.  With a codec stage
that is not a passthrough, ``encode_put`` encodes into staging slots and puts from there, and
``get_decoded`` gets into staging slots and decodes into the arena buffers, in the same thread.

**Codecs.**  With the codec ``none`` and no encryption (the tier's
:class:`~lmprefetch.codec.ChunkStage` is a passthrough) the transfers stay zero-copy; an
object written under another codec is recognised by its first bytes after the get and decoded
in place (in the same thread).  With a codec or encryption (``mooncake_codec``,
``encryption_key_file``; docs/codecs.md), the tier moves chunks through a small *staging*
arena of its own (registered with Mooncake like the engine's): the writer's thread encodes
each chunk into a staging slot and puts it from there; a load gets objects into staging slots
and its thread decodes them into the arena buffers (zstd and numpy release the GIL).  At most
``_STAGING_SLOTS`` slots are in use at once (a FIFO weighted limiter hands them out; a staged
load or write batch takes at most ``_STAGED_BATCH_KEYS``).  An object the stage refuses
(damaged, unknown, another tenant's) is a miss, counted in ``stats.codec_misses``; objects
are immutable, so the tier remembers the key as bad (a probe stops there) until its writer
has removed the object and stored a good one.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from ..codec import ChunkStage
from ..codec.stage import Decodes
from ..memory import Arena, Buffer
from .mooncake_store import INVALID_PARAMS, MooncakeStore

__all__ = [
    "close_store",
    "encode_put",
    "exist",
    "get_decoded",
    "get_into",
    "new_store",
    "put_from",
    "remove",
    "slot_address",
]


def exist(store: MooncakeStore, names: list[str]) -> list[int]:
    return list(store.batch_is_exist(names))


def get_into(
    store: MooncakeStore, names: list[str], addresses: list[int], sizes: list[int]
) -> list[int]:
    """Read each object into its buffer (the thread that writes arena memory)."""
    return list(store.batch_get_into(names, addresses, sizes))


def get_decoded(
    store: MooncakeStore,
    names: list[str],
    addresses: list[int],
    sizes: list[int],
    bufs: Sequence[Buffer],
    staged: Sequence[Buffer] | None,
    stage: ChunkStage,
    key_names: list[bytes],
    tenant: bytes,
) -> tuple[list[int], Decodes]:
    """Get each object (into the ``staged`` buffers, or straight into ``bufs``), then decode
    each one got into its buffer, in order, until one is refused (the thread that writes
    arena memory: never abandoned); Mooncake's result per key, and what the decoding did."""
    results = get_into(store, names, addresses, sizes)
    done = Decodes(stage)
    for i, rc in enumerate(results):
        if not 0 < rc <= sizes[i]:
            break
        with bufs[i].slot() as slot:
            if staged is None:  # the object is in the slot already (maybe encoded elsewhere)
                ok = done.in_place(slot, rc, key_name=key_names[i], tenant=tenant)
            else:
                with staged[i].slot() as stored:
                    ok = done.into(stored[:rc], slot, key_name=key_names[i], tenant=tenant)
        if not ok:
            break
    return results, done


def encode_put(
    store: MooncakeStore,
    names: list[str],
    addresses: list[int],
    sizes: list[int],
    bufs: Sequence[Buffer],
    staged: Sequence[Buffer],
    stage: ChunkStage,
    key_names: list[bytes],
    tenants: list[bytes],
) -> tuple[list[int], list[int], float]:
    """Encode each buffer's payload into its staging buffer and put them all from there (the
    thread that reads arena memory: never abandoned); Mooncake's result per key (an encoding
    larger than its staging slot is not put: ``INVALID_PARAMS``), the stored bytes of each
    (-1 for those), and the seconds encoding took."""
    t0 = time.perf_counter()
    lengths: list[int] = []
    for buf, dest, key_name, tenant in zip(bufs, staged, key_names, tenants, strict=True):
        with buf.view() as payload:
            stored = stage.encode(payload, key_name=key_name, tenant=tenant)
        n = memoryview(stored).nbytes
        if n > dest.capacity:
            lengths.append(-1)
            continue
        dest.write(stored)
        lengths.append(n)
    seconds = time.perf_counter() - t0
    fits = [i for i, n in enumerate(lengths) if n > 0]
    put = (
        put_from(
            store,
            [names[i] for i in fits],
            [addresses[i] for i in fits],
            [lengths[i] for i in fits],
        )
        if fits
        else []
    )
    results = [INVALID_PARAMS] * len(names)
    for i, rc in zip(fits, put, strict=False):
        results[i] = rc
    return results, lengths, seconds


def put_from(
    store: MooncakeStore, names: list[str], addresses: list[int], sizes: list[int]
) -> list[int]:
    """Store each object from its buffer (the thread that reads arena memory)."""
    return list(store.batch_put_from(names, addresses, sizes))


def remove(store: MooncakeStore, name: str) -> int:
    return int(store.remove(name))


def slot_address(buf: Buffer) -> int:
    return buf.arena.address + buf.index * buf.capacity


def close_store(store: MooncakeStore, arenas: Sequence[Arena]) -> None:
    """(Worker thread.)  Unregister the arenas and close the client (unmounting its segment:
    the objects in it are gone from the pool)."""
    for arena in arenas:
        try:
            store.unregister_buffer(arena.address)
        except ValueError:  # the arena was closed first: its memory is no longer ours
            pass
    store.close()


def new_store() -> MooncakeStore:
    """A client of the installed Mooncake (``mooncake-transfer-engine``), not set up yet."""
    from mooncake.store import MooncakeDistributedStore

    store: MooncakeStore = MooncakeDistributedStore()
    return store
