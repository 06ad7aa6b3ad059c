"""A save in steady state leaves no per-leaf Python objects alive for the collector (issue 65):
objects that outlive a save call are promoted to the collector's oldest generation, and
thousands of them per save made the interpreter run full collections (tenths of a second each,
inside the training loop) every few saves. Counted with the collector's own list of tracked
objects: those a steady save creates and leaves alive once it has completed (what it keeps
into the next step) must not grow with the number of leaves. Tensors are left out of the
count: a module's state_dict() makes a fresh detached alias of each parameter every call,
which the save holds until its bytes are copied. The objects a save in flight holds in its
background thread are not counted either."""

from __future__ import annotations

import gc
import itertools
from collections.abc import Callable

import pytest
import torch

import ckptio

_names = itertools.count()


def _state(tensors: int) -> tuple[dict[str, object], torch.optim.Optimizer]:
    """A ModuleList of tensors / 2 small Linear layers and SGD with momentum (one step taken:
    a momentum buffer per parameter), so the state has ``tensors`` tensors and, in the
    optimizer's param groups, about as many Python values."""
    model = torch.nn.ModuleList(torch.nn.Linear(4, 4, bias=False) for _ in range(tensors // 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    opt.step()
    return {"model": model, "optim": opt, "step": 3}, opt


def _left_alive(save: Callable[[int], None], settle: Callable[[], None]) -> int:
    """Objects (not tensors) that one steady save creates and leaves alive once completed."""
    for step in range(1, 5):  # the first saves plan; the later ones reuse the plan
        save(step)
    settle()
    gc.collect()
    gc.disable()
    try:
        before = {id(o) for o in gc.get_objects()}
        save(10)
        settle()
        return sum(1 for o in gc.get_objects()
                   if id(o) not in before and not isinstance(o, torch.Tensor))
    finally:
        gc.enable()


def _manager(tensors: int, lazy: bool) -> int:
    state, opt = _state(tensors)
    mgr = ckptio.CheckpointManager(tiers=[ckptio.Tier(f"shm://gcsurv{next(_names)}", keep_last=2)])
    try:
        return _left_alive(lambda step: (mgr.save(step, state, lazy=lazy, asynchronous=True,
                                                  optimizers=[opt] if lazy else ()),
                                         opt.step()) and None, mgr.wait)
    finally:
        mgr.close()


def _checkpointer(tensors: int, lazy: bool, root: str) -> int:
    state, opt = _state(tensors)
    ck = ckptio.Checkpointer()
    handles: list[ckptio.SaveHandle] = []

    def save(step: int) -> None:
        settle()
        handles.append(ck.async_save(state, f"{root}/s{step % 3}", lazy=lazy,
                                     optimizers=[opt] if lazy else ()))
        opt.step()

    def settle() -> None:
        while handles:
            handles.pop().wait()

    try:
        return _left_alive(save, settle)
    finally:
        settle()
        ck.close()


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_a_manager_save_leaves_no_per_leaf_objects_alive(lazy, shm):
    """Before: about 5 objects per leaf (the tree, each object leaf's entry and its encoded
    value) outlived each call; now a few hundred at most, the same for 200 and 1,000 tensors."""
    small, large = _manager(200, lazy), _manager(1000, lazy)
    assert large < 400 and large - small < 50, (small, large)


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_a_checkpointer_save_leaves_no_per_leaf_objects_alive(lazy, tmp_path):
    small = _checkpointer(200, lazy, str(tmp_path / "a"))
    large = _checkpointer(1000, lazy, str(tmp_path / "b"))
    assert large < 400 and large - small < 50, (small, large)


def test_the_objects_alive_do_not_grow_over_fifty_saves(shm):
    """Objects the collector tracks, counted after a full collection: the same after 50 more
    saves as after 10 (nothing kept per save)."""
    state, opt = _state(400)
    mgr = ckptio.CheckpointManager(tiers=[ckptio.Tier(f"shm://gcsurv{next(_names)}", keep_last=2)])
    counts = []
    try:
        for step in range(1, 61):
            mgr.save(step, state, lazy=True, optimizers=[opt])
            opt.step()
            if step in (10, 60):
                mgr.wait()
                gc.collect()
                counts.append(len(gc.get_objects()))
    finally:
        mgr.close()
    assert counts[1] - counts[0] < 100, counts


def _promoted(lazy: bool, saves: int) -> tuple[int, int]:
    """Objects moved to the collector's oldest generation by the generation-1 collections
    during ``saves`` steady saves of a 1,000-tensor state: (not tensors, tensors)."""
    state, opt = _state(1000)
    mgr = ckptio.CheckpointManager(tiers=[ckptio.Tier(f"shm://gcsurv{next(_names)}", keep_last=2)])
    young: list[list[object]] = []
    counts = [0, 0]

    def watch(phase: str, info: dict[str, int]) -> None:
        if info["generation"] != 1:
            return
        if phase == "start":
            young.append(gc.get_objects(0) + gc.get_objects(1))
            return
        old = {id(o) for o in gc.get_objects(2)}
        for o in young.pop():
            if id(o) in old:
                counts[isinstance(o, torch.Tensor)] += 1

    def step(n: int) -> None:
        mgr.save(n, state, lazy=lazy, asynchronous=True, optimizers=[opt] if lazy else ())
        opt.step()

    try:
        for n in range(1, 6):  # the first saves plan; the later ones reuse the plan
            step(n)
        mgr.wait()
        gc.collect()
        gc.callbacks.append(watch)
        try:
            for n in range(6, 6 + saves):
                step(n)
            mgr.wait()
        finally:
            gc.callbacks.remove(watch)
    finally:
        mgr.close()
    return counts[0], counts[1]


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_a_steady_save_promotes_no_per_leaf_objects(lazy, shm):
    """A full collection runs once the objects promoted to the oldest generation since the last
    one exceed a quarter of those there, dead since or not: what a save keeps alive while the
    young collections inside it run is what sets the collections off. Before: the flattened
    state's tree (a list per leaf) and the like, about 850 objects (not tensors) promoted per
    save of 1,000 tensors; now the state's structure is the last save's (flatten.FlatCache).
    Tensors are counted apart: a module's state_dict() makes fresh detached aliases. The count
    depends on when the young collections fall (about 2,100 alone, 4,623 once in a loaded CI
    worker): the bound is far below the code before's 17,000."""
    objects, tensors = _promoted(lazy, 20)
    assert objects < 8000, (objects, tensors)
