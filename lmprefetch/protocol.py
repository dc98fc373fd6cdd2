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
                           ext ``seq``, ``deadline_ms``, ``skip_chunks``
``LookupResponseMsg``      ``lookup_id``, ``num_hit_tokens``; ext ``seq``, ``worker_id``
``LookupCleanupMsg``       ``lookup_id``; ext ``seq``
=========================  ==================================================================

Decoding errors are part of the API: :func:`decode_worker_message` and :func:`decode_response`
raise :class:`msgspec.DecodeError` (its subclass :class:`msgspec.ValidationError` for
well-formed msgpack of the wrong shape) and nothing else, so a receive loop catches exactly
``msgspec.DecodeError``, counts the frame as malformed and carries on.  A request that decodes
but makes no sense (hashes and offsets of different lengths, …) is reported by
:func:`validate_request`.
"""

from __future__ import annotations

from typing import TypeAlias

import msgspec

__all__ = [
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


class LookupMsg(msgspec.Struct, tag=True, tag_field="type", gc=False):
    """Base of every lookup message; the tag (field ``"type"``) is the class name.

    ``gc=False``: the messages are flat and never form reference cycles, so the cyclic
    garbage collector need not track them (fewer collections while decoding bursts).
    """


class LookupRequestMsg(LookupMsg):
    """Scheduler → worker: find (and prefetch) the longest cached prefix of a prompt."""

    #: The engine's request id.
    lookup_id: str
    #: One prefix-chained chunk hash per chunk (signed or unsigned 64-bit).
    hashes: list[int]
    #: Tokens in each chunk (``end - start``; not cumulative), one per hash.
    offsets: list[int]
    #: LMCache's per-request settings; passed through untouched.
    request_configs: dict[str, str] | None = None
    # -- lmprefetch extensions ----------------------------------------------------------
    #: The client's sequence number for this lookup (0: unknown, e.g. an LMCache client).
    seq: int = 0
    #: Absolute wall-clock deadline in epoch milliseconds (``time.time() * 1000``) after
    #: which the worker stops and answers 0; 0 means none.
    deadline_ms: int = 0
    #: Leading chunks the engine already holds; workers count them as hit without probing
    #: or loading them.
    skip_chunks: int = 0


class LookupResponseMsg(LookupMsg):
    """Worker → scheduler: the number of leading tokens this rank has ready."""

    lookup_id: str
    #: Hit tokens (not chunks), counted from token 0.
    num_hit_tokens: int
    # -- lmprefetch extensions ----------------------------------------------------------
    #: Echo of the request's ``seq`` (0 from an LMCache worker).
    seq: int = 0
    #: The answering rank; -1 from an LMCache worker, which does not say.
    worker_id: int = -1


class LookupCleanupMsg(LookupMsg):
    """Scheduler → worker: release whatever was prefetched for this lookup."""

    lookup_id: str
    # -- lmprefetch extensions ----------------------------------------------------------
    #: The lookup's ``seq``; 0 means "whatever is held under this id".
    seq: int = 0


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
    except UnicodeDecodeError as exc:
        raise _bad_utf8(exc) from None


def decode_response(buf: bytes | bytearray | memoryview) -> LookupResponseMsg:
    """Decode a frame received on the scheduler's response socket.

    Raises:
        msgspec.DecodeError: the frame is not msgpack, or not a response message
            (:class:`msgspec.ValidationError`, a subclass, for the wrong shape or tag).
    """
    try:
        return _response_decoder.decode(buf)
    except UnicodeDecodeError as exc:
        raise _bad_utf8(exc) from None


def _bad_utf8(exc: UnicodeDecodeError) -> msgspec.DecodeError:
    # msgspec lets a str that is not valid UTF-8 escape as UnicodeDecodeError (found by
    # fuzzing); to callers it is just another malformed frame.
    return msgspec.DecodeError(f"MessagePack data is malformed: invalid UTF-8 in a str ({exc})")


def validate_request(msg: LookupRequestMsg) -> str | None:
    """Check that a decoded request makes sense; the server counts a failure as malformed.

    Returns:
        ``None`` for a sane request, else a sentence saying what is wrong: ``hashes`` and
        ``offsets`` differ in length, an offset is not positive, or ``skip_chunks`` is
        negative or larger than the number of chunks.
    """
    n = len(msg.hashes)
    if n != len(msg.offsets):
        return f"hashes and offsets differ in length ({n} != {len(msg.offsets)})"
    for i, offset in enumerate(msg.offsets):
        if offset <= 0:
            return f"offsets[{i}] must be a positive token count, got {offset}"
    if not 0 <= msg.skip_chunks <= n:
        return (
            f"skip_chunks must be between 0 and the number of chunks ({n}), got {msg.skip_chunks}"
        )
    return None
