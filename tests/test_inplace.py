"""In-place loads restore every value the state holds, the way resuming jobs write them:
tuples and namedtuples rebuilt in their parents, Python values replaced, fresh optimizers and
schedulers (as objects) given the state they lack, all RNGs, ranks holding different keys."""

from __future__ import annotations

import collections
import contextlib
import random

import numpy as np
import pytest
import torch

import ckptio
from ckptio.testing.rank_processes import run_ranks

import inplace_cases as cases

Pair = collections.namedtuple("Pair", "first second")


def _model_and_optim(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer, object]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Dropout(0.1), torch.nn.Linear(5, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, sched: object, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        x = torch.randn(4, 6)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()  # type: ignore[attr-defined]
        losses.append(loss.item())
    return losses


def test_every_python_value_differs_and_is_restored(tmp_path):
    saved = {"t": (1, 2.5, "x", None, Pair(3, (4, 5.0))), "s": "hello", "n": None, "i": 7,
             "v": 3, "nested": [(1, 2), {"k": (True, b"raw")}], "tensor_in_tuple": (torch.ones(2), 9)}
    ckptio.save(saved, tmp_path / "c")
    keep = torch.zeros(2)
    state = {"t": (0, 0.0, "y", 5, Pair(0, (0, 0.0))), "s": "other", "n": 4, "i": None,
             "v": torch.zeros(3), "nested": [(0, 0), {"k": (False, b"")}], "tensor_in_tuple": (keep, 0)}
    report = ckptio.load(tmp_path / "c", state)
    assert state["t"] == saved["t"] and type(state["t"][4]) is Pair
    assert (state["s"], state["n"], state["i"], state["v"]) == ("hello", None, 7, 3)
    assert state["nested"] == [(1, 2), {"k": (True, b"raw")}]
    assert state["tensor_in_tuple"][0] is keep and torch.equal(keep, torch.ones(2))
    assert state["tensor_in_tuple"][1] == 9
    assert not report.missing and not report.unexpected and not report.mismatched


def test_python_and_numpy_rng_state_tuples_load_in_place(tmp_path):
    random.seed(3)
    np.random.seed(4)
    saved = {"py": random.getstate(), "np": np.random.get_state()}
    ckptio.save(saved, tmp_path / "c")
    random.seed(99)
    np.random.seed(99)
    state = {"py": random.getstate(), "np": np.random.get_state()}
    ckptio.load(tmp_path / "c", state)
    random.setstate(state["py"])
    np.random.set_state(state["np"])
    random.seed(3)
    expected = random.random()
    random.setstate(saved["py"])
    assert random.random() == expected
    assert state["py"] == saved["py"]
    assert all(np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b
               for a, b in zip(state["np"], saved["np"]))


def test_root_tuple_fills_tensors_and_refuses_differing_values(tmp_path):
    ckptio.save((torch.ones(2), 3), tmp_path / "c")
    same = (torch.zeros(2), 3)
    ckptio.load(tmp_path / "c", same)
    assert torch.equal(same[0], torch.ones(2))
    with pytest.raises(ckptio.StateMismatchError, match="pass a dict or list"):
        ckptio.load(tmp_path / "c", (torch.zeros(2), 4))


def test_rng_state_round_trip_python_numpy_torch(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    ckptio.save({"rng": ckptio.RNGState()}, tmp_path / "c")
    expected = (random.random(), random.gauss(0, 1), np.random.rand(), np.random.randn(),
                torch.rand(3).tolist())
    random.seed(8)
    np.random.seed(8)
    torch.manual_seed(8)
    ckptio.load(tmp_path / "c", {"rng": ckptio.RNGState()})
    got = (random.random(), random.gauss(0, 1), np.random.rand(), np.random.randn(),
           torch.rand(3).tolist())
    assert got == expected


def test_rng_state_is_stored_compactly(tmp_path):
    ckptio.save({"rng": ckptio.RNGState()}, tmp_path / "c")
    fresh = ckptio.load(tmp_path / "c")
    assert fresh["rng"]["python"]["mt"].shape == (625,)
    assert fresh["rng"]["numpy"]["mt"].shape == (624,)
    assert isinstance(fresh["rng"]["torch"], torch.Tensor)


@contextlib.contextmanager
def _cuda_generators(monkeypatch, states, restored=None):
    """torch.cuda's generator functions over ``states`` (one uint8 tensor per device), as if
    that many CUDA devices were visible; ``set_rng_state_all`` fills ``restored``. Only for
    RNGState's own calls: ckptio's I/O must not believe CUDA is there (it would pin memory)."""
    def set_all(new):
        restored[:] = [t.clone() for t in new]

    with monkeypatch.context() as m:
        m.setattr(torch.cuda, "is_available", lambda: True)
        m.setattr(torch.cuda, "device_count", lambda: len(states))
        m.setattr(torch.cuda, "get_rng_state_all", lambda: [t.clone() for t in states])
        m.setattr(torch.cuda, "set_rng_state_all", set_all)
        yield


def test_rng_state_keeps_every_cuda_devices_generator(tmp_path, monkeypatch):
    """Without a GPU (tests/gpu/test_cuda.py does it on real ones): three devices' generator
    states captured, stored and set back each to its device; another device count refused."""
    devices = [torch.arange(16, dtype=torch.uint8) + 16 * d for d in range(3)]
    with _cuda_generators(monkeypatch, devices):
        captured = ckptio.RNGState().state_dict()
    ckptio.save({"rng": captured}, tmp_path / "c")
    loaded = ckptio.load(tmp_path / "c")["rng"]
    restored: list = []
    with _cuda_generators(monkeypatch, [torch.zeros(16, dtype=torch.uint8)] * 3, restored):
        ckptio.RNGState().load_state_dict(loaded)
    assert [t.tolist() for t in restored] == [t.tolist() for t in devices]
    with _cuda_generators(monkeypatch, [torch.zeros(16, dtype=torch.uint8)] * 2, restored):
        with pytest.raises(ckptio.StateMismatchError, match="3 CUDA generator states, this "
                           "process sees 2 devices"):
            ckptio.RNGState().load_state_dict(loaded)


@pytest.mark.parametrize("as_objects", [True, False])
def test_fresh_optimizer_and_scheduler_resume_bit_exactly(tmp_path, as_objects):
    model, opt, sched = _model_and_optim()
    _train(model, opt, sched, 3)
    torch.manual_seed(42)
    state = {"model": model, "optim": opt, "sched": sched, "rng": ckptio.RNGState()}
    ckptio.save(state if as_objects else {k: v.state_dict() for k, v in state.items()},
                tmp_path / "c")
    expected = _train(model, opt, sched, 3)

    model2, opt2, sched2 = _model_and_optim(seed=7)  # fresh: different weights, no Adam state
    assert not opt2.state
    fresh = {"model": model2, "optim": opt2, "sched": sched2, "rng": ckptio.RNGState()}
    if as_objects:
        report = ckptio.load(tmp_path / "c", fresh)
        assert any(k.startswith("optim.state.") for k in report.loaded)
    else:
        plain = {k: v.state_dict() for k, v in fresh.items()}
        with pytest.raises(ckptio.StateMismatchError, match="put the optimizer object itself"):
            ckptio.load(tmp_path / "c", plain)
        with pytest.warns(UserWarning, match="optimizer's per-parameter state"):
            ckptio.load(tmp_path / "c", plain, strict=False)
        # the documented plain-dict path: load fresh, hand each object its state
        loaded = ckptio.load(tmp_path / "c")
        for name, obj in fresh.items():
            obj.load_state_dict(loaded[name])
    assert opt2.param_groups[0]["betas"] == (0.8, 0.95)
    assert _train(model2, opt2, sched2, 3) == expected


def test_optimizer_with_other_parameter_groups_fails_loudly(tmp_path):
    model, opt, sched = _model_and_optim()
    _train(model, opt, sched, 1)
    ckptio.save({"optim": opt}, tmp_path / "c")
    other = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))])
    with pytest.raises(ckptio.CkptError):
        ckptio.load(tmp_path / "c", {"optim": other})


