"""Per-rank bodies of the multi-rank tests (module-level: ranks are spawned and import them).

Layouts build a state leaf holding part of a reference tensor: "full" (a plain tensor),
"shard0" / "shard1" / "replicate" (DTensor on a 1-D mesh), "mesh2d" (DTensor on a 2 x W/2 mesh,
Shard(0) x Shard(1)), "flat" / "flat2" (FlatShard slices cut off row boundaries, unevenly,
some empty), "box" (TensorShard row blocks of uneven height), "checkpointable" (padded row
blocks declaring DCP's CheckpointableTensor fields). ``save_layout`` / ``load_layout``
also move SPECIALS between ranks (NaN payloads, -0.0, subnormals, float8, complex64, bool:
tests/special_values.py), compared byte for byte.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import torch

import ckptio
from special_values import bits_equal, rand, specials

# a small pool: each rank would otherwise allocate and pre-fault the default 256 MiB
SMALL = ckptio.Options(buffer_bytes=1 << 20, pool_bytes=4 << 20)

SHAPES = {"a": ((7, 5), torch.float32), "b": ((6, 10), torch.bfloat16), "c": ((13,), torch.int64)}


def reference(name: str) -> torch.Tensor:
    shape, dtype = SHAPES[name]
    g = torch.Generator().manual_seed(sum(map(ord, name)) + 7)  # not hash(): salted per process
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-1000, 1000, shape, generator=g, dtype=dtype)


# every bit pattern: NaN payloads, -0.0, infinities and subnormals first (special_values.py)
SPECIALS = {"nan32": ((9, 4), torch.float32), "nan16": ((5, 6), torch.float16),
            "nanbf": ((7, 3), torch.bfloat16), "e4m3": ((10, 3), torch.float8_e4m3fn),
            "e5m2": ((11,), torch.float8_e5m2), "cplx": ((6, 5), torch.complex64),
            "flag": ((13, 2), torch.bool)}


def special_reference(name: str) -> torch.Tensor:
    shape, dtype = SPECIALS[name]
    return specials(dtype, shape, seed=sum(map(ord, name)))


def _cuts(n: int, world: int, skew: float) -> list[int]:
    """Uneven cut points 0 = c0 <= c1 <= ... <= cW = n (some pieces may be empty)."""
    cuts = [0] + [min(n, int(n * (r + skew) / world)) for r in range(1, world)] + [n]
    return sorted(cuts)


def _mesh(world: int, two_d: bool) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2, world // 2) if two_d else (world,))


def fully_shard_linears(model: torch.nn.Module) -> torch.nn.Module:
    """FSDP2 over every rank of the default group: each Linear child, then the root."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.children():
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def leaf(layout: str, full: torch.Tensor, rank: int, world: int) -> Any:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    if layout == "full":
        return full.clone()
    if layout in ("shard0", "shard1", "replicate"):
        dim = 1 if layout == "shard1" and full.dim() > 1 else 0
        placement = Replicate() if layout == "replicate" else Shard(dim)
        return distribute_tensor(full.clone(), _mesh(world, False), [placement])
    if layout == "mesh2d":
        second = Shard(1) if full.dim() > 1 else Replicate()
        return distribute_tensor(full.clone(), _mesh(world, True), [Shard(0), second])
    if layout in ("flat", "flat2"):
        cuts = _cuts(full.numel(), world, 0.37 if layout == "flat" else 0.81)
        return ckptio.FlatShard(full.reshape(-1)[cuts[rank]:cuts[rank + 1]].clone(),
                                tuple(full.shape), cuts[rank])
    if layout == "box":
        cuts = _cuts(full.shape[0], world, 0.6)
        offsets = (cuts[rank],) + (0,) * (full.dim() - 1)
        return ckptio.TensorShard(full[cuts[rank]:cuts[rank + 1]].clone(), tuple(full.shape), offsets)
    if layout == "checkpointable":
        return checkpointable(full, rank, world)
    raise ValueError(layout)


