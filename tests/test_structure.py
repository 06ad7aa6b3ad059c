"""The structure checks of tests/structure.py: no private-member reach across objects, no
import circle (tests/test_layers.py asserts the circles with the layers), no recursive closure,
allow-lists naming only what is there, and the command that prints the counts. Then the checker itself, on
made-up packages."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from tests.structure import (
    CIRCLES_TO_VANISH,
    PACKAGE,
    REACHES_TO_VANISH,
    ROOT,
    THIRD_PARTY,
    circles,
    duplicate_names,
    main,
    reaches,
    unexpected,
)


def test_no_private_member_reach_across_objects():
    found = [f"{r.module}:{r.line} {r.text}" + (" (a private name of another library: list it "
                                                "in THIRD_PARTY with why)" if r.third_party else "")
             for r in unexpected(reaches())]
    assert not found, ("private members reached across objects (use a public method or a "
                       "Protocol beside the class):\n  " + "\n  ".join(found))


def test_the_allow_lists_name_only_what_is_there():
    """An entry whose reach or circle is gone is removed from its list (tests/structure.py)."""
    found = reaches()
    gone = sorted(REACHES_TO_VANISH - {r.key for r in found})
    gone += sorted(set(THIRD_PARTY) - {r.text for r in found})
    members = {c.members for c in circles()}
    gone += sorted(" <-> ".join(sorted(c)) for c in CIRCLES_TO_VANISH - members)
    assert not gone, ("no longer found, remove (or, if only moved, update) in "
                      "tests/structure.py's lists:\n  "
                      + "\n  ".join(gone))


def test_the_command_prints_the_counts_and_lists_them():
    run = subprocess.run([sys.executable, "-m", "tests.structure"], cwd=ROOT, text=True,
                         capture_output=True, timeout=120, check=False)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    ours = [r for r in reaches() if not r.third_party]
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
             for name, line in _recursive_closures(ast.parse(path.read_text()))}
    assert not found, found
