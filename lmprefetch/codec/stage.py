"""One tier's codec stage: what its write-behind applies to a payload before storing it, and
what its load path applies to stored bytes to fill an arena slot.

    stage = ChunkStage(get_codec("lossless", dtype=config.kv_dtype), cipher)
    stored = stage.encode(payload, key_name=key.to_string().encode(), tenant=tenant)
    n = stage.decode_into(stored, slot.view(), key_name=..., tenant=...)   # CodecMiss: a miss

Encoding: the codec first (compressing), then the cipher (sealing).  With the codec ``none`` and
no cipher the stage is a *passthrough*: :meth:`ChunkStage.encode` returns the payload itself, so
a tier keeps its zero-copy paths (Mooncake's put-from, the disk tier's ``O_DIRECT`` reads).

Decoding reads whatever was stored, whatever this stage's own codec: an encoded chunk
(:mod:`.format`), a sealed one (:mod:`.encryption`), or a raw payload (written with ``none``, or
before codecs existed).  A tier whose framing records which it stored (the disk tier's file
header, the Redis tier's value header: ``encoded=True`` for what :meth:`ChunkStage.encode`
changed, ``False`` for a payload as it is) says so, and the stage trusts it; a tier that
stores bare objects (Mooncake) passes ``encoded=None`` and the stage tells them apart by their
first four bytes.  A tier sizes its read buffers with :meth:`ChunkStage.max_read_bytes`
(every codec's largest chunk), so chunks written under other settings fit.  A passthrough tier
reads stored bytes straight into the arena slot and calls :meth:`ChunkStage.decode_in_place`,
which costs nothing for a raw payload (a look at its first four bytes) and decodes a chunk
written with a codec through a scratch copy.  With a cipher, only sealed chunks are accepted
(a raw or merely encoded chunk in a store that should hold only ciphertext was not written by
us); without one, a sealed chunk is a miss (there is no key to open it).  A raw payload that
happens to start with an envelope's four magic bytes is read as that envelope and fails its
checksum: a miss (one chunk in four billion), never wrong bytes.

Thread-safe and free of I/O: tiers call it in their worker threads.
"""

from __future__ import annotations

import threading
import time

from .encryption import (
    ENCODED,
    ENVELOPE,
    RAW,
    TAG_BYTES,
    DecryptionMiss,
    TenantCipher,
    is_sealed,
)
from .format import HEADER, CodecMiss, is_encoded
from .registry import Codec, decode_into

__all__ = ["MAX_OVERHEAD_BYTES", "ChunkStage", "Decodes"]

#: The most bytes any codec and the cipher add to a payload: the encoded chunk's header, the
#: lossless body's plane table for 4-byte elements at worst (a count, then a mode and a length
#: per plane; every lossy body is at most the lossless one, :meth:`Codec.encode`), and the
#: envelope with GCM's tag.  ``tests/test_codecs.py`` checks it bounds every codec.
MAX_OVERHEAD_BYTES = HEADER.size + 1 + 4 * 9 + ENVELOPE.size + TAG_BYTES

_local = threading.local()


def _scratch(name: str, nbytes: int) -> memoryview:
    """A per-thread buffer of at least ``nbytes`` (reused: no allocation per chunk)."""
    buf: bytearray | None = getattr(_local, name, None)
    if buf is None or len(buf) < nbytes:
        buf = bytearray(nbytes)
        setattr(_local, name, buf)
    return memoryview(buf)[:nbytes]


def _plain_scratch(nbytes: int) -> memoryview:
    return _scratch("plain", nbytes)


