"""The lookup wire protocol: msgspec messages, wire-compatible with LMCache 0.5.6.

LMCache's async lookup sends three messages over ZeroMQ, one frame each, encoded as msgpack
**maps** tagged by the field ``"type"`` whose value is the class name (a ``msgspec.Struct``
declared with ``tag=True``).  lmprefetch keeps that exact shape and appends optional fields
with defaults, so either side can talk to the other:

* an LMCache message decodes here with the extension fields at their defaults (``seq=0``,
  ``worker_id=-1``, …);
* our messages decode in LMCache, because msgspec ignores unknown map keys by default (so this
  module must never set ``forbid_unknown_fields``);
* every field, defaults included, is always emitted (no ``omit_defaults``), in declaration
  order after the tag, exactly as LMCache's encoder does.

=========================  ==================================================================
message                    fields (LMCache's first, then lmprefetch's extensions)
=========================  ==================================================================
``LookupRequestMsg``       ``lookup_id``, ``hashes``, ``offsets``, ``request_configs``;
                           ext ``seq``, ``deadline_ms``, ``skip_chunks``, ``tenant``,
                           ``load_policy``
``LookupResponseMsg``      ``lookup_id``, ``num_hit_tokens``; ext ``seq``, ``worker_id``,
                           ``tier_tokens``
``LookupCleanupMsg``       ``lookup_id``; ext ``seq``
=========================  ==================================================================

Tenants: ``hashes`` are whatever the client computed, salted for a tenant when it has one (a
``cache_salt``, a LoRA adapter; see :mod:`lmprefetch.hashing`).  The salt is chained into the
hashes on the scheduler side, so workers never see a tenant's salt, and the LMCache-compatible
fields keep their meaning.  The extension ``tenant`` names the tenant for encryption at rest
(:func:`~lmprefetch.codec.tenant_id`: a 16-byte digest of the salt, not the salt): a worker
that encrypts opens the chunks with that tenant's key.  A request without it (an LMCache
client, an unsalted prompt) is in the shared name space.

Decoding errors are part of the API: :func:`decode_worker_message` and :func:`decode_response`
raise :class:`msgspec.DecodeError` (its subclass :class:`msgspec.ValidationError` for
well-formed msgpack of the wrong shape) and nothing else, whatever the bytes: msgspec itself
lets a few other exceptions escape for hostile input (``RecursionError`` for arrays nested a
thousand deep inside an ignored field, ``UnicodeDecodeError`` for a bad ``str``), and those are
turned into ``DecodeError`` here.  So a receive loop catches exactly ``msgspec.DecodeError``,
counts the frame as malformed and carries on.

Every integer on the wire is checked against its wire type when it is decoded, so that whatever
decodes can be answered: ``seq``, ``deadline_ms`` and ``num_hit_tokens`` are 0 … 2**63-1,
``worker_id`` is -1 … 2**31-1, and hashes are any 64-bit value, signed or unsigned.  A request
that decodes but makes no sense (hashes and offsets of different lengths, an offset that is not
a token count of 1 … 2**32-1, a bad ``skip_chunks``) is reported by :func:`validate_request`;
the worker answers it 0.  An accepted request therefore always gets exactly one answer, and that
answer always encodes.

Nothing here does I/O or awaits: encoding and decoding are pure functions.
"""

from __future__ import annotations

from typing import Annotated, Final, TypeAlias

import msgspec

from .config_checks import LOAD_POLICIES

__all__ = [
    "INT64_MAX",
    "LOAD_POLICIES",
    "MAX_CHUNK_TOKENS",
    "MAX_TENANT_BYTES",
    "LookupCleanupMsg",
    "LookupMsg",
    "LookupRequestMsg",
    "LookupResponseMsg",
    "WorkerMessage",
    "decode_response",
    "decode_worker_message",
    "encode",
    "validate_request",
]


#: The largest signed 64-bit integer: the bound of ``seq``, ``deadline_ms`` and token counts.
INT64_MAX: Final = 2**63 - 1
#: The most tokens one chunk may have (an unsigned 32-bit count).
MAX_CHUNK_TOKENS: Final = 2**32 - 1
#: The longest ``tenant`` a request may name (a tenant id is 16 bytes).
MAX_TENANT_BYTES: Final = 64

#: A sequence number, deadline or token total: a non-negative signed 64-bit integer.
_U63 = Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)]
#: A rank, or -1 for "not said" (an LMCache worker).
_WorkerId = Annotated[int, msgspec.Meta(ge=-1, le=2**31 - 1)]


class LookupMsg(msgspec.Struct, tag=True, tag_field="type", gc=False):
    """Base of every lookup message; the tag (field ``"type"``) is the class name.

    ``gc=False``: the messages are flat and never form reference cycles, so the cyclic
    garbage collector need not track them (fewer collections while decoding bursts).
    """


class LookupRequestMsg(LookupMsg):
    """Scheduler → worker: find (and prefetch) the longest cached prefix of a prompt."""

    #: The engine's request id.
    lookup_id: str
    #: One prefix-chained chunk hash per chunk (signed or unsigned 64-bit), salted by the
    #: client for a tenant's name space when the request has one.
    hashes: list[int]
    #: Tokens in each chunk (``end - start``; not cumulative), one per hash.
    offsets: list[int]
    #: LMCache's per-request settings; passed through untouched.
    request_configs: dict[str, str] | None = None
    # -- lmprefetch extensions ----------------------------------------------------------
    #: The client's sequence number for this lookup (0: unknown, e.g. an LMCache client).
    seq: _U63 = 0
    #: Absolute wall-clock deadline in epoch milliseconds (``time.time() * 1000``) after
    #: which the worker stops and answers 0; 0 means none.
    deadline_ms: _U63 = 0
    #: Leading chunks the engine already holds; workers count them as hit without probing
    #: or loading them.
    skip_chunks: int = 0
    #: The tenant (:func:`~lmprefetch.codec.tenant_id` of the prompt's salt; at most
    #: :data:`MAX_TENANT_BYTES`), for workers that encrypt chunks per tenant; ``b""``: the
    #: shared name space.
    tenant: bytes = b""
    #: The load policy for this lookup: one of :data:`LOAD_POLICIES` (a request's own
    #: ``load_policy``, e.g. vLLM's ``kv_transfer_params``), or ``""``: the worker's
    #: configured ``load_policy``.
    load_policy: str = ""


