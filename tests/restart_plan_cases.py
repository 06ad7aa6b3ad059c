"""Per-rank bodies of tests/test_restart_planning.py (module-level: run_ranks forks ranks that
import them). A job of 4 ranks saves a state of Shard(0) DTensors and replicated vectors; a
fresh job of 4 ranks loads it in place, counting the work every rank does before its reads:
how often a DTensor's region is worked out, and how many collective steps the load takes."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

import ckptio
from ckptio.distributed.storegroup import StoreGroup
from ckptio.planning import sharding

N = 12  # layers


def options() -> ckptio.Options:
    """A small pool (each rank would otherwise pre-fault 256 MiB) and short deadlines."""
    return dataclasses.replace(ckptio.Options(buffer_bytes=1 << 20, pool_bytes=4 << 20),
                               rank_timeout_s=10.0)


def full_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    state = {}
    for i in range(N):
        state[f"layer{i}.w"] = torch.randn((64, 40), generator=g)
        state[f"layer{i}.b"] = torch.randn((40,), generator=g)
    return state


def _dtensors(world: int, shapes: dict[str, tuple[int, ...]] | None = None) -> dict[str, Any]:
    """The state as this rank holds it: matrices Shard(0), vectors Replicate (zeros, or
    ``shapes`` overriding some keys' shapes)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for key, value in full_state().items():
        value = torch.zeros((shapes or {}).get(key, value.shape))
        out[key] = distribute_tensor(value, mesh, [Shard(0) if value.dim() == 2 else Replicate()])
    return out


def save(rank: int, world: int, path: str) -> bool:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    state = {k: distribute_tensor(v, mesh, [Shard(0) if v.dim() == 2 else Replicate()])
             for k, v in full_state().items()}
    ckptio.save(state, path, options=options())
    return True


def load_counted(rank: int, world: int, path: str) -> dict[str, Any]:
    """Load in place -> how often this rank worked out a DTensor's region, how many collective
    steps (gathers of ckptio's store group) the load took, and whether every piece is right."""
    into = _dtensors(world)
    counts = {"regions": 0, "steps": 0}
    dtensor, gather = sharding._dtensor, StoreGroup.gather

    def region(*args: Any, **kwargs: Any) -> Any:
        counts["regions"] += 1
        return dtensor(*args, **kwargs)

    def step(self: StoreGroup, data: bytes) -> Any:
        counts["steps"] += 1
        return gather(self, data)

    sharding._dtensor = region  # type: ignore[assignment]
    StoreGroup.gather = step  # type: ignore[method-assign]
    try:
        ckptio.load(path, into, options=options())
    finally:
        sharding._dtensor, StoreGroup.gather = dtensor, gather  # type: ignore[method-assign]
    want = _expected(world)
    equal = all(torch.equal(into[k].to_local(), want[k].to_local()) for k in want)
    return {**counts, "equal": equal}


def _expected(world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    return {k: distribute_tensor(v, mesh, [Shard(0) if v.dim() == 2 else Replicate()])
            for k, v in full_state().items()}


def load_mismatched_on(rank: int, world: int, path: str, bad: int) -> Any:
    """Rank ``bad``'s state has a vector of another length (its plan fails); -> the error
    this rank's load raised (class name, message), and whether it is a CkptError."""
    into = _dtensors(world, {"layer3.b": (41,)} if rank == bad else None)
    try:
        ckptio.load(path, into, options=options())
    except Exception as exc:  # noqa: BLE001 - the test checks what it is
        return type(exc).__name__, str(exc), isinstance(exc, ckptio.CkptError)
    return None


def load_extra_key_on(rank: int, world: int, path: str, lacking: int) -> Any:
    """Rank ``lacking``'s state lacks one layer's bias that every other rank holds: not
    unexpected (some rank asks for it); -> the error, if any, and whether the rest loaded."""
    into = _dtensors(world)
    if rank == lacking:
        del into["layer5.b"]
    try:
        report = ckptio.load(path, into, options=options())
    except Exception as exc:  # noqa: BLE001 - the test checks what it is
        return type(exc).__name__, str(exc)
    want = _expected(world)
    return list(report.unexpected), all(torch.equal(into[k].to_local(), want[k].to_local())
                                        for k in into)
