"""Every way of stopping a command: SIGINT or SIGTERM, to the process or to its whole group
(Ctrl-C in a terminal, ``timeout``), at moments from the imports to mid-benchmark, for every
subcommand, the console script and ``python -m lmprefetch`` (``tests/stopping.py`` runs them).

Each case checks all three things a user sees: the command exits promptly, it says one line
(``lmprefetch: interrupted`` / ``terminated``; a serving worker, that it stopped), and it leaves
nothing behind: no file or directory in its temporary directory, no process it started.  The
moment is a line the command printed (an import ending, a progress bar's phase, a log line),
never a sleep.

How promptly: the goal is 2 s, and ``python -m tests.stopping`` prints each case's time (the
README's figure).  The test's own deadline, :data:`DEADLINE_S`, is far above it, so that a busy
CI machine cannot fail it by being slow; a command that waits for a child (the 31-35 s that
``kill -INT`` took mid-benchmark) or hangs still fails it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from . import stopping
from .stopping import Case, cases, rendered, serve_cases, stop, unique

#: Seconds from the signal to the exit past which a case fails (see the module docstring).
DEADLINE_S = 20.0


def assert_stopped_at_once_with_one_line_and_nothing_left(case: Case, tmp_path: Path) -> None:
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    outcome = stop(unique(case), tmpdir, ready_s=900, exit_s=DEADLINE_S * 2)
    shown = outcome.output[-4000:]
    assert outcome.status == case.expected_status, shown
    assert outcome.seconds < DEADLINE_S, f"{outcome.seconds:.1f} s to exit"
    assert outcome.screen == [case.expected_line], shown
    assert outcome.files == [], "left in the temporary directory"
    assert outcome.processes == [], "processes left running"


@pytest.mark.parametrize("case", cases(), ids=lambda c: f"{c.name}: {c.how}")
def test_stopped_at_once_with_one_line_and_nothing_left(case: Case, tmp_path: Path) -> None:
    assert_stopped_at_once_with_one_line_and_nothing_left(case, tmp_path)


@pytest.mark.vllm
@pytest.mark.parametrize("case", serve_cases(), ids=lambda c: f"{c.name}: {c.how}")
def test_bench_serve_stopped_with_its_vllm_servers(case: Case, tmp_path: Path) -> None:
    """The vLLM servers (each in a session of its own) are stopped too: SIGINT, a short grace,
    then SIGKILL to each server's whole group."""
    pytest.importorskip("vllm")
    assert_stopped_at_once_with_one_line_and_nothing_left(case, tmp_path)


