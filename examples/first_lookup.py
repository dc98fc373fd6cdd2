"""A first lookup, inside Trio: store a prompt's chunks, look the prompt up, claim them.

Run it: ``python examples/first_lookup.py`` (plain ``pip install lmprefetch`` is enough).
"""

import trio

from lmprefetch import PrefetchConfig, open_engine


async def main() -> None:
    config = PrefetchConfig(chunk_size=16, chunk_bytes=4096, cpu_bytes=1 << 20)
    async with open_engine(config) as engine:
        prompt = list(range(100))  # token ids: 6 whole chunks of 16 (+ 4 tokens never cached)
        kv = [bytes([c]) * 4096 for c in range(6)]  # one payload (the KV bytes) per chunk
        await engine.store(prompt, kv)

        hashes = engine.hasher.hash(prompt)  # one prefix-chained hash per whole chunk
        offsets = engine.hasher.offsets(len(prompt))  # tokens per chunk: [16, 16, ...]
        hit = await engine.lookup_and_prefetch("req-1", hashes, offsets)
        print(f"cached prefix: {hit} of {len(prompt)} tokens")

        with engine.claim("req-1") as chunks:  # (key, buffer) pairs, released on exit
            head = bytes(chunks[-1][1].view()[:2])
            print(f"claimed {len(chunks)} chunks; the last one starts with {head!r}")


if __name__ == "__main__":
    trio.run(main)
