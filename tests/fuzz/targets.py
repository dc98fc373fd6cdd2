"""What the wire fuzzers check, as plain functions of one input's bytes.

The same functions serve three callers: the Hypothesis tests in the default suite, the
coverage-guided atheris harnesses (``tests/fuzz/run_atheris.py``, ``nox -s fuzz``), and the
regression test that replays every input ever kept under ``tests/fuzz/crashes/`` and
``tests/fuzz/corpus/``.  A check passes by returning and fails by raising; anything but an
``AssertionError`` escaping a check is the bug itself (the exception a receive loop would have
died of).

Targets (each one a directory name under ``corpus/`` and ``crashes/``):

* ``worker_frame`` — :func:`check_worker_frame`: one frame for a worker's request socket.
* ``response_frame`` — :func:`check_response_frame`: one frame for the client's answer socket.
* ``server_frames`` — :class:`HandleHarness`: a sequence of frames (see :func:`split_frames`)
  fed to ``LookupServer._handle`` on a live in-process engine with cached data, then the
  server's counters, its answers and the engine's conservation invariant are checked.
* ``config_toml`` — :func:`check_config_toml`: the bytes of a config file.
* ``chunk_file`` — :func:`check_chunk_file`: the bytes of a disk-tier chunk file.
* ``chunk_name`` — :func:`check_chunk_name`: a file name in the disk tier's directory.
"""

from __future__ import annotations

import atexit
import os
import shutil
import struct
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Iterable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import trio
import xxhash
from anyio.from_thread import BlockingPortal, start_blocking_portal

from lmprefetch import PrefetchConfig
from lmprefetch.config import parse_host_port
from lmprefetch.keys import ChunkKey
from lmprefetch.prefetch import Engine
from lmprefetch.protocol import (
    LookupCleanupMsg,
    LookupRequestMsg,
    LookupResponseMsg,
    decode_response,
    decode_worker_message,
    encode,
    validate_request,
)
from lmprefetch.server import LookupServer
from lmprefetch.wiring import open_engine

__all__ = [
    "TARGETS",
    "HandleHarness",
    "Outcome",
    "assert_names_what_to_fix",
    "assert_usable",
    "check_chunk_file",
    "check_chunk_name",
    "check_config_toml",
    "check_response_frame",
    "check_worker_frame",
    "classify_response_frame",
    "classify_worker_frame",
    "fill_stored_prompts",
    "join_frames",
    "split_frames",
    "toml_keys",
]

CHUNK = 4
RANK = 3
WORLD_SIZE = 4


@dataclass(frozen=True)
class Outcome:
    """What a receiver must make of one frame: ``malformed`` (dropped and counted),
    ``cleanup``, ``request`` (accepted unless stale, answered) or ``invalid`` (a request that
    decodes but makes no sense: answered 0 and counted as malformed), or ``response``."""

    kind: str
    msg: Any = None
    #: For requests: the most tokens an answer may claim (0 for an invalid request).
    max_tokens: int = 0


def classify_worker_frame(data: bytes) -> Outcome:
    """What a worker must make of ``data`` (any exception while decoding: ``malformed``),
    without checking the decoder itself: the oracle of the server tests."""
    try:
        msg = decode_worker_message(data)
    except Exception:
        return Outcome("malformed")
    if isinstance(msg, LookupCleanupMsg):
        return Outcome("cleanup", msg)
    if validate_request(msg) is not None:
        return Outcome("invalid", msg, 0)
    return Outcome("request", msg, sum(msg.offsets))


def classify_response_frame(data: bytes) -> Outcome:
    """What the client must make of ``data`` (any exception while decoding: ``malformed``)."""
    try:
        return Outcome("response", decode_response(data))
    except Exception:
        return Outcome("malformed")


def check_worker_frame(data: bytes) -> Outcome:
    """One frame for a worker: only ``msgspec.DecodeError`` may escape the decoder; whatever
    decodes re-encodes to an equal message, and every answer the worker could give it encodes
    (so an accepted request can always be answered)."""
    try:
        msg = decode_worker_message(data)
    except msgspec.DecodeError:
        return Outcome("malformed")
    assert isinstance(msg, LookupRequestMsg | LookupCleanupMsg), type(msg)
    assert decode_worker_message(encode(msg)) == msg
    if isinstance(msg, LookupCleanupMsg):
        return Outcome("cleanup", msg)
    problem = validate_request(msg)
    assert problem is None or isinstance(problem, str)
    most = 0 if problem is not None else sum(msg.offsets)
    for hit_tokens in {0, most}:
        answer = LookupResponseMsg(msg.lookup_id, hit_tokens, seq=msg.seq, worker_id=RANK)
        assert decode_response(encode(answer)) == answer
    return Outcome("request" if problem is None else "invalid", msg, most)


