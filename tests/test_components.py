"""``--require COMPONENT`` (tests/components.py): a session meant to exercise a component fails
when the component is missing or its tests skip, and the default run still skips.

Each case runs pytest (in this process: the plugin keeps its state in the run's config) on a
small test file, with made-up components: ``gadget`` (always usable), ``gizmo`` (a package that
does not exist) and ``doohickey`` (a program that is not on ``PATH``).
"""

from __future__ import annotations

import pytest

from . import components

pytest_plugins = ("pytester",)

CONFTEST = """
from tests.components import (
    pytest_addoption,
    pytest_configure,
    pytest_runtest_makereport,
    pytest_sessionfinish,
)
"""

INI = """
[pytest]
addopts = -p no:cacheprovider -rs
markers =
    gadget: needs the gadget
    gizmo: needs the gizmo
    doohickey: needs the doohickey
"""

TESTS = """
import pytest

@pytest.mark.gadget
def test_gadget_skips():
    pytest.skip("no gadget here")

@pytest.mark.gadget
@pytest.mark.skipif(True, reason="gadget switched off")
def test_gadget_skip_mark():
    pass

@pytest.mark.gadget
def test_gadget_works():
    pass

@pytest.mark.gadget
@pytest.mark.xfail(reason="known", run=False)
def test_gadget_xfail():
    pass

def test_plain_skip():
    pytest.skip("unrelated to any component")
"""


@pytest.fixture
def suite(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    monkeypatch.setitem(components.COMPONENTS, "gadget", ((), ()))
    monkeypatch.setitem(components.COMPONENTS, "gizmo", (("lmprefetch_no_such_package",), ()))
    monkeypatch.setitem(components.COMPONENTS, "doohickey", ((), ("lmprefetch-no-such-program",)))
    pytester.makeconftest(CONFTEST)
    pytester.makeini(INI)
    pytester.makepyfile(test_suite=TESTS)
    return pytester


def test_without_require_skips_stay_skips(suite: pytest.Pytester) -> None:
    result = suite.runpytest_inprocess()
    result.assert_outcomes(passed=1, skipped=3, xfailed=1)
    assert result.ret == pytest.ExitCode.OK


def test_required_component_turns_its_tests_skips_into_failures(suite: pytest.Pytester) -> None:
    result = suite.runpytest_inprocess("--require", "gadget")
    # pytest.skip in the test (call) fails; the skip mark (setup) errors; xfail and the
    # unmarked test's skip are left alone.
    result.assert_outcomes(passed=1, failed=1, errors=1, skipped=1, xfailed=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(
        [
            "*ERROR at setup of test_gadget_skip_mark*",
            "*skipped, but this session requires gadget (--require)*gadget switched off*",
            "*FAILURES*",
            "*skipped, but this session requires gadget (--require)*no gadget here*",
        ]
    )


def test_required_component_whose_tests_all_pass(suite: pytest.Pytester) -> None:
    result = suite.runpytest_inprocess("--require", "gadget", "-k", "works or xfail")
    result.assert_outcomes(passed=1, xfailed=1)
    assert result.ret == pytest.ExitCode.OK


def test_required_component_with_no_test_run_fails(suite: pytest.Pytester) -> None:
    result = suite.runpytest_inprocess("--require", "gadget", "-m", "not gadget")
    result.assert_outcomes(skipped=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*--require gadget: no test marked 'gadget' ran*"])


def test_required_package_that_does_not_import_stops_the_run(suite: pytest.Pytester) -> None:
    result = suite.runpytest_inprocess("--require", "gizmo")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["*--require gizmo: lmprefetch_no_such_package cannot be imported (ModuleNotFoundError*"]
    )


def test_required_program_not_on_path_stops_the_run(suite: pytest.Pytester) -> None:
    result = suite.runpytest_inprocess("--require", "doohickey")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["*--require doohickey: lmprefetch-no-such-program is not on PATH*"]
    )


def test_unknown_component_is_a_usage_error(suite: pytest.Pytester) -> None:
    result = suite.runpytest_inprocess("--require", "nothing")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*argument --require: invalid choice: 'nothing'*"])
