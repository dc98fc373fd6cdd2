"""One vLLM request as the connector's scheduler side carries it, from arrival to finish
(:class:`ConnectorRequest`): its lookups and the hit they converge to, the load planned when
vLLM allocates its blocks, the saves planned every step, and their release.

The scheduler side (:mod:`.scheduler`) builds one when vLLM hands it a request and forwards
each of vLLM's calls about the request to it; nothing here calls back up.  Every model takes
the same path; what a model with one full-attention group (*legacy*) does differently is a
property of its groups (:class:`~.groups.KVGroups`): plain chain hashes as keys, a hit that may
end inside a chunk, synchronous loads.

The hit
-------
A hit of ``b`` tokens (``b`` a chunk boundary) needs, in every group, what that group reads to
go on from token ``b`` (:meth:`~.groups.KVGroup.first_needed_token`):

* full attention: every chunk before ``b`` — one **prefix lookup** over the full-attention
  groups' keys, interleaved chunk by chunk (``F`` = its answer, in chunks);
* sliding window: the chunks under the window before ``b`` — a lookup of the window's chunks
  only (the chunks before it are ``skip_tokens``: neither probed nor loaded), one per window
  size, so a short window is not held to a longer one's chunks;
* Mamba / GDN: the recurrent state at ``b`` — one small lookup per candidate boundary, a batch
  of :data:`STATE_CANDIDATES` boundaries at a time from the top, since states exist only where
  vLLM handed one over (a few per request).

The boundary starts at the highest chunk boundary that leaves a token to compute, drops to
``F``, and then to whatever a window or a state allows, and every drop is checked again by the
groups before it; it only goes down, so it converges.  The window and state lookups for the
first candidate start together with the prefix lookup, so a repeated prompt is answered in one
round trip.  A legacy model has only the prefix lookup, over every chunk of the request (a
trailing partial chunk too): its hit is the prefix found, and vLLM's call keeps the last token
to compute.  Every lookup is an ordinary lmprefetch lookup (the prefix lookup's id is the
request id, the others add a suffix): the workers hold what they loaded until the step claims
it or the scheduler side cancels it.  A load-or-recompute policy would cap the candidate
boundary in :meth:`ConnectorRequest.poll`.

Threads: the scheduler's; nothing here blocks (polls are dictionary reads in the client).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ...codec import tenant_id
from .metadata import KeyBlocks, LoadSpec, LookupClaim, SaveSpec
from .tenancy import chunk_blocks

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.request import Request

    from ...client import LookupClient
    from ...events import ChunkBlocks
    from ...hashing import ChunkHasher
    from .groups import KVGroup, KVGroups
    from .known import KnownChunks
    from .stats import ConnectorStatistics

__all__ = ["STATE_CANDIDATES", "ConnectorRequest", "RequestContext", "SubLookup", "rows_to_load"]

log = logging.getLogger("lmprefetch.integration.vllm")

#: Mamba state boundaries probed per round (each a lookup of one key per Mamba group).
STATE_CANDIDATES = 8
#: A held answer whose lookup started longer ago than this fraction of ``claim_ttl_s`` is
#: looked up again rather than used: the workers may release it before the step claims it.
STALE_ANSWER_FRACTION = 0.5
#: vLLM's null block: out-of-window sliding-window blocks, skipped Mamba states.  Never read
#: from, never written to.
NULL_BLOCK = 0
#: The clock of answers' age (a module attribute so tests can move it).
_now = time.monotonic


@dataclass
class RequestContext:
    """What every request of one scheduler side shares.

    Attributes:
        client: the lookup client.
        groups: the model's KV cache groups.
        hasher: chunk hashes (its ``chunk_size`` is a multiple of every group's block size).
        statistics: the scheduler side's counters (changed in place).
        known: the chunks the workers were last known to hold (``may_load_async``).
        claim_ttl_s: how long the workers hold an unclaimed prefetch.
        hash_block_size: the block size of vLLM's block hashes when KV events are on (chunks
            are named by them), else ``None``.
    """

    client: LookupClient
    groups: KVGroups
    hasher: ChunkHasher
    statistics: ConnectorStatistics
    known: KnownChunks
    claim_ttl_s: float
    hash_block_size: int | None


@dataclass
class SubLookup:
    """One lookup a request's hit is built from.

    ``entries[i]`` is the (group, chunk) of the ``i``-th key looked up; the first ``skip``
    were not probed (vLLM holds them, or the group does not need them).  ``answer`` counts the
    keys found contiguously from the first (skipped ones included), once known."""

    lookup_id: str
    entries: list[tuple[KVGroup, int]]
    hashes: list[int]
    skip: int
    answer: int | None = None
    #: For window lookups: the chunk range ``[lo, hi)`` it verifies, and its window set.
    lo: int = 0
    hi: int = 0
    window: tuple[int, int] = (0, 0)
    #: Registered in the client (not yet forgotten or cancelled).
    sent: bool = field(default=False, repr=False)

    @property
    def held(self) -> bool:
        """The workers may hold keys loaded for it (pending, or answered past the skipped)."""
        return self.answer is None or self.answer > self.skip


class ConnectorRequest:
    """One request, from ``on_new_request`` to ``request_finished`` (see the module docstring).

    Args:
        request: vLLM's request.
        ctx: what the scheduler side's requests share.
        load_ok: the request is looked up and loaded (a consumer connector, a request keyed by
            its tokens that reads the prefix cache and did not ask to load nothing).
        save_ok: its prompt's chunks are saved.
        salt: its tenant's name space (:mod:`.tenancy`), ``None`` for the shared one.
        max_load_tokens: its cap on the tokens loaded past vLLM's own hit (whole blocks), or
            ``None``.
        load_policy: its own load policy (``kv_transfer_params``), a built-in one's name, or
            ``""``: the workers' configured one.
    """

    def __init__(
        self,
        request: Request,
        ctx: RequestContext,
        *,
        load_ok: bool,
        save_ok: bool,
        salt: bytes | None = None,
        max_load_tokens: int | None = None,
        load_policy: str = "",
    ) -> None:
        self.request = request
        self.load_ok = load_ok
        self.save_ok = save_ok
        self.max_load_tokens = max_load_tokens
        self.load_policy = load_policy
        self._ctx = ctx
        self._groups = ctx.groups
        self._cs = ctx.hasher.chunk_size
        self._salt = salt
        #: The tenant its saves are sealed for (a digest of the salt; ``b""``: shared).
        self._tenant = tenant_id(salt)
        # Windows grouped by what they need (window, retained tokens): one window lookup per
        # set, so a group with a short window is not held to a longer one's chunks.
        self._full = self._groups.of_kind("full")
        self._mamba = self._groups.of_kind("mamba")
        self._window_sets: dict[tuple[int, int], list[KVGroup]] = {}
        for g in self._groups.of_kind("sliding_window"):
            self._window_sets.setdefault((g.window or 0, g.extra_retained_tokens), []).append(g)
        #: Chain hashes of the request's first ``_hashed_tokens`` tokens.
        self._hashes: list[int] = []
        self._hashed_tokens = 0
        # The current lookups (:meth:`start`): the boundary's bounds in chunks, the lookups,
        # and the hit in tokens from token 0 once known.
        self.cap = 0
        self.skip = 0
        self._n_tokens = 0
        self._started_at = 0.0
        self._prefix: SubLookup | None = None
        self._windows: list[SubLookup] = []
        self._states: dict[int, SubLookup] = {}
        self._window_used: dict[tuple[int, int], SubLookup] = {}
        #: The lookups the hit loads from (window and state: the ones that decided it).
        self.used: list[SubLookup] = []
        self.result: int | None = None
        # What vLLM did with the hit.
        self._consumed = False  # admitted with the current hit
        self._num_computed = 0  # vLLM's own hit at its last ask: the load starts there
        self._queued_async = False  # may_load_async said True: the load is asynchronous
        self._sources: dict[str, int] = {}  # the planned load's tokens by tier
        #: Tokens loaded from lmprefetch (Mamba states up to there are not saved again).
        self.loaded_to = 0
        #: Prompt tokens whose chunks are stored (or known to be): saves start there.
        self.saved_tokens = 0

    @property
    def hashes(self) -> list[int]:
        """The chain hashes of the request's chunks computed so far (its lookup's, its saves')."""
        return self._hashes

    @property
    def lookups(self) -> list[SubLookup]:
        """Every lookup of the current round (some may be answered, some pending)."""
        subs = [self._prefix] if self._prefix is not None else []
        return [*subs, *self._windows, *self._states.values()]

    @property
    def held(self) -> bool:
        """Some lookup may still hold or be loading keys on the workers."""
        return any(sub.sent and sub.held for sub in self.lookups)

    @property
    def asynchronous(self) -> bool:
        """Its load is asynchronous for vLLM: a hybrid model's (only then can a failed one be
        reported by request), or one vLLM queued as such (``may_load_async``)."""
        return not self._groups.legacy or self._queued_async

    # -- arrival: the lookups -----------------------------------------------------------------
    def start(self, local_tokens: int) -> None:
        """Start a fresh round of lookups of the request's tokens, skipping the whole chunks
        of ``local_tokens`` (vLLM's own hit: the workers neither probe nor load them); the
        round before is released."""
        self.release()
        self._consumed = False
        self._started_at = _now()
        self._prefix, self._windows, self._states, self.used = None, [], {}, []
        self._window_used, self._sources = {}, {}
        self.result = None
        cs = self._cs
        n = len(self.request.all_token_ids)
        chunks = self._ctx.hasher.num_chunks(n)
        # A legacy hit may end inside a chunk (vLLM's call keeps the last token to compute);
        # any other ends on the last chunk boundary before the last token.
        partial = self._groups.legacy
        cap = chunks if partial else min((max(n, 1) - 1) // cs, chunks)
        if self.max_load_tokens is not None:
            limit = local_tokens + self.max_load_tokens  # the request's own cap
            cap = min(cap, -(-limit // cs) if partial else limit // cs)
        self._n_tokens, self.cap = n, cap
        self.skip = min(local_tokens // cs, cap)
        if cap <= self.skip:
            self.result = self.skip * cs  # nothing to look up past what vLLM holds
            return
        self._ctx.statistics.lookups += 1
        self._chunk_hashes(n)
        if self._full:
            entries = [(g, c) for c in range(cap) for g in self._full]
            skip = self.skip * len(self._full)
            self._prefix = self._send(self._make(self.request.request_id, entries, skip))
        # Speculatively, what the highest boundary needs besides the prefix: a repeated prompt
        # is then answered in one round trip.
        self._window_allows(cap)
        if self._mamba and cap not in self._states:
            self._states[cap] = self._send(self._state_lookup(cap))
        self.poll()

    def _make(self, lookup_id: str, entries: list[tuple[KVGroup, int]], skip: int) -> SubLookup:
        hashes = [self._groups.key_hash(g, self._hashes[c]) for g, c in entries]
        return SubLookup(lookup_id, entries, hashes, skip)

    def _send(self, sub: SubLookup) -> SubLookup:
        cs, n = self._cs, self._n_tokens
        answer = self._ctx.client.lookup(
            sub.lookup_id,
            (),
            skip_tokens=sub.skip * cs,
            hashes=sub.hashes,
            offsets=[min(cs, n - c * cs) for _, c in sub.entries],  # tokens per key's chunk
            # (every chunk is whole but a legacy request's last: answers count its tokens)
            salt=self._salt,  # (hashed already: it names the tenant, for encryption)
            load_policy=self.load_policy,
        )
        sub.sent = True
        self._ctx.statistics.group_lookups += 1
        if answer is not None:
            sub.answer = -(-answer // cs)
        return sub

    def _poll_sub(self, sub: SubLookup) -> int | None:
        if sub.answer is None:
            answer = self._ctx.client.lookup(sub.lookup_id, ())
            if answer is not None:
                sub.answer = -(-answer // self._cs)
        return sub.answer

    def _chunk_hashes(self, num_tokens: int) -> list[int]:
        """Chain hashes of the chunks of the request's first ``num_tokens`` tokens (cached: a
        request's tokens only grow, and a whole chunk's hash never changes; a trailing partial
        chunk's hash is reused only for the same token count)."""
        want = self._ctx.hasher.num_chunks(num_tokens)
        whole = num_tokens // self._cs
        if num_tokens == self._hashed_tokens or (
            want == whole and whole <= self._hashed_tokens // self._cs
        ):
            return self._hashes[:want]
        tokens = list(self.request.all_token_ids[:num_tokens])
        self._hashes = self._ctx.hasher.hash(tokens, self._salt)
        self._hashed_tokens = num_tokens
        return self._hashes

    # -- the hit ----------------------------------------------------------------------------
    def poll(self) -> int | None:
        """The hit in tokens from token 0 (at least vLLM's own whole chunks), or ``None``
        while a lookup it needs is pending."""
        if self.result is not None:
            return self.result
        b = self.cap
        if self._prefix is not None:
            answer = self._poll_sub(self._prefix)
            if answer is None:
                return None
            b = min(answer // len(self._full), b)  # every full group of a chunk
        while b > self.skip:  # each lower boundary is checked again by the groups before
            allowed = self._window_allows(b)
            if allowed == b:
                allowed = self._state_allows(b)
            if allowed is None:
                return None
            if allowed == b:
                return self._finish(b)
            b = allowed
        return self._finish(self.skip)

    def wait(self, timeout_s: float) -> int | None:
        """Block until the hit is known (:meth:`poll`), waiting on each pending lookup's answer
        in turn, or until ``timeout_s`` passes (``None``).  For tests, benchmarks and
        synchronous callers, like :meth:`LookupClient.wait <lmprefetch.client.LookupClient.wait>`
        it waits on the client's condition; the scheduler's path never calls it."""
        deadline = time.monotonic() + timeout_s
        while (hit := self.poll()) is None:
            pending = [sub for sub in self.lookups if sub.sent and sub.answer is None]
            left = deadline - time.monotonic()
            if not pending or left <= 0:
                return None
            self._ctx.client.wait(pending[0].lookup_id, left)
        return hit

    def _window_range(self, b: int, groups: list[KVGroup]) -> tuple[int, int]:
        """The chunks ``[lo, b)`` a window set needs below boundary ``b`` (in chunks)."""
        first = min(g.first_needed_token(b * self._cs) for g in groups)
        return max(self.skip, first // self._cs), b

    def _window_allows(self, b: int) -> int | None:
        """``b`` if every window group's chunks under the window before ``b`` are there, else
        the highest boundary below ``b`` they allow (checked again by the caller); ``None``
        while pending.  Every window set is asked (their lookups run side by side)."""
        self._window_used = {}
        allowed: int | None = b
        for key, groups in self._window_sets.items():
            got = self._window_set_allows(b, key, groups)
            allowed = None if got is None or allowed is None else min(allowed, got)
        return allowed

    def _window_set_allows(self, b: int, key: tuple[int, int], groups: list[KVGroup]) -> int | None:
        lo, hi = self._window_range(b, groups)
        if lo >= hi:
            return b
        g = len(groups)
        for sub in self._windows:
            if sub.window != key or sub.lo > lo or sub.hi < hi:
                continue
            answer = self._poll_sub(sub)
            if answer is None:
                return None
            if answer < sub.skip:
                return self.skip  # the lookup failed or timed out: no window, no hit
            verified = answer // g  # chunks present contiguously from 0 (skipped counted)
            if verified >= hi:
                self._window_used[key] = sub
                return b
            if verified >= lo:
                return verified  # chunk `verified` is missing: the boundary cannot pass it
            # The first missing chunk lies below the range this boundary needs: ask again.
        entries = [(grp, c) for c in range(hi) for grp in groups]
        lookup_id = f"{self.request.request_id}|lmp-w{key[0]}.{lo}-{hi}"
        sub = self._make(lookup_id, entries, lo * g)
        sub.lo, sub.hi, sub.window = lo, hi, key
        self._windows.append(self._send(sub))
        return self._window_set_allows(b, key, groups) if sub.answer is not None else None

    def _state_allows(self, b: int) -> int | None:
        """``b`` if the Mamba groups' states at ``b`` are there, else the highest boundary
        below it with states (``skip`` when none); ``None`` while a candidate is pending."""
        if not self._mamba:
            return b
        for x in range(b, self.skip, -1):
            if x not in self._states:  # look up the states at x and the next ones below it
                for y in range(x, max(self.skip, x - STATE_CANDIDATES), -1):
                    if y not in self._states:
                        self._states[y] = self._send(self._state_lookup(y))
            answer = self._poll_sub(self._states[x])
            if answer is None:
                return None
            if answer >= len(self._mamba):
                return x
        return self.skip

    def _state_lookup(self, boundary: int) -> SubLookup:
        """The lookup of every Mamba group's state at ``boundary`` (in chunks): the state
        after chunk ``boundary - 1`` is stored under that chunk's hash."""
        entries = [(g, boundary - 1) for g in self._mamba]
        return self._make(f"{self.request.request_id}|lmp-s{boundary}", entries, 0)

    def _finish(self, b: int) -> int:
        """Settle on boundary ``b`` (chunks): keep the lookups it loads from, release the
        others on every worker now, and note what the workers hold."""
        self.result = min(b * self._cs, self._n_tokens)
        used: list[SubLookup] = []
        if b > self.skip:
            if self._prefix is not None:
                used.append(self._prefix)
            for key, groups in self._window_sets.items():
                lo, hi = self._window_range(b, groups)
                if lo < hi:
                    used.append(self._window_used[key])
            if self._mamba:
                used.append(self._states[b])
        self.used = used
        for sub in self.lookups:
            if not any(sub is u for u in used):
                self._release(sub)
        # Which of the looked-up chunks every rank holds (may_load_async's answer).
        first, found = self.skip, self.result // self._cs
        self._ctx.known.held(self._hashes[first:found])
        if self.max_load_tokens is None:  # (a capped lookup probed only the chunks under it)
            self._ctx.known.gone(self._hashes[max(found, first) :])
        return self.result

    # -- vLLM's questions -----------------------------------------------------------------
    def may_load_async(self) -> bool:
        """True when lmprefetch has a hit for the request that it will load: its lookups
        answered one, or (still pending: vLLM asks right after arrival) the first chunk past
        vLLM's own hit is one the workers were last known to hold (:mod:`.known`).  vLLM then
        queues the request for asynchronous loads, and its hit is loaded asynchronously."""
        if not self.load_ok or self._consumed:
            return False
        if self.result is not None:
            likely = self.held
        else:
            likely = self.skip < len(self._hashes) and self._hashes[self.skip] in self._ctx.known
        self._queued_async = likely
        return likely

    def matched(self, num_computed_tokens: int) -> tuple[int | None, bool]:
        """``get_num_new_matched_tokens``: the tokens past vLLM's ``num_computed_tokens`` it
        can load, keeping at least one to compute (``None`` while pending), and whether the
        load is asynchronous.

        The request is looked up again when it comes back after its hit was used (preempted,
        or a failed load reset it), when vLLM's own hit has shrunk below the chunks the
        lookups skipped (the hit would leave a gap), and when the hit is too old to trust (the
        workers may release it, after ``claim_ttl_s``, before the step claims it)."""
        if not self.load_ok:
            return 0, False
        self._num_computed = num_computed_tokens
        stats = self._ctx.statistics
        if self._consumed:
            stats.lookup_restarts += 1
            self._queued_async = False  # vLLM put it back in its ordinary waiting queue
            self.start(num_computed_tokens)
        hit = self.poll()
        stale_after_s = self._ctx.claim_ttl_s * STALE_ANSWER_FRACTION
        if hit is not None and (
            num_computed_tokens < self.skip * self._cs
            or (self.held and _now() - self._started_at > stale_after_s)
        ):
            stats.lookup_restarts += 1
            self.start(num_computed_tokens)
            hit = self.poll()
        if hit is None:
            return None, False
        n_tokens = self.request.num_tokens
        external = max(min(hit - num_computed_tokens, n_tokens - 1 - num_computed_tokens), 0)
        if self.max_load_tokens is not None and external > self.max_load_tokens:
            external = self.max_load_tokens  # (a hybrid hit is capped at a chunk boundary)
            stats.load_cap_cut += 1
        return external, self.asynchronous and external > 0

    # -- allocation: the load --------------------------------------------------------------
    def plan_load(self, blocks: KVCacheBlocks, num_external_tokens: int) -> LoadSpec | None:
        """``update_state_after_alloc``: the load of the ``num_external_tokens`` vLLM accepted
        (into ``blocks``), or ``None`` when nothing is loaded (the lookups are released).

        Only the first call after an ask counts (vLLM calls again, with 0 tokens, once an
        asynchronous load is done)."""
        if not self.load_ok or self._consumed:
            return None
        self._consumed = True
        hit = self.result or 0
        if self.save_ok:
            self.saved_tokens = max(self.saved_tokens, hit // self._cs * self._cs)
        if num_external_tokens <= 0:
            self.release()
            return None
        req_id = self.request.request_id
        start = self._num_computed
        end = start + num_external_tokens
        # A hybrid hit is the boundary every group agreed on, and nothing else (vLLM may
        # lower the count it accepts); a legacy one can be loaded up to any token below it
        # (vLLM never raises the count).
        claims = None
        if end == hit or (self._groups.legacy and end < hit):
            claims = self._claims(blocks.get_block_ids(), start, end)
        stats = self._ctx.statistics
        if claims is None:
            # vLLM's blocks (or token count) do not match the lookups: load nothing and
            # report the load as failed (vLLM recomputes under "recompute").
            log.warning(
                "request %s: cannot load tokens [%d, %d) into vLLM's blocks as looked up "
                "(hit %s); reporting the load as failed", req_id, start, end, hit,
            )  # fmt: skip
            self.release()
            claims = []
        else:
            self._sources = self._split_sources(start, end)
            for sub in self.used:  # the workers keep what they hold for the step's claim
                self._forget(sub)
            self.loaded_to = end
            stats.lookup_hits += 1
            stats.hit_tokens += end - start
        return LoadSpec(req_id, start, end, claims, asynchronous=self.asynchronous)

    def _claims(
        self, block_ids: Sequence[Sequence[int]], start: int, end: int
    ) -> list[LookupClaim] | None:
        """What each lookup the hit uses loads into tokens ``[start, end)``: its keys up to the
        chunk holding token ``end - 1``, each with its rows and their blocks; ``None`` if
        vLLM's blocks do not fit the plan."""
        boundary = -(-end // self._cs)
        announced = self._groups.announced
        claims = []
        for sub in self.used:
            keys = []
            for (group, chunk), key_hash in zip(sub.entries[sub.skip :], sub.hashes[sub.skip :]):
                if group.kind != "mamba" and chunk >= boundary:
                    break  # held past the load: released with the claim
                if group.index >= len(block_ids):
                    return None
                planned = rows_to_load(group, chunk, self._cs, block_ids[group.index], start, end)
                if planned is None:
                    return None
                rows, dest = planned
                name = self._name(chunk) if group is announced else None
                keys.append(KeyBlocks(key_hash, group.index, dest, rows, name))
            claims.append(LookupClaim(sub.lookup_id, keys))
        return claims

    def _split_sources(self, start: int, end: int) -> dict[str, int]:
        """Tokens ``[start, end)`` of the hit by the tier that served their full-attention
        chunks (the prefix lookup's split, read before the lookup is forgotten)."""
        prefix = self._prefix
        tiers = self._ctx.client.tier_tokens(prefix.lookup_id) if prefix is not None else []
        g = len(self._full)
        out: dict[str, int] = {}
        lo = self.skip * self._cs  # the split covers the keys past the skipped chunks
        for tier, n in tiers:
            hi = lo + n // g  # keys interleave the full groups
            got = min(hi, end) - max(lo, start)
            if got > 0:
                out[tier] = out.get(tier, 0) + got
            lo = hi
        return out

    def hit_sources(self, num_external_tokens: int) -> dict[str, int]:
        """The tokens of the load just planned by the tier that served them (tier names; what
        the split does not cover is under ``""``); they sum to ``num_external_tokens``."""
        sources = dict(self._sources)
        known = sum(sources.values())
        if known > num_external_tokens:  # never expected: trust the count vLLM has
            return {"": num_external_tokens}
        if known < num_external_tokens:
            sources[""] = num_external_tokens - known
        return {k: v for k, v in sources.items() if v > 0}

    # -- every step: the saves ---------------------------------------------------------------
    def plan_save(
        self,
        n_scheduled: int,
        state_offers: Sequence[tuple[int, int, int]],
        manager: KVCacheManager,
    ) -> SaveSpec | None:
        """The keys this step completes (``request.num_computed_tokens`` is still the pre-step
        count here): each attention group's prompt chunks whose blocks are all real (a
        sliding-window chunk partly out of the window, its blocks already vLLM's null block, is
        not saved), and the Mamba states vLLM offers (``(group, block, boundary tokens)``,
        ``kv_connector_block_state.boundary_state_offloads``) at chunk boundaries past the
        loaded ones, each under the hash of the chunk ending there."""
        req, cs = self.request, self._cs
        prompt = int(req.num_prompt_tokens)
        done = min(int(req.num_computed_tokens) + n_scheduled, prompt)
        partial_tail = done == prompt and self._ctx.hasher.save_partial_chunks
        end = max(done if partial_tail else done // cs * cs, self.saved_tokens)
        if end == self.saved_tokens and not state_offers:
            return None
        hashes = self._chunk_hashes(max(end, prompt // cs * cs))
        block_ids = manager.get_block_ids(req.request_id)
        first, last = self.saved_tokens // cs, -(-end // cs)
        announced = self._groups.announced
        keys: list[KeyBlocks] = []
        attention = [g for g in self._groups.groups if g.kind != "mamba"]
        for c in range(first, last):
            for g in attention:
                per_chunk = cs // g.block_size
                rows = -(-(min((c + 1) * cs, end) - c * cs) // g.block_size)
                ids = list(block_ids[g.index][c * per_chunk : c * per_chunk + rows])
                if len(ids) < rows or NULL_BLOCK in ids:
                    continue
                name = self._name(c) if g is announced else None
                keys.append(
                    KeyBlocks(self._groups.key_hash(g, hashes[c]), g.index, ids, None, name)
                )
        by_index = {g.index: g for g in self._mamba}
        for group_index, block, boundary in state_offers:
            mamba = by_index.get(group_index)
            if (
                mamba is not None
                and block != NULL_BLOCK
                and boundary % cs == 0
                and self.loaded_to < boundary <= len(hashes) * cs
            ):
                chain_hash = hashes[boundary // cs - 1]
                keys.append(
                    KeyBlocks(self._groups.key_hash(mamba, chain_hash), group_index, [block])
                )
        self._ctx.known.held(hashes[first:last])
        self.saved_tokens = end
        if not keys:
            return None
        self._ctx.statistics.save_chunks_planned += len(keys)
        return SaveSpec(req.request_id, keys, self._tenant)

    def _name(self, chunk: int) -> ChunkBlocks | None:
        """vLLM's name of chunk ``chunk`` for KV events (``None`` when events are off)."""
        block_size = self._ctx.hash_block_size
        if block_size is None:
            return None
        return chunk_blocks(self.request, chunk, self._cs, block_size)

    # -- finish ----------------------------------------------------------------------------
    def release(self) -> None:
        """Release every lookup still registered: cancel (on every worker, now) what may hold
        keys, forget the others.  Idempotent."""
        for sub in self.lookups:
            self._release(sub)

    def _release(self, sub: SubLookup) -> None:
        if sub.sent and sub.held:
            self._ctx.client.cancel(sub.lookup_id)
        self._forget(sub)

    def _forget(self, sub: SubLookup) -> None:
        if sub.sent:
            self._ctx.client.forget(sub.lookup_id)
            sub.sent = False


def rows_to_load(
    group: KVGroup,
    chunk: int,
    chunk_size: int,
    block_ids: Sequence[int],
    start_token: int,
    end_token: int,
) -> tuple[list[int], list[int]] | None:
    """Rows of ``group``'s chunk ``chunk`` a load of tokens ``[start_token, end_token)``
    copies, and their destination blocks; ``None`` when a block the load must fill is missing
    (a plan vLLM cannot have made).

    Attention groups: the rows of the chunk's blocks from ``start_token`` (block aligned) up
    to the one holding token ``end_token - 1``, less a sliding window's rows before it needs
    them (vLLM's null block there).  Mamba: the state at the boundary goes into the boundary's
    block and into every block after it already allocated (vLLM copies the boundary state into
    the running block before the connector loads, so both must hold it)."""
    bs = group.block_size
    if group.kind == "mamba":
        j = end_token // bs - 1
        if j >= len(block_ids) or block_ids[j] == NULL_BLOCK:
            return None
        into = [b for b in block_ids[j:] if b != NULL_BLOCK]
        return [0] * len(into), into
    per_chunk = chunk_size // bs
    base = chunk * per_chunk  # the chunk's first block
    first = max(base, -(-start_token // bs), group.first_needed_token(end_token) // bs)
    last = min(base + per_chunk, -(-end_token // bs))
    if last <= first:
        return [], []
    if last > len(block_ids):
        return None
    # vLLM will not read a sliding-window block it made its null block.
    rows = [j - base for j in range(first, last) if block_ids[j] != NULL_BLOCK]
    if group.kind == "full" and len(rows) < last - first:
        return None
    return rows, [block_ids[base + r] for r in rows]
