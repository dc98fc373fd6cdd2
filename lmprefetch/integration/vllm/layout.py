"""The paged KV cache seen as rows of bytes: how a chunk's payload is cut out of vLLM's KV
tensors and put back (the only torch-heavy part of the connector)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ...config import KV_DTYPES


# -- the paged KV cache, seen as rows of bytes ----------------------------------------------
@dataclass
class _Layer:
    name: str
    #: A view of vLLM's tensor, ``[num_blocks, *row]``, as the widest integer words
    #: (int64 where sizes and offsets allow) so copies move words, not bytes.
    rows: torch.Tensor
    row_bytes: int
    word: torch.dtype


class PagedKVLayout:
    """vLLM's per-layer KV tensors as block-major rows of bytes, and the chunk payload codec.

    Whatever layout vLLM hands over (block dimension first — vLLM 0.32's logical
    ``[B, H, N, C]`` views, possibly strided into one shared buffer, possibly split into
    kernel blocks — or a legacy ``[2, B, …]`` layout), each layer becomes a ``uint8`` view
    ``[num_blocks, *row]`` of the same memory, so copies are plain byte copies for every dtype.

    Args:
        kv_caches: layer name → KV tensor, as given to ``register_kv_caches``.
        num_blocks: vLLM's number of (manager) blocks.
        block_size: tokens per block.
    """

    def __init__(self, kv_caches: Mapping[str, torch.Tensor], num_blocks: int, block_size: int):
        if not kv_caches:
            raise ValueError("register_kv_caches: no KV cache tensors")
        if num_blocks < 1:
            raise ValueError(f"num_blocks: must be at least 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.layers: list[_Layer] = []
        seen: set[tuple[int, tuple[int, ...], tuple[int, ...]]] = set()
        dtypes: set[torch.dtype] = set()
        devices: set[torch.device] = set()
        for name in sorted(kv_caches):
            tensor = kv_caches[name]
            identity = (tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()))
            if identity in seen:  # a layer sharing another layer's KV cache
                continue
            seen.add(identity)
            rows = _block_major_words(tensor, num_blocks, name)
            row_bytes = math.prod(rows.shape[1:]) * rows.element_size()
            self.layers.append(_Layer(name, rows, row_bytes, rows.dtype))
            dtypes.add(tensor.dtype)
            devices.add(tensor.device)
        if len(devices) != 1:
            raise ValueError(f"register_kv_caches: KV tensors on several devices: {devices}")
        self.device: torch.device = devices.pop()
        self.dtype: torch.dtype | None = dtypes.pop() if len(dtypes) == 1 else None
        self.row_bytes = sum(layer.row_bytes for layer in self.layers)
        # Where each layer's rows start within a one-row payload.
        self._row_offsets: list[int] = []
        offset = 0
        for layer in self.layers:
            self._row_offsets.append(offset)
            offset += layer.row_bytes

    @property
    def kv_dtype_name(self) -> str | None:
        """The KV dtype as a :data:`~lmprefetch.config.KV_DTYPES` name, if uniform and known."""
        if self.dtype is None:
            return None
        name = str(self.dtype).removeprefix("torch.")
        return name if name in KV_DTYPES else None

    def payload_bytes(self, rows: int) -> int:
        """Size of a payload of ``rows`` blocks."""
        return rows * self.row_bytes

    def extract(
        self, chunks: Sequence[Sequence[int]], out: torch.Tensor | None = None
    ) -> list[torch.Tensor]:
        """Copy the payload of each chunk out of the paged cache.

        Args:
            chunks: for each chunk, its block ids in token order.
            out: a reusable ``uint8`` CPU staging tensor of at least the payloads' total size
                (saves a fresh allocation and its page faults per call); by default a new one.

        Returns:
            One contiguous ``uint8`` CPU tensor per chunk, views into ``out`` (valid until
            ``out`` is reused).

        Raises:
            ValueError: ``out`` is too small or not a CPU ``uint8`` tensor.
        """
        sizes = [self.payload_bytes(len(ids)) for ids in chunks]
        total = sum(sizes)
        if out is not None and (
            out.dtype != torch.uint8 or out.device.type != "cpu" or out.numel() < total
        ):
            raise ValueError(f"extract: out must be a CPU uint8 tensor of {total}+ bytes")
        on_cpu = self.device.type == "cpu"
        if out is not None and on_cpu:
            work = out[:total]
        else:
            work = torch.empty(total, dtype=torch.uint8, device=self.device)
        offset = 0
        for ids, size in zip(chunks, sizes, strict=True):
            n = len(ids)
            if n:
                index = torch.tensor(list(ids), dtype=torch.long, device=self.device)
                runs = _runs(ids)
                for layer, row_offset in zip(self.layers, self._row_offsets, strict=True):
                    start = offset + n * row_offset
                    dst = work[start : start + n * layer.row_bytes].view(layer.word)
                    dst = dst.view(n, *layer.rows.shape[1:])
                    if runs is None:
                        torch.index_select(layer.rows, 0, index, out=dst)
                    else:
                        for first, i, k in runs:
                            dst[i : i + k].copy_(layer.rows[first : first + k])
            offset += size
        if not on_cpu:
            host = out[:total] if out is not None else torch.empty(total, dtype=torch.uint8)
            host.copy_(work)
            work = host
        parts: list[torch.Tensor] = []
        offset = 0
        for size in sizes:
            parts.append(work[offset : offset + size])
            offset += size
        return parts

    def inject(
        self, parts: Sequence[Any], row_lo: int, row_hi: int, block_ids: Sequence[int]
    ) -> None:
        """Copy rows ``[row_lo, row_hi)`` of one chunk's payload into ``block_ids``.

        Args:
            parts: the payload as bytes-like parts (one, or one per layer in layerwise mode),
                whose concatenation is the payload; each layer's rows lie within one part.
            row_lo: the first row (block of the chunk) to copy.
            row_hi: the row after the last one to copy.
            block_ids: the destination block of each row, ``row_hi - row_lo`` of them.

        Raises:
            ValueError: the payload does not have the size of a whole number of rows, holds
                fewer than ``row_hi`` rows, or splits a layer across parts.

        The copy is issued on the current stream for device caches; synchronise before the
        payload's memory is released.
        """
        n = row_hi - row_lo
        if n != len(block_ids):
            raise ValueError(f"inject: {n} rows for {len(block_ids)} blocks")
        views = [memoryview(p).cast("B") for p in parts]
        total = sum(v.nbytes for v in views)
        rows, rest = divmod(total, self.row_bytes)
        if rest or rows < row_hi:
            raise ValueError(
                f"payload of {total} bytes is not {row_hi} or more rows of {self.row_bytes} bytes"
            )
        if n <= 0:
            return
        runs = _runs(block_ids)
        index = torch.tensor(list(block_ids), dtype=torch.long, device=self.device)
        part_starts = []
        acc = 0
        for v in views:
            part_starts.append(acc)
            acc += v.nbytes
        tensors: dict[int, torch.Tensor] = {}
        for layer, row_offset in zip(self.layers, self._row_offsets, strict=True):
            seg_start = rows * row_offset + row_lo * layer.row_bytes
            seg_end = seg_start + n * layer.row_bytes
            p = _part_index(part_starts, seg_start)
            if seg_end > part_starts[p] + views[p].nbytes:
                raise ValueError(f"payload part {p} splits layer {layer.name!r}")
            src_all = tensors.get(p)
            if src_all is None:
                src_all = tensors[p] = torch.frombuffer(views[p], dtype=torch.uint8)
            base = part_starts[p]
            src = src_all[seg_start - base : seg_end - base].view(layer.word)
            src = src.view(n, *layer.rows.shape[1:])
            if layer.rows.device.type != "cpu":
                src = src.to(layer.rows.device, non_blocking=True)
            if runs is None:
                layer.rows.index_copy_(0, index, src)
            else:
                for first, i, k in runs:
                    layer.rows[first : first + k].copy_(src[i : i + k])

    def inject_rows(
        self, parts: Sequence[Any], rows: Sequence[int], block_ids: Sequence[int]
    ) -> None:
        """Copy row ``rows[i]`` of one payload into block ``block_ids[i]``, for every ``i``
        (rows in any order, a row into several blocks): :meth:`inject` per run of consecutive
        rows going to consecutive positions of the lists.

        Raises:
            ValueError: as :meth:`inject`, or the lists differ in length.
        """
        if len(rows) != len(block_ids):
            raise ValueError(f"inject_rows: {len(rows)} rows for {len(block_ids)} blocks")
        i = 0
        while i < len(rows):
            j = i + 1
            while j < len(rows) and rows[j] == rows[j - 1] + 1:
                j += 1
            self.inject(parts, rows[i], rows[j - 1] + 1, block_ids[i:j])
            i = j

    def synchronize(self) -> None:
        """Wait for copies issued on the device's current stream (no-op on CPU)."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()


