"""A steady save runs no Python per tensor in ckptio, on the training thread or in the background
(issue 65): Python calls counted with the interpreter's profile hook
(ckptio/testing/callcount.py), at two state sizes, so that the per-tensor slope shows whatever
the machine's load. Before: about 20 calls of ckptio's per tensor in an eager save's call (the
capture's checks and memmove, one by one), 16 in the background (a hasher per entry), 32 in a
lazy save's background. The capture's run of small host tensors (capture_window.put_run,
buffers.move_many) must copy exactly what put() copies one by one: compared byte by byte on
buffers full of stale bytes, with every case put() leaves to another path in the middle."""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptio
from ckptio.io.buffers import Buffer
from ckptio.saving.capture_window import MEMMOVE_MAX_NBYTES, Window
from ckptio.testing.callcount import CallCounts, since

_names = itertools.count()


def _state(tensors: int, adamw: bool = False) -> tuple[dict[str, Any], torch.optim.Optimizer]:
    model = torch.nn.ModuleList(torch.nn.Linear(4, 4, bias=False) for _ in range(tensors // 2))
    opt: torch.optim.Optimizer = (torch.optim.AdamW(model.parameters(), lr=1e-3) if adamw else
                                  torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    for param in model.parameters():
        param.grad = torch.ones_like(param)
    opt.step()
    return {"model": model, "optim": opt, "step": 3}, opt


def _saver(where: str, root: Path | None) -> tuple[Any, Callable[..., Any]]:
    """(what to close, save(step, state, **extra) -> its handle): a manager over a memory tier
    ("shm") or a disk tier ("disk", under ``root``), or a plain Checkpointer's async_save into
    a directory per step under ``root`` ("plain": the staging pool's capture)."""
    if where == "plain":
        assert root is not None
        ck = ckptio.Checkpointer()
        return ck, lambda step, state, **extra: ck.async_save(state, str(root / f"s{step}"),
                                                              **extra)
    location = (f"shm://calls{next(_names)}" if where == "shm" else
                str(root / f"tier{next(_names)}") if root is not None else "")
    mgr = ckptio.CheckpointManager(tiers=[ckptio.Tier(location, keep_last=2)])
    return mgr, lambda step, state, **extra: mgr.save(step, state, asynchronous=True, **extra)


def _per_save(tensors: int, lazy: bool, saves: int = 3, where: str = "shm",
              root: Path | None = None) -> dict[str, float]:
    """ckptio's calls per steady save: in the call (the training thread) and in every other
    thread, over ``saves`` saves (``_saver``'s ``where``), a save every step."""
    state, opt = _state(tensors)
    calls = CallCounts()
    calls.install()  # before the threads start
    owner, save = _saver(where, root)
    extra: dict[str, Any] = {"lazy": True, "optimizers": [opt]} if lazy else {}
    out = {"call": 0.0, "background": 0.0}
    try:
        for step in range(1, 5):  # the first saves plan; the later ones reuse the plan
            handle = save(step, state, **extra)
            opt.step()
        handle.wait()
        start = calls.snapshot()
        for step in range(5, 5 + saves):
            before = calls.snapshot()
            handle = save(step, state, **extra)
            out["call"] += since(before, calls.snapshot()).get(("MainThread", "ckptio"), 0)
            opt.step()
        handle.wait()
        out["background"] = sum(n for (thread, where_), n in
                                since(start, calls.snapshot()).items()
                                if thread != "MainThread" and where_ == "ckptio")
    finally:
        calls.uninstall()
        owner.close()
    return {k: v / saves for k, v in out.items()}


@pytest.mark.usefixtures("shm")
@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_a_steady_save_runs_no_python_per_tensor(lazy: bool) -> None:
    """ckptio's Python calls per steady save, 40 and 240 tensors: at most 2 more per added
    tensor in the call and 8 in the background (before: 20 and 16 eager, 13 and 32 lazy)."""
    small, large = _per_save(40, lazy), _per_save(240, lazy)
    slope = {k: (large[k] - small[k]) / 200 for k in small}
    assert slope["call"] <= 2, (small, large)
    assert slope["background"] <= 8, (small, large)


@pytest.mark.parametrize(("where", "lazy"), [("plain", False), ("plain", True),
                                             ("disk", False)])
def test_a_steady_save_through_the_pool_runs_no_python_per_tensor(tmp_path: Path, where: str,
                                                                  lazy: bool) -> None:
    """The staging pool's capture (a plain Checkpointer's async_save to a directory, a
    manager's disk tier): at most 2 calls of ckptio's per added tensor, in the call and in the
    background (before: about 14 in the call of an eager save, or in the background of a lazy
    one: section 16's groups per dtype, a few calls per tensor)."""
    small = _per_save(40, lazy, where=where, root=tmp_path / "small")
    large = _per_save(240, lazy, where=where, root=tmp_path / "large")
    slope = {k: (large[k] - small[k]) / 200 for k in small}
    assert slope["call"] <= 2, (small, large)
    assert slope["background"] <= 2, (small, large)


@pytest.mark.usefixtures("shm")
@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_a_steady_save_runs_little_python_per_save(lazy: bool) -> None:
    """ckptio's Python calls per steady save into a memory tier, whatever the state's size: at
    most 800 in the call and 560 in the background, 240 tensors (before: about 1,100 and 650
    eager, 1,100 and 750 lazy: the I/O profile file looked up twice per save, the mount table
    parsed each time although no profile file exists, each committed step's listing through a
    Store, a lazy save's optimizer state read value by value)."""
    counts = _per_save(240, lazy)
    assert counts["call"] <= 800, counts
    assert counts["background"] <= 560, counts


@pytest.mark.usefixtures("shm")
@pytest.mark.parametrize("where", ["shm", "disk", "plain"])
@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_steady_saves_restore_bitwise(tmp_path: Path, lazy: bool, where: str) -> None:
    """Steady saves (a memory tier's mapped files, a disk tier's and a plain Checkpointer's
    staging pool) of small tensors of many dtypes (padding between them), a transposed one, a
    conjugate view, an inference tensor, an empty one and one larger than a memmove's limit
    among them, and AdamW: each restored step is the state as saved, bitwise."""
    state, opt = _state(60, adamw=True)
    with torch.inference_mode():
        frozen = torch.arange(7, dtype=torch.int16)
    extra = {
        "i8": [torch.arange(k + 1, dtype=torch.int8) for k in range(13)],
        "bits": torch.tensor([True, False, True]), "bf16": torch.randn(5).bfloat16(),
        "f64": torch.randn(3, dtype=torch.float64), "t": torch.randn(6, 4).t(),
        "conj": torch.randn(4, dtype=torch.complex64).conj(), "inference": frozen,
        "empty": torch.empty(0, 3), "big": torch.randn(MEMMOVE_MAX_NBYTES // 4 + 3),
        "tail": [torch.randn(3, 3) for _ in range(9)],
    }
    state["extra"] = extra
    kept: dict[int, dict[str, Any]] = {}
    owner, save = _saver(where, tmp_path)
    try:
        for step in range(1, 7):
            for t in extra["i8"]:
                t.add_(1)
            extra["tail"][step % 9].mul_(-1.5)
            extra["big"][step] = float(step)
            handle = save(step, state, lazy=lazy, optimizers=[opt] if lazy else ())
            kept[step] = {  # what the save holds: the state as it is before the step
                "model": {k: v.clone() for k, v in state["model"].state_dict().items()},
                "optim": copy.deepcopy(opt.state_dict()["state"]),
                "extra": {k: ([x.clone() for x in v] if isinstance(v, list) else v.clone())
                          for k, v in extra.items()}}
            opt.step()
        handle.wait()
        for step in (5, 6):
            loaded = ckptio.load(str(tmp_path / f"s{step}") if where == "plain" else
                                 owner.path(step))
            want = kept[step]
            for key, value in want["model"].items():
                assert _same(loaded["model"][key], value), (step, key)
            for index, moments in want["optim"].items():
                for name, value in moments.items():
                    assert _same(loaded["optim"]["state"][index][name], value), (step, name)
            for key, value in want["extra"].items():
                got = loaded["extra"][key]
                pairs = zip(got, value, strict=True) if isinstance(value, list) else [(got, value)]
                assert all(_same(a, b) for a, b in pairs), (step, key)
    finally:
        owner.close()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bytes, dtype and shape (the values as row-major elements, resolved views)."""
    a, b = a.resolve_conj().contiguous(), b.resolve_conj().contiguous()
    return (a.dtype == b.dtype and a.shape == b.shape
            and bytes(a.view(-1).view(torch.uint8).numpy()) ==
            bytes(b.view(-1).view(torch.uint8).numpy()))


class _Item:
    def __init__(self, t: torch.Tensor) -> None:
        self.nbytes, self.dtype = t.nbytes, str(t.dtype).removeprefix("torch.")


class _Sink:
    """A window's target: one region of stale bytes, hand-offs recorded."""

    async_copies = False

    def __init__(self, nbytes: int, mapped: object | None) -> None:
        # not None: a mapped save (put() copies one by one); None: the pool's buffers (put()
        # groups the small host tensors per dtype, copied at the hand-off)
        self.mapped = mapped
        self.bytes = bytearray(b"\xa5" * nbytes)
        self.handed: list[tuple[int, int, list[tuple[int, int, int]]]] = []

    def region(self, _file: int, start: int) -> Buffer:
        view = memoryview(self.bytes)[start:]
        if not len(view):
            return Buffer(0, memoryview(bytearray()), torch.empty(0, dtype=torch.uint8))
        return Buffer(0, view, torch.frombuffer(view, dtype=torch.uint8))

    def release(self, _buffer: Buffer) -> None:
        pass

    def hand_off(self, _file: int, offset: int, _buffer: Buffer, nbytes: int,
                 pieces: list[tuple[int, int, int]]) -> None:
        self.handed.append((offset, nbytes, list(pieces)))


@pytest.mark.parametrize("mapped", [True, False], ids=["mapped", "pool"])
def test_a_run_copies_what_put_copies_one_by_one(mapped: bool) -> None:
    """Window.put_run over a run with every case put() handles otherwise in it (a transposed,
    a conjugate, an inference, an empty, a too large, a subclass's tensor) and padding between:
    the same bytes in a buffer of stale bytes, the same pieces, as put() item by item, into a
    mapped save's region and into a pool buffer (where put() groups small tensors per dtype)."""
    with torch.inference_mode():
        frozen = torch.arange(5, dtype=torch.int32)

    class Sub(torch.Tensor):
        pass

    sources = [torch.arange(k + 1, dtype=torch.int8) for k in range(5)] + [
        torch.randn(4, 3).t(), torch.randn(3, dtype=torch.complex64).conj(), frozen,
        torch.randn(2, 2).as_subclass(Sub), torch.tensor([True, False]),
        torch.randn(3).bfloat16(), torch.randn(MEMMOVE_MAX_NBYTES // 8 + 1, dtype=torch.float64),
        torch.nn.Parameter(torch.randn(3, 3)), torch.empty(0)] + [
        torch.randn(2) for _ in range(6)]
    items = [_Item(t) for t in sources]
    offsets, at = [], 0
    for item in items:
        at = -(-at // 64) * 64
        offsets.append(at)
        at += item.nbytes
    total = -(-at // 4096) * 4096
    target = object() if mapped else None
    one, run = _Sink(total, target), _Sink(total, target)
    window = Window(one, 0)
    for index, (offset, item, source) in enumerate(zip(offsets, items, sources, strict=True)):
        window.put(offset, item, source, index)
    window.close(total)
    sizes = [item.nbytes for item in items]
    ends = [o + n for o, n in zip(offsets, sizes, strict=True)]
    dtypes = [t.dtype for t in sources]
    window, first, taken = Window(run, 0), 0, 0
    while first < len(items):
        took = window.put_run(offsets, sizes, ends, sources, dtypes, first, len(items), first)
        taken += took
        if not took:
            window.put(offsets[first], items[first], sources[first], first)
            took = 1
        first += took
    window.close(total)
    assert taken >= 8  # the runs took most of them
    assert run.bytes == one.bytes
    assert run.handed == one.handed
