"""bench-serve's Redis link scenarios without vLLM: the slow link (``tc`` commands, the
``netem`` detection and its fallback, the delay proxy, the rate on a real ``lo`` in a private
network namespace), the scenarios' selection and their figures and goals in the JSON.

The scenarios end to end (real vLLM servers) run in ``tests/test_vllm_serve.py``, marked
``slow_link`` (``nox -s slow_link``, not ``ci``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from lmprefetch import cli
from lmprefetch.bench.netns import loopback_only
from lmprefetch.bench.serve import _needs_private_netns, add_arguments, options_from_args
from lmprefetch.bench.serve.link import (
    PROXY_READY,
    LinkSpec,
    Shaper,
    Sink,
    TcResult,
    measure_transfer,
    tc_commands,
)
from lmprefetch.bench.serve.options import (
    CODEC_LINK_SCENARIOS,
    DEFAULT_SCENARIOS,
    LINK_SCENARIOS,
    SCENARIO_NAMES,
    SCENARIOS,
    ServeBenchOptions,
)
from lmprefetch.bench.serve.procs import free_port

ROOT = Path(__file__).resolve().parent.parent
LINK_NAMES = [
    "slow_remote_always",
    "slow_remote_recompute",
    "slow_remote_cost",
    "fast_remote_always",
    "fast_remote_recompute",
    "fast_remote_cost",
]


# -- tc commands and the netem detection -------------------------------------------------------
class FakeTc:
    """Records ``tc`` commands; fails those that name a qdisc kind in ``unknown`` as a kernel
    without it does, and any whose words include ``fail_on``."""

    def __init__(self, unknown: Sequence[str] = (), fail_on: str | None = None) -> None:
        self.unknown = set(unknown)
        self.fail_on = fail_on
        self.calls: list[list[str]] = []

    def __call__(self, args: Sequence[str]) -> TcResult:
        self.calls.append(list(args))
        if args[:1] == ["qdisc"] and args[1] == "add" and self.unknown & set(args):
            return TcResult(2, "Error: Specified qdisc kind is unknown.")
        if self.fail_on is not None and self.fail_on in args:
            return TcResult(2, "RTNETLINK answers: Operation not permitted")
        return TcResult(0, "")


def test_tc_commands_classify_both_directions_of_the_port_and_nothing_else() -> None:
    spec = LinkSpec(rate_bytes_per_s=10e6, delay_s=0.025)
    for netem in (False, True):
        cmds = [" ".join(c) for c in tc_commands(6380, spec, netem=netem)]
        assert cmds[0] == "qdisc add dev lo root handle 1: htb"  # no default class: others pass
        filters = [c for c in cmds if c.startswith("filter")]
        assert len(filters) == 2
        assert any("match ip dport 6380 0xffff flowid 1:10" in f for f in filters)
        assert any("match ip sport 6380 0xffff flowid 1:20" in f for f in filters)
        classes = [c for c in cmds if c.startswith("class")]
        assert all("rate 80000000bit ceil 80000000bit" in c for c in classes) and len(classes) == 2
        leaves = [c for c in cmds if "netem" in c]
        if netem:
            assert len(leaves) == 2 and all("delay 25ms rate 80000000bit" in c for c in leaves)
        else:
            assert leaves == []


def test_without_netem_the_shaper_says_why_and_installs_htb_alone() -> None:
    tc = FakeTc(unknown=["netem"])
    shaper = Shaper(tc)
    available, why = shaper.netem_available()
    assert available is False and "Specified qdisc kind is unknown" in why
    tc.calls.clear()
    shaper.install(7000, LinkSpec(5e6, 0.02), netem=available)
    assert shaper.installed
    assert not any("netem" in c for c in tc.calls)
    assert sum(c[0] == "class" for c in tc.calls) == 2
    shaper.remove()
    assert tc.calls[-1] == ["qdisc", "del", "dev", "lo", "root"] and not shaper.installed


def test_with_netem_the_probe_is_removed_and_netem_carries_the_delay() -> None:
    tc = FakeTc()
    shaper = Shaper(tc)
    assert shaper.netem_available() == (True, "")
    assert tc.calls[-1] == ["qdisc", "del", "dev", "lo", "root"]  # the probe is not left
    shaper.install(7000, LinkSpec(5e6, 0.02), netem=True)
    assert sum("netem" in c and "delay" in c for c in tc.calls) == 1 + 2  # probe + 2 leaves


def test_a_tc_failure_leaves_nothing_installed_and_names_the_command() -> None:
    tc = FakeTc(fail_on="filter")
    shaper = Shaper(tc)
    with pytest.raises(OSError, match=r"tc filter add .*Operation not permitted"):
        shaper.install(7000, LinkSpec(5e6, 0.02), netem=False)
    assert not shaper.installed
    assert tc.calls[-1] == ["qdisc", "del", "dev", "lo", "root"]


# -- the delay proxy -------------------------------------------------------------------------
@pytest.fixture
def proxy_to_sink() -> Any:
    """A :class:`Sink`, and a delay proxy process (100 ms one way) in front of it."""
    delay_s = 0.1
    with Sink() as sink:
        port = free_port()
        argv = [
            sys.executable, "-m", "lmprefetch.bench.serve.link", "proxy",
            "--listen", str(port), "--target", str(sink.port), "--delay-ms", str(delay_s * 1e3),
        ]  # fmt: skip
        with subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, cwd=ROOT) as proc:
            try:
                assert proc.stdout is not None
                assert PROXY_READY in proc.stdout.readline()  # (blocks until it listens)
                yield sink.port, port, delay_s
            finally:
                proc.terminate()
                proc.wait(timeout=30)


def test_the_proxy_delays_each_direction_and_pipelines(proxy_to_sink: Any) -> None:
    sink_port, port, delay_s = proxy_to_sink
    direct = measure_transfer(sink_port, 0, 1)
    # One exchange through the proxy: the request waits delay_s, the answer delay_s again.
    one = measure_transfer(port, 0, 1)
    assert one >= 2 * delay_s > direct
    # Many bytes each way arrive whole, and still only about one delay each way: the proxy
    # forwards while it reads (a delay line), it does not wait delay_s per read.
    many = measure_transfer(port, 4 << 20, 4 << 20)
    assert many >= 2 * delay_s
    reads = (4 << 20) // (1 << 16)  # the proxy reads at most 64 KiB at a time
    assert many < reads * delay_s


# -- the rate, on a real lo in a private network namespace -------------------------------------
_RATE_CHECK = textwrap.dedent(
    """
    import json, sys
    from lmprefetch.bench.serve.link import LinkSpec, Shaper, Sink, measure_transfer
    rate, n = float(sys.argv[1]), int(sys.argv[2])
    shaper = Shaper()
    netem, why = shaper.netem_available()
    out = {"netem": netem, "why": why}
    with Sink() as sink:
        out["unshaped"] = measure_transfer(sink.port, n, n)
        try:
            shaper.install(sink.port, LinkSpec(rate, 0.0), netem=False)
        except OSError as exc:  # no htb here: nothing to measure
            print(json.dumps({"skip": str(exc)}))
            sys.exit(0)
        out["up"] = measure_transfer(sink.port, n, 1)
        out["down"] = measure_transfer(sink.port, 0, n)
        shaper.remove()
        out["removed"] = measure_transfer(sink.port, n, n)
    print(json.dumps(out))
    """
)


def _can_make_a_private_netns() -> bool:
    from lmprefetch.bench.netns import unshare_argv

    argv = unshare_argv(["true"])
    if argv is None or shutil.which("tc") is None:
        return False
    unshare = argv[: argv.index("--")]
    return (
        subprocess.run([*unshare, "--", "true"], capture_output=True, check=False).returncode == 0
    )


@pytest.mark.skipif(
    not _can_make_a_private_netns(), reason="needs tc and a private network namespace"
)
def test_the_shaper_limits_the_ports_rate_each_way_and_is_removed(tmp_path: Path) -> None:
    rate, n = 4e6, 2 << 20  # 2 MiB at 4 MB/s: about 0.5 s each way
    script = tmp_path / "rate_check.py"
    script.write_text(_RATE_CHECK)
    argv = [sys.executable, "-m", "lmprefetch.bench.netns", sys.executable, str(script)]
    done = subprocess.run(
        [*argv, str(rate), str(n)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    if "skip" in out:
        pytest.skip(f"tc cannot shape lo here: {out['skip']}")
    # The detection matches what tc says about netem on this kernel.
    assert out["netem"] is (out["why"] == ""), out
    if not out["netem"]:
        assert out["why"]
    floor = 0.8 * n / rate  # (htb lets one burst through at once)
    assert out["up"] >= floor and out["down"] >= floor, out
    # Unshaped, the same bytes both ways take a fraction of that (loopback: milliseconds).
    assert out["unshaped"] < floor and out["removed"] < floor, out


# -- the scenarios ---------------------------------------------------------------------------
def test_the_link_scenarios_are_the_issues_and_not_in_the_default_run() -> None:
    assert list(LINK_SCENARIOS.values()) == LINK_NAMES
    codec_names = list(CODEC_LINK_SCENARIOS.values())
    assert codec_names == ["slow_remote_lossless", "slow_remote_bitround3"]
    assert [n for n in SCENARIO_NAMES if "_remote_" in n] == LINK_NAMES + codec_names
    assert not set(LINK_NAMES + codec_names) & set(DEFAULT_SCENARIOS)
    by_name = {s.name: s for s in SCENARIOS}
    assert [by_name[n].load_policy for n in LINK_NAMES] == ["always", "never", "cost"] * 2
    assert [by_name[n].link for n in LINK_NAMES] == ["slow"] * 3 + ["fast"] * 3
    assert all(by_name[n].tier == "redis" and by_name[n].servers == 1 for n in LINK_NAMES)
    assert all(by_name[n].codec is None for n in LINK_NAMES)
    # The codec scenarios: slow_remote_always with redis_codec set, and a goal beside it.
    for codec, name in CODEC_LINK_SCENARIOS.items():
        sc = by_name[name]
        assert (sc.link, sc.load_policy, sc.codec, sc.tier) == ("slow", "always", codec, "redis")
    assert _needs_private_netns(
        ServeBenchOptions.quick_preset(scenarios=("slow_remote_lossless",))
    ) == (not loopback_only())


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


@pytest.mark.parametrize(
    "argv",
    [
        ["--quick"],
        ["--scenarios", "slow_remote_cost,recompute", "--json", "out.json", "--no-progress"],
        ["--slow-link-rate", "2.5", "--slow-link-delay-ms", "35", "--rounds", "3", "--seed", "7"],
    ],
)
def test_the_command_line_is_rebuilt_from_the_options_not_sys_argv(argv: list[str]) -> None:
    """What bench-serve runs again in its own network namespace: the same options."""
    from lmprefetch.bench.serve import command_line

    args = cli.build_parser().parse_args(["bench-serve", *argv])
    again = cli.build_parser().parse_args(command_line(args))
    assert {k: v for k, v in vars(again).items() if k != "func"} == {
        k: v for k, v in vars(args).items() if k != "func"
    }


def test_scenarios_and_the_slow_link_from_the_command_line() -> None:
    opts = options_from_args(_args("--quick"))
    assert opts.scenarios == DEFAULT_SCENARIOS
    assert not _needs_private_netns(opts)
    link_args = ["--slow-link-rate", "5", "--slow-link-delay-ms", "30"]
    opts = options_from_args(
        _args("--quick", "--scenarios", "slow_remote_cost, fast_remote_always", *link_args)
    )
    assert opts.scenarios == ("slow_remote_cost", "fast_remote_always")
    assert opts.slow_link_rate == 5e6 and math.isclose(opts.slow_link_delay_s, 0.03)
    assert opts.settings()["slow_link"] == {"rate_bytes_per_s": 5e6, "delay_ms": 30.0}
    fast_only = options_from_args(_args("--quick", "--scenarios", "fast_remote_cost"))
    from lmprefetch.bench.netns import loopback_only

    # Only a slow link needs a namespace of the benchmark's own (and only where it is not).
    assert _needs_private_netns(opts) is not loopback_only()
    assert not _needs_private_netns(fast_only)


def test_the_measured_servers_cpu_tier_cannot_keep_a_document_until_it_returns() -> None:
    from lmprefetch.bench.serve.link_scenario import link_cpu_bytes
    from lmprefetch.bench.serve.model import kv_bytes_per_token

    for opts in (ServeBenchOptions.full(), ServeBenchOptions.quick_preset()):
        chunk = opts.chunk_size * kv_bytes_per_token(opts.model)
        doc = (opts.long_doc.doc_tokens // opts.chunk_size) * chunk
        cpu = link_cpu_bytes(opts)
        # A lookup may hold half the arena: one document's load fits, three documents do not.
        assert 2 * doc < cpu < 3 * doc
        assert opts.long_doc.docs >= 4  # so a document is gone when it comes back


# -- figures, goals and the JSON ---------------------------------------------------------------
def _link_result(p50_ms: dict[str, float]) -> dict[str, Any]:
    from lmprefetch.bench.serve.rounds import WorkloadStats

    opts = ServeBenchOptions.quick_preset(scenarios=tuple(p50_ms))
    raw: dict[str, Any] = {}
    for name, ms in p50_ms.items():
        policy = {"always": "always", "recompute": "never", "cost": "cost"}[name.split("_")[-1]]
        loads = policy != "never"
        stats = WorkloadStats(
            ttft_s=[ms / 1e3 * f for f in (0.9, 1.0, 1.1)],
            requests=3,
            completion_tokens=24,
            prompt_tokens=6240,
            cached_tokens=6144 if loads else 0,
            elapsed_s=3.0,
            metrics={
                "external_kv_transfer": 6144.0 if loads else 0.0,
                "lmprefetch_policy_loaded": 3.0 if loads else 0.0,
                "lmprefetch_policy_skipped": 0.0 if loads else 3.0,
            },
        )
        slow = name.startswith("slow")
        raw[name] = {
            "long_doc_qa": stats,
            "chat": None,
            "startup_s": [20.0, 21.0],
            "link": {
                "kind": "slow" if slow else "fast",
                "mechanism": "htb+proxy" if slow else "none",
            },
            "load_policy": policy,
            "load_policy_set": True,
            "lmprefetch_cpu_bytes": 12 << 20,
            "redis_sent_bytes": (6144 * 4096 + 1000) if loads else 500,
        }
    return {
        "raw": raw,
        "settings": opts.settings(),
        "machine": {"cpu": "x", "cores": 2, "memory_gib": 1, "python": "3", "versions": {}},
        "load_average": {"before": [1.0, 1.0, 1.0], "after": [1.0, 1.0, 1.0]},
        "elapsed_s": 1.0,
    }


def test_link_figures_and_goals_from_the_same_run() -> None:
    from lmprefetch.bench.serve import _finite
    from lmprefetch.bench.serve.report import format_report, summarize

    p50 = dict(zip(LINK_NAMES, [1000.0, 500.0, 540.0, 150.0, 500.0, 200.0]))
    result = _link_result(p50)
    measured = {"ping_ms": 41.0, "chunk_get_ms": 150.0, "chunk_bytes": 1 << 20}
    result["raw"]["slow_remote_always"]["link"]["measured"] = measured
    summary = summarize(result)
    doc = json.loads(json.dumps(_finite(summary)))
    for name in LINK_NAMES:
        entry = doc["scenarios"][name]
        assert math.isclose(entry["ttft_p50_ms"], p50[name])
        assert "chat" not in entry  # long-document QA only
        assert entry["link"]["mechanism"] and entry["load_policy"]
    always = doc["scenarios"]["slow_remote_always"]
    assert math.isclose(always["redis_sent_vs_hit_bytes"], 1 + 1000 / (6144 * 4096))
    assert doc["scenarios"]["slow_remote_recompute"]["redis_sent_vs_hit_bytes"] is None
    goals = {g["key"]: g for g in doc["goals"]}
    slow, fast = goals["slow_remote_cost_vs_best"], goals["fast_remote_cost_vs_always"]
    assert math.isclose(slow["figure"], 540 / 500) and slow["met"] is True  # vs recompute
    assert slow["limit"] == 1.1
    assert slow["p50_ms"] == {n: p50[n] for n in LINK_NAMES[:3]}
    assert math.isclose(fast["figure"], 200 / 150) and fast["met"] is False  # vs always
    assert fast["p50_ms"] == {"fast_remote_cost": 200.0, "fast_remote_always": 150.0}
    text = format_report(summary)
    assert "slow_remote_cost 540 ms" in text and "fast_remote_always 150 ms" in text
    assert text.count("[MISSED]") == 1 and "Redis link scenarios" in text
    assert "(PING 41 ms, GET of a 1024 KiB chunk 150 ms)" in text
    assert "Multi-round chat" not in text  # no scenario of this run has one
    assert doc["scenarios"]["slow_remote_recompute"]["metrics"]["lmprefetch_policy_skipped"] == 3
    assert "3/0/0" in text and "0/0/3" in text  # the policy's decisions: load/cut/skip


def test_a_link_goal_without_all_its_peers_is_not_measured() -> None:
    from lmprefetch.bench.serve.report import summarize

    result = _link_result({"slow_remote_cost": 500.0, "slow_remote_always": 400.0})
    result["raw"]["slow_remote_recompute"] = {"error": "no load_policy", "unavailable": True}
    goals = {g["key"]: g for g in summarize(result)["goals"]}
    assert goals["slow_remote_cost_vs_best"]["met"] is None
    assert "fast_remote_cost_vs_always" not in goals  # none of its scenarios ran


def test_without_link_scenarios_no_link_goal_lines() -> None:
    from lmprefetch.bench.serve.report import summarize

    result = _link_result({})
    keys = {g["key"] for g in summarize(result)["goals"]}
    assert keys == {"long_doc_p50_vs_apc", "cpu_hit_vs_apc_hit", "disk_hit_vs_apc_hit"}


async def test_scraped_metrics_carry_lmprefetchs_connector_counters() -> None:
    """The policy's decisions reach the figures: ``vllm:lmprefetch_<key>_total`` counters on
    vLLM's /metrics become ``lmprefetch_<key>`` (summed over engines)."""
    httpx = pytest.importorskip("httpx")
    from lmprefetch.bench.serve.client import scrape_metrics

    text = textwrap.dedent(
        """\
        # TYPE vllm:lmprefetch_policy_skipped counter
        vllm:lmprefetch_policy_skipped_total{engine="0",model_name="bench"} 4.0
        vllm:lmprefetch_policy_skipped_total{engine="1",model_name="bench"} 1.0
        vllm:lmprefetch_policy_skipped_created{engine="0",model_name="bench"} 1.7e9
        # TYPE vllm:prompt_tokens counter
        vllm:prompt_tokens_total{engine="0",model_name="bench"} 2080.0
        """
    )
    transport = httpx.MockTransport(lambda request: httpx.Response(200, text=text))
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
        out = await scrape_metrics(client)
    assert out["lmprefetch_policy_skipped"] == 5.0 and out["prompt_tokens"] == 2080.0
    assert not any(k.endswith("_created") for k in out)


