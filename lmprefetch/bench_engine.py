"""Kept for old imports: the engine benchmark is :mod:`lmprefetch.bench.engine`."""

from __future__ import annotations

from .bench.engine import add_arguments as add_arguments
from .bench.engine import format_report as format_report
from .bench.engine import main as main
from .bench.engine import run as run

__all__ = ["add_arguments", "format_report", "main", "run"]
