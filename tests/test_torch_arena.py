"""The torch buffer backend (the ``torch`` extra): buffers are views of one uint8 tensor."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from lmprefetch import PrefetchConfig, open_engine  # noqa: E402
from lmprefetch.memory import Arena, DoubleReleaseError  # noqa: E402

pytestmark = pytest.mark.torch


def test_torch_arena_buffers_are_tensor_views() -> None:
    arena = Arena(64, 4, backend="torch")
    buf = arena.allocate()
    assert buf is not None
    buf.write(b"\x01\x02\x03")
    t = buf.tensor()
    assert t.dtype == torch.uint8 and t.tolist() == [1, 2, 3]
    t[0] = 9  # the tensor and the memoryview share memory
    assert bytes(buf.view()) == b"\x09\x02\x03"
    assert t.is_pinned() == torch.cuda.is_available()
    buf.release()
    assert arena.free_slots == 4
    with pytest.raises(DoubleReleaseError, match=r"used after its last release"):
        buf.tensor()


async def test_engine_with_torch_buffers_takes_tensor_payloads() -> None:
    config = PrefetchConfig(chunk_size=4, chunk_bytes=64, cpu_bytes=64 * 16, buffer_backend="torch")
    async with open_engine(config) as engine:
        toks = list(range(8))
        payloads = [torch.arange(16, dtype=torch.float16) + i for i in range(2)]
        assert await engine.store(toks, payloads) == 2
        assert await engine.lookup_and_prefetch("t", engine.hasher.hash(toks), [4, 4]) == 8
        with engine.claim("t") as chunks:
            for (_, buf), expected in zip(chunks, payloads):
                assert torch.equal(buf.tensor().view(torch.float16), expected)


def test_each_buffer_is_its_own_slot_of_the_tensor() -> None:
    arena = Arena(64, 3, backend="torch")
    bufs = [arena.allocate() for _ in range(3)]
    for i, buf in enumerate(bufs):
        assert buf is not None
        buf.write(bytes([i + 1]) * (10 + i))
    for i, buf in enumerate(bufs):
        assert buf is not None
        assert buf.tensor().tolist() == [i + 1] * (10 + i)
        buf.release()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float8_e4m3fn", "float32"])
async def test_tensors_of_any_kv_dtype_are_stored_as_their_bytes(dtype: str) -> None:
    """numpy has no bfloat16 or fp8: a tensor is stored as its raw bytes, whatever its dtype."""
    config = PrefetchConfig(chunk_size=4, chunk_bytes=64, cpu_bytes=64 * 16)
    async with open_engine(config) as engine:
        toks = list(range(8))
        payloads = [(torch.arange(8, dtype=torch.float32) * (i + 1)).to(getattr(torch, dtype))
                    for i in range(2)]  # fmt: skip
        assert await engine.store(toks, payloads) == 2
        assert await engine.lookup_and_prefetch("t", engine.hasher.hash(toks), [4, 4]) == 8
        with engine.claim("t") as chunks:
            for (_, buf), expected in zip(chunks, payloads):
                assert bytes(buf.view()) == expected.view(torch.uint8).numpy().tobytes()
