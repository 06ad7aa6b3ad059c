"""A steady save reuses the last save's structure (flatten.FlatCache: each plain container's
keys, dotted keys and tree node) and plan (plan.PlanCache), checked field by field (issue 65).
Neither may hide a change: each test saves a state three times with one Checkpointer (so the
caches are warm and used), changes one thing, saves again and loads that last checkpoint
fresh, which must hold the changed state bitwise (keys, key types, values, shapes)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import ckptio

SAVES = ["sync", "eager", "lazy"]


def _save_after(tmp_path: Any, state: dict[str, Any], change: Callable[[], None],
                how: str, optimizers: tuple[torch.optim.Optimizer, ...] = ()) -> Any:
    """Three warm saves, ``change()``, one more save; -> that checkpoint, loaded fresh."""
    if not optimizers:  # a lazy save needs one; this one is not part of the state
        optimizers = (torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1),)
    ck = ckptio.Checkpointer()
    try:
        for i in range(4):
            if i == 3:
                change()
            path = tmp_path / f"s{i}"
            if how == "sync":
                ck.save(state, path)
            else:
                ck.async_save(state, path, lazy=how == "lazy",
                              optimizers=optimizers if how == "lazy" else ()).wait()
    finally:
        ck.close()
    return ckptio.load(tmp_path / "s3")


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))


def _same(loaded: Any, expected: Any) -> None:
    """``loaded`` equals ``expected`` exactly: the same keys of the same types, bitwise tensors."""
    assert type(loaded) is type(expected) or all(
        isinstance(v, (dict, torch.Tensor)) for v in (loaded, expected)), (loaded, expected)
    if isinstance(expected, dict):
        assert [(type(k), k) for k in loaded] == [(type(k), k) for k in expected]
        for key, value in expected.items():
            _same(loaded[key], value)
    elif isinstance(expected, (list, tuple)):
        assert len(loaded) == len(expected)
        for got, want in zip(loaded, expected):
            _same(got, want)
    elif isinstance(expected, torch.Tensor):
        assert loaded.dtype == expected.dtype and loaded.shape == expected.shape
        assert torch.equal(loaded.view(torch.uint8) if loaded.numel() else loaded,
                           expected.detach().contiguous().view(torch.uint8)
                           if expected.numel() else expected)
    else:
        assert loaded == expected


@pytest.mark.parametrize("how", SAVES)
def test_a_registered_buffer_and_a_replaced_parameter_are_saved(tmp_path, how):
    """The module's state_dict gets a key (FlatCache: other keys) and a parameter of another
    shape at the same key (PlanCache: another signature)."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def change() -> None:
        model[0].register_buffer("scale", torch.arange(5.0))
        model[1].weight = torch.nn.Parameter(torch.full((3, 3), 7.0))

    loaded = _save_after(tmp_path, {"model": model}, change, how, (opt,))
    _same(loaded["model"], model.state_dict())
    assert loaded["model"]["0.scale"].tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("how", SAVES)
def test_changed_values_in_place_and_resized_tensors_are_saved(tmp_path, how):
    """Values written in place, a tensor resized in place (same object, new shape), a scalar
    and a list's item changed: the cached structure, the fresh values."""
    model = _model()
    extra = {"counts": [1, 2, 3], "lr": 0.5, "t": torch.zeros(4), "name": "a"}

    def change() -> None:
        with torch.no_grad():
            model[0].weight.add_(1.0)
        extra["t"].resize_(6).copy_(torch.arange(6.0))
        extra["counts"][2] = 9
        extra["lr"] = -0.0
        extra["name"] = "b"

    loaded = _save_after(tmp_path, {"model": model, "extra": extra}, change, how)
    _same(loaded["model"], model.state_dict())
    _same(loaded["extra"], extra)
    assert str(loaded["extra"]["lr"]) == "-0.0"


@pytest.mark.parametrize("how", SAVES)
def test_a_key_of_another_type_and_a_list_of_another_length_are_saved(tmp_path, how):
    """The same dotted keys from other key types ("1" and 1), a list grown, a leaf that becomes
    a container and a dict of dicts that gains an inner key."""
    state: dict[str, Any] = {"d": {"1": torch.ones(2), 2: 3}, "l": [1, 2], "x": 5,
                             "dd": {0: {"m": torch.zeros(2)}, 1: {"m": torch.ones(2)}}}

    def change() -> None:
        state["d"] = {1: torch.full((2,), 4.0), "2": 3}
        state["l"].append(3)
        state["x"] = {"y": 6}
        state["dd"][1]["v"] = torch.full((3,), 2.0)

    loaded = _save_after(tmp_path, state, change, how)
    _same(loaded, state)


@pytest.mark.parametrize("how", SAVES)
def test_an_optimizers_new_state_and_a_state_dict_hook_are_seen(tmp_path, how):
    """An optimizer's state gains entries (momentum turned on, a step taken) and a module's
    state_dict hook changes what it returns on every call: each save runs it afresh."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    calls = [0]

    def hook(module: Any, state_dict: dict[str, Any], prefix: str, local: Any) -> None:
        calls[0] += 1
        state_dict[prefix + "calls"] = torch.tensor([calls[0]])

    model[1].register_state_dict_post_hook(hook)

    def change() -> None:
        opt.param_groups[0]["momentum"] = 0.9
        for param in model.parameters():
            param.grad = torch.ones_like(param)
        opt.step()

    loaded = _save_after(tmp_path, {"model": model, "optim": opt}, change, how, (opt,))
    _same(loaded["model"]["0.weight"], model[0].weight)
    assert loaded["model"]["1.calls"].tolist() == [calls[0]] and calls[0] >= 4
    expected = opt.state_dict()
    _same(loaded["optim"]["state"], expected["state"])
    assert loaded["optim"]["param_groups"][0]["momentum"] == 0.9
