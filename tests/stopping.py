"""Stop an ``lmprefetch`` command the way a user does, at a moment it has shown, and look at
what is left: how long it took to exit, what it printed, and what it left behind.

The command runs in a pseudo-terminal of its own (standard output and error, as in a user's
terminal: progress bars are drawn), in a process group of its own, with ``TMPDIR`` pointing at
an empty directory of the test's and a unique ``LMP_STOP_TEST`` variable in its
environment.  A reader thread collects everything the terminal shows.  The harness waits until
the terminal shows the moment's text (a line the command printed: never a sleep), then sends
the signal to the process or to its whole group (Ctrl-C in a terminal reaches the group), and
times the exit.  Afterwards:

* ``seconds``: from the signal to the exit (the process reaped);
* ``screen``: the lines the terminal shows from the signal on, as a terminal renders them (a
  carriage return or an erase-line overwrites, ``-X importtime`` lines left out);
* ``files``: what is left in the command's ``TMPDIR``;
* ``processes``: every process still alive (zombies aside) whose environment carries the
  run's variable: every descendant, whatever its process group or session.

``python -m tests.stopping`` runs :func:`cases` (what ``tests/test_stopping.py`` checks; with
``--serve`` also :func:`serve_cases`) and prints each case's exit time.
"""

from __future__ import annotations

import contextlib
import os
import pty
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: The environment variable that marks every process of one run.
MARK = "LMP_STOP_TEST"
#: The moment "while Python imports the command": with ``-X importtime`` Python prints a line
#: as each module's import ends.  Trio is imported by ``main`` (with the benchmarks and pyzmq:
#: a few hundred milliseconds in all), after it took charge of the signals: before that, the
#: console script's own ``from lmprefetch.cli import main`` runs, and a Ctrl-C there is
#: Python's (``python -m lmprefetch`` takes charge first: :data:`CLI_IMPORT`).
IMPORTS = r"import time:.*\|\s+trio\r?\n"
#: While the child processes a phase starts import what they run: they import pyzmq (the
#: command itself did long before), with ``-X importtime`` passed on to them.
CHILDREN_IMPORT = r"import time:.*\|\s+zmq\r?\n"
#: While ``lmprefetch.cli`` itself is imported (its first import is argparse), which only
#: ``python -m lmprefetch`` covers.
CLI_IMPORT = r"import time:.*\|\s+argparse\r?\n"


def console_script() -> list[str]:
    """The ``lmprefetch`` console script installed beside this Python (the user's command)."""
    script = Path(sys.executable).with_name("lmprefetch")
    return [str(script)] if script.exists() else [sys.executable, "-m", "lmprefetch"]


PYTHON_M = [sys.executable, "-m", "lmprefetch"]
#: ``lmprefetch bench`` small enough for the suite (about five seconds on two busy cores), with
#: every phase and child process of the default run.
SMALL_BENCH = [
    "bench", "--conversations", "8", "--turns", "2", "--chunk-bytes", "262144",
    "--cpu-bytes", "16777216", "--miss-lookups", "400", "--rtt-samples", "50",
    "--cancel-samples", "20", "--disk-probe-rounds", "2",
]  # fmt: skip


@dataclass(frozen=True)
class Case:
    """One way of stopping: the command, the moment, the signal and where it is sent."""

    name: str
    argv: Sequence[str]
    moment: str  # a regular expression the terminal must show first
    signum: int
    group: bool  # to the process group (Ctrl-C, ``timeout``) or the process (``kill``)
    #: The line the command prints when it stops (default: ``lmprefetch: interrupted`` or
    #: ``terminated``) and its exit status (default: 128 + the signal).
    line: str | None = None
    status: int | None = None

    @property
    def expected_line(self) -> str:
        if self.line is not None:
            return self.line
        return "lmprefetch: " + ("interrupted" if self.signum == signal.SIGINT else "terminated")

    @property
    def expected_status(self) -> int:
        return 128 + self.signum if self.status is None else self.status

    @property
    def how(self) -> str:
        return f"{signal.Signals(self.signum).name} to the {'group' if self.group else 'process'}"


@dataclass
class Outcome:
    status: int | None
    seconds: float
    screen: list[str]
    files: list[str]
    processes: list[str]
    output: str = field(repr=False)


