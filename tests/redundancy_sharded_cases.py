"""Rank functions of tests/test_redundancy_sharded.py (importable by name: ranks are forked from
a clean forkserver): FSDP2 and FSDP2-over-TP training states, as ``get_state_dict`` gives them
(DTensors), saved every step into a memory tier with redundancy across simulated hosts (one rank
per host: tests/redundancy_cases.py plays the hosts), then restored into freshly built models.
Every state is compared by the digests of its whole tensors (``full_tensor``: a collective)."""

from __future__ import annotations

import hashlib
import os
from typing import Any

import torch

import ckptio
from tests.redundancy_cases import (_DELTA, LOSSES, OPTS, _play_host, _tiers,
                                    kill_during_protection)

IN, HIDDEN, OUT = 16, 66, 10  # 66 and 10 rows over 2 or 4 ranks: uneven shards


def _build(layout: str, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """An MLP, FSDP2 over every rank (``fsdp``) or column/row tensor-parallel over the 2x2
    mesh's ``tp`` and FSDP2 over its ``dp`` (``2d``), and its AdamW."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.ReLU(),
                                torch.nn.Linear(HIDDEN, OUT))
    if layout == "2d":
        mesh = init_device_mesh("cpu", (dist.get_world_size() // 2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
    else:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    batch = torch.randn(8, IN, generator=torch.Generator().manual_seed(step))  # alike on all
    model(batch).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def _digests(state: dict[str, Any]) -> dict[str, str]:
    """sha1 of every whole tensor of a (nested) state dict, DTensors gathered (collective)."""
    out: dict[str, str] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key in sorted(value, key=str):
                walk(f"{prefix}.{key}", value[key])
        elif isinstance(value, torch.Tensor):
            whole = value.full_tensor() if hasattr(value, "full_tensor") else value
            data = whole.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
            out[prefix] = hashlib.sha1(data).hexdigest()
    walk("", state)
    return out


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)  # a fresh optimizer's state is made here
    return {"model": msd, "optim": osd, "step": step}


def train(rank: int, world: int, base: str, disk: str, layout: str, spec: str, steps: int,
          delta: bool = False, kill_at: int = 0) -> dict[str, Any]:
    """``steps`` steps, each saved and protected; -> the digests of the state at each step.
    ``kill_at``: SIGKILL this process while the protection of that step is being encoded."""
    _play_host(rank, 1, base)
    model, opt = _build(layout, seed=0)
    mgr = ckptio.CheckpointManager(tiers=_tiers(spec, disk), options=OPTS,
                                   **(_DELTA if delta else {}))
    digests = {}
    for step in range(1, steps + 1):
        _step(model, opt, step)
        state = _state(model, opt, step)
        if step == kill_at:
            os.environ["CKPTIO_TEST_PROTECT_PAUSE_S"] = "60"
        mgr.save(step, state, metrics={"loss": LOSSES.get(step, 0.0)} if delta else None)
        if step == kill_at:
            kill_during_protection(base, rank, step)
        mgr.protected()
        digests[step] = _digests(state)
    status = mgr.status()
    mgr.close()
    return {"digests": digests, "status": status[0]}


def restore(rank: int, world: int, base: str, disk: str, layout: str, spec: str,
            delta: bool = False) -> dict[str, Any]:
    """A restarted job: a model built from another seed, restored in place -> its digests."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    _play_host(rank, 1, base)
    model, opt = _build(layout, seed=1000)
    state = _state(model, opt, -1)
    mgr = ckptio.CheckpointManager(tiers=_tiers(spec, disk), options=OPTS,
                                   **(_DELTA if delta else {}))
    step = mgr.restore(state)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    how = mgr.last_restore
    mgr.close()
    return {"step": step, "state_step": state["step"], "how": how,
            "digests": _digests(_state(model, opt, state["step"])),
            "pid": os.getpid()}


def first_step_estimate(rank: int, world: int) -> dict[str, int]:
    """The memory tier's size estimate of a first step of a Shard(0) DTensor state (what its
    budget checks before any step is held) and the local shard's bytes."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from ckptio.managing.tier import state_nbytes

    mesh = init_device_mesh("cpu", (world,))
    weight = distribute_tensor(torch.zeros(64, 1024), mesh, [Shard(0)])
    return {"estimate": state_nbytes({"w": weight, "step": 1}),
            "local": weight.to_local().numel() * 4}