def check_response_frame(data: bytes) -> Outcome:
    """One frame for the client: only ``msgspec.DecodeError`` may escape; whatever decodes
    re-encodes to an equal message and has a usable token count and rank."""
    try:
        msg = decode_response(data)
    except msgspec.DecodeError:
        return Outcome("malformed")
    assert isinstance(msg, LookupResponseMsg), type(msg)
    assert decode_response(encode(msg)) == msg
    assert msg.num_hit_tokens >= 0 and msg.worker_id >= -1
    return Outcome("response", msg)


# -- a sequence of frames in one input --------------------------------------------------------
def split_frames(data: bytes) -> list[bytes]:
    """``data`` as frames, each behind a 4-byte big-endian length (a short last one takes the
    rest), so one fuzz input is a conversation a mutator can change frame by frame."""
    frames, i = [], 0
    while i < len(data):
        n = int.from_bytes(data[i : i + 4], "big")
        frames.append(data[i + 4 : i + 4 + n])
        i += 4 + n
    return frames


def join_frames(frames: Iterable[bytes]) -> bytes:
    return b"".join(struct.pack(">I", len(f)) + f for f in frames)


# -- the server's receive path on a live engine -------------------------------------------------
def stored_prompts() -> list[list[int]]:
    """The prompts the harness's engine holds: in the CPU tier, and (longer) in a slower tier
    whose loads run in tasks."""
    return [[p * 1000 + i for i in range(n * CHUNK)] for p, n in ((1, 3), (2, 5), (3, 8))]


