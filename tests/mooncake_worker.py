"""A worker process for the cross-process Mooncake tests: one engine (``open_engine`` with the
Mooncake tier), driven by JSON lines on stdin, answering JSON lines on stdout.

    python -m tests.mooncake_worker '<PrefetchConfig as JSON>'

Commands (one per line): ``{"cmd": "store", "prompts": [[token, ...], ...]}`` stores each
prompt (chunk ``i``'s payload is :func:`payload` of its hash) and flushes the write-behind;
``{"cmd": "lookup", "tokens": [...]}`` looks a prompt up, claims it and answers the hit tokens
and the claimed chunks' ``(hash, length, xxh3)``; ``{"cmd": "stats"}``; ``{"cmd": "drop_cpu",
"prompts": [...]}`` forgets prompts in the CPU tier (so that lookups go to Mooncake).  It prints
``{"ready": true}`` once the engine is open, and closes the engine at the end of stdin.
"""

from __future__ import annotations

import json
import random
import sys
from typing import Any

import trio
import xxhash

from lmprefetch import PrefetchConfig, open_engine


def payload(chunk_hash: int, size: int) -> bytes:
    """The one right payload of a chunk (a pure function of its hash)."""
    return random.Random(chunk_hash).randbytes(size)


def digest(data: Any) -> int:
    return xxhash.xxh3_64_intdigest(data)


async def serve(config: PrefetchConfig) -> None:
    out = sys.stdout
    async with open_engine(config) as engine:
        tier = next(t for t in engine.tiers if t.name == "mooncake")
        connected = getattr(tier, "connected", False)
        print(json.dumps({"ready": True, "connected": connected}), file=out, flush=True)
        n = 0
        while True:
            line = await trio.to_thread.run_sync(sys.stdin.readline)
            if not line:
                break
            msg = json.loads(line)
            cmd = msg["cmd"]
            answer: dict[str, Any]
            if cmd == "store":
                stored = 0
                for tokens in msg["prompts"]:
                    hashes = engine.hasher.hash(tokens)
                    data = [payload(h, config.chunk_bytes) for h in hashes]
                    stored += await engine.store(tokens, data)
                await engine.flush()
                answer = {"stored": stored}
            elif cmd == "lookup":
                tokens = msg["tokens"]
                hashes = engine.hasher.hash(tokens)
                n += 1
                lookup_id = f"lookup-{n}"
                hit = await engine.lookup_and_prefetch(
                    lookup_id, hashes, [config.chunk_size] * len(hashes)
                )
                with engine.claim(lookup_id) as items:
                    chunks = [
                        [key.chunk_hash, buf.length, digest(buf.view())] for key, buf in items
                    ]
                answer = {"hit_tokens": hit, "chunks": chunks}
            elif cmd == "drop_cpu":
                for tokens in msg["prompts"]:
                    for key in engine.keys.keys(engine.hasher.hash(tokens)):
                        engine.cpu.discard(key)
                answer = {}
            elif cmd == "stats":
                answer = {"stats": engine.stats(), "idle": engine.is_idle()}
            else:
                answer = {"error": f"unknown command {cmd!r}"}
            print(json.dumps(answer), file=out, flush=True)


def main() -> None:
    config = PrefetchConfig.from_dict(json.loads(sys.argv[1]))
    trio.run(serve, config)


if __name__ == "__main__":
    main()
