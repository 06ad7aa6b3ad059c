"""ckptio's layers, checked from its source (ast: nothing of ckptio is imported for these checks,
and no dependency is added; the source is read by tests/structure.py).

The layers are the data below (LAYERS, then DRIVERS, bottom to top); a module may import its
own layer and the layers below it. The drivers, the top, are ordered in sub-layers too, each
importing only itself and what is below it: base helpers < api < shared <
tiering < managing < manager < interop drivers < ckptio (its __init__) < the users of
``ckptio`` itself (lightning, demo) < cli. A listed module that does not exist (any more) is
no error. KNOWN_UPWARD lists upward imports allowed for now (none).

ckptio.testing may import anything, and nothing else in ckptio imports it. Nothing in ckptio
imports the repository's benchmarks/ (not installed with ckptio) except ckptio.cli, which runs
them for ``ckptio bench``. Every import counts for the layers: module level, inside functions
and under ``if TYPE_CHECKING``. No imports form a circle, between modules or sub-packages
(tests/structure.py); the imports that run when a module is imported (module level, with the
package __init__ each one runs first) form no cycle, whatever allow-list says otherwise.

Every module declares ``__all__`` (what other modules may use), naming only what it binds; a
ckptio module takes from another ckptio module only what that one's ``__all__`` lists (or a
submodule). ckptio/__init__.py's ``__all__`` is the public surface, pinned below.

A failure names the importing module and line, the imported module and the rule it breaks.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.structure import (
    CIRCLES_TO_VANISH,
    PACKAGE,
    ROOT,
    Import,
    all_imports,
    circles,
    cycles,
    forget,
    imports_of,
    package_modules,
    parse,
    resolve,
    runtime_graph,
    show_cycle,
    walk_one,
)


@pytest.fixture(scope="module", autouse=True)
def _parsed_once() -> Iterator[None]:
    """The package's files are parsed once for this module's tests (tests/structure.py parse)
    and the trees dropped after them."""
    yield
    forget()

# ------------------------------------------------------------------------------------------------
# the layer table: edit here

# The layers below the drivers, bottom to top.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("ckptio.alignment", "ckptio.environment", "ckptio.errors", "ckptio.options",
     "ckptio.scheme_settings", "ckptio.version"),
    ("ckptio.format",),
    ("ckptio.planning", "ckptio.io"),
    ("ckptio.storage",),
    ("ckptio.distributed",),
    ("ckptio.saving", "ckptio.loading"),
    ("ckptio.tuning",),
)
# The drivers (the top layer) in their sub-layers, bottom to top.
DRIVERS: tuple[tuple[str, ...], ...] = (
    ("ckptio.resources", "ckptio.stepmeta", "ckptio.rng", "ckptio.optim", "ckptio.devices",
     "ckptio.packed", "ckptio.policies", "ckptio.destination"),  # base helpers
    ("ckptio.api", "ckptio.load_ranks"),  # the Checkpointer
    ("ckptio.shared",),  # ckptio.save / load, on a shared Checkpointer
    ("ckptio.redundancy",),  # a memory tier's copies across hosts: protection, rebuild
    ("ckptio.managing",),  # the CheckpointManager and its parts: tiers, drain, restore loop
    ("ckptio.dcp", "ckptio.export", "ckptio.export_fill", "ckptio.convert",
     "ckptio.convert_writers", "ckptio.hf_checkpoints", "ckptio.hf_trainer", "ckptio.tc_storage",
     "ckptio.torchtitan_manager", "ckptio.lightning_rng",
     "ckptio.lightning_paths", "ckptio.dir_leases"),  # interop drivers
    ("ckptio",),  # the public surface (its __init__)
    ("ckptio.lightning", "ckptio.deepspeed_engine", "ckptio.deepspeed_guard",
     "ckptio.deepspeed_tags", "ckptio.deepspeed_reads", "ckptio.demo",
     "ckptio.megatron_common", "ckptio.megatron_strategy"),  # users of ``import ckptio``
    ("ckptio.cli", "ckptio.__main__"),  # the command line
)
APART = (("ckptio.saving", "ckptio.loading"), ("ckptio.planning", "ckptio.io"))
TESTING = "ckptio.testing"  # imports anything; imported by nothing else in ckptio
BENCHMARKS = "benchmarks"  # the repository's peer benchmarks, outside the package
MAY_IMPORT_BENCHMARKS = {"ckptio.cli"}

# Upward imports tolerated while a move is under way, as "importer -> imported" modules (none
# today). A listed one that no longer occurs fails test_known_upward_imports_still_occur.
KNOWN_UPWARD: frozenset[str] = frozenset()

PUBLIC = {
    "Checkpointer", "CheckpointManager", "save", "async_save", "load", "verify", "Options",
    "RNGState", "OptimizerState", "TensorShard", "FlatShard", "SaveHandle", "SaveResult",
    "AsyncSaveResult",
    "LoadReport", "Progress", "__version__", "export_hf", "register_store", "settings_for",
    "S3Settings", "GcsSettings",
    "CkptError", "CheckpointLockedError", "CheckpointNotFoundError", "CorruptCheckpointError",
    "IncompleteCheckpointError", "ManifestError", "PickleRefusedError", "RankFailedError",
    "SaveTimeoutError",
    "StateMismatchError", "StorageIOError", "UnsupportedPathError", "UnsupportedStateError",
    "DcpReader", "DcpWriter", "Tier", "Partners", "Parity", "read_metadata", "DeltaPolicy",
    "StepInfo", "SaveMoment", "RetentionPolicy", "SavePolicy", "KeepAll", "KeepLatest",
    "KeepEvery", "KeepRecent", "KeepBest", "SaveEvery", "SaveOnPreemption", "AnyOf",
    "DeltaBasePolicy",
}

ORDER = LAYERS + DRIVERS  # every layer, bottom to top


def _names(layers: tuple[tuple[str, ...], ...]) -> str:
    return " < ".join(", ".join(g.removeprefix("ckptio.") for g in layer) for layer in layers)


RULES = f"{_names(LAYERS)} < drivers"
DRIVER_RULES = f"drivers: {_names(DRIVERS)}"


# ------------------------------------------------------------------------------------------------
# the rules


def group_of(module: str) -> str | None:
    """The LAYERS entry ``module`` belongs to (the longest that holds it), or None."""
    if module == TESTING or module.startswith(TESTING + "."):
        return TESTING
    best = None
    for layer in ORDER:
        for group in layer:
            inside = module == group or (group != "ckptio" and module.startswith(group + "."))
            if inside and (best is None or len(group) > len(best)):
                best = group
    return best


def layer_of(group: str) -> int:
    return next(i for i, layer in enumerate(ORDER) if group in layer)


def violation(imp: Import) -> str | None:
    """Why ``imp`` breaks the layer rules, or None."""
    where = f"{imp.importer} imports {imp.imported} (line {imp.line})"
    if imp.imported == BENCHMARKS or imp.imported.startswith(BENCHMARKS + "."):
        if imp.importer in MAY_IMPORT_BENCHMARKS:
            return None
        return (f"{where}: nothing in ckptio imports the repository's benchmarks/ (they are not "
                f"installed) except {', '.join(sorted(MAY_IMPORT_BENCHMARKS))}; move what it "
                "needs into ckptio")
    mine, theirs = group_of(imp.importer), group_of(imp.imported)
    for module, group in ((imp.importer, mine), (imp.imported, theirs)):
        if group is None:
            return (f"{where}: {module} is in no layer; add it to LAYERS or DRIVERS in "
                    "tests/test_layers.py")
    assert mine is not None and theirs is not None
    if mine == TESTING:
        return None
    if theirs == TESTING:
        return (f"{where}: nothing in ckptio imports {TESTING} (test support; it imports ckptio, "
                "not the other way)")
    if layer_of(mine) < layer_of(theirs):
        if f"{imp.importer} -> {imp.imported}" in KNOWN_UPWARD:
            return None
        rules = DRIVER_RULES if layer_of(mine) >= len(LAYERS) else RULES
        return (f"{where}: layer {mine} may not import layer {theirs}, which is above it "
                f"({rules}); move what it needs down to {mine}'s layer or below")
    for pair in APART:
        if mine != theirs and {mine, theirs} == set(pair):
            return (f"{where}: {pair[0]} and {pair[1]} do not import each other; move what "
                    f"both need to a layer below them")
    return None


# ------------------------------------------------------------------------------------------------
# __all__


def module_all(path: Path) -> list[str] | None:
    """The module's literal ``__all__``, or None when it declares none at module level."""
    for node in parse(path).body:
        targets = (node.targets if isinstance(node, ast.Assign) else
                   [node.target] if isinstance(node, ast.AnnAssign) and node.value else [])
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            value = ast.literal_eval(node.value)  # type: ignore[union-attr, arg-type]
            assert isinstance(value, (list, tuple)), f"{path}: __all__ is not a list"
            return list(value)
    return None


