"""Which name space a vLLM request's KV belongs to, and what vLLM calls its chunks in events.

A request's chunks are hashed under a salt (:func:`~lmprefetch.hashing.tenant_salt`) built from
its ``cache_salt`` and its LoRA adapter, so two tenants (or two adapters) never share a key:

* ``cache_salt`` is vLLM's per-request tenant secret; it is used as given.
* A LoRA adapter is its **name** and its **identity**: a digest of the adapter's files when
  ``lora_path`` is a local directory or file (every regular file at the top of the directory,
  which is all vLLM reads: names, sizes and contents), else the path string itself (e.g. a
  Hugging Face repository id that vLLM's worker resolves).  Two adapters of the same name with
  different weights get different identities; the same adapter copied to another path or
  machine gets the same one, so servers sharing a Redis share its cache.  The digest is computed
  once per (name, path), on the scheduler's thread (reading the adapter once, typically tens of
  milliseconds per 100 MB), and again when a request says ``load_inplace`` (the adapter's files
  were replaced).

Requests with multimodal inputs or prompt embeddings stay uncached: their KV depends on data
the token ids do not name (images, embedding values), and keying it correctly would need those
per-chunk digests chained into the hashes.
"""

from __future__ import annotations

import hashlib
import logging
import os
from typing import TYPE_CHECKING

from ...events import ChunkBlocks
from ...hashing import tenant_salt

if TYPE_CHECKING:
    from vllm.lora.request import LoRARequest
    from vllm.v1.request import Request

__all__ = ["LoraIdentities", "chunk_blocks", "request_salt"]

log = logging.getLogger("lmprefetch.integration.vllm")

_READ_BYTES = 1 << 20


class LoraIdentities:
    """The identity of each LoRA adapter seen, by ``(name, path)`` (see the module docstring)."""

    def __init__(self) -> None:
        self._known: dict[tuple[str, str], str] = {}

    def identity(self, lora_request: LoRARequest) -> str:
        name = str(lora_request.lora_name)
        path = str(getattr(lora_request, "lora_path", "") or "")
        key = (name, path)
        known = self._known.get(key)
        if known is None or getattr(lora_request, "load_inplace", False):
            known = self._known[key] = adapter_identity(path)
        return known


def adapter_identity(path: str) -> str:
    """``"files:<digest>"`` of an adapter's files, or ``"path:<path>"`` when ``path`` is not a
    readable local file or directory."""
    try:
        if os.path.isdir(path):
            files = sorted(e.name for e in os.scandir(path) if e.is_file())
            digest = hashlib.blake2b(digest_size=16, person=b"lmprefetch.lora")
            for name in files:
                _digest_file(digest, name, os.path.join(path, name))
            return "files:" + digest.hexdigest()
        if os.path.isfile(path):
            digest = hashlib.blake2b(digest_size=16, person=b"lmprefetch.lora")
            _digest_file(digest, os.path.basename(path), path)
            return "files:" + digest.hexdigest()
    except OSError as exc:
        log.warning("LoRA adapter %s: cannot read its files (%s); keyed by its path", path, exc)
    return "path:" + path


def _digest_file(digest: hashlib.blake2b, name: str, path: str) -> None:
    raw = name.encode("utf-8")
    digest.update(len(raw).to_bytes(4, "big") + raw)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        digest.update(size.to_bytes(8, "big"))
        while chunk := f.read(_READ_BYTES):
            digest.update(chunk)


def request_salt(request: Request, loras: LoraIdentities) -> bytes | None:
    """The salt of a request's name space, or ``None`` for the shared, unsalted one."""
    cache_salt = getattr(request, "cache_salt", None) or None
    lora = getattr(request, "lora_request", None)
    if lora is None:
        return tenant_salt(cache_salt)
    return tenant_salt(cache_salt, str(lora.lora_name), loras.identity(lora))


def chunk_blocks(request: Request, chunk: int, chunk_size: int, block_size: int) -> ChunkBlocks:
    """How vLLM names chunk ``chunk`` of ``request`` in KV events: the request's own block
    hashes of the chunk's full blocks (as vLLM's routers know them), the chunk's tokens, the
    hash of the block before it, and the LoRA adapter."""
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    per_chunk = chunk_size // block_size
    first = chunk * per_chunk
    hashes = list(request.block_hashes[first : first + per_chunk])
    start = chunk * chunk_size
    tokens = list(request.all_token_ids[start : start + len(hashes) * block_size])
    parent = request.block_hashes[first - 1] if first > 0 else None
    lora = getattr(request, "lora_request", None)
    return ChunkBlocks.make(
        [maybe_convert_block_hash(h) for h in hashes],
        block_size,
        parent_block_hash=None if parent is None else maybe_convert_block_hash(parent),
        token_ids=tokens,
        lora_id=None if lora is None else int(lora.lora_int_id),
        lora_name=None if lora is None else str(lora.lora_name),
    )
