"""The benchmark's options and its synthetic multi-turn chat workload."""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = [
    "BenchOptions",
    "Workload",
    "fraction",
    "int_at_least",
    "make_workload",
    "payload_block",
]

KiB = 1024
MiB = 1024 * KiB


@dataclass
class BenchOptions:
    workers: int = 2
    conversations: int = 32
    cold_ratio: float = 0.2
    turns: int = 4
    system_tokens: int = 1024
    turn_tokens: int = 512
    repeats: int = 3
    concurrency: int = 16
    abort_ratio: float = 0.1
    chunk_size: int = 256
    chunk_bytes: int = 2 * MiB  # one chunk of one rank's KV (LMCache's reference size)
    cpu_bytes: int = 256 * MiB  # smaller than the workload: older chunks live on disk only
    miss_lookups: int = 20_000
    rtt_samples: int = 2_000
    cancel_samples: int = 100  # per worker
    disk_probe_rounds: int = 8  # per worker: lookups vs the verified read of the same files
    seed: int = 0
    transport: str = "ipc"
    json: bool = False
    plot: str | None = None
    progress: bool = True


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse ``type`` for an integer option of at least ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    parse.__name__ = "int"
    return parse


def fraction(text: str) -> float:
    """An argparse ``type`` for a number between 0 and 1."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0.0 <= value <= 1.0:  # also NaN
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {text}")
    return value


@dataclass
class Workload:
    stored: list[list[int]] = field(default_factory=list)  # per warm conversation: its history
    lookups: list[list[int]] = field(default_factory=list)  # prompts to look up, in order


def make_workload(opts: BenchOptions) -> Workload:
    """A deterministic multi-turn chat workload (the same in every process)."""
    rng = random.Random(opts.seed)
    vocab = 32_000

    def text(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    system = text(opts.system_tokens)
    half = opts.turn_tokens // 2
    w = Workload()
    prompts: list[list[int]] = []
    for c in range(opts.conversations):
        turns = [(text(half), text(half)) for _ in range(opts.turns)]  # (user, assistant)
        warm = c >= int(opts.conversations * opts.cold_ratio)
        history = list(system)
        for t, (user, assistant) in enumerate(turns):
            prompts.append(history + user)  # turn t's prompt: everything so far + the question
            if t < opts.turns - 1:
                history += user + assistant
        if warm:
            w.stored.append(history)
    for _ in range(opts.repeats):
        batch = list(prompts)
        rng.shuffle(batch)
        w.lookups.extend(batch)
    return w


def payload_block(chunk_bytes: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(chunk_bytes)
