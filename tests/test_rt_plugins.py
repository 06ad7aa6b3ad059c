"""Resuming after the user changed the model or its optimizer between runs (red team: plugins).

A run trains a small model with AdamW and saves it through a CheckpointManager; the next run
builds something else and restores:

- another kind of optimizer (SGD where AdamW saved): a strict restore refuses, naming the
  hyperparameters each side has alone and the fix (keys= the other top-level keys); a
  strict=False load leaves the optimizer as built (its own learning rate, weight decay and no
  state), loads the model and reports the optimizer in ``LoadReport.mismatched``, where it used
  to hand SGD AdamW's learning rate, weight decay and moments without a word; its learning-rate
  scheduler is left out with it (its saved base learning rates are AdamW's). Adam and AdamW
  (the same hyperparameter names), and a group holding one hyperparameter more (a torch
  release adding one) with no scheduler's ``initial_lr`` beside it, are not taken for another
  kind;
- the model in bfloat16 where float32 was saved, strict=False without cast: the weights stay
  as built and so does their optimizer state (it used to be the saved run's moments and step,
  applied to weights that were not loaded); with cast=True both load; the same where a layer
  was also inserted (the optimizer mapped by parameter name);
- a layer added or every parameter renamed, ``restore(state, strict=False)``: the manager
  returns only the step, so the keys left as built were said nowhere (the load's LoadReport
  was dropped): a warning names them at the user's line and ``last_restore["report"]`` is the
  LoadReport (also for ``restore(state, step=N)``); a state whose every key was renamed is
  told so, not that an empty container is not filled;
- the HF Trainer with a bfloat16 model: refused in the Trainer's terms, without offering
  cast=True, which the Trainer cannot pass;
- the HF Trainer with another layer frozen (the same number of trainable parameters): the
  optimizer is loaded without the model, so ckptio could not check its parameters' names, and
  torch loaded the state by index: parameters got their neighbours' moments, and the next
  fused AdamW step died of SIGSEGV. Refused now, naming the parameters.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import ckptio


def _build(dtype: torch.dtype = torch.float32) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).to(dtype)


def _trained_run(where: Path) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Three AdamW steps (and a schedule) saved at step 3 of a manager in ``where`` (a path
    with a space)."""
    model = _build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 0.5 ** epoch)
    for _ in range(3):
        model(torch.randn(5, 4)).pow(2).sum().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    manager = ckptio.CheckpointManager(where)
    manager.save(3, {"model": model, "optim": opt, "sched": sched}, force=True)
    manager.close()
    return model, opt


@pytest.fixture
def run(tmp_path: Path) -> tuple[Path, nn.Module, torch.optim.Optimizer]:
    where = tmp_path / "my run"
    return (where, *_trained_run(where))


def test_another_kind_of_optimizer_is_refused_naming_what_differs_and_the_fix(run) -> None:
    where, _, _ = run
    model = _build()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(sgd, lambda epoch: 0.5 ** epoch)
    manager = ckptio.CheckpointManager(where)
    with pytest.raises(ckptio.StateMismatchError) as err:
        manager.restore({"model": model, "optim": sgd, "sched": sched})
    manager.close()
    text = str(err.value)
    for said in ("'optim'", "SGD", "betas", "momentum", "another kind of optimizer",
                 "keys=['model']", "strict=False"):
        assert said in text, text
    assert sgd.state_dict()["state"] == {}
    assert sgd.param_groups[0]["lr"] == 0.1 and sgd.param_groups[0]["weight_decay"] == 0


def test_another_kind_of_optimizer_by_name_is_refused_too(tmp_path: Path) -> None:
    model = _build()
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4)).sum().backward()
    adamw.step()
    ckptio.save({"model": model, "optim": ckptio.OptimizerState(model, adamw)}, tmp_path / "c")
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = {"model": model, "optim": ckptio.OptimizerState(model, sgd)}
    with pytest.raises(ckptio.StateMismatchError, match=r"'optim'.*\['dampening', 'momentum'"):
        ckptio.load(tmp_path / "c", state)
    with pytest.warns(UserWarning, match="another kind of optimizer"):
        report = ckptio.load(tmp_path / "c", state, strict=False)
    assert sgd.state_dict()["state"] == {} and sgd.param_groups[0]["lr"] == 0.1
    assert [m.split(":")[0] for m in report.mismatched] == ["optim"]