async def fill_stored_prompts(engine: Engine, slow: Any) -> None:
    """The wire harnesses' data: the first two :func:`stored_prompts` in the CPU tier, all
    three in ``slow`` (a fake tier's ``data``)."""
    for n, prompt in enumerate(stored_prompts()):
        data = [bytes([n * 16 + i]) * 40 for i in range(len(prompt) // CHUNK)]
        if n < 2:
            await engine.store(prompt, data)
        for key, payload in zip(engine.keys.keys(engine.hasher.hash(prompt)), data):
            slow.data[key] = payload


def harness_config() -> PrefetchConfig:
    return PrefetchConfig(chunk_size=CHUNK, chunk_bytes=64, cpu_bytes=64 * 48)


def known_hashes() -> list[int]:
    """The chunk hashes of :func:`stored_prompts` as the engine computes them."""
    from lmprefetch.hashing import ChunkHasher

    hasher = ChunkHasher(CHUNK)
    return sorted({h for p in stored_prompts() for h in hasher.hash(p)})


class HandleHarness:
    """``LookupServer._handle`` on an in-process engine (CPU tier plus a slower fake tier, both
    with data), running on a Trio loop in a background thread.

    :meth:`run` feeds one input's frames, then checks: the server counted each frame exactly as
    the oracle says (:func:`classify_worker_frame`, and the running lookup of its id for
    staleness); once the lookups are cancelled, the outbox holds exactly one answer per
    accepted request (same id and seq), within its token count, from this rank; and the engine
    is back to its conservation invariant with no failed lookup.  Use it as a context
    manager.
    """

    def __init__(self) -> None:
        # The fake tier lives in tests/fakes.py (the harness runs from the repository root).
        from tests.fakes import FakeTier

        self._stack = ExitStack()
        try:
            self.portal: BlockingPortal = self._stack.enter_context(
                start_blocking_portal(backend="trio")
            )
            slow = FakeTier("slow")
            engine_cm = open_engine(
                harness_config(), rank=RANK, world_size=WORLD_SIZE, extra_tiers=[slow]
            )
            self.engine: Engine = self._stack.enter_context(
                self.portal.wrap_async_context_manager(engine_cm)
            )
            self.portal.call(self._fill, slow)
        except BaseException:
            self._stack.close()
            raise
        self.server = LookupServer(self.engine, None, None)  # type: ignore[arg-type]
        self.inputs = 0

    async def _fill(self, slow: Any) -> None:
        await fill_stored_prompts(self.engine, slow)

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> HandleHarness:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run(self, data: bytes) -> None:
        self.inputs += 1
        self.portal.call(self._run, split_frames(data))

    async def _run(self, frames: list[bytes]) -> None:
        server, engine = self.server, self.engine
        # Start clean even after an input that failed a check (Hypothesis goes on shrinking).
        engine.cancel_all()
        await engine.wait_quiet()
        server._outbox.clear()
        failed_before = _failures(engine)
        accepted: Counter[tuple[str, int]] = Counter()
        most: dict[tuple[str, int], int] = {}
        for frame in frames:
            # The oracle, frame by frame: what the server must count for this frame.  A
            # request older than the running lookup of its id is stale (dropped, unanswered)
            # whether or not it makes sense; otherwise it is accepted and answered, and one
            # that makes no sense is also counted as malformed.
            outcome = classify_worker_frame(frame)
            want: Counter[str] = Counter()
            if outcome.kind == "malformed":
                want["messages_malformed"] = 1
            elif outcome.kind == "cleanup":
                want["cleanups_received"] = 1
            else:
                msg = outcome.msg
                current = engine.current_seq(msg.lookup_id)
                want["requests_received"] = 1
                if current is not None and msg.seq and msg.seq < current:
                    want["requests_stale"] = 1
                else:
                    want["requests_accepted"] = 1
                    want["messages_malformed"] = int(outcome.kind == "invalid")
                    key = (msg.lookup_id, msg.seq)
                    accepted[key] += 1
                    most[key] = max(most.get(key, 0), outcome.max_tokens)
            before = msgspec.structs.asdict(server.counters)
            server._handle(frame)
            after = msgspec.structs.asdict(server.counters)
            got = Counter({k: after[k] - before[k] for k in before})
            assert +got == +want, (got, want, outcome)
            check_worker_frame(frame)  # and the decoder's own rules
            # Let lookups run between frames now and then, as a real receive loop would.
            if len(frame) % 3 == 0:
                await trio.lowlevel.checkpoint()
        engine.cancel_all()
        await engine.wait_quiet()
        answers = [decode_response(buf) for buf in server._outbox]
        server._outbox.clear()
        server.counters.answers_sent += len(answers)  # what the send task would do
        # Exactly one answer per accepted request, within its tokens, from this rank.
        assert Counter((a.lookup_id, a.seq) for a in answers) == accepted, (answers, accepted)
        for a in answers:
            assert a.worker_id == RANK
            assert 0 <= a.num_hit_tokens <= most[(a.lookup_id, a.seq)], a
        assert_idle(engine, failed_before)


def _failures(engine: Engine) -> tuple[int, ...]:
    s = engine.statistics()
    return (s.lookups.failed, *(tier.errors for _, tier in s.tiers))


def assert_idle(engine: Engine, failures_before: tuple[int, ...] | None = None) -> None:
    """DESIGN §7 conservation, and no lookup failed and no tier erred (since
    ``failures_before``, from :func:`_failures`, if given)."""
    s = engine.statistics()
    assert s.lookups.inflight == 0 and s.lookups.held == 0, s
    assert s.pinned_chunks == 0 and s.limiter.used == 0, s
    assert s.arena.used_bytes == s.cpu_resident_bytes, s
    before = failures_before or (0,) * (1 + len(s.tiers))
    assert _failures(engine) == before, f"a lookup failed or a tier erred: {s}"


# -- a config file ---------------------------------------------------------------------------
FIELDS: tuple[str, ...] = tuple(PrefetchConfig.__struct_fields__)


def assert_names_what_to_fix(exc: ValueError, names: set[str]) -> None:
    """The message starts with one of ``names`` (its ``repr`` if it is not printable) and a
    colon, and is one line."""
    msg = str(exc)
    shown = {*names, *(repr(name) for name in names)}
    assert any(msg.startswith(f"{name}: ") for name in shown), msg
    assert "\n" not in msg and "\r" not in msg, msg


def assert_usable(config: PrefetchConfig) -> None:
    """A config that validated can be used: its text goes into keys, paths and URLs."""
    key = ChunkKey(config.model_name, 1, 0, 2**64 - 1, config.kv_dtype, 3)
    key.to_string().encode("utf-8")
    assert ChunkKey.from_string(key.to_string()) == key
    if config.disk_path is not None:
        os.fsencode(config.disk_path)
        assert "\x00" not in config.disk_path
    if config.redis_url is not None:
        config.redis_url.encode("utf-8")
    if config.mooncake_master is not None:  # what the Mooncake tier is given
        parse_host_port(config.mooncake_master)
    for text in (config.mooncake_metadata_server, config.mooncake_local_hostname):
        text.encode("utf-8")
    assert PrefetchConfig.from_dict(config.to_dict()) == config


def toml_keys(raw: bytes) -> list[str]:
    """The keys of the table ``from_file`` reads (the names a message may start with)."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - exercised on 3.10 only
        import tomli as tomllib

    try:
        doc = tomllib.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError):
        return []
    table = doc.get("lmprefetch", doc)
    return list(table) if isinstance(table, dict) else []


_scratch: list[Path] = []


def _scratch_dir() -> Path:
    """A directory for the files the checks write (one per process, reused)."""
    if not _scratch:
        _scratch.append(Path(tempfile.mkdtemp(prefix="lmprefetch-fuzz-")))
        # Removed as the process exits (the suite left one in the temporary directory).
        atexit.register(shutil.rmtree, _scratch[0], ignore_errors=True)
    return _scratch[0]


def check_config_toml(data: bytes) -> None:
    """A config file with these bytes loads into a usable config, or is a one-line
    ``ValueError`` naming the file or the field to fix."""
    path = _scratch_dir() / "config.toml"
    path.write_bytes(data)
    try:
        config = PrefetchConfig.from_file(path)
    except ValueError as exc:
        assert_names_what_to_fix(exc, {str(path), "config", *FIELDS, *toml_keys(data)})
    else:
        assert_usable(config)


# -- a chunk file of the disk tier --------------------------------------------------------------
#: The key every fuzzed chunk file is read back as, and the buffer it is read into.
CHUNK_KEY = ChunkKey("model", 1, 0, 2**64 - 1, "bfloat16")
CHUNK_SLOT_BYTES = 64


def check_chunk_file(data: bytes) -> None:
    """A file with these bytes, read back by the disk tier as :data:`CHUNK_KEY`, is either a
    well-formed chunk file for that key whose whole payload (checksum verified) lands in the
    buffer, or a ``ChunkMiss`` (corrupt, another key's, too large): never an exception of
    another kind, never garbage."""
    from lmprefetch.tiers import chunkfile

    path = _scratch_dir() / f"{CHUNK_KEY.to_string()}{chunkfile.FILE_SUFFIX}"
    path.write_bytes(data)
    slot = bytearray(CHUNK_SLOT_BYTES)
    key_bytes = CHUNK_KEY.to_string().encode()
    try:
        n = chunkfile.read_buffered(str(path), key_bytes, memoryview(slot)).payload_bytes
    except chunkfile.ChunkMiss:
        return
    head = chunkfile.HEADER.unpack_from(data, 0)
    assert head[:3] == (chunkfile.MAGIC, chunkfile.VERSION, chunkfile.HEADER_BYTES), head
    payload = data[chunkfile.HEADER_BYTES :]
    assert head[3] == n == len(payload) <= CHUNK_SLOT_BYTES, (head, n)
    assert head[4] == xxhash.xxh3_64_intdigest(payload)
    start = chunkfile.HEADER.size
    assert head[5] == len(key_bytes) and data[start : start + head[5]] == key_bytes
    assert bytes(slot[:n]) == payload


def check_chunk_name(data: bytes) -> None:
    """A file name in the disk tier's directory (any bytes, as ``os.scandir`` gives them) is
    either the canonical name of a key, or not one of ours: never an exception."""
    from lmprefetch.tiers import chunkfile

    name = data.decode("utf-8", "surrogateescape")
    key = chunkfile.parse_name(name)
    if key is not None:
        assert key.to_string() + chunkfile.FILE_SUFFIX == name, (key, name)


#: Target name → the check of one input (the server target needs a harness: see ``runner``).
TARGETS: dict[str, Callable[[bytes], object] | None] = {
    "worker_frame": check_worker_frame,
    "response_frame": check_response_frame,
    "server_frames": None,
    "config_toml": check_config_toml,
    "chunk_file": check_chunk_file,
    "chunk_name": check_chunk_name,
}


def runner(target: str) -> tuple[Callable[[bytes], object], Callable[[], None]]:
    """The check for ``target`` and a function that releases what it holds."""
    check = TARGETS[target]
    if check is not None:
        return check, lambda: None
    harness = HandleHarness()
    return harness.run, harness.close


if __name__ == "__main__":  # pragma: no cover - replay one file by hand
    target_name, path = sys.argv[1], sys.argv[2]
    run_one, done = runner(target_name)
    try:
        with open(path, "rb") as f:
            run_one(f.read())
    finally:
        done()
    print("ok")
