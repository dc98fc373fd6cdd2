"""Token ids → chunks → prefix-chained 64-bit hashes.

Chunk ``i`` covers tokens ``[i*chunk_size, (i+1)*chunk_size)``.  Its hash is a digest of the
previous chunk's hash and the chunk's token ids, so one hash names the whole prefix up to and
including that chunk.  Token ids are hashed as little-endian signed 64-bit integers; the digest is
truncated to 8 bytes and read as an unsigned big-endian integer (a msgpack ``uint64``).  Nothing
depends on ``PYTHONHASHSEED``: the scheduler and every worker process compute the same hashes.

With ``save_partial_chunks=False`` (the default, LMCache's ``save_unfull_chunk=False``) a trailing
chunk shorter than ``chunk_size`` is dropped: never stored, never looked up.

Pure functions of their arguments: nothing here does I/O or awaits.
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from collections.abc import Sequence
from typing import Any

from .config import HASH_ALGORITHMS

__all__ = ["ChunkHasher"]

_PERSON = b"lmprefetch.v1"  # blake2b personalisation: our hashes never equal another scheme's
_ROOT = b"\x00" * 8  # the "previous hash" of chunk 0


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

    def num_chunks(self, num_tokens: int) -> int:
        """How many chunks (and hashes) ``num_tokens`` tokens make."""
        full, rest = divmod(num_tokens, self.chunk_size)
        return full + (1 if rest and self.save_partial_chunks else 0)

    def hash(self, token_ids: Sequence[int] | Any) -> list[int]:
        """One prefix-chained 64-bit hash per chunk.

        ``token_ids`` may be a list of ints, an ``array``, a numpy array or a torch tensor
        (anything that converts to a flat sequence of integers).
        """
        data = _token_bytes(token_ids)
        n_tokens = len(data) // 8
        n_chunks = self.num_chunks(n_tokens)
        step = self.chunk_size * 8
        out: list[int] = []
        prev = _ROOT
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

    def spans(self, token_ids: Sequence[int] | Any) -> list[tuple[int, int, int]]:
        """``(start, end, hash)`` per chunk; ``end - start`` is the chunk's token count."""
        hashes = self.hash(token_ids)
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
