"""The structure checks of tests/structure.py: no private-member reach across objects, no
import circle (tests/test_layers.py asserts the circles with the layers), no recursive closure,
one owner of byte geometry (ckptio/alignment.py), allow-lists naming only what is there, and the
command that prints the counts. Then the checker itself, on made-up packages."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.structure import (
    CIRCLES_TO_VANISH,
    PACKAGE,
    REACHES_TO_VANISH,
    ROOT,
    THIRD_PARTY,
    Reach,
    circles,
    duplicate_names,
    forget,
    main,
    package_modules,
    parse,
    reaches,
    unexpected,
)
from tests.structure_trees import (
    FOLDERS,
    every_reach,
    listed_but_gone,
    tree_reaches,
    unexpected_in,
)


@pytest.fixture(scope="module", autouse=True)
def _parsed_once() -> Iterator[None]:
    """The sources are parsed once for this module's tests (tests/structure.py parse) and the
    trees dropped after them."""
    yield
    forget()


@pytest.fixture(scope="module")
def package_reaches() -> list[Reach]:
    """reaches() of the package, found once for the three tests that read it."""
    return reaches()


@pytest.fixture(scope="module")
def outside_reaches() -> list[Reach]:
    """every_reach() of benchmarks/ and tests/, found once for the two tests that read it."""
    return every_reach()


def test_no_private_member_reach_across_objects(package_reaches):
    found = [f"{r.module}:{r.line} {r.text}" + (" (a private name of another library: list it "
                                                "in THIRD_PARTY with why)" if r.third_party else "")
             for r in unexpected(package_reaches)]
    assert not found, ("private members reached across objects (use a public method or a "
                       "Protocol beside the class):\n  " + "\n  ".join(found))


def test_the_allow_lists_name_only_what_is_there(package_reaches):
    """An entry whose reach or circle is gone is removed from its list (tests/structure.py)."""
    found = package_reaches
    gone = sorted(REACHES_TO_VANISH - {r.key for r in found})
    gone += sorted(set(THIRD_PARTY) - {r.text for r in found})
    members = {c.members for c in circles()}
    gone += sorted(" <-> ".join(sorted(c)) for c in CIRCLES_TO_VANISH - members)
    assert not gone, ("no longer found, remove (or, if only moved, update) in "
                      "tests/structure.py's lists:\n  "
                      + "\n  ".join(gone))


def test_the_command_prints_the_counts_and_lists_them(package_reaches):
    run = subprocess.run([sys.executable, "-m", "tests.structure"], cwd=ROOT, text=True,
                         capture_output=True, timeout=120, check=False)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    ours = [r for r in package_reaches if not r.third_party]
    assert lines[0] == f"private-member reaches across objects: {len(ours)}"
    assert lines[-1] == "beyond the allow-lists: 0 reaches, 0 circles, 0 repeated file names"
    assert "module file names that repeat: 0" in lines
    assert f"import circles: {len(circles())}" in lines
    assert all(f"{r.module}:{r.line} {r.text}" in run.stdout for r in ours)


# ------------------------------------------------------------------------------------------------
# the checker itself


def _package(root: Path, files: dict[str, str]) -> Path:
    pkg = root / "ckptio"
    for rel, text in {"__init__.py": "", **files}.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    for folder in {p.parent for p in pkg.rglob("*.py")}:
        (folder / "__init__.py").touch()
    return pkg


def test_a_reach_is_told_from_the_objects_own_access(tmp_path):
    pkg = _package(tmp_path, {
        "job.py": ("import threading\n"
                   "class Job:\n"
                   "    _kind = 'x'\n"
                   "    def __init__(self):\n"
                   "        self._done = threading.Event()\n"
                   "        self._done.set()\n"  # its own: no reach
                   "    def _finish(self):\n"
                   "        super()._finish()\n"  # its own: no reach
                   "    @classmethod\n"
                   "    def made(cls, other):\n"
                   "        job = cls()\n"
                   "        job._done.set()\n"  # another instance of the class: a reach
                   "        return cls._kind\n"),
        "use/runner.py": ("import threading, collections\n"
                          "from torch.distributed.tensor._utils import f\n"
                          "def run(job, point):\n"
                          "    job._finish()\n"  # a reach
                          "    point._replace(x=1)\n"  # namedtuple's, public
                          "    threading._register_atexit(run)\n"  # another library's
                          "    job.__class__\n"
                          "    socket._GLOBAL_DEFAULT_TIMEOUT\n"),  # another library's, unlisted
    })
    found = {(r.module, r.text, r.third_party) for r in reaches(pkg)}
    assert found == {("ckptio.job", "job._done", False),
                     ("ckptio.use.runner", "job._finish", False),
                     ("ckptio.use.runner", "threading._register_atexit", True),
                     ("ckptio.use.runner", "torch.distributed.tensor._utils", True),
                     ("ckptio.use.runner", "socket._GLOBAL_DEFAULT_TIMEOUT", True)}
    assert {r.text for r in unexpected(reaches(pkg))} == {"job._done", "job._finish",
                                                          "socket._GLOBAL_DEFAULT_TIMEOUT"}
    assert main([str(pkg)]) == 1


def test_circles_count_every_import_between_modules_and_sub_packages(tmp_path):
    pkg = _package(tmp_path, {
        "a.py": "def f():\n    from ckptio import b\n",
        "b.py": ("from typing import TYPE_CHECKING\n"
                 "if TYPE_CHECKING:\n    from ckptio.a import f\n"),
        "p/x.py": "from ckptio.q.y import g\n",
        "q/y.py": "g = 1\n",
        "q/z.py": "from ckptio.p.w import h\n",
        "p/w.py": "h = 2\n",
    })
    found = sorted(sorted(c.members) for c in circles(pkg))
    assert found == [["ckptio.a", "ckptio.b"], ["ckptio.p", "ckptio.q"]], found
    texts = [c.text for c in circles(pkg)]
    assert "modules ckptio.a, ckptio.b: import cycle: ckptio.a imports ckptio.b (line 2), which " \
           "ckptio.b imports ckptio.a (line 3)" in texts, texts
    assert any(t.startswith("sub-packages ckptio.p, ckptio.q: import cycle: ckptio.p imports "
                            "ckptio.q") for t in texts), texts


def test_a_circle_is_every_module_of_its_component(tmp_path):
    """Three modules in one knot are one circle of three, even where a shorter cycle runs
    through two of them (an allow-list naming two does not cover the third)."""
    pkg = _package(tmp_path, {"a.py": "import ckptio.b\nimport ckptio.c\n",
                              "b.py": "import ckptio.a\n", "c.py": "import ckptio.a\n"})
    (circle,) = circles(pkg)
    assert circle.members == {"ckptio.a", "ckptio.b", "ckptio.c"}


def test_the_command_fails_on_a_reach_or_a_circle(tmp_path, capsys):
    pkg = _package(tmp_path, {"a.py": "import ckptio.b\n", "b.py": "import ckptio.a\n"})
    assert main([str(pkg)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "private-member reaches across objects: 0"
    assert out[-1] == "beyond the allow-lists: 0 reaches, 1 circles, 0 repeated file names"
    clean = _package(tmp_path / "clean", {"a.py": "import ckptio.b\n", "b.py": "x = 1\n"})
    assert main([str(clean)]) == 0


def test_a_repeated_module_file_name_is_named_and_fails(tmp_path, capsys):
    pkg = _package(tmp_path, {"io/base.py": "x = 1\n", "storage/base.py": "y = 2\n",
                              "io/__main__.py": "", "storage/__main__.py": ""})
    assert duplicate_names(pkg) == [f"base.py: {Path('ckptio/io/base.py')}, "
                                    f"{Path('ckptio/storage/base.py')}"]
    assert main([str(pkg)]) == 1
    assert capsys.readouterr().out.splitlines()[-1] == (
        "beyond the allow-lists: 0 reaches, 0 circles, 1 repeated file names")


def test_a_file_is_parsed_once_per_text(tmp_path):
    """tests/structure.py parse: the same text gives the same tree (the structure and layer
    tests share it), a changed file its new tree."""
    path = tmp_path / "m.py"
    path.write_text("A = 1\n")
    first = parse(path)
    assert parse(path) is first
    path.write_text("B = 2\n")
    assert ast.unparse(parse(path)) == "B = 2"


def test_no_module_file_name_repeats_in_the_package():
    assert duplicate_names() == [], "one name, one module: rename one of each pair"


def _recursive_closures(tree: ast.Module) -> list[tuple[str, int]]:
    """(name, line) of each function defined inside another function's body (not a method of a
    class there) that calls itself by name: its cell refers back to it, a reference cycle."""
    found = []
    for outer in ast.walk(tree):
        if not isinstance(outer, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for inner in outer.body:
            if isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(
                    isinstance(n, ast.Name) and n.id == inner.name for n in ast.walk(inner)):
                found.append((inner.name, inner.lineno))
    return found


def test_no_recursive_closure_in_the_package():
    """A recursive nested function keeps everything it closes over in a reference cycle until a
    garbage collection: a load's walk held the state, its device mesh and WORLD past
    destroy_process_group (tests/test_exit.py). Recursion lives in module-level functions or
    objects. The finder finds one, too."""
    planted = ast.parse("def f(x):\n    def walk(n):\n        return walk(n - 1) if n else x\n"
                        "    return walk(3)\n")
    assert _recursive_closures(planted) == [("walk", 2)]
    found = {f"{path}:{line} {name}" for path in sorted(PACKAGE.rglob("*.py"))
             for name, line in _recursive_closures(parse(path))}
    assert not found, found


# ------------------------------------------------------------------------------------------------
# one owner of byte geometry

GEOMETRY_OWNER = "ckptio.alignment"  # BLOCK, SMALL_ALIGN, align_up/down, padding, is_aligned
GEOMETRY_NAMES = {"BLOCK", "ALIGN"}  # defined by the owner only
# Module-level constants whose value holds 4096 without being the block size, each with why:
# (module, name) -> reason. Every other 4096 in ckptio is the block size: ask the owner.
NOT_GEOMETRY: dict[tuple[str, str], str] = {
    ("ckptio.format.torchzip", "HEAD_NBYTES"): "a torch item's zip records before data/0 fit",
    ("ckptio.format.torchzip", "TAIL_NBYTES"): "a torch item's records after its data fit",
    ("ckptio.storage.holder", "RECORD_MAX_NBYTES"): "the bound of a lock holder's JSON record",
    ("ckptio.storage.s3.objects", "SEEN_MAX"): "a count of names remembered",
    ("ckptio.io.buffers", "MAX_KEPT_VIEWS"): "a count of views kept per buffer",
    ("ckptio.tuning.state", "WIDTHS"): "model widths of the synthetic state",
    ("ckptio.demo.train", "KILL_NOTE_BYTES"): "the size of the demo's kill note",
}


def _allowed_constants(module: str, tree: ast.Module) -> tuple[set[int], set[str]]:
    """ids of the nodes inside the values of ``module``'s NOT_GEOMETRY constants, and their names."""
    nodes, names = set(), set()
    for stmt in tree.body:
        targets = stmt.targets if isinstance(stmt, ast.Assign) else (
            [stmt.target] if isinstance(stmt, ast.AnnAssign) and stmt.value is not None else [])
        for target in targets:
            if isinstance(target, ast.Name) and (module, target.id) in NOT_GEOMETRY:
                names.add(target.id)
                nodes.update(id(n) for n in ast.walk(stmt.value))  # type: ignore[arg-type]
    return nodes, names