def test_the_codec_link_scenario_has_its_goal_beside_the_plain_one() -> None:
    """``slow_remote_lossless`` is ``slow_remote_always`` with ``redis_codec`` set: its goal
    is its TTFT p50 over the plain one's, from the same run, and the report shows the codec
    and the bytes Redis sent (fewer than the hit's KV)."""
    from lmprefetch.bench.serve import _finite
    from lmprefetch.bench.serve.report import format_report, summarize

    result = _link_result({"slow_remote_always": 1000.0})
    plain = result["raw"]["slow_remote_always"]
    lossless = dict(plain, redis_codec="lossless", redis_sent_bytes=int(6144 * 4096 * 0.69))
    stats = plain["long_doc_qa"]
    lossless["long_doc_qa"] = type(stats)(**{**vars(stats), "ttft_s": [0.63, 0.7, 0.77]})
    result["raw"]["slow_remote_lossless"] = lossless
    result["settings"]["scenarios"] = ["slow_remote_always", "slow_remote_lossless"]
    summary = summarize(result)
    doc = json.loads(json.dumps(_finite(summary)))
    entry = doc["scenarios"]["slow_remote_lossless"]
    assert entry["redis_codec"] == "lossless"
    assert doc["scenarios"]["slow_remote_always"]["redis_codec"] == "none"
    assert math.isclose(entry["redis_sent_vs_hit_bytes"], 0.69, rel_tol=1e-6)
    goal = {g["key"]: g for g in doc["goals"]}["slow_remote_lossless_vs_always"]
    assert math.isclose(goal["figure"], 0.7) and goal["met"] is True and goal["limit"] == 0.75
    assert goal["p50_ms"] == {"slow_remote_lossless": 700.0, "slow_remote_always": 1000.0}
    text = format_report(summary)
    assert "(redis_codec none): 0.70 (goal <= 0.75) [met]" in text
    assert "slow_remote_lossless 700 ms" in text