def test_children_start_with_the_stop_signals_blocked_then_ignore_ctrl_c() -> None:
    """A child stopped while it still imports printed a traceback (a Ctrl-C reaches the whole
    group): it starts with SIGINT and SIGTERM blocked, and its entry point then ignores SIGINT
    (the parent stops it) and lets SIGTERM end it."""
    import multiprocessing as mp

    from lmprefetch.bench.processes import start_process, stop_processes

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    procs: list[Any] = []
    try:
        with child:
            start_process(ctx, stopping.report_signals, (child,), procs)
        assert parent.poll(120)
        at_start, after, handlers = parent.recv()
    finally:
        stop_processes(procs, grace_s=10.0)
        parent.close()
    assert {signal.SIGINT, signal.SIGTERM} <= set(at_start)
    assert not {signal.SIGINT, signal.SIGTERM} & set(after)
    assert handlers == ["SIG_IGN", "SIG_DFL"]
    # And this process's own signal mask is as it was.
    assert not {signal.SIGINT, signal.SIGTERM} & signal.pthread_sigmask(signal.SIG_BLOCK, ())


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_as_the_handlers_are_installed_is_one_line_too(signum: int) -> None:
    """``python -m lmprefetch`` got a Ctrl-C as main() entered its with statement: outside
    its try, a traceback.  Here the signal comes exactly then; and after the command's clean-up
    (the handlers are not put back but the signals ignored) another prints nothing."""
    code = (
        "import contextlib, os, sys\n"
        "from lmprefetch import _stopping, cli\n"
        "@contextlib.contextmanager\n"
        "def signalled():\n"
        f"    os.kill(os.getpid(), {int(signum)})  # as the with statement is entered\n"
        "    yield\n"
        "_stopping.resource_tracker_stopped_at_exit = signalled\n"
        "status = cli.main()\n"
        f"os.kill(os.getpid(), {int(signum)})  # the command is done: ignored\n"
        "sys.exit(status)\n"
    )
    out = subprocess.run([sys.executable, "-c", code, "bench"], capture_output=True, text=True,
                         timeout=120, check=False)  # fmt: skip
    what = "interrupted" if signum == signal.SIGINT else "terminated"
    assert (out.returncode, out.stderr) == (128 + signum, f"lmprefetch: {what}\n")


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_whose_stop_python_dropped_still_stops_the_command(signum: int) -> None:
    """A signal handled while a ``__del__`` (or the import system's weakref callback) runs:
    its Stopped is raised where Python cannot propagate it, and was dropped with an "Exception
    ignored" traceback while the command went on (CI saw ``bench`` run to the end after a
    SIGTERM during its imports).  The command stops before its work, with one line."""
    code = (
        "import os, sys\n"
        "from lmprefetch import cli\n"
        "class Late:\n"
        "    def __del__(self):\n"
        f"        os.kill(os.getpid(), {int(signum)})\n"
        "        for _ in range(100_000):  # the handler runs in here: its Stopped goes nowhere\n"
        "            pass\n"
        "parse = cli._parse\n"
        "def parsed(*args):\n"
        "    Late()  # made and collected at once: __del__ runs now\n"
        "    return parse(*args)\n"
        "cli._parse = parsed\n"
        "sys.exit(cli.main())\n"
    )
    out = subprocess.run([sys.executable, "-c", code, "bench"], capture_output=True, text=True,
                         timeout=120, check=False)  # fmt: skip
    what = "interrupted" if signum == signal.SIGINT else "terminated"
    assert (out.returncode, out.stderr, out.stdout) == (128 + signum, f"lmprefetch: {what}\n", "")