def bound_names(path: Path) -> set[str]:
    """Names a module binds at module level (defs, classes, assignments, imports)."""
    names: set[str] = set()
    for node, runtime in walk_one(parse(path), True):
        if not runtime and not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return names


def _module_aliases(tree: ast.Module, name: str, is_package: bool,
                    modules: set[str]) -> dict[str, str]:
    """Local name -> ckptio module, for names bound to a module by an import."""
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in modules and (a.asname or "." not in a.name):
                    aliases[a.asname or a.name] = a.name
        elif isinstance(node, ast.ImportFrom):
            source = resolve(name, is_package, node.module, node.level)
            for a in node.names:
                if f"{source}.{a.name}" in modules:
                    aliases[a.asname or a.name] = f"{source}.{a.name}"
    return aliases


def _rebound(tree: ast.Module, alias: str) -> bool:
    """Whether ``alias`` is also bound as a variable or argument somewhere (then its attributes
    need not be the module's)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id == alias and isinstance(node.ctx, ast.Store):
            return True
        if isinstance(node, ast.arg) and node.arg == alias:
            return True
    return False


def uses_outside_all(package: Path = PACKAGE) -> list[str]:
    """Every name a ckptio module takes from another that the other's __all__ does not list."""
    modules = package_modules(package)
    declared = {m: module_all(p) for m, p in modules.items()}
    problems: list[str] = []

    def check(importer: str, module: str, attr: str, line: int) -> None:
        if module == importer or f"{module}.{attr}" in modules or attr.startswith("__"):
            return
        listed = declared.get(module)
        if listed is not None and attr not in listed:
            problems.append(f"{importer} uses {module}.{attr} (line {line}), which {module}'s "
                            f"__all__ does not list: add it there or stop using it")

    for name, path in modules.items():
        for imp in imports_of(name, path, set(modules)):
            if imp.name is not None and imp.name != "*" and imp.imported in modules:
                check(name, imp.imported, imp.name, imp.line)
        tree = parse(path)
        aliases = _module_aliases(tree, name, path.name == "__init__.py", set(modules))
        aliases = {a: m for a, m in aliases.items() if not _rebound(tree, a)}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in aliases):
                check(name, aliases[node.value.id], node.attr, node.lineno)
    return problems


