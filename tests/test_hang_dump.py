"""The per-test hang dump (tests/hang_dump.py): a long test's passing run prints no stack dump,
a short test that outruns ``faulthandler_timeout`` still gets one."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

CONFTEST = """
from tests.hang_dump import (
    pytest_addoption, pytest_configure, pytest_runtest_setup, pytest_unconfigure,
)
"""
INI = """
[pytest]
faulthandler_timeout = 1
hang_dump_timeout_long = 120
markers =
    slow: long
    vllm: starts vLLM
"""
# Each test outruns faulthandler_timeout (1 s) threefold: only the unmarked one is dumped.
TESTS = """
import time

import pytest

@pytest.fixture(scope="module")
def started_server():
    time.sleep(3)  # as a module-scoped fixture that starts vLLM does, in the first test's setup
    yield

@pytest.mark.vllm
def test_marked_with_a_slow_fixture(started_server):
    pass

@pytest.mark.slow
def test_marked_and_slow_itself():
    time.sleep(3)

def test_unmarked_and_slow():
    time.sleep(3)
"""


@pytest.mark.skipif(sys.platform == "win32", reason="faulthandler's timer on a POSIX fd")
def test_only_the_unmarked_slow_test_is_dumped(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "pytest.ini").write_text(INI)
    (tmp_path / "test_sleepy.py").write_text(textwrap.dedent(TESTS))
    path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "3 passed" in out, out
    # One dump, of the unmarked test; none while the marked test's fixture or body ran.
    assert out.count("Timeout (0:00:01)!") == 1, out
    assert "in test_unmarked_and_slow" in out, out
    assert "in started_server" not in out and "in test_marked_and_slow_itself" not in out, out