def _is_block_literal(node: ast.AST) -> bool:
    """4096, or a shift of two integers that makes it (1 << 12, 4 << 10)."""
    if isinstance(node, ast.Constant):
        return type(node.value) is int and node.value == 4096
    return (isinstance(node, ast.BinOp) and isinstance(node.op, ast.LShift)
            and all(isinstance(n, ast.Constant) and type(n.value) is int
                    for n in (node.left, node.right))
            and node.left.value << node.right.value == 4096)  # type: ignore[attr-defined]


def _is_rounding(node: ast.AST) -> bool:
    """``x // n * n`` or ``-(-x // n) * n``: a value rounded to a multiple by hand."""
    if not (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult)):
        return False
    for part, n in ((node.left, node.right), (node.right, node.left)):
        if isinstance(part, ast.UnaryOp) and isinstance(part.op, ast.USub):
            part = part.operand
        if (isinstance(part, ast.BinOp) and isinstance(part.op, ast.FloorDiv)
                and ast.dump(part.right) == ast.dump(n)):
            return True
    return False


def geometry_breaches(module: str, tree: ast.Module) -> list[tuple[int, str]]:
    """(line, what) of each place ``module`` does byte geometry itself instead of asking
    GEOMETRY_OWNER: a literal block size, its own BLOCK or ALIGN, arithmetic on BLOCK (% or //),
    or a hand-written rounding to a multiple."""
    if module == GEOMETRY_OWNER:
        return []
    allowed, _ = _allowed_constants(module, tree)
    found = []
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if _is_block_literal(node) and id(node) not in allowed:
            found.append((line, "a literal 4096: use BLOCK (or list a constant that is no "
                                "block size in NOT_GEOMETRY with why)"))
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and node.id in GEOMETRY_NAMES:
            found.append((line, f"defines {node.id}: import BLOCK from {GEOMETRY_OWNER}"))
        elif (isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Mod, ast.FloorDiv))
              and isinstance(node.right, ast.Name) and node.right.id == "BLOCK"):
            found.append((line, "arithmetic on BLOCK: use is_aligned, padding, align_down or align_up"))
        elif _is_rounding(node):
            found.append((line, "a rounding to a multiple by hand: use align_up or align_down"))
    return sorted(found)


