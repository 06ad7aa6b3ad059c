"""How README's test command runs the suite (pyproject's addopts): on two pytest-xdist workers,
each taking whole files, with the slow tier (``@pytest.mark.slow``) left out; and every test of
that tier named in docs/TESTS.md's list with why and what faster test covers its feature, so a
test is never moved out of the default run unsaid.

The slow tests are found in the source (ast), as written: a test function decorated with
``pytest.mark.slow`` or a module-level name bound to it, or a parametrize case with it in
``marks=``."""

from __future__ import annotations

import ast
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SECTION = "## Two workers and the slow tier"


def _is_slow(node: ast.expr, aliases: set[str]) -> bool:
    """``node`` is pytest.mark.slow, or a name bound to it at module level."""
    return (isinstance(node, ast.Name) and node.id in aliases) or (
        isinstance(node, ast.Attribute) and node.attr == "slow"
        and isinstance(node.value, ast.Attribute) and node.value.attr == "mark")


def _marks_slow(decorator: ast.expr, aliases: set[str]) -> bool:
    """The decorator marks the test (or one of its parametrize cases) slow."""
    if _is_slow(decorator, aliases):
        return True
    return any(isinstance(kw.value, (ast.Name, ast.Attribute, ast.List, ast.Tuple))
               and any(_is_slow(m, aliases) for m in ast.walk(kw.value) if isinstance(m, ast.expr))
               for call in ast.walk(decorator) if isinstance(call, ast.Call)
               for kw in call.keywords if kw.arg == "marks")


def slow_tests() -> set[str]:
    """``tests/<file>::<function>`` of every test marked slow (wholly or in some cases)."""
    found = set()
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        tree = ast.parse(path.read_text())
        aliases = {t.id for node in tree.body if isinstance(node, ast.Assign)
                   and _is_slow(node.value, set()) for t in node.targets if isinstance(t, ast.Name)}
        for node in ast.walk(tree):
            if (isinstance(node, ast.FunctionDef) and node.name.startswith("test")
                    and any(_marks_slow(d, aliases) for d in node.decorator_list)):
                found.add(f"{path.relative_to(ROOT).as_posix()}::{node.name}")
    return found


def _addopts() -> list[str]:
    tomllib = pytest.importorskip("tomllib", reason="Python 3.11's tomllib")
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return shlex.split(config["tool"]["pytest"]["ini_options"]["addopts"])


def test_readme_command_runs_on_two_workers_without_the_slow_tier() -> None:
    tomllib = pytest.importorskip("tomllib", reason="Python 3.11's tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    opts = _addopts()
    assert opts[opts.index("-n") + 1] == "2" and opts[opts.index("--dist") + 1] == "loadfile", opts
    assert opts[opts.index("-m") + 1] == "not slow" and "--durations=25" in opts, opts
    assert any(d.startswith("pytest-xdist") for d in project["project"]["optional-dependencies"]["test"])
    markers = project["tool"]["pytest"]["ini_options"]["markers"]
    assert any(m.startswith("slow:") for m in markers), markers


def test_every_slow_test_is_listed_in_tests_md_with_why() -> None:
    page = (ROOT / "docs" / "TESTS.md").read_text()
    assert SECTION in page, f"docs/TESTS.md has no {SECTION!r} section"
    section = page.split(SECTION, 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(tests/[^`]+?::\w+)[^`]*` \| ([^|]+) \| ([^|]+) \|$", section, re.M)
    listed = {name for name, _, _ in rows}
    found = slow_tests()
    assert found, "no test is marked slow: the slow tier's section and this test go too"
    assert found <= listed, f"marked slow, not listed in docs/TESTS.md: {sorted(found - listed)}"
    assert listed <= found, f"listed in docs/TESTS.md, not marked slow: {sorted(listed - found)}"
    assert all(why.strip() and covered.strip() for _, why, covered in rows), rows


def test_the_finder_sees_each_way_of_marking() -> None:
    """A decorator, an alias of the mark, and a parametrize case's ``marks=``."""
    source = ("import pytest\nSLOW = pytest.mark.slow\n"
              "@pytest.mark.slow\ndef test_a(): pass\n"
              "@SLOW\ndef test_b(): pass\n"
              "@pytest.mark.parametrize('x', [1, pytest.param(2, marks=SLOW)])\ndef test_c(x): pass\n"
              "@pytest.mark.parametrize('x', [1, 2])\ndef test_d(x): pass\n")
    tree = ast.parse(source)
    aliases = {"SLOW"}
    marked = [f.name for f in tree.body if isinstance(f, ast.FunctionDef)
              and any(_marks_slow(d, aliases) for d in f.decorator_list)]
    assert marked == ["test_a", "test_b", "test_c"]
