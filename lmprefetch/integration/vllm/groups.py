"""vLLM's KV cache groups as the connector sees them: what each group's blocks hold, what a
chunk of it is stored under, and the chunk size that fits them all.

vLLM's hybrid KV cache manager (HMA) gives every kind of layer its own *group*, each with its
own block table and block size: full attention, sliding-window attention, Mamba / gated
delta-net (GDN) state.  One token position therefore has one block per group, and the groups'
blocks hold different things:

* **full attention**: every token's K/V; a hit needs every chunk before the boundary;
* **sliding window** (window ``W``): only the last ``W - 1`` tokens before the next token
  matter; vLLM keeps full-length, position-aligned block lists whose out-of-window entries
  are its null block 0.  A hit needs the chunks under the window before the boundary;
* **Mamba / GDN** (``mamba_cache_mode="align"``): one recurrent state per block boundary, of
  which vLLM keeps only a few.  A hit needs the state *at* the boundary.

A model with one full-attention group (every non-hybrid model, and any model with HMA off) is
**legacy**: its chunks are stored under the plain chain hash (:mod:`lmprefetch.hashing`),
exactly as before groups existed, so existing caches stay valid.  Every other model is
**hybrid**: each group's chunk ``c`` is stored under its own key, whose hash is the chain hash
of chunk ``c`` mixed with the group's *identity* (:func:`group_hash`, :meth:`KVGroups.key_hash`):
a digest of the group's kind, block size, layer names and per-layer geometry (heads, head size,
dtype, state shapes).
So groups never share a key, two models (or two layouts of one model) never do either, and a
model's chunks from an HMA-off server (one group of every layer, plain hashes) are never
mistaken for an HMA-on server's.  Carrying the group in the hash leaves
:class:`~lmprefetch.keys.ChunkKey` and its string form (the disk tier's file names) unchanged.

Pure functions of their arguments apart from reading vLLM's spec objects.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from ...config import PrefetchConfig

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec

__all__ = [
    "GroupKind",
    "KVGroup",
    "KVGroups",
    "group_hash",
    "read_groups",
    "resolve_chunk_size",
]

GroupKind = Literal["full", "sliding_window", "mamba"]

_IDENTITY_PERSON = b"lmprefetch.grp"  # blake2b personalisation of a group's identity
_HASH_PERSON = b"lmprefetch.gkey"  # ... and of a group's chunk hashes
#: Bumped when what a group's payload holds changes (a stored chunk of another version then
#: simply never hits).
_PAYLOAD_VERSION = "1"


@dataclass(frozen=True)
class KVGroup:
    """One vLLM KV cache group.

    Attributes:
        index: vLLM's group id (the position of the group's block ids in vLLM's tuples).
        kind: ``"full"``, ``"sliding_window"`` or ``"mamba"``.
        block_size: tokens per block of this group.
        layer_names: the group's layers, in vLLM's order.
        window: sliding-window groups: the window in tokens (``None`` otherwise).
        extra_retained_tokens: sliding-window groups: tokens vLLM keeps below the window.
        identity: 16-byte digest of what makes the group's bytes what they are.
    """

    index: int
    kind: GroupKind
    block_size: int
    layer_names: tuple[str, ...]
    window: int | None
    extra_retained_tokens: int
    identity: bytes

    def first_needed_token(self, boundary: int) -> int:
        """The first token whose KV this group needs to go on from ``boundary`` tokens.

        Full attention: 0.  Sliding window: where vLLM's ``SlidingWindowManager`` stops
        skipping (``boundary - W + 1 - extra_retained_tokens``; earlier blocks are its null
        block).  Mamba: ``boundary`` (only the state at the boundary)."""
        if self.kind == "full":
            return 0
        if self.kind == "mamba":
            return boundary
        assert self.window is not None
        return max(0, boundary - self.window + 1 - self.extra_retained_tokens)

    def describe(self) -> str:
        if self.kind == "sliding_window":
            return f"sliding window {self.window} (block {self.block_size})"
        name = "full attention" if self.kind == "full" else "mamba"
        return f"{name} (block {self.block_size})"


@dataclass(frozen=True)
class KVGroups:
    """The model's KV cache groups, read once when the connector is built.

    A request on any model goes the same way (:class:`~.request.ConnectorRequest`); what a
    *legacy* model (one full-attention group) does differently is a property of its groups,
    asked in three places:

    * its keys are the plain chain hashes (:meth:`key_hash`), so caches from before groups
      existed stay valid;
    * its hit may end inside a chunk (a trailing partial chunk, or the last token kept to
      compute): only vLLM's blocks bound it; a hybrid hit ends on a chunk boundary, where
      every group has what it needs;
    * its loads are synchronous for vLLM and a failed one is reported by block, so vLLM
      recomputes from the first lost block; a hybrid load is asynchronous and reported by
      request (vLLM cannot map a block id back to a request when block ids are per group).

    Attributes:
        groups: the groups lmprefetch stores (those vLLM marks for external transfer); one
            full-attention group of ``block_size`` when vLLM gave none (a bare unit test).
        legacy: one full-attention group (see above).
        unsupported: why lmprefetch neither looks up nor saves for this model (a group kind
            it cannot restore), or ``None``.
        block_size: the first group's block size.
    """

    groups: tuple[KVGroup, ...]
    legacy: bool
    unsupported: str | None
    block_size: int

    @property
    def hybrid(self) -> bool:
        return not self.legacy

    def of_kind(self, kind: GroupKind) -> tuple[KVGroup, ...]:
        return tuple(g for g in self.groups if g.kind == kind)

    @property
    def announced(self) -> KVGroup | None:
        """The group whose chunks KV events name (the first full-attention group), if any."""
        full = self.of_kind("full")
        return full[0] if full else None

    def key_hash(self, group: KVGroup, chain_hash: int) -> int:
        """The hash ``group``'s chunk with chain hash ``chain_hash`` is stored under: the chain
        hash itself for a legacy model, else :func:`group_hash`."""
        return chain_hash if self.legacy else group_hash(group.identity, chain_hash)

    @property
    def block_sizes(self) -> tuple[int, ...]:
        return tuple(sorted({g.block_size for g in self.groups})) or (self.block_size,)

    @property
    def block_lcm(self) -> int:
        """The least common multiple of the groups' block sizes: a chunk must be a multiple of
        it so that every chunk boundary is a block boundary in every group."""
        return math.lcm(*self.block_sizes)

    def describe(self) -> str:
        return ", ".join(g.describe() for g in self.groups) or f"block {self.block_size}"


def group_hash(identity: bytes, chain_hash: int) -> int:
    """The hash group ``identity``'s chunk is stored under, for a chunk whose chain hash is
    ``chain_hash``: a keyed 64-bit blake2b digest, so no two groups (and no group and the plain
    chain) share a hash."""
    digest = hashlib.blake2b(
        chain_hash.to_bytes(8, "big"), digest_size=8, key=identity, person=_HASH_PERSON
    ).digest()
    return int.from_bytes(digest, "big")


# -- reading vLLM's groups ---------------------------------------------------------------------
def read_groups(kv_cache_config: KVCacheConfig | None, fallback_block_size: int) -> KVGroups:
    """The connector's view of ``kv_cache_config.kv_cache_groups``.

    Args:
        kv_cache_config: vLLM's ``KVCacheConfig`` (``None`` or no groups: one legacy group of
            ``fallback_block_size``, as in unit tests that build the connector bare).
        fallback_block_size: vLLM's ``cache_config.block_size``.
    """
    specs = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    if not specs:
        bare = KVGroup(0, "full", fallback_block_size, (), None, 0, b"")
        return KVGroups((bare,), True, None, fallback_block_size)
    groups: list[KVGroup] = []
    unsupported: list[str] = []
    for index, group in enumerate(specs):
        if not getattr(group, "enable_kv_transfer", True):
            continue  # vLLM keeps this group out of external KV transfer
        spec = group.kv_cache_spec
        kind, why = _kind_of(spec)
        if kind is None:
            unsupported.append(f"group {index} ({type(spec).__name__}): {why}")
            continue
        layers = tuple(str(n) for n in group.layer_names)
        groups.append(
            KVGroup(
                index=index,
                kind=kind,
                block_size=int(spec.block_size),
                layer_names=layers,
                window=int(spec.sliding_window) if kind == "sliding_window" else None,
                extra_retained_tokens=int(getattr(spec, "extra_retained_tokens", 0) or 0),
                identity=_identity(kind, spec, layers),
            )
        )
    legacy = not unsupported and len(groups) == 1 and groups[0].kind == "full"
    if not groups and not unsupported:
        unsupported.append("no KV cache group takes part in external KV transfer")
    block_size = groups[0].block_size if groups else fallback_block_size
    return KVGroups(
        tuple(groups), legacy, "; ".join(unsupported) if unsupported else None, block_size
    )


def _kind_of(spec: KVCacheSpec) -> tuple[GroupKind | None, str]:
    """A spec's kind, or ``None`` and why lmprefetch cannot restore it.

    Matched by class name (in MRO order), so this module needs no vLLM import and follows
    vLLM's own subclassing (``MLAAttentionSpec`` is a full-attention spec, ...)."""
    names = [c.__name__ for c in type(spec).__mro__]
    first = names[0]
    if first == "UniformTypeKVCacheSpecs":
        # HMA off: every layer in one group, possibly of different sizes (Gemma-4's head dims).
        inner = list(getattr(spec, "kv_cache_specs", {}).values())
        kinds = {_kind_of(s)[0] for s in inner}
        if kinds == {"full"}:
            return "full", ""
        return None, "a uniform group of layers lmprefetch cannot all restore"
    if first in _UNSUPPORTED:
        return None, _UNSUPPORTED[first]
    if "MambaSpec" in names:
        mode = str(getattr(spec, "mamba_cache_mode", "none"))
        if mode != "align":
            return None, (
                f'mamba_cache_mode is "{mode}": vLLM keeps no boundary states to save or '
                "restore (turn prefix caching on: vLLM then sets it to align)"
            )
        if int(getattr(spec, "num_speculative_blocks", 0) or 0):
            return None, "speculative decoding blocks in a Mamba group are not supported"
        return "mamba", ""
    if "SlidingWindowSpec" in names:
        return "sliding_window", ""
    if "FullAttentionSpec" in names:
        return "full", ""
    return None, "an unknown kind of KV cache group"