def _part_index(starts: Sequence[int], offset: int) -> int:
    index = 0
    for i, start in enumerate(starts):
        if start <= offset:
            index = i
    return index


def _runs(block_ids: Sequence[int]) -> list[tuple[int, int, int]] | None:
    """``block_ids`` as ``(first block, first row, length)`` runs of consecutive blocks, when
    there are few enough runs that one slice copy per run beats one indexed copy (a fresh
    request's blocks are often consecutive); else ``None``."""
    runs: list[tuple[int, int, int]] = []
    limit = max(1, len(block_ids) // 4)
    for i, block in enumerate(block_ids):
        if runs and runs[-1][0] + runs[-1][2] == block:
            first, row, k = runs[-1]
            runs[-1] = (first, row, k + 1)
        else:
            if len(runs) == limit:
                return None
            runs.append((block, i, 1))
    return runs


_WORDS = ((8, torch.int64), (4, torch.int32), (2, torch.int16))


def _block_major_words(tensor: torch.Tensor, num_blocks: int, name: str) -> torch.Tensor:
    """``tensor`` as a view ``[num_blocks, *row]`` of the widest integer words its sizes,
    strides and offset allow (``uint8`` at worst), sharing its memory."""
    shape = tuple(tensor.shape)
    if not shape:
        raise ValueError(f"KV cache of layer {name!r} is a scalar")
    if shape[0] == num_blocks:
        view = tensor
    elif shape[0] > num_blocks and shape[0] % num_blocks == 0:
        # vLLM split each manager block into kernel blocks: group them back.
        view = tensor.unflatten(0, (num_blocks, shape[0] // num_blocks))
    else:
        dims = [d for d, size in enumerate(shape) if size == num_blocks]
        if len(dims) > 1 and shape[0] == 2 and 1 in dims:
            dims = [1]  # [2 (K/V), num_blocks, ...] layouts
        if len(dims) != 1:
            raise ValueError(
                f"KV cache of layer {name!r} has shape {shape}; cannot tell which dimension "
                f"holds the {num_blocks} blocks"
            )
        view = tensor.movedim(dims[0], 0)
    if view.stride(-1) != 1:
        raise ValueError(f"KV cache of layer {name!r}: the innermost dimension is not contiguous")
    as_bytes = view.view(torch.uint8)
    for size, word in _WORDS:
        if (
            as_bytes.storage_offset() % size == 0
            and all(st % size == 0 for st in as_bytes.stride()[:-1])
            and as_bytes.shape[-1] % size == 0
        ):
            return as_bytes.view(word)
    return as_bytes
