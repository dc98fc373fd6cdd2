"""What a request on a hybrid model loads and saves, block by block, in each KV cache group.

Pure functions of vLLM's block ids: the scheduler side calls them to build the step's
:class:`~.metadata.HybridLoadSpec` and :class:`~.metadata.HybridSaveSpec`; the tests call
them directly.  vLLM's null block 0 (out-of-window sliding-window blocks, skipped Mamba states)
is never read from and never written to.
"""

from __future__ import annotations

from collections.abc import Sequence

from .groups import KVGroup, KVGroups, group_hash
from .hits import HybridLookup
from .metadata import GroupClaim, GroupRows

__all__ = ["SaveItem", "plan_hybrid_load", "plan_hybrid_saves"]

NULL_BLOCK = 0


def _rows_to_load(
    group: KVGroup,
    chunk: int,
    chunk_size: int,
    block_ids: Sequence[int],
    start_token: int,
    end_token: int,
) -> tuple[list[int], list[int]] | None:
    """Rows of ``group``'s chunk ``chunk`` to copy, and their destination blocks; ``None`` when a
    block the load must fill is missing (a plan vLLM cannot have made)."""
    bs = group.block_size
    if group.kind == "mamba":
        # The state at the boundary goes into the boundary's block and into every block
        # after it that is already allocated: vLLM copies the boundary state into the running
        # block before the connector loads (a synchronous load), so both must hold it.
        j = end_token // bs - 1
        if j >= len(block_ids) or block_ids[j] == NULL_BLOCK:
            return None
        into = [b for b in block_ids[j:] if b != NULL_BLOCK]
        return [0] * len(into), into
    per_chunk = chunk_size // bs
    first_needed = group.first_needed_token(end_token)
    rows: list[int] = []
    dest: list[int] = []
    for r in range(per_chunk):
        j = chunk * per_chunk + r
        first, last = j * bs, (j + 1) * bs
        if first < start_token or last > end_token or last <= first_needed:
            continue
        if j >= len(block_ids):
            return None
        block = block_ids[j]
        if block == NULL_BLOCK:
            if group.kind == "full":
                return None
            continue  # vLLM will not read this sliding-window block
        rows.append(r)
        dest.append(block)
    return rows, dest


def plan_hybrid_load(
    lookup: HybridLookup,
    chunk_size: int,
    block_ids: Sequence[Sequence[int]],
    start_token: int,
    end_token: int,
) -> list[GroupClaim] | None:
    """The claims that load tokens ``[start_token, end_token)`` of a hybrid request.

    Args:
        lookup: the request's settled lookups (``end_token`` is its hit).
        chunk_size: tokens per chunk.
        block_ids: vLLM's block ids of the request, one list per KV cache group.
        start_token: the first token to load (vLLM holds the ones before).
        end_token: the hit boundary.

    Returns:
        One claim per lookup the hit uses, or ``None`` if vLLM's blocks do not match the plan
        (the load then fails as a whole).
    """
    boundary = end_token // chunk_size
    claims: list[GroupClaim] = []
    for sub in lookup.used:
        keys: list[GroupRows] = []
        for i in range(sub.skip, len(sub.entries)):
            group, chunk = sub.entries[i]
            if group.kind != "mamba" and chunk >= boundary:
                break  # held past the boundary: released with the claim
            if group.index >= len(block_ids):
                return None
            planned = _rows_to_load(
                group, chunk, chunk_size, block_ids[group.index], start_token, end_token
            )
            if planned is None:
                return None
            keys.append(GroupRows(sub.hashes[i], group.index, *planned))
        claims.append(GroupClaim(sub.lookup_id, keys))
    return claims


class SaveItem:
    """One key to save: its hash, group and blocks; ``chunk`` is the chunk it belongs to (for
    KV events), ``announce`` whether it names the chunk in KV events."""

    __slots__ = ("announce", "block_ids", "chunk", "chunk_hash", "group")

    def __init__(
        self, chunk_hash: int, group: int, block_ids: list[int], chunk: int, announce: bool
    ) -> None:
        self.chunk_hash = chunk_hash
        self.group = group
        self.block_ids = block_ids
        self.chunk = chunk
        self.announce = announce


def plan_hybrid_saves(
    groups: KVGroups,
    chunk_size: int,
    chain_hashes: Sequence[int],
    block_ids: Sequence[Sequence[int]],
    first_chunk: int,
    end_chunk: int,
    state_offers: Sequence[tuple[int, int, int]] = (),
    min_state_boundary: int = 0,
) -> list[SaveItem]:
    """The keys of chunks ``[first_chunk, end_chunk)`` and of the Mamba states vLLM offered.

    * Attention groups: a chunk's blocks, when every one of them is a real block (a
      sliding-window chunk partly outside the window, its blocks already vLLM's null block,
      is not saved).
    * Mamba groups: ``state_offers`` are vLLM's hand-offs ``(group, block, boundary tokens)``
      (``kv_connector_block_state.boundary_state_offloads``); a state at a chunk boundary
      ``b`` with ``min_state_boundary < b <= len(chain_hashes) * chunk_size`` is saved under
      the hash of the chunk ending there.  The first full-attention group's chunks are the ones
      KV events announce.

    Args:
        groups: the model's groups.
        chunk_size: tokens per chunk.
        chain_hashes: chain hashes of the request's (prompt) chunks, at least ``end_chunk``.
        block_ids: vLLM's block ids of the request, one list per group.
        first_chunk: the first chunk not saved yet.
        end_chunk: the chunk after the last complete one.
        state_offers: vLLM's Mamba boundary-state hand-offs for the request.
        min_state_boundary: states at or below this many tokens are not saved (loaded
            from lmprefetch in the first place).
    """
    items: list[SaveItem] = []
    full = groups.of_kind("full")
    announced = full[0].index if full else None
    attention = [g for g in groups.groups if g.kind != "mamba"]
    for c in range(first_chunk, end_chunk):
        for g in attention:
            per_chunk = chunk_size // g.block_size
            ids = list(block_ids[g.index][c * per_chunk : (c + 1) * per_chunk])
            if len(ids) < per_chunk or NULL_BLOCK in ids:
                continue
            h = group_hash(g.identity, chain_hashes[c])
            items.append(SaveItem(h, g.index, ids, c, g.index == announced))
    by_index = {g.index: g for g in groups.of_kind("mamba")}
    limit = len(chain_hashes) * chunk_size
    for group_index, block, boundary in state_offers:
        mamba = by_index.get(group_index)
        if (
            mamba is None
            or block == NULL_BLOCK
            or boundary % chunk_size
            or not min_state_boundary < boundary <= limit
        ):
            continue
        c = boundary // chunk_size - 1
        h = group_hash(mamba.identity, chain_hashes[c])
        items.append(SaveItem(h, group_index, [block], c, False))
    return items