#: Spec classes lmprefetch does not restore, and why (the docs list them too).
_UNSUPPORTED = {
    "ChunkedLocalAttentionSpec": "chunked local attention",
    "RSWASpec": "a sliding window that evicts a middle gap",
    "CircularBufferSpec": "a ring buffer, not a prefix",
    "SinkFullAttentionSpec": "attention sinks",
    "CrossAttentionSpec": "encoder-decoder cross attention (depends on the encoder input)",
    "EncoderOnlyAttentionSpec": "encoder-only attention",
    "HiSparseHotSpec": "HiSparse host-resident blocks",
    "HiSparseResidentSpec": "HiSparse host-resident blocks",
}


def _identity(kind: str, spec: KVCacheSpec, layers: Sequence[str]) -> bytes:
    """A digest of what makes a group's bytes what they are (see the module docstring)."""
    fields = [f"v={_PAYLOAD_VERSION}", f"kind={kind}", "layers=" + ",".join(layers)]
    fields += _spec_fields(spec)
    text = "\n".join(fields).encode("utf-8")
    return hashlib.blake2b(text, digest_size=16, person=_IDENTITY_PERSON).digest()


_GEOMETRY = (
    "num_kv_heads",
    "head_size",
    "head_size_v",
    "dtype",
    "kv_quant_mode",
    "num_head_slots",
    "state_content_bytes",
    "tokens_per_state",
    "sliding_window",
    "shapes",
    "dtypes",
    "mamba_type",
    "num_heads",
)


