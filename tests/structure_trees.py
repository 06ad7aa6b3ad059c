"""The private reaches of the repository's benchmarks/ and tests/, read with ast as
tests/structure.py reads the package (nothing is imported), and their allow-lists.

    python -m tests.structure_trees      # from the repository root: counts, then each listed

A reach here is what it is in the package (``expr._name`` where ``_name`` is a private member
of a class of ckptio, benchmarks/ or tests/, ``expr`` not the object itself), and also a private
module-level name of one of our modules taken from outside it (``collective._decide``, ``from
benchmarks.engines import _torch_load``). A private name of another library is allowed as
tests/structure.py's THIRD_PARTY lists it.

benchmarks/ uses public API only; what cannot is in BENCH_REACHES with why. A test may reach the
privates of what it tests (a white-box check of a part no public call shows) only as listed in
TEST_REACHES: per test module, why, and each expression; a new reach, in a listed module or
not, fails tests/test_structure.py, and so does a listed one that is gone.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

from tests.structure import (
    NAMEDTUPLE,
    ROOT,
    THIRD_PARTY,
    Reach,
    is_own,
    is_private,
    package_modules,
    parse,
    private_members,
)
from tests.structure_lists import BENCH_REACHES, OUTSIDE_THIRD_PARTY, TEST_REACHES

__all__ = ["FOLDERS", "every_reach", "listed_but_gone", "main", "tree_reaches", "unexpected_in"]

FOLDERS = ("benchmarks", "tests")


def _tops(root: Path) -> set[str]:
    """The first parts of the modules that are ours: ckptio, benchmarks, tests, and what the
    tests import by their bare names (``from test_dcp_in import ...``, ``from s3.x import``)."""
    tests = root / "tests"
    return {"ckptio", *FOLDERS, *(p.stem for p in tests.glob("*.py")),
            *(p.name for p in tests.iterdir() if p.is_dir())}


def _module_privates(trees: list[ast.Module]) -> set[str]:
    """The private names our modules bind at their top level (functions, classes, constants)."""
    names: set[str] = set()
    for tree in trees:
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            targets = (node.targets if isinstance(node, ast.Assign) else
                       [node.target] if isinstance(node, ast.AnnAssign) else [])
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return {n for n in names if is_private(n)}


def _libraries(tree: ast.Module, tops: set[str]) -> set[str]:
    """The names a module binds to another library's modules (``import os``, ``from torch
    import distributed as dist``): a private attribute of one is that library's."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update((a.asname or a.name).split(".")[0] for a in node.names
                         if a.name.split(".")[0] not in tops)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] not in tops:
                names.update(a.asname or a.name for a in node.names)
    return names


def tree_reaches(folder: str, root: Path = ROOT) -> list[Reach]:
    """Every private reach in ``root/folder`` (benchmarks or tests), as the docstring says."""
    every = {**package_modules(root / "ckptio"),
             **{m: p for f in FOLDERS for m, p in package_modules(root / f).items()}}
    trees = {m: parse(p) for m, p in every.items()}
    return _reaches_in(folder, trees, _tops(root))


def _reaches_in(folder: str, trees: dict[str, ast.Module], tops: set[str]) -> list[Reach]:
    ours = private_members(trees.values()) | _module_privates(list(trees.values()))
    found: list[Reach] = []
    for module, tree in trees.items():
        if module.split(".")[0] != folder:
            continue
        libraries = _libraries(tree, tops)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and is_private(node.attr)
                    and not is_own(node.value) and node.attr not in NAMEDTUPLE):
                theirs = isinstance(node.value, ast.Name) and node.value.id in libraries
                found.append(Reach(module, node.lineno, ast.unparse(node),
                                   theirs or node.attr not in ours))
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                mine = node.module.split(".")[0] in tops
                if not mine and any(is_private(p) for p in node.module.split(".")):
                    found.append(Reach(module, node.lineno, node.module, True))
                else:
                    found += [Reach(module, node.lineno, f"{node.module}.{a.name}", not mine)
                              for a in node.names if is_private(a.name)]
    return sorted(found, key=lambda r: (r.module, r.line, r.text))


def _allowed(reach: Reach) -> bool:
    if reach.third_party and (reach.text in THIRD_PARTY or reach.text in OUTSIDE_THIRD_PARTY):
        return True
    if reach.module.startswith("tests."):
        return reach.text in TEST_REACHES.get(reach.module, ("", frozenset()))[1]
    return reach.key in BENCH_REACHES


def unexpected_in(found: list[Reach]) -> list[Reach]:
    """The reaches no allow-list allows."""
    return [r for r in found if not _allowed(r)]


def every_reach(root: Path = ROOT) -> list[Reach]:
    """tree_reaches of both folders, their sources read once."""
    every = {**package_modules(root / "ckptio"),
             **{m: p for f in FOLDERS for m, p in package_modules(root / f).items()}}
    trees = {m: parse(p) for m, p in every.items()}
    return [r for f in FOLDERS for r in _reaches_in(f, trees, _tops(root))]


def listed_but_gone(root: Path = ROOT, found: list[Reach] | None = None) -> list[str]:
    """Entries of BENCH_REACHES and TEST_REACHES that no longer occur (in ``found``, by default
    every_reach(root))."""
    found = every_reach(root) if found is None else found
    keys = {r.key for r in found}
    gone = sorted(k for k in BENCH_REACHES if k not in keys)
    gone += sorted(t for t in OUTSIDE_THIRD_PARTY if t not in {r.text for r in found})
    gone += sorted(f"{m}: {text}" for m, (_, texts) in TEST_REACHES.items() for text in texts
                   if f"{m}: {text}" not in keys)
    return gone


def main() -> int:
    bad = 0
    for folder in FOLDERS:
        found = tree_reaches(folder)
        wrong = unexpected_in(found)
        bad += len(wrong)
        print(f"{folder}: private reaches {len(found)}, beyond the allow-lists {len(wrong)}")
        for r in found:
            print(f"  {r.module}:{r.line} {r.text}"
                  + ("" if _allowed(r) else "  (NOT ALLOWED)")
                  + ("  (another library's)" if r.third_party else ""))
    gone = listed_but_gone()
    print(f"listed but gone: {len(gone)}", *(f"  {g}" for g in gone), sep="\n")
    return 1 if bad or gone else 0


if __name__ == "__main__":
    sys.exit(main())
