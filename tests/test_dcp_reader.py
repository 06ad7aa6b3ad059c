"""ckptio.DcpReader: ``dcp.load(state, storage_reader=ckptio.DcpReader(path))`` of checkpoints
written by ``ckptio.save`` (FSDP2 on real gloo ranks, FlatShard partitions, per-rank and inline
values, aliases) and of stock DCP directories, with DCP's own planners.

Checked against DCP itself: the keys and planner_data DcpReader reports for a ckptio.save'd
state equal those of ``dcp.save`` of the same state (FileSystemWriter's .metadata), and what
``_load_state_dict_from_keys`` (DCP's ``_EmptyStateDictLoadPlanner``) returns through DcpReader
equals what it returns through FileSystemReader. Restored tensors are compared bitwise
(dtype and bytes). Faults: a flipped data byte reaches the caller as the CorruptCheckpointError
inside DCP's CheckpointException; a missing key or checkpoint is named.
"""

from __future__ import annotations

import pickle
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

import ckptio
from ckptio.testing.ranks import run_ranks

warnings.filterwarnings("ignore", message=".*process group.*", category=UserWarning)
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

DIMS = (6, 10, 5)  # 5 rows over 2 or 4 ranks: uneven shards, one empty on 4
STEPS = 2


# ------------------------------------------------------------------------------------------------
# helpers (module level: the ranks import this module)


def _same(got: Any, want: Any, where: str = "") -> None:
    """Bitwise for tensors and arrays (dtype included), == for the rest, types of containers."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype, (where, got)
        assert torch.equal(got, want), where
    elif isinstance(want, np.ndarray):
        assert isinstance(got, np.ndarray) and got.dtype == want.dtype, (where, got)
        assert got.tobytes() == want.tobytes() and got.shape == want.shape, where
    elif isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want), (where, list(got), list(want))
        for k in want:
            _same(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want), (where, got, want)
        for i, (g, w) in enumerate(zip(got, want)):
            _same(g, w, f"{where}.{i}")
    else:
        assert type(got) is type(want) and got == want, (where, got, want)


def _build(seed: int, fsdp: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(DIMS[0], DIMS[1]), torch.nn.ReLU(),
                                torch.nn.Linear(DIMS[1], DIMS[2]))
    if fsdp:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.95))


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(100 * step + rank)
        model(torch.randn(4, DIMS[0], generator=gen)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def _dcp_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    # on a fresh optimizer this creates its state first (the tensors a load fills)
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def _full(value: torch.Tensor) -> np.ndarray:
    full = value.full_tensor() if hasattr(value, "full_tensor") else value
    return full.detach().clone().numpy()


def _snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Every parameter and optimizer tensor whole (a collective under FSDP2), and the groups."""
    state = _dcp_state(model, opt)
    out: dict[str, Any] = {f"model.{k}": _full(v) for k, v in state["model"].items()}
    for fqn, slots in state["optim"]["state"].items():
        for name, value in slots.items():
            out[f"optim.{fqn}.{name}"] = _full(value)
    out["param_groups"] = [dict(g) for g in state["optim"]["param_groups"]]
    return out


def fsdp_save(rank: int, world: int, ck: str, stock: str) -> dict[str, Any]:
    """Train FSDP2 + AdamW, then save the same state with ckptio.save and with dcp.save."""
    model, opt = _build(0, fsdp=True)
    _train(model, opt)
    state = _dcp_state(model, opt)
    ckptio.save({**state, "step": STEPS}, ck)
    dcp.save({**state, "step": STEPS}, checkpoint_id=stock)
    return _snapshot(model, opt)


def fsdp_load(rank: int, world: int, paths: list[str]) -> list[dict[str, Any]]:
    """Fresh FSDP2 model and optimizer (another seed), loaded the way DCP users do."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    out = []
    for path in paths:
        model, opt = _build(1, fsdp=True)
        state = {**_dcp_state(model, opt), "step": -1}
        dcp.load(state, storage_reader=ckptio.DcpReader(path))
        assert state["step"] == STEPS, state["step"]
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        out.append(_snapshot(model, opt))
    return out


# ------------------------------------------------------------------------------------------------
# (1) FSDP2 + AdamW saved by ckptio on 2 ranks, loaded by dcp.load on 2, 1 and 4 ranks; (5) the
# stock DCP checkpoint of the same state through DcpReader; keys equal to DCP's own


@pytest.fixture(scope="module")
def fsdp_saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("fsdp")
    ck, stock = str(root / "ckptio"), str(root / "dcp")
    want = run_ranks(2, fsdp_save, ck, stock, timeout_s=300)
    _same(want[1], want[0], "ranks agree")
    return {"ck": ck, "stock": stock, "want": want[0]}


def test_keys_and_paths_match_dcp_save_of_the_same_state(fsdp_saved: dict[str, Any]) -> None:
    ours = ckptio.DcpReader(fsdp_saved["ck"]).read_metadata()
    theirs = FileSystemReader(fsdp_saved["stock"]).read_metadata()
    assert sorted(ours.state_dict_metadata) == sorted(theirs.state_dict_metadata)
    assert ours.planner_data == theirs.planner_data
    assert "optim.param_groups.0.betas" in ours.planner_data  # a tuple: one BYTE_IO key
    for fqn, md in theirs.state_dict_metadata.items():
        mine = ours.state_dict_metadata[fqn]
        assert type(mine) is type(md), fqn
        if hasattr(md, "size"):
            assert (mine.size, mine.properties.dtype) == (md.size, md.properties.dtype), fqn
            got = sorted((tuple(c.offsets), tuple(c.sizes)) for c in mine.chunks)
            assert got == sorted((tuple(c.offsets), tuple(c.sizes)) for c in md.chunks
                                 if all(c.sizes)), fqn


@pytest.mark.parametrize("world", [2, 1, 4])
def test_fsdp2_checkpoint_loads_through_dcp_load(fsdp_saved: dict[str, Any], world: int) -> None:
    results = run_ranks(world, fsdp_load, [fsdp_saved["ck"], fsdp_saved["stock"]], timeout_s=300)
    for rank, (from_ckptio, from_stock) in enumerate(results):
        _same(from_ckptio, fsdp_saved["want"], f"ckptio.save -> {world} ranks, rank {rank}")
        _same(from_stock, fsdp_saved["want"], f"dcp.save -> {world} ranks, rank {rank}")
    assert fsdp_saved["want"]["param_groups"][0]["betas"] == (0.8, 0.95)


def test_a_fresh_model_is_not_already_equal(fsdp_saved: dict[str, Any]) -> None:
    """The comparison can fail: a fresh model differs from the trained one."""
    model, _opt = _build(1, fsdp=False)
    fresh = model.state_dict()["0.weight"].numpy()
    assert not np.array_equal(fresh, fsdp_saved["want"]["model.0.weight"])
