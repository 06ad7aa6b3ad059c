"""DCP's CheckpointableTensor protocol (torch 2.14+): a plain local tensor declaring
``global_shape``, ``global_offsets``, ``local_offsets`` and ``local_sizes``. ``ckptio.save``
stores its one shard as a box of the global tensor (duck-typed, so on any torch; several
shards in one tensor are refused, naming the fix) and a load fills that shard in place,
leaving padding alone; under ``dcp.save``, ``ckptio.DcpWriter`` writes what DCP's planner
makes of it (several shards too), on a torch that has the protocol.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckptio
from ckptio.errors import UnsupportedStateError

HAS_PROTOCOL = hasattr(dcp, "CheckpointableTensor")


def _declare(t: torch.Tensor, shape: tuple[int, ...], offsets: Any, local_offsets: Any,
             sizes: Any) -> torch.Tensor:
    t.global_shape, t.global_offsets = shape, offsets  # type: ignore[attr-defined]
    t.local_offsets, t.local_sizes = local_offsets, sizes  # type: ignore[attr-defined]
    return t


def _padded(full: torch.Tensor, pad: float) -> torch.Tensor:
    """``full`` (4 x 3) at rows 1..4, cols 0..2 of a 6 x 5 buffer filled with ``pad``."""
    buf = torch.full((6, 5), pad, dtype=full.dtype)
    buf[1:5, 0:3] = full
    return _declare(buf, (4, 3), ((0, 0),), ((1, 0),), ((4, 3),))


def test_save_stores_the_declared_shard_and_load_fills_it_in_place(tmp_path: Path) -> None:
    full = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    ckptio.save({"w": _padded(full, -7.0), "step": 1}, tmp_path / "c")
    got = ckptio.load(tmp_path / "c")
    assert got["w"].shape == (4, 3) and torch.equal(got["w"], full)
    target = _padded(torch.zeros(4, 3), 99.0)
    ckptio.load(tmp_path / "c", {"w": target, "step": 0})
    assert torch.equal(target[1:5, 0:3], full)
    target[1:5, 0:3] = 99.0
    assert torch.all(target == 99.0), "the padding was written"


def test_a_partial_shard_is_stored_at_its_global_offsets(tmp_path: Path) -> None:
    """Rows 2..3 of a 4 x 3 tensor (no local offsets: the whole local tensor, as in torch)."""
    full = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    mine = _declare(full[2:4].clone(), (4, 3), ((2, 0),), ((),), ((2, 3),))
    with pytest.raises(ckptio.CkptError, match="'w'.*6 elements of a tensor of 12 .*missing"):
        ckptio.save({"w": mine}, tmp_path / "c")  # one process: the other rows' rank is absent


def test_several_shards_in_one_tensor_are_refused_naming_the_fix(tmp_path: Path) -> None:
    two = _declare(torch.zeros(4, 3), (4, 3), ((2, 0), (0, 0)), ((0, 0), (2, 0)),
                   ((2, 3), (2, 3)))
    with pytest.raises(UnsupportedStateError, match="'w'.*2 shards.*TensorShard.*DcpWriter"):
        ckptio.save({"w": two}, tmp_path / "c")
    assert not (tmp_path / "c").exists() or not any((tmp_path / "c").iterdir())


def test_a_shard_outside_its_tensor_is_refused(tmp_path: Path) -> None:
    bad = _declare(torch.zeros(2, 3), (4, 3), ((3, 0),), ((0, 0),), ((2, 3),))
    with pytest.raises(UnsupportedStateError, match="'w'.*does not fit"):
        ckptio.save({"w": bad}, tmp_path / "c")


@pytest.mark.skipif(not HAS_PROTOCOL, reason=f"torch {torch.__version__} has no DCP "
                    "CheckpointableTensor (torch 2.14+); dev/newer_torch.sh runs it there")
def test_dcp_save_through_the_writer_takes_several_shards_in_one_tensor(tmp_path: Path) -> None:
    full = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    local = torch.cat([full[2:4], full[0:2]])  # rows 2..3 first, then rows 0..1
    two = _declare(local, (4, 3), ((2, 0), (0, 0)), ((0, 0), (2, 0)), ((2, 3), (2, 3)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # one process, no process group
        dcp.save({"w": two, "p": _padded(full, -1.0)},
                 storage_writer=ckptio.DcpWriter(tmp_path / "c"))
        got = ckptio.load(tmp_path / "c")
        assert torch.equal(got["w"], full) and torch.equal(got["p"], full)
        target = _padded(torch.zeros(4, 3), 5.0)
        dcp.load({"p": target}, storage_reader=ckptio.DcpReader(tmp_path / "c"))
    assert torch.equal(target[1:5, 0:3], full) and float(target[0, 0]) == 5.0