def test_one_owner_of_byte_geometry():
    """The block size, the alignment rule and every rounding on them live in ckptio/alignment.py;
    every other module asks it (issue 68). The finder finds each kind of breach, too."""
    planted = ast.parse("ALIGN = 4096\n"
                        "SHIFTED = 1 << 12\n"
                        "def f(n, BLOCK):\n"
                        "    if n % BLOCK:\n"
                        "        return (n + 7) // 8 * 8\n"
                        "    return -(-n // ALIGN) * ALIGN\n"
                        "HEAD_NBYTES = 4096\n")
    assert [line for line, _ in geometry_breaches("ckptio.x", planted)] == [1, 1, 2, 4, 5, 6, 7]
    assert len(geometry_breaches("ckptio.format.torchzip", planted)) == 6  # HEAD_NBYTES listed
    assert geometry_breaches(GEOMETRY_OWNER, planted) == []
    found = [f"{module}:{line} {what}" for module, path in package_modules().items()
             for line, what in geometry_breaches(module, parse(path))]
    assert not found, "byte geometry outside ckptio/alignment.py:\n  " + "\n  ".join(found)


def test_the_not_geometry_list_names_only_what_is_there():
    modules = package_modules()
    gone = sorted(f"{m}.{name}" for m, name in NOT_GEOMETRY
                  if m not in modules
                  or name not in _allowed_constants(m, parse(modules[m]))[1])
    assert not gone, f"no longer found, remove from NOT_GEOMETRY: {gone}"


