"""LMCache 0.5.6 beside lmprefetch: the engine benchmark's workload, both measured in one run.

    python examples/bench_lmcache_peer.py [--chunks 16] [--chunk-bytes 2097152] [--repeats 50]
                                          [--json]

Runs only where ``lmcache`` is importable (``nox -s lmcache`` installs it); elsewhere it says so
and exits 0.  Workload (the same as ``lmprefetch bench-engine``): 16 chunks × 2 MiB per lookup;
a CPU hit, a disk hit (files in the page cache), a full miss, and 8 concurrent disk lookups of
8 different prompts; the median over ``--repeats`` (``max(3, repeats // 5)`` for the 8-way case).

What is measured on the LMCache side (CPU only: no vLLM, no GPU, no ZeroMQ):

* a real ``LMCacheEngine`` from ``LMCacheEngineBuilder.get_or_create`` with
  ``enable_async_loading=True``, ``local_cpu=True`` and a ``LocalDiskBackend`` on a temporary
  directory (``max_local_cpu_size`` / ``max_local_disk_size`` sized like lmprefetch's arena and
  disk tier; LMCache's default 4 disk I/O threads, lmprefetch's ``disk_read_threads=4``);
  ``post_init(async_lookup_server=…)`` gets a stand-in that records when
  ``send_response_to_scheduler`` is called;
* one lookup = what ``LMCacheAsyncLookupServer`` does on a ``LookupRequestMsg``:
  ``engine.async_lookup_and_prefetch(lookup_id, hashes=…, offsets=…, pin=True)`` (keys built
  from the hashes, the coroutine handed to the storage manager's event-loop thread: contains on
  each tier, loads through the async serializer, the all-done callback) **until the storage
  manager calls** ``send_response_to_scheduler`` (the answer; the time is taken inside that call,
  so the hop back to the benchmark's thread is not counted), **plus the release**,
  ``engine.cleanup_memory_objs(lookup_id)`` (what a ``LookupCleanupMsg`` does; timed on the
  calling thread);
* chunks are put with ``StorageManager.batched_put`` (CPU) and the disk backend's
  ``batched_submit_put_task`` (``LMCacheEngine.store`` needs a GPU connector); a disk hit is
  made by force-removing the prompt's keys from the ``LocalCPUBackend`` hot cache;
* LMCache's logging is set to WARNING (``LMCACHE_LOG_LEVEL``; its INFO line per answer would
  cost it time) and usage telemetry is off (``LMCACHE_TRACK_USAGE=false``, ``DO_NOT_TRACK=1``).

lmprefetch's side is :func:`lmprefetch.bench.engine.run`: ``Engine.lookup_and_prefetch`` plus
the ``claim`` block that releases the result, on the same machine in the same process.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

MiB = 1024 * 1024
GiB = 1024 * MiB
CHUNK_TOKENS = 256
#: How long one LMCache answer may take before the benchmark gives up (seconds).
ANSWER_TIMEOUT_S = 60.0

CASES = (
    ("cpu_hit", "CPU hit"),
    ("disk_hit", "disk hit (page cache)"),
    ("miss", "full miss"),
    ("disk_x8", "8 concurrent disk lookups"),
)


def _quiet_lmcache() -> None:
    """No usage telemetry, and WARNING logs; LMCache reads these when first imported."""
    for name, value in (
        ("LMCACHE_TRACK_USAGE", "false"),
        ("DO_NOT_TRACK", "1"),
        ("LMCACHE_LOG_LEVEL", "WARNING"),
    ):
        os.environ.setdefault(name, value)


def _lmcache_available() -> bool:
    _quiet_lmcache()
    try:
        import lmcache.v1.cache_engine  # noqa: F401
    except ImportError:
        return False
    return True


class _AnswerRecorder:
    """Stands in for ``LMCacheAsyncLookupServer``: the storage manager calls
    ``send_response_to_scheduler`` from its event-loop thread when a lookup is answered."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: dict[str, threading.Event] = {}
        self.answered_at: dict[str, float] = {}
        self.hit_tokens: dict[str, int] = {}

    def expect(self, lookup_id: str) -> threading.Event:
        with self._lock:
            event = self._events[lookup_id] = threading.Event()
        return event

    def send_response_to_scheduler(self, lookup_id: str, num_hit_tokens: int) -> None:
        now = time.perf_counter()
        with self._lock:
            self.answered_at[lookup_id] = now
            self.hit_tokens[lookup_id] = num_hit_tokens
            event = self._events.get(lookup_id)
        if event is not None:
            event.set()


