"""Real Mooncake processes for tests: ``mooncake_master`` and the standalone store
(``mooncake_client``), on free loopback ports, inside a private network namespace.

Mooncake's clients listen on every network interface (whatever address they are given), so the
tests that start them run only where this process sees no interface but loopback: under
``python -m lmprefetch.bench.netns`` (which ``nox -s mooncake`` and ``nox -s ci`` use) or in a
container without a network.  Elsewhere they skip, naming the command; with ``--require
mooncake`` (tests/components.py) that is a failure instead.

Readiness is the process's own word: each process logs to a pipe that a thread drains, and the
helper waits (an event, with a deadline) for its "started" line; the master's RPC service
starts just after its last line, so then one connection is tried until it is accepted (a
deadline bounds it).  Every process is stopped by its own pid.

Mooncake's own timeouts (read from the environment as its clients connect) are set here, once,
for every test of the process: they are process-wide.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from lmprefetch.bench.netns import loopback_only

from .server_processes import ServerProcess, free_port

__all__ = [
    "CALL_TIMEOUT_S",
    "MOONCAKE_CLIENT",
    "MOONCAKE_MASTER",
    "MooncakeMaster",
    "MooncakeStore",
    "missing",
    "needs_mooncake",
]

#: The Mooncake tier's ``timeout_s`` in these tests, and Mooncake's own timeouts below:
#: generous, so that a busy machine does not turn a slow call into a failure.
CALL_TIMEOUT_S = 5.0
for _name, _value in (
    ("MC_RPC_TIMEOUT_MS", "5000"),
    ("MC_RPC_CONNECT_TIMEOUT_MS", "5000"),
    ("MC_TCP_PROGRESS_TIMEOUT_SEC", "5"),
    ("MC_TCP_STATUS_TIMEOUT_SEC", "5"),
    ("MC_STORE_CLIENT_SETUP_RETRIES", "1"),
):
    os.environ.setdefault(_name, _value)

STARTUP_TIMEOUT_S = 30.0
NETNS_COMMAND = "python -m lmprefetch.bench.netns python -m pytest -m mooncake"


def _program(name: str) -> str | None:
    """``name`` on ``PATH``, or beside this Python (a virtual environment's ``bin``)."""
    found = shutil.which(name)
    if found is None:
        beside = Path(sys.executable).parent / name
        if beside.is_file() and os.access(beside, os.X_OK):
            found = str(beside)
    return found


MOONCAKE_MASTER = _program("mooncake_master")
MOONCAKE_CLIENT = _program("mooncake_client")


def missing() -> str | None:
    """What is missing to run the Mooncake tests here (a sentence), or ``None``."""
    if importlib.util.find_spec("mooncake") is None:
        return "the mooncake package is not installed (pip install 'lmprefetch[mooncake]')"
    try:
        from mooncake.store import MooncakeDistributedStore  # noqa: F401
    except ImportError as exc:
        return f"mooncake.store cannot be imported ({exc}; apt-get install libibverbs1?)"
    for name, path in (("mooncake_master", MOONCAKE_MASTER), ("mooncake_client", MOONCAKE_CLIENT)):
        if path is None:
            return f"{name} is not on PATH"
    if not loopback_only():
        return (
            "not in a private network namespace (Mooncake's clients listen on every "
            f"interface): run `{NETNS_COMMAND}` or `nox -s mooncake`"
        )
    return None


_MISSING = missing()
needs_mooncake = [
    pytest.mark.mooncake,
    pytest.mark.skipif(_MISSING is not None, reason=_MISSING or ""),
]


class _Process(ServerProcess):
    """A child process whose output a thread drains into :attr:`log`; :meth:`wait_for` waits
    for a line."""

    def __init__(self, name: str) -> None:
        super().__init__(STARTUP_TIMEOUT_S)
        self.name = name
        self.log = bytearray()
        self._changed = threading.Condition()
        self._drainer: threading.Thread | None = None

    def _spawn(self, argv: list[str]) -> None:
        self.log.clear()
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        self._drainer = threading.Thread(target=self._drain, args=(self.proc,), daemon=True)
        self._drainer.start()

    def _drain(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        with proc.stdout:
            for line in iter(proc.stdout.readline, b""):
                with self._changed:
                    self.log += line
                    self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    def wait_for(self, text: str, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        """Block until the log holds ``text``.

        Raises:
            RuntimeError: the process exited first, or the deadline passed.
        """
        needle = text.encode()
        proc = self.proc
        assert proc is not None
        with self._changed:
            ok = self._changed.wait_for(
                lambda: needle in self.log or proc.poll() is not None, timeout_s
            )
            if not ok or needle not in self.log:
                raise RuntimeError(
                    f"{self.name}: no {text!r} within {timeout_s} s "
                    f"(exit status {proc.poll()}):\n{self.log.decode(errors='replace')[-3000:]}"
                )

    def _reaped(self) -> None:
        super()._reaped()
        if self._drainer is not None:  # it ends at the end of the output
            self._drainer.join(STARTUP_TIMEOUT_S)
            self._drainer = None


def _wait_accepting(port: int, timeout_s: float) -> None:
    """Connect to ``127.0.0.1:port`` until it accepts (the deadline only bounds a hang)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1.0).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"nothing accepts on 127.0.0.1:{port}") from None
            time.sleep(0.01)  # the RPC service is starting; try again


class MooncakeMaster(_Process):
    """``mooncake_master`` on 127.0.0.1: its RPC port (``address``) and its metrics port.

    Args:
        port: the RPC port (a free one when ``None``; :meth:`start` again reuses it).
        lease_ttl_ms: ``--default_kv_lease_ttl`` (Mooncake's default: 10 s).
        http_metadata: also serve the HTTP metadata server (``metadata_url``).
        extra: more flags.
    """

    def __init__(
        self,
        port: int | None = None,
        *,
        lease_ttl_ms: int | None = None,
        http_metadata: bool = False,
        extra: tuple[str, ...] = (),
    ) -> None:
        super().__init__("mooncake_master")
        self.port = port or free_port()
        self.metrics_port = free_port()
        self.http_port = free_port() if http_metadata else 0
        self.lease_ttl_ms = lease_ttl_ms
        self.extra = extra

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def metadata_url(self) -> str:
        assert self.http_port
        return f"http://127.0.0.1:{self.http_port}/metadata"

    def start(self) -> MooncakeMaster:
        assert MOONCAKE_MASTER is not None
        argv = [
            MOONCAKE_MASTER,
            "--rpc_address=127.0.0.1",
            f"--rpc_port={self.port}",
            "--metrics_host=127.0.0.1",
            f"--metrics_port={self.metrics_port}",
            *self.extra,
        ]
        if self.lease_ttl_ms is not None:
            argv.append(f"--default_kv_lease_ttl={self.lease_ttl_ms}")
        if self.http_port:
            argv += [
                "--enable_http_metadata_server=true",
                "--http_metadata_server_host=127.0.0.1",
                f"--http_metadata_server_port={self.http_port}",
            ]
        self._spawn(argv)
        try:
            self.wait_for("Master admin server started")
            _wait_accepting(self.port, STARTUP_TIMEOUT_S)
        except BaseException:
            self.kill()
            raise
        return self


class MooncakeStore(_Process):
    """The standalone store: a ``mooncake_client`` process that holds ``segment_mib`` MiB of
    the pool and serves no requests of its own (the serving workers contribute nothing)."""

    def __init__(self, master: MooncakeMaster, segment_mib: int = 64) -> None:
        super().__init__("mooncake_client")
        self.master = master
        self.segment_mib = segment_mib
        self.port = free_port()

    def start(self) -> MooncakeStore:
        assert MOONCAKE_CLIENT is not None
        self._spawn([
            MOONCAKE_CLIENT,
            f"--global_segment_size={self.segment_mib}MB",
            "--host=127.0.0.1",
            f"--port={self.port}",
            f"--master_server_address={self.master.address}",
            "--metadata_server=P2PHANDSHAKE",
            "--protocol=tcp",
        ])  # fmt: skip
        try:
            self.wait_for("Starting real client service")
        except BaseException:
            self.kill()
            raise
        return self


# -- fixtures ------------------------------------------------------------------------------------
@pytest.fixture(name="mooncake_master")
def mooncake_master_fixture() -> Iterator[MooncakeMaster]:
    """A fresh master for one test (a lease of 1 s, so that ``remove`` after a load is quick)."""
    if _MISSING is not None:
        pytest.skip(_MISSING)
    master = MooncakeMaster(lease_ttl_ms=1000).start()
    try:
        yield master
    finally:
        master.kill()  # it keeps nothing; a SIGTERM'd master takes a second to exit
