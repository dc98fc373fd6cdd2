"""Fuzzing what a person types: ``PrefetchConfig`` from dicts, TOML files and the environment,
and the ``lmprefetch`` command line.

The rules checked (``docs/reliability.md``): a bad setting is a ``ValueError`` whose message
starts with the name to fix (the field, the variable, the file) and is one line; nothing else
escapes; and whatever validates can be used (its text can be written into keys, file names and
Redis commands).  The command line ends with exit status 0 or 2 (or 1, never here), and a
status 2 prints exactly one line and no traceback.  Nothing real starts:
``WorkerRuntime.start`` and the benchmarks' runs are replaced by a stub that records the call.

Example counts are modest; ``LMPF_FUZZ_SCALE`` multiplies them.
"""

from __future__ import annotations

import json
import os
import string
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmprefetch import PrefetchConfig, cli

from .fuzz import budget
from .fuzz.frames import weighted
from .fuzz.targets import FIELDS, assert_names_what_to_fix, assert_usable, toml_keys


def fuzz_settings(examples: int) -> settings:
    return budget.fuzz_settings(examples, HealthCheck.function_scoped_fixture)


# -- values ------------------------------------------------------------------------------------
_texts = weighted(
    (6, st.text(max_size=12)),
    # Lone surrogates: what Python makes of an environment variable that is not UTF-8.
    (1, st.binary(min_size=1, max_size=6).map(lambda b: b.decode("utf-8", "surrogateescape"))),
    (1, st.sampled_from(["", " ", "\x00", "a\nb", "redis://127.0.0.1:1", "rediss://h:1,redis://"])),
)
_numbers_as_text = st.sampled_from(
    ["0", "-1", "1", "256", "1_000", "0x10", "1e3", "1e400", "-0", "nan", "inf", "-inf", " 4 ",
     "99999999999999999999", "1" + "0" * 400, "true", "false", "yes", "null", "٣"]
)  # fmt: skip
_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),  # unbounded: far past every range
    st.floats(),
    _texts,
    _numbers_as_text,
    st.binary(max_size=6),
)
_values = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner),
    max_leaves=5,
)