def test_grad_scaler_and_user_stateful(tmp_path):
    class Loader:
        def __init__(self) -> None:
            self.position, self.order = 0, (3, 1, 2)

        def state_dict(self) -> dict:
            return {"position": self.position, "order": self.order}

        def load_state_dict(self, state: dict) -> None:
            self.position, self.order = state["position"], state["order"]

    loader = Loader()
    loader.position, loader.order = 17, (2, 3, 1)
    scaler = torch.amp.GradScaler("cpu", init_scale=512.0)
    ckptio.save({"loader": loader, "scaler": scaler}, tmp_path / "c")
    loader2, scaler2 = Loader(), torch.amp.GradScaler("cpu", init_scale=2.0)
    ckptio.load(tmp_path / "c", {"loader": loader2, "scaler": scaler2})
    assert (loader2.position, loader2.order) == (17, (2, 3, 1))
    assert scaler2.state_dict() == scaler.state_dict()


def test_module_with_extra_checkpoint_keys_is_unexpected_not_created(tmp_path):
    ckptio.save({"m": torch.nn.Linear(2, 2)}, tmp_path / "c")
    with pytest.raises(ckptio.StateMismatchError, match="not in the state"):
        ckptio.load(tmp_path / "c", {"m": torch.nn.Linear(2, 2, bias=False)})