# -- the decision tables (issue 31) -------------------------------------------------------------
def _lookup(wall: float, decision: str, kept: int, **kw: Any) -> dict[str, Any]:
    record = {
        "kind": "lookup", "rank": 0, "lookup_id": "x", "wall": wall, "policy": "CostPolicy",
        "prompt_tokens": 2080, "computed_tokens": 0, "hit_chunks": 8, "hit_tokens": 2048,
        "kept_chunks": kept, "kept_tokens": kept * 256, "decision": decision,
        "parts": [{"tier": "redis", "chunks": 8, "bytes": 8 << 20, "zero_copy": False,
                   "latency_s": 0.05, "bytes_per_s": 10e6, "age_s": 3.0}],
        "probes": [{"tier": "cpu", "seconds": 0.0, "chunks": 0},
                   {"tier": "redis", "seconds": 0.042, "chunks": 8}],
        "prefill_a": 0.00023, "prefill_b": 0.0, "prefill_source": "measured",
        "predicted_load_s": 0.89 if kept else 0.0, "predicted_recompute_s": 0.0 if kept else 0.47,
        "predicted_load_all_s": 0.89, "predicted_recompute_all_s": 0.47,
        "decided_s": 0.042, "load_s": 0.95 if kept else None,
        "answered_s": 0.99 if kept else 0.043, "answer_tokens": kept * 256,
        "not_probed": [], "calibrating": [],
    }  # fmt: skip
    record.update(kw)
    return record


