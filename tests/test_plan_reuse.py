"""A steady save proves its plan unchanged with one pass per field over all tensors at once
(planning/reuse.py) and copies its small host tensors with one call per dtype
(saving/grouped.py), issue 65: no Python line runs per tensor in the plan's check, the
capture issues one copy per dtype group (counted with a TorchFunctionMode), and no change
after ten saves goes unnoticed (each changed checkpoint is loaded back bitwise)."""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

import ckptio


def _lines_in(folder: str, call: Callable[[], Any]) -> int:
    """Python line events ``call`` runs in files under ckptio/``folder`` on this thread."""
    counts: Counter[str] = Counter()
    part = f"ckptio/{folder}/"

    def local(frame: Any, event: str, _arg: Any) -> Any:
        if event == "line":
            counts[frame.f_code.co_filename] += 1
        return local

    def tracer(frame: Any, _event: str, _arg: Any) -> Any:
        return local if part in frame.f_code.co_filename.replace("\\", "/") else None

    sys.settrace(tracer)
    try:
        call()
    finally:
        sys.settrace(None)
    return sum(counts.values())


def _state(tensors: int) -> dict[str, Any]:
    torch.manual_seed(0)
    return {"model": {f"w{i}": torch.randn(4, 4) for i in range(tensors)}, "step": 3,
            "lr": 0.5, "name": "run"}


def test_the_reused_plan_runs_no_python_line_per_tensor(tmp_path: Path) -> None:
    """Steady saves of 40 and of 400 tensors run about the same number of Python lines in
    planning/ (before: a loop over every leaf, about ten lines per tensor)."""
    lines = {}
    for tensors in (40, 400):
        state = _state(tensors)
        ck = ckptio.Checkpointer()
        try:
            for i in range(3):
                ck.save(state, tmp_path / f"{tensors}-{i}")
            lines[tensors] = _lines_in("planning", lambda: ck.async_save(
                state, tmp_path / f"{tensors}-t").wait())
        finally:
            ck.close()
    assert lines[400] - lines[40] < 100, lines