class Terminal:
    """A pseudo-terminal whose output a thread collects; :meth:`wait_for` waits for a pattern."""

    def __init__(self) -> None:
        self.master, self.slave = pty.openpty()
        self._data = bytearray()
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while True:
            try:
                chunk = os.read(self.master, 65536)
            except OSError:  # EIO: every process with the other end has closed it
                chunk = b""
            with self._changed:
                if not chunk:
                    self._changed.notify_all()
                    return
                self._data += chunk
                self._changed.notify_all()

    def text(self, start: int = 0) -> str:
        with self._changed:
            return self._data[start:].decode(errors="replace")

    def mark(self) -> int:
        with self._changed:
            return len(self._data)

    def wait_for(self, pattern: str, timeout_s: float) -> bool:
        """Whether the terminal showed ``pattern`` within ``timeout_s``."""
        compiled = re.compile(pattern)
        with self._changed:
            return self._changed.wait_for(
                lambda: compiled.search(self._data.decode(errors="replace")) is not None,
                timeout_s,
            )

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.slave)
        self._thread.join(5)
        with contextlib.suppress(OSError):
            os.close(self.master)


def rendered(text: str) -> list[str]:
    """The non-empty lines a terminal shows for ``text``: in each line what follows its last
    carriage return or erase-line (the progress bar's redraws), ``-X importtime`` lines out."""
    lines = []
    for line in text.replace("\r\n", "\n").split("\n"):
        shown = re.split(r"\r|\x1b\[2K", line)[-1]
        if shown.strip() and not shown.startswith("import time:"):
            lines.append(shown)
    return lines


def marked_processes(mark: str) -> list[str]:
    """``"pid command"`` of every live (not zombie) process whose environment has
    ``LMP_STOP_TEST=mark``."""
    needle = f"{MARK}={mark}".encode()
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            environ = Path(entry.path, "environ").read_bytes()
            stat = Path(entry.path, "stat").read_text()
            cmdline = Path(entry.path, "cmdline").read_bytes()
        except OSError:
            continue
        state = stat[stat.rfind(")") + 2 :].split()[0]
        if needle in environ.split(b"\0") and state != "Z":
            command = cmdline.replace(b"\0", b" ").decode(errors="replace")
            found.append(f"{entry.name} {command}")
    return found


def _environment(mark: str, tmpdir: Path, moment: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMPREFETCH_")}
    env.update({MARK: mark, "TMPDIR": str(tmpdir), "PYTHONUNBUFFERED": "1", "COLUMNS": "100"})
    if "import time:" in moment:
        env["PYTHONPROFILEIMPORTTIME"] = "1"
    return env


def stop(case: Case, tmpdir: Path, *, ready_s: float = 300.0, exit_s: float = 60.0) -> Outcome:
    """Run ``case``; see the module docstring.  ``ready_s``: how long the command may take to
    reach the moment; ``exit_s``: to exit after the signal (the outcome's ``status`` is
    ``None`` when it did not)."""
    with _fifo() as fifo:
        argv = [a.replace("{fifo}", str(fifo)) for a in case.argv]
        return _stop(case, argv, tmpdir, ready_s, exit_s)


@contextlib.contextmanager
def _fifo() -> Iterator[Path]:
    """A FIFO nobody writes (outside the command's temporary directory): a command that reads
    it waits there, wherever the signal finds it; ``{fifo}`` in a case's command names it."""
    with empty_directory() as directory:
        path = directory / "never-written.toml"
        os.mkfifo(path)
        yield path


def _stop(case: Case, argv: list[str], tmpdir: Path, ready_s: float, exit_s: float) -> Outcome:
    mark = uuid.uuid4().hex
    terminal = Terminal()
    proc = subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=terminal.slave,
        stderr=terminal.slave,
        env=_environment(mark, tmpdir, case.moment),
        cwd=tmpdir,
        start_new_session=True,
    )
    os.close(terminal.slave)
    try:
        if not terminal.wait_for(case.moment, ready_s):
            raise AssertionError(
                f"{case.name}: never showed {case.moment!r}; it showed:\n{terminal.text()[-3000:]}"
            )
        start = terminal.mark()
        t0 = time.monotonic()
        if case.group:
            os.killpg(proc.pid, case.signum)
        else:
            proc.send_signal(case.signum)
        status: int | None
        try:
            status = proc.wait(exit_s)
        except subprocess.TimeoutExpired:
            status = None
        seconds = time.monotonic() - t0
        # (The children are checked at once: a command must not exit before its children.)
        left = marked_processes(mark)
        files = sorted(os.listdir(tmpdir))
        terminal.close()  # reads to the end, unless a child left behind holds the terminal
        return Outcome(status, seconds, rendered(terminal.text(start)), files, left,
                       terminal.text())  # fmt: skip
    finally:
        _end(proc, mark)
        terminal.close()