def test_strict_false_leaves_another_kind_of_optimizer_as_built_and_reports_it(run) -> None:
    where, saved, _ = run
    model = _build()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(sgd, lambda epoch: 0.5 ** epoch)
    with pytest.warns(UserWarning, match="another kind of optimizer") as said:
        report = ckptio.load(where / "step-3", {"model": model, "optim": sgd, "sched": sched},
                             strict=False)
    assert "SGD" in str(said[0].message)
    assert sched.base_lrs == [0.1] and sched.last_epoch == 0
    group = sgd.param_groups[0]
    assert (group["lr"], group["weight_decay"], group["momentum"]) == (0.1, 0, 0.9)
    assert "betas" not in group and sgd.state_dict()["state"] == {}
    assert [m.split(":")[0] for m in report.mismatched] == ["optim", "sched"]
    assert [k for k in report.loaded if not k.startswith("model.")] == []
    for mine, theirs in zip(model.parameters(), saved.parameters()):
        assert torch.equal(mine, theirs)
    model(torch.randn(2, 4)).sum().backward()
    sgd.step()  # SGD's own hyperparameters: it steps


@pytest.mark.parametrize("kind", ["adam", "extra_hyperparameter"])
def test_optimizers_with_the_same_hyperparameter_names_still_load(run, kind: str) -> None:
    where, _, saved_opt = run
    model = _build()
    if kind == "adam":
        opt: torch.optim.Optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        ckptio.load(where / "step-3", {"model": model, "optim": opt}, keys=["model", "optim"])
    else:  # one name more on this side only: the ordinary key rule (missing), not another kind
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        opt.param_groups[0]["added_by_a_newer_torch"] = 1
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            report = ckptio.load(where / "step-3", {"model": model, "optim": opt},
                                 keys=["model", "optim"], strict=False)
        assert report.missing == ("optim.param_groups.0.added_by_a_newer_torch",)
        assert report.mismatched == ()
    for p, q in zip(model.parameters(), saved_opt.param_groups[0]["params"]):
        assert torch.equal(opt.state[p]["exp_avg"], saved_opt.state[q]["exp_avg"])


def test_weights_left_at_another_dtype_keep_no_saved_optimizer_state(run) -> None:
    where, saved, saved_opt = run
    model = _build(torch.bfloat16)
    built = [p.clone() for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.warns(UserWarning, match="cast=True"):
        report = ckptio.load(where / "step-3", {"model": model, "optim": opt},
                             keys=["model", "optim"], strict=False)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), built))
    assert opt.state_dict()["state"] == {}, "the saved moments on weights that were not loaded"
    stale = [m for m in report.mismatched if m.startswith("optim.state.")]
    assert len(stale) == 12 and "left as it was" in stale[0], report.mismatched

    cast = _build(torch.bfloat16)
    opt = torch.optim.AdamW(cast.parameters(), lr=1e-3)
    ckptio.load(where / "step-3", {"model": cast, "optim": opt}, keys=["model", "optim"],
                strict=False, cast=True)
    for p, q in zip(cast.parameters(), saved.parameters()):
        assert torch.equal(p, q.to(torch.bfloat16))
        assert torch.equal(opt.state[p]["exp_avg"],
                           saved_opt.state[q]["exp_avg"].to(torch.bfloat16))