def test_the_command_stops_the_resource_tracker_it_started_and_only_that() -> None:
    """The spawn method's resource tracker outlived the command by a moment (a child process
    left); one that ran before (the command called as a function) is not the command's."""
    code = (
        "from multiprocessing import resource_tracker as rt\n"
        "from lmprefetch._stopping import resource_tracker_stopped_at_exit as owned\n"
        "with owned():\n"
        "    rt.ensure_running()\n"
        "    assert rt._resource_tracker._pid is not None\n"
        "assert rt._resource_tracker._pid is None, 'the tracker it started still runs'\n"
        "rt.ensure_running()\n"
        "pid = rt._resource_tracker._pid\n"
        "with owned():\n"
        "    rt.ensure_running()\n"
        "assert rt._resource_tracker._pid == pid, 'a tracker that ran before was stopped'\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=False)  # fmt: skip
    assert out.stdout == "ok\n", out.stderr


def test_the_harness_sees_what_it_checks(tmp_path: Path) -> None:
    """A command that prints a traceback, leaves a directory and a child, and exits with the
    wrong status fails every check (the harness reads the terminal, the directory and /proc)."""
    script = tmp_path / "bad.py"
    script.write_text(
        "import os, signal, subprocess, sys, tempfile, time\n"
        "tempfile.mkdtemp(prefix='left-')\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'],\n"
        "                         start_new_session=True)\n"
        "def fail(*_):\n"
        "    raise RuntimeError('a traceback')\n"
        "signal.signal(signal.SIGINT, fail)  # a traceback on Ctrl-C, exit status 1\n"
        "print('ready', flush=True)\n"
        "signal.pause()\n"
    )
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    case = Case("bad", [sys.executable, str(script)], r"ready", signal.SIGINT, True)
    outcome = stop(case, tmpdir, exit_s=DEADLINE_S)
    assert outcome.status == 1 and outcome.seconds >= 0
    assert "Traceback (most recent call last):" in outcome.screen
    assert [f for f in outcome.files if f.startswith("left-")]
    assert len(outcome.processes) == 1 and "time.sleep(600)" in outcome.processes[0]
    problems = stopping.problems_of(case, outcome)
    assert len(problems) == 4, problems  # status, printed, left files, left processes


def test_a_terminal_shows_the_last_redraw_of_a_line() -> None:
    text = (
        "\r\x1b[2K[##..] 50%  phase\r\x1b[2K[###.] 75%  phase\r\x1b[2K"
        "lmprefetch: interrupted\r\n"
    )
    assert rendered("import time: 1 | 2 | trio\r\n" + text) == ["lmprefetch: interrupted"]
    assert rendered("\r\x1b[2K[#...] 25%") == ["[#...] 25%"]


def test_a_command_started_with_sigint_ignored_still_stops_on_one(tmp_path: Path) -> None:
    """A shell script's background job inherits SIGINT ignored (so does a test suite started
    as one): ``kill -INT`` must stop the command all the same."""
    case = Case("worker, SIGINT ignored at start", [
        sys.executable, "-c",
        "import signal, sys\n"
        "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
        "from lmprefetch.cli import main\n"
        "sys.exit(main())\n",
        "worker", "--request-endpoint", "ipc://@lmp-stop-{}-w", "--response-endpoint",
        "ipc://@lmp-stop-{}-s", "--config", "{fifo}",
    ], stopping.IMPORTS, signal.SIGINT, False)  # fmt: skip
    assert_stopped_at_once_with_one_line_and_nothing_left(case, tmp_path)


def test_the_package_imports_nothing_heavy() -> None:
    """The console script imports ``lmprefetch.cli`` before ``main`` takes charge of Ctrl-C:
    that import must stay short (no Trio, pyzmq or msgspec), or a Ctrl-C then is a traceback."""
    code = (
        "import sys\n"
        "import lmprefetch.cli\n"
        "heavy = sorted(m for m in ('trio', 'zmq', 'msgspec', 'xxhash', 'lmprefetch.config')\n"
        "               if m in sys.modules)\n"
        "print(heavy)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=False, env=env)  # fmt: skip
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


@pytest.mark.parametrize(
    "code",
    [
        "from tests.fuzz.targets import check_config_toml\n"
        "check_config_toml(b'chunk_size = 4\\n')\n",
        "from tests import schedules\n"
        "schedules._disk_template(schedules.by_name(next(\n"
        "    s.name for s in schedules.scenarios() if s.disk)))\n",
    ],
    ids=["fuzz targets", "schedule explorer"],
)
def test_the_suites_own_scratch_directories_go_with_its_process(code: str, tmp_path: Path) -> None:
    """The suite left ``lmprefetch-fuzz-*`` and ``lmprefetch-schedules-*`` behind in the
    system's temporary directory on every run."""
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": str(root)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=False, env=env, cwd=root)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert list(tmp_path.iterdir()) == []


def test_every_trio_run_of_a_command_goes_through_stopping() -> None:
    """A command's Trio runs go through ``_stopping.run_trio``, where a stop signal cancels
    the run; a plain ``trio.run`` under the command's handlers gets the signal raised wherever
    the main thread is, also inside Trio's own loop, and the run is abandoned with a screenful
    of tracebacks (bench-disk's phase budget did, when a Ctrl-C landed in it on a busy
    machine).  Only a worker process's own run may be plain: its entry point ignores SIGINT
    and SIGTERM ends it (``_stopping.child_signals``)."""
    import re

    package = Path(stopping.__file__).resolve().parents[1] / "lmprefetch"
    allowed = {package / "_stopping.py", package / "bench" / "processes.py"}
    plain = [
        f"{path.relative_to(package.parent)}:{n}"
        for path in sorted(package.rglob("*.py"))
        if path not in allowed
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"\btrio\.run\(", line)
    ]
    assert plain == []
