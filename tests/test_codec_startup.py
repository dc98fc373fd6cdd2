"""Start-up errors of the codec and encryption settings: one line naming the field, exit 2,
explained in docs/troubleshooting.md (the helpers of test_startup_errors.py)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from .test_startup_errors import assert_one_line_exit_2, run, toml, worker_args

__all__ = ["toml"]  # the fixture, imported for this module's tests


@pytest.mark.parametrize(
    ("setting", "words"),
    [
        ('disk_codec = "zip"', ["disk_codec", "must be one of", "bitround<N>"]),
        ('redis_codec = "int8"\nkv_dtype = "int8"', ["redis_codec", "floating-point kv_dtype"]),
        ('mooncake_codec = "bitround7"', ["mooncake_codec", "N from 1 to 6"]),
    ],
)
def test_a_bad_codec_setting_names_the_field(
    setting: str, words: list[str], toml: Callable[[str], str]
) -> None:
    assert_one_line_exit_2(run(worker_args("--config", toml(setting + "\n"))), *words)


def test_a_missing_or_short_key_file_stops_the_start(
    tmp_path: Path, toml: Callable[[str], str]
) -> None:
    missing = tmp_path / "no-such-key"
    out = run(worker_args("--config", toml(f'encryption_key_file = "{missing}"\n')))
    assert_one_line_exit_2(out, "encryption_key_file", str(missing), "not found")
    short = tmp_path / "short-key"
    short.write_bytes(b"0123456789")
    out = run(worker_args(), env={"LMPREFETCH_ENCRYPTION_KEY_FILE": str(short)})
    assert_one_line_exit_2(out, "encryption_key_file", "holds 10 bytes", "LMPREFETCH_")


def test_a_codec_without_its_libraries_says_what_to_install(
    tmp_path: Path, toml: Callable[[str], str]
) -> None:
    import subprocess

    script = tmp_path / "no_zstd.py"
    script.write_text(
        "import sys, importlib.util\n"
        "real = importlib.util.find_spec\n"
        "importlib.util.find_spec = lambda n, *a: None if n == 'zstandard' else real(n, *a)\n"
        "from lmprefetch.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    path = toml('disk_codec = "lossless"\n')
    out = subprocess.run(
        [sys.executable, str(script), *worker_args("--config", path)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert_one_line_exit_2(out, "disk_codec", "zstandard", "lmprefetch[codecs]")
