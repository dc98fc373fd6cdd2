"""Per-tenant encryption at rest: AES-256-GCM with a key per tenant, bound to the chunk's key.

The operator holds one secret, the **master key**: a file of at least 32 bytes (e.g.
``head -c 32 /dev/urandom > key`` or ``openssl rand -hex 32 > key``; surrounding whitespace is
ignored), named in the configuration and read once at start-up (:func:`load_master_key`: a
missing, unreadable or short file is one line, and the engine does not start).

Each tenant's key is derived from it with HKDF-SHA256 (``cryptography``), the tenant's identity
as HKDF's ``info``: the tenant identity is a digest of the request's salt (vLLM's
``cache_salt`` and LoRA adapter, :func:`tenant_id`), the empty string for requests without one.
Neither the master key nor a tenant key is ever stored or sent.  So a dump of a shared Redis or
Mooncake reveals no KV, and one tenant's key opens no other tenant's chunks.

A sealed chunk is ``b"LKVE"``, a version byte, an algorithm byte (1: AES-256-GCM), a 16-bit
content kind (0: the raw payload, 1: an encoded chunk, see :mod:`.format`), a random 96-bit
nonce, then the ciphertext and GCM's 16-byte tag.  The associated data
(authenticated, not stored) is the envelope's 20-byte prefix, the tenant identity and the
chunk's storage name (``ChunkKey.to_string()``), each length-prefixed: a chunk copied under
another key, opened with another tenant's key, tampered with or truncated fails
authentication, and :meth:`TenantCipher.open_into` raises :class:`DecryptionMiss` (a
:class:`~lmprefetch.codec.format.CodecMiss`: the load stops at that chunk).  It never returns
plaintext it did not authenticate.

Random nonces: under one tenant key, 2**32 chunks keep the chance of a repeated nonce below
2**-32 (NIST SP 800-38D's bound); a deployment that writes more per tenant should rotate the
master key.  Compose with codecs by compressing first (ciphertext does not compress).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import secrets
import stat
import struct
from collections import OrderedDict
from threading import Lock
from typing import Any

from .format import CodecMiss

__all__ = [
    "ENCODED",
    "ENVELOPE",
    "MASTER_KEY_MIN_BYTES",
    "RAW",
    "DecryptionMiss",
    "KeyFileError",
    "TenantCipher",
    "cryptography_missing",
    "is_sealed",
    "load_master_key",
    "tenant_id",
]

MAGIC = b"LKVE"
VERSION = 1
AES_256_GCM = 1
#: What a sealed chunk holds: the payload as it is, or an encoded chunk.
RAW, ENCODED = 0, 1
#: magic, version, algorithm, content kind, nonce.
ENVELOPE = struct.Struct("<4sBBH12s")
TAG_BYTES = 16
MASTER_KEY_MIN_BYTES = 32
_KEY_FILE_MAX_BYTES = 64 * 1024
_HKDF_SALT = b"lmprefetch.chunk-encryption.v1"
_TENANT_PERSON = b"lmprefetch.tent"  # blake2b personalisation (at most 16 bytes)
#: Tenant keys kept derived (HKDF is microseconds, AESGCM's key setup too; this bounds memory).
_CACHED_TENANTS = 4096
EXTRA_HINT = "pip install 'lmprefetch[encryption]'"


class KeyFileError(ValueError):
    """The master key file is missing, unreadable or too short; the message is one line that
    names the file."""


class DecryptionMiss(CodecMiss):
    """A sealed chunk that does not authenticate under this tenant's key and this chunk key
    (another tenant's, moved, tampered, truncated), or a chunk that should be sealed and is
    not."""


def load_master_key(path: str | os.PathLike[str], *, setting: str = "encryption_key_file") -> bytes:
    """The master key in the file ``path``: its bytes as they are, or, for a key written as
    text (printable ASCII, such as ``openssl rand -hex 32``), without surrounding whitespace.
    A binary key is never stripped: 32 random bytes begin or end with a whitespace byte about
    one time in 20, and ``head -c 32 /dev/urandom`` would then make a 31-byte key.

    Raises:
        KeyFileError: the file is missing, unreadable, or holds fewer than 32 bytes; the
            message starts with ``setting`` (the configuration field that named it).
    """
    try:
        with open(path, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):  # a device or a pipe: no key
                raise KeyFileError(
                    f"{setting}: cannot read the key file {str(path)!r} (not a regular file)"
                )
            raw = f.read(_KEY_FILE_MAX_BYTES + 1)
    except (OSError, ValueError) as exc:
        if isinstance(exc, KeyFileError):
            raise
        why = "not found" if isinstance(exc, FileNotFoundError) else _reason(exc)
        raise KeyFileError(f"{setting}: cannot read the key file {str(path)!r} ({why})") from None
    if len(raw) > _KEY_FILE_MAX_BYTES:
        raise KeyFileError(
            f"{setting}: the key file {str(path)!r} is larger than {_KEY_FILE_MAX_BYTES} bytes: "
            "not a key file"
        )
    text = raw.strip()
    key = text if all(0x20 <= b < 0x7F for b in text) else raw
    if len(key) < MASTER_KEY_MIN_BYTES:
        raise KeyFileError(
            f"{setting}: the key file {str(path)!r} holds {len(key)} bytes; at least "
            f"{MASTER_KEY_MIN_BYTES} are needed (e.g. head -c 32 /dev/urandom > FILE)"
        )
    return key


def _reason(exc: Exception) -> str:
    return (exc.strerror if isinstance(exc, OSError) else None) or str(exc)


def cryptography_missing() -> str | None:
    """What to install for encryption, or ``None`` if ``cryptography`` is there."""
    if importlib.util.find_spec("cryptography") is None:
        return f"encryption needs the cryptography package: {EXTRA_HINT}"
    return None


def tenant_id(salt: bytes | None) -> bytes:
    """The tenant identity of a request's salt (:func:`~lmprefetch.hashing.tenant_salt`): a
    16-byte digest that names the tenant without revealing its salt; ``b""`` for the shared,
    unsalted name space."""
    if salt is None:
        return b""
    return hashlib.blake2b(bytes(salt), digest_size=16, person=_TENANT_PERSON).digest()


def is_sealed(blob: bytes | bytearray | memoryview) -> bool:
    """Whether ``blob`` starts like a sealed chunk (says nothing of its authenticity)."""
    return bytes(memoryview(blob)[: len(MAGIC)]) == MAGIC


def _framed(*parts: bytes) -> bytes:
    return b"".join(struct.pack("<I", len(p)) + p for p in parts)


class TenantCipher:
    """Seals and opens chunks under per-tenant keys derived from one master key.

    Thread-safe: tiers call it from their worker threads.  AES-GCM runs in ``cryptography``'s
    native code.

    Args:
        master_key: the operator's secret (:func:`load_master_key`).

    Raises:
        ValueError: ``master_key`` is shorter than 32 bytes, or ``cryptography`` is missing
            (the message says what to install).
    """

    def __init__(self, master_key: bytes) -> None:
        if len(master_key) < MASTER_KEY_MIN_BYTES:
            raise ValueError(f"master_key: at least {MASTER_KEY_MIN_BYTES} bytes")
        try:
            from cryptography.hazmat.primitives.ciphers.aead import AESGCM
        except ImportError:
            raise ValueError(f"encryption needs the cryptography package: {EXTRA_HINT}") from None
        self._aesgcm = AESGCM
        self._master = bytes(master_key)
        self._keys: OrderedDict[bytes, Any] = OrderedDict()
        self._lock = Lock()

    def _cipher(self, tenant: bytes) -> Any:
        with self._lock:
            cipher = self._keys.get(tenant)
            if cipher is not None:
                self._keys.move_to_end(tenant)
                return cipher
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.kdf.hkdf import HKDF

        key = HKDF(algorithm=hashes.SHA256(), length=32, salt=_HKDF_SALT, info=tenant).derive(
            self._master
        )
        cipher = self._aesgcm(key)
        with self._lock:
            self._keys[tenant] = cipher
            while len(self._keys) > _CACHED_TENANTS:
                self._keys.popitem(last=False)
        return cipher

    def seal(
        self,
        plaintext: bytes | bytearray | memoryview,
        *,
        tenant: bytes,
        key_name: bytes,
        content: int = RAW,
    ) -> bytes:
        """``plaintext`` encrypted and authenticated for ``tenant`` under the chunk key
        ``key_name`` (``ChunkKey.to_string().encode()``); ``content`` (:data:`RAW` or
        :data:`ENCODED`) is recorded, authenticated, for the reader."""
        head = ENVELOPE.pack(MAGIC, VERSION, AES_256_GCM, content, secrets.token_bytes(12))
        aad = _framed(head, tenant, key_name)
        sealed: bytes = self._cipher(tenant).encrypt(head[-12:], bytes(plaintext), aad)
        return head + sealed

    @staticmethod
    def opened_bytes(blob: bytes | bytearray | memoryview) -> int:
        """The plaintext length of a sealed chunk (0 for a blob too short to be one)."""
        return max(0, len(memoryview(blob)) - ENVELOPE.size - TAG_BYTES)

    @staticmethod
    def content(blob: bytes | bytearray | memoryview) -> int:
        """The content kind a sealed chunk says it holds (:data:`RAW`, :data:`ENCODED`), not
        yet authenticated: only for choosing where to decrypt it to (a lie fails
        :meth:`open_into`)."""
        view = memoryview(blob).cast("B")
        if len(view) < ENVELOPE.size:
            return -1
        return int(ENVELOPE.unpack_from(view)[3])

    def open_into(
        self,
        blob: bytes | bytearray | memoryview,
        out: bytearray | memoryview,
        *,
        tenant: bytes,
        key_name: bytes,
    ) -> int:
        """Authenticate and decrypt a sealed chunk into the start of ``out``; returns the
        plaintext length.  Where ``cryptography`` can (``decrypt_into``, 46+), the plaintext is
        written into ``out`` directly, so on a miss ``out`` may hold unauthenticated bytes: the
        caller must not hand it out.

        Raises:
            DecryptionMiss: not a sealed chunk, another algorithm or version, or it does not
                authenticate (another tenant, another chunk key, tampered, truncated), or it
                is larger than ``out``.
        """
        view = memoryview(blob).cast("B")
        if len(view) < ENVELOPE.size + TAG_BYTES:
            raise DecryptionMiss("shorter than a sealed chunk")
        magic, version, algorithm, content, nonce = ENVELOPE.unpack_from(view)
        if magic != MAGIC:
            raise DecryptionMiss("not a sealed chunk (encryption is on: plaintext is refused)")
        if version != VERSION or algorithm != AES_256_GCM or content not in (RAW, ENCODED):
            raise DecryptionMiss(
                f"sealed with version {version}, algorithm {algorithm}, content {content}"
            )
        size = self.opened_bytes(view)
        target = memoryview(out).cast("B")
        if size > len(target):
            raise DecryptionMiss(f"opens to {size} bytes, more than the {len(target)} given")
        aad = _framed(bytes(view[: ENVELOPE.size]), tenant, key_name)
        from cryptography.exceptions import InvalidTag

        cipher = self._cipher(tenant)
        try:
            if hasattr(cipher, "decrypt_into"):
                cipher.decrypt_into(nonce, view[ENVELOPE.size :], aad, target[:size])
            else:  # pragma: no cover - cryptography before 46
                target[:size] = cipher.decrypt(nonce, bytes(view[ENVELOPE.size :]), aad)
        except InvalidTag:
            raise DecryptionMiss(
                "does not authenticate (another tenant or chunk key, or damaged)"
            ) from None
        return size
