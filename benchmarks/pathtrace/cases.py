"""The five paths of issue 44, traced (see tracer.py). Run: python run.py OUTDIR."""
from __future__ import annotations

import os
import torch

import ckptio
import ckptio.shared  # noqa: F401  - every module a path runs is imported before tracing:
import ckptio.managing.manager  # noqa: F401    the traced call is the first use (cold), imports excluded
try:  # the layout before issue 44 (670eac5): the tiered manager, imported lazily by __new__
    import ckptio.tiering.manager  # noqa: F401
except ImportError:  # after: managing/manager.py imports every part at module level
    pass
from tracer import Tracer

MiB = 1 << 20


def _model(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(8, 16)).pow(2).mean().backward()
    opt.step()
    return model, opt


def path1(out: str) -> list[dict]:
    model, opt = _model()
    state = {"model": model, "optim": opt, "step": 3}
    t = Tracer()
    t.start()
    try:
        ckptio.save(state, os.path.join(out, "p1"))
    finally:
        t.stop()
    return t.result()


def _fsdp(model: torch.nn.Module) -> torch.nn.Module:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.children():
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def path2(rank: int, world: int, out: str) -> list[dict]:
    torch.manual_seed(0)
    model = _fsdp(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(),
                                      torch.nn.Linear(32, 4)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(8, 16)).pow(2).mean().backward()
    opt.step()
    state = {"model": model, "optim": opt, "step": 3}
    t = Tracer()
    t.start()
    try:
        ckptio.save(state, os.path.join(out, "p2"))
    finally:
        t.stop()
    return t.result()


def path3(rank: int, world: int, out: str) -> list[dict]:
    """The 2-rank FSDP2 checkpoint of path 2 loaded into Shard(1) DTensors (another layout)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    params = {k: distribute_tensor(v.detach().clone(), mesh, [Shard(v.dim() - 1)])
              for k, v in model.state_dict().items()}
    state = {"model": params}
    t = Tracer()
    t.start()
    try:
        report = ckptio.load(os.path.join(out, "p2"), state, keys="model")
    finally:
        t.stop()
    assert report.loaded, report
    return t.result()


def _play_host(rank: int, base: str) -> None:
    os.environ["CKPTIO_HOST_ID"] = f"host{rank}"
    os.environ["CKPTIO_SHM_DIR"] = os.path.join(base, f"host{rank}")
    os.makedirs(os.environ["CKPTIO_SHM_DIR"], exist_ok=True)


def _tiers(disk: str) -> list:
    return [ckptio.Tier("shm://run", redundancy=ckptio.Partners(1)),
            ckptio.Tier(disk, every=10)]


OPTS = dict(buffer_bytes=MiB, pool_bytes=4 * MiB)


def path4(rank: int, world: int, base: str, disk: str) -> list[dict]:
    _play_host(rank, base)
    model, opt = _model(rank)
    state = {"model": model, "optim": opt, "step": 10}
    t = Tracer()
    t.start()
    try:
        mgr = ckptio.CheckpointManager(tiers=_tiers(disk), options=ckptio.Options(**OPTS))
        mgr.save(10, state)
        mgr.protected()
        mgr.drained()
    finally:
        t.stop()
    mgr.close()
    return t.result()


def path5(rank: int, world: int, base: str, disk: str) -> list[dict]:
    _play_host(rank, base)
    model, opt = _model(100 + rank)
    state = {"model": model, "optim": opt, "step": -1}
    mgr = ckptio.CheckpointManager(tiers=_tiers(disk), options=ckptio.Options(**OPTS))
    t = Tracer()
    t.start()
    try:
        step = mgr.restore(state)
    finally:
        t.stop()
    how = mgr.last_restore
    mgr.close()
    return [{"step": step, "how": {k: v for k, v in (how or {}).items()}}] + t.result()
