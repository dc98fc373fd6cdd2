"""Codecs for stored chunks: fewer bytes on disk, in Redis and in Mooncake, and per-tenant
encryption at rest.

* :mod:`.format` — the self-describing header of an encoded chunk and the miss exceptions;
* :mod:`.registry` — the codecs by name (:func:`get_codec`) and the decoder of any encoded
  chunk (:func:`decode_into`);
* :mod:`.lossless` — byte planes + zstd; :mod:`.lossy` — ``bitround<N>``, ``fp8``, ``int8``,
  ``int4``;
* :mod:`.encryption` — AES-256-GCM under per-tenant keys derived from the operator's master key;
* :mod:`.stage` — one tier's codec and cipher together (:class:`ChunkStage`): encode on the
  write-behind path, decode into an arena slot on the load path.

Importing this package imports neither numpy nor zstandard nor cryptography: configuration
checks need only the names.  docs/codecs.md has the measurements and the choices.
"""

from __future__ import annotations

from .encryption import DecryptionMiss as DecryptionMiss
from .encryption import KeyFileError as KeyFileError
from .encryption import TenantCipher as TenantCipher
from .encryption import load_master_key as load_master_key
from .encryption import tenant_id as tenant_id
from .format import CodecMiss as CodecMiss
from .format import CorruptEncoding as CorruptEncoding
from .format import UnknownEncoding as UnknownEncoding
from .registry import CODEC_NAMES as CODEC_NAMES
from .registry import DEFAULT_GROUP as DEFAULT_GROUP
from .registry import Codec as Codec
from .registry import codec_problem as codec_problem
from .registry import decode_into as decode_into
from .registry import get_codec as get_codec
from .registry import is_lossy as is_lossy
from .stage import ChunkStage as ChunkStage

__all__ = [
    "CODEC_NAMES",
    "DEFAULT_GROUP",
    "ChunkStage",
    "Codec",
    "CodecMiss",
    "CorruptEncoding",
    "DecryptionMiss",
    "KeyFileError",
    "TenantCipher",
    "UnknownEncoding",
    "codec_problem",
    "decode_into",
    "get_codec",
    "is_lossy",
    "load_master_key",
    "tenant_id",
]