# ------------------------------------------------------------------------------------------------
# benchmarks/ and tests/ (tests/structure_trees.py, its lists in tests/structure_lists.py)


def test_no_private_reach_in_benchmarks_or_tests_beyond_the_lists(outside_reaches):
    """benchmarks/ uses public API (BENCH_REACHES: what cannot, with why); a test reaches the
    privates of what it tests only as TEST_REACHES lists them, per module with why."""
    found = [f"{r.module}:{r.line} {r.text}" for r in unexpected_in(outside_reaches)]
    assert not found, ("private reaches (use public API, or list the reach in "
                       "tests/structure_lists.py with why):\n  " + "\n  ".join(found))


def test_the_outside_lists_name_only_what_is_there(outside_reaches):
    assert listed_but_gone(found=outside_reaches) == [], "remove from tests/structure_lists.py"


def test_a_new_reach_in_a_benchmark_or_a_test_is_found(tmp_path):
    """A private member or module-level name of ckptio or of another benchmark, taken from a
    benchmark or a test, is a reach; one of another library is its; a test's listed reach is
    allowed only in its own module."""
    _package(tmp_path, {"wire.py": "def _decide(x):\n    return x\nclass Solo:\n"
                                   "    def __init__(self):\n        self._published = {}\n"})
    for rel, text in {
            "benchmarks/__init__.py": "",
            "benchmarks/engines.py": "def _opts():\n    return 1\n",
            "benchmarks/scale.py": ("import os\nfrom ckptio import wire\n"
                                    "from benchmarks.engines import _opts\n"
                                    "def run(group):\n    os._exit(0)\n"
                                    "    return wire._decide(group._published), _opts()\n"),
            "tests/__init__.py": "",
            "tests/test_io_uring.py": "def test(backend):\n    backend._ring\n",
            "tests/test_other.py": "def test(backend):\n    backend._ring\n"}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    bench = {(r.text, r.third_party) for r in tree_reaches("benchmarks", tmp_path)}
    assert bench == {("benchmarks.engines._opts", False), ("wire._decide", False),
                     ("group._published", False), ("os._exit", True)}
    assert {r.text for r in unexpected_in(tree_reaches("benchmarks", tmp_path))} == {
        "benchmarks.engines._opts", "wire._decide", "group._published"}
    tests = unexpected_in(tree_reaches("tests", tmp_path))  # _ring: not a member here: theirs
    assert [(r.module, r.text) for r in tests] == [("tests.test_other", "backend._ring")]


def test_no_import_circle_in_benchmarks_or_tests():
    found = [c.text for f in FOLDERS for c in circles(ROOT / f)]
    assert not found, "import circles:\n  " + "\n  ".join(found)
