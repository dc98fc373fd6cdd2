"""Coverage-guided fuzzing of one target with atheris (libFuzzer for Python).

Usage, from the repository root (``nox -s fuzz`` runs every target this way)::

    python tests/fuzz/run_atheris.py TARGET [libFuzzer options] [WORK_DIR]

``TARGET`` is one of ``tests/fuzz/targets.py``'s ``TARGETS``.  The checked-in corpus
``tests/fuzz/corpus/TARGET/`` is always read (never written: new inputs go to ``WORK_DIR``,
which should be outside the repository); a crashing input is written to
``tests/fuzz/crashes/TARGET/`` (libFuzzer's ``-artifact_prefix``), where the regression test
(``tests/test_fuzz_regressions.py``) replays it in every test run from then on.  Typical
options: ``-max_total_time=60`` (seconds), ``-runs=N``, ``-seed=N``.

What is instrumented for coverage: lmprefetch's modules and ``tomllib`` (pure Python).  msgspec
is a C extension built without coverage instrumentation, so for the decoders the guidance
comes from lmprefetch's own code (the checks after decoding, the server's receive path, the
engine); a structure-aware mutator (:func:`mutate`) makes up for the rest by editing the
msgpack structure of an input as well as its bytes.
"""

from __future__ import annotations

import os
import random
import shlex
import sys
from pathlib import Path
from typing import Any

import atheris
import msgspec

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # so that ``tests.fuzz`` imports

with atheris.instrument_imports(include=["lmprefetch", "tomllib", "tomli", "tests.fuzz.targets"]):
    import lmprefetch  # noqa: F401
    from tests.fuzz import targets

FIELD_NAMES = [
    "type", "lookup_id", "hashes", "offsets", "request_configs", "seq", "deadline_ms",
    "skip_chunks", "num_hit_tokens", "worker_id", "junk",
]  # fmt: skip
TAGS = ["LookupRequestMsg", "LookupResponseMsg", "LookupCleanupMsg", "", "lookuprequestmsg"]
EDGE_INTS = [
    0, 1, -1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1, -(2**63),
    -(2**31), 255, 256, 65535, 65536,
]  # fmt: skip


class _Nested:
    """A placeholder for a container nested ``depth`` deep, each level ``unit``."""

    def __init__(self, depth: int, unit: bytes) -> None:
        self.raw = unit * depth + b"\xc0"
        self.marker = f"\ue000nested-{id(self)}"


def _encode(msg: Any) -> bytes:
    """``msgspec.msgpack.encode``, with every :class:`_Nested` spliced in as raw bytes."""
    nested: list[_Nested] = []

    def hook(obj: Any) -> Any:
        if isinstance(obj, _Nested):
            nested.append(obj)
            return obj.marker
        raise NotImplementedError

    out = msgspec.msgpack.encode(msg, enc_hook=hook)
    for n in nested:
        out = out.replace(msgspec.msgpack.encode(n.marker), n.raw)
    return out


def _interesting(rng: random.Random, depth: int = 0) -> Any:
    """A value of any msgpack type, biased to the edges."""
    kind = rng.randrange(11)
    if kind == 0:
        return rng.choice(EDGE_INTS)
    if kind == 1:
        return [rng.choice([*EDGE_INTS, 4, 4, 4]) for _ in range(rng.randrange(6))]
    if kind == 2:
        return rng.choice(TAGS)
    if kind == 3:
        return None
    if kind == 4:
        return rng.choice([True, False, 0.5, float("nan"), float("inf"), -0.0])
    if kind == 5:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(8)))
    if kind == 6:
        return msgspec.msgpack.Ext(rng.randrange(-128, 128), b"\x00" * rng.choice([1, 4, 8, 12]))
    if kind == 7 and depth < 3:
        return {str(rng.randrange(4)): _interesting(rng, depth + 1) for _ in range(2)}
    if kind == 8:
        return {rng.choice(EDGE_INTS): "v"}  # a key that is not a str
    if kind == 9:  # spliced in as raw bytes after encoding: msgspec will not encode it
        return _Nested(rng.choice([10, 500, 1000, 3000]), rng.choice([b"\x91", b"\x81\xc0"]))
    return "x" * rng.randrange(40)