class ChunkStage:
    """A tier's codec and optional cipher.

    Args:
        codec: what new chunks are encoded with (:func:`~lmprefetch.codec.get_codec`).
        cipher: seals every chunk for its tenant (``None``: no encryption).
    """

    def __init__(self, codec: Codec, cipher: TenantCipher | None = None) -> None:
        self.codec = codec
        self.cipher = cipher

    def __repr__(self) -> str:
        sealed = ", sealed per tenant" if self.cipher is not None else ""
        return f"<ChunkStage {self.codec.name}{sealed}>"

    @property
    def passthrough(self) -> bool:
        """Stored bytes are the payload itself (codec ``none``, no cipher)."""
        return self.codec.name == "none" and self.cipher is None

    @property
    def per_tenant(self) -> bool:
        """Chunks are sealed per tenant: encoding and decoding need the request's tenant."""
        return self.cipher is not None

    @staticmethod
    def max_read_bytes(payload_bytes: int) -> int:
        """The most bytes a stored chunk of a payload of at most ``payload_bytes`` has, whatever
        codec and cipher wrote it: what a tier's read buffer must hold so that chunks written
        under other settings stay readable."""
        return payload_bytes + MAX_OVERHEAD_BYTES

    def max_stored_bytes(self, payload_bytes: int) -> int:
        """The most bytes :meth:`encode` stores for a payload of ``payload_bytes``: what a
        tier's read buffer (a disk read, a Redis value, a Mooncake get) must hold."""
        if self.codec.name == "none":
            stored = payload_bytes
        else:
            stored = self.codec.max_encoded_bytes(payload_bytes)
        if self.cipher is not None:
            stored += ENVELOPE.size + TAG_BYTES
        return stored

    def encode(
        self, payload: bytes | bytearray | memoryview, *, key_name: bytes, tenant: bytes = b""
    ) -> bytes | bytearray | memoryview:
        """The bytes to store for ``payload`` under the chunk key ``key_name``
        (``ChunkKey.to_string().encode()``) for ``tenant``
        (:func:`~lmprefetch.codec.encryption.tenant_id`)."""
        if self.codec.name == "none":
            if self.cipher is None:
                return payload
            return self.cipher.seal(payload, tenant=tenant, key_name=key_name, content=RAW)
        encoded = self.codec.encode(payload)
        if self.cipher is None:
            return encoded
        return self.cipher.seal(encoded, tenant=tenant, key_name=key_name, content=ENCODED)

    def encodes(self) -> bool:
        """Whether :meth:`encode` changes payloads (not a passthrough): what a tier records in
        its framing (``encoded``) for what it stores."""
        return not self.passthrough

    def is_raw(self, stored: bytes | bytearray | memoryview, encoded: bool | None = None) -> bool:
        """Whether ``stored`` is to be read as the payload itself, with nothing to decode: no
        cipher here, and the tier's framing says it is a payload (``encoded`` false) or, where
        it does not say (``None``), it is neither an encoded nor a sealed chunk."""
        if self.cipher is not None or encoded:
            return False
        return encoded is False or (not is_encoded(stored) and not is_sealed(stored))

    def decode_in_place(
        self,
        slot: bytearray | memoryview,
        stored_bytes: int,
        *,
        key_name: bytes,
        tenant: bytes = b"",
        encoded: bool | None = None,
    ) -> int:
        """The payload's length, once the ``stored_bytes`` a tier read straight into the start of
        ``slot`` are the payload: a raw payload is left as it is (without a cipher: the usual
        case of a passthrough tier, free); an encoded or sealed chunk is copied to a per-thread
        scratch buffer and decoded back into ``slot``.  ``encoded``: as :meth:`decode_into`.

        Raises:
            CodecMiss: as :meth:`decode_into`.  ``slot`` must not be handed out then.
        """
        view = memoryview(slot).cast("B")
        stored = view[:stored_bytes]
        if self.is_raw(stored, encoded):
            return stored_bytes
        copy = _scratch("stored", stored_bytes)
        copy[:] = stored
        return self.decode_into(copy, view, key_name=key_name, tenant=tenant, encoded=encoded)

    def decode_into(
        self,
        stored: bytes | bytearray | memoryview,
        out: bytearray | memoryview,
        *,
        key_name: bytes,
        tenant: bytes = b"",
        encoded: bool | None = None,
    ) -> int:
        """Fill the start of ``out`` with the payload ``stored`` holds; returns its length.

        Args:
            encoded: what the tier's framing says ``stored`` is: what :meth:`encode` made of a
                payload (``True``), a payload as it is (``False``: copied without a look at
                its bytes, or refused with a cipher here), or ``None`` where the tier stores
                bare objects: told by the first four bytes.

        Raises:
            CodecMiss: the stored bytes are damaged, of an unknown or foreign encoding, sealed
                for another tenant or chunk key, sealed with no cipher here, not sealed with a
                cipher here, or larger than ``out``.  ``out`` must not be handed out then.
        """
        dtype = self.codec.dtype
        if encoded is False:
            if self.cipher is not None:
                raise DecryptionMiss("a payload as it is (encryption is on: plaintext is refused)")
            return _copy_raw(stored, out)
        if encoded and not is_sealed(stored) and not is_encoded(stored):
            raise CodecMiss("stored as encoded, but neither an encoded nor a sealed chunk")
        if self.cipher is not None:
            if not is_sealed(stored):
                raise DecryptionMiss("not sealed (encryption is on: plaintext is refused)")
            if self.cipher.content(stored) == RAW:
                return self.cipher.open_into(stored, out, tenant=tenant, key_name=key_name)
            plain = _plain_scratch(self.cipher.opened_bytes(stored))
            self.cipher.open_into(stored, plain, tenant=tenant, key_name=key_name)
            if not is_encoded(plain):
                raise CodecMiss("sealed content is not an encoded chunk")
            return decode_into(plain, out, dtype=dtype)
        if is_sealed(stored):
            raise DecryptionMiss("sealed, and no encryption key is configured here")
        if is_encoded(stored):
            return decode_into(stored, out, dtype=dtype)
        return _copy_raw(stored, out)


