"""Real ``redis-server`` processes for tests: a standalone server and a 3-node cluster.

Servers listen on 127.0.0.1 on free ports (bind-to-port-0), keep nothing on disk
(``--save "" --appendonly no``) and run in a temporary directory.  Readiness is the server's own
word, not a polling loop: each server logs to a pipe and the helper waits (``selectors``, with a
deadline) for "Ready to accept connections" and, for cluster nodes, "Cluster state changed: ok".
Once ready the pipe is closed (Redis ignores ``SIGPIPE``, so later log lines are just lost).
Every process is stopped by its own pid, and only processes started here are ever signalled.

Import the fixtures into a test module (they are registered under the names ``redis_server``,
``redis_cluster`` and ``redis_cluster_module``)::

    from .redis_servers import redis_cluster_fixture, redis_server_fixture  # noqa: F401
"""

from __future__ import annotations

import contextlib
import os
import selectors
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .server_processes import ServerProcess, free_port

REDIS_SERVER = shutil.which("redis-server")
REDIS_CLI = shutil.which("redis-cli")
HAVE_REDIS = REDIS_SERVER is not None and REDIS_CLI is not None

STARTUP_TIMEOUT_S = 20.0


class RedisServer(ServerProcess):
    """One ``redis-server`` process on ``127.0.0.1:port`` with ``workdir`` as its directory.

    Args:
        workdir: the server's ``--dir`` (created if needed).
        port: the port; a free one when ``None``.
        cluster: start with ``--cluster-enabled yes`` (and a free cluster bus port).
    """

    def __init__(self, workdir: Path, port: int | None = None, *, cluster: bool = False) -> None:
        super().__init__(STARTUP_TIMEOUT_S)
        self.workdir = workdir
        self.port = port if port is not None else free_port()
        self.cluster = cluster
        self.bus_port = free_port() if cluster else 0
        self._log = bytearray()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def log_text(self) -> str:
        return self._log.decode(errors="replace")

    def start(self) -> RedisServer:
        """Start the process and return once it accepts connections.

        Raises:
            RuntimeError: it exited or did not become ready within ``STARTUP_TIMEOUT_S``.
        """
        assert REDIS_SERVER is not None
        if self.proc is not None:
            raise RuntimeError("already started")
        self.workdir.mkdir(parents=True, exist_ok=True)
        args = [
            REDIS_SERVER,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self.workdir),
            "--daemonize", "no",
            "--logfile", "",
            "--protected-mode", "no",
        ]  # fmt: skip
        if self.cluster:
            args += [
                "--cluster-enabled", "yes",
                "--cluster-config-file", f"nodes-{self.port}.conf",
                "--cluster-port", str(self.bus_port),
            ]  # fmt: skip
        self._log.clear()
        self.proc = subprocess.Popen(
            args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        try:
            self.wait_for_log("Ready to accept connections", STARTUP_TIMEOUT_S)
        except BaseException:
            self.stop()
            raise
        if not self.cluster:
            self.close_log()
        return self

    def wait_for_log(self, text: str, timeout_s: float) -> None:
        """Block until the server's log contains ``text`` (waiting on its pipe, deadline
        ``timeout_s``).

        Raises:
            RuntimeError: the process exited or the deadline passed first.
        """
        proc = self.proc
        if proc is None or proc.stdout is None:
            raise RuntimeError("no log to wait on")
        needle = text.encode()
        deadline = time.monotonic() + timeout_s
        fd = proc.stdout.fileno()
        with selectors.DefaultSelector() as selector:
            selector.register(fd, selectors.EVENT_READ)
            while needle not in self._log:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise RuntimeError(f"redis {self.address}: no {text!r} within {timeout_s} s")
                if not selector.select(remaining):
                    continue  # the deadline check above ends the wait
                chunk = os.read(fd, 65536)
                if not chunk:
                    raise RuntimeError(
                        f"redis {self.address} exited before {text!r}:\n{self.log_text}"
                    )
                self._log += chunk

    def close_log(self) -> None:
        """Stop reading the server's log (it keeps running; its later log lines are lost)."""
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()

    def _reaped(self) -> None:
        self.close_log()
        super()._reaped()


class RedisCluster:
    """Three cluster-enabled servers joined by ``redis-cli --cluster create`` (no replicas)."""

    def __init__(self, workdir: Path, size: int = 3) -> None:
        self.nodes = [RedisServer(workdir / f"node{i}", cluster=True) for i in range(size)]

    @property
    def url(self) -> str:
        """The comma-separated startup-node URLs lmprefetch takes."""
        return ",".join(node.url for node in self.nodes)

    def start(self) -> RedisCluster:
        """Start the nodes, create the cluster, return once every node says cluster_state:ok.

        Raises:
            RuntimeError: a node failed to start or the cluster did not form in time.
        """
        assert REDIS_CLI is not None
        try:
            for node in self.nodes:
                node.start()
            subprocess.run(
                [REDIS_CLI, "--cluster", "create", *(n.address for n in self.nodes),
                 "--cluster-replicas", "0", "--cluster-yes"],
                check=True,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=STARTUP_TIMEOUT_S,
            )  # fmt: skip
            for node in self.nodes:
                node.wait_for_log("Cluster state changed: ok", STARTUP_TIMEOUT_S)
                node.close_log()
            for node in self.nodes:
                info = redis_cli(node, "CLUSTER", "INFO")
                if "cluster_state:ok" not in info:
                    raise RuntimeError(f"cluster node {node.address} not ok:\n{info}")
        except BaseException:
            self.stop()
            raise
        return self

    def flushall(self) -> None:
        for node in self.nodes:
            redis_cli(node, "FLUSHALL")

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


def redis_cli(server: RedisServer, *command: str) -> str:
    """Run one command with ``redis-cli`` against ``server``; its output."""
    assert REDIS_CLI is not None
    done = subprocess.run(
        [REDIS_CLI, "-h", "127.0.0.1", "-p", str(server.port), *command],
        check=True,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=STARTUP_TIMEOUT_S,
    )
    return done.stdout.decode()


@contextlib.contextmanager
def raw_client(url: str) -> Iterator[Any]:
    """A plain redis-py client (``redis.Redis`` or ``RedisCluster`` for a comma list), closed
    on exit: for tests that reach around the tier (delete, corrupt, inspect)."""
    import redis
    from redis.cluster import ClusterNode
    from redis.cluster import RedisCluster as ClusterClient

    urls = url.split(",")
    client: Any
    if len(urls) == 1:
        client = redis.Redis.from_url(urls[0], socket_timeout=5)
    else:
        nodes = []
        for u in urls:
            host, port = u.removeprefix("redis://").split(":")
            nodes.append(ClusterNode(host, int(port)))
        client = ClusterClient(startup_nodes=nodes, socket_timeout=5)
    try:
        yield client
    finally:
        client.close()


# -- fixtures (plain sync fixtures: pytest-trio async fixtures must be function-scoped) ------
@pytest.fixture(name="redis_server")
def redis_server_fixture(tmp_path: Path) -> Iterator[RedisServer]:
    """A fresh standalone server for one test."""
    if not HAVE_REDIS:
        pytest.skip("redis-server / redis-cli not on PATH")
    server = RedisServer(tmp_path / "redis").start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(name="redis_cluster_module", scope="module")
def redis_cluster_module_fixture(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[RedisCluster]:
    """One 3-node cluster per test module (forming a cluster takes about two seconds)."""
    if not HAVE_REDIS:
        pytest.skip("redis-server / redis-cli not on PATH")
    cluster = RedisCluster(tmp_path_factory.mktemp("redis-cluster")).start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(name="redis_cluster")
def redis_cluster_fixture(redis_cluster_module: RedisCluster) -> RedisCluster:
    """The module's cluster, emptied for this test."""
    redis_cluster_module.flushall()
    return redis_cluster_module
