"""Every example runs (an example that does not run in the test suite is a bug)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run_example(name: str, *args: str, timeout: float = 300) -> str:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_quickstart() -> None:
    out = run_example("quickstart.py")
    assert "stored 6 chunks" in out
    assert "cached prefix: 96 tokens" in out
    assert "claimed 6 chunks" in out
    assert "second prompt: 48 tokens cached" in out


@pytest.mark.slow
def test_bench_engine_example() -> None:
    out = run_example("bench_engine.py", "3")
    assert "disk hit (page cache)" in out
    assert "leak check after the run: OK" in out
