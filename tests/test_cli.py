"""The `lmprefetch` command: worker, bench (small), bench-engine, config errors, signals."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from lmprefetch import LookupClient, PrefetchConfig

CLI = [sys.executable, "-m", "lmprefetch"]
TIMEOUT_S = 60


def worker_env(**variables: str) -> dict[str, str]:
    """This process's environment without its ``LMPREFETCH_*`` variables (a worker refuses
    those it does not know, a user's exported settings), plus
    ``variables``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMPREFETCH_")}
    return {**env, **variables}


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_worker_serves_lookups_and_stops_on_a_signal(tmp_path: Path, signum: int) -> None:
    cfg_file = tmp_path / "w.toml"
    cfg_file.write_text(
        "chunk_size = 4\nchunk_bytes = 64\ncpu_bytes = 4096\nlookup_timeout_s = 10\n"
    )
    tag = uuid.uuid4().hex[:8]
    req, resp = f"ipc://@lmp-cli-{tag}-w", f"ipc://@lmp-cli-{tag}-s"
    proc = subprocess.Popen(
        [
            *CLI,
            "worker",
            "--request-endpoint",
            req,
            "--response-endpoint",
            resp,
            "--config",
            str(cfg_file),
            "--metrics-port",
            "0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=worker_env(LMPREFETCH_CLAIM_TTL_S="20", LMPREFETCH_CHUNK_BYTES="32"),
    )
    try:
        assert proc.stdout is not None and proc.stderr is not None
        line = proc.stdout.readline()
        assert "serving" in line and "metrics" in line
        # What won, the file or a variable, for each field that was set; the endpoints stay
        # at the end of the line.
        assert line.startswith(
            f"lmprefetch worker rank 0/1 serving {req} (chunk_size=4 from --config {cfg_file}, "
            "chunk_bytes=32 from LMPREFETCH_CHUNK_BYTES, "
            f"cpu_bytes=4096 from --config {cfg_file}, "
            f"lookup_timeout_s=10.0 from --config {cfg_file}, "
            "claim_ttl_s=20.0 from LMPREFETCH_CLAIM_TTL_S, the rest default), "
            "metrics on 127.0.0.1:"
        ), line
        assert line.rstrip("\n").rsplit(":", 1)[1].isdigit(), line
        config = PrefetchConfig.from_file(cfg_file).replace(chunk_bytes=32)
        with LookupClient(config, [req], resp) as client:
            client.lookup("a", list(range(8)))
            assert client.wait("a", 10) == 0  # an empty worker: a miss, answered
        proc.send_signal(signum)  # after start-up, either is the ordinary way to stop: 0
        assert proc.wait(timeout=30) == 0
        name = signal.Signals(signum).name
        assert proc.stderr.read().splitlines() == [
            f"lmprefetch worker rank 0/1: stopped ({name})"
        ]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


def test_the_start_up_line_names_the_file_as_given_and_hides_passwords() -> None:
    from lmprefetch.cli import configuration_text

    config = PrefetchConfig(redis_url="redis://user:s3cret@cache:6379/0", disk_path="/d")
    where = {"redis_url": "in /etc/l.toml", "disk_path": "from LMPREFETCH_DISK_PATH"}
    text = configuration_text(config, where, "$LMPREFETCH_CONFIG")
    assert text == (
        'redis_url="redis://user:***@cache:6379/0" from $LMPREFETCH_CONFIG /etc/l.toml, '
        'disk_path="/d" from LMPREFETCH_DISK_PATH, the rest default'
    )
    assert "s3cret" not in text
    assert configuration_text(PrefetchConfig(), {}, "--config") == "every setting its default"


def test_a_mistyped_command_gets_the_closest_one(capsys: pytest.CaptureFixture[str]) -> None:
    from lmprefetch import cli

    for typed, hint in (
        ("benhc", "did you mean 'bench'?"),
        ("bench-dsk", "did you mean 'bench-disk'?"),
        ("wrker", "did you mean 'worker'?"),
        (
            "xyz",
            "the commands: worker, bench, bench-engine, bench-disk, bench-serve, bench-codecs, "
            "model",
        ),
    ):
        with pytest.raises(SystemExit) as caught:
            cli.main(["-v", typed, "--json"])
        assert caught.value.code == 2
        assert capsys.readouterr().err.splitlines() == [
            f"lmprefetch: unknown command {typed!r}; {hint} (see lmprefetch --help)"
        ]


def test_an_unknown_option_points_to_its_commands_help(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from lmprefetch import cli

    for command in ("bench", "bench-engine", "bench-disk", "bench-serve", "worker"):
        with pytest.raises(SystemExit) as caught:
            cli.main([command, "--no-such", "x"])
        assert caught.value.code == 2
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1, err
        assert err[0].endswith(f"(see lmprefetch {command} --help)"), err
        if command != "worker":  # (the worker also misses its required options: said first)
            assert err[0] == (
                f"lmprefetch {command}: unrecognized arguments: --no-such x "
                f"(see lmprefetch {command} --help)"
            )


def _without(module: str, argv: list[str], tmp: Path) -> subprocess.CompletedProcess[str]:
    """``lmprefetch argv`` as if ``module`` were not installed, with ``TMPDIR`` at ``tmp``."""
    runner = (
        f"import sys\nsys.modules[{module!r}] = None\n"
        "from lmprefetch.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    )
    return subprocess.run(
        [sys.executable, "-c", runner, *argv], capture_output=True, text=True,
        timeout=TIMEOUT_S, check=False, env={**os.environ, "TMPDIR": str(tmp)},
    )  # fmt: skip


def test_bench_plot_without_matplotlib_says_so_before_the_run(tmp_path: Path) -> None:
    out = _without("matplotlib", ["bench", "--plot", str(tmp_path / "b.png")], tmp_path)
    assert out.returncode == 2, out.stderr
    assert out.stderr.splitlines() == [
        "lmprefetch: --plot needs matplotlib: python -m pip install 'lmprefetch[plot]'"
    ]
    assert out.stdout == "" and list(tmp_path.iterdir()) == []  # no run was started
    missing = tmp_path / "no" / "b.png"
    out = subprocess.run([*CLI, "bench", "--plot", str(missing)], capture_output=True,
                         text=True, timeout=TIMEOUT_S, check=False)  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert out.stderr.splitlines() == [f"lmprefetch: --plot: {missing.parent} is not a directory"]


def test_bad_config_is_a_clear_error(tmp_path: Path) -> None:
    cfg_file = tmp_path / "bad.toml"
    cfg_file.write_text("chunk_size = 0\n")
    out = subprocess.run(
        [
            *CLI,
            "worker",
            "--request-endpoint",
            "ipc://@x",
            "--response-endpoint",
            "ipc://@y",
            "--config",
            str(cfg_file),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 2
    assert "chunk_size: must be at least 1" in out.stderr


@pytest.mark.slow
def test_bench_runs_small_and_reports_json(tmp_path: Path) -> None:
    out = subprocess.run(
        [
            *CLI,
            "bench",
            "--conversations",
            "6",
            "--turns",
            "2",
            "--repeats",
            "1",
            "--miss-lookups",
            "400",
            "--rtt-samples",
            "50",
            "--chunk-bytes",
            "65536",
            "--cpu-bytes",
            str(4 << 20),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert out.returncode == 0, out.stdout + out.stderr
    r = json.loads(out.stdout)
    assert r["leak_free"] is True
    assert r["replay"]["lookups"] == 6 * 2
    assert 0 < r["replay"]["hit_ratio"] <= 1
    assert r["raw_rtt_us"] > 0 and r["miss_rtt_us"] > 0
    assert r["miss_lookups_per_s_per_worker"] > 0
    assert r["cancel_samples"] > 0
    assert r["cancel_release_ms_p50"] <= r["cancel_release_ms_p99"] <= r["cancel_release_ms_max"]
    # Each figure with a goal comes with it, and says whether it met it.
    assert {g["key"] for g in r["goals"]} >= {
        "miss_rtt_ratio", "first_lookup_ratio", "disk_prefetch_vs_verified_read",
        "cancel_release_ms_p99",
    }  # fmt: skip
    assert all(isinstance(g["met"], bool) for g in r["goals"])
    # The disk figure: lookups and the verified read of the same files, in every worker.
    probe = r["disk_probe"]
    assert probe["workers"] == 2 and probe["rounds"] > 0
    assert probe["prefetch_gbps"] > 0 and probe["verified_read_gbps"] > 0
    assert probe["reads_trusted"] + probe["reads_hashed"] > 0


@pytest.mark.slow
def test_bench_plot(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "bench.png"
    out = subprocess.run(
        [
            *CLI,
            "bench",
            "--conversations",
            "4",
            "--turns",
            "2",
            "--repeats",
            "1",
            "--miss-lookups",
            "200",
            "--rtt-samples",
            "20",
            "--chunk-bytes",
            "65536",
            "--cpu-bytes",
            str(4 << 20),
            "--plot",
            str(png),
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert png.stat().st_size > 1000
    assert "leak check: OK" in out.stdout


def test_bench_engine_small() -> None:
    out = subprocess.run(
        [
            *CLI,
            "bench-engine",
            "--chunks",
            "4",
            "--chunk-bytes",
            "65536",
            "--repeats",
            "3",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    r = json.loads(out.stdout)
    assert r["idle_after"] is True and r["disk_chunks_loaded"] > 0
    assert [g["key"] for g in r["goals"]][-1] == "cold_first_disk_vs_steady"
    if r["lmcache"] is None:  # not installed: no LMCache figure, and no goal against it
        assert not any("lmcache" in g["key"] for g in r["goals"])


def test_every_error_is_one_line_whatever_was_typed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found by fuzzing the command line: argparse does not quote unrecognized arguments, and a
    config key may hold a line break, so one mistake printed two lines."""
    from lmprefetch import cli

    with pytest.raises(SystemExit) as caught:
        cli.main(["bench", "--rank", "\x1e"])
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "lmprefetch bench: unrecognized arguments: --rank \\x1e (see lmprefetch bench --help)"
    ]
    cfg = tmp_path / "w.toml"
    cfg.write_text('"chunk\\nsize" = 4\n')
    ipc = f"ipc://@lmp-cli-{uuid.uuid4().hex[:8]}"
    argv = ["worker", "--request-endpoint", ipc, "--response-endpoint", ipc, "--config", str(cfg)]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1, err
    assert err.startswith("lmprefetch: 'chunk\\nsize': unknown PrefetchConfig field")


# -- a signal during start-up ----------------------------------------------------------------
# Each test sends the signal at a moment the worker provably is inside its start-up (it holds a
# connection to a Redis that never answers, or it has opened a config file nobody writes yet),
# so none depends on timing.  A worker that ignored the signal would go on starting for as long
# as the Redis deadline (minutes); one that printed a traceback fails the stderr check.
def _start_worker(*args: str) -> subprocess.Popen[str]:
    tag = uuid.uuid4().hex[:8]
    return subprocess.Popen(
        [*CLI, "worker", "--request-endpoint", f"ipc://@lmp-cli-{tag}-w",
         "--response-endpoint", f"ipc://@lmp-cli-{tag}-s", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=worker_env(),
    )  # fmt: skip


def _assert_stopped_cleanly(proc: subprocess.Popen[str], status: int, line: str) -> None:
    out, err = proc.communicate(timeout=TIMEOUT_S)
    assert proc.returncode == status, err
    assert "Traceback" not in err
    assert err.splitlines() == [line], err
    assert out == ""  # it never said it was serving


@pytest.mark.parametrize(
    ("signum", "status", "line"),
    [(signal.SIGINT, 130, "lmprefetch: interrupted"),
     (signal.SIGTERM, 143, "lmprefetch: terminated")],
    ids=["SIGINT", "SIGTERM"],
)  # fmt: skip
def test_a_signal_while_the_engine_opens_cancels_the_start_up(
    tmp_path: Path, signum: int, status: int, line: str
) -> None:
    silent_redis = socket.create_server(("127.0.0.1", 0))
    silent_redis.settimeout(TIMEOUT_S)
    port = silent_redis.getsockname()[1]
    cfg = tmp_path / "w.toml"
    cfg.write_text(
        f'redis_url = "redis://127.0.0.1:{port}"\nredis_timeout_s = 300\n'
        "cpu_bytes = 1048576\nchunk_bytes = 4096\narena_prefault_bytes = 0\n"
    )
    proc = _start_worker("--config", str(cfg))
    try:
        conn, _ = silent_redis.accept()  # the engine is opening its Redis tier: start-up
        try:
            proc.send_signal(signum)
            # Promptly: the start-up would otherwise wait up to redis_timeout_s for the PING.
            _assert_stopped_cleanly(proc, status, line)
        finally:
            conn.close()
    finally:
        silent_redis.close()
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_ctrl_c_while_the_config_file_is_read_exits_130_without_a_traceback(
    tmp_path: Path,
) -> None:
    fifo = tmp_path / "w.toml"
    os.mkfifo(fifo)
    proc = _start_worker("--config", str(fifo))
    writer: list[int] = []
    # Opening a FIFO for writing returns when the reader has opened it: the worker is then
    # reading its config file, which is never written.
    opener = threading.Thread(target=lambda: writer.append(os.open(fifo, os.O_WRONLY)))
    opener.daemon = True
    opener.start()
    try:
        opener.join(TIMEOUT_S)
        assert writer, "the worker never opened its config file"
        proc.send_signal(signal.SIGINT)
        _assert_stopped_cleanly(proc, 130, "lmprefetch: interrupted")
    finally:
        for fd in writer:
            os.close(fd)
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        if not writer:  # unblock the opener: open the FIFO's read end ourselves
            os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))


def test_the_benchmarks_child_processes_end_quietly() -> None:
    """Ctrl-C reaches the whole process group, and a stopped command's children find their pipe
    closed: the benchmark's worker and echo processes printed a traceback each while the
    command itself said "interrupted" once."""
    from lmprefetch.bench import disk, processes

    def interrupted() -> None:
        raise KeyboardInterrupt

    def parent_gone() -> None:
        raise EOFError

    def exit_status(body: Callable[[], None]) -> object:
        """``child_main(body)()``'s exit status, run in a thread (where it leaves this
        process's signal handling alone)."""
        codes: list[object] = []

        def run() -> None:
            try:
                processes.child_main(body)()
            except SystemExit as exc:
                codes.append(exc.code)

        thread = threading.Thread(target=run)
        thread.start()
        thread.join(TIMEOUT_S)
        return codes[0] if codes else None

    assert exit_status(interrupted) == 130
    assert exit_status(parent_gone) == 1
    for main in (
        processes.worker_main, processes.echo_main, processes.trio_echo_main, disk._burn,
    ):  # fmt: skip
        assert main.__code__ is processes.child_main(interrupted).__code__, main
