"""Goals of the benchmarks: each figure printed with its goal, and marked when it misses it.

A :class:`Goal` is one figure from one run and the bound it should meet.  The reports print
:meth:`Goal.mark` beside the figure (``✓`` or ``✗ MISSED``) and ``--json`` carries
:meth:`Goal.as_dict` for each, so nobody has to compare numbers by eye.  A figure that could
not be measured in this run (a peer that is not installed) has no goal line at all: no figure
is ever copied from another run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["Goal"]


@dataclass(frozen=True)
class Goal:
    """``value`` (measured in this run) against ``target``.

    Args:
        key: the figure's name in ``--json``.
        label: what the figure is, for people.
        value: the figure.
        op: ``"<="`` (at most the target is good) or ``">="`` (at least).
        target: the goal.
        unit: printed after value and target (``"×"``, ``"µs"``, ``"ms"``, ``"/s"``).
    """

    key: str
    label: str
    value: float
    op: Literal["<=", ">="]
    target: float
    unit: str

    @property
    def met(self) -> bool:
        """Whether the figure meets its goal (a figure that is not a number never does)."""
        if math.isnan(self.value):
            return False
        return self.value <= self.target if self.op == "<=" else self.value >= self.target

    def goal_text(self) -> str:
        sign = "≤" if self.op == "<=" else "≥"
        return f"{sign} {_num(self.target)}{self.unit}"

    def mark(self) -> str:
        """``✓`` when met, else ``✗ MISSED``."""
        return "✓" if self.met else "✗ MISSED"

    def line(self, width: int = 58) -> str:
        """One report line: label, value, goal and mark."""
        return (
            f"  {self.label:<{width}} {_num(self.value):>9}{self.unit:<2}  goal "
            f"{self.goal_text():<9} {self.mark()}"
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "label": self.label,
            "value": self.value,
            "goal": self.goal_text(),
            "met": self.met,
        }


def _num(x: float) -> str:
    if math.isnan(x):
        return "n/a"
    if abs(x) >= 100:
        return f"{x:.0f}"
    if abs(x) >= 10:
        return f"{x:.1f}"
    return f"{x:.2f}"
