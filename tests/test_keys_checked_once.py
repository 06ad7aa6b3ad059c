"""A save whose plan is reused does not walk its keys again before the commit: the reader's key
rules (format/keyrules.py, check_keys) gave the same answer for the same keys, tree and
aliases, and for a state of thousands of tensors the walk held the interpreter on the save's
thread in every save of a training loop (docs/BENCH_LOOP.md section 17). A manifest whose keys
differ from the last one that passed is still checked. That memory is owned by a
Checkpointer's plan memory (keyrules.KeysPassed in collective.Memory), not kept in format/:
no function of format/ changes module-level state (found and named here)."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch

import ckptio
from ckptio.errors import ManifestError
from ckptio.format import keyrules, manifest
from ckptio.format.types import ObjectEntry

FORMAT = Path(__file__).resolve().parent.parent / "ckptio" / "format"
# module-level state a function of format/ may change, with why
ALLOWED = {("containers.py", "_STAND_INS"): "one stand-in type per saved namedtuple type and "
           "process, so values loaded twice have the same type"}


@pytest.fixture
def walks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the walks of the key rules."""
    calls: list[int] = []
    real = keyrules.check_entries

    def counting(*args: object, **kwargs: object) -> None:
        calls.append(1)
        real(*args, **kwargs)  # type: ignore[arg-type]
    monkeypatch.setattr(keyrules, "check_entries", counting)
    return calls


def _state(step: int) -> dict[str, object]:
    return {"model": {f"w{i}": torch.full((8,), float(step + i)) for i in range(20)},
            "step": step, "tags": ["a", "b"]}


def test_saves_of_one_layout_walk_the_keys_once(tmp_path: Path, walks: list[int]) -> None:
    with ckptio.CheckpointManager(tmp_path / "run", keep_last=2) as mgr:
        for step in range(1, 6):
            mgr.save(step, _state(step), asynchronous=True)
        mgr.wait()
        assert len(walks) == 1
        other = {**_state(6), "extra": torch.ones(3)}  # another layout: checked again
        mgr.save(6, other)
        assert len(walks) == 2
    back = {**_state(0), "extra": torch.zeros(3)}
    with ckptio.CheckpointManager(tmp_path / "run") as again:
        assert again.restore(back) == 6
    assert torch.equal(back["model"]["w3"], torch.full((8,), 9.0))  # type: ignore[index]
    assert torch.equal(back["extra"], torch.ones(3)) and back["tags"] == ["a", "b"]


def test_a_step_committed_before_the_manager_hears_of_it_is_not_read_back(
        tmp_path: Path, walks: list[int]) -> None:
    """A synchronous save after an async one: the async step's retention pass finds the new
    step committed already; the manager made it, so its manifest is not read (it was, in
    CI under load: an async save done quickly had the save call read its manifest back)."""
    with ckptio.CheckpointManager(tmp_path / "run", keep_last=2) as mgr:
        handle = mgr.save(1, _state(1), asynchronous=True)
        assert handle is not None
        handle.wait()
        mgr.save(2, _state(2))
        assert len(walks) == 1
        assert mgr.steps() == [1, 2]


def test_a_bad_manifest_after_a_good_one_is_still_refused() -> None:
    m = manifest.Manifest(version=3, save_id="s", checksum_algorithm="xxh3_64", world_size=1,
                          files=(), tensors=(), objects=(ObjectEntry("a", ["int", 1]),),
                          aliases=(), tree={"d": [["a", {"k": "a"}]]}, meta={},
                          block_nbytes=1 << 20)
    manifest.check_keys(m, "x")
    manifest.check_keys(m, "x")
    clash = dataclasses.replace(m, objects=(*m.objects, ObjectEntry("a", ["int", 2])))
    with pytest.raises(ManifestError):
        manifest.check_keys(clash, "x")


def test_each_checkpointer_remembers_its_own_layout(tmp_path: Path, walks: list[int]) -> None:
    """The memory of the last layout that passed is owned by a Checkpointer's plan memory
    (collective.Memory.keys), not shared by the process: another Checkpointer saving another
    layout in between does not make this one walk its unchanged keys again."""
    other = {**_state(0), "extra": torch.ones(3)}
    ck_a, ck_b = ckptio.Checkpointer(), ckptio.Checkpointer()
    try:
        ck_a.save(_state(1), tmp_path / "a1")
        ck_b.save(other, tmp_path / "b1")
        assert len(walks) == 2
        ck_a.save(_state(2), tmp_path / "a2")  # a's layout, unchanged since a's last save
        assert len(walks) == 2, "a Checkpointer's key memory was replaced by another's save"
        ck_b.save({**other, "more": torch.ones(2)}, tmp_path / "b2")  # b's new layout: walked
        assert len(walks) == 3
    finally:
        ck_a.close()
        ck_b.close()
    assert torch.equal(ckptio.load(tmp_path / "a2")["model"]["w0"], torch.full((8,), 2.0))


_MUTATORS = {"append", "add", "update", "pop", "popitem", "clear", "setdefault", "extend",
             "insert", "remove", "discard", "__setitem__"}


def _state_kept(source: str) -> list[tuple[int, str]]:
    """(line, name) where a function changes module-level state: ``global``, or a module-level
    name (not a parameter or local of that function) item-assigned, item-deleted or mutated by
    a container method."""
    tree = ast.parse(source)
    top = {t.id for node in tree.body if isinstance(node, (ast.Assign, ast.AnnAssign))
           for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
           if isinstance(t, ast.Name)}
    found: list[tuple[int, str]] = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        own = {a.arg for a in ast.walk(fn.args) if isinstance(a, ast.arg)} | {
            n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        for node in ast.walk(fn):
            if isinstance(node, ast.Global):
                found.extend((node.lineno, f"global {name}") for name in node.names)
                continue
            base: ast.expr | None = None
            if isinstance(node, ast.Subscript) and isinstance(node.ctx, (ast.Store, ast.Del)):
                base = node.value
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                  and node.func.attr in _MUTATORS):
                base = node.func.value
            if isinstance(base, ast.Name) and base.id in top and base.id not in own:
                found.append((node.lineno, base.id))
    return sorted(set(found))


def test_format_keeps_no_state_between_calls() -> None:
    """format/ is pure: no function there changes module-level state (a memo such as the key
    rules' last layout belongs to an object its owner passes, keyrules.KeysPassed). Its
    tables are built at import and only read."""
    planted = ("_passed = [None]\n_seen = {}\nTABLE = {'a': 1}\n"
               "def f(x, table):\n    _passed[0] = x\n    _seen.setdefault(x, 1)\n"
               "    table[x] = TABLE['a']\n    local = {}\n    local[x] = 1\n"
               "def g():\n    global _n\n")
    assert _state_kept(planted) == [(5, "_passed"), (6, "_seen"), (11, "global _n")]
    found = [f"format/{path.name}:{line} {name}" for path in sorted(FORMAT.glob("*.py"))
             for line, name in _state_kept(path.read_text())
             if (path.name, name) not in ALLOWED]
    assert not found, ("module-level state changed by format/ (own it by an object passed "
                       "where needed, e.g. keyrules.KeysPassed):\n  " + "\n  ".join(found))
    for (name, binding), _why in ALLOWED.items():
        assert binding in {n for _, n in _state_kept((FORMAT / name).read_text())}, (
            f"ALLOWED names {name}:{binding}, which is gone: drop it from the list")
