"""Token ids → chunks → prefix-chained 64-bit hashes.

Chunk ``i`` covers tokens ``[i*chunk_size, (i+1)*chunk_size)``.  Its hash is a digest of the
previous chunk's hash and the chunk's token ids, so one hash names the whole prefix up to and
including that chunk.  Token ids are hashed as little-endian signed 64-bit integers; the digest is
truncated to 8 bytes and read as an unsigned big-endian integer (a msgpack ``uint64``).  Nothing
depends on ``PYTHONHASHSEED``: the scheduler and every worker process compute the same hashes.

With ``save_partial_chunks=False`` (the default, LMCache's ``save_unfull_chunk=False``) a trailing
chunk shorter than ``chunk_size`` is dropped: never stored, never looked up.

Tenants (salts).  A prompt may be hashed under a *salt*: bytes naming the name space its KV
belongs to (vLLM's ``cache_salt``, a LoRA adapter; :func:`tenant_salt` builds it).  The salt
replaces the all-zero "previous hash" of chunk 0 by a digest of the salt, so chunk 0's hash
differs from the unsalted one and, through the chain, so does every later chunk's: a salted
prompt shares no key with the unsalted prompt or with the same prompt under another salt.
Without a salt (``None``) the hashes are exactly those of earlier releases.  The salt itself
never leaves the process that hashes: workers only ever see the salted hashes.

Pure functions of their arguments: nothing here does I/O or awaits.
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from collections.abc import Sequence
from typing import Any

from .config import HASH_ALGORITHMS, PrefetchConfig

__all__ = ["ChunkHasher", "tenant_salt"]

_PERSON = b"lmprefetch.v1"  # blake2b personalisation: our hashes never equal another scheme's
_ROOT = b"\x00" * 8  # the "previous hash" of chunk 0 (unsalted)
_SALT_PERSON = b"lmprefetch.salt"  # a salt's digest never equals a chunk hash of the same bytes


class ChunkHasher:
    """Split token ids into chunks and hash them with a prefix chain.

    Args:
        chunk_size: tokens per chunk (at least 1).
        algorithm: ``"blake2b"`` (default, fastest) or ``"sha256"``.
        save_partial_chunks: also hash a trailing partial chunk.
    """

    __slots__ = ("algorithm", "chunk_size", "save_partial_chunks")

    def __init__(
        self, chunk_size: int, algorithm: str = "blake2b", save_partial_chunks: bool = False
    ) -> None:
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size: must be a positive int, got {chunk_size!r}")
        if algorithm not in HASH_ALGORITHMS:
            raise ValueError(f"algorithm: must be one of {HASH_ALGORITHMS}, got {algorithm!r}")
        self.chunk_size = chunk_size
        self.algorithm = algorithm
        self.save_partial_chunks = save_partial_chunks

    @classmethod
    def from_config(cls, config: PrefetchConfig) -> ChunkHasher:
        """The hasher ``config`` describes (``chunk_size``, ``hash_algorithm``,
        ``save_partial_chunks``): what the scheduler side and every worker must agree on."""
        return cls(config.chunk_size, config.hash_algorithm, config.save_partial_chunks)

    def num_chunks(self, num_tokens: int) -> int:
        """How many chunks (and hashes) ``num_tokens`` tokens make."""
        full, rest = divmod(num_tokens, self.chunk_size)
        return full + (1 if rest and self.save_partial_chunks else 0)

    def root(self, salt: bytes | None = None) -> bytes:
        """The 8-byte "previous hash" chunk 0 is chained to: all zeros without a salt, else a
        digest of the salt (blake2b with its own personalisation, or the first 8 bytes of
        sha256 over ``b"lmprefetch.salt" + salt``, following ``algorithm``).

        Raises:
            ValueError: ``salt`` is not bytes (or is empty: use ``None`` for no salt).
        """
        if salt is None:
            return _ROOT
        if not isinstance(salt, (bytes, bytearray, memoryview)) or not len(salt):
            raise ValueError(f"salt: must be non-empty bytes or None, got {salt!r}")
        if self.algorithm == "blake2b":
            return hashlib.blake2b(bytes(salt), digest_size=8, person=_SALT_PERSON).digest()
        return hashlib.sha256(_SALT_PERSON + bytes(salt)).digest()[:8]

    def hash(self, token_ids: Sequence[int] | Any, salt: bytes | None = None) -> list[int]:
        """One prefix-chained 64-bit hash per chunk.

        ``token_ids`` may be a list of ints, an ``array``, a numpy array or a torch tensor
        (anything that converts to a flat sequence of integers).  ``salt`` (see
        :func:`tenant_salt`) puts the prompt in its own name space: every hash differs from
        the unsalted ones and from those under any other salt.
        """
        prev = self.root(salt)
        data = _token_bytes(token_ids)
        n_tokens = len(data) // 8
        n_chunks = self.num_chunks(n_tokens)
        step = self.chunk_size * 8
        out: list[int] = []
        mv = memoryview(data)
        if self.algorithm == "blake2b":
            blake2b = hashlib.blake2b
            for i in range(n_chunks):
                b = blake2b(prev, digest_size=8, person=_PERSON)
                b.update(mv[i * step : (i + 1) * step])
                prev = b.digest()
                out.append(int.from_bytes(prev, "big"))
        else:
            sha256 = hashlib.sha256
            for i in range(n_chunks):
                s = sha256(prev)
                s.update(mv[i * step : (i + 1) * step])
                prev = s.digest()[:8]
                out.append(int.from_bytes(prev, "big"))
        return out

    def spans(
        self, token_ids: Sequence[int] | Any, salt: bytes | None = None
    ) -> list[tuple[int, int, int]]:
        """``(start, end, hash)`` per chunk; ``end - start`` is the chunk's token count."""
        hashes = self.hash(token_ids, salt)
        n_tokens = _length(token_ids)
        cs = self.chunk_size
        return [(i * cs, min((i + 1) * cs, n_tokens), h) for i, h in enumerate(hashes)]

    def offsets(self, num_tokens: int) -> list[int]:
        """Tokens per chunk (the wire's ``offsets``) for a prompt of ``num_tokens`` tokens."""
        full, rest = divmod(num_tokens, self.chunk_size)
        out = [self.chunk_size] * full
        if rest and self.save_partial_chunks:
            out.append(rest)
        return out