def test_ranks_holding_different_keys_load_strictly(tmp_path):
    results = run_ranks(2, cases.distinct_keys, str(tmp_path / "c"))
    assert all(r["same"] and r["unexpected"] == [] for r in results)


def test_a_key_no_rank_asks_for_is_unexpected_everywhere(tmp_path):
    assert run_ranks(2, cases.nobody_asks, str(tmp_path / "c")) == ["StateMismatchError"] * 2


@pytest.mark.parametrize("url", ["hdfs://b/y", "ftp://c/d"])
def test_urls_are_refused_not_saved_to_a_local_folder(tmp_path, monkeypatch, url):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ckptio.UnsupportedPathError, match="register_store"):
        ckptio.save({"a": torch.ones(1)}, url)
    with pytest.raises(ckptio.UnsupportedPathError):
        ckptio.load(url)
    with pytest.raises(ckptio.UnsupportedPathError):
        ckptio.verify(url)
    assert list(tmp_path.iterdir()) == []


def test_a_key_tied_to_a_loaded_key_is_filled_not_missing(tmp_path):
    """A checkpoint without a tied weight (Hugging Face files leave out lm_head.weight, tied to
    the embedding) loads strictly into a model that ties them: the tie fills it. A missing key
    that is not tied, or tied to a key that is not loaded, is still missing."""
    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(5, 3)
            self.head = torch.nn.Linear(3, 5, bias=False)
            self.head.weight = self.emb.weight

    src = Tied()
    ckptio.save({"emb.weight": src.emb.weight.detach().clone()}, tmp_path / "ck")
    fresh = Tied()
    report = ckptio.load(tmp_path / "ck", fresh.state_dict())
    assert torch.equal(fresh.head.weight, src.emb.weight) and not report.missing
    assert set(report.loaded) == {"emb.weight", "head.weight"}
    untied = {"emb.weight": torch.zeros(5, 3), "head.weight": torch.zeros(5, 3)}
    with pytest.raises(ckptio.StateMismatchError, match="head.weight"):
        ckptio.load(tmp_path / "ck", untied)
    ckptio.save({"other": torch.ones(1)}, tmp_path / "none")
    with pytest.raises(ckptio.StateMismatchError, match="emb.weight"):
        ckptio.load(tmp_path / "none", Tied().state_dict())
    meta = {"emb.weight": torch.empty(5, 3, device="meta"), "head.weight": torch.empty(5, 3, device="meta")}
    with pytest.raises(ckptio.StateMismatchError, match=r"missing from the checkpoint \['head.weight'\]"):
        ckptio.load(tmp_path / "ck", meta)  # meta tensors all share data_ptr 0: not a tie