def _spec_fields(spec: KVCacheSpec) -> list[str]:
    fields = [f"spec={type(spec).__name__}", f"block={int(spec.block_size)}"]
    inner = getattr(spec, "kv_cache_specs", None)
    if isinstance(inner, dict):  # UniformTypeKVCacheSpecs: every layer's own spec
        for name in sorted(inner):
            fields += [f"layer={name}", *_spec_fields(inner[name])]
        return fields
    for name in _GEOMETRY:
        try:
            value = getattr(spec, name)
        except (AttributeError, NotImplementedError):
            continue
        fields.append(f"{name}={value!s}")
    return fields


# -- the chunk size ------------------------------------------------------------------------
def resolve_chunk_size(
    config: PrefetchConfig, explicit: frozenset[str], groups: KVGroups
) -> PrefetchConfig:
    """``config`` with a chunk size that is a multiple of every group's block size.

    Unset, it is the default rounded up to the groups' least common multiple (256 stays 256
    for blocks of 16 … 256; a 640-token Qwen3-Next block makes it 640).  Set, it must be such
    a multiple already.  Hybrid models also need whole chunks (no ``save_partial_chunks``) and
    one key per chunk (no ``layerwise``).

    Raises:
        ValueError: one line naming the field, and for ``chunk_size`` the value that fits.
    """
    lcm = groups.block_lcm
    fit = -(-config.chunk_size // lcm) * lcm
    if config.chunk_size % lcm:
        if "chunk_size" in explicit:
            sizes = groups.block_sizes
            what = (
                f"vLLM's block size ({lcm})"
                if len(sizes) == 1
                else f"every KV cache group's block size ({groups.describe()}; lcm {lcm})"
            )
            raise ValueError(
                f"chunk_size: {config.chunk_size} is not a multiple of {what}; "
                f"set chunk_size to {fit} (or a multiple of it)"
            )
        config = config.replace(chunk_size=fit)
    if groups.hybrid:
        if config.save_partial_chunks:
            raise ValueError(
                "save_partial_chunks: not supported for hybrid models (a hit must end on a "
                f"block boundary of every KV cache group: {groups.describe()})"
            )
        if config.layerwise:
            raise ValueError(
                f"layerwise: not supported for hybrid models (KV cache groups: {groups.describe()})"
            )
    return config