# ------------------------------------------------------------------------------------------------
# the tests


def layer_problems(package: Path = PACKAGE) -> list[str]:
    """Every import that breaks the layers, and every module in no layer."""
    problems = list(dict.fromkeys(v for imp in all_imports(package)
                                  if (v := violation(imp)) is not None))
    return problems + [f"{m} is in no layer; add it to LAYERS or DRIVERS in tests/test_layers.py"
                       for m in package_modules(package) if group_of(m) is None]


def test_every_module_is_in_a_layer_and_imports_only_down():
    problems = layer_problems()
    assert not problems, "layer rules broken:\n  " + "\n  ".join(problems)


def test_known_upward_imports_still_occur():
    """KNOWN_UPWARD names only imports that are there: one removed is removed from it too."""
    found = {f"{i.importer} -> {i.imported}" for i in all_imports()}
    gone = sorted(KNOWN_UPWARD - found)
    assert not gone, f"no longer imported, remove from tests/test_layers.py KNOWN_UPWARD: {gone}"


def test_a_listed_module_that_does_not_exist_is_no_error(monkeypatch):
    """Modules come and go (stepdir/ moves into storage/, tiering/manager.py merges into
    managing/manager.py): a layer entry naming none is no error, and the rules still hold for the rest."""
    ghost = ("ckptio.gone", "ckptio.gone.too")
    monkeypatch.setattr(sys.modules[__name__], "ORDER", (*ORDER[:-1], ghost, ORDER[-1]))
    assert group_of("ckptio.gone.sub") == "ckptio.gone"
    assert layer_problems() == []
    assert violation(Import("ckptio.cli", "ckptio.gone", 1, True)) is None
    assert "may not import" in (violation(Import("ckptio.gone", "ckptio.cli", 1, True)) or "")


def test_no_import_circle_over_all_imports():
    """No circle over every import (module level, in functions, under TYPE_CHECKING), between
    modules or between sub-packages; tests/structure.py CIRCLES_TO_VANISH lists those other
    helpers of issue 44 are breaking."""
    found = [c.text for c in circles() if c.members not in CIRCLES_TO_VANISH]
    assert not found, "import circles:\n  " + "\n  ".join(found)


