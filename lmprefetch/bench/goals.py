"""Goals of the benchmarks: each figure printed with its goal, and marked when it misses it.

A :class:`Goal` is one figure from one run and the bound it should meet.  The reports print
:meth:`Goal.mark` beside the figure (``✓`` or ``✗ MISSED``) and ``--json`` carries
:meth:`Goal.as_dict` for each, so nobody has to compare numbers by eye.  A figure that could
not be measured in this run (a peer that is not installed) has no goal line at all: no figure
is ever copied from another run.

A missed goal says whether the machine at hand could have met it: most figures have a
:class:`Limit`, the same quantity measured in the same run on something that does strictly
less than lmprefetch must (a raw pyzmq echo for a round trip, a bare Python call for a poll,
a plain read of the same files for a prefetch).  When the limit itself misses the goal, the
miss is expected on this machine; when it does not, the rest is lmprefetch's own cost or the
machine's load, and :meth:`Goal.why_missed` prints the load average taken with the figure
beside it.  Nothing in that sentence is a number from elsewhere.
"""

from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["Goal", "Limit", "load_text"]


@dataclass(frozen=True)
class Limit:
    """What bounds a figure on this machine, measured in the same run, in the figure's unit.

    Args:
        label: what was measured, for people (``"a raw pyzmq echo's round trip"``).
        value: the measurement, comparable with the goal's target.
    """

    label: str
    value: float


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
        limit: the same quantity on what bounds it here, measured in the same run, if any.
        load_avg: the 1-minute load average when the figure was measured (NaN: unknown).
        load_avg_before: the 1-minute load average before the run started (other jobs).
        cpus: the machine's CPU count (0: unknown).
    """

    key: str
    label: str
    value: float
    op: Literal["<=", ">="]
    target: float
    unit: str
    limit: Limit | None = None
    load_avg: float = math.nan
    load_avg_before: float = math.nan
    cpus: int = 0

    def _meets(self, value: float) -> bool:
        if math.isnan(value):
            return False
        return value <= self.target if self.op == "<=" else value >= self.target

    @property
    def met(self) -> bool:
        """Whether the figure meets its goal (a figure that is not a number never does)."""
        return self._meets(self.value)

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

    def why_missed(self) -> str | None:
        """For a missed goal, whether this machine could have met it, from this run's numbers
        (``None`` for a goal that was met).

        With a limit: whether the limit itself meets the goal ("out of reach on this machine"
        when it does not), and how many times the limit the figure is, the part of the miss
        the limit does not explain; with the load average taken with the figure."""
        if self.met:
            return None
        load = load_text(self.load_avg, self.cpus, self.load_avg_before)
        limit = self.limit
        if limit is None or math.isnan(limit.value):
            return f"no limit for it measured in this run ({load})"
        measured = f"{limit.label}: {_num(limit.value)}{self.unit} in this run"
        # How many times worse than its limit the figure is (>= 1 unless lmprefetch beats it).
        worse, better = (self.value, limit.value) if self.op == "<=" else (limit.value, self.value)
        beyond = f"; the figure is {worse / better:.1f}× that" if better > 0 else ""
        if not self._meets(limit.value):
            return f"out of reach on this machine: {measured}, past the goal{beyond} ({load})"
        return (
            f"within this machine's reach: {measured}{beyond}, which is lmprefetch's own cost "
            f"or the machine's load ({load})"
        )

    def lines(self, width: int = 58) -> list[str]:
        """:meth:`line`, and for a missed goal :meth:`why_missed` under it (wrapped)."""
        why = self.why_missed()
        if why is None:
            return [self.line(width)]
        return [
            self.line(width),
            *textwrap.wrap(why, 100, initial_indent="      ↳ ", subsequent_indent="        "),
        ]

    def as_dict(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "label": self.label,
            "value": self.value,
            "goal": self.goal_text(),
            "met": self.met,
            "limit": None
            if self.limit is None
            else {"label": self.limit.label, "value": self.limit.value},
            "load_avg": self.load_avg,
            "why_missed": self.why_missed(),
        }


def load_text(load_avg: float, cpus: int, before: float = math.nan) -> str:
    """``"load average 3.1 on 2 CPUs, 0.4 before the run"`` (the parts that are known)."""
    text = "load average unknown" if math.isnan(load_avg) else f"load average {load_avg:.1f}"
    if cpus:
        text += f" on {cpus} CPUs"
    if not math.isnan(before):
        text += f", {before:.1f} before the run"
    return text


def _num(x: float) -> str:
    if math.isnan(x):
        return "n/a"
    if abs(x) >= 100:
        return f"{x:.0f}"
    if abs(x) >= 10:
        return f"{x:.1f}"
    return f"{x:.2f}"