def test_a_key_mismatch_names_only_the_sides_that_differ(tmp_path):
    ckptio.save({"a": torch.ones(2), "b": torch.ones(2)}, tmp_path / "ck")
    with pytest.raises(ckptio.StateMismatchError) as info:
        ckptio.load(tmp_path / "ck", {"a": torch.zeros(2)})
    message = str(info.value)
    assert message.startswith(f"{tmp_path / 'ck'}: state and checkpoint keys differ: not in "
                              "the state ['b']. Pass strict=False"), message
    assert "missing from the checkpoint" not in message and "Otherwise" not in message
    with pytest.raises(ckptio.StateMismatchError, match=r"missing from the checkpoint \['c'\]; "
                       r"not in the state \['b'\]\. Pass strict=False"):
        ckptio.load(tmp_path / "ck", {"a": torch.zeros(2), "c": torch.zeros(2)})


def test_a_meta_destination_is_refused_not_skipped(tmp_path):
    """Loading into a meta tensor (a model built on the meta device and never materialised)
    would copy nowhere and report success: it is refused, naming the key and the fix."""
    ckptio.save({"w": torch.ones(4)}, tmp_path / "ck")
    with torch.device("meta"):
        model = torch.nn.Linear(4, 1, bias=False)
    with pytest.raises(ckptio.StateMismatchError, match=r"w: the state's tensor is on the meta device.*to_empty"):
        ckptio.load(tmp_path / "ck", {"w": model.weight.view(4)})
    with pytest.warns(UserWarning, match="meta device"):
        report = ckptio.load(tmp_path / "ck", {"w": model.weight.view(4)}, strict=False)
    assert not report.loaded and "meta device" in report.mismatched[0]


def test_weights_tied_in_the_state_but_saved_apart_are_refused(tmp_path):
    """A model that ties two weights (one tensor under two keys) cannot hold a checkpoint saved
    untied, whose two tensors differ: filling both would leave the embedding holding the head's
    values. A strict load refuses, naming both keys; strict=False leaves both as they were.
    Saved tied (an alias), or untied with equal values, it loads."""
    class Tied(torch.nn.Module):
        def __init__(self, tied: bool) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(5, 3)
            self.head = torch.nn.Linear(3, 5, bias=False)
            if tied:
                self.head.weight = self.emb.weight

    apart = Tied(tied=False)
    ckptio.save({"model": apart}, tmp_path / "apart")
    model = Tied(tied=True)
    before = model.emb.weight.detach().clone()
    with pytest.raises(ckptio.StateMismatchError,
                       match=r"model.head.weight: the state ties it to model.emb.weight"):
        ckptio.load(tmp_path / "apart", {"model": model})
    assert torch.equal(model.emb.weight, before)
    with pytest.warns(UserWarning, match="ties it to"):
        ckptio.load(tmp_path / "apart", {"model": model}, strict=False)
    assert torch.equal(model.emb.weight, before)
    source = Tied(tied=True)
    ckptio.save({"model": source}, tmp_path / "tied")
    ckptio.save({"model": {"emb.weight": source.emb.weight, "head.weight": source.emb.weight.detach().clone()}},
                tmp_path / "equal")
    for name in ("tied", "equal"):
        fresh = Tied(tied=True)
        ckptio.load(tmp_path / name, {"model": fresh})
        assert torch.equal(fresh.head.weight, source.emb.weight), name


def test_inference_and_expanded_destinations_are_refused_by_name(tmp_path):
    """A tensor made under inference_mode, or an expanded one (stride 0), cannot be written by
    a load: refused as a StateMismatchError naming the key and the fix, not a RuntimeError
    from a copy on an I/O thread, inside inference_mode too."""
    ckptio.save({"w": torch.arange(3.0)}, tmp_path / "ck")
    with torch.inference_mode():
        inference = torch.zeros(3)
    with pytest.raises(ckptio.StateMismatchError, match="w: the state's tensor was made under torch.inference_mode"):
        ckptio.load(tmp_path / "ck", {"w": inference})
    with torch.inference_mode(), pytest.raises(ckptio.StateMismatchError, match="inference_mode"):
        ckptio.load(tmp_path / "ck", {"w": inference})
    with pytest.raises(ckptio.StateMismatchError, match=r"w: the state's tensor is expanded .*t.clone\(\)"):
        ckptio.load(tmp_path / "ck", {"w": torch.zeros(1).expand(3)})
    with pytest.warns(UserWarning, match="expanded"):
        report = ckptio.load(tmp_path / "ck", {"w": torch.zeros(1).expand(3)}, strict=False)
    assert not report.loaded