def test_no_import_circle_in_the_benchmarks():
    """The peer benchmarks (benchmarks/, outside the package) form no import circle either:
    shared pieces live in benchmarks/__init__.py or a module of their own (plan_model.py)."""
    found = [c.text for c in circles(ROOT / BENCHMARKS)]
    assert not found, "import circles:\n  " + "\n  ".join(found)


def test_no_import_cycle():
    modules = package_modules()
    graph = runtime_graph(all_imports(), set(modules))
    found = [show_cycle(c, graph) for c in cycles(graph)]
    assert not found, "\n".join(found)


def test_every_module_declares_all_of_names_it_binds():
    problems = []
    for name, path in package_modules().items():
        listed = module_all(path)
        if listed is None:
            problems.append(f"{name} ({path.relative_to(ROOT)}) declares no __all__")
            continue
        submodules = {m.rsplit(".", 1)[1] for m in package_modules() if m.startswith(name + ".")
                      and "." not in m[len(name) + 1:]} if path.name == "__init__.py" else set()
        unbound = sorted(set(listed) - bound_names(path) - submodules)
        if unbound:
            problems.append(f"{name}: __all__ lists {unbound}, which it does not define")
        if len(set(listed)) != len(listed):
            problems.append(f"{name}: __all__ lists a name twice")
    assert not problems, "\n  ".join(["__all__ problems:", *problems])


def test_ckptio_modules_use_only_what_others_list_in_all():
    problems = uses_outside_all()
    assert not problems, "\n  ".join(["names used across modules but not in __all__:", *problems])


def test_the_public_surface_is_ckptio_all():
    listed = module_all(PACKAGE / "__init__.py")
    extra, missing = sorted(set(listed or ()) - PUBLIC), sorted(PUBLIC - set(listed or ()))
    assert listed is not None and not extra and not missing, (
        f"ckptio.__all__ differs from the public surface: extra {extra}, missing {missing}; "
        "change both on purpose (tests/test_layers.py PUBLIC)")


def test_sub_packages_say_they_are_internal():
    for init in sorted(PACKAGE.glob("*/__init__.py")):
        doc = ast.get_docstring(parse(init)) or ""
        assert "public" in doc and "``ckptio`` itself" in doc, (
            f"{init.relative_to(ROOT)}: its docstring should say what the layer holds, that it is "
            "internal, and that the public surface is ``ckptio`` itself")


