"""LMCache 0.5.6 driven through the engine benchmark's workload, one sample at a time.

``lmprefetch bench-engine`` measures LMCache beside lmprefetch when ``lmcache`` is importable,
sample by sample in the same run (the two alternate, so a change in the machine's load hits
both alike); elsewhere it prints no LMCache figure at all.  ``examples/bench_lmcache_peer.py``
(run by ``nox -s lmcache``) is the same comparison as a script.

What is measured on the LMCache side (CPU only: no vLLM, no GPU, no ZeroMQ):

* a real ``LMCacheEngine`` from ``LMCacheEngineBuilder.get_or_create`` with
  ``enable_async_loading=True``, ``local_cpu=True`` and a ``LocalDiskBackend`` on a temporary
  directory (sized like lmprefetch's arena and disk tier; LMCache's default 4 disk I/O
  threads); ``post_init(async_lookup_server=…)`` gets a stand-in that records when
  ``send_response_to_scheduler`` is called;
* one lookup = what ``LMCacheAsyncLookupServer`` does on a ``LookupRequestMsg``:
  ``engine.async_lookup_and_prefetch(lookup_id, hashes=…, offsets=…, pin=True)`` **until the
  storage manager calls** ``send_response_to_scheduler`` (the time is taken inside that call,
  so the hop back to the benchmark's thread is not counted), **plus the release**,
  ``engine.cleanup_memory_objs(lookup_id)`` (what a ``LookupCleanupMsg`` does);
* chunks are put with ``StorageManager.batched_put`` (CPU) and the disk backend's
  ``batched_submit_put_task`` (``LMCacheEngine.store`` needs a GPU connector); a disk hit is
  made by force-removing the prompt's keys from the ``LocalCPUBackend`` hot cache;
* LMCache's logging is set to WARNING (its INFO line per answer would cost it time) and usage
  telemetry is off (``LMCACHE_TRACK_USAGE=false``, ``DO_NOT_TRACK=1``).

LMCache does not verify what it reads from disk (lmprefetch checks a checksum, D17), and it
leaks a disk-metadata pin per prefetched chunk (D02): :attr:`LMCachePeer.disk_metadata_pins`
says how many after the run.

The ``Dnn`` codes are LMCache's defects, the rows of the defect table in
``docs/cancellation.md`` ("The defects"), each with its ``test_dNN_`` regression tests.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from typing import Any

__all__ = ["CHUNK_TOKENS", "LMCachePeer", "lmcache_available"]

MiB = 1024 * 1024
GiB = 1024 * MiB
#: Tokens per chunk (the engine benchmark's ``chunk_size``).
CHUNK_TOKENS = 256
#: How long one LMCache answer may take before the benchmark gives up (seconds).
ANSWER_TIMEOUT_S = 60.0


def _quiet_lmcache() -> None:
    """No usage telemetry, and WARNING logs; LMCache reads these when first imported."""
    for name, value in (
        ("LMCACHE_TRACK_USAGE", "false"),
        ("DO_NOT_TRACK", "1"),
        ("LMCACHE_LOG_LEVEL", "WARNING"),
    ):
        os.environ.setdefault(name, value)


def lmcache_available() -> bool:
    """Whether LMCache can be imported here (it imports torch: seconds, the first time)."""
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
            event = self._events.pop(lookup_id, None)
        if event is not None:
            event.set()


class LMCachePeer:
    """An LMCache engine holding the engine benchmark's prompts: prompt 0 in its CPU backend,
    prompts 1–8 on its disk backend only.  Use as a context manager; :meth:`sample` times one
    lookup + release.

    Args:
        chunks: chunks per prompt.
        chunk_bytes: bytes per chunk (a multiple of 1024: one chunk is a bf16
            ``[2, 1, 256, hidden]`` KV tensor).
        cpu_bytes: the size of LMCache's CPU backend (the engine benchmark gives it the size
            of lmprefetch's arena).
    """

    CASES = ("cpu_hit", "miss", "disk_hit", "disk_x8")
    #: ``chunk_bytes`` must be a multiple of this (bf16 K and V of 256 tokens).
    CHUNK_BYTES_MULTIPLE = 2 * CHUNK_TOKENS * 2

    def __init__(self, chunks: int, chunk_bytes: int, cpu_bytes: int) -> None:
        if chunk_bytes % self.CHUNK_BYTES_MULTIPLE:
            raise ValueError(f"chunk_bytes must be a multiple of {self.CHUNK_BYTES_MULTIPLE}")
        self.chunks = chunks
        self.chunk_bytes = chunk_bytes
        self.cpu_bytes = cpu_bytes
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._instance_id = f"lmprefetch-peer-bench-{os.getpid()}-{id(self)}"
        self._engine: Any = None
        self._answers = _AnswerRecorder()
        self._prompts: list[tuple[list[int], list[int], list[Any]]] = []
        self._miss: tuple[list[int], list[int], list[Any]] | None = None
        self._disk: Any = None
        self._cpu: Any = None
        self._n = 0
        #: Whether every answer had the expected hit count (and no disk hit came from CPU).
        self.answers_ok = True
        #: Hit-token counts seen per case.
        self.hit_tokens: dict[str, set[int]] = {c: set() for c in self.CASES}

    def __enter__(self) -> LMCachePeer:
        try:
            self._open()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _open(self) -> None:
        _quiet_lmcache()
        import torch
        from lmcache.v1.cache_engine import LMCacheEngineBuilder
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.memory_management import MemoryFormat
        from lmcache.v1.metadata import LMCacheMetadata

        chunks, chunk_bytes = self.chunks, self.chunk_bytes
        hidden = chunk_bytes // (2 * CHUNK_TOKENS * 2)
        shape = torch.Size([2, 1, CHUNK_TOKENS, hidden])
        dtype = torch.bfloat16
        self._tmp = tempfile.TemporaryDirectory(prefix="lmcache-peer-bench-")
        config = LMCacheEngineConfig.from_defaults(
            chunk_size=CHUNK_TOKENS,
            local_cpu=True,
            max_local_cpu_size=self.cpu_bytes / GiB,
            local_disk=f"file://{self._tmp.name}/",
            max_local_disk_size=64 * chunks * chunk_bytes / GiB,
            enable_async_loading=True,
            lmcache_instance_id=self._instance_id,
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
            engine_id=self._instance_id,
        )
        engine = LMCacheEngineBuilder.get_or_create(
            self._instance_id,
            config,
            metadata,
            None,  # no GPU connector: nothing is stored or retrieved through the GPU
            lambda tensor, src: None,
            lambda obj, src: obj,
        )
        self._engine = engine
        engine.post_init(async_lookup_server=self._answers)
        sm = engine.storage_manager
        if sm is None:
            raise RuntimeError("LMCache built no storage manager")
        self._cpu = sm.storage_backends["LocalCPUBackend"]
        self._disk = sm.storage_backends["LocalDiskBackend"]
        db = engine.token_database

        def chunk_hashes(prompt: int) -> tuple[list[int], list[int], list[Any]]:
            tokens = [prompt * 10_000_000 + t for t in range(chunks * CHUNK_TOKENS)]
            triples = list(db.process_tokens(tokens=tokens, make_key=False))
            hashes = [int(h) for _, _, h in triples]
            offsets = [end - start for start, end, _ in triples]
            keys = [k for _, _, k in db.process_tokens(hashes=hashes, offsets=offsets)]
            return hashes, offsets, keys

        self._prompts = [chunk_hashes(i) for i in range(9)]
        self._miss = chunk_hashes(99)
        payload = torch.frombuffer(bytearray(os.urandom(chunk_bytes)), dtype=torch.uint8)
        written = threading.Semaphore(0)
        n_written = 0
        for _, _, keys in self._prompts:
            objs = []
            for _ in keys:
                obj = sm.allocate(shape, dtype, MemoryFormat.KV_2LTD)
                if obj is None:
                    raise RuntimeError("LMCache's CPU pool is full")
                obj.tensor.view(-1).view(torch.uint8).copy_(payload)
                objs.append(obj)
            self._disk.batched_submit_put_task(
                keys, objs, on_complete_callback=lambda key: written.release()
            )
            sm.batched_put(keys, objs, location="LocalCPUBackend")
            n_written += len(keys)
        deadline = time.monotonic() + ANSWER_TIMEOUT_S
        for _ in range(n_written):
            if not written.acquire(timeout=max(0.0, deadline - time.monotonic())):
                raise TimeoutError("LMCache did not finish writing the disk tier")
        # Disk hits: prompts 1..8 leave the CPU hot cache; the disk backend has them.
        for _, _, keys in self._prompts[1:]:
            for key in keys:
                self._cpu.remove(key, force=True)

    def close(self) -> None:
        """Destroy the engine and remove its directory (idempotent)."""
        if self._engine is not None:
            from lmcache.v1.cache_engine import LMCacheEngineBuilder

            self._engine = None
            LMCacheEngineBuilder.destroy(self._instance_id)
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    @property
    def disk_metadata_pins(self) -> int:
        """Disk-metadata pins LMCache holds now (it pins twice and unpins once per prefetched
        chunk, D02)."""
        return int(sum(meta.pin_count for meta in self._disk.dict.values()))

    def _submit(self, lookup_id: str, prompt: tuple[list[int], list[int], list[Any]]) -> None:
        self._engine.async_lookup_and_prefetch(
            lookup_id=lookup_id, hashes=prompt[0], offsets=prompt[1], pin=True
        )

    def sample(self, case: str) -> float:
        """One lookup of ``case`` (``cpu_hit``, ``miss``, ``disk_hit`` or ``disk_x8``: eight
        different disk prompts at once), answer + release, in seconds (blocking)."""
        engine, answers = self._engine, self._answers
        self._n += 1
        if case == "disk_x8":
            prompts = self._prompts[1:9]
        elif case == "miss":
            assert self._miss is not None
            prompts = [self._miss]
        else:
            prompts = [self._prompts[0 if case == "cpu_hit" else 1]]
        ids = [f"{case}-{self._n}-{i}" for i in range(len(prompts))]
        events = [answers.expect(lid) for lid in ids]
        t0 = time.perf_counter()
        for lid, prompt in zip(ids, prompts):
            self._submit(lid, prompt)
        for lid, event in zip(ids, events):
            if not event.wait(ANSWER_TIMEOUT_S):
                raise TimeoutError(f"LMCache did not answer lookup {lid}")
        answer_s = max(answers.answered_at[lid] for lid in ids) - t0
        t1 = time.perf_counter()
        for lid in ids:
            engine.cleanup_memory_objs(lid)
        total = answer_s + time.perf_counter() - t1
        full = self.chunks * CHUNK_TOKENS
        want = 0 if case == "miss" else full
        for lid in ids:
            got = answers.hit_tokens.pop(lid)
            answers.answered_at.pop(lid)
            self.hit_tokens[case].add(got)
            if got != want:
                self.answers_ok = False
        if case == "disk_hit" and any(self._cpu.contains(k) for k in self._prompts[1][2]):
            self.answers_ok = False  # a disk hit served from the CPU backend is no disk hit
        return total