def test_hf_trainer_with_a_bfloat16_model_is_refused_without_offering_cast(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from ckptio.hf_trainer import CkptioTrainer

    from tests.integrations.hf_trainer_run import TokenData, tiny_model, training_args

    out = str(tmp_path / "hf run")
    transformers.set_seed(0)
    CkptioTrainer(model=tiny_model(), args=training_args(out, max_steps=1, save_steps=1),
                  train_dataset=TokenData()).train()
    trainer = CkptioTrainer(model=tiny_model().to(torch.bfloat16),
                            args=training_args(out, max_steps=2, save_steps=1),
                            train_dataset=TokenData())
    with pytest.raises(ckptio.StateMismatchError) as err:
        trainer.train(resume_from_checkpoint=True)
    text = str(err.value)
    assert "checkpoint-1" in text and "torch.bfloat16 in the state" in text, text
    assert "cast=True" not in text and "strict=False is not available" in text, text


@pytest.mark.parametrize("step", [None, 3])
def test_a_partial_restore_says_which_keys_it_left_as_built(run, step: int | None) -> None:
    where, saved, _ = run
    model = nn.Sequential(*_build(), nn.Linear(2, 2))  # a layer added at the end
    manager = ckptio.CheckpointManager(where)
    with pytest.warns(UserWarning, match=r"restore\(strict=False\) of step 3 left 2 key") as said:
        assert manager.restore({"model": model}, step=step, keys=["model"], strict=False) == 3
    manager.close()
    assert said[0].filename == __file__, said[0].filename  # the user's line
    assert "['model.3.weight', 'model.3.bias']" in str(said[0].message)
    report = manager.last_restore["report"]
    assert report.missing == ("model.3.weight", "model.3.bias") and report.unexpected == ()
    assert manager.last_restore["step"] == 3 and manager.last_restore["tier"] == 0
    assert torch.equal(model[0].weight, saved[0].weight)


def test_a_state_whose_every_key_was_renamed_is_told_so(run) -> None:
    where, _, _ = run

    class Renamed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first, self.second = nn.Linear(4, 8), nn.Linear(8, 2)

    manager = ckptio.CheckpointManager(where)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        manager.restore({"model": Renamed()}, keys=["model"], strict=False)
    manager.close()
    text = " | ".join(str(w.message) for w in said)
    assert "model.first.weight" in text and "renamed since the save" in text, text
    assert "empty container" not in text, text
    assert manager.last_restore["report"].loaded == ()


def test_hf_trainer_with_another_layer_frozen_is_refused_naming_the_parameters(
        tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from ckptio.hf_trainer import CkptioTrainer

    from tests.integrations.hf_trainer_run import TokenData, tiny_model, training_args

    def trainer(frozen: int, max_steps: int) -> CkptioTrainer:
        transformers.set_seed(0)
        model = tiny_model()
        model.transformer.h[frozen].attn.c_proj.weight.requires_grad_(False)
        return CkptioTrainer(model=model, train_dataset=TokenData(),
                             args=training_args(str(tmp_path), max_steps=max_steps, save_steps=2))

    trainer(0, 2).train()
    resumed = trainer(1, 2)  # no step after the load: the old code returned, state misaligned
    with pytest.raises(ckptio.StateMismatchError) as err:
        resumed.train(resume_from_checkpoint=True)
    text = str(err.value)
    assert "checkpoint-2" in text and "transformer.h.1.attn.c_proj.weight" in text, text
    assert "frozen" in text, text
    for group in resumed.optimizer.param_groups:
        for p in group["params"]:
            moments = resumed.optimizer.state.get(p, {}).get("exp_avg")
            assert moments is None or moments.shape == p.shape


@pytest.mark.parametrize("cast", [False, True])
def test_a_layer_inserted_and_bfloat16_maps_no_state_onto_weights_left_as_built(
        run, cast: bool) -> None:
    where, saved, saved_opt = run
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.Linear(8, 2))
    model = model.to(torch.bfloat16)  # "3" inserted: saved "2" (8, 8) is here, saved "4" is not
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        ckptio.load(where / "step-3", {"model": model, "optim": opt}, keys=["model", "optim"],
                    strict=False, cast=cast)
    text = " | ".join(str(w.message) for w in said)
    assert "loaded by parameter name" in text, text
    assert torch.equal(model[0].weight, saved[0].weight.to(torch.bfloat16)) == cast
    assert (model[0].weight in opt.state) == cast, text
    if cast:
        assert torch.equal(opt.state[model[0].weight]["exp_avg"],
                           saved_opt.state[saved[0].weight]["exp_avg"].to(torch.bfloat16))
    else:
        assert "left at another dtype ['0.bias', '0.weight'" in text, text
