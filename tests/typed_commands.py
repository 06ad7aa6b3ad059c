"""The commands the documentation tells a reader to type, and how they are run as typed:
shared by tests/test_examples.py (each example's docstring commands) and
tests/test_doc_commands.py (the shell lines of README.md and docs/, and the count of those not
run here).

Collected: each example's docstring lines indented four spaces, and the lines of ```bash,
```sh and ```console blocks, split at ``&&``, that start with python, python3, torchrun,
ckptio or .venv/...; and the README's inline ``.venv/...`` commands. A case runs its commands
verbatim through bash, each in a fresh process with a deadline, in a reader's directory (links
to the checkout's examples/, tests/ and pyproject.toml, and to the running venv as .venv/),
with the user's environment only: PATH led by that venv's bin/, HOME, TMPDIR (the test's),
LANG, and PYTHONPATH as the test was given it (a checkout under test); no CKPTIO_*, AWS_* or
test variables. /tmp paths a command names that did not exist before are removed after it.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
VENV = Path(sys.prefix)
SHELL = re.compile(r"^```(?:bash|sh|console|shell)\n(.*?)^```", re.S | re.M)
TYPED = re.compile(r"(?:python3?|torchrun|ckptio|\.venv/\S+)(?:\s|$)")


def _shell_lines(block: str) -> Iterator[str]:
    """The commands of a shell block: continuation lines joined, a ``$ `` prompt dropped,
    ``&&`` chains split into their commands."""
    for line in block.replace("\\\n", " ").splitlines():
        line = line.strip().removeprefix("$ ")
        for part in re.split(r"\s+&&\s+", line):
            if TYPED.match(part):
                yield part


def docstring_commands(script: Path) -> list[str]:
    """The commands in ``script``'s docstring (lines indented four spaces), as written."""
    doc = ast.get_docstring(ast.parse(script.read_text())) or ""
    return [line.strip() for line in doc.splitlines()
            if line.startswith("    ") and TYPED.match(line.strip())]


def documented() -> dict[str, str]:
    """Every documented command -> where it is documented (the first place)."""
    found: dict[str, str] = {}
    for script in sorted((ROOT / "examples").glob("*.py")):
        for command in docstring_commands(script):
            found.setdefault(command, str(script.relative_to(ROOT)))
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for block in SHELL.findall(page.read_text()):
            for command in _shell_lines(block):
                found.setdefault(command, str(page.relative_to(ROOT)))
    for inline in re.findall(r"`(\.venv/[^`]+)`", (ROOT / "README.md").read_text()):
        found.setdefault(inline, "README.md")
    return found


Setup = Callable[[Path, dict[str, str]], None]


@dataclass(frozen=True)
class Case:
    """Commands run in order in one reader's directory, each with a pattern its output must
    match; ``setup`` makes what the page assumes exists, ``after(here, env, i)`` runs after
    command i (for a page that interleaves Python), ``check`` looks at the results."""

    commands: tuple[tuple[str, str], ...]
    needs: tuple[str, ...] = ()  # modules, "cuda", "weed"
    setup: Setup | None = None
    after: Callable[[Path, dict[str, str], int], None] | None = None
    check: Callable[[Path], None] | None = None
    timeout: float = 240
    s3: bool = False  # run against a local SeaweedFS, its AWS_* variables exported


def missing(needs: tuple[str, ...]) -> str | None:
    """Why a case cannot run here, or None."""
    for need in needs:
        if need == "cuda":
            if not torch.cuda.is_available():
                return "needs a CUDA device"
        elif need == "weed":
            from ckptio.testing.s3server import ServerError, weed_binary
            try:
                weed_binary()
            except ServerError as exc:
                return f"needs the weed binary: {exc}"
        elif importlib.util.find_spec(need) is None:
            return f"needs {need} (its extra)"
    return None


def user_env(tmp: Path) -> dict[str, str]:
    env = {"PATH": f"{VENV / 'bin'}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}",
           "HOME": os.environ.get("HOME", str(tmp)), "TMPDIR": str(tmp), "LANG": "C.UTF-8"}
    if os.environ.get("PYTHONPATH"):  # a checkout under test that is not the installed one
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    return env


def reader_dir(tmp: Path) -> Path:
    """A reader's directory: the checkout's examples/, tests/ and pyproject.toml, and .venv."""
    work = tmp / "work"
    work.mkdir()
    for name in ("examples", "tests", "pyproject.toml"):
        (work / name).symlink_to(ROOT / name)
    (work / ".venv").symlink_to(VENV)
    return work


def typed(command: str, here: Path, env: dict[str, str], timeout: float) -> str:
    """Run ``command`` through bash -> its output; its process group is killed at the deadline."""
    proc = subprocess.Popen(["bash", "-c", command], cwd=here, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{command!r} ran over {timeout} s:\n{out[-3000:]}")
    assert proc.returncode == 0, f"{command!r} exited {proc.returncode}:\n{out[-4000:]}"
    return out


def run_case(case: Case, tmp: Path) -> list[str]:
    """Run ``case`` as a reader would (module docstring) -> each command's output."""
    if (why := missing(case.needs)) is not None:
        pytest.skip(why)
    here, env = reader_dir(tmp), user_env(tmp)
    made = sorted({p for c, _ in case.commands for p in re.findall(r"/tmp/[\w.-]+", c)
                   if not os.path.exists(p)})
    try:
        if not case.s3:
            return _commands(case, here, env)
        from ckptio.testing.s3server import SeaweedServer

        with SeaweedServer(tmp / "weed", bucket="other") as server:
            return _commands(case, here, {**env, **server.env()})
    finally:
        for path in made:
            shutil.rmtree(path, ignore_errors=True)


def _commands(case: Case, here: Path, env: dict[str, str]) -> list[str]:
    if case.setup is not None:
        case.setup(here, env)
    outs = []
    for i, (command, expect) in enumerate(case.commands):
        out = typed(command, here, env, case.timeout)
        assert re.search(expect, out), f"{command!r}: no {expect!r} in\n{out[-3000:]}"
        outs.append(out)
        if case.after is not None:
            case.after(here, env, i)
    if case.check is not None:
        case.check(here)
    return outs
