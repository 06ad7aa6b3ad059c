"""ckptio's structure, read from its source with ast (nothing of ckptio is imported): its
imports and their circles, the private-member reaches across objects, and module file names
that repeat (one name, one module: ``__init__.py``/``__main__.py`` excepted).

    python -m tests.structure        # from the repository root: counts, then each one listed

prints how many private-member reaches, import circles and repeated file names the package has
and lists them; its exit status is 0 when there is none beyond the allow-lists below (empty).
tests/test_layers.py checks the layers with the same reading of imports; tests/test_structure.py
asserts what this prints.

A private reach: ``expr._name`` where ``expr`` is not ``self``/``cls``/``super()`` and ``_name``
is a private member a ckptio class defines (``def _name`` or ``_name = ...`` in a class body,
``self._name = ...`` in a method). Accesses to another instance of the same class count too.
A private name of another library (``threading._register_atexit``) or taken from a private
module of one (``torch.distributed.tensor._utils``) is allowed only as listed in THIRD_PARTY,
with why; namedtuple's ``_make``/``_replace``/``_fields``/``_asdict`` are public API.
An import circle: modules that import each other through any chain of imports (module level,
inside functions and under TYPE_CHECKING alike), at module and at sub-package granularity.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CIRCLES_TO_VANISH", "NAMEDTUPLE", "PACKAGE", "REACHES_TO_VANISH", "ROOT",
           "THIRD_PARTY", "Circle", "Import", "Reach", "all_imports", "circles", "components",
           "cycles", "duplicate_names", "import_graph", "imports_of", "is_own", "is_private",
           "forget", "main", "package_modules", "parse", "private_members", "reaches", "report",
           "resolve", "runtime_graph", "show_cycle", "sub_package", "sub_package_graph",
           "unexpected", "walk_one"]

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "ckptio"
BENCHMARKS = "benchmarks"  # the repository's peer benchmarks, outside the package

# Private names of other libraries ckptio uses, each with why: expression -> reason (wherever
# in ckptio it occurs: modules move, the reason stays).
THIRD_PARTY: dict[str, str] = {
    "threading._register_atexit":
        "work that must end before threading joins non-daemon threads at exit (a save in "
        "flight finishes, pre-faulting and the liveness beat stop); atexit runs after that",
    "threading._shutdown":
        "what the interpreter's exit does before atexit (threading's exit hooks, then a join of "
        "every non-daemon thread): ckptio/testing/cli_process.py ends a command forked from a "
        "warm interpreter as python -m ckptio would end (tests only)",
    "atexit._run_exitfuncs":
        "the interpreter's atexit step, which a forked child ending with os._exit skips: "
        "ckptio/testing/cli_process.py runs it as python -m ckptio's exit would (tests only)",
    "c10d._get_default_store": "the job's c10d store, which torch exposes no public getter for",
    "c10d._get_process_group_store": "a sub-group's c10d store (no public getter)",
    "c10d._world": "a sub-group's c10d store on older torch, which lacks "
                   "_get_process_group_store",
    "body._raw_stream":
        "a fully read GET's connection back to urllib3's pool: botocore's StreamingBody has "
        "no public release (its close() drops the connection)",
    "metadata_manager.DefaultMetadataManager._all_gather_pickled_data":
        "torch_checkpointing 0.1.1's metadata gather, which puts its bytes on CUDA "
        "(metadata_manager.py line 416): ckptio/testing/tc_peer.py swaps in a CPU exchange so "
        "that the peer runs beside ckptio on gloo ranks (tests and benchmarks only)",
    "engine._commit_decoupled_checkpoint":
        "DeepSpeed 0.19's only way to commit a decoupled engine's pending tag (and write its "
        "'latest') outside step(): ckptio.deepspeed_engine's use() before it replaces such an "
        "engine, and commit_now() for a save after the last step",
    "engine._get_zero_param_shapes":
        "DeepSpeed 0.19's names and shapes of the parameters its ZeRO optimizer flattens, in "
        "their order (what it stores as param_shapes): ckptio.deepspeed_engine's load guard "
        "compares them with the saved ones to name a changed parameter before DeepSpeed copies "
        "flat partitions of another size",
    "made._http":
        "google-cloud-storage's requests session, to mount a connection pool as large as the "
        "requests in flight (the library sets no pool size; requests' default keeps 10)",
    "torch.distributed.tensor._utils":
        "DTensor's local shape and offset of a shard (compute_local_shape_and_global_offset, "
        "_get_shard_size_and_offsets): the same arithmetic DCP uses, not public",
    "tensor._version":
        "torch's version counter of a tensor, which every in-place change advances: a lazy "
        "save's check that the tensors it copies in the background were not changed before "
        "it copied them (saving/handle.py; also read by an attrgetter there); torch exposes "
        "it under no public name",
    "torch._foreach_copy_":
        "a capture's small host tensors of one dtype copied with one call, not one per tensor "
        "(saving/grouped.py): torch exposes no public copy of many tensors",
}
NAMEDTUPLE = {"_make", "_replace", "_fields", "_asdict", "_field_defaults"}

# Reaches tolerated while a rewrite is under way (none today): "module: expression". A listed
# reach that no longer occurs fails tests/test_structure.py.
REACHES_TO_VANISH: frozenset[str] = frozenset()

# Import circles tolerated while a move is under way (none today), each the set of modules (or
# sub-packages) in it; a listed circle that no longer occurs fails tests/test_structure.py.
CIRCLES_TO_VANISH: frozenset[frozenset[str]] = frozenset()


# ------------------------------------------------------------------------------------------------
# imports

@dataclass(frozen=True)
class Import:
    importer: str
    imported: str  # a module (or, for names taken from an unknown module, that module)
    line: int
    runtime: bool  # runs when ``importer`` is imported: module level, not under TYPE_CHECKING
    name: str | None = None  # the name taken by ``from imported import name`` (not a module)


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_modules(package: Path = PACKAGE) -> dict[str, Path]:
    """Every module of the package: dotted name -> file."""
    return {module_name(p, package.parent): p for p in sorted(package.rglob("*.py"))
            if "__pycache__" not in p.parts}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _walk(node: ast.AST, runtime: bool) -> Iterator[tuple[ast.AST, bool]]:
    """Every node below ``node``, with whether it runs at import time."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield child, runtime
            for grand in ast.iter_child_nodes(child):  # decorators and defaults run; bodies not
                if grand not in child.body:
                    yield from walk_one(grand, runtime)
            for stmt in child.body:
                yield from walk_one(stmt, False)
            continue
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for stmt in child.body:
                yield from walk_one(stmt, False)
            for stmt in child.orelse:
                yield from walk_one(stmt, runtime)
            continue
        yield from walk_one(child, runtime)