def _step(wall: float, tokens: int, seconds: float, predicted: float | None) -> dict[str, Any]:
    return {"kind": "step", "rank": 0, "wall": wall, "tokens": tokens, "attention": 0,
            "seconds": seconds, "load_s": 0.0, "predicted_s": predicted}  # fmt: skip


def test_each_question_is_joined_with_its_decision_and_what_it_cost() -> None:
    """A loaded question, a skipped one, one the policy did not probe for, and one without a
    lookup (``never``): each shows its decision, the predicted and the measured load or
    steps, where its time went, and the counts."""
    from lmprefetch.bench.serve.decisions import decision_counts, decision_rows

    trace = [
        _step(5.0, 2048, 0.5, None),  # a warm-up step, before the first question
        _lookup(10.01, "loaded", 8),
        _step(11.01, 32, 0.012, 0.010),  # 11.01 - (10.01 + 0.99) = 10 ms after the answer
        _lookup(20.002, "skipped", 0, calibrating=["redis"]),
        _step(20.05, 2048, 0.48, 0.47),
        _step(20.53, 32, 0.011, 0.010),
        _lookup(
            30.001,
            "miss",
            0,
            hit_chunks=0,
            parts=[],
            probes=[],
            not_probed=["redis"],
            load_s=None,
            answered_s=0.0001,
            predicted_load_s=None,
            predicted_recompute_s=None,
            predicted_load_all_s=None,
            predicted_recompute_all_s=None,
        ),
        _step(30.002, 2080, 0.49, 0.48),
        {"kind": "gc", "rank": 0, "wall": 30.3, "generation": 2, "seconds": 0.02},
        _step(40.003, 2080, 0.5, 0.48),
        _step(40.51, 1, 0.02, 0.01),  # a decode step that ended after the first token
    ]
    sent = [10.0, 20.0, 30.0, 40.0]
    ttft = [1.1, 0.6, 0.55, 0.52]
    rows = decision_rows(trace, sent, ttft)
    loaded, skipped, unprobed, none = rows
    assert loaded["decision"] == "loaded" and loaded["kept_chunks"] == 8
    assert loaded["predicted_load_ms"] == pytest.approx(890)
    assert loaded["measured_load_ms"] == pytest.approx(950)
    assert loaded["probe_ms"] == pytest.approx(42)
    assert loaded["wait_ms"] == pytest.approx(10, abs=0.01)
    assert loaded["tiers"] == [{"tier": "redis", "chunks": 8, "latency_ms": 50.0, "mb_per_s": 10.0}]
    assert skipped["decision"] == "skipped" and skipped["calibrating"] == ["redis"]
    assert skipped["predicted_recompute_all_ms"] == pytest.approx(470)
    assert skipped["measured_steps_ms"] == pytest.approx(491)
    assert skipped["predicted_steps_ms"] == pytest.approx(480)
    assert skipped["steps"] == 2 and skipped["step_tokens"] == 2080
    assert math.isnan(skipped["measured_load_ms"])
    assert unprobed["decision"] == "not probed" and unprobed["gc_ms"] == pytest.approx(20)
    assert none["decision"] == "no lookup" and none["wait_ms"] == pytest.approx(3, abs=0.01)
    assert none["steps"] == 1 and none["after_steps_ms"] == pytest.approx(17, abs=0.01)
    counts = decision_counts(rows)
    assert [counts[k] for k in ("loaded", "truncated", "skipped", "not probed", "no lookup")] == [
        1, 0, 1, 1, 1,
    ]  # fmt: skip


