"""Micro-benchmark of the hot paths: ``python examples/bench_hot_path.py [repeats]``.

Times, on the engine's Trio thread and without the caller's await:

* ``start_lookup`` of a 16-chunk prompt the CPU tier holds (answered at once, held) followed
  by ``take`` and the release of the claimed buffers: the task-less path of a CPU hit;
* ``start_lookup`` of a 16-chunk prompt no tier holds (a miss every tier rules out at once);
* ``Engine.stats()``, and the typed ``Engine.statistics()`` behind it;

and on the scheduler's side:

* ``LookupClient.lookup`` of a new id (the submit: register it, queue the command for the
  bridge thread), and of a new id with precomputed hashes (sent from the calling thread);
* building the typed command of a submit (``bridge.Request``), beside a tuple of its fields;

each beside an empty Python call timed the same way (the floor of any call), as a ratio, with
the load average.  Medians over ``repeats`` batches of 100 calls.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable

import trio

from lmprefetch import ChunkHasher, LookupClient, PrefetchConfig, open_engine

CHUNKS = 16
CHUNK_TOKENS = 16
BATCH = 100


def _per_call_us(fn: Callable[[int], object], repeats: int) -> float:
    """The median over ``repeats`` batches of the time of one ``fn(i)`` call, in µs."""
    samples = []
    i = 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(BATCH):
            fn(i)
            i += 1
        samples.append((time.perf_counter() - t0) / BATCH)
    return statistics.median(samples) * 1e6


def _noop(i: int) -> None:
    return None


def _engine_figures(repeats: int) -> dict[str, float]:
    config = PrefetchConfig(
        chunk_size=CHUNK_TOKENS, chunk_bytes=4096, cpu_bytes=64 * 4096 * CHUNKS,
        arena_prefault_bytes=0,
    )  # fmt: skip
    hasher = ChunkHasher(config.chunk_size, config.hash_algorithm)
    prompt = list(range(CHUNKS * CHUNK_TOKENS))
    hit_hashes = hasher.hash(prompt)
    miss_hashes = hasher.hash([t + 10**6 for t in prompt])
    offsets = [CHUNK_TOKENS] * CHUNKS
    out: dict[str, float] = {}

    async def main() -> None:
        async with open_engine(config) as engine:
            await engine.store_hashes(hit_hashes, [b"x" * 4096] * CHUNKS)
            answers: list[int] = []
            on_answer = answers.append

            def cpu_hit(i: int) -> None:
                lid = f"h{i}"
                engine.start_lookup(lid, hit_hashes, offsets, on_answer=on_answer)
                with engine.claim(lid):
                    pass

            def miss(i: int) -> None:
                engine.start_lookup(f"m{i}", miss_hashes, offsets, on_answer=on_answer)

            def stats(i: int) -> None:
                engine.stats()

            out["cpu_hit_us"] = _per_call_us(cpu_hit, repeats)
            out["miss_us"] = _per_call_us(miss, repeats)
            out["stats_us"] = _per_call_us(stats, repeats)
            if hasattr(engine, "statistics"):  # the typed value behind stats()

                def statistics(i: int) -> None:
                    engine.statistics()

                out["statistics_us"] = _per_call_us(statistics, repeats)
            assert answers.count(CHUNKS * CHUNK_TOKENS) == repeats * BATCH, "a hit was missed"
            assert answers.count(0) == repeats * BATCH, "a miss was not answered at once"
            await engine.wait_quiet()
            assert engine.is_idle(), engine.stats()

    trio.run(main)
    return out


def _client_figures(repeats: int) -> dict[str, float]:
    config = PrefetchConfig(chunk_size=CHUNK_TOKENS, lookup_timeout_s=3600.0)
    tag = f"{os.getpid()}-{time.monotonic_ns()}"
    # Nobody listens on the worker endpoint: sends queue up to the high-water mark, then are
    # counted as dropped; neither costs the submit anything.
    client = LookupClient(
        config, [f"ipc://@lmprefetch-hot-{tag}-w"], f"ipc://@lmprefetch-hot-{tag}-r"
    )
    out: dict[str, float] = {}
    try:
        prompt = list(range(CHUNKS * CHUNK_TOKENS))
        hasher = ChunkHasher(config.chunk_size, config.hash_algorithm)
        hashes = hasher.hash(prompt)
        offsets = [CHUNK_TOKENS] * CHUNKS

        def submit(i: int) -> None:
            client.lookup(f"s{i}", prompt)

        def submit_hashed(i: int) -> None:
            client.lookup(f"p{i}", prompt, hashes=hashes, offsets=offsets)

        out["submit_us"] = _per_call_us(submit, repeats)
        out["submit_hashed_us"] = _per_call_us(submit_hashed, repeats)
    finally:
        client.close()
    return out


def _command_figures(repeats: int) -> dict[str, float]:
    """What the typed command costs to build on the scheduler's thread, beside the tuple of the
    same fields it replaced."""
    try:
        from lmprefetch.bridge import Request
    except ImportError:  # a version whose commands were plain tuples
        return {}
    prompt = list(range(CHUNKS * CHUNK_TOKENS))

    def typed(i: int) -> None:
        Request(
            lookup_id="x", seq=i, token_ids=prompt, n_tokens=len(prompt), skip_tokens=0,
            request_configs=None, hashes=None, offsets=None, deadline_ms=i, salt=None,
        )  # fmt: skip

    def plain(i: int) -> None:
        (0, "x", i, prompt, len(prompt), 0, None, None, None, i, None)

    return {
        "command_us": _per_call_us(typed, repeats),
        "command_tuple_us": _per_call_us(plain, repeats),
    }


def main(argv: list[str]) -> int:
    repeats = int(argv[1]) if len(argv) > 1 else 200
    floor = _per_call_us(_noop, repeats)
    figures = {**_engine_figures(repeats), **_client_figures(repeats), **_command_figures(repeats)}
    load = os.getloadavg()[0]
    print(f"hot paths, median of {repeats} batches of {BATCH} calls (load average {load:.2f})")
    names = {
        "cpu_hit_us": f"start_lookup, {CHUNKS}-chunk CPU hit + claim",
        "miss_us": f"start_lookup, {CHUNKS}-chunk known miss",
        "stats_us": "Engine.stats()",
        "statistics_us": "Engine.statistics() (typed)",
        "submit_us": "LookupClient.lookup, submit",
        "submit_hashed_us": "LookupClient.lookup, submit with hashes",
        "command_us": "bridge.Request built (typed command)",
        "command_tuple_us": "the same fields as a tuple",
    }
    for key, label in names.items():
        if key not in figures:
            continue
        us = figures[key]
        print(f"  {label:<44} {us:8.2f} µs   {us / floor:8.1f}× an empty call ({floor:.3f} µs)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
