"""What each gloo rank runs in tests/test_sharded_tensor.py (importable by the rank processes):
a legacy ShardedTensor state saved and loaded by DCP (the control) and by ckptio."""

from __future__ import annotations

import os
from typing import Any

import torch

ROWS, COLS = 7, 5  # uneven over 2 ranks (4 + 3 rows) and over 4 (2 + 2 + 2 + 1)


def _spec(world: int) -> Any:
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec

    return ChunkShardingSpec(dim=0, placements=[f"rank:{r}/cpu" for r in range(world)])


def state(world: int, seed: int) -> dict[str, Any]:
    """{"w": a ShardedTensor of ROWS x COLS, row-chunked over the ranks, "b": a plain tensor}:
    the values depend on ``seed`` only (each rank holds its rows of the same global tensor)."""
    from torch.distributed._shard import sharded_tensor

    whole = torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(seed))
    st = sharded_tensor.zeros(_spec(world), ROWS, COLS)
    for shard in st.local_shards():
        offset, rows = shard.metadata.shard_offsets[0], shard.metadata.shard_sizes[0]
        shard.tensor.copy_(whole[offset:offset + rows])
    return {"w": st, "b": torch.arange(3.0) + seed}


def local_rows(value: Any) -> list[list[float]]:
    shards = value.local_shards()
    return shards[0].tensor.tolist() if shards else []


def save_both(rank: int, world: int, root: str) -> dict[str, Any]:
    """The same ShardedTensor state saved by dcp.save and by ckptio.save."""
    import torch.distributed.checkpoint as dcp

    import ckptio

    saved = state(world, seed=1)
    dcp.save(saved, checkpoint_id=os.path.join(root, "dcp"))
    ckptio.save(saved, os.path.join(root, "ckptio"))
    return {"rows": local_rows(saved["w"])}


def load_each(rank: int, world: int, root: str) -> dict[str, Any]:
    """Into fresh ShardedTensor templates (other values) on ``world`` ranks: DCP's checkpoint
    by dcp.load (the control) and by ckptio.load, ckptio's by ckptio.load and dcp.load through
    ckptio.DcpReader -> each template's local rows and "b"."""
    import torch.distributed.checkpoint as dcp

    import ckptio

    out: dict[str, Any] = {}
    for name, how in (("dcp", "dcp"), ("dcp", "ckptio"), ("ckptio", "ckptio"),
                      ("ckptio", "dcp_reader")):
        template = state(world, seed=9)
        path = os.path.join(root, name)
        if how == "dcp":
            dcp.load(template, checkpoint_id=path)
        elif how == "dcp_reader":
            dcp.load(template, storage_reader=ckptio.DcpReader(path))
        else:
            ckptio.load(path, template)
        out[f"{name}-by-{how}"] = {"rows": local_rows(template["w"]),
                                   "b": template["b"].tolist()}
    return out


def two_shards_on_one_rank(rank: int, world: int, root: str) -> str:
    """A ShardedTensor whose two row chunks both sit on this rank -> ckptio.save's error."""
    from torch.distributed._shard import sharded_tensor
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec

    import ckptio

    spec = ChunkShardingSpec(dim=0, placements=["rank:0/cpu", "rank:0/cpu"])
    try:
        ckptio.save({"w": sharded_tensor.zeros(spec, ROWS, COLS)}, os.path.join(root, "c"))
    except ckptio.CkptError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "saved"


def _fsdp1(seed: int) -> Any:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    return FSDP(model, device_id=torch.device("cpu"), use_orig_params=True)


def fsdp1_sharded_state_dict(rank: int, world: int, root: str) -> dict[str, Any]:
    """FSDP1 with StateDictType.SHARDED_STATE_DICT (ShardedTensors): trained a step, saved by
    ckptio; a model of other weights loads it in place through the same state dict type ->
    whether every parameter, gathered whole, equals the saved model's."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType

    import ckptio

    model = _fsdp1(seed=0)
    model(torch.randn(4, 8)).sum().backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        saved = model.state_dict()
    kinds = sorted({type(v).__name__ for v in saved.values()})
    ckptio.save({"model": saved}, os.path.join(root, "fsdp1"))
    other = _fsdp1(seed=5)
    with FSDP.state_dict_type(other, StateDictType.SHARDED_STATE_DICT):
        template = other.state_dict()
        ckptio.load(os.path.join(root, "fsdp1"), {"model": template})
        other.load_state_dict(template)
    with FSDP.summon_full_params(model), FSDP.summon_full_params(other):
        same = all(torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters()))
    return {"kinds": kinds, "same": same}
