"""Warm-starting a changed model from a checkpoint of the old one, with its optimizer (issue 63.8).

A model and AdamW train a few steps and are saved (``ckptio.save``, and a CheckpointManager);
then a fresh process builds the model changed (a layer inserted in the middle, so every later
parameter's index in the optimizer shifts; a layer added at the end; a layer removed), a fresh
AdamW, and loads in the three forms a user tries:

* ``ckptio.load(path, state)``: refused, the error naming the parameters added and removed and
  the fixes (strict=False, keys=), not pipeline stages;
* ``keys=["model"]``: the optimizer is never looked at; strict, it names only the model's keys
  that differ; with strict=False the model's matching tensors load bit for bit and the optimizer
  stays as built;
* ``strict=False``: the model's matching tensors and the optimizer's state mapped by parameter
  name load bit for bit (the moments of ``hidden`` go to ``hidden``, whatever its index now),
  the new parameters have no state, the saved hyperparameters are back, a warning names the new
  parameters, and ``opt.step()`` runs.

In this process: a layer inserted into an nn.Sequential (the later layers renamed, one
reshaped) is named in the error, an optimizer over fewer parameters of
the same model (a frozen layer) loads with ``keys=["model"]`` strictly, and an old-layout load
(same model) still loads exactly.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptio
from ckptio.errors import StateMismatchError

MODEL_SRC = r'''
import torch
from torch import nn


class Net(nn.Module):
    """inp -> [mid] -> hidden -> out -> [extra]; ``change`` picks the model's version."""

    def __init__(self, change: str = "none") -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        if change == "middle":
            self.mid = nn.Linear(8, 8)  # registered before hidden: its indices shift by 2
        if change != "removed":
            self.hidden = nn.Linear(8, 8)
        self.out = nn.Linear(8, 3 if change == "reshaped" else 2)
        if change == "end":
            self.extra = nn.Linear(2, 2)

    def forward(self, x):
        x = self.inp(x).relu()
        for name in ("mid", "hidden"):
            if hasattr(self, name):
                x = getattr(self, name)(x).relu()
        x = self.out(x)
        return self.extra(x) if hasattr(self, "extra") else x


def train_step(model, opt):
    model(torch.randn(5, 4)).square().sum().backward()
    opt.step()
    opt.zero_grad()
'''

_ns: dict[str, Any] = {}
exec(MODEL_SRC, _ns)
Net, train_step = _ns["Net"], _ns["train_step"]

# The fresh process: for each change, each form of load into a freshly built model and AdamW
# (another lr than saved); prints one JSON line of what happened.
CHILD = MODEL_SRC + r'''
import json, sys, warnings
import ckptio

path, how, ref_path, changes = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4].split(",")
ref = torch.load(ref_path)
FORMS = {"default": {}, "keys": {"keys": ["model"]},
         "keys_nonstrict": {"keys": ["model"], "strict": False}, "nonstrict": {"strict": False}}
out = {}
for change in changes:
    for form, kwargs in FORMS.items():
        torch.manual_seed(7)
        model = Net(change)
        opt = torch.optim.AdamW(model.parameters(), lr=0.5)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        state = {"model": model, "optim": opt}
        row = {}
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            try:
                if how == "manager":
                    row["step"] = ckptio.CheckpointManager(path).restore(state, **kwargs)
                else:
                    ckptio.load(path, state, **kwargs)
            except ckptio.CkptError as exc:
                row["error"] = f"{type(exc).__name__}: {exc}"
        row["warnings"] = [str(w.message) for w in said]
        names = dict(model.named_parameters())
        row["loaded"] = sorted(n for n, p in names.items()
                               if n in ref["params"] and torch.equal(p, ref["params"][n]))
        row["untouched"] = sorted(n for n, p in names.items() if torch.equal(p, before[n]))
        row["moments"] = sorted(
            n for n, p in names.items() if p in opt.state and n in ref["state"]
            and all(torch.equal(opt.state[p][k], v) for k, v in ref["state"][n].items()))
        row["with_state"] = sorted(n for n, p in names.items() if p in opt.state)
        row["lr"] = opt.param_groups[0]["lr"]
        if "error" not in row:
            train_step(model, opt)  # the next step runs
            row["after_step"] = sorted(n for n, p in names.items() if p in opt.state)
        out[f"{change}/{form}"] = row
