"""The chaos harness's smoke run, so the harness itself cannot rot.

``python -m tests.chaos --smoke`` runs the whole harness of ``nox -s chaos`` (see
``tests/chaos.py``) with a fixed list of faults instead of a timed random schedule: every kind
targeted (a kill mid-load and mid-write, a corruption of each kind the reader checks: payload,
header, key) and blind once each, and a full disk once, spaced by the traffic's progress, not
by time.
It runs in a subprocess, so the harness's checks for left file descriptors and threads see
only what it made, and its private tmpfs (``unshare``) dies with it.

Nothing here is a timing threshold: every outcome checked is decided by the order of events
(a stopped worker cannot answer; a damaged file is read after the damage; a full file system
refuses a write), and the harness asks a scenario lookup again when its answer came late
(a late answer may have been cut short by its deadline).  The deadlines bound hangs only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs Linux /proc"),
]

KINDS = ("kill", "pause", "delete", "truncate", "corrupt")


def test_chaos_smoke(tmp_path: Path) -> None:
    out = tmp_path / "chaos.json"
    done = subprocess.run(
        [sys.executable, "-m", "tests.chaos", "--smoke", "--seed", "1", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,  # a hang; a run takes seconds
    )
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-6000:]
    fig = json.loads(out.read_text())
    assert fig["violations"] == [] and fig["violation_count"] == 0 and not fig["aborted"]
    assert fig["wrong_bytes"] == 0
    targeted = {"kill": 2, "pause": 1, "delete": 1, "truncate": 1, "corrupt": 3}
    for kind in KINDS:
        assert fig["faults"][f"{kind}-targeted"] == targeted[kind], kind
        assert fig["faults"][f"{kind}-blind"] == 1, kind
    counters, traffic, client = fig["counters"], fig["traffic"], fig["client"]
    for variant in ("payload", "header", "other-key"):  # at least the targeted one each
        assert counters[f"damage_{variant}"] >= 1, variant
    assert counters["killed_mid_load"] == 1
    assert counters["killed_mid_write"] == 1
    assert counters["stale_temp_files_removed_on_restart"] >= 1  # the half-written file
    assert counters["doomed_lookups_zero"] == 1  # the lookup sent to the stopped worker
    assert counters["files_damaged_blind"] >= 3  # each blind fault hit 1-3 files
    # Every restart found exactly the files the killed process left.
    restarts = 4 if fig["disk"]["full_disk_unavailable"] is None else 3
    assert counters["restarts"] == counters["restarts_found_disk"] == restarts
    # The eight threads did real work through one client, all of it checked.
    assert traffic["lookups"] > 0 and traffic["claims"] > 0
    assert traffic["chunks_verified"] > 0 and traffic["wrong_chunks"] == 0
    assert client["duplicate_answers"] == 0 and client["pending"] == 0
    assert client["submitted"] == traffic["lookups"] + counters["scenario_lookups"]
    # Rank 0 is never killed: its process served every request of the run and answered each.
    rank0 = fig["workers"]["0"]
    assert rank0["restarts"] == 0
    assert rank0["requests_accepted"] == rank0["answers_sent"] == client["submitted"]
    assert fig["leaks"] == {
        "fds": {}, "threads": [], "zmq_threads": {}, "bridge_thread_alive": False,
    }  # fmt: skip
    why = fig["disk"]["full_disk_unavailable"]
    if why is not None:
        pytest.skip(f"everything but the full disk passed; no tmpfs for it here: {why}")
    assert fig["faults"]["full_disk-targeted"] == 1
    # Below its capacity every rank's tier refused each write of the prompt with ENOSPC.
    assert "full_disk_rank_at_capacity" not in counters
    assert counters["writes_refused_by_full_disk"] == 2 * 6  # ranks x chunks of the prompt
    assert counters["restarts_on_full_disk"] == 1  # with no free block and no free inode
    assert counters["ballast_bytes"] > 0 and counters["ballast_files"] > 0


@pytest.mark.mooncake
def test_chaos_smoke_with_mooncake(tmp_path: Path) -> None:
    """The smoke run with the Mooncake tier on every rank (a master and a store process the
    harness starts, in its own network namespace): everything above still holds, the traffic
    loads Mooncake-only prompts from Mooncake (every byte checked), and the master is killed
    once while a lookup's Mooncake load is held (that lookup answers 0, the prompt is served
    again after the restart) and once blind."""
    from .mooncake_servers import missing

    problem = missing()
    if problem is not None:
        pytest.skip(problem)
    out = tmp_path / "chaos.json"
    done = subprocess.run(
        [sys.executable, "-m", "tests.chaos", "--smoke", "--mooncake", "--seed", "2",
         "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,  # a hang; a run takes about a minute
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-6000:]
    fig = json.loads(out.read_text())
    assert fig["violations"] == [] and fig["violation_count"] == 0 and not fig["aborted"]
    assert fig["wrong_bytes"] == 0
    assert fig["faults"]["master-targeted"] == 1 and fig["faults"]["master-blind"] == 1
    counters = fig["counters"]
    assert counters["master_killed_mid_load"] == 1
    assert counters["master_restarts"] == 2
    rank0 = fig["workers"]["0"]
    assert rank0["mooncake"]["chunks_loaded"] > 0  # the traffic hit Mooncake-only prompts
    assert rank0["requests_accepted"] == rank0["answers_sent"] == fig["client"]["submitted"]
    assert fig["traffic"]["wrong_chunks"] == 0
    assert fig["leaks"] == {
        "fds": {}, "threads": [], "zmq_threads": {}, "bridge_thread_alive": False,
    }  # fmt: skip
