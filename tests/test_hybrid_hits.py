"""The hit of a request on a hybrid model (``lmprefetch.integration.vllm.hits``), against a
fake lookup client: whatever keys are stored and however the answers are delayed, the hit is
the highest chunk boundary that every KV cache group can serve, and nothing stays held.

No vLLM engine is involved, but the package imports vLLM, so this runs with the vLLM tests.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .vllm_support import vllm_imports

with vllm_imports():
    from lmprefetch.integration.vllm.groups import KVGroup, KVGroups, group_hash
    from lmprefetch.integration.vllm.hits import STATE_CANDIDATES, HybridLookup

pytestmark = pytest.mark.vllm

CS = 32  # tokens per chunk; every group's block is 16 or 32


class FakeClient:
    """Answers a lookup with the contiguous run of stored keys after the skipped ones, at
    once or after some polls; records what is live (sent and neither forgotten nor
    cancelled)."""

    def __init__(self, stored: set[int], delays: list[int]) -> None:
        self.stored = stored
        self._delays = delays
        self.pending: dict[str, tuple[int, int]] = {}  # id -> (answer, polls left)
        self.answers: dict[str, int] = {}
        self.live: set[str] = set()
        self.sent = 0
        self.splits: dict[str, list[tuple[str, int]]] = {}

    def lookup(
        self,
        lookup_id: str,
        token_ids: Any,
        *,
        skip_tokens: int = 0,
        hashes: list[int] | None = None,
        offsets: list[int] | None = None,
        salt: bytes | None = None,
    ) -> int | None:
        assert salt is None  # these requests have no cache salt: the shared name space
        if lookup_id in self.answers:
            return self.answers[lookup_id]
        if lookup_id in self.pending:
            answer, polls = self.pending[lookup_id]
            if polls <= 0:
                del self.pending[lookup_id]
                self.answers[lookup_id] = answer
                return answer
            self.pending[lookup_id] = (answer, polls - 1)
            return None
        assert hashes is not None and offsets is not None
        assert lookup_id not in self.live, f"{lookup_id} sent twice while live"
        self.sent += 1
        self.live.add(lookup_id)
        skip = skip_tokens // CS
        n = skip
        while n < len(hashes) and hashes[n] in self.stored:
            n += 1
        answer = n * CS
        delay = self._delays[self.sent % len(self._delays)] if self._delays else 0
        if delay == 0:
            self.answers[lookup_id] = answer
            return answer
        self.pending[lookup_id] = (answer, delay)
        return None

    def _drop(self, lookup_id: str) -> None:
        self.live.discard(lookup_id)
        self.pending.pop(lookup_id, None)
        self.answers.pop(lookup_id, None)

    def forget(self, lookup_id: str) -> None:
        self._drop(lookup_id)

    def cancel(self, lookup_id: str) -> None:
        self._drop(lookup_id)

    def tier_tokens(self, lookup_id: str) -> list[tuple[str, int]]:
        """The tiers that served an answered lookup: :attr:`splits` by id, else none."""
        return self.splits.get(lookup_id, []) if lookup_id in self.answers else []


def _group(index: int, kind: str, window: int | None = None) -> KVGroup:
    block = 16 if index % 2 else 32
    return KVGroup(index, kind, block, (f"l{index}",), window, 0, bytes([index + 1]) * 16)  # type: ignore[arg-type]


@st.composite
def scenarios(draw: st.DrawFn) -> dict[str, Any]:
    kinds = draw(
        st.lists(st.sampled_from(["full", "sliding_window", "mamba"]), min_size=1, max_size=4)
    )
    groups = tuple(
        _group(i, k, draw(st.integers(2, 100)) if k == "sliding_window" else None)
        for i, k in enumerate(kinds)
    )
    n_chunks = draw(st.integers(0, 24))
    num_tokens = n_chunks * CS + draw(st.integers(0, CS - 1))
    chain = draw(st.lists(st.integers(0, 2**64 - 1), min_size=n_chunks, max_size=n_chunks))
    stored = {
        group_hash(g.identity, h)
        for g in groups
        for h in chain
        if draw(st.floats(0, 1)) < draw(st.sampled_from([0.3, 0.8, 1.0]))
    }
    return {
        "groups": KVGroups(groups, False, None, 16),
        "chain": chain,
        "num_tokens": num_tokens,
        "local": draw(st.integers(0, max(0, num_tokens - 1))) // 16 * 16,
        "stored": stored,
        "delays": draw(st.lists(st.integers(0, 3), max_size=5)),
        # The request's max_load_tokens (None: no cap).
        "max_tokens": draw(st.one_of(st.none(), st.integers(0, 24 * CS))),
    }


def best_boundary(s: dict[str, Any]) -> int:
    """The highest boundary (chunks) every group can serve, by brute force."""
    groups: KVGroups = s["groups"]
    chain: list[int] = s["chain"]
    cap = min((max(s["num_tokens"], 1) - 1) // CS, len(chain))
    if s["max_tokens"] is not None:
        cap = min(cap, (s["local"] + s["max_tokens"]) // CS)
    skip = min(s["local"] // CS, cap)

    def has(g: KVGroup, c: int) -> bool:
        return group_hash(g.identity, chain[c]) in s["stored"]

    def serves(b: int) -> bool:
        for g in groups.groups:
            if g.kind == "full" and not all(has(g, c) for c in range(skip, b)):
                return False
            if g.kind == "sliding_window":
                first = max(skip, g.first_needed_token(b * CS) // CS)
                if not all(has(g, c) for c in range(first, b)):
                    return False
            if g.kind == "mamba" and not has(g, b - 1):
                return False
        return True

    return max([skip, *(b for b in range(skip + 1, cap + 1) if serves(b))])


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_the_hit_is_the_highest_boundary_every_group_serves(s: dict[str, Any]) -> None:
    client = FakeClient(s["stored"], s["delays"])
    lookup = HybridLookup(
        "r",
        client,
        s["groups"],
        CS,
        s["chain"],
        s["num_tokens"],
        s["local"],  # type: ignore[arg-type]
        max_tokens=s["max_tokens"],
    )
    lookup.start()
    hit = lookup.poll()
    for _ in range(200):
        if hit is not None:
            break
        hit = lookup.poll()
    assert hit is not None, "the hit never converged"
    assert hit == best_boundary(s) * CS
    if s["max_tokens"] is not None:  # never loads past the request's cap
        assert hit - s["local"] <= s["max_tokens"] or hit <= s["local"]
    # Only the lookups the load claims are still held, and after the load none is.
    assert client.live == {sub.lookup_id for sub in lookup.used}
    lookup.keep_used()
    assert client.live == set()
    # State candidates are probed from the top in batches, never all at once.
    n_mamba = sum(1 for g in s["groups"].groups if g.kind == "mamba")
    if n_mamba:
        states = [x for x in lookup.lookups if "|lmp-s" in x.lookup_id]
        assert len(states) <= max(1, lookup.cap - lookup.skip)
        assert len(states) <= 1 + STATE_CANDIDATES * (
            1 + (lookup.cap - lookup.skip) // STATE_CANDIDATES
        )


@settings(max_examples=100, deadline=None)
@given(scenarios())
def test_a_cancelled_request_holds_nothing(s: dict[str, Any]) -> None:
    client = FakeClient(s["stored"], s["delays"] or [2])
    lookup = HybridLookup(
        "r",
        client,
        s["groups"],
        CS,
        s["chain"],
        s["num_tokens"],
        s["local"],  # type: ignore[arg-type]
    )
    lookup.start()
    lookup.poll()
    lookup.cancel()
    assert client.live == set()


def test_hit_sources_come_from_the_prefix_lookup_in_tokens() -> None:
    """Two full-attention groups: the prefix lookup's keys interleave them (two keys per
    chunk), so its split, counted in keys' tokens, halves into the request's tokens."""
    groups = KVGroups((_group(0, "full"), _group(2, "full")), False, None, 16)
    chain = [11, 12, 13, 14]
    stored = {group_hash(g.identity, h) for g in groups.groups for h in chain}
    client = FakeClient(stored, [])
    client.splits["r|lmp-full"] = [("cpu", 4 * CS), ("disk", 4 * CS)]  # keys 0-3, 4-7
    lookup = HybridLookup("r", client, groups, CS, chain, 4 * CS + 1, 0)  # type: ignore[arg-type]
    lookup.start()
    assert lookup.poll() == 4 * CS
    assert lookup.sources(0, 4 * CS) == {"cpu": 2 * CS, "disk": 2 * CS}
    assert lookup.sources(CS, 3 * CS) == {"cpu": CS, "disk": CS}
    lookup.keep_used()
    assert lookup.sources(0, 4 * CS) == {}  # forgotten: the split is gone with the lookup