def _end(proc: subprocess.Popen[bytes], mark: str) -> None:
    """Whatever a failed case left running: the command, then every process with its mark
    (only processes of this run have it)."""
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    for line in marked_processes(mark):
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(line.split()[0]), signal.SIGKILL)


def cases(script: Sequence[str] | None = None) -> list[Case]:
    """Every way of stopping that the suite checks (``tests/test_stopping.py``): each
    subcommand, each at the moments it shows, each signal to the process and to the group."""
    lmp = list(script or console_script())
    intr, term = signal.SIGINT, signal.SIGTERM
    bench = [*lmp, *SMALL_BENCH]
    out = [
        # While Python imports the command (the console script and python -m).
        Case("bench, imports", [*lmp, "bench"], IMPORTS, intr, True),
        Case("bench, imports", [*lmp, "bench"], IMPORTS, term, False),
        Case("python -m, imports", [*PYTHON_M, "bench"], IMPORTS, intr, True),
        Case("python -m, its own import", [*PYTHON_M, "bench"], CLI_IMPORT, intr, True),
        Case("python -m, its own import", [*PYTHON_M, "bench"], CLI_IMPORT, term, False),
        # (The worker then reads a config file nobody writes: still starting when the signal
        # comes, however late.)
        Case("worker, imports", [*lmp, "worker", "--request-endpoint", "ipc://@x",
                                 "--response-endpoint", "ipc://@y", "--config", "{fifo}"],
             IMPORTS, term, True),
        # lmprefetch bench, phase by phase (the progress bar names each).
        Case("bench, workers start", bench, r"starting \d+ workers", intr, True),
        Case("bench, workers start", bench, r"starting \d+ workers", term, True),
        # Ctrl-C and timeout while the workers, then the transport's worker, still import.
        Case("bench, workers importing", bench,
             r"starting \d+ workers[\s\S]*" + CHILDREN_IMPORT, intr, True),
        Case("bench, workers importing", bench,
             r"starting \d+ workers[\s\S]*" + CHILDREN_IMPORT, term, True),
        Case("bench, transport worker importing", bench,
             r"round trips[\s\S]*" + CHILDREN_IMPORT, intr, True),
        Case("bench, workers store", bench, r"\] +[1-9]\d*% .*storing", intr, False),
        Case("bench, workers store", bench, r"\] +[1-9]\d*% .*storing", term, True),
        Case("bench, transport", bench, r"round trips", intr, False),
        Case("bench, transport", bench, r"round trips", term, False),
        Case("bench, scheduler", bench, r"submit and poll", intr, True),
        Case("bench, scheduler", bench, r"submit and poll", term, True),
        # The default run (642 MB of chunk files), as `timeout 6 lmprefetch bench` stops it.
        Case("bench (defaults), workers store", [*lmp, "bench"], r"\] +[1-9]\d*% .*storing",
             term, True),
        Case("python -m, bench transport", [*PYTHON_M, *SMALL_BENCH], r"round trips", intr,
             True),
        # The engine benchmark and the disk benchmark (-v: each engine opened says so).
        Case("bench-engine", [*lmp, "-v", "bench-engine", "--repeats", "5", "--lmcache", "off"],
             r"pre-faulted", intr, True),
        Case("bench-engine", [*lmp, "-v", "bench-engine", "--repeats", "5", "--lmcache", "off"],
             r"pre-faulted", term, False),
        Case("bench-disk, burners", [*lmp, "bench-disk", "--quick", "--runs", "1",
                                     "--repeats", "3", "--lmcache", "off"],
             r"run 1/1 alone", intr, True),
        Case("bench-disk, burners", [*lmp, "bench-disk", "--quick", "--runs", "1",
                                     "--repeats", "3", "--lmcache", "off"],
             r"run 1/1 alone", term, False),
        # The phase budget alone: the signal lands in its Trio run, beside the burners.
        Case("bench-disk --budget-only, burners", [*lmp, "bench-disk", "--quick", "--runs",
                                                   "1", "--budget-only"],
             r"run 1/1 alone", intr, True),
    ]  # fmt: skip
    worker = [*lmp, "worker", "--request-endpoint", "ipc://@lmp-stop-{}-w",
              "--response-endpoint", "ipc://@lmp-stop-{}-s", "--metrics-port", "0"]  # fmt: skip
    for signum, group in ((intr, True), (term, False)):
        name = signal.Signals(signum).name
        out.append(
            Case("worker, serving", worker, r"serving .*\n", signum, group,
                 line=f"lmprefetch worker rank 0/1: stopped ({name})", status=0)
        )  # fmt: skip
    return out


