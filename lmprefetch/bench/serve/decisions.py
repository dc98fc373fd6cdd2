"""bench-serve's decision tables: each measured question of a link scenario beside what the
measured server decided for it and what that cost, predicted and measured.

The measured server writes a trace (``decision_log``, :mod:`lmprefetch.trace`): one record per
lookup (the decision, the cost model's predictions, the probe and load times), one per model
step (its tokens, its measured time and the time the prefill model expected), one per slow
garbage collection.  A question is joined with the records whose wall clock falls between its
sending and its first token (one request is in flight at a time).  So a miss explains itself:
a question that loaded where recomputing was cheaper shows which prediction was wrong (the
load's, or the recompute's), and a slow question shows where its time went (the probe, the
load, the wait for vLLM's next step, the steps, a garbage collection).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

__all__ = ["decision_counts", "decision_rows", "format_decisions", "summarize_decisions"]

#: The decisions, in the order the tables count them ("not probed": the policy ruled the
#: tier out before probing it, and the prompt was recomputed).
DECISIONS = ("loaded", "truncated", "skipped", "not probed")


def _ms(seconds: float | None) -> float:
    return math.nan if seconds is None else seconds * 1e3


def decision_rows(
    trace: Sequence[dict[str, Any]], sent_at: Sequence[float], ttft_s: Sequence[float]
) -> list[dict[str, Any]]:
    """One row per measured question (in the order sent): its TTFT, the lookup that served it
    (the last one in its window) and the steps that computed it, with the figures the tables
    show (milliseconds; NaN where not known)."""
    rows: list[dict[str, Any]] = []
    for i, (sent, ttft) in enumerate(zip(sent_at, ttft_s)):
        end = sent + ttft
        window = [r for r in trace if sent <= float(r["wall"]) <= end]
        lookups = [r for r in window if r["kind"] == "lookup"]
        # The steps that ended before the first token (a decode step may start before the
        # client sees the first token, and end after it).
        steps = [
            r
            for r in window
            if r["kind"] == "step"
            and float(r["wall"]) + float(r["load_s"]) + float(r["seconds"]) <= end
        ]
        gcs = [r for r in window if r["kind"] == "gc"]
        lookup = lookups[-1] if lookups else None
        decision = "no lookup"
        if lookup is not None:
            decision = lookup["decision"]
            if decision == "miss" and lookup.get("not_probed"):
                decision = "not probed"  # the policy recomputed without asking the tier
        row: dict[str, Any] = {
            "question": i + 1,
            "ttft_ms": ttft * 1e3,
            "decision": decision,
            "hit_chunks": lookup["hit_chunks"] if lookup else 0,
            "kept_chunks": lookup["kept_chunks"] if lookup else 0,
            "lookups": len(lookups),
            "steps": len(steps),
            "step_tokens": sum(int(s["tokens"]) for s in steps),
            "measured_steps_ms": sum(float(s["seconds"]) for s in steps) * 1e3,
            "steps_cpu_ms": (
                sum(float(s["cpu_s"]) for s in steps) * 1e3
                if steps and all(s.get("cpu_s") is not None for s in steps)
                else math.nan
            ),
            "predicted_steps_ms": (
                sum(float(s["predicted_s"]) for s in steps) * 1e3
                if steps and all(s["predicted_s"] is not None for s in steps)
                else math.nan
            ),
            "gc_ms": sum(float(g["seconds"]) for g in gcs) * 1e3,
        }
        first_step = min((float(s["wall"]) for s in steps), default=math.nan)
        steps_end = max(
            (float(s["wall"]) + float(s["load_s"]) + float(s["seconds"]) for s in steps),
            default=math.nan,
        )
        # After the last step: sampling, the output's way to the client.
        row["after_steps_ms"] = (end - steps_end) * 1e3
        if lookup is not None:
            answered = float(lookup["wall"]) + float(lookup["answered_s"])
            row.update(
                policy=lookup.get("policy"),  # the class that decided (a request may name one)
                lookup_ms=float(lookup["answered_s"]) * 1e3,
                probe_ms=sum(float(p["seconds"]) for p in lookup["probes"]) * 1e3,
                predicted_load_ms=_ms(lookup["predicted_load_s"]),
                predicted_recompute_ms=_ms(lookup["predicted_recompute_s"]),
                predicted_load_all_ms=_ms(lookup["predicted_load_all_s"]),
                predicted_recompute_all_ms=_ms(lookup["predicted_recompute_all_s"]),
                measured_load_ms=_ms(lookup["load_s"]),
                arrival_ms=(float(lookup["wall"]) - sent) * 1e3,
                wait_ms=(first_step - answered) * 1e3,
                tiers=[
                    {
                        "tier": p["tier"],
                        "chunks": p["chunks"],
                        "latency_ms": _ms(p["latency_s"]),
                        "mb_per_s": (
                            math.nan if p["bytes_per_s"] is None else p["bytes_per_s"] / 1e6
                        ),
                    }
                    for p in lookup["parts"]
                ],
                not_probed=list(lookup.get("not_probed") or ()),
                calibrating=list(lookup.get("calibrating") or ()),
                prefill=[lookup["prefill_a"], lookup["prefill_b"], lookup["prefill_source"]],
            )
        else:
            row.update(
                lookup_ms=math.nan,
                probe_ms=math.nan,
                predicted_load_ms=math.nan,
                predicted_recompute_ms=math.nan,
                predicted_load_all_ms=math.nan,
                predicted_recompute_all_ms=math.nan,
                measured_load_ms=math.nan,
                arrival_ms=math.nan,
                wait_ms=(first_step - sent) * 1e3,
            )
        rows.append(row)
    return rows


def decision_counts(rows: Sequence[dict[str, Any]]) -> dict[str, int]:
    """How many questions were loaded whole, truncated, skipped (and had no lookup)."""
    counts = dict.fromkeys((*DECISIONS, "miss", "no lookup"), 0)
    for row in rows:
        counts[row["decision"]] = counts.get(row["decision"], 0) + 1
    return counts


def _median(values: Sequence[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return statistics.median(finite) if finite else math.nan


def summarize_decisions(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per decision: the questions, and the medians of TTFT and of the predicted and measured
    costs (the load for loaded questions, the prefill steps for the others)."""
    out: dict[str, Any] = {}
    for decision in (*DECISIONS, "no lookup"):
        mine = [r for r in rows if r["decision"] == decision]
        if not mine:
            continue
        out[decision] = {
            "questions": len(mine),
            "ttft_ms": _median([r["ttft_ms"] for r in mine]),
            "predicted_load_ms": _median([r["predicted_load_ms"] for r in mine]),
            "measured_load_ms": _median([r["measured_load_ms"] for r in mine]),
            "predicted_recompute_all_ms": _median([r["predicted_recompute_all_ms"] for r in mine]),
            "predicted_steps_ms": _median([r["predicted_steps_ms"] for r in mine]),
            "measured_steps_ms": _median([r["measured_steps_ms"] for r in mine]),
        }
    return out


