"""The hit of a request on a hybrid model (:class:`lmprefetch.integration.vllm.request.
ConnectorRequest`), against a fake lookup client: whatever keys are stored and however the
answers are delayed, the hit is the highest chunk boundary that every KV cache group can serve,
the load planned for it claims exactly the lookups it uses, and nothing stays held after it.

No vLLM engine is involved, but the package imports vLLM, so this runs with the vLLM tests.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .vllm_support import vllm_imports

with vllm_imports():
    from lmprefetch.integration.vllm import ConnectorStatistics
    from lmprefetch.integration.vllm.groups import KVGroup, KVGroups, group_hash
    from lmprefetch.integration.vllm.known import KnownChunks
    from lmprefetch.integration.vllm.request import (
        STATE_CANDIDATES,
        ConnectorRequest,
        RequestContext,
    )

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
        load_policy: str = "",
    ) -> int | None:
        assert salt is None  # these requests have no cache salt: the shared name space
        assert load_policy == ""  # nor a load policy of their own
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


class FakeHasher:
    """Hands out a scenario's chain hashes as a request's (one per whole chunk)."""

    chunk_size = CS
    save_partial_chunks = False

    def __init__(self, chain: list[int]) -> None:
        self._chain = chain

    def num_chunks(self, num_tokens: int) -> int:
        return num_tokens // CS

    def hash(self, token_ids: Any, salt: bytes | None = None) -> list[int]:
        return self._chain[: len(token_ids) // CS]


class FakeRequest:
    """What the connector reads of a vLLM request before it is scheduled."""

    def __init__(self, num_tokens: int) -> None:
        self.request_id = "r"
        self.all_token_ids = list(range(num_tokens))
        self.num_tokens = self.num_prompt_tokens = num_tokens
        self.num_computed_tokens = 0


class FakeBlocks:
    """vLLM's blocks for a request: every group has distinct real blocks everywhere."""

    def __init__(self, groups: KVGroups) -> None:
        self._n = 1 + max(g.index for g in groups.groups)

    def get_block_ids(self) -> tuple[list[int], ...]:
        return tuple(list(range(1 + 1000 * i, 1000 * (i + 1))) for i in range(self._n))


def request_of(s: dict[str, Any], client: FakeClient, max_tokens: int | None) -> Any:
    ctx = RequestContext(
        client=client,  # type: ignore[arg-type]
        groups=s["groups"],
        hasher=FakeHasher(s["chain"]),  # type: ignore[arg-type]
        statistics=ConnectorStatistics(),
        known=KnownChunks(),
        claim_ttl_s=30.0,
        hash_block_size=None,
    )
    request = FakeRequest(s["num_tokens"])
    return ConnectorRequest(
        request,  # type: ignore[arg-type]
        ctx,
        load_ok=True,
        save_ok=False,
        max_load_tokens=max_tokens,
    )


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
    r = request_of(s, client, s["max_tokens"])
    r.start(s["local"])
    hit = r.poll()
    for _ in range(200):
        if hit is not None:
            break
        hit = r.poll()
    assert hit is not None, "the hit never converged"
    assert hit == best_boundary(s) * CS
    if s["max_tokens"] is not None:  # never loads past the request's cap
        assert hit - s["local"] <= s["max_tokens"] or hit <= s["local"]
    # Only the lookups the load claims are still held ...
    assert client.live == {sub.lookup_id for sub in r.used}
    # ... vLLM's ask and allocation plan a load that claims exactly them, and none is held
    # here after it (the workers keep theirs for the claim).
    external, asynchronous = r.matched(s["local"])
    assert external == max(hit - s["local"], 0)
    load = r.plan_load(FakeBlocks(s["groups"]), external)
    if external:
        assert asynchronous and load is not None and load.asynchronous
        assert (load.start_token, load.end_token) == (s["local"], hit)
        assert [c.lookup_id for c in load.claims] == [sub.lookup_id for sub in r.used]
        assert all(c.keys for c in load.claims)
    else:
        assert load is None
    assert client.live == set()
    # State candidates are probed from the top in batches, never all at once.
    n_mamba = sum(1 for g in s["groups"].groups if g.kind == "mamba")
    if n_mamba:
        states = [x for x in r.lookups if "|lmp-s" in x.lookup_id]
        assert len(states) <= max(1, r.cap - r.skip)
        assert len(states) <= 1 + STATE_CANDIDATES * (1 + (r.cap - r.skip) // STATE_CANDIDATES)


@settings(max_examples=100, deadline=None)
@given(scenarios())
def test_a_cancelled_request_holds_nothing(s: dict[str, Any]) -> None:
    client = FakeClient(s["stored"], s["delays"] or [2])
    r = request_of(s, client, None)
    r.start(s["local"])
    r.poll()
    r.release()
    assert client.live == set()


def test_hit_sources_come_from_the_prefix_lookup_in_tokens() -> None:
    """Two full-attention groups: the prefix lookup's keys interleave them (two keys per
    chunk), so its split, counted in keys' tokens, halves into the request's tokens."""
    groups = KVGroups((_group(0, "full"), _group(2, "full")), False, None, 16)
    chain = [11, 12, 13, 14]
    stored = {group_hash(g.identity, h) for g in groups.groups for h in chain}
    client = FakeClient(stored, [])
    client.splits["r"] = [("cpu", 4 * CS), ("disk", 4 * CS)]  # keys 0-3, 4-7
    s = {"groups": groups, "chain": chain, "num_tokens": 4 * CS + 1}
    r = request_of(s, client, None)
    r.start(0)
    assert r.poll() == 4 * CS
    assert r.matched(0) == (4 * CS, True)
    assert r.plan_load(FakeBlocks(groups), 4 * CS) is not None
    assert r.hit_sources(4 * CS) == {"cpu": 2 * CS, "disk": 2 * CS}
    # What the split does not cover is counted under "" (vLLM's count is the truth).
    client.splits["r"] = [("cpu", 2 * CS)]
    r.start(0)
    assert r.matched(0) == (4 * CS, True)
    assert r.plan_load(FakeBlocks(groups), 4 * CS) is not None
    assert r.hit_sources(4 * CS) == {"cpu": CS, "": 3 * CS}