def serve_cases(script: Sequence[str] | None = None) -> list[Case]:
    """``lmprefetch bench-serve`` (it needs vLLM's CPU build, or it stops at once, saying so):
    while it imports, while a server starts, and mid-round (the progress bar's count moves)."""
    serve = [*(script or console_script()), "bench-serve", "--quick", "--scenarios", "apc"]
    return [
        Case("bench-serve, imports", serve, IMPORTS, signal.SIGINT, False),
        Case("bench-serve, server starting", serve, r"starting server 1/1", signal.SIGINT, True),
        Case("bench-serve, mid-round", serve, r"apc .*\] +[1-9]", signal.SIGTERM, False),
    ]


def report_signals(conn: Any) -> None:
    """A child's entry point: send the parent the signals blocked as it starts, then those
    blocked and SIGINT's and SIGTERM's handlers once :func:`child_signals` ran."""
    from lmprefetch._stopping import child_signals

    at_start = sorted(signal.pthread_sigmask(signal.SIG_BLOCK, ()))
    child_signals()
    after = sorted(signal.pthread_sigmask(signal.SIG_BLOCK, ()))
    handlers = [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)]
    names = [h.name if isinstance(h, signal.Handlers) else h for h in handlers]
    conn.send((at_start, after, names))


def unique(case: Case) -> Case:
    """``case`` with its ``{}`` placeholders (endpoint names) made unique to this run."""
    tag = uuid.uuid4().hex[:8]
    return Case(case.name, [a.replace("{}", tag) for a in case.argv], case.moment,
                case.signum, case.group, case.line, case.status)  # fmt: skip


@contextlib.contextmanager
def empty_directory() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="lmp-stop-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def main() -> int:
    """Run every case once and print its exit time (for the report); status 1 if one failed.
    ``--serve``: bench-serve's too (vLLM's CPU build must be installed)."""
    failed = 0
    print(f"{'case':<36} {'signal':<24} {'exit s':>7}  result")
    for case in cases() + (serve_cases() if "--serve" in sys.argv else []):
        with empty_directory() as tmpdir:
            outcome = stop(unique(case), tmpdir, ready_s=900)
        problems = problems_of(case, outcome)
        failed += bool(problems)
        print(f"{case.name:<36} {case.how:<24} {outcome.seconds:7.2f}  "
              f"{'; '.join(problems) or 'ok'}", flush=True)  # fmt: skip
    return 1 if failed else 0


def problems_of(case: Case, outcome: Outcome, deadline_s: float = 2.0) -> list[str]:
    """What is wrong with ``outcome`` (empty when nothing is)."""
    problems = []
    if outcome.status != case.expected_status:
        problems.append(f"status {outcome.status}, not {case.expected_status}")
    if outcome.seconds > deadline_s:
        problems.append(f"{outcome.seconds:.2f} s to exit")
    if outcome.screen != [case.expected_line]:
        problems.append(f"printed {outcome.screen!r}")
    if outcome.files:
        problems.append(f"left {outcome.files}")
    if outcome.processes:
        problems.append(f"left processes {outcome.processes}")
    return problems


if __name__ == "__main__":
    sys.exit(main())