def run_lmcache(chunks: int, chunk_bytes: int, repeats: int) -> dict[str, Any]:
    """Measure LMCache 0.5.6's async lookup + prefetch (see the module docstring)."""
    _quiet_lmcache()
    import torch
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.memory_management import MemoryFormat
    from lmcache.v1.metadata import LMCacheMetadata

    # One chunk = KV_2LTD [2, layers=1, 256 tokens, hidden] in bf16 = chunk_bytes.
    if chunk_bytes % (2 * CHUNK_TOKENS * 2):
        raise ValueError(f"chunk_bytes must be a multiple of {2 * CHUNK_TOKENS * 2}")
    hidden = chunk_bytes // (2 * CHUNK_TOKENS * 2)
    shape = torch.Size([2, 1, CHUNK_TOKENS, hidden])
    dtype = torch.bfloat16
    instance_id = f"lmprefetch-peer-bench-{os.getpid()}"
    out: dict[str, Any] = {"chunks": chunks, "chunk_bytes": chunk_bytes, "repeats": repeats}

    with tempfile.TemporaryDirectory(prefix="lmcache-peer-bench-") as tmp:
        config = LMCacheEngineConfig.from_defaults(
            chunk_size=CHUNK_TOKENS,
            local_cpu=True,
            max_local_cpu_size=max(GiB, 20 * chunks * chunk_bytes) / GiB,
            local_disk=f"file://{tmp}/",
            max_local_disk_size=64 * chunks * chunk_bytes / GiB,
            enable_async_loading=True,
            lmcache_instance_id=instance_id,
        )
        metadata = LMCacheMetadata(
            model_name="bench",
            world_size=1,
            local_world_size=1,
            worker_id=0,
            local_worker_id=0,
            kv_dtype=dtype,
            kv_shape=(1, 2, CHUNK_TOKENS, 1, hidden),
            role="worker",
            engine_id=instance_id,
        )
        answers = _AnswerRecorder()
        engine = LMCacheEngineBuilder.get_or_create(
            instance_id,
            config,
            metadata,
            None,  # no GPU connector: nothing is stored or retrieved through the GPU
            lambda tensor, src: None,
            lambda obj, src: obj,
        )
        try:
            engine.post_init(async_lookup_server=answers)
            sm = engine.storage_manager
            assert sm is not None, "LMCache built no storage manager"
            cpu = sm.storage_backends["LocalCPUBackend"]
            disk = sm.storage_backends["LocalDiskBackend"]
            db = engine.token_database

            def chunk_hashes(prompt: int) -> tuple[list[int], list[int], list[Any]]:
                tokens = [prompt * 10_000_000 + t for t in range(chunks * CHUNK_TOKENS)]
                triples = list(db.process_tokens(tokens=tokens, make_key=False))
                hashes = [int(h) for _, _, h in triples]
                offsets = [end - start for start, end, _ in triples]
                keys = [k for _, _, k in db.process_tokens(hashes=hashes, offsets=offsets)]
                return hashes, offsets, keys

            prompts = [chunk_hashes(i) for i in range(9)]
            payload = torch.frombuffer(bytearray(os.urandom(chunk_bytes)), dtype=torch.uint8)
            written = threading.Semaphore(0)
            n_written = 0
            for _, _, keys in prompts:
                objs = []
                for _ in keys:
                    obj = sm.allocate(shape, dtype, MemoryFormat.KV_2LTD)
                    assert obj is not None, "LMCache's CPU pool is full"
                    obj.tensor.view(-1).view(torch.uint8).copy_(payload)
                    objs.append(obj)
                disk.batched_submit_put_task(
                    keys, objs, on_complete_callback=lambda key: written.release()
                )
                sm.batched_put(keys, objs, location="LocalCPUBackend")
                n_written += len(keys)
            deadline = time.monotonic() + ANSWER_TIMEOUT_S
            for _ in range(n_written):
                if not written.acquire(timeout=max(0.0, deadline - time.monotonic())):
                    raise TimeoutError("LMCache did not finish writing the disk tier")

            def submit(lookup_id: str, prompt: tuple[list[int], list[int], Any]) -> None:
                engine.async_lookup_and_prefetch(
                    lookup_id=lookup_id, hashes=prompt[0], offsets=prompt[1], pin=True
                )

            def wait(lookup_id: str, event: threading.Event) -> None:
                if not event.wait(ANSWER_TIMEOUT_S):
                    raise TimeoutError(f"LMCache did not answer lookup {lookup_id}")

            def one(lookup_id: str, prompt: Any) -> tuple[float, float, int]:
                """(answer seconds, answer + release seconds, hit tokens)"""
                event = answers.expect(lookup_id)
                t0 = time.perf_counter()
                submit(lookup_id, prompt)
                wait(lookup_id, event)
                answer_s = answers.answered_at[lookup_id] - t0
                t1 = time.perf_counter()
                engine.cleanup_memory_objs(lookup_id)
                release_s = time.perf_counter() - t1
                return answer_s, answer_s + release_s, answers.hit_tokens[lookup_id]

            def case(name: str, prefix: str, prompt: Any) -> None:
                samples = [one(f"{prefix}{i}", prompt) for i in range(repeats)]
                out[f"{name}_answer_us"] = statistics.median(s[0] for s in samples) * 1e6
                out[f"{name}_us"] = statistics.median(s[1] for s in samples) * 1e6
                out[f"{name}_hit_tokens"] = sorted({s[2] for s in samples})

            case("cpu_hit", "c", prompts[0])
            case("miss", "m", chunk_hashes(99))

            # Disk hits: prompts 1..8 leave the CPU hot cache; the disk backend has them.
            for _, _, keys in prompts[1:]:
                for key in keys:
                    cpu.remove(key, force=True)
            case("disk_hit", "d", prompts[1])
            out["disk_hit_from_cpu"] = any(cpu.contains(k) for k in prompts[1][2])

            samples = []
            for r in range(max(3, repeats // 5)):
                ids = [f"x{r}-{i}" for i in range(1, 9)]
                events = [answers.expect(lid) for lid in ids]
                t0 = time.perf_counter()
                for lid, i in zip(ids, range(1, 9)):
                    submit(lid, prompts[i])
                for lid, event in zip(ids, events):
                    wait(lid, event)
                answer_s = max(answers.answered_at[lid] for lid in ids) - t0
                t1 = time.perf_counter()
                for lid in ids:
                    engine.cleanup_memory_objs(lid)
                release_s = time.perf_counter() - t1
                samples.append((answer_s, answer_s + release_s, answers.hit_tokens[ids[-1]]))
            out["disk_x8_answer_us"] = statistics.median(s[0] for s in samples) * 1e6
            out["disk_x8_us"] = statistics.median(s[1] for s in samples) * 1e6
            out["disk_x8_hit_tokens"] = sorted({s[2] for s in samples})
            # LMCache's disk prefetch pins each key's disk metadata twice and unpins it once
            # (reference notes §7.3): what that leaves pinned after this run.
            out["disk_metadata_pins_after"] = sum(meta.pin_count for meta in disk.dict.values())
        finally:
            LMCacheEngineBuilder.destroy(instance_id)
    full = chunks * CHUNK_TOKENS
    out["answers_ok"] = (
        out["cpu_hit_hit_tokens"] == [full]
        and out["disk_hit_hit_tokens"] == [full]
        and out["disk_x8_hit_tokens"] == [full]
        and out["miss_hit_tokens"] == [0]
        and not out["disk_hit_from_cpu"]
    )
    return out


def format_report(lmc: dict[str, Any], ours: dict[str, Any]) -> str:
    mb = ours["chunks"] * ours["chunk_bytes"] / MiB
    limits = {
        "cpu_hit": ("trio checkpoint", ours["trio_checkpoint_us"]),
        "disk_hit": ("raw read, same bytes", ours["raw_read_16_us"]),
        "miss": ("trio checkpoint", ours["trio_checkpoint_us"]),
        "disk_x8": ("raw read, same bytes", ours["raw_read_x8_us"]),
    }
    lines = [
        f"LMCache 0.5.6 vs lmprefetch — {ours['chunks']} chunks × "
        f"{ours['chunk_bytes'] / MiB:g} MiB ({mb:g} MiB) per lookup, median of "
        f"{ours['repeats']}, both measured in this run (lookup + prefetch + release)",
        "",
        f"  {'case':<27}{'LMCache':>12}{'lmprefetch':>13}{'LMCache/lmp':>13}"
        f"   {'limit (same run)':>31}{'lmp/limit':>10}",
    ]
    for key, name in CASES:
        peer, mine = lmc[f"{key}_us"], ours[f"{key}_us"]
        limit_name, limit = limits[key]
        lines.append(
            f"  {name:<27}{peer:10.1f}µs{mine:11.1f}µs{peer / mine:12.1f}×"
            f"   {limit_name:>22} {limit:7.1f}µs{mine / limit:9.2f}×"
        )
    lines += [
        "",
        "  LMCache: engine.async_lookup_and_prefetch(pin=True) → send_response_to_scheduler, "
        "+ cleanup_memory_objs",
        "           (answer alone: "
        + ", ".join(f"{name} {lmc[f'{key}_answer_us']:.1f}µs" for key, name in CASES)
        + ")",
        "  lmprefetch: Engine.lookup_and_prefetch + claim",
        f"  answers correct: LMCache {'OK' if lmc['answers_ok'] else 'WRONG'}; "
        f"lmprefetch leak check {'OK' if ours['idle_after'] else 'LEAK'}; "
        f"LMCache disk-metadata pins left: {lmc['disk_metadata_pins_after']}",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--chunks", type=int, default=16)
    p.add_argument("--chunk-bytes", type=int, default=2 * MiB)
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if not _lmcache_available():
        print("lmcache is not installed: nothing to compare (nox -s lmcache installs it)")
        return 0

    from lmprefetch.bench.engine import run

    ours = run(args.chunks, args.chunk_bytes, args.repeats)
    lmc = run_lmcache(args.chunks, args.chunk_bytes, args.repeats)
    if args.json:
        print(json.dumps({"lmcache": lmc, "lmprefetch": ours}, indent=2))
    else:
        print(format_report(lmc, ours))
    return 0 if lmc["answers_ok"] and ours["idle_after"] else 1


if __name__ == "__main__":
    sys.exit(main())
