"""Shared fixtures.  Real-I/O tests use the real clock with an outer ``fail_after``; tests whose
blocking is all in-process may use ``autojump_clock``."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmprefetch import PrefetchConfig

from . import components, hang_dump

# The hooks of ``--require COMPONENT`` (tests/components.py) and of the per-test hang dumps
# (tests/hang_dump.py) are registered from here.
from .components import pytest_runtest_makereport, pytest_sessionfinish  # noqa: F401
from .hang_dump import pytest_runtest_setup, pytest_unconfigure  # noqa: F401


def pytest_addoption(parser: pytest.Parser) -> None:
    components.pytest_addoption(parser)
    hang_dump.pytest_addoption(parser)


def pytest_configure(config: pytest.Config) -> None:
    hang_dump.pytest_configure(config)
    components.pytest_configure(config)


@pytest.fixture
def small_config() -> PrefetchConfig:
    """4-token chunks of at most 64 bytes, a 32-slot arena."""
    return PrefetchConfig(chunk_size=4, chunk_bytes=64, cpu_bytes=64 * 32)


@pytest.fixture(scope="session")
def trained_model() -> Path:
    """The trained model's directory (SmolLM2-135M, ``lmprefetch model build``), built if it
    can be; the test skips where it cannot (a failure under ``--require trained``)."""
    from lmprefetch.bench.trained import ModelUnavailable, ensure_model

    try:
        return ensure_model()
    except ModelUnavailable as exc:
        pytest.skip(f"the trained model cannot be built here: {exc}")
