"""The memory tier's page reuse is owned by its root (issue 68, "rooms by feature"): the
mappings of a memory tier's files live in the ``Mappings`` its LocalRoot owns and its steps'
stores carry (storage/local/mapped.py), not in a process-wide cache.

Covers: no module of storage/local keeps module-level mutable state (a cache dict, list or
set, or a ``global`` rebinding) beyond the one named below; closing one Checkpointer (a
manager on another memory tier) leaves a second manager's warm slots mapped, so its next
save still copies straight into their pages and writes no data through its backend; a
Checkpointer serving a tier hands a second root at the same location the first's mappings.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

import torch

import ckptio
from ckptio import Tier
from ckptio.storage.local.local_root import LocalRoot
from ckptio.storage.local.local_store import LocalStore
from ckptio.storage.select import checkpoint_path
from tests.conftest import assert_same
from tests.write_counting import WriteCounting

MiB = 1 << 20
OPTS = ckptio.Options(buffer_bytes=MiB, pool_bytes=4 * MiB)
LOCAL = Path(__file__).resolve().parent.parent / "ckptio" / "storage" / "local"
# module-level mutable state allowed in storage/local, with why
ALLOWED = {("dirlock.py", "_unlockable_warned"): "warn once per process per filesystem",
           ("runlease.py", "_HELD"): "the leases a forked child closes: per process, as a fork is"}
_MUTABLE_CALLS = {"dict", "list", "set", "defaultdict", "OrderedDict", "WeakValueDictionary",
                  "WeakKeyDictionary", "WeakSet", "deque"}


def _module_state(source: str) -> list[tuple[int, str]]:
    """(line, name) of every module-level binding to a mutable container and every
    ``global`` statement (a function rebinding module state) in ``source``."""
    tree = ast.parse(source)
    found: list[tuple[int, str]] = []
    for node in tree.body:
        targets: list[ast.expr] = []
        value: ast.expr | None = None
        if isinstance(node, ast.Assign):
            targets, value = list(node.targets), node.value
        elif isinstance(node, ast.AnnAssign):
            targets, value = [node.target], node.value
        mutable = isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp,
                                     ast.SetComp)) or (
            isinstance(value, ast.Call)
            and getattr(value.func, "id", getattr(value.func, "attr", None)) in _MUTABLE_CALLS)
        for target in targets:
            if mutable and isinstance(target, ast.Name) and target.id != "__all__":
                found.append((node.lineno, target.id))
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            found.extend((node.lineno, f"global {name}") for name in node.names)
    return found


def test_no_module_level_cache_in_storage_local():
    """Every mapping, slot and lock of the local stores belongs to an object (a root, a store,
    a lease): a module-level cache coming back in storage/local is found and named."""
    planted = "_cache: dict[int, int] = {}\n_ticks = 0\ndef f():\n    global _ticks\n"
    assert _module_state(planted) == [(1, "_cache"), (4, "global _ticks")]
    found = [f"storage/local/{path.name}:{line} {name}" for path in sorted(LOCAL.glob("*.py"))
             for line, name in _module_state(path.read_text())
             if (path.name, name) not in ALLOWED]
    assert not found, ("module-level state in storage/local (own it by an object, e.g. the "
                       "root's Mappings):\n  " + "\n  ".join(found))
    for (name, binding), _why in ALLOWED.items():
        assert binding in {n for _, n in _module_state((LOCAL / name).read_text())}, (
            f"ALLOWED names {name}:{binding}, which is gone: drop it from the list")


def _state(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(200_000, generator=g), "b": torch.randn(33, generator=g)}


def _run(location: str, steps: range, ck: ckptio.Checkpointer) -> ckptio.CheckpointManager:
    mgr = ckptio.CheckpointManager(tiers=[Tier(location, keep_last=1)], checkpointer=ck)
    for step in steps:
        mgr.save(step, _state(step))
    return mgr


def test_closing_another_checkpointer_leaves_this_tiers_slots_mapped(shm: str) -> None:
    """Manager B's memory tier is warm (its dropped steps' files mapped ahead); manager A, on
    another memory tier with its own Checkpointer, closes. B's next save still copies into
    mapped slots: no data file written through B's backend, and it loads bit for bit."""
    ck_b = ckptio.Checkpointer(OPTS)
    root_b = checkpoint_path("shm://b")
    os.makedirs(root_b, exist_ok=True)
    counting = ck_b.resources().wrap_backend(LocalStore(root_b), WriteCounting)
    mgr_b = _run("shm://b", range(3), ck_b)  # from step 2 on: mapped, the ring warm
    try:
        ck_a = ckptio.Checkpointer(OPTS)
        with _run("shm://a", range(3), ck_a):
            pass
        ck_a.close()
        before = len(counting.written)
        mgr_b.save(3, _state(3))
        wrote = [n for n in counting.written[before:] if n.startswith("data-")]
        assert not wrote, f"closing another Checkpointer unmapped this tier's slots: {wrote}"
        assert_same(ck_b.load(mgr_b.path(3)), _state(3))
    finally:
        mgr_b.close()
        ck_b.close()


def test_a_second_root_at_one_location_shares_the_first_ones_mappings(shm: str) -> None:
    """Two managers' roots at one location through one Checkpointer: one Mappings, so a save
    of either takes the slots the other mapped; a step's store carries it."""
    ck = ckptio.Checkpointer(OPTS)
    try:
        where = checkpoint_path("shm://same")
        first, second = LocalRoot(where, slots=True), LocalRoot(where, slots=True)
        ck.resources().serve(first)
        ck.resources().serve(second)
        assert second.mappings is first.mappings
        store = ck.resources().served(LocalStore(first.path(7)))
        assert isinstance(store, LocalStore) and store.mappings is first.mappings
        elsewhere = ck.resources().served(LocalStore(os.path.join(str(shm), "other", "step-7")))
        assert isinstance(elsewhere, LocalStore) and elsewhere.mappings is None
    finally:
        ck.close()