class Decodes:
    """A run of decodes in one of a tier's load threads, chunk after chunk, until the stage
    refuses one: the payload lengths so far, the bytes and the time it took (for the tier's
    statistics: ``TierStats.observe_decoded``), and the refusal that ended it.

    A payload stored as it is costs no decoding: it is copied (:meth:`into`) or left where it
    is (:meth:`in_place`), untimed.
    """

    __slots__ = ("decoded", "lengths", "miss", "seconds", "stage", "stored_bytes")

    def __init__(self, stage: ChunkStage) -> None:
        self.stage = stage
        #: The payload length of each chunk decoded so far, in order.
        self.lengths: list[int] = []
        self.stored_bytes = 0
        self.seconds = 0.0
        #: Whether any chunk went through the codec or the cipher.
        self.decoded = False
        #: Why the stage refused the chunk after the decoded ones (kept without its
        #: traceback: :meth:`CodecMiss.detached`), if it did.
        self.miss: CodecMiss | None = None

    @property
    def payload_bytes(self) -> int:
        return sum(self.lengths)

    def into(
        self,
        stored: bytes | bytearray | memoryview,
        out: bytearray | memoryview,
        *,
        key_name: bytes,
        tenant: bytes,
        encoded: bool | None = None,
    ) -> bool:
        """Decode ``stored`` into ``out`` (:meth:`ChunkStage.decode_into`); ``False`` once the
        stage refused it (:attr:`miss`): the run ends there."""
        size = memoryview(stored).nbytes
        if self.stage.is_raw(stored, encoded):
            try:
                n = _copy_raw(stored, out)
            except CodecMiss as exc:  # larger than ``out``
                return self._refused(exc, 0.0)
            return self._done(n, size, 0.0, decoded=False)
        t0 = time.perf_counter()
        try:
            n = self.stage.decode_into(
                stored, out, key_name=key_name, tenant=tenant, encoded=encoded
            )
        except CodecMiss as exc:
            return self._refused(exc, time.perf_counter() - t0)
        return self._done(n, size, time.perf_counter() - t0, decoded=True)

    def in_place(
        self,
        slot: bytearray | memoryview,
        stored_bytes: int,
        *,
        key_name: bytes,
        tenant: bytes,
        encoded: bool | None = None,
    ) -> bool:
        """The ``stored_bytes`` read straight into ``slot``, decoded where they lie
        (:meth:`ChunkStage.decode_in_place`); ``False`` once the stage refused them."""
        with memoryview(slot)[:stored_bytes] as stored:
            raw = self.stage.is_raw(stored, encoded)
        if raw:
            return self._done(stored_bytes, stored_bytes, 0.0, decoded=False)
        t0 = time.perf_counter()
        try:
            n = self.stage.decode_in_place(
                slot, stored_bytes, key_name=key_name, tenant=tenant, encoded=encoded
            )
        except CodecMiss as exc:
            return self._refused(exc, time.perf_counter() - t0)
        return self._done(n, stored_bytes, time.perf_counter() - t0, decoded=True)

    def _refused(self, exc: CodecMiss, seconds: float) -> bool:
        self.miss = exc.detached()
        self.seconds += seconds
        return False

    def _done(self, length: int, stored_bytes: int, seconds: float, *, decoded: bool) -> bool:
        self.lengths.append(length)
        self.stored_bytes += stored_bytes
        self.seconds += seconds
        self.decoded = self.decoded or decoded
        return True


def _copy_raw(stored: bytes | bytearray | memoryview, out: bytearray | memoryview) -> int:
    view = memoryview(stored).cast("B")
    target = memoryview(out).cast("B")
    if len(view) > len(target):
        raise CodecMiss(f"a raw chunk of {len(view)} bytes, more than the {len(target)} given")
    target[: len(view)] = view
    return len(view)