def test_ckptio_bench_outside_a_checkout_says_how_to_run_the_peer_benchmarks(monkeypatch, capsys):
    """benchmarks/ is not installed: without a checkout, `ckptio bench save-load` says in one
    line how to run it (``ckptio bench io`` is installed: ckptio.tuning.io_study)."""
    from ckptio import cli

    monkeypatch.setattr(cli, "_checkout", lambda module: None)
    assert cli.main(["bench", "save-load", "--gb", "2", "--engines", "a b"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == ["ckptio bench save-load: the peer benchmarks are not installed with ckptio; "
                     "from a checkout of its repository run: python -m benchmarks.save_load "
                     "--gb 2 --engines 'a b'"], lines
    monkeypatch.undo()
    assert cli._checkout("save_load") == str(ROOT)  # this checkout (editable install or cwd)


# ------------------------------------------------------------------------------------------------
# the checker itself, on made-up imports


@pytest.mark.parametrize(("importer", "imported", "says"), [
    ("ckptio.format.manifest", "ckptio.planning.reshard",
     "layer ckptio.format may not import layer ckptio.planning"),
    ("ckptio.saving.persist", "ckptio.loading.restore",
     "ckptio.saving and ckptio.loading do not import each other"),
    ("ckptio.io.stage", "ckptio.planning.layout",
     "ckptio.planning and ckptio.io do not import each other"),
    ("ckptio.tuning.io_study", "benchmarks.save_load", "nothing in ckptio imports the repository"),
    ("ckptio.api", "ckptio.testing.faults", "nothing in ckptio imports ckptio.testing"),
    ("ckptio.format.values", "ckptio", "layer ckptio.format may not import layer ckptio"),
    ("ckptio.newthing", "ckptio.errors", "ckptio.newthing is in no layer"),
    ("ckptio.resources", "ckptio.api", "layer ckptio.resources may not import layer ckptio.api"),
    ("ckptio.api", "ckptio.shared", "layer ckptio.api may not import layer ckptio.shared"),
    ("ckptio.shared", "ckptio.managing.manager", "(drivers: resources, stepmeta"),
    ("ckptio.redundancy.protect", "ckptio.managing.manager", "layer ckptio.redundancy may not import"),
    ("ckptio.redundancy.rebuild", "ckptio.managing.level",
     "layer ckptio.redundancy may not import layer ckptio.managing"),
    ("ckptio.managing.manager", "ckptio.dcp.reader", "layer ckptio.managing may not import layer ckptio.dcp"),
    ("ckptio.export", "ckptio", "layer ckptio.export may not import layer ckptio,"),
    ("ckptio", "ckptio.cli", "layer ckptio may not import layer ckptio.cli"),
])
def test_a_wrong_way_import_is_named(importer, imported, says):
    message = violation(Import(importer, imported, 7, True))
    assert message is not None and says in message, message
    assert message.startswith(f"{importer} imports {imported} (line 7)"), message


@pytest.mark.parametrize(("importer", "imported"), [
    ("ckptio.cli", "benchmarks.save_load"), ("ckptio.api", "ckptio.tuning.profile"),
    ("ckptio.testing.faults", "ckptio.api"), ("ckptio.options", "ckptio.errors"),
    ("ckptio.saving.save_session", "ckptio.distributed.collective"),
    ("ckptio.planning.reshard", "ckptio.format.geometry"), ("ckptio.demo.train", "ckptio"),
    ("ckptio.managing.manager", "ckptio.managing.drain"), ("ckptio.managing.manager", "ckptio.managing.chains"),
    ("ckptio.managing.agreed", "ckptio.managing.guard"), ("ckptio.shared", "ckptio.api"),
    ("ckptio.cli.ls_run", "ckptio.redundancy.marks"), ("ckptio.lightning", "ckptio"),
    ("ckptio", "ckptio.managing.manager"), ("ckptio.convert", "ckptio.export"),
])
def test_a_right_way_import_passes(importer, imported):
    assert violation(Import(importer, imported, 1, True)) is None


def test_a_cycle_is_found_and_named():
    graph = {"a": {"b": 3}, "b": {"c": 5}, "c": {"a": 9, "d": 1}, "d": {}}
    (cycle,) = cycles(graph)
    assert cycle == ["a", "b", "c", "a"]
    assert show_cycle(cycle, graph) == ("import cycle: a imports b (line 3), which b imports c "
                                        "(line 5), which c imports a (line 9)")
    assert cycles({"a": {"b": 1}, "b": {}}) == []


def test_imports_are_read_with_where_they_run(tmp_path):
    pkg = tmp_path / "ckptio"
    (pkg / "format").mkdir(parents=True)
    for rel in ("__init__.py", "errors.py", "format/__init__.py", "format/types.py"):
        (pkg / rel).write_text("")
    (pkg / "format" / "x.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "from ckptio.format import types\n"
        "from ckptio.errors import CkptError\n"
        "if TYPE_CHECKING:\n"
        "    from ckptio import api\n"
        "def f():\n"
        "    from benchmarks import save_load\n")
    found = {(i.imported, i.runtime, i.name) for i in all_imports(pkg)}
    assert found == {("ckptio.format.types", True, None), ("ckptio.errors", True, "CkptError"),
                     ("ckptio", False, "api"), ("benchmarks.save_load", False, None)}


# Modules that never import torch, directly or through the ckptio modules they import (the
# package __init__s aside, which a torch-free reader bypasses: tests/test_dcpmeta.py runs them so).
# DCP's .metadata and item heads are decoded here, before anything decides to import torch;
# and ckptio's index files (the manifest too, but values.py imports torch where it decodes a
# torch value: tests/test_index_files.py decodes both in a process without torch).
TORCH_FREE = {"ckptio.errors", "ckptio.format.types", "ckptio.format.tiling",
              "ckptio.format.geometry", "ckptio.format.dcpmeta", "ckptio.format.torchzip",
              "ckptio.format.check", "ckptio.format.regular_section", "ckptio.format.grid",
              "ckptio.format.overlap", "ckptio.format.checksum", "ckptio.format.allowlist"}


def test_torch_free_modules_import_no_torch():
    modules = package_modules()
    problems = []
    for name in sorted(TORCH_FREE):
        tree = parse(modules[name])
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found = [node.module]
            else:
                continue
            problems += [f"{name}:{node.lineno} imports {m}" for m in found
                         if m.split(".")[0] == "torch"]
        for imp in imports_of(name, modules[name], set(modules)):
            if imp.imported not in TORCH_FREE and imp.imported not in ("ckptio", "ckptio.format"):
                problems.append(f"{name}:{imp.line} imports {imp.imported}, which may import torch")
    assert not problems, "\n".join(problems)
