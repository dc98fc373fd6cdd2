"""WorkerRuntime: the engine's sync API on a background Trio thread."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from lmprefetch import PrefetchConfig, WorkerRuntime

CHUNK = 4


@pytest.fixture
def config() -> PrefetchConfig:
    return PrefetchConfig(chunk_size=CHUNK, chunk_bytes=64, cpu_bytes=64 * 32)


def test_store_lookup_claim_cancel_stats(config: PrefetchConfig) -> None:
    with WorkerRuntime.start(config) as rt:
        toks = list(range(12))
        assert rt.store(toks, [b"a" * 8, b"b" * 8, b"c" * 8]) == 3
        hashes = rt.call(rt.engine.hasher.hash, toks)
        assert rt.lookup_and_prefetch("x", hashes, [CHUNK] * 3) == 12
        assert rt.statistics().engine.lookups.held == 1
        with rt.claim("x") as chunks:
            assert [bytes(b.view()) for _, b in chunks] == [b"a" * 8, b"b" * 8, b"c" * 8]
            assert rt.statistics().engine.lookups.held == 0
        with rt.claim("x") as chunks:
            assert chunks == []
        rt.lookup_and_prefetch("y", hashes, [CHUNK] * 3)
        rt.cancel("y")
        rt.cancel("y")
        assert rt.is_idle()


def test_claimed_buffers_are_released_from_the_callers_thread(config: PrefetchConfig) -> None:
    with WorkerRuntime.start(config) as rt:
        toks = list(range(8))
        rt.store(toks, [b"z" * 8] * 2)
        hashes = rt.call(rt.engine.hasher.hash, toks)
        rt.lookup_and_prefetch("x", hashes, [CHUNK] * 2)
        result: list[bool] = []

        def model_step() -> None:
            with rt.claim("x") as chunks:
                result.append(len(chunks) == 2)

        t = threading.Thread(target=model_step)
        t.start()
        t.join()
        assert result == [True]
        assert rt.is_idle()


def test_store_errors_propagate_and_store_nowait(config: PrefetchConfig) -> None:
    with WorkerRuntime.start(config) as rt:
        with pytest.raises(ValueError, match=r"payloads\[0\]"):
            rt.store(list(range(4)), [b"x" * 65])
        fut = rt.store_nowait(list(range(8)), [b"q" * 8] * 2)
        assert fut.result(timeout=10) == 2


def test_close_is_idempotent_and_use_after_close_raises(config: PrefetchConfig) -> None:
    rt = WorkerRuntime.start(config)
    rt.close()
    rt.close()
    rt.cancel("anything")  # a no-op once closed
    with pytest.raises(RuntimeError, match="closed"):
        rt.store([1, 2, 3, 4], [b"x"])
    with pytest.raises(RuntimeError, match="closed"), rt.claim("x"):
        pass


def test_engine_restart_finds_chunks_on_disk(config: PrefetchConfig, tmp_path: Path) -> None:
    cfg = config.replace(disk_path=str(tmp_path))
    toks = list(range(16))
    data = [bytes([i]) * 8 for i in range(4)]
    with WorkerRuntime.start(cfg) as rt:
        assert rt.store(toks, data) == 4
    # close() flushed the write-behind; a new engine finds the chunks on disk.
    with WorkerRuntime.start(cfg) as rt:
        hashes = rt.call(rt.engine.hasher.hash, toks)
        assert rt.statistics().engine.cpu_resident_chunks == 0
        assert rt.lookup_and_prefetch("r", hashes, [CHUNK] * 4) == 16
        with rt.claim("r") as chunks:
            assert [bytes(b.view()) for _, b in chunks] == data
        assert rt.statistics().engine.tier("disk").chunks_loaded == 4


def test_bad_endpoint_arguments(config: PrefetchConfig) -> None:
    with pytest.raises(ValueError, match="go together"):
        WorkerRuntime.start(config, request_endpoint="ipc://@x")
    with pytest.raises(ValueError, match="endpoint"):
        WorkerRuntime.start(config, request_endpoint="http://x", response_endpoint="ipc://@y")


def test_store_hashes_nowait(config: PrefetchConfig) -> None:
    with WorkerRuntime.start(config) as rt:
        hashes = rt.call(rt.engine.hasher.hash, list(range(8)))
        assert rt.store_hashes_nowait(hashes, [b"1" * 8, b"2" * 8]).result(timeout=10) == 2
        assert rt.lookup_and_prefetch("h", hashes, [CHUNK, CHUNK]) == 8
        rt.cancel("h")
