"""The linter's rules (pyproject.toml, [tool.ruff]) hold on the package, the examples, the tests
and the benchmarks, and the type checker's ([tool.mypy]) on the package: a change that breaks
one (an unused import, a blind except without its note, a line over the limit, a call with the
wrong type, an unannotated function) fails here. The type checker does not read tests/ and
benchmarks/ (their helpers are not annotated throughout)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


LINTED = ("ckptio", "examples", "tests", "benchmarks")


def test_ruff_passes_on_the_package_tests_and_benchmarks() -> None:
    if importlib.util.find_spec("ruff") is None:
        pytest.skip("ruff is not installed (the test extra installs it)")
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", *LINTED],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_mypy_passes_on_the_package() -> None:
    if importlib.util.find_spec("mypy") is None:
        pytest.skip("mypy is not installed (the test extra installs it)")
    done = subprocess.run([sys.executable, "-m", "mypy", "--no-incremental"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-2000:]