def walk_one(node: ast.AST, runtime: bool) -> Iterator[tuple[ast.AST, bool]]:
    yield node, runtime
    yield from _walk(node, runtime)


def resolve(importer: str, is_package: bool, module: str | None, level: int) -> str:
    if not level:
        return module or ""
    base = importer.split(".")
    base = base if is_package else base[:-1]
    base = base[:len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


_TREES: dict[tuple[str, str], ast.Module] = {}


def parse(path: Path) -> ast.Module:
    """``path``'s syntax tree, parsed once per text: the checks here, in tests/structure_trees.py,
    tests/test_layers.py and tests/test_structure.py read the same files many times. The trees
    are shared: read them, never change them. ``forget`` empties the memo."""
    text = path.read_text()
    key = (str(path), text)
    if key not in _TREES:
        _TREES[key] = ast.parse(text, str(path))
    return _TREES[key]


def forget() -> None:
    """Drop the parsed trees (a test module's teardown: they are large)."""
    _TREES.clear()


def imports_of(name: str, path: Path, modules: set[str]) -> list[Import]:
    """The imports in module ``name`` (file ``path``) of ckptio modules and of benchmarks."""
    tree = parse(path)
    is_package = path.name == "__init__.py"
    out: list[Import] = []
    for node, runtime in walk_one(tree, True):
        if isinstance(node, ast.Import):
            out += [Import(name, alias.name, node.lineno, runtime) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            source = resolve(name, is_package, node.module, node.level)
            for alias in node.names:
                full = f"{source}.{alias.name}"
                if full in modules or source == BENCHMARKS:
                    out.append(Import(name, full, node.lineno, runtime))
                else:
                    out.append(Import(name, source, node.lineno, runtime, alias.name))
    return [i for i in out if _ours(i.imported)]


def _ours(module: str) -> bool:
    top = module.split(".")[0]
    return top in ("ckptio", BENCHMARKS, "tests")


def all_imports(package: Path = PACKAGE) -> list[Import]:
    modules = package_modules(package)
    found: list[Import] = []
    for name, path in modules.items():
        found += imports_of(name, path, set(modules))
    return found


# ------------------------------------------------------------------------------------------------
# graphs and circles

def runtime_graph(imports: list[Import], modules: set[str]) -> dict[str, dict[str, int]]:
    """importer -> {imported module: line}, for the imports that run on import, each with the
    package __init__ files it runs first: not ckptio's own (every import runs it) nor those of
    packages holding the importer (Python has begun them before the importer runs)."""
    graph: dict[str, dict[str, int]] = {m: {} for m in modules}
    for imp in imports:
        if not imp.runtime or imp.imported not in modules or imp.imported == imp.importer:
            continue
        graph[imp.importer].setdefault(imp.imported, imp.line)
        parts = imp.imported.split(".")
        for n in range(2, len(parts)):
            package = ".".join(parts[:n])
            if package in modules and not (imp.importer + ".").startswith(package + "."):
                graph[imp.importer].setdefault(package, imp.line)
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One cycle (a list of modules, the first repeated at the end) per strongly connected
    component of more than one module."""
    return [_cycle_in(sorted(c), graph) for c in components(graph)]


def components(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, {})))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(component)
    return components


def _cycle_in(component: list[str], graph: dict[str, dict[str, int]]) -> list[str]:
    """A shortest cycle from the component's first module back to itself, inside it (BFS)."""
    members = set(component)
    first = component[0]
    parent: dict[str, str | None] = {first: None}
    frontier = [first]
    while frontier:
        following = []
        for node in frontier:
            for nxt in sorted(graph[node]):
                if nxt == first:
                    path = [node]
                    while (up := parent[path[-1]]) is not None:
                        path.append(up)
                    return [*reversed(path), first]
                if nxt in members and nxt not in parent:
                    parent[nxt] = node
                    following.append(nxt)
        frontier = following
    raise AssertionError(f"no cycle through {first}")


def show_cycle(cycle: list[str], graph: dict[str, dict[str, int]]) -> str:
    steps = [f"{a} imports {b} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:])]
    return "import cycle: " + ", which ".join(steps)


def import_graph(imports: Iterable[Import], modules: set[str]) -> dict[str, dict[str, int]]:
    """importer -> {imported module: line} over every import (module level, in functions,
    under TYPE_CHECKING), each with the sub-package __init__ files it runs first (as
    runtime_graph: not ckptio's own, nor those of packages holding the importer)."""
    return runtime_graph([Import(i.importer, i.imported, i.line, True, i.name) for i in imports],
                         modules)


def sub_package(module: str) -> str:
    """``ckptio.saving.persist`` -> ``ckptio.saving``; a top-level module is its own."""
    return ".".join(module.split(".")[:2])


def sub_package_graph(graph: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """The graph between sub-packages (an import inside one is no edge)."""
    out: dict[str, dict[str, int]] = {}
    for importer, edges in graph.items():
        mine = out.setdefault(sub_package(importer), {})
        for imported, line in edges.items():
            if sub_package(imported) != sub_package(importer):
                mine.setdefault(sub_package(imported), line)
    return out


@dataclass(frozen=True)
class Circle:
    members: frozenset[str]  # every module (or sub-package) of one strongly connected component
    text: str  # them, and one cycle through them, each step with its line


def circles(package: Path = PACKAGE) -> list[Circle]:
    """Every import circle: at module granularity, then between sub-packages (one of
    top-level modules only, found already, is not repeated)."""
    modules = package_modules(package)
    graph = import_graph(all_imports(package), set(modules))
    found: list[Circle] = []
    for g, what in ((graph, "modules"), (sub_package_graph(graph), "sub-packages")):
        found += [Circle(frozenset(c), f"{what} {', '.join(sorted(c))}: "
                         f"{show_cycle(_cycle_in(sorted(c), g), g)}")
                  for c in components(g) if frozenset(c) not in {f.members for f in found}]
    return found


# ------------------------------------------------------------------------------------------------
# private reaches


@dataclass(frozen=True)
class Reach:
    module: str
    line: int
    text: str  # the expression, e.g. ``handle._finished``
    third_party: bool  # a private name of another library (THIRD_PARTY says which may be used)

    @property
    def key(self) -> str:
        return f"{self.module}: {self.text}"


def is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_members(trees: Iterable[ast.Module]) -> set[str]:
    """The private member names ckptio's classes define (methods, class attributes, and
    ``self._x`` assigned in their methods)."""
    names: set[str] = set()
    for tree in trees:
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            for node in cls.body:
                targets = (node.targets if isinstance(node, ast.Assign) else
                           [node.target] if isinstance(node, ast.AnnAssign) else [])
                names.update(t.id for t in targets if isinstance(t, ast.Name))
            for node in ast.walk(cls):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(node.name)
                elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                      and isinstance(node.value, ast.Name) and node.value.id == "self"):
                    names.add(node.attr)
    return {n for n in names if is_private(n)}


def is_own(value: ast.expr) -> bool:
    """``self``, ``cls`` or ``super()``: the object itself."""
    return (isinstance(value, ast.Name) and value.id in ("self", "cls")) or (
        isinstance(value, ast.Call) and isinstance(value.func, ast.Name)
        and value.func.id == "super")


def reaches(package: Path = PACKAGE) -> list[Reach]:
    """Every private-member access across objects in the package, and every private name of
    another library it uses (attributes, and names or modules it imports)."""
    modules = package_modules(package)
    trees = {m: parse(p) for m, p in modules.items()}
    members = private_members(trees.values())
    found: list[Reach] = []
    for module, tree in trees.items():
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and is_private(node.attr) and not is_own(node.value)
                    and node.attr not in NAMEDTUPLE):
                found.append(Reach(module, node.lineno, ast.unparse(node),
                                   node.attr not in members))
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                if node.module.split(".")[0] in ("ckptio", BENCHMARKS):
                    continue  # ckptio's own: tests/test_layers.py checks names against __all__
                if any(is_private(p) for p in node.module.split(".")):
                    found.append(Reach(module, node.lineno, node.module, True))
                else:
                    found += [Reach(module, node.lineno, f"{node.module}.{a.name}", True)
                              for a in node.names if is_private(a.name)]
    return sorted(found, key=lambda r: (r.module, r.line, r.text))


def unexpected(found: list[Reach]) -> list[Reach]:
    """The reaches neither THIRD_PARTY nor REACHES_TO_VANISH allow."""
    return [r for r in found if r.key not in REACHES_TO_VANISH
            and (not r.third_party or r.text not in THIRD_PARTY)]


# ------------------------------------------------------------------------------------------------
# the command


def _section(title: str, lines: list[str]) -> list[str]:
    return [f"{title}: {len(lines)}", *(f"  {line}" for line in lines)]


def duplicate_names(package: Path = PACKAGE) -> list[str]:
    """Module file names that occur more than once in the package (``__init__.py`` and
    ``__main__.py`` are a package's own), each as ``name: path, path``."""
    seen: dict[str, list[str]] = {}
    for path in sorted(package.rglob("*.py")):
        if "__pycache__" not in path.parts and path.name not in ("__init__.py", "__main__.py"):
            seen.setdefault(path.name, []).append(str(path.relative_to(package.parent)))
    return [f"{name}: {', '.join(paths)}" for name, paths in sorted(seen.items())
            if len(paths) > 1]


def report(package: Path = PACKAGE) -> tuple[list[str], int]:
    """The printed report and how many problems it names beyond the allow-lists."""
    found = reaches(package)
    ours = [r for r in found if not r.third_party]
    theirs = [r for r in found if r.third_party]
    every = circles(package)
    listed = [c for c in every if c.members in CIRCLES_TO_VANISH]
    loops = [c for c in every if c.members not in CIRCLES_TO_VANISH]
    bad = unexpected(found)
    lines = [*_section("private-member reaches across objects", [
        f"{r.module}:{r.line} {r.text}" + ("  (REACHES_TO_VANISH)" if r.key in REACHES_TO_VANISH
                                           else "") for r in ours])]
    lines += _section("import circles", [c.text + ("  (CIRCLES_TO_VANISH)" if c in listed else "")
                                         for c in [*loops, *listed]])
    lines += _section("private names of other libraries", [
        f"{r.module}:{r.line} {r.text}" + ("" if r.text in THIRD_PARTY
                                           else "  (NOT IN THIRD_PARTY)") for r in theirs])
    twins = duplicate_names(package)
    lines += _section("module file names that repeat", twins)
    lines.append(f"beyond the allow-lists: {len(bad)} reaches, {len(loops)} circles, "
                 f"{len(twins)} repeated file names")
    return lines, len(bad) + len(loops) + len(twins)


def main(argv: list[str] | None = None) -> int:
    lines, problems = report(Path(argv[0]) if argv else PACKAGE)
    print("\n".join(lines))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