class LookupResponseMsg(LookupMsg):
    """Worker → scheduler: the number of leading tokens this rank has ready."""

    lookup_id: str
    #: Hit tokens (not chunks), counted from token 0.
    num_hit_tokens: _U63
    # -- lmprefetch extensions ----------------------------------------------------------
    #: Echo of the request's ``seq`` (0 from an LMCache worker).
    seq: _U63 = 0
    #: The answering rank; -1 from an LMCache worker, which does not say.
    worker_id: _WorkerId = -1
    #: Which tier served the hit: ``[tier name, tokens]`` pairs in prefix order, covering
    #: the hit past the skipped chunks (``None`` from a peer that does not say).
    tier_tokens: list[tuple[str, _U63]] | None = None


class LookupCleanupMsg(LookupMsg):
    """Scheduler → worker: release whatever was prefetched for this lookup."""

    lookup_id: str
    # -- lmprefetch extensions ----------------------------------------------------------
    #: The lookup's ``seq``; 0 means "whatever is held under this id".
    seq: _U63 = 0


#: What a worker's request socket carries.
WorkerMessage: TypeAlias = "LookupRequestMsg | LookupCleanupMsg"

_encoder = msgspec.msgpack.Encoder()
_worker_decoder: msgspec.msgpack.Decoder[WorkerMessage] = msgspec.msgpack.Decoder(
    LookupRequestMsg | LookupCleanupMsg
)
_response_decoder = msgspec.msgpack.Decoder(LookupResponseMsg)


def encode(msg: LookupMsg) -> bytes:
    """Encode one message as a msgpack map (one ZeroMQ frame).

    Raises:
        OverflowError: an integer does not fit msgpack's range (``-2**63 … 2**64-1``).
    """
    return _encoder.encode(msg)


def decode_worker_message(buf: bytes | bytearray | memoryview) -> WorkerMessage:
    """Decode a frame received on a worker's request socket.

    Raises:
        msgspec.DecodeError: the frame is not msgpack, or not a request or cleanup message
            (:class:`msgspec.ValidationError`, a subclass, for the wrong shape or tag).
    """
    try:
        return _worker_decoder.decode(buf)
    except msgspec.DecodeError:
        raise
    except Exception as exc:
        raise _malformed(exc) from None


def decode_response(buf: bytes | bytearray | memoryview) -> LookupResponseMsg:
    """Decode a frame received on the scheduler's response socket.

    Raises:
        msgspec.DecodeError: the frame is not msgpack, or not a response message
            (:class:`msgspec.ValidationError`, a subclass, for the wrong shape or tag).
    """
    try:
        return _response_decoder.decode(buf)
    except msgspec.DecodeError:
        raise
    except Exception as exc:
        raise _malformed(exc) from None


def _malformed(exc: Exception) -> msgspec.DecodeError:
    # msgspec lets some hostile input escape as other exceptions (found by fuzzing): a str that
    # is not valid UTF-8 (UnicodeDecodeError), containers nested ~1,000 deep even inside a field
    # that is ignored (RecursionError).  To callers every one is just another malformed frame.
    return msgspec.DecodeError(f"MessagePack data is malformed: {type(exc).__name__}: {exc}")


def validate_request(msg: LookupRequestMsg) -> str | None:
    """Check that a decoded request makes sense; the server counts a failure as malformed.

    Returns:
        ``None`` for a sane request, else a sentence saying what is wrong: ``hashes`` and
        ``offsets`` differ in length, an offset is not a token count of 1 … 2**32-1, the
        tokens add up to more than 2**63-1 (the answer could not be encoded),
        ``skip_chunks`` is negative or larger than the number of chunks, ``tenant`` is
        longer than :data:`MAX_TENANT_BYTES`, or ``load_policy`` is neither ``""`` nor one
        of :data:`LOAD_POLICIES` (a request never makes a worker import code).
    """
    n = len(msg.hashes)
    if n != len(msg.offsets):
        return f"hashes and offsets differ in length ({n} != {len(msg.offsets)})"
    for i, offset in enumerate(msg.offsets):
        if not 0 < offset <= MAX_CHUNK_TOKENS:
            return f"offsets[{i}] must be a token count of 1 to {MAX_CHUNK_TOKENS}, got {offset}"
    # With every offset below 2**32 the total overflows int64 only past 2**31 chunks, more
    # than any frame within max_message_bytes holds: a guard that no test can reach.
    total = sum(msg.offsets)  # pragma: no mutate
    if total > INT64_MAX:  # pragma: no mutate
        return f"the offsets add up to {total} tokens, more than {INT64_MAX}"
    if not 0 <= msg.skip_chunks <= n:
        return (
            f"skip_chunks must be between 0 and the number of chunks ({n}), got {msg.skip_chunks}"
        )
    if len(msg.tenant) > MAX_TENANT_BYTES:
        return f"tenant must be at most {MAX_TENANT_BYTES} bytes, got {len(msg.tenant)}"
    if msg.load_policy and msg.load_policy not in LOAD_POLICIES:
        return f"load_policy must be one of {LOAD_POLICIES} or empty, got {msg.load_policy!r}"
    return None