class _Copies(TorchFunctionMode):
    """Counts the torch copy calls made from Python and the tensors each copies."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, int]] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", str(func))
        if "copy" in name:
            self.calls.append((name, len(args[0]) if isinstance(args[0], (list, tuple)) else 1))
        return func(*args, **(kwargs or {}))


def test_the_capture_copies_each_dtype_group_with_one_call(tmp_path: Path) -> None:
    """300 small float32 and 200 small int64 host tensors: no torch copy call (runs of
    memmoves read by ``map``, capture_window.Window.put_run; before section 16, a memmove per
    tensor by Python, then one copy call per dtype); 50 small transposed ones, which a run
    refuses: one copy call for all of them (their dtype's group); the checkpoint loads
    bitwise."""
    state = {"f": [torch.randn(8, 8) for _ in range(300)],
             "i": [torch.arange(16) * k for k in range(200)],
             "t": [torch.randn(4, 6).t() for _ in range(50)]}
    ck = ckptio.Checkpointer()
    try:
        ck.save(state, tmp_path / "warm")
        with _Copies() as copies:
            ck.save(state, tmp_path / "s")
    finally:
        ck.close()
    foreach = sorted(n for name, n in copies.calls if name.endswith("_foreach_copy_"))
    assert foreach == [50], copies.calls
    assert len(copies.calls) == 1, copies.calls  # no per-tensor copy besides
    loaded = ckptio.load(tmp_path / "s")
    for key in ("f", "i", "t"):
        assert all(torch.equal(a, b) for a, b in zip(loaded[key], state[key], strict=True))


def _tie(state: dict[str, Any]) -> None:
    state["model"]["w1"] = state["model"]["w0"]


def _untie_after(state: dict[str, Any]) -> None:
    state["model"]["w1"] = state["model"]["w1"].clone()


CHANGES: dict[str, Callable[[dict[str, Any]], None]] = {
    "dtype": lambda s: s["model"].__setitem__("w2", s["model"]["w2"].double()),
    "shape, resized in place": lambda s: s["model"]["w3"].resize_(2, 8),
    "new key": lambda s: s["model"].__setitem__("w9x", torch.full((4, 4), 9.0)),
    "transposed, same shape": lambda s: s["model"].__setitem__("w4", s["model"]["w4"].t()),
    "tied to another key": _tie,
    "replaced by another tensor": lambda s: s["model"].__setitem__("w5", torch.randn(4, 4)),
    "a view at another offset": lambda s: s["model"].__setitem__(
        "w6", torch.randn(32)[16:].view(4, 4)),
    "int to bool": lambda s: s.__setitem__("step", True),
    "float to -0.0": lambda s: s.__setitem__("lr", -0.0),
    "a str to None": lambda s: s.__setitem__("name", None),
}


@pytest.mark.parametrize("change", list(CHANGES))
@pytest.mark.parametrize("how", ["sync", "eager"])
def test_a_change_after_ten_saves_is_saved_bitwise(tmp_path: Path, change: str, how: str) -> None:
    """Ten saves warm the plan's record; one change; the next save holds it bitwise, and the
    save after it (the record made again) too."""
    state = _state(8)
    ck = ckptio.Checkpointer()
    try:
        for i in range(12):
            if i == 10:
                CHANGES[change](state)
            if how == "sync":
                ck.save(state, tmp_path / f"s{i}")
            else:
                ck.async_save(state, tmp_path / f"s{i}").wait()
    finally:
        ck.close()
    for i in (10, 11):
        loaded = ckptio.load(tmp_path / f"s{i}")
        assert list(loaded["model"]) == list(state["model"])
        for key, want in state["model"].items():
            got = loaded["model"][key]
            assert got.dtype == want.dtype and got.shape == want.shape, key
            assert torch.equal(got.contiguous().view(torch.uint8),
                               want.contiguous().view(torch.uint8)), key
        for key in ("step", "lr", "name"):
            assert type(loaded[key]) is type(state[key]) and loaded[key] == state[key], key
        assert str(loaded["lr"]) == str(state["lr"])  # -0.0 stays -0.0
    if change == "tied to another key":
        loaded = ckptio.load(tmp_path / "s11")
        assert loaded["model"]["w1"] is loaded["model"]["w0"]  # stored once, as an alias


def test_untying_after_ten_tied_saves_is_noticed(tmp_path: Path) -> None:
    """Two keys of one tensor for ten saves, then two tensors: each is saved with its own
    values."""
    state = _state(4)
    _tie(state)
    ck = ckptio.Checkpointer()
    try:
        for i in range(11):
            if i == 10:
                _untie_after(state)
                state["model"]["w1"].add_(1.0)
            ck.save(state, tmp_path / f"s{i}")
    finally:
        ck.close()
    loaded = ckptio.load(tmp_path / "s10")
    assert loaded["model"]["w1"] is not loaded["model"]["w0"]
    assert torch.equal(loaded["model"]["w1"], state["model"]["w1"])
    assert torch.equal(loaded["model"]["w0"], state["model"]["w0"])


def test_a_lazy_saves_small_tensors_are_copied_before_its_call_returns(tmp_path: Path) -> None:
    """The tensors no optimizer owns are grouped too: a lazy save's call returns once their
    copies are made, so changing them right after the call does not reach the checkpoint (the
    optimizer's large parameter after them is still being copied then)."""
    model = torch.nn.Sequential(*(torch.nn.Linear(2048, 2048, bias=False) for _ in range(6)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    extra = [torch.full((8,), float(i)) for i in range(50)]
    state = {"model": model, "optim": opt, "extra": extra}
    ck = ckptio.Checkpointer()
    try:
        for i in range(3):
            handle = ck.async_save(state, tmp_path / f"s{i}", lazy=True, optimizers=[opt])
            for t in extra:
                t.add_(100.0)
            handle.wait()
    finally:
        ck.close()
    loaded = ckptio.load(tmp_path / "s2")
    assert [t[0].item() for t in loaded["extra"]] == [200.0 + i for i in range(50)]
