"""Where a hung test is stuck: every thread's stack, dumped once a test outruns its budget.

pytest's ``faulthandler_timeout`` gives every test one budget, and its dump does not stop the
test.  With one budget for all, the tests meant to take minutes (those that start vLLM or
LMCache, and the ``slow`` ones, on two busy cores) printed ``Timeout (0:02:00)!`` and every
thread's stack on runs that then passed, which reads as a failure.  Here a test marked with
one of :data:`LONG_MARKERS` gets the longer budget of the ini option ``hang_dump_timeout_long``
(seconds); every other test keeps ``faulthandler_timeout``.  A real hang is still diagnosed,
in either kind of test, once its budget is spent.

How: pytest arms ``faulthandler.dump_traceback_later(faulthandler_timeout)`` around each
test's whole protocol (setup, call, teardown) and cancels it afterwards.  The setup hook
below runs first thing inside that, before any fixture (a module-scoped fixture that starts
vLLM runs in its first test's setup), and re-arms the timer with the longer budget; pytest's
own cancel still ends it.  The dump goes to a copy of the terminal's stderr taken before
output capturing starts, as pytest's own does.
"""

from __future__ import annotations

import faulthandler
import os
import sys

import pytest

#: Tests with any of these markers get ``hang_dump_timeout_long``.
LONG_MARKERS = ("vllm", "hybrid", "lmcache", "slow")
_STDERR_FD = pytest.StashKey[int]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini(
        "hang_dump_timeout_long",
        "seconds before the stacks of a test marked "
        f"{' / '.join(LONG_MARKERS)} are dumped (tests/hang_dump.py); others get "
        "faulthandler_timeout",
        type="string",
        default="0",
    )


def pytest_configure(config: pytest.Config) -> None:
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        # No file descriptor behind stderr (mutmut runs pytest in-process with stderr
        # captured): pytest's own faulthandler is off then too, and so is the longer budget.
        return
    config.stash[_STDERR_FD] = os.dup(fd)


def pytest_unconfigure(config: pytest.Config) -> None:
    fd = config.stash.get(_STDERR_FD, None)
    if fd is not None:
        os.close(fd)
        del config.stash[_STDERR_FD]


def budget_s(item: pytest.Item) -> float:
    """The seconds ``item`` may run before its stacks are dumped (0: never)."""
    default = float(item.config.getini("faulthandler_timeout") or 0)
    long = float(item.config.getini("hang_dump_timeout_long") or 0)
    if default > 0 and long > 0 and any(item.get_closest_marker(m) for m in LONG_MARKERS):
        return max(default, long)
    return default


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    budget = budget_s(item)
    default = float(item.config.getini("faulthandler_timeout") or 0)
    fd = item.config.stash.get(_STDERR_FD, None)
    if budget > default and fd is not None:
        faulthandler.dump_traceback_later(budget, file=fd)