def test_keys_naming_nothing_is_refused_not_a_silent_empty_load(tmp_path):
    """keys=["modle"] (a typo) selects nothing: a strict in-place load loaded nothing and said
    nothing. It is refused naming the name and the checkpoint's top-level keys; strict=False
    warns; a name the state holds but the checkpoint lacks is still a missing key."""
    ckptio.save({"model": {"w": torch.ones(3)}, "step": 4}, tmp_path / "ck")
    state = {"model": {"w": torch.zeros(3)}, "step": 0}
    with pytest.raises(ckptio.StateMismatchError,
                       match=r"keys=: \['modle'\] select\(s\) no key of the checkpoint or the state "
                             r"\(the checkpoint's top-level keys: \['model', 'step'\]\)"):
        ckptio.load(tmp_path / "ck", state, keys=["model", "modle"])
    assert not state["model"]["w"].any()
    with pytest.warns(UserWarning, match=r"\['modle'\] select"):
        ckptio.load(tmp_path / "ck", state, keys="modle", strict=False)
    with pytest.raises(ckptio.StateMismatchError, match=r"missing from the checkpoint \['ema.w'\]"):
        ckptio.load(tmp_path / "ck", {**state, "ema": {"w": torch.zeros(3)}}, keys=["ema"])
    report = ckptio.load(tmp_path / "ck", state, keys=["model.w"])
    assert report.loaded == ("model.w",) and torch.equal(state["model"]["w"], torch.ones(3))


def test_a_fresh_load_refuses_keys_naming_nothing_and_keys_of_another_kind(tmp_path):
    """A fresh load with keys=["stpe"] (a typo) returned {} (and ["model", "stpe"] dropped the
    typo silently), keys=[] returned {}, and keys=[123] or keys=123 escaped as a TypeError. Now
    the typo is refused as the in-place load refuses it (strict=False warns), keys=[] and keys=
    of another kind are CkptErrors naming what keys= takes, and an iterator's names are kept."""
    ckptio.save({"model": {"w": torch.ones(3)}, "step": 4}, tmp_path / "ck")
    for keys in (["stpe"], ["model", "stpe"]):
        with pytest.raises(ckptio.StateMismatchError,
                           match=r"keys=: \['stpe'\] select\(s\) no key of the checkpoint \(the "
                                 r"checkpoint's top-level keys: \['model', 'step'\]\)"):
            ckptio.load(tmp_path / "ck", keys=keys)
    with pytest.warns(UserWarning, match=r"strict=False: keys=: \['stpe'\]"):
        assert ckptio.load(tmp_path / "ck", keys=["model", "stpe"], strict=False).keys() == {
            "model"}
    with pytest.raises(ckptio.CkptError, match=r"keys=\[\] selects no key"):
        ckptio.load(tmp_path / "ck", keys=[])
    for keys in ([123], 123, b"model"):
        with pytest.raises(ckptio.CkptError, match="keys= takes a key's name"):
            ckptio.load(tmp_path / "ck", keys=keys)
    with pytest.raises(ckptio.CkptError, match="keys= takes a key's name"):
        ckptio.load(tmp_path / "ck", {"model": {"w": torch.zeros(3)}}, keys=[1])
    assert ckptio.load(tmp_path / "ck", keys=(k for k in ["step"])) == {"step": 4}
    ckptio.save({"empty": {}, "nested": {"none": [], "w": torch.ones(1)}}, tmp_path / "e")
    assert ckptio.load(tmp_path / "e", keys=["empty", "nested.none"]) == {  # no leaf, no typo
        "empty": {}, "nested": {"none": []}}
    state = {"model": {"w": torch.zeros(3)}, "step": 0}
    ckptio.load(tmp_path / "ck", state, keys=iter(["model"]))
    assert torch.equal(state["model"]["w"], torch.ones(3)) and state["step"] == 0
