"""``ChunkHasher.from_config`` and ``KeyMaker.from_config``: one place turns a configuration into
hashes and keys, and every component that hashes or makes keys uses it (a component that built
its own and dropped a setting would hash differently from the others: every lookup a miss)."""

from __future__ import annotations

import os
import threading
from dataclasses import asdict
from multiprocessing import Pipe
from typing import Any

import pytest

from lmprefetch import LookupClient, PrefetchConfig, open_engine
from lmprefetch.bench.processes import worker_main
from lmprefetch.bench.workload import BenchOptions, make_workload
from lmprefetch.hashing import ChunkHasher
from lmprefetch.keys import KeyMaker

#: Every hashing setting away from its default.
UNUSUAL = PrefetchConfig(
    chunk_size=16,
    hash_algorithm="sha256",
    save_partial_chunks=True,
    model_name="org/model",
    kv_dtype="float16",
    layerwise=True,
    num_layers=3,
    chunk_bytes=3 * 64,
    cpu_bytes=3 * 64 * 64,
)


def test_the_hasher_carries_every_hashing_setting() -> None:
    hasher = ChunkHasher.from_config(UNUSUAL)
    assert (hasher.chunk_size, hasher.algorithm, hasher.save_partial_chunks) == (
        16, "sha256", True,
    )  # fmt: skip
    tokens = list(range(40))  # 2.5 chunks: the partial one is hashed too
    assert hasher.hash(tokens) == ChunkHasher(16, "sha256", save_partial_chunks=True).hash(tokens)
    assert len(hasher.hash(tokens)) == 3


def test_the_key_maker_carries_every_key_setting() -> None:
    keys = KeyMaker.from_config(UNUSUAL, rank=1, world_size=2).keys([7])
    assert [tuple(k) for k in keys] == [("org/model", 2, 1, 7, "float16", layer) for layer in
                                        range(3)]  # fmt: skip
    with pytest.raises(ValueError, match="rank"):
        KeyMaker.from_config(UNUSUAL, rank=2, world_size=2)


async def test_the_engine_and_its_event_tracker_hash_and_key_as_configured() -> None:
    async with open_engine(UNUSUAL, rank=1, world_size=2, kv_events="chunks") as engine:
        assert engine.hasher.hash(list(range(40))) == ChunkHasher.from_config(UNUSUAL).hash(
            list(range(40))
        )
        want = KeyMaker.from_config(UNUSUAL, rank=1, world_size=2).keys([5, 6])
        assert engine.keys.keys([5, 6]) == want
        assert engine.kv_events is not None
        assert engine.kv_events._keys.keys([5, 6]) == want


def test_the_bench_workers_store_what_the_client_looks_up() -> None:
    """``lmprefetch bench`` workers preload the workload's histories: with
    ``save_partial_chunks`` they must store the trailing partial chunk too, as the client
    (the bridge) hashes it; they used to hash with the default and store one chunk less per
    history."""
    config = PrefetchConfig(
        chunk_size=16, save_partial_chunks=True, chunk_bytes=256, cpu_bytes=256 * 256,
        arena_prefault_bytes=0,
    )  # fmt: skip
    opts = BenchOptions(
        workers=1, conversations=4, cold_ratio=0.0, turns=2, system_tokens=40, turn_tokens=20,
        chunk_size=16, chunk_bytes=256, cpu_bytes=256 * 256, progress=False,
    )  # fmt: skip
    expected = sum(
        ChunkHasher.from_config(config).num_chunks(len(h)) for h in make_workload(opts).stored
    )
    assert expected > sum(len(h) // 16 for h in make_workload(opts).stored)  # partial chunks
    tag = f"{os.getpid()}-{threading.get_ident()}"
    request, response = f"ipc://@lmprefetch-fc-{tag}-req", f"ipc://@lmprefetch-fc-{tag}-resp"
    parent, child = Pipe()
    worker = threading.Thread(
        target=worker_main,
        args=(child, config.to_dict(), 0, 1, request, response, asdict(opts)),
        daemon=True,
    )
    # A client bound to the response endpoint, as in a real run (the worker connects to it).
    client = LookupClient(config, [request], response)
    worker.start()
    try:
        assert parent.poll(120), "the worker did not get ready"
        tag_, info = parent.recv()
        assert tag_ == "ready"
        assert info["stored_chunks"] == expected
        history = make_workload(opts).stored[0]
        assert client.lookup("h", history) is None
        got: Any = client.wait("h", 60)
        assert got == len(history)  # every token, the partial chunk's included
    finally:
        parent.send(("stop", None))
        assert parent.poll(120)
        assert parent.recv()[0] == "closed"
        worker.join(60)
        client.close()
    assert not worker.is_alive()