def _f(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:,.0f}"


def format_decisions(name: str, policy: str, rows: Sequence[dict[str, Any]]) -> list[str]:
    """A scenario's decision table (text): one line per question."""
    counts = decision_counts(rows)
    lines = [
        f"  {name} ({policy}): {counts['loaded']} loaded whole / {counts['truncated']} truncated"
        f" / {counts['skipped']} skipped / {counts['not probed']} not probed"
        + (f" / {counts['no lookup']} without a lookup" if counts["no lookup"] else "")
        + "; ms, predicted/measured:",
        f"    {'#':>3}{'TTFT':>7}  {'decision':<10}{'kept':>6}{'load p/m':>13}"
        f"{'recomp. hit p':>15}{'steps p/m':>13}{'cpu':>6}{'probe':>7}{'lookup':>8}{'wait':>7}"
        f"{'after':>7}{'gc':>5}  tiers (latency ms, MB/s)",
    ]
    for r in rows:
        tiers = ", ".join(
            f"{t['tier']} {t['chunks']} ({_f(t['latency_ms'])}, {_f(t['mb_per_s'])})"
            for t in r.get("tiers", ())
        )
        if r.get("not_probed"):
            tiers += (", " if tiers else "") + "not probed: " + ",".join(r["not_probed"])
        if r.get("calibrating"):
            tiers += " [measuring " + ",".join(r["calibrating"]) + "]"
        kept = f"{r['kept_chunks']}/{r['hit_chunks']}" if r["decision"] != "no lookup" else "-"
        lines.append(
            f"    {r['question']:>3}{_f(r['ttft_ms']):>7}  {r['decision']:<10}{kept:>6}"
            f"{_f(r['predicted_load_ms']) + '/' + _f(r['measured_load_ms']):>13}"
            f"{_f(r['predicted_recompute_all_ms']):>15}"
            f"{_f(r['predicted_steps_ms']) + '/' + _f(r['measured_steps_ms']):>13}"
            f"{_f(r['steps_cpu_ms']):>6}"
            f"{_f(r['probe_ms']):>7}{_f(r['lookup_ms']):>8}{_f(r['wait_ms']):>7}"
            f"{_f(r['after_steps_ms']):>7}{_f(r['gc_ms']):>5}  {tiers}"
        )
    return lines