def test_the_decision_tables_are_in_the_report_and_the_json() -> None:
    from lmprefetch.bench.serve import _finite
    from lmprefetch.bench.serve.report import format_report, summarize

    result = _link_result({"slow_remote_cost": 500.0, "slow_remote_always": 900.0})
    raw = result["raw"]["slow_remote_cost"]
    stats = raw["long_doc_qa"]
    stats.sent_at = [10.0, 20.0, 30.0]
    raw["trace"] = [
        _lookup(10.01, "loaded", 8),
        _lookup(20.01, "skipped", 0),
        _lookup(30.01, "truncated", 4),
    ]
    result["raw"]["slow_remote_always"]["trace"] = None  # an lmprefetch without the trace
    summary = summarize(result)
    doc = json.loads(json.dumps(_finite(summary)))
    cost = doc["scenarios"]["slow_remote_cost"]
    assert [r["decision"] for r in cost["decisions"]] == ["loaded", "skipped", "truncated"]
    assert cost["decision_counts"]["truncated"] == 1
    assert cost["decision_summary"]["loaded"]["measured_load_ms"] == pytest.approx(950)
    assert "decisions" not in doc["scenarios"]["slow_remote_always"]
    text = format_report(summary)
    assert "slow_remote_cost (cost): 1 loaded whole / 1 truncated / 1 skipped / 0 not probed" in (
        text
    )
    assert "890/950" in text  # the load, predicted/measured


