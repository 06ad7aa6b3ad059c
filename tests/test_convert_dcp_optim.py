"""``ckptio convert --to dcp`` of a training state loads into the form DCP documents:
``get_state_dict(model, opt)`` (optimizer state keyed by parameter name), ``dcp.load``, then
``set_state_dict``, in a fresh process where importing ckptio fails. ckptio.save records the
parameter names when the model is in the state; without them the optimizer stays keyed by
index and convert says so (a warning naming the key and what loads it).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

import ckptio
from ckptio.convert import convert

ROOT = Path(__file__).resolve().parents[1]

_MODEL = textwrap.dedent("""
    import torch

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.pos = torch.nn.Parameter(torch.zeros(4))
            self.body = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2))

    def trained(seed):
        torch.manual_seed(seed)
        net = Net()
        opt = torch.optim.AdamW([{"params": [net.pos]},
                                 {"params": list(net.body.parameters()), "lr": 0.1}])
        for _ in range(2):
            (net.body(torch.randn(2, 3)).sum() + net.pos.square().sum()).backward()
            opt.step()
        return net, opt
""")

_DCP_LOAD = textwrap.dedent("""
    import sys
    sys.modules["ckptio"] = None  # importing ckptio fails from here on
    import warnings
    warnings.simplefilter("ignore")
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from net import trained

    path, expected = sys.argv[1:3]
    want = torch.load(expected, weights_only=True)
    net, opt = trained(seed=1)  # other values: all must come from the checkpoint
    msd, osd = get_state_dict(net, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(net, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    for k, v in want["model"].items():
        assert torch.equal(net.state_dict()[k], v), k
    got = opt.state_dict()
    for i, per in want["optim"]["state"].items():
        for k, v in per.items():
            assert torch.equal(got["state"][i][k], v), (i, k)
    assert [g["lr"] for g in got["param_groups"]] == [g["lr"] for g in want["optim"]["param_groups"]]
    print("loaded the get_state_dict form")
""")


@pytest.fixture()
def net(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    (tmp_path / "net.py").write_text(_MODEL)
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib

    import net as module

    return importlib.reload(module)


def test_convert_to_dcp_loads_into_get_state_dict_form(tmp_path: Path, net) -> None:  # type: ignore[no-untyped-def]
    model, opt = net.trained(seed=0)
    ckptio.save({"model": model, "optim": opt, "step": 2}, tmp_path / "src")
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, tmp_path / "want.pt")
    done = subprocess.run([sys.executable, "-m", "ckptio", "convert", "--to", "dcp",
                           str(tmp_path / "src"), str(tmp_path / "dcp")], capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=180,
                          check=False)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    (tmp_path / "load.py").write_text(_DCP_LOAD)
    done = subprocess.run([sys.executable, str(tmp_path / "load.py"), str(tmp_path / "dcp"),
                           str(tmp_path / "want.pt")], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(tmp_path)}, timeout=180,
                          check=False)
    assert done.returncode == 0 and "get_state_dict form" in done.stdout, done.stderr[-3000:]
    # ckptio.load reads it into the same form (an optimizer object itself takes index keys)
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model2, opt2 = net.trained(seed=1)
    msd, osd = get_state_dict(model2, opt2)
    state = {"model": msd, "optim": osd, "step": 0}
    ckptio.load(tmp_path / "dcp", state)
    set_state_dict(model2, opt2, model_state_dict=state["model"], optim_state_dict=state["optim"])
    for i, per in opt.state_dict()["state"].items():
        for k, v in per.items():
            assert torch.equal(opt2.state_dict()["state"][i][k], v), (i, k)


def test_an_optimizer_without_recorded_names_stays_by_index_with_a_warning(
        tmp_path: Path, net) -> None:  # type: ignore[no-untyped-def]
    _model, opt = net.trained(seed=0)
    ckptio.save({"optim": opt.state_dict()}, tmp_path / "src")  # no model: no names
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        convert(tmp_path / "src", tmp_path / "dcp", to="dcp")
    said = [str(w.message) for w in caught if "keyed by parameter" in str(w.message)]
    assert len(said) == 1 and "'optim'" in said[0] and "get_state_dict" in said[0], said
    assert set(ckptio.load(tmp_path / "dcp")["optim"]["state"]) == {0, 1, 2, 3, 4}
