"""Shared fixtures.  Real-I/O tests use the real clock with an outer ``fail_after``; tests whose
blocking is all in-process may use ``autojump_clock``."""

from __future__ import annotations

import pytest

from lmprefetch import PrefetchConfig

# ``--require COMPONENT`` (see tests/components.py): the hooks are registered from here.
from .components import (  # noqa: F401
    pytest_addoption,
    pytest_configure,
    pytest_runtest_makereport,
    pytest_sessionfinish,
)


@pytest.fixture
def small_config() -> PrefetchConfig:
    """4-token chunks of at most 64 bytes, a 32-slot arena."""
    return PrefetchConfig(chunk_size=4, chunk_bytes=64, cpu_bytes=64 * 32)