def test_in_order_runs_the_scenarios_in_the_order_named() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    names = ",".join(reversed(LINK_NAMES))
    opts = options_from_args(parser.parse_args(["--quick", "--scenarios", names, "--in-order"]))
    assert [s.name for s in opts.scenarios_to_run()] == LINK_NAMES[::-1]
    assert opts.settings()["scenario_order"] == LINK_NAMES[::-1]
    opts = options_from_args(parser.parse_args(["--quick", "--scenarios", names]))
    assert [s.name for s in opts.scenarios_to_run()] == LINK_NAMES  # the table's order


def test_side_by_side_groups_the_link_scenarios_of_one_link_and_codec() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    names = ",".join(["fast_remote_cost", "apc", *reversed(LINK_NAMES), "slow_remote_lossless"])
    args = ["--quick", "--scenarios", names, "--in-order"]
    opts = options_from_args(parser.parse_args([*args, "--side-by-side"]))
    groups = [[s.name for s in g] for g in opts.scenario_groups()]
    assert groups == [
        ["fast_remote_cost", "fast_remote_recompute", "fast_remote_always"],
        ["apc"],
        ["slow_remote_cost", "slow_remote_recompute", "slow_remote_always"],
        ["slow_remote_lossless"],  # another codec: its own Redis
    ]
    assert opts.settings()["side_by_side"] == [groups[0], groups[2]]
    alone = options_from_args(parser.parse_args(args))
    assert [len(g) for g in alone.scenario_groups()] == [1] * 8
    assert alone.settings()["side_by_side"] == []


