"""Start-up errors of ``lmprefetch worker``: one line naming the problem, exit code 2.

Every case runs the real command in a subprocess and checks what an operator sees: exactly one
line on stderr, naming the option or setting to fix, no traceback, exit status 2.  The worker
must fail before it serves anything, so nothing is left running.
"""

from __future__ import annotations

import functools
import os
import re
import socket
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import zmq

CLI = [sys.executable, "-m", "lmprefetch"]
TIMEOUT_S = 60
TROUBLESHOOTING = Path(__file__).resolve().parent.parent / "docs" / "troubleshooting.md"


@functools.cache
def documented_messages() -> list[re.Pattern[str]]:
    """The start-up messages docs/troubleshooting.md explains (one ```text block each; the
    parts in <angle brackets> vary)."""
    templates = re.findall(r"```text\n(lmprefetch.*?)\n```", TROUBLESHOOTING.read_text())
    return [
        re.compile(".+?".join(re.escape(part) for part in re.split(r"<[^<>]+>", template)))
        for template in templates
    ]


def ipc() -> str:
    return f"ipc://@lmp-startup-{uuid.uuid4().hex[:12]}"


def worker_args(*extra: str) -> list[str]:
    return ["worker", "--request-endpoint", ipc(), "--response-endpoint", ipc(), *extra]


