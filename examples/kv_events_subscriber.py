"""Subscribe to a worker's KV events (``lmprefetch worker --events-endpoint ...``) and print them.

    python examples/kv_events_subscriber.py tcp://127.0.0.1:5557 [--topic kv]
    python examples/kv_events_subscriber.py --demo

The stream is vLLM's format (``[topic, seq, msgpack KVEventBatch]``; see
``docs/tenancy-and-events.md``), so the same loop reads vLLM's own publisher.  ``--demo`` starts
a worker in this process (a four-chunk CPU tier, events on a free loopback port), stores six
one-chunk prompts and prints the stream until it has seen the six stores and the two evictions
they cause.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import zmq

from lmprefetch import PrefetchConfig, WorkerRuntime
from lmprefetch.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, decode_batch


def describe(event: KVEvent) -> str:
    if isinstance(event, AllBlocksCleared):
        return "AllBlocksCleared"
    hashes = ", ".join(h.hex() if isinstance(h, bytes) else format(h, "016x")
                       for h in event.block_hashes)  # fmt: skip
    where = f"{event.medium}/{event.locality}"
    if isinstance(event, BlockStored):
        return f"BlockStored   {where:<15} [{hashes}] {len(event.token_ids)} tokens"
    return f"BlockRemoved  {where:<15} [{hashes}]"


def follow(
    sub: zmq.Socket[bytes], done: Callable[[list[KVEvent]], bool], timeout_ms: int | None
) -> list[KVEvent]:
    """Print batches until ``done(events so far)``; each wait lasts at most ``timeout_ms``."""
    seen: list[KVEvent] = []
    expected_seq = None
    while not done(seen):
        if not sub.poll(timeout_ms):
            raise SystemExit(f"no KV event batch for {timeout_ms} ms")
        _topic, seq_bytes, payload = sub.recv_multipart()
        seq = int.from_bytes(seq_bytes, "big")
        if expected_seq is not None and seq != expected_seq:
            print(f"(batches {expected_seq}..{seq - 1} were lost)")
        expected_seq = seq + 1
        for event in decode_batch(payload).events:
            print(f"#{seq:<4} {describe(event)}")
            seen.append(event)
    return seen


def subscriber(
    endpoint: str, topic: str
) -> tuple[zmq.Context[zmq.Socket[bytes]], zmq.Socket[bytes]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
    sub.connect(endpoint)
    return ctx, sub


def demo() -> int:
    config = PrefetchConfig(chunk_size=4, chunk_bytes=64, cpu_bytes=64 * 4)
    with WorkerRuntime.start(config, events_endpoint="tcp://127.0.0.1:0") as worker:
        assert worker.publisher is not None
        print(f"worker publishing on {worker.publisher.endpoint}")
        ctx, sub = subscriber(worker.publisher.endpoint, "")
        try:
            for prompt in range(6):
                worker.store([prompt * 10 + i for i in range(4)], [bytes([prompt]) * 64])
            events = follow(
                sub,
                lambda seen: (
                    sum(isinstance(e, BlockStored) for e in seen) == 6
                    and sum(isinstance(e, BlockRemoved) for e in seen) == 2
                ),
                timeout_ms=30_000,
            )
        finally:
            sub.close()
            ctx.term()
    stored = sum(isinstance(e, BlockStored) for e in events)
    removed = sum(isinstance(e, BlockRemoved) for e in events)
    print(f"stored {stored}, removed {removed} (a four-chunk CPU tier evicted two)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("endpoint", nargs="?", help="the worker's --events-endpoint")
    parser.add_argument("--topic", default="", help="the worker's --events-topic")
    parser.add_argument("--demo", action="store_true", help="run against an in-process worker")
    args = parser.parse_args(argv)
    if args.demo:
        return demo()
    if not args.endpoint:
        parser.error("give the worker's events endpoint, or --demo")
    ctx, sub = subscriber(args.endpoint, args.topic)
    try:
        follow(sub, lambda seen: False, timeout_ms=None)
    except KeyboardInterrupt:
        pass
    finally:
        sub.close()
        ctx.term()
    return 0


if __name__ == "__main__":
    sys.exit(main())