@pytest.mark.parametrize(
    ("policies", "configured"),
    [
        (["always", "never", "cost"], "cost"),  # cost keeps its state across its requests
        (["never", "always"], "always"),  # a server configured never looks nothing up
        (["never"], "never"),
    ],
)
def test_side_by_side_one_server_is_configured_with_a_policy_that_looks_up(
    policies: list[str], configured: str
) -> None:
    from lmprefetch.bench.serve.link_scenario import shared_server_policy
    from lmprefetch.bench.serve.servers import ScenarioUnavailable

    assert shared_server_policy(policies) == configured
    with pytest.raises(ScenarioUnavailable, match="only the built-in ones"):
        shared_server_policy(["always", "pkg.mod:Mine"])


def test_every_server_runs_its_model_with_a_core_left_for_the_rest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lmprefetch.bench.serve.servers import base_env, model_threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: {0, 1})
    assert model_threads() == 1
    assert base_env(tmp_path)["OMP_NUM_THREADS"] == "1"
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: set(range(8)))
    assert base_env(tmp_path)["OMP_NUM_THREADS"] == "7"
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: {3})
    assert base_env(tmp_path)["OMP_NUM_THREADS"] == "1"
    monkeypatch.setenv("OMP_NUM_THREADS", "4")  # the operator's choice stands
    assert base_env(tmp_path)["OMP_NUM_THREADS"] == "4"