print(json.dumps(out))
'''

SAVED = ["inp.weight", "inp.bias", "hidden.weight", "hidden.bias", "out.weight", "out.bias"]


def _train() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for _ in range(3):
        train_step(model, opt)
    return model, opt


def _fresh_process_loads(how: str, root: Path) -> dict[str, dict[str, Any]]:
    """Train, save (``how``: ckptio.save or a manager), run the fresh process -> its rows."""
    model, opt = _train()
    state = {"model": model, "optim": opt}
    path = str(root / ("run" if how == "manager" else "ckpt"))
    if how == "manager":
        manager = ckptio.CheckpointManager(path)
        manager.save(3, state)
        manager.close()
    else:
        ckptio.save(state, path)
    names = dict(model.named_parameters())
    ref = {"params": {n: p.detach().clone() for n, p in names.items()},
           "state": {n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in names.items()}}
    torch.save(ref, root / "ref.pt")
    changes = ",".join(c for h, c in CASES if h == how)
    done = subprocess.run([sys.executable, "-c", CHILD, path, how, str(root / "ref.pt"), changes],
                          capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


CASES = [("save", "middle"), ("save", "end"), ("save", "removed"), ("manager", "middle")]


@pytest.fixture(scope="module")
def fresh_loads(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """how -> the fresh process's rows ("<change>/<form>" -> what happened), run once each."""
    done: dict[str, dict[str, dict[str, Any]]] = {}

    def rows(how: str) -> dict[str, dict[str, Any]]:
        if how not in done:
            done[how] = _fresh_process_loads(how, tmp_path_factory.mktemp(f"warm-{how}"))
        return done[how]
    return rows


ADDED = {"middle": ["mid.weight", "mid.bias"], "end": ["extra.weight", "extra.bias"],
         "removed": []}
REMOVED = {"middle": [], "end": [], "removed": ["hidden.weight", "hidden.bias"]}


@pytest.mark.parametrize(("how", "change"), CASES)
def test_the_default_load_says_which_parameters_changed_and_the_fixes(fresh_loads: Any, how: str, change: str) -> None:
    loads = fresh_loads(how)
    row = loads[f"{change}/default"]
    error = row["error"]
    assert error.startswith("StateMismatchError"), error
    assert "key 'optim': the model's parameters changed since the save" in error, error
    if ADDED[change]:
        assert f"added {ADDED[change]}" in error, error
    if REMOVED[change]:
        assert f"removed {REMOVED[change]}" in error, error
    assert "strict=False" in error and "keys=['model']" in error, error
    assert ("added parameters start with none" in error) == bool(ADDED[change]), error
    assert ("removed ones' state is left out" in error) == bool(REMOVED[change]), error
    assert "pipeline" not in error, error
    assert row["with_state"] == [] and row["lr"] == 0.5  # nothing was loaded
    assert sorted(row["untouched"]) == sorted(ADDED[change] + [n for n in SAVED
                                                               if n not in REMOVED[change]])


@pytest.mark.parametrize(("how", "change"), CASES)
def test_keys_model_never_looks_at_the_optimizer(fresh_loads: Any, how: str, change: str) -> None:
    loads = fresh_loads(how)
    strict = loads[f"{change}/keys"]["error"]
    assert strict.startswith("StateMismatchError: ") and "optim" not in strict, strict
    assert "state and checkpoint keys differ" in strict, strict
    for name in ADDED[change]:
        assert f"'model.{name}'" in strict, strict
    for name in REMOVED[change]:
        assert f"'model.{name}'" in strict, strict
    row = loads[f"{change}/keys_nonstrict"]
    assert "error" not in row, row
    kept = [n for n in SAVED if n not in REMOVED[change]]
    assert row["loaded"] == sorted(kept)  # bit for bit
    assert row["with_state"] == [] and row["lr"] == 0.5  # the optimizer as it was built
    assert not any("optimizer" in w for w in row["warnings"]), row["warnings"]
    assert row["after_step"] == sorted(kept + ADDED[change])


@pytest.mark.parametrize(("how", "change"), CASES)
def test_strict_false_maps_the_optimizer_state_by_name(fresh_loads: Any, how: str, change: str) -> None:
    loads = fresh_loads(how)
    row = loads[f"{change}/nonstrict"]
    assert "error" not in row, row
    kept = sorted(n for n in SAVED if n not in REMOVED[change])
    assert row["loaded"] == kept
    assert sorted(row["untouched"]) == sorted(ADDED[change])  # new layers as built
    # every old parameter's own moments and step, bit for bit, whatever its index now
    assert row["moments"] == kept and row["with_state"] == kept
    assert row["lr"] == 0.01  # the saved hyperparameters
    said = [w for w in row["warnings"] if "the model's parameters changed" in w]
    assert len(said) == 1, row["warnings"]
    assert (f"optimizer 'optim' was loaded by parameter name ({len(kept)} parameter(s)' state)"
            in said[0]), said[0]
    if ADDED[change]:
        assert f"the new parameters {ADDED[change]} start with no optimizer state" in said[0]
    if REMOVED[change]:
        assert f"removed parameters {REMOVED[change]}" in said[0], said[0]
    assert row["after_step"] == sorted(kept + ADDED[change])  # opt.step() ran on every one


def _load(path: Any, change: str, **kwargs: Any) -> tuple[torch.nn.Module,
                                                          torch.optim.Optimizer, Any]:
    model = Net(change)
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    return model, opt, ckptio.load(path, {"model": model, "optim": opt}, **kwargs)


def test_a_layer_inserted_in_a_sequential_names_the_reshaped_ones(ckpt_dir: Path) -> None:
    """nn.Sequential names layers by position: a layer inserted renames the later ones, so
    ``1.weight`` now has another shape (its saved moments are left out) and ``2.*`` is new."""
    def build(widths: list[int]) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = torch.nn.Sequential(*[torch.nn.Linear(a, b) for a, b in zip(widths, widths[1:])])
        return model, torch.optim.AdamW(model.parameters())

    torch.manual_seed(0)
    model, opt = build([4, 8, 2])
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    ckptio.save({"model": model, "optim": opt}, ckpt_dir)
    new, new_opt = build([4, 8, 8, 2])
    state = {"model": new, "optim": new_opt}
    with pytest.raises(StateMismatchError, match=r"the model's parameters changed since the save "
                       r"\(added \['2\.weight', '2\.bias'\]; reshaped 1\.weight \(8, 8\), saved "
                       r"\(2, 8\), 1\.bias \(8,\), saved \(2,\)\)"):
        ckptio.load(ckpt_dir, state)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        ckptio.load(ckpt_dir, state, strict=False)
    text = " ".join(str(w.message) for w in said)
    assert "that of the reshaped parameters ['1.weight', '1.bias'] was left out" in text, text
    assert set(new_opt.state) == {new[0].weight, new[0].bias}
    assert torch.equal(new_opt.state[new[0].weight]["exp_avg"], opt.state[model[0].weight]["exp_avg"])
    new(torch.randn(5, 4)).sum().backward()
    new_opt.step()


def test_an_optimizer_over_fewer_parameters_loads_with_keys_model(ckpt_dir: Path) -> None:
    """A frozen layer: the model is as saved, its optimizer holds fewer parameters."""
    model, opt = _train()
    ckptio.save({"model": model, "optim": opt}, ckpt_dir)
    new = Net()
    new_opt = torch.optim.AdamW([p for n, p in new.named_parameters() if not n.startswith("inp")])
    state = {"model": new, "optim": new_opt}
    with pytest.raises(StateMismatchError, match=r"\(in the model but no longer optimized "
                       r"\(frozen\?\) \['inp\.weight', 'inp\.bias'\]\)"):  # not "removed"
        ckptio.load(ckpt_dir, state)
    report = ckptio.load(ckpt_dir, state, keys=["model"])
    assert report.missing == () and not new_opt.state
    assert all(torch.equal(a, b) for a, b in zip(new.parameters(), model.parameters()))
    with pytest.warns(UserWarning, match=r"loaded by parameter name \(4 parameter"):
        ckptio.load(ckpt_dir, state, strict=False)
    assert torch.equal(new_opt.state[new.out.weight]["exp_avg_sq"],
                       opt.state[model.out.weight]["exp_avg_sq"])
    train_step(new, new_opt)


def test_the_fix_that_leaves_the_optimizer_out_keeps_the_rest_of_the_state(
        ckpt_dir: Path) -> None:
    """The error's keys= fix names every top-level key but the optimizer's: applied as given,
    the scheduler, the step and the RNG state are restored too (a new user's trial: the
    advice keys=['model'] resumed at step 7 with the learning rate back at its warm-up and the
    RNG unrestored, with no word of it)."""
    model, opt = _train()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(3):
        sched.step()
    saved_rng = torch.get_rng_state()
    ckptio.save({"model": model, "optim": opt, "sched": sched, "step": 6, "rng": saved_rng},
                ckpt_dir)
    new = Net("end")
    new_opt = torch.optim.AdamW(new.parameters(), lr=0.5)
    new_sched = torch.optim.lr_scheduler.StepLR(new_opt, step_size=1, gamma=0.5)
    state = {"model": new, "optim": new_opt, "sched": new_sched, "step": 0,
             "rng": torch.zeros_like(saved_rng)}
    with pytest.raises(StateMismatchError) as refused:
        ckptio.load(ckpt_dir, state)
    fix = "keys=['model', 'rng', 'sched', 'step'] to leave the optimizer out"
    assert fix in str(refused.value), str(refused.value)
    report = ckptio.load(ckpt_dir, state, keys=["model", "rng", "sched", "step"], strict=False)
    assert "model.extra.weight" in report.missing, report
    assert state["step"] == 6 and torch.equal(state["rng"], saved_rng)
    assert new_sched.last_epoch == 3 and not new_opt.state


def test_the_same_model_loads_exactly_with_no_warning(ckpt_dir: Path) -> None:
    model, opt = _train()
    ckptio.save({"model": model, "optim": opt}, ckpt_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        new, new_opt, report = _load(ckpt_dir, "none")
    assert report.missing == report.unexpected == ()
    for p, q in zip(new.parameters(), model.parameters()):
        assert torch.equal(p, q)
        assert all(torch.equal(new_opt.state[p][k], v) for k, v in opt.state[q].items())


def test_regrouped_parameters_are_named_as_such(ckpt_dir: Path) -> None:
    """The same parameters split into other param groups since the save (no bias decay, say):
    the refusal says they were regrouped and how, not that the model changed with an empty
    list of changes."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    ckptio.save({"model": model, "optim": opt}, ckpt_dir)
    params = list(model.parameters())
    regrouped = torch.optim.AdamW([{"params": params[:1]}, {"params": params[1:], "weight_decay": 0.0}])
    with pytest.raises(StateMismatchError, match=r"its parameters were regrouped or reordered since "
                       r"the save \(the same parameters: saved as 1 param group\(s\) of \[4\], "
                       r"now 2 of \[1, 3\]\)") as info:
        ckptio.load(ckpt_dir, {"model": model, "optim": regrouped})
    assert "()" not in str(info.value)
    reordered = torch.optim.AdamW([*params[2:], *params[:2]])
    with pytest.raises(StateMismatchError, match=r"its parameters were reordered since the save "
                       r"\(the same parameters and groups, in another order"):
        ckptio.load(ckpt_dir, {"model": model, "optim": reordered})


def test_keys_that_differ_only_by_a_wrapper_say_so(ckpt_dir: Path) -> None:
    """A model saved wrapped (DDP's ``module.``, torch.compile's ``_orig_mod.``) and loaded
    unwrapped: every key differs, and strict=False (the fix the refusal used to suggest) would
    load none of the model's tensors. The refusal names the wrapper and the fix instead, for
    the model's keys and for its optimizer's; strict=False says why nothing was loaded."""
    class Wrapped(torch.nn.Module):
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.module = inner

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    ckptio.save({"model": Wrapped(model), "optim": opt}, ckpt_dir)
    plain = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    wrapper = r"The keys differ only by a wrapper \(saved with \['module'\], the state has none"
    with pytest.raises(StateMismatchError, match=wrapper) as info:
        ckptio.load(ckpt_dir, {"model": plain}, keys=["model"])
    assert "Pass strict=False" not in str(info.value)
    with pytest.raises(StateMismatchError, match=r"key 'optim': the model's parameters changed .*" + wrapper):
        ckptio.load(ckpt_dir, {"model": plain, "optim": torch.optim.AdamW(plain.parameters())})
    with pytest.warns(UserWarning, match=wrapper):
        ckptio.load(ckpt_dir, {"model": plain}, keys=["model"], strict=False)
    ckptio.load(ckpt_dir, {"model": Wrapped(plain), "optim": torch.optim.AdamW(plain.parameters())})
    assert torch.equal(plain[0].weight, model[0].weight)
