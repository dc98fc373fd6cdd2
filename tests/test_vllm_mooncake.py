"""Two vLLM OpenAI servers (CPU build) sharing one Mooncake master: each serves the prompts only
the other one computed, from Mooncake.

The servers run lmprefetch's connector with the CPU and Mooncake tiers; vLLM's own prefix cache
is off, so every cached token a response reports was served by lmprefetch, and the first
server's CPU tier is not the second's: the tokens came from Mooncake (each server also gives
the pool 32 MiB, so the chunks one stores live in its own memory and the other reads them from
there over TCP).  Like every Mooncake test it runs in a private network namespace
(tests/mooncake_servers.py); ``nox -s vllm`` runs it so.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import trio

pytest.importorskip("vllm")
pytest.importorskip("httpx")

from lmprefetch.hashing import ChunkHasher
from lmprefetch.keys import ChunkKey
from lmprefetch.tiers.mooncake import mooncake_key

from .mooncake_servers import MooncakeMaster, needs_mooncake
from .mooncake_servers import mooncake_master_fixture as mooncake_master_fixture
from .vllm_servers import (
    CHUNK,
    P2,
    P3,
    connector_config,
    vllm_servers,
    whole_chunks,
)

pytestmark = [pytest.mark.vllm, *needs_mooncake]


async def landed(master: str, prompt: Sequence[int]) -> None:
    """Wait until Mooncake holds every whole chunk of ``prompt`` (writes are write-behind),
    asking as a client of its own that gives the pool nothing."""
    from mooncake.store import MooncakeDistributedStore

    names = [
        mooncake_key(ChunkKey("bench", 1, 0, h, "float32"))
        for h in ChunkHasher(CHUNK).hash(list(prompt))
    ]
    client = MooncakeDistributedStore()
    rc = await trio.to_thread.run_sync(
        client.setup, "127.0.0.1", "P2PHANDSHAKE", 0, 0, "tcp", "", master
    )
    assert rc == 0
    try:
        with trio.fail_after(120):
            while True:
                found = await trio.to_thread.run_sync(client.batch_is_exist, names)
                if list(found) == [1] * len(names):
                    return
                await trio.sleep(0.05)
    finally:
        await trio.to_thread.run_sync(client.close)


async def test_two_servers_sharing_one_mooncake_master_serve_each_others_prompts(
    tmp_path: Path, mooncake_master: MooncakeMaster
) -> None:
    config = connector_config(
        mooncake_master=mooncake_master.address,
        mooncake_segment_bytes=32 << 20,
        model_name="bench",
        kv_dtype="float32",
    )
    async with vllm_servers(tmp_path, [config, config]) as (a, b):
        first_a = await a.complete(P2)
        await landed(mooncake_master.address, P2)
        from_mooncake_b = await b.complete(P2)
        first_b = await b.complete(P3)
        await landed(mooncake_master.address, P3)
        from_mooncake_a = await a.complete(P3)

    assert first_a.cached_tokens == 0 and first_b.cached_tokens == 0
    # Each server serves the prompt only the other one computed, from Mooncake: every whole
    # chunk, and the same tokens.
    assert from_mooncake_b.cached_tokens == whole_chunks(P2)
    assert from_mooncake_a.cached_tokens == whole_chunks(P3)
    assert from_mooncake_b.output_ids == first_a.output_ids
    assert from_mooncake_a.output_ids == first_b.output_ids
