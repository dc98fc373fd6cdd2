"""How far a request on a hybrid model can be served: the hit every KV cache group agrees on.

A hit of ``b`` tokens (``b`` a chunk boundary) needs, in every group, what that group reads to
go on from token ``b`` (:meth:`KVGroup.first_needed_token`):

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
round trip.  Every lookup is an ordinary lmprefetch lookup of the request's engine (its id is
the request id plus a suffix): the workers hold what they loaded until the step claims it or
the scheduler cancels it, and each lookup's answer is the contiguous run of keys it found,
counted here in keys (every key's "tokens" are ``chunk_size``).

This is the one place the hit of a hybrid request is decided (:meth:`HybridLookup.poll`); a
load-or-recompute policy would cap the candidate boundary here.

Threads: the scheduler's; nothing here blocks (polls are dictionary reads in the client).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .groups import KVGroup, KVGroups, group_hash

if TYPE_CHECKING:
    from ...client import LookupClient

__all__ = ["STATE_CANDIDATES", "HybridLookup", "SubLookup"]

#: Mamba state boundaries probed per round (each a lookup of one key per Mamba group).
STATE_CANDIDATES = 8


@dataclass
class SubLookup:
    """One lookup a hybrid hit is built from.

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
    sent: bool = field(default=False, repr=False)

    @property
    def held(self) -> bool:
        """The workers may hold keys loaded for it (answered past the skipped ones)."""
        return self.answer is None or self.answer > self.skip


