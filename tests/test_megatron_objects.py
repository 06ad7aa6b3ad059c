"""A Megatron load asking for a ShardedObject the checkpoint lacks, through ckptio's load
strategy, on 2 gloo ranks where only rank 1 asks for it (Megatron's default strict mode,
ASSUME_OK_UNEXPECTED, leaves the check to the strategy): every rank raises
MissingInCheckpointError naming rank 1's key before anything is read (the tensors stay as they
were; before, they were loaded in place, rank 0 went on and rank 1 raised, advising
``strict=False``, which Megatron's ``load`` refuses with a ValueError); with the strict mode
the message names, ``'log_all'``, the load leaves the key out. And a ShardedObject that needs
pickle: the refusals on save and on load name the strategies' ``allow_pickle`` (they named
ckptio.save's and ckptio.load's, and advised load's ``keys=``, which Megatron has not).
Skipped where megatron-core is not installed.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core.dist_checkpointing",
                    reason="megatron-core is not installed (the test extra has it)")
from megatron.core import dist_checkpointing as mdc  # noqa: E402
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor  # noqa: E402

from ckptio.errors import PickleRefusedError, UnsupportedStateError  # noqa: E402
from ckptio.megatron_strategy import (  # noqa: E402
    CkptioLoadShardedStrategy,
    CkptioSaveShardedStrategy,
    MissingInCheckpointError,
)
from ckptio.testing.rank_processes import run_ranks  # noqa: E402


def _state(rank: int, fill: float, extra: bool) -> dict[str, Any]:
    """A TP-split tensor and one object per rank; ``extra``: an object never saved."""
    state: dict[str, Any] = {
        "w": ShardedTensor.from_rank_offsets("w", torch.full((2,), fill), (0, rank, 2)),
        "o": ShardedObject("obj", {"rank": rank}, (2,), (rank,), replica_id=0)}
    if extra:
        state["x"] = ShardedObject("extra", None, (1,), (0,), replica_id=0)
    return state


def _missing_object(rank: int, world: int, root: str) -> dict[str, Any]:
    os.makedirs(root, exist_ok=True)
    mdc.save(_state(rank, 1.0 + rank, False), root, sharded_strategy=CkptioSaveShardedStrategy())
    asked = _state(rank, 0.0, extra=rank == 1)
    out: dict[str, Any] = {"error": None}
    try:
        mdc.load(asked, root, sharded_strategy=CkptioLoadShardedStrategy())
    except MissingInCheckpointError as exc:
        out["error"] = str(exc)
    out["untouched"] = torch.equal(asked["w"].data, torch.zeros(2))
    got = mdc.load(_state(rank, 0.0, extra=rank == 1), root,
                   sharded_strategy=CkptioLoadShardedStrategy(), strict="log_all")
    out["left_out"] = (got["w"].tolist(), got["o"], sorted(got))
    return out


def test_a_shardedobject_one_rank_asks_for_is_refused_on_every_rank_before_any_read(
        tmp_path: Path) -> None:
    got = run_ranks(2, _missing_object, str(tmp_path / "ckpt"), timeout_s=240)
    for rank, out in enumerate(got):
        said = out["error"]
        assert said is not None and "extra/shard_0_1" in said and "1:" in said, (rank, out)
        assert "strict='log_all'" in said and "strict=False" not in said, said
        assert out["untouched"], (rank, out)
        assert out["left_out"] == ([1.0 + rank] * 2, {"rank": rank}, ["o", "w"]), out


def _pickled(rank: int, world: int, root: str) -> list[str]:
    """A Namespace as a ShardedObject saved without and with pickle, loaded without -> what
    the refusals said."""
    os.makedirs(root, exist_ok=True)

    def state(value: Any) -> dict[str, Any]:
        return {"o": ShardedObject("args", value, (1,), (0,), replica_id=0)}

    said = []
    try:
        mdc.save(state(argparse.Namespace(lr=0.1)), root,
                 sharded_strategy=CkptioSaveShardedStrategy())
    except UnsupportedStateError as exc:
        said.append(str(exc))
    mdc.save(state(argparse.Namespace(lr=0.1)), root,
             sharded_strategy=CkptioSaveShardedStrategy(allow_pickle=True))
    try:
        mdc.load(state(None), root, sharded_strategy=CkptioLoadShardedStrategy())
    except PickleRefusedError as exc:
        said.append(str(exc))
    return said


def test_pickle_refusals_name_the_strategies_allow_pickle(tmp_path: Path) -> None:
    ((save, load),) = run_ranks(1, _pickled, str(tmp_path / "ckpt"), timeout_s=240)
    assert "CkptioSaveShardedStrategy(allow_pickle=True)" in save, save
    assert "CkptioLoadShardedStrategy(allow_pickle=True)" in save, save
    assert "CkptioLoadShardedStrategy(allow_pickle=True)" in load, load
    assert "keys=" not in load and "load(..." not in load, load