def tenant_salt(
    cache_salt: str | None = None,
    lora_name: str | None = None,
    lora_identity: str | None = None,
) -> bytes | None:
    """The salt of one tenant's name space, or ``None`` when nothing sets one.

    The parts are encoded unambiguously, each as a one-byte tag, its UTF-8 length (4 bytes,
    big-endian) and its UTF-8 bytes, in this order: ``b"s"`` + ``cache_salt``, ``b"l"`` +
    ``lora_name``, ``b"i"`` + ``lora_identity``; a part that is ``None`` or empty is left
    out.  So two requests share a name space exactly when they have the same cache salt, the
    same adapter name and the same adapter identity, and no choice of strings can make one
    tenant's salt equal another's.

    Args:
        cache_salt: vLLM's per-request ``cache_salt`` (a tenant's secret).
        lora_name: the LoRA adapter's name.
        lora_identity: what tells two adapters of the same name apart (the vLLM connector uses
            a digest of the adapter's files, or its path; see ``docs/tenancy-and-events.md``).
    """
    out = bytearray()
    for tag, part in ((b"s", cache_salt), (b"l", lora_name), (b"i", lora_identity)):
        if part is None or part == "":
            continue
        if not isinstance(part, str):
            raise ValueError(f"tenant_salt: parts must be str or None, got {part!r}")
        data = part.encode("utf-8")
        out += tag + len(data).to_bytes(4, "big") + data
    return bytes(out) if out else None


def _length(token_ids: Any) -> int:
    shape = getattr(token_ids, "shape", None)
    if shape is not None and len(shape) == 1:
        return int(shape[0])
    return len(token_ids)


def _token_bytes(token_ids: Any) -> bytes:
    """The token ids as packed little-endian int64 bytes."""
    if isinstance(token_ids, (list, tuple)):
        try:
            # struct.pack is about twice as fast as array("q", ...) for a list of ints.
            return struct.pack(f"<{len(token_ids)}q", *token_ids)
        except (struct.error, OverflowError, TypeError) as exc:
            raise ValueError(f"token_ids: must be 64-bit integers ({exc})") from None
    if isinstance(token_ids, array):
        return array("q", token_ids).tobytes() if _LITTLE else _swap(array("q", token_ids))
    # numpy arrays and torch tensors: go through numpy without a Python-level loop.
    if hasattr(token_ids, "numpy") and hasattr(token_ids, "detach"):
        token_ids = token_ids.detach().cpu().numpy()
    if hasattr(token_ids, "astype") and hasattr(token_ids, "tobytes"):
        arr = token_ids.reshape(-1)
        if arr.dtype.kind not in "iu":
            raise ValueError(f"token_ids: must be integers, got dtype {arr.dtype}")
        return bytes(arr.astype("<i8", copy=False).tobytes())
    return _token_bytes(list(token_ids))


_LITTLE = array("q", [1]).tobytes()[0] == 1


def _swap(a: array[int]) -> bytes:  # pragma: no cover - big-endian hosts only
    a.byteswap()
    return a.tobytes()