class HybridLookup:
    """The lookups of one request on a hybrid model, and the hit they converge to.

    Args:
        req_id: vLLM's request id (the lookups' ids extend it).
        client: the scheduler side's lookup client.
        groups: the model's groups (hybrid).
        chunk_size: tokens per chunk (a multiple of every group's block size).
        chain_hashes: the request's chain hashes (:mod:`lmprefetch.hashing`) of its whole
            chunks, under its tenant's salt.
        num_tokens: the request's token count (a hit leaves at least one to compute).
        local_tokens: vLLM's own prefix-cache hit (block aligned); whole chunks of it are
            skipped.
        on_lookup: called once per lookup sent (a counter).
        max_tokens: the request's cap on loaded tokens (``max_load_tokens``): the boundary
            stays at or below ``local_tokens + max_tokens``.
        salt: the request's salt (its chain hashes are salted already): it names the tenant
            in every lookup, for workers that encrypt per tenant.
    """

    def __init__(
        self,
        req_id: str,
        client: LookupClient,
        groups: KVGroups,
        chunk_size: int,
        chain_hashes: Sequence[int],
        num_tokens: int,
        local_tokens: int,
        on_lookup: Callable[[], None] | None = None,
        max_tokens: int | None = None,
        salt: bytes | None = None,
    ) -> None:
        self.req_id = req_id
        self._salt = salt
        self._client = client
        self._groups = groups
        self._cs = chunk_size
        self._chain = list(chain_hashes)
        self._full = groups.of_kind("full")
        # Sliding-window groups by what they need (window, retained tokens): one window lookup
        # per set, so a group with a short window is not held to a longer one's chunks.
        self._window_sets: dict[tuple[int, int], list[KVGroup]] = {}
        for g in groups.of_kind("sliding_window"):
            key = (g.window or 0, g.extra_retained_tokens)
            self._window_sets.setdefault(key, []).append(g)
        self._mamba = groups.of_kind("mamba")
        self._on_lookup = on_lookup
        #: The highest boundary (in chunks) that leaves a token to compute.
        self.cap = min((max(num_tokens, 1) - 1) // chunk_size, len(self._chain))
        if max_tokens is not None:  # the request's own cap on what is loaded
            self.cap = min(self.cap, (local_tokens + max_tokens) // chunk_size)
        #: Chunks vLLM holds itself (not looked up).
        self.skip = min(local_tokens // chunk_size, self.cap)
        self._prefix: SubLookup | None = None
        self._windows: list[SubLookup] = []
        self._states: dict[int, SubLookup] = {}
        #: The converged hit in tokens (from token 0), once known.
        self.result: int | None = None
        #: The lookups whose keys the hit loads (window and state: the ones that decided).
        self.used: list[SubLookup] = []
        #: The window lookup that verified the current boundary, per window set.
        self._window_used: dict[tuple[int, int], SubLookup] = {}

    # -- the lookups ------------------------------------------------------------------------
    @property
    def lookups(self) -> list[SubLookup]:
        """Every lookup sent for this request (some may be answered, some pending)."""
        subs = [self._prefix] if self._prefix is not None else []
        return [*subs, *self._windows, *self._states.values()]

    def _send(self, sub: SubLookup) -> SubLookup:
        cs = self._cs
        answer = self._client.lookup(
            sub.lookup_id,
            (),
            skip_tokens=sub.skip * cs,
            hashes=sub.hashes,
            offsets=[cs] * len(sub.hashes),
            salt=self._salt,
        )
        sub.sent = True
        if self._on_lookup is not None:
            self._on_lookup()
        if answer is not None:
            sub.answer = answer // cs
        return sub

    def _poll_sub(self, sub: SubLookup) -> int | None:
        if sub.answer is None:
            answer = self._client.lookup(sub.lookup_id, ())
            if answer is not None:
                sub.answer = answer // self._cs
        return sub.answer

    def sources(self, start: int, end: int) -> dict[str, int]:
        """Tokens ``[start, end)`` of the hit by the tier that served their full-attention
        chunks (the prefix lookup's split, while it is live; empty without one)."""
        prefix = self._prefix
        tiers = self._client.tier_tokens(prefix.lookup_id) if prefix is not None else []
        if prefix is None or not tiers:
            return {}
        g = len(self._full)
        out: dict[str, int] = {}
        lo = prefix.skip * self._cs // g  # keys interleave the full groups
        for tier, n in tiers:
            hi = lo + n // g
            got = min(hi, end) - max(lo, start)
            if got > 0:
                out[tier] = out.get(tier, 0) + got
            lo = hi
        return out

    def _make(self, suffix: str, entries: list[tuple[KVGroup, int]], skip: int) -> SubLookup:
        hashes = [group_hash(g.identity, self._chain[c]) for g, c in entries]
        return SubLookup(f"{self.req_id}|lmp-{suffix}", entries, hashes, skip)

    def start(self) -> None:
        """Send the prefix lookup and, speculatively, the window and state lookups for the
        highest boundary (nothing when no boundary is above vLLM's own hit)."""
        if self.cap <= self.skip:
            self.result = self.skip * self._cs
            return
        if self._full:
            entries = [(g, c) for c in range(self.cap) for g in self._full]
            self._prefix = self._send(self._make("full", entries, self.skip * len(self._full)))
        # Speculatively, what the highest boundary needs besides the prefix: a repeated
        # prompt is then answered in one round trip.
        self._window_allows(self.cap)
        if self._mamba and self.cap not in self._states:
            self._states[self.cap] = self._send(self._state_lookup(self.cap))
        self.poll()

    # -- convergence ------------------------------------------------------------------------
    def poll(self) -> int | None:
        """The hit in tokens from token 0 (a chunk boundary; at most vLLM's own hit when
        nothing more can be served), or ``None`` while a lookup it needs is pending."""
        if self.result is not None:
            return self.result
        if self._prefix is not None:
            answer = self._poll_sub(self._prefix)
            if answer is None:
                return None
            # Entries from 0: every full group of a chunk must be there.
            b = min(answer // len(self._full), self.cap)
        else:
            b = self.cap
        while True:
            if b <= self.skip:
                return self._finish(self.skip)
            allowed = self._window_allows(b)
            if allowed is None:
                return None
            if allowed < b:
                b = allowed
                continue
            allowed = self._state_allows(b)
            if allowed is None:
                return None
            if allowed < b:
                b = allowed
                continue
            return self._finish(b)

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
        sub = self._make(f"w{key[0]}.{lo}-{hi}", entries, lo * g)
        sub.lo, sub.hi, sub.window = lo, hi, key
        self._windows.append(self._send(sub))
        return self._window_set_allows(b, key, groups) if sub.answer is not None else None

    def _state_allows(self, b: int) -> int | None:
        """``b`` if the Mamba groups' states at ``b`` are there, else the highest boundary
        below it with states (``skip`` when none); ``None`` while a candidate is pending."""
        if not self._mamba:
            return b
        for x in range(b, self.skip, -1):
            sub = self._states.get(x)
            if sub is None:
                self._probe_states(x)
                sub = self._states[x]
            answer = self._poll_sub(sub)
            if answer is None:
                return None
            if answer >= len(self._mamba):
                return x
        return self.skip

    def _probe_states(self, top: int) -> None:
        """Look up the states at ``top`` and the next boundaries below it (not yet probed)."""
        for x in range(top, max(self.skip, top - STATE_CANDIDATES), -1):
            if x not in self._states:
                self._states[x] = self._send(self._state_lookup(x))

    def _state_lookup(self, boundary: int) -> SubLookup:
        """The lookup of every Mamba group's state at ``boundary`` (in chunks): the state
        after chunk ``boundary - 1`` is stored under that chunk's hash."""
        return self._make(f"s{boundary}", [(g, boundary - 1) for g in self._mamba], 0)

    def _finish(self, b: int) -> int:
        """Settle on boundary ``b`` (chunks): keep the lookups it loads from, release the
        others on every worker now."""
        self.result = b * self._cs
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
        return self.result

    def _release(self, sub: SubLookup) -> None:
        if not sub.sent:
            return
        if sub.held:
            self._client.cancel(sub.lookup_id)
        else:
            self._client.forget(sub.lookup_id)
        sub.sent = False

    # -- ending ---------------------------------------------------------------------------
    def keep_used(self) -> None:
        """The hit is being loaded: forget the used lookups here (the workers keep what they
        hold for the step's claim)."""
        for sub in self.used:
            if sub.sent:
                self._client.forget(sub.lookup_id)
                sub.sent = False

    def cancel(self) -> None:
        """Release everything still held or pending on every worker (idempotent)."""
        for sub in self.lookups:
            self._release(sub)

    @property
    def held(self) -> bool:
        """Some lookup may still hold or be loading keys on the workers."""
        return any(sub.sent and sub.held for sub in self.lookups)
