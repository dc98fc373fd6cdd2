"""Property test: random interleavings of store / lookup / claim / cancel / expire keep the
invariants and always hand out exactly the stored bytes."""

from __future__ import annotations

import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmprefetch import PrefetchConfig, open_engine

from .fakes import FakeTier
from .helpers import CHUNK, assert_conserved

PROMPTS = 4  # distinct prompts (each up to 6 chunks, sharing prefixes)

op = st.one_of(
    st.tuples(st.just("store"), st.integers(0, PROMPTS - 1), st.integers(1, 6)),
    st.tuples(st.just("disk"), st.integers(0, PROMPTS - 1), st.integers(1, 6)),
    st.tuples(st.just("lookup"), st.integers(0, PROMPTS - 1), st.integers(1, 6)),
    st.tuples(st.just("claim"), st.integers(0, 5), st.just(0)),
    st.tuples(st.just("cancel"), st.integers(0, 5), st.just(0)),
    st.tuples(st.just("wait"), st.integers(1, 40), st.just(0)),
    st.tuples(st.just("evict"), st.integers(0, PROMPTS - 1), st.integers(0, 5)),
)


def prompt_tokens(p: int, n_chunks: int) -> list[int]:
    # Prompts 0 and 1 share their first two chunks.
    base = 0 if p in (0, 1) else p
    toks = [base * 1000 + i for i in range(2 * CHUNK)]
    toks += [p * 1000 + 500 + i for i in range((n_chunks - 2) * CHUNK)] if n_chunks > 2 else []
    return toks[: n_chunks * CHUNK]


def payload_for(chunk_hash: int) -> bytes:
    return chunk_hash.to_bytes(8, "big") * 5  # 40 bytes, unique per chunk


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(op, min_size=1, max_size=40))
def test_random_interleavings_keep_invariants(ops: list[tuple[str, int, int]]) -> None:
    config = PrefetchConfig(chunk_size=CHUNK, chunk_bytes=64, cpu_bytes=64 * 12, claim_ttl_s=1.0)

    async def main() -> None:
        disk = FakeTier("disk")
        disk.chunk_delay_s = 0.003
        async with open_engine(config, extra_tiers=[disk]) as engine:
            lookup_no = 0
            answers: dict[str, list[int]] = {}
            async with trio.open_nursery() as nursery:
                for kind, a, b in ops:
                    if kind == "store":
                        toks = prompt_tokens(a, b)
                        hashes = engine.hasher.hash(toks)
                        await engine.store(toks, [payload_for(h) for h in hashes])
                    elif kind == "disk":
                        hashes = engine.hasher.hash(prompt_tokens(a, b))
                        for key in engine.keys.keys(hashes):
                            disk.data[key] = payload_for(key.chunk_hash)
                    elif kind == "lookup":
                        lid = f"L{lookup_no % 6}"
                        lookup_no += 1
                        hashes = engine.hasher.hash(prompt_tokens(a, b))
                        answers[lid] = []
                        engine.start_lookup(
                            lid, hashes, [CHUNK] * len(hashes), on_answer=answers[lid].append
                        )
                    elif kind == "claim":
                        with engine.claim(f"L{a}") as chunks:
                            for i, (key, buf) in enumerate(chunks):
                                assert bytes(buf.view()) == payload_for(key.chunk_hash)
                                assert key.chunk_hash == chunks[0][0].chunk_hash or i > 0
                            got = answers.get(f"L{a}", [])
                            if chunks:
                                assert got and got[-1] == len(chunks) * CHUNK
                    elif kind == "cancel":
                        engine.cancel(f"L{a}")
                    elif kind == "wait":
                        await trio.sleep(a * 0.001)
                    elif kind == "evict":
                        hashes = engine.hasher.hash(prompt_tokens(a, 6))
                        engine.cpu.discard(engine.keys.keys(hashes)[b])
                    for got in answers.values():
                        assert len(got) <= 1
                nursery.cancel_scope.cancel()
            engine.cancel_all()
            await engine.wait_quiet()
            for got in answers.values():
                assert len(got) == 1
            assert_conserved(engine)
        assert engine.arena.used_slots == 0

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