def checkpointable(full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """A plain tensor with the fields of DCP's CheckpointableTensor protocol (torch 2.14+;
    duck-typed, so any torch): this rank's uneven row block of ``full`` after one padding row."""
    cuts = _cuts(full.shape[0], world, 0.45)
    piece = full[cuts[rank]:cuts[rank + 1]]
    padded = torch.cat([torch.zeros((1, *full.shape[1:]), dtype=full.dtype), piece])
    padded.global_shape = tuple(full.shape)  # type: ignore[attr-defined]
    padded.global_offsets = ((cuts[rank],) + (0,) * (full.dim() - 1),)  # type: ignore[attr-defined]
    padded.local_offsets = ((1,) + (0,) * (full.dim() - 1),)  # type: ignore[attr-defined]
    padded.local_sizes = (tuple(piece.shape),)  # type: ignore[attr-defined]
    return padded


def _local_dtensor(full: torch.Tensor, mesh: Any, placements: list[Any]) -> Any:
    """The DTensor ``distribute_tensor`` would make, built from this rank's piece alone (gloo
    cannot scatter float8)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    sizes, offsets = compute_local_shape_and_global_offset(full.shape, mesh, placements)
    piece = full[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))].clone()
    return DTensor.from_local(piece, mesh, placements, run_check=False, shape=full.shape,
                              stride=full.stride())


def special_leaf(layout: str, full: torch.Tensor, rank: int, world: int) -> Any:
    """``leaf``, with DTensors built without collectives."""
    from torch.distributed.tensor import Replicate, Shard

    if layout in ("shard0", "shard1", "replicate"):
        dim = 1 if layout == "shard1" and full.dim() > 1 else 0
        placement = Replicate() if layout == "replicate" else Shard(dim)
        return _local_dtensor(full, _mesh(world, False), [placement])
    if layout == "mesh2d":
        second = Shard(1) if full.dim() > 1 else Replicate()
        return _local_dtensor(full, _mesh(world, True), [Shard(0), second])
    return leaf(layout, full, rank, world)


def specials_for(layout: str, rank: int, world: int, blank: bool = False) -> dict[str, Any]:
    """SPECIALS laid out as ``layout``; ``blank``: other bits of the same dtypes and shapes."""
    out = {}
    for name, (shape, dtype) in SPECIALS.items():
        full = rand(dtype, shape, seed=99) if blank else special_reference(name)
        out[name] = special_leaf(layout, full, rank, world)
    return out


def local(value: Any) -> torch.Tensor:
    if isinstance(value, (ckptio.TensorShard, ckptio.FlatShard)):
        return value.local
    if type(value).__name__ == "DTensor":
        return value.to_local()
    if hasattr(value, "global_offsets"):  # checkpointable(): its shard, not the padding
        return value[1:1 + value.local_sizes[0][0]]
    return value


def state_for(layout: str, rank: int, world: int, zeros: bool = False) -> dict[str, Any]:
    out = {}
    for name in SHAPES:
        full = reference(name)
        out[name] = leaf(layout, torch.zeros_like(full) if zeros else full, rank, world)
    return out


def save_layout(rank: int, world: int, path: str, layout: str) -> None:
    ckptio.save({"model": state_for(layout, rank, world), "special": specials_for(layout, rank, world),
                 "step": 5}, path, options=SMALL)


def load_layout(rank: int, world: int, path: str, layout: str) -> int:
    """Load into ``layout`` and compare every rank's part byte for byte with the reference."""
    state = {"model": state_for(layout, rank, world, zeros=True),
             "special": specials_for(layout, rank, world, blank=True), "step": 0}
    report = ckptio.load(path, state, options=SMALL)
    wants = [("model", name, leaf(layout, reference(name), rank, world)) for name in SHAPES]
    wants += [("special", name, special_leaf(layout, special_reference(name), rank, world))
              for name in SPECIALS]
    for part, name, want in wants:
        if not bits_equal(local(state[part][name]), local(want)):
            raise AssertionError(f"rank {rank}: {part}.{name} differs after loading into {layout}")
    if state["step"] != 5:
        raise AssertionError(f"step {state['step']}")
    return report.nbytes_read


def with_env(env: dict[str, str], fn_name: str, rank: int, world: int, *args: Any) -> Any:
    """``fn_name(rank, world, *args)`` with ``env`` set first (an S3 server's endpoint and
    keys: ranks fork from a server started before the test set them)."""
    os.environ.update(env)
    return globals()[fn_name](rank, world, *args)


def s3_save_layout(rank: int, world: int, env: dict[str, str], path: str, layout: str) -> None:
    with_env(env, "save_layout", rank, world, path, layout)


def s3_load_layout(rank: int, world: int, env: dict[str, str], path: str, layout: str) -> int:
    return with_env(env, "load_layout", rank, world, path, layout)


# ------------------------------------------------------------------ round trip with every kind


def mixed_state(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.tensor import Replicate, distribute_tensor

    mesh = _mesh(world, False)
    torch.manual_seed(100 + rank)  # a per-rank RNG state
    return {
        "w": leaf("shard0", reference("a"), rank, world),
        "r1": distribute_tensor(torch.full((64, 64), 1.5), mesh, [Replicate()]),
        "r2": distribute_tensor(torch.full((64, 64), 2.5), mesh, [Replicate()]),
        "same": torch.arange(4096, dtype=torch.float32),  # plain, equal everywhere
        "nan_same": special_reference("nan32"),  # equal bytes everywhere, not equal by value
        "rng": torch.get_rng_state(),  # plain, different on every rank
        "mine": torch.full((3,), float(rank)),
        "step": 7,
        "loader": {"position": 1000 + rank},
    }


def api_imported(rank: int, world: int) -> list[str]:
    """Which of ckptio's API modules this rank found imported when it started (forked from the
    warm forkserver, which imports them once: rank_processes.PRELOAD)."""
    import sys

    return [m for m in ("torch._dynamo", "ckptio.api", "ckptio.shared", "ckptio.managing.manager")
            if m in sys.modules]


def roundtrip(rank: int, world: int, path: str) -> dict[str, Any]:
    state = mixed_state(rank, world)
    ckptio.save(state, path, options=SMALL)
    fresh = mixed_state(rank, world)
    for key in ("w", "r1", "r2"):
        local(fresh[key]).zero_()
    fresh["same"].zero_()
    fresh["nan_same"].zero_()
    fresh["rng"] = torch.zeros_like(fresh["rng"])
    fresh["mine"].zero_()
    fresh["step"], fresh["loader"]["position"] = 0, 0
    ckptio.load(path, fresh, options=SMALL)
    for key in state:
        a, b = state[key], fresh[key]
        if isinstance(a, dict):
            assert a == b, (key, a, b)
        elif isinstance(a, int):
            assert a == b, (key, a, b)
        else:
            assert bits_equal(local(a), local(b)), key
    with open(os.path.join(path, "manifest.json")) as f:
        f.readline()
        return json.loads(f.readline())


# ------------------------------------------------------------------ faults


def fault_on_one_rank(rank: int, world: int, path: str, where: str) -> str:
    """Save once (good), then a second save that fails on rank 1 only; -> this rank's error."""
    from ckptio.testing.faults import inject

    ck = ckptio.Checkpointer(SMALL)
    ck.save(state_for("shard0", rank, world), path)
    second = state_for("shard0", rank, world)
    for value in second.values():
        local(value).fill_(1)
    if rank == 1 and where == "write":
        inject(ck, fail_write=1)
    if rank == 1 and where == "plan":
        second["bad"] = {1, 2}  # a set: cannot be stored without pickle
    try:
        ck.save(second, path)
    except ckptio.CkptError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


# ------------------------------------------------------------------ plan reuse


def reuse(rank: int, world: int, root: str) -> list[int]:
    """Three saves through one Checkpointer, state changed in place between them (and a plain
    tensor equal on all ranks at first, then different): each checkpoint holds its own values."""
    ck = ckptio.Checkpointer(SMALL)
    state = {"model": state_for("shard0", rank, world), "plain": torch.zeros(8), "step": 0}
    for step in range(3):
        for value in state["model"].values():
            local(value).copy_(local(value) + 1)
        if step == 2:
            state["plain"].fill_(float(rank + 10))  # now per rank
        state["step"] = step
        ck.save(state, os.path.join(root, f"s{step}"))
    return [sum(m.reused for m in ck._ranks.memories())]


def check_reuse(rank: int, world: int, root: str) -> None:
    for step in range(3):
        state = {"model": state_for("shard0", rank, world, zeros=True), "plain": torch.zeros(8),
                 "step": -1}
        ckptio.load(os.path.join(root, f"s{step}"), state, options=SMALL)
        for name in SHAPES:
            expected = local(leaf("shard0", reference(name), rank, world))
            for _ in range(step + 1):
                expected = expected + 1  # as the saves did: step by step (float rounding)
            assert bits_equal(local(state["model"][name]), expected), (step, name)
        plain = float(rank + 10) if step == 2 else 0.0
        assert bits_equal(state["plain"], torch.full((8,), plain)), (step, state["plain"])
        assert state["step"] == step


# ------------------------------------------------------------------ small plain between big shards

INTERLEAVED_N = 50_000  # floats per shard: the gap a small entry's read could run through


def interleaved_full() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    out = {}
    for i in range(8):  # in file order: a small plain tensor, a big sharded one, ...
        out[f"l{i}.norm"] = torch.randn(16, generator=g)
        out[f"l{i}.weight"] = torch.randn(2 * INTERLEAVED_N, generator=g)
    return out


def save_interleaved(rank: int, world: int, path: str) -> None:
    state = {k: leaf("shard0", v, rank, world) if v.numel() > 16 else v
             for k, v in interleaved_full().items()}
    ckptio.save(state, path, options=SMALL)


# ------------------------------------------------------------------ lazy save of DTensor params


def lazy_dtensor(rank: int, world: int, path: str) -> None:
    """A lazy async save of DTensor parameters and their optimizer: the step right after the
    call waits for the capture, so the checkpoint holds the values from before the step."""
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = _mesh(world, False)
    weight = torch.nn.Parameter(distribute_tensor(reference("a"), mesh, [Shard(0)]))
    opt = torch.optim.SGD([weight], lr=0.5, momentum=0.9)
    weight.grad = distribute_tensor(torch.ones(SHAPES["a"][0]), mesh, [Shard(0)])
    opt.step()  # momentum buffers exist now
    before = {"w": local(weight).clone(), "m": local(opt.state[weight]["momentum_buffer"]).clone()}
    # not the optimizer's: copied before async_save returns, and laid out first on disk (so
    # the written order differs from the planned one)
    buf = distribute_tensor(reference("a") * 3, mesh, [Shard(0)])
    count = torch.tensor([rank + 1.0])
    ck = ckptio.Checkpointer(SMALL)
    handle = ck.async_save({"w": weight, "opt": opt.state_dict(), "buf": buf, "count": count},
                           path, lazy=True, optimizers=[opt])
    local(buf).zero_()
    count.zero_()
    opt.step()  # waits for the capture (a step pre-hook), then changes weight and momentum
    handle.wait()
    assert not torch.equal(local(weight), before["w"])
    loaded = {"w": distribute_tensor(torch.zeros(SHAPES["a"][0]), mesh, [Shard(0)]),
              "opt": {"state": {0: {"momentum_buffer": distribute_tensor(
                  torch.zeros(SHAPES["a"][0]), mesh, [Shard(0)])}},
                      "param_groups": opt.state_dict()["param_groups"]},
              "buf": distribute_tensor(torch.zeros(SHAPES["a"][0]), mesh, [Shard(0)]),
              "count": torch.zeros(1)}
    ck.load(path, loaded)
    assert bits_equal(local(loaded["buf"]), local(distribute_tensor(reference("a") * 3, mesh, [Shard(0)])))
    assert bits_equal(loaded["count"], torch.tensor([rank + 1.0]))
    assert bits_equal(local(loaded["w"]), before["w"])
    assert bits_equal(local(loaded["opt"]["state"][0]["momentum_buffer"]), before["m"])


# ------------------------------------------------------------------ errors seen on some ranks only


def unreported_error_on_one_rank(rank: int, world: int, path: str) -> str:
    """A failed async save whose error rank 0 has seen (wait()) and rank 1 has not: the next
    save raises rank 1's old error there and RankFailedError on rank 0, instead of hanging."""
    from ckptio.testing.faults import inject

    ck = ckptio.Checkpointer(SMALL)
    ck.save(state_for("shard0", rank, world), path)  # resources made, a checkpoint exists
    if rank == 1:
        inject(ck, fail_write=1)
    handle = ck.async_save(state_for("shard0", rank, world), path)
    if rank == 0:
        try:
            handle.wait()
        except ckptio.CkptError:
            pass
    try:
        ck.save(state_for("shard0", rank, world), path)
    except ckptio.CkptError as exc:
        return type(exc).__name__
    return "no error"


def load_fails_on_one_rank(rank: int, world: int, path: str) -> str:
    ckptio.save(state_for("shard0", rank, world), path, options=SMALL)
    state = state_for("shard0", rank, world, zeros=True)
    if rank == 1:
        state["extra"] = torch.zeros(1)  # a key the checkpoint lacks: strict load refuses
    try:
        ckptio.load(path, state, options=SMALL)
    except ckptio.CkptError as exc:
        return type(exc).__name__
    return "no error"


# ------------------------------------------------------------------ CheckpointManager


def _manager_state(rank: int, world: int, step: int) -> dict[str, Any]:
    model = state_for("box", rank, world)  # TensorShard row blocks: each rank reads its own file
    for value in model.values():
        local(value).add_(step)
    return {"model": model, "step": step}


def _flip_rank_part(path: str, key: str, writer: int) -> None:
    """Flip a byte of ``key``'s chunk in the file ``writer`` wrote (only that rank reads it)."""
    with open(os.path.join(path, "manifest.json"), "rb") as f:
        body = json.loads(f.read().split(b"\n", 1)[1])
    entry = next(t for t in body["tensors"] if t["key"] == key and f"-r{writer:05d}-" in t["file"])
    with open(os.path.join(path, entry["file"]), "r+b") as f:
        f.seek(entry["offset"] + 1)
        byte = f.read(1)[0]
        f.seek(entry["offset"] + 1)
        f.write(bytes([byte ^ 0x10]))


def manager_ranks(rank: int, world: int, root: str) -> dict[str, Any]:
    """Both ranks save steps 1-3 through a CheckpointManager (keep_last=2), restore,
    then restore again after rank 0 damaged rank 1's part of step 3: -> what each rank saw."""
    import warnings

    from ckptio.managing.manager import CheckpointManager

    hidden: list[str] = []  # steps this rank renamed away (retention)
    rename = os.rename

    def spy(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        if ".deleting-" in os.fspath(dst):
            hidden.append(os.path.basename(os.fspath(src)))
        rename(src, dst, *args, **kwargs)

    os.rename = spy  # this rank's process only
    try:
        mgr = CheckpointManager(root, keep_last=2, options=SMALL)
        for step in (1, 2, 3):
            # 2 and 3 async: 2's retention runs while 3's save talks to the other rank
            mgr.save(step, _manager_state(rank, world, step), asynchronous=step > 1)
        mgr.wait()
        steps = mgr.steps()
        restored, same, caught = [], [], []
        for damage in (False, True):
            if damage and rank == 0:
                _flip_rank_part(mgr.path(3), "model.a", writer=1)
            torch.distributed.barrier()
            state = _manager_state(rank, world, 0)
            with warnings.catch_warnings(record=True) as record:
                warnings.simplefilter("always")
                restored.append(mgr.restore(state))
            caught += [str(w.message) for w in record]
            want = _manager_state(rank, world, restored[-1])
            same.append(state["step"] == restored[-1] and all(
                bits_equal(local(state["model"][n]), local(want["model"][n])) for n in SHAPES))
        # rank 0 finds damage, rank 1 a state mismatch: no rank falls back, each raises its own
        if rank == 0:
            _flip_rank_part(mgr.path(3), "model.a", writer=0)
        torch.distributed.barrier()
        state = _manager_state(rank, world, 0) | ({"extra": torch.zeros(1)} if rank else {})
        try:
            mgr.restore(state)
            mixed = "no error"
        except ckptio.CkptError as exc:
            mixed = type(exc).__name__
        mgr.close()
    finally:
        os.rename = rename
    return {"steps": steps, "hidden": hidden, "restored": restored, "same": same,
            "warnings": caught, "mixed": mixed}


def save_load_in_subgroups(rank: int, world: int, root: str) -> dict[str, Any]:
    """Two subgroups of 2 ranks each save and load their own checkpoint with process_group=
    (every rank makes both subgroups, in the same order, as torch requires)."""
    import torch.distributed as dist

    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = groups[rank // 2]
    path = os.path.join(root, f"half{rank // 2}")
    value = torch.full((4, 4), float(rank))
    state = {"w": torch.arange(16.0).reshape(4, 4) * (rank // 2 + 1), f"r{rank}": value,
             "step": 3}
    ckptio.save(state, path, options=SMALL, process_group=mine)
    back = {"w": torch.zeros(4, 4), f"r{rank}": torch.zeros(4, 4), "step": 0}
    ckptio.load(path, back, options=SMALL, process_group=mine)
    # rank 0's process holds the job's store (init_process_group without torchrun): it must
    # not exit while the other subgroup still saves through it, as with torch's own collectives
    dist.barrier()
    return {"w": back["w"].tolist(), "mine": back[f"r{rank}"].tolist(), "step": back["step"]}


# ------------------------------------------------------------------ regular layouts


GRID_LAYOUTS = {  # key -> (shape, placements over a 2 x 2 mesh); uneven sizes, nested Shard(0)
    "col": ((10, 6), ("S0", "S0")), "row": ((6, 9), ("S0", "S1")), "norm": ((7,), ("R", "R")),
    "half": ((9, 4), ("S0", "R")), "tp": ((5, 4), ("R", "S1")), "small": ((3, 2), ("S0", "S0")),
}


def grid_state(rank: int, world: int, fill: float | None = None) -> dict[str, Any]:
    """DTensors on a 2 x 2 mesh as FSDP x TP lays them out; "small" has an empty piece (3 rows
    in 4 nested pieces), and "head" is tied to it (the same DTensor: the rank whose piece is
    empty cannot see the tie). ``fill``: every element that value."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2))
    state: dict[str, Any] = {}
    for n, (key, (shape, kinds)) in enumerate(GRID_LAYOUTS.items()):
        full = torch.arange(n * 1000, n * 1000 + math.prod(shape), dtype=torch.float32).reshape(shape)
        if fill is not None:
            full.fill_(fill)
        placements = [Replicate() if k == "R" else Shard(int(k[1])) for k in kinds]
        state[key] = distribute_tensor(full, mesh, placements)
    state["head"] = state["small"]
    state["step"] = 3
    return state


def grid_roundtrip(rank: int, world: int, path: str) -> dict[str, Any]:
    """Save a regular layout (checking it is planned per tensor), load it back in place;
    -> the manifest body and the keys this rank planned as regular."""
    from ckptio.distributed import rankplan
    from ckptio.distributed.dist import over_torch
    from ckptio.format.flatten import flatten
    from ckptio.planning.plan import build_plan

    import torch.distributed as dist

    state = grid_state(rank, world)
    plan, sources = build_plan(flatten(state), allow_pickle=False)
    mine = rankplan.local_plan(over_torch(dist.group.WORLD), plan, sources, flatten(state))
    regular = sorted(i.key for i in mine.regular.items) if mine.regular else []
    ckptio.save(state, path, options=SMALL)
    fresh = grid_state(rank, world, fill=-1.0)
    fresh["step"] = 0
    ckptio.load(path, fresh, options=SMALL)
    for key in GRID_LAYOUTS:
        assert bits_equal(local(state[key]), local(fresh[key])), key
    assert fresh["head"] is fresh["small"] and fresh["step"] == 3
    with open(os.path.join(path, "manifest.json")) as f:
        f.readline()
        return {"manifest": json.loads(f.readline()), "regular": regular}


def regular_edges(rank: int, world: int, root: str) -> str | None:
    """(1) One Checkpointer saving a layout over WORLD, another layout of the same shapes over a
    group of all ranks, then that layout over WORLD again (a plan-cache hit there): each save
    must record its own layout. (2) Ranks 0 and 1 save DTensors whose 2 x 2 mesh spans ranks
    beyond their group: the per-chunk path (a replica group of HSDP saving its replica)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    full = torch.arange(64.0).reshape(8, 8)
    line = init_device_mesh("cpu", (world,))
    rows = {"w": distribute_tensor(full, line, [Shard(0)])}
    cols = {"w": distribute_tensor(full, line, [Shard(1)])}
    everyone = dist.new_group(list(range(world)))
    ck = ckptio.Checkpointer(SMALL)
    ck.save(rows, os.path.join(root, "a"))
    ck.save(cols, os.path.join(root, "b"), process_group=everyone)
    ck.save(cols, os.path.join(root, "c"))
    square = init_device_mesh("cpu", (2, 2))
    hsdp = {"w": distribute_tensor(full, square, [Replicate(), Shard(0)])}
    pair = dist.new_group([0, 1])
    out = None
    if rank < 2:
        ckptio.Checkpointer(SMALL).save(hsdp, os.path.join(root, "d"), process_group=pair)
        out = "saved"
    dist.barrier()
    return out


# ------------------------------------------------------------------ placements that are not regions


def _partial_state(rank: int, world: int) -> dict[str, Any]:
    """A DTensor with a Partial placement (each rank holds an addend of the value)."""
    from torch.distributed.tensor import DTensor, Partial

    addend = torch.full((4, 4), float(rank + 1))
    return {"grad": DTensor.from_local(addend, _mesh(world, False), [Partial()])}


def _interleaved_state(rank: int, world: int) -> dict[str, Any]:
    """A hand-made ``_StridedShard(0, sf=2)`` over a 1-D mesh of ``world`` ranks: each rank
    holds every other pair of rows (rank 0 of 2: rows 0, 1, 4, 5 of 8), no box of the tensor.
    (FSDP2 over tensor parallelism, ``(_StridedShard(0, sf=tp), Shard(0))``, holds one box per
    rank and saves: tests/test_strided_shard.py.)"""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import _StridedShard

    local = torch.full((4, 4), float(rank))
    weight = DTensor.from_local(local, _mesh(world, False), [_StridedShard(0, split_factor=2)],
                                shape=torch.Size((4 * world, 4)), stride=(4, 1))
    return {"model": {"0.weight": weight}}


def refused_placement(rank: int, world: int, root: str, kind: str) -> dict[str, Any]:
    """Save a state holding a placement ckptio cannot store (and a tensor it can), into
    ``root/prev`` (which holds a checkpoint) and ``root/fresh`` (nothing yet); -> each
    attempt's error, and the refused tensor's placements as torch names them."""
    if kind == "partial":
        state = _partial_state(rank, world)
        refused = state["grad"]
    else:
        state = _interleaved_state(rank, world)
        refused = state["model"]["0.weight"]
    state |= {"other": leaf("shard0", reference("a"), rank, world), "step": 9}
    errors = {}
    for where in ("prev", "fresh"):
        try:
            ckptio.save(state, os.path.join(root, where), options=SMALL)
            errors[where] = "no error"
        except ckptio.CkptError as exc:
            errors[where] = f"{type(exc).__name__}: {exc}"
    return {"errors": errors, "placements": repr(refused.placements)}


# ------------------------------------------------------------------ per_rank_from on another world


def next_saved_rank(rank: int) -> int:
    """A per_rank_from function: new rank r takes saved rank (r + 1) % 2."""
    return (rank + 1) % 2


def per_rank_values_from(rank: int, world: int, path: str,
                         mapping: dict[int, int]) -> dict[str, Any]:
    """Load the per-rank values ``roundtrip`` saved on 2 ranks, in place on this world, with
    per_rank_from a mapping, then a function; -> what each load put in place."""
    out: dict[str, Any] = {}
    for name, policy in (("mapping", mapping), ("function", next_saved_rank)):
        state = {"mine": torch.zeros(3), "loader": {"position": 0}, "rng": torch.zeros_like(
            torch.get_rng_state())}
        ckptio.load(path, state, keys=["mine", "loader", "rng"], per_rank_from=policy,
                    options=SMALL)
        out[name] = {"mine": state["mine"].tolist(), "position": state["loader"]["position"],
                     "rng": state["rng"].tolist()}
    return out


# ------------------------------------------------------------------ ranks naming other checkpoints


def paths_disagree(rank: int, world: int, root: str) -> dict[str, Any]:
    """Saves and loads where the ranks pass different paths (a step number or a timestamp in
    the name that differs between ranks): each refused on every rank with a CkptError, nothing
    committed; a manager whose ranks save different steps keeps its previous step."""
    out: dict[str, Any] = {}
    mine = {"w": torch.arange(6.0), "r": torch.full((2,), float(rank))}  # "r": per rank
    for name, call in (
            ("save", lambda: ckptio.save(mine, os.path.join(root, f"step-{rank}"), options=SMALL)),
            ("load", lambda: ckptio.load(os.path.join(root, "AB"[rank]), back, options=SMALL))):
        if name == "load":
            for where, fill in (("A", 1.0), ("B", 2.0)):
                ckptio.save({"w": torch.full((6,), fill)}, os.path.join(root, where),
                            options=SMALL)
        back = {"w": torch.zeros(6)}
        try:
            call()
            out[name] = "no error"
        except ckptio.CkptError as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
    out["committed"] = sorted(d for d in os.listdir(root)
                              if os.path.exists(os.path.join(root, d, "manifest.json")))
    with ckptio.CheckpointManager(os.path.join(root, "run"), options=SMALL) as mgr:
        mgr.save(1, mine)
        try:
            mgr.save(2 + rank, mine)
            out["manager"] = "no error"
        except ckptio.CkptError as exc:
            out["manager"] = f"{type(exc).__name__}: {exc}"
        back = {"w": torch.zeros(6), "r": torch.zeros(2)}
        out["restored"] = mgr.restore(back)
        out["same"] = bits_equal(back["r"], mine["r"]) and bits_equal(back["w"], mine["w"])
    return out


def manager_out_of_step(rank: int, world: int, root: str) -> dict[str, Any]:
    """A manager's ranks calling different methods: rank 0 lists its steps while rank 1 saves
    (each a different first exchange); -> what each call returned or raised, and the steps
    every rank lists afterwards, in step again."""
    opts = ckptio.Options(rank_timeout_s=3, step_timeout_s=6, buffer_bytes=1 << 20,
                          pool_bytes=4 << 20)
    out: dict[str, Any] = {}
    mgr = ckptio.CheckpointManager(root, options=opts)
    mgr.save(1, {"w": torch.arange(4.0)})
    try:
        out["mixed"] = repr(mgr.steps() if rank == 0 else mgr.save(2, {"w": torch.ones(4)}))
    except ckptio.CkptError as exc:
        out["mixed"] = f"{type(exc).__name__}: {exc}"
    out["steps"] = mgr.steps()
    mgr.close()
    return out


def manager_restore_killed(rank: int, world: int, root: str, mark: str) -> str | None:
    """Save step 1 on every rank, then restore it with rank 1 killed (SIGKILL) while it reads;
    -> what the survivor's restore raised."""
    from ckptio.testing import killed

    opts = ckptio.Options(rank_timeout_s=3, step_timeout_s=60, buffer_bytes=1 << 20,
                          pool_bytes=4 << 20)
    mgr = ckptio.CheckpointManager(root, options=opts)
    mgr.save(1, {"w": torch.arange(4.0), "r": torch.full((2,), float(rank))})
    if rank == 1:
        killed.arm("load:read", mark, "kill")
    try:
        mgr.restore({"w": torch.zeros(4), "r": torch.zeros(2)})
    except ckptio.CkptError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None