def _link_runs() -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location("link_runs", ROOT / "tools" / "link_runs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_link_runs_alternates_the_order_and_tabulates_each_run() -> None:
    from lmprefetch.bench.serve import _finite
    from lmprefetch.bench.serve.report import summarize

    tool = _link_runs()
    assert tool.scenario_order(1) == LINK_NAMES
    assert tool.scenario_order(2) == LINK_NAMES[::-1]
    assert tool.scenario_order(3) == LINK_NAMES
    argv = tool.bench_serve_argv(2, Path("r.json"), "py", ["--model", "random"])
    assert argv[argv.index("--scenarios") + 1] == ",".join(LINK_NAMES[::-1])
    assert "--side-by-side" in argv and argv[-2:] == ["--model", "random"]
    alone = tool.bench_serve_argv(1, Path("r.json"), "py", [], side_by_side=False)
    assert "--side-by-side" not in alone
    p50 = dict(zip(LINK_NAMES, [1000.0, 500.0, 540.0, 40.0, 500.0, 48.0]))
    result = _link_result(p50)
    raw = result["raw"]["slow_remote_cost"]
    raw["long_doc_qa"].sent_at = [10.0, 20.0, 30.0]
    raw["trace"] = [_lookup(10.01, "loaded", 8), _lookup(20.01, "skipped", 0)]
    summary = json.loads(json.dumps(_finite(summarize(result))))
    rows = tool.rows(2, summary, "0.10 0.20 0.30", "1.50 1.00 0.50")
    slow, fast = rows
    assert (slow["link"], slow["always"], slow["recompute"], slow["cost"]) == (
        "slow", 1000.0, 500.0, 540.0,
    )  # fmt: skip
    assert slow["ratio"] == pytest.approx(1.08) and slow["met"] is True
    assert slow["decisions"] == "1 / 0 / 1 / 0"  # of the three questions, one had no lookup
    assert fast["ratio"] == pytest.approx(1.2) and fast["met"] is False
    assert fast["decisions"] == "-"  # no trace
    table = tool.table(rows)
    assert "| 2 | slow | 0.10 0.20 0.30 → 1.50 1.00 0.50 | 1 000 ms | 500 ms | 540 ms | 1.08 |" in (
        table
    )
    assert "| 1.20 (**missed**) |" in table
    assert "missed or not measured in 1 of 2" in table