def _plausible(field: str) -> st.SearchStrategy[Any]:
    """About the right kind of value for ``field``, at the edges."""
    default = getattr(PrefetchConfig(), field)
    if isinstance(default, bool):
        return st.one_of(st.booleans(), st.sampled_from(["true", "false", "1", "0", "maybe"]))
    if isinstance(default, int):
        return st.one_of(
            st.integers(-2, 2**70),
            st.sampled_from([default, default * 2, default // 2, 2**31 - 1, 2**63]),
            _numbers_as_text,
        )
    if isinstance(default, float):
        return st.one_of(st.floats(), st.integers(-1, 10**6), _numbers_as_text)
    return _texts


_keys = weighted((6, st.sampled_from(FIELDS)), (1, st.text(max_size=8)))
configs_as_dicts = st.dictionaries(_keys, st.none(), max_size=6).flatmap(
    lambda d: st.fixed_dictionaries(
        {k: (_plausible(k) if k in FIELDS else _values) | _values for k in d}
    )
)


# -- (d) PrefetchConfig ---------------------------------------------------------------------
@fuzz_settings(150)
@given(st.one_of(configs_as_dicts, _values))
def test_from_dict_succeeds_or_names_the_field(data: Any) -> None:
    try:
        config = PrefetchConfig.from_dict(data)
    except ValueError as exc:
        names = {"config", *FIELDS}
        if isinstance(data, Mapping):
            names |= {str(k) for k in data} | {repr(k) for k in data if not isinstance(k, str)}
        assert_names_what_to_fix(exc, names)
    else:
        assert_usable(config)


# TOML, written as text: every kind of literal, right and wrong, under every kind of key.
_toml_literals = st.one_of(
    st.integers().map(str),
    st.sampled_from(["0x1F", "0o17", "0b101", "1_000", "+5", "-0", "99999999999999999999"]),
    st.sampled_from(["inf", "-inf", "nan", "+nan", "1e400", "6.02e23", "-0.0", "1.", ".5"]),
    st.floats(allow_nan=False, allow_infinity=False).map(repr),
    st.sampled_from(["true", "false", "True", "1979-05-27T07:32:00Z", "1979-05-27", "07:32:00"]),
    _texts.map(lambda s: json.dumps(s, ensure_ascii=bool(len(s) % 2))),  # basic strings
    st.text(string.printable.replace("'", "").replace("\n", ""), max_size=8).map(
        lambda s: f"'{s}'"
    ),
    st.sampled_from(['"""a\nb"""', "'''x'''", "[1, 2]", "[]", "{a = 1}", "{}", '"\\u0000"']),
    # Nested deep enough to exhaust a recursive parser.
    st.integers(1, 5000).map(lambda n: "[" * n + "]" * n),
    st.integers(1, 5000).map(lambda n: "{a = " * n + "1" + "}" * n),
)
_toml_keys = st.one_of(
    st.sampled_from(FIELDS),
    st.sampled_from(FIELDS).map(lambda f: f"lmprefetch.{f}"),
    st.text(string.ascii_letters + "_-", min_size=1, max_size=8),
    st.text(max_size=6).map(json.dumps),  # quoted keys: any text, newlines too
)
_toml_lines = st.one_of(
    st.tuples(_toml_keys, _toml_literals).map(lambda kv: f"{kv[0]} = {kv[1]}"),
    st.sampled_from(["[lmprefetch]", "[[lmprefetch]]", "lmprefetch = 5", "[other]", "[", "# x"]),
)
toml_documents = st.one_of(
    st.lists(_toml_lines, max_size=8).map("\n".join),
    st.text(max_size=40),
)


@pytest.fixture
def scratch(tmp_path: Path) -> Path:
    """A directory for this test's files (Hypothesis reuses it across examples)."""
    return tmp_path


@fuzz_settings(250)
@given(st.one_of(toml_documents.map(lambda t: t.encode("utf-8", "surrogatepass")), st.binary()))
def test_from_file_succeeds_or_names_the_file_or_the_field(scratch: Path, raw: bytes) -> None:
    path = scratch / f"{uuid.uuid4().hex}.toml"
    path.write_bytes(raw)
    try:
        config = PrefetchConfig.from_file(path)
    except ValueError as exc:
        names = {str(path), "config", *FIELDS}
        names |= set(toml_keys(raw))
        assert_names_what_to_fix(exc, names)
    else:
        assert_usable(config)
    finally:
        path.unlink()


_env_names = weighted(
    (6, st.sampled_from(FIELDS).map(lambda f: f"LMPREFETCH_{f.upper()}")),
    (1, st.text(string.ascii_uppercase + "_", max_size=8).map(lambda s: f"LMPREFETCH_{s}")),
    (1, st.sampled_from(["HOME", "LMPREFETCH", "lmprefetch_chunk_size", "LMPREFETCH_CONFIG"])),
)


@fuzz_settings(250)
@given(
    st.dictionaries(_env_names, st.one_of(_texts, _numbers_as_text), max_size=5),
    st.one_of(st.none(), toml_documents),
)
def test_from_env_succeeds_or_names_the_variable_or_the_field(
    scratch: Path, environ: dict[str, str], toml: str | None
) -> None:
    path = scratch / f"{uuid.uuid4().hex}.toml"
    if toml is not None:
        path.write_bytes(toml.encode("utf-8", "surrogatepass"))
        environ = {**environ, "LMPREFETCH_CONFIG": str(path)}
    try:
        config = PrefetchConfig.from_env(environ)
    except ValueError as exc:
        names = {*environ, str(path), environ.get("LMPREFETCH_CONFIG", ""), "config", *FIELDS}
        if toml is not None:
            names |= set(toml_keys(toml.encode("utf-8", "surrogatepass")))
        assert_names_what_to_fix(exc, names)
    else:
        assert_usable(config)
    finally:
        path.unlink(missing_ok=True)


# -- (e) the command line -------------------------------------------------------------------
class Started(Exception):
    """Raised by the stubs: the command got past its checks and would start now."""


@pytest.fixture
def stubbed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing real starts: no worker runtime, no benchmark, no signal handler, no
    ``LMPREFETCH_*`` variable from the environment this suite runs in."""
    from lmprefetch.bench import disk, engine, system
    from lmprefetch.runtime import WorkerRuntime

    def start(*args: object, **kwargs: object) -> None:
        raise Started

    monkeypatch.setattr(WorkerRuntime, "start", start)
    monkeypatch.setattr(system, "run_bench", start)
    monkeypatch.setattr(engine, "run", start)
    monkeypatch.setattr(disk, "run", start)
    monkeypatch.setattr(cli.signal, "signal", lambda *a: None)
    for name in list(os.environ):
        if name.startswith("LMPREFETCH_"):
            monkeypatch.delenv(name)


_options = [
    "--rank", "--world-size", "--request-endpoint", "--response-endpoint", "--config",
    "--metrics-port", "--metrics-host", "--workers", "--conversations", "--turns", "--repeats",
    "--concurrency", "--abort-ratio", "--chunk-bytes", "--cpu-bytes", "--miss-lookups",
    "--rtt-samples", "--transport", "--seed", "--json", "--plot", "--no-progress", "--chunks",
    "-v", "--verbose", "--help", "--version", "--rank=", "--", "-", "--rnk",
    "--runs", "--burners", "--lmcache", "--quick", "--disk-only", "--disk-probe-rounds",
    "--cancel-samples",
]  # fmt: skip
_endpoints = st.one_of(
    st.just("ipc://@lmp-fuzz-cli").map(lambda s: f"{s}-{uuid.uuid4().hex[:8]}"),
    st.sampled_from(["tcp://127.0.0.1:0", "tcp://[::1]:5555", "tcp://x:99999", "http://x"]),
    st.sampled_from(["ipc://", "ipc://@", "ipc:///" + "x" * 200, "tcp://:1", ""]),
)
_arg_values = st.one_of(
    _numbers_as_text,
    st.integers(-(2**70), 2**70).map(str),
    st.floats().map(str),
    _endpoints,
    st.sampled_from(["ipc", "tcp", "127.0.0.1", "0.0.0.0", "::1", "/nonexistent/x.toml", "/"]),
    _texts.filter(lambda s: "\x00" not in s),  # execve cannot pass a NUL
)
_worker_argv = st.tuples(
    st.lists(st.sampled_from(["--rank", "--world-size", "--metrics-port"]), max_size=2),
    st.lists(_arg_values, min_size=2, max_size=2),
    _endpoints,
    _endpoints,
).map(
    lambda t: [
        "worker",
        "--request-endpoint",
        t[2],
        "--response-endpoint",
        t[3],
        *[x for pair in zip(t[0], t[1]) for x in pair],
    ]
)
argvs = st.one_of(
    st.lists(
        st.one_of(
            st.sampled_from(["worker", "bench", "bench-engine", "bench-disk"]),
            st.sampled_from(_options),
            _arg_values,
        ),
        max_size=8,
    ),
    _worker_argv,
    st.tuples(
        st.sampled_from(["bench", "bench-engine", "bench-disk"]),
        st.lists(st.tuples(st.sampled_from(_options), _arg_values), max_size=4),
    ).map(lambda t: [t[0], *[x for pair in t[1] for x in pair]]),
)


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int | str, str, str]:
    """``lmprefetch argv`` in-process: (exit status or "started", stdout, stderr)."""
    try:
        status: int | str = cli.main(argv)
    except SystemExit as exc:  # argparse: --help, --version, usage errors
        status = exc.code if isinstance(exc.code, int) else 1
    except Started:
        status = "started"
    out, err = capsys.readouterr()
    return status, out, err


@fuzz_settings(300)
@given(argvs)
def test_the_command_line_ends_with_0_or_one_line_and_2(
    stubbed: None, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    status, out, err = run_cli(argv, capsys)
    assert "Traceback" not in out + err
    if status == "started":
        assert err == "", err
    elif status == 0:
        assert out and not err  # --help or --version
    else:
        assert status == 2, (status, err)
        assert len(err.splitlines()) == 1, err
        assert err.startswith("lmprefetch"), err


@fuzz_settings(150)
@given(toml_documents)
def test_a_worker_given_any_config_file_starts_or_says_why_in_one_line(
    stubbed: None, capsys: pytest.CaptureFixture[str], scratch: Path, toml: str
) -> None:
    path = scratch / f"{uuid.uuid4().hex}.toml"
    path.write_bytes(toml.encode("utf-8", "surrogatepass"))
    argv = ["worker", "--request-endpoint", "ipc://@a", "--response-endpoint", "ipc://@b"]
    try:
        status, _out, err = run_cli([*argv, "--config", str(path)], capsys)
    finally:
        path.unlink()
    assert status in ("started", 2), (status, err)
    if status == 2:
        assert len(err.splitlines()) == 1 and "Traceback" not in err, err
