"""Legacy ShardedTensor states (torch.distributed._shard; FSDP1's sharded state dicts, still in
use): saved and loaded by ckptio as DCP does them, DCP in the same test as the control.

On 2 gloo ranks a state of a ShardedTensor (7 x 5, row-chunked: 4 + 3 rows) and a plain tensor
is saved by ``dcp.save`` and by ``ckptio.save``. Then, into fresh ShardedTensor templates of
other values: DCP's checkpoint loaded by ``dcp.load`` (the control) and by ``ckptio.load``;
ckptio's by ``ckptio.load`` and by ``dcp.load`` through ``ckptio.DcpReader``: each rank's rows
bit for bit, on the saving 2 ranks and resharded on 4 ranks (2 + 2 + 2 + 1 rows); and in one
process ``ckptio.load`` of either gives the whole tensor, and ``ckptio.export_hf`` writes it.
FSDP1's SHARDED_STATE_DICT of a real model on 2 ranks round-trips into another model. Before,
ckptio refused a ShardedTensor at save and as a template. Several local shards on one rank are refused naming the fix.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import ckptio
from ckptio.testing.rank_processes import run_ranks
from tests import sharded_tensor_cases as cases

TIMEOUT = 180


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.Tensor]:
    root = tmp_path_factory.mktemp("sharded-tensor")
    got = run_ranks(2, cases.save_both, str(root), timeout_s=TIMEOUT)
    whole = torch.tensor(got[0]["rows"] + got[1]["rows"])
    assert whole.shape == (cases.ROWS, cases.COLS)
    return root, whole


def _rows(whole: torch.Tensor, world: int, rank: int) -> list[list[float]]:
    per = -(-cases.ROWS // world)  # ChunkShardingSpec's ceil split
    return whole[rank * per:(rank + 1) * per].tolist()


@pytest.mark.parametrize("world", [2, 4])
def test_dcp_and_ckptio_checkpoints_load_into_sharded_tensors_both_ways(saved: Any,
                                                                       world: int) -> None:
    root, whole = saved
    got = run_ranks(world, cases.load_each, str(root), timeout_s=TIMEOUT)
    b = (torch.arange(3.0) + 1).tolist()
    for rank, loaded in enumerate(got):
        for how in ("dcp-by-dcp", "dcp-by-ckptio", "ckptio-by-ckptio", "ckptio-by-dcp_reader"):
            assert loaded[how]["rows"] == _rows(whole, world, rank), (rank, how)
            assert loaded[how]["b"] == b, (rank, how)


def test_one_process_loads_the_whole_tensor_and_exports_it(saved: Any, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    root, whole = saved
    for name in ("ckptio", "dcp"):
        out = ckptio.load(root / name)
        assert torch.equal(out["w"], whole) and torch.equal(out["b"], torch.arange(3.0) + 1)
    ckptio.export_hf(root / "ckptio", tmp_path / "hf", keys=None)
    exported = load_file(str(next((tmp_path / "hf").glob("*.safetensors"))))
    assert torch.equal(exported["w"], whole)


def test_several_local_shards_on_one_rank_are_refused_naming_the_fix(tmp_path: Path) -> None:
    got = run_ranks(1, cases.two_shards_on_one_rank, str(tmp_path), timeout_s=TIMEOUT)
    assert "2 local shards on this rank" in got[0] and "ckptio.TensorShard(" in got[0], got[0]
    assert not (tmp_path / "c").exists()


def test_fsdp1_sharded_state_dict_round_trips(tmp_path: Path) -> None:
    """FSDP1's SHARDED_STATE_DICT (ShardedTensors) on 2 gloo ranks: saved by ckptio, loaded in
    place into another model's sharded state dict: every parameter equal, gathered whole."""
    got = run_ranks(2, cases.fsdp1_sharded_state_dict, str(tmp_path), timeout_s=TIMEOUT)
    for rank, result in enumerate(got):
        assert result["kinds"] == ["ShardedTensor"], (rank, result)
        assert result["same"], rank
