"""Every input the fuzzers ever kept, replayed through its target's check on every test run.

``tests/fuzz/crashes/<target>/`` holds each input that once failed a check (found by atheris
in ``nox -s fuzz``, or by a Hypothesis test and written down); ``tests/fuzz/corpus/<target>/``
holds the seeds and the inputs the coverage-guided fuzzer kept for new coverage.  A crash
file that fails here is a regression (or a new find: fix it, keep the file).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from .fuzz.targets import TARGETS, HandleHarness

FUZZ = Path(__file__).parent / "fuzz"


def _inputs() -> list[tuple[str, Path]]:
    found = []
    for kind in ("crashes", "corpus"):
        for target in TARGETS:
            directory = FUZZ / kind / target
            if directory.is_dir():
                found += [(target, p) for p in sorted(directory.iterdir()) if p.is_file()]
    return found


INPUTS = _inputs()


@pytest.fixture(scope="module")
def harness() -> Iterator[HandleHarness]:
    with HandleHarness() as h:
        yield h


def test_every_target_has_a_corpus() -> None:
    for target in TARGETS:
        assert any(t == target for t, p in INPUTS if p.parent.parent.name == "corpus"), target


@pytest.mark.parametrize(
    ("target", "path"),
    INPUTS,
    ids=[f"{p.parent.parent.name}/{t}/{p.name}" for t, p in INPUTS],
)
def test_kept_input_passes_its_check(
    target: str, path: Path, request: pytest.FixtureRequest
) -> None:
    data = path.read_bytes()
    check = TARGETS[target]
    if check is None:  # the server's receive path needs the live engine
        request.getfixturevalue("harness").run(data)
    else:
        check(data)