def run(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``lmprefetch args`` with ``env`` for its ``LMPREFETCH_*`` variables (this process's own,
    a developer's exported settings, are left out)."""
    inherited = {k: v for k, v in os.environ.items() if not k.startswith("LMPREFETCH_")}
    return subprocess.run(
        [*CLI, *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
        env={**inherited, **(env or {})},
    )


def assert_one_line_exit_2(out: subprocess.CompletedProcess[str], *names: str) -> None:
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2, out.stderr
    assert len(lines) == 1, out.stderr
    assert "Traceback" not in out.stderr
    for name in names:
        assert name in lines[0], (name, lines[0])
    assert out.stdout == ""  # it never said it was serving
    assert any(p.fullmatch(lines[0]) for p in documented_messages()), (
        f"not explained in docs/troubleshooting.md: {lines[0]}"
    )


@pytest.fixture
def toml(tmp_path: Path) -> Callable[[str], str]:
    def write(text: str) -> str:
        path = tmp_path / f"{uuid.uuid4().hex[:8]}.toml"
        path.write_text(text)
        return str(path)

    return write


@pytest.fixture
def busy_tcp_port() -> Iterator[int]:
    """A loopback TCP port this test holds open (so binding it fails)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        yield s.getsockname()[1]


def test_missing_config_file(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.toml")
    assert_one_line_exit_2(run(worker_args("--config", missing)), missing, "not found")


def test_directory_given_as_config(tmp_path: Path) -> None:
    assert_one_line_exit_2(run(worker_args("--config", str(tmp_path))), "directory")


def test_config_file_that_is_not_toml(toml: Callable[[str], str]) -> None:
    path = toml("chunk_size = = 3\n")
    assert_one_line_exit_2(run(worker_args("--config", path)), path, "TOML")


def test_disk_path_that_is_a_file(tmp_path: Path, toml: Callable[[str], str]) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    path = toml(f'disk_path = "{a_file}"\nchunk_bytes = 4096\ncpu_bytes = 65536\n')
    assert_one_line_exit_2(run(worker_args("--config", path)), "disk_path", "not a directory")


@pytest.mark.parametrize(
    ("disk_path", "problem"),
    [("/proc", "not writable"), ("/proc/lmprefetch-cannot-exist", "cannot create")],
)
def test_disk_path_that_cannot_be_written(
    disk_path: str, problem: str, toml: Callable[[str], str]
) -> None:
    # /proc refuses new files and directories even to root, who ignores permission bits.
    path = toml(f'disk_path = "{disk_path}"\nchunk_bytes = 4096\ncpu_bytes = 65536\n')
    assert_one_line_exit_2(run(worker_args("--config", path)), "disk_path", problem)


def test_metrics_port_out_of_range() -> None:
    assert_one_line_exit_2(run(worker_args("--metrics-port", "70000")), "--metrics-port")


def test_metrics_port_in_use(busy_tcp_port: int) -> None:
    out = run(worker_args("--metrics-port", str(busy_tcp_port)))
    assert_one_line_exit_2(out, "--metrics-port", str(busy_tcp_port), "in use")


def test_metrics_host_that_does_not_resolve() -> None:
    # .invalid never resolves (RFC 6761); it was reported as a problem of --metrics-port.
    out = run(worker_args("--metrics-port", "0", "--metrics-host", "lmprefetch.invalid"))
    assert_one_line_exit_2(out, "--metrics-host", "lmprefetch.invalid", "cannot resolve")


def test_metrics_host_that_is_not_an_address_of_this_machine() -> None:
    # 192.0.2.1 (TEST-NET-1, RFC 5737) is assigned to no machine; the bind fails, nothing is sent.
    out = run(worker_args("--metrics-port", "0", "--metrics-host", "192.0.2.1"))
    assert_one_line_exit_2(out, "--metrics-host", "192.0.2.1", "address of this machine")
    assert "--metrics-port" not in out.stderr


def test_metrics_host_without_metrics_port_is_not_ignored() -> None:
    out = run(worker_args("--metrics-host", "0.0.0.0"))
    assert_one_line_exit_2(out, "--metrics-host", "--metrics-port")


def test_request_endpoint_already_bound() -> None:
    endpoint = ipc()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    holder = ctx.socket(zmq.PULL)
    holder.linger = 0
    holder.bind(endpoint)
    try:
        out = run(["worker", "--request-endpoint", endpoint, "--response-endpoint", ipc()])
    finally:
        holder.close()
        ctx.term()
    assert_one_line_exit_2(out, "--request-endpoint", endpoint, "in use")


def test_bad_endpoint_names_the_option() -> None:
    out = run(["worker", "--request-endpoint", "http://x", "--response-endpoint", ipc()])
    assert_one_line_exit_2(out, "--request-endpoint", "http://x")


def test_bad_events_endpoint_names_the_option() -> None:
    out = run(worker_args("--events-endpoint", "udp://127.0.0.1:5557"))
    assert_one_line_exit_2(out, "--events-endpoint", "udp://127.0.0.1:5557")


def test_events_endpoint_in_use(busy_tcp_port: int) -> None:
    endpoint = f"tcp://127.0.0.1:{busy_tcp_port}"
    out = run(worker_args("--events-endpoint", endpoint))
    assert_one_line_exit_2(out, "--events-endpoint", endpoint, "in use")


def test_events_endpoint_with_events_off() -> None:
    out = run(
        worker_args("--events-endpoint", "tcp://127.0.0.1:0"), env={"LMPREFETCH_KV_EVENTS": "0"}
    )
    assert_one_line_exit_2(out, "--events-endpoint", "kv_events")


@pytest.mark.parametrize(
    ("module", "setting", "names"),
    [
        ("redis", 'redis_url = "redis://127.0.0.1:1"\n', ("redis_url", "lmprefetch[redis]")),
        # Was a 34-line traceback ending in ModuleNotFoundError.
        ("torch", 'buffer_backend = "torch"\ncpu_bytes = 1048576\nchunk_bytes = 4096\n',
         ("buffer_backend", "lmprefetch[torch]")),
    ],
    ids=["redis_url", "buffer_backend"],
)  # fmt: skip
def test_a_setting_without_its_extra_names_the_extra(
    module: str, setting: str, names: tuple[str, ...], toml: Callable[[str], str]
) -> None:
    """Simulate an install without the extra: the import fails, the message names it."""
    runner = (
        f"import sys\nsys.modules[{module!r}] = None  # as if the extra were not installed\n"
        "from lmprefetch.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", runner, *worker_args("--config", toml(setting))],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )
    assert_one_line_exit_2(out, *names)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("cpu_bytes", "99999999999999999999"),
        ("cpu_bytes", str(1 << 47)),  # valid in general, more than this machine has
        ("chunk_size", str(1 << 40)),
        ("socket_hwm", str(1 << 40)),
        ("claim_ttl_s", "inf"),
    ],
)
def test_sizes_too_large_name_the_field(field: str, value: str, toml: Callable[[str], str]) -> None:
    path = toml(f"{field} = {value}\n")
    assert_one_line_exit_2(run(worker_args("--config", path)), field)


@pytest.mark.parametrize("with_config", [False, True], ids=["environment", "--config"])
def test_unknown_environment_variable_is_rejected(
    with_config: bool, toml: Callable[[str], str]
) -> None:
    """With --config too: a misspelt variable was silently ignored there."""
    args = worker_args("--config", toml("chunk_size = 4\n")) if with_config else worker_args()
    out = run(args, env={"LMPREFETCH_CHUNK_SIZ": "16"})
    assert_one_line_exit_2(out, "LMPREFETCH_CHUNK_SIZ", "did you mean LMPREFETCH_CHUNK_SIZE?")


def test_variables_override_the_config_file(toml: Callable[[str], str]) -> None:
    path = toml("kv_events = true\nchunk_size = 4\n")
    out = run(
        worker_args("--config", path, "--events-endpoint", "tcp://127.0.0.1:0"),
        env={"LMPREFETCH_KV_EVENTS": "false"},
    )
    assert_one_line_exit_2(out, "--events-endpoint", "kv_events = false")


@pytest.mark.parametrize("with_config", [False, True], ids=["environment", "--config"])
def test_a_bad_variable_names_the_field_and_the_variable(
    with_config: bool, toml: Callable[[str], str]
) -> None:
    args = worker_args("--config", toml("chunk_size = 4\n")) if with_config else worker_args()
    out = run(args, env={"LMPREFETCH_CHUNK_SIZE": "big"})
    assert_one_line_exit_2(out, "chunk_size: expected int", "(from LMPREFETCH_CHUNK_SIZE)")
    out = run(args, env={"LMPREFETCH_CLAIM_TTL_S": "-1"})
    assert_one_line_exit_2(out, "claim_ttl_s: must be", "(from LMPREFETCH_CLAIM_TTL_S)")


def test_an_unknown_key_in_the_file_gets_a_suggestion(toml: Callable[[str], str]) -> None:
    path = toml("chunk_sise = 4\n")
    out = run(worker_args("--config", path))
    expected = "chunk_sise: unknown PrefetchConfig field; did you mean 'chunk_size'?"
    assert_one_line_exit_2(out, f"{expected} (in {path})")


@pytest.mark.parametrize(
    ("args", "name"),
    [
        (["--world-size", "0"], "--world-size"),
        (["--world-size", "2", "--rank", "2"], "--rank"),
        (["--rank", "-1"], "--rank"),
        (["--rank", "x"], "--rank"),
        (["--metrics-port", "many"], "--metrics-port"),
    ],
)
def test_bad_options_name_the_option(args: list[str], name: str) -> None:
    assert_one_line_exit_2(run(worker_args(*args)), name)


def test_missing_required_options() -> None:
    assert_one_line_exit_2(run(["worker"]), "--request-endpoint")


# -- codecs and encryption (lmprefetch.codec) --------------------------------------------------
@pytest.mark.parametrize(
    ("setting", "words"),
    [
        ('disk_codec = "zip"', ["disk_codec", "must be one of", "bitround<N>"]),
        ('redis_codec = "int8"\nkv_dtype = "int8"', ["redis_codec", "floating-point kv_dtype"]),
        ('mooncake_codec = "bitround7"', ["mooncake_codec", "N from 1 to 6"]),
        ('disk_codec = "int4"\ncodec_group = 63', ["codec_group", "int4", "even, got 63"]),
        ("codec_group = 0", ["codec_group"]),
    ],
)
def test_a_bad_codec_setting_names_the_field(
    setting: str, words: list[str], toml: Callable[[str], str]
) -> None:
    assert_one_line_exit_2(run(worker_args("--config", toml(setting + "\n"))), *words)


def test_a_missing_or_short_key_file_stops_the_start(
    tmp_path: Path, toml: Callable[[str], str]
) -> None:
    missing = tmp_path / "no-such-key"
    out = run(worker_args("--config", toml(f'encryption_key_file = "{missing}"\n')))
    assert_one_line_exit_2(out, "encryption_key_file", str(missing), "not found")
    short = tmp_path / "short-key"
    short.write_bytes(b"0123456789")
    out = run(worker_args(), env={"LMPREFETCH_ENCRYPTION_KEY_FILE": str(short)})
    assert_one_line_exit_2(out, "encryption_key_file", "holds 10 bytes", "LMPREFETCH_")


def test_a_codec_without_its_libraries_says_what_to_install(
    tmp_path: Path, toml: Callable[[str], str]
) -> None:
    script = tmp_path / "no_zstd.py"
    script.write_text(
        "import sys, importlib.util\n"
        "real = importlib.util.find_spec\n"
        "importlib.util.find_spec = lambda n, *a: None if n == 'zstandard' else real(n, *a)\n"
        "from lmprefetch.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    path = toml('disk_codec = "lossless"\n')
    out = subprocess.run(
        [sys.executable, str(script), *worker_args("--config", path)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert_one_line_exit_2(out, "disk_codec", "zstandard", "lmprefetch[codecs]")