def _mutate_message(msg: Any, rng: random.Random) -> Any:
    """Edit a decoded msgpack value: a field set, dropped, added or retagged."""
    if not isinstance(msg, dict):
        return {"type": rng.choice(TAGS), "lookup_id": "m", "payload": msg}
    msg = dict(msg)
    how = rng.randrange(5)
    name = rng.choice(FIELD_NAMES)
    if how == 0 and msg:
        msg.pop(rng.choice(list(msg)))
    elif how == 1:
        msg["type"] = rng.choice(TAGS)
    elif how == 2 and (lists := [k for k, v in msg.items() if isinstance(v, list) and v]):
        name = rng.choice(lists)  # one element of hashes or offsets
        items = list(msg[name])
        items[rng.randrange(len(items))] = rng.choice(EDGE_INTS)
        msg[name] = items
    else:
        msg[name] = _interesting(rng)
    return msg


def _mutate_frame(frame: bytes, rng: random.Random) -> bytes | None:
    try:
        msg = msgspec.msgpack.decode(frame)
    except (msgspec.DecodeError, RecursionError):
        return None
    try:
        return _encode(_mutate_message(msg, rng))
    except (msgspec.EncodeError, OverflowError, TypeError, ValueError, RecursionError):
        return None


def mutate(data: bytes, max_size: int, seed: int) -> bytes:
    """libFuzzer's byte mutations half the time; else an edit of the msgpack structure (of one
    frame, for the server target: or frames dropped, repeated or swapped)."""
    rng = random.Random(seed)
    if TARGET == "config_toml" or rng.random() < 0.5:
        return atheris.Mutate(data, max_size)
    if TARGET != "server_frames":
        out = _mutate_frame(data, rng)
        return atheris.Mutate(data, max_size) if out is None else out[:max_size]
    frames = targets.split_frames(data) or [b""]
    i = rng.randrange(len(frames))
    how = rng.randrange(4)
    if how == 0:
        frames.insert(rng.randrange(len(frames) + 1), frames[i])
    elif how == 1 and len(frames) > 1:
        del frames[i]
    elif how == 2:
        j = rng.randrange(len(frames))
        frames[i], frames[j] = frames[j], frames[i]
    else:
        out = _mutate_frame(frames[i], rng)
        frames[i] = atheris.Mutate(frames[i], max(len(frames[i]) * 2, 64)) if out is None else out
    return targets.join_frames(frames)[:max_size]


def main() -> None:
    global TARGET
    if len(sys.argv) < 2 or sys.argv[1] not in targets.TARGETS:
        sys.exit(f"usage: {sys.argv[0]} {{{','.join(targets.TARGETS)}}} [libFuzzer options]")
    TARGET = sys.argv[1]
    crashes = ROOT / "tests" / "fuzz" / "crashes" / TARGET
    crashes.mkdir(parents=True, exist_ok=True)
    corpus = ROOT / "tests" / "fuzz" / "corpus" / TARGET
    args = [a for a in sys.argv[2:] if a.startswith("-")]
    dirs = [a for a in sys.argv[2:] if not a.startswith("-")]
    # libFuzzer starts argv[0] again through the shell for -merge and -fork: make it a
    # command line that runs this script, for this target, with this interpreter.
    script = os.path.abspath(sys.argv[0])
    program = " ".join(shlex.quote(a) for a in (sys.executable, script, TARGET))
    if any(a.startswith("-merge_inner") for a in args):  # such a child: as libFuzzer says
        argv = [program, *sys.argv[2:]]
    else:
        # New inputs go to the first directory: never the checked-in corpus, unless merging.
        dirs = [str(corpus), *dirs] if "-merge=1" in args else [*dirs, str(corpus)]
        argv = [program, f"-artifact_prefix={crashes}{os.sep}", *args, *dirs]
    check, close = targets.runner(TARGET)

    def test_one_input(data: bytes) -> None:
        check(data)

    atheris.Setup(argv, test_one_input, custom_mutator=mutate)
    try:
        atheris.Fuzz()
    finally:
        close()


TARGET = ""

if __name__ == "__main__":
    main()
