"""Restarting a job on another number of ranks: FSDP2 and 2-D DTensor checkpoints loaded on more
or fewer real gloo ranks, bitwise against the saved values, with the model changed meanwhile,
per-rank values, a manager picking the newest step, and ranks that disagree.

The rank functions are at module level (ranks import them by name).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptio.testing.rank_processes import run_ranks
from dist_cases import fully_shard_linears

DIMS = (5, 7, 2)  # 7 rows over 2 or 3 ranks: uneven; 2 rows over 3 ranks: one empty shard
TIMEOUT_S = 120


# ------------------------------------------------------------------------------------------------
# what every rank runs


def build(dims: tuple[int, ...], seed: int, fsdp: bool) -> tuple[torch.nn.Module, Any]:
    """An MLP of Linear layers over ``dims`` and its AdamW; FSDP2 over every rank if ``fsdp``."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[torch.nn.Linear(a, b) for a, b in zip(dims, dims[1:])])
    if fsdp:
        fully_shard_linears(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train(model: torch.nn.Module, opt: Any, dims: tuple[int, ...], steps: int) -> None:
    """``steps`` steps on a fixed batch (the same on every rank)."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(4, dims[0], generator=gen)
    for _ in range(steps):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()


def whole(state: Any) -> Any:
    """``state`` with every DTensor gathered whole (a collective) and tensors cloned."""
    from torch.distributed.tensor import DTensor

    if isinstance(state, dict):
        return {k: whole(v) for k, v in state.items()}
    if isinstance(state, DTensor):
        return state.full_tensor().clone()
    if isinstance(state, torch.Tensor):
        return state.clone()
    return state


def states(model: torch.nn.Module, opt: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}


def save_fsdp(rank: int, world: int, path: str, dims: tuple[int, ...], extra: dict) -> Any:
    """Train FSDP2 two steps and save model, optimizer, this rank's RNG, and ``extra``."""
    import ckptio

    model, opt = build(dims, 0, True)
    train(model, opt, dims, 2)
    torch.manual_seed(100 + rank)
    state = {**states(model, opt), "rng": torch.get_rng_state(), "step": 2}
    state.update(extra.get(rank, {}))
    ckptio.save(state, path)
    return whole(states(model, opt))


def load_fsdp(rank: int, world: int, path: str, dims: tuple[int, ...], kwargs: dict,
              with_rng: bool, extra: dict | None = None) -> Any:
    """Build FSDP2 (another seed) on ``world`` ranks, load, return the report or the error."""
    import ckptio

    model, opt = build(dims, 1, True)
    train(model, opt, dims, 1)  # the optimizer has state to fill
    state = states(model, opt)
    if with_rng:
        state["rng"] = torch.get_rng_state()
    state.update((extra or {}).get(rank, {}))
    try:
        report = ckptio.load(path, state, **kwargs)
    except Exception as e:  # noqa: BLE001 - the test looks at it
        return {"error": type(e).__name__, "msg": str(e), "ckpt": isinstance(e, ckptio.CkptError)}
    return {"report": report, "whole": whole(states(model, opt)), "rng": state.get("rng"),
            "extra": {k: v for k, v in state.items() if k not in ("model", "optim", "rng")}}


def load_diverging(rank: int, world: int, path: str, dims: tuple[int, ...], how: str,
                   share: bool = True) -> Any:
    """Load with each rank naming another checkpoint (``paths``) or other ``keys``."""
    import time

    import ckptio

    model, opt = build(dims, 1, True)
    state = states(model, opt)
    kwargs: dict[str, Any] = {"strict": False}
    where = path
    if how == "paths":
        where = path if rank == 0 else path + "-other"
    else:
        kwargs["keys"] = "model" if rank == 0 else "optim"
    t = time.monotonic()
    try:
        options = ckptio.Options(broadcast_replicated=share)
        ckptio.Checkpointer(options).load(where, state, **kwargs)
    except Exception as e:  # noqa: BLE001 - the test looks at it
        return {"error": type(e).__name__, "msg": str(e), "ckpt": isinstance(e, ckptio.CkptError),
                "s": time.monotonic() - t}
    return {"ok": True, "s": time.monotonic() - t}


def manager_cycle(rank: int, world: int, root: str, dims: tuple[int, ...], steps: list[int],
                  restore: bool, rng: bool = False, kwargs: dict | None = None) -> Any:
    """Save ``steps`` through a manager (or restore the newest step) on ``world`` ranks."""
    import ckptio

    model, opt = build(dims, 0 if not restore else 1, True)
    train(model, opt, dims, 1)
    mgr = ckptio.CheckpointManager(root, keep_last=5, save_every=1)
    try:
        torch.manual_seed(100 + rank)
        extra = {"rng": torch.get_rng_state()} if rng else {}
        state = {**states(model, opt), **extra}
        if restore:
            try:
                got = mgr.restore(state, **(kwargs or {}))
            except ckptio.CkptError as e:
                return {"error": type(e).__name__, "msg": str(e)}
            return {"step": got, "whole": whole(states(model, opt)), "rng": state.get("rng")}
        for s in steps:
            train(model, opt, dims, 1)
            state = {**states(model, opt), **extra}
            mgr.save(s, state)
        return {"whole": whole(states(model, opt))}
    finally:
        mgr.close()


def mesh_tensors(world: int, shape2d: tuple[int, int]) -> dict[str, Any]:
    """Two DTensors on a ``shape2d`` mesh of ``world`` ranks: a (5, 3) matrix with Shard(0) and
    Shard(1) and a (2,) vector with Shard(0), Replicate: uneven shards, some of them empty."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    full = torch.arange(15, dtype=torch.float32).reshape(5, 3)
    vec = torch.tensor([7.0, 8.0])
    if world == 0:  # the reference: whole tensors
        return {"m": full, "v": vec}
    mesh = init_device_mesh("cpu", shape2d)
    return {"m": distribute_tensor(full.clone(), mesh, [Shard(0), Shard(1)]),
            "v": distribute_tensor(vec.clone(), mesh, [Shard(0), Replicate()])}


def mesh_save(rank: int, world: int, path: str, shape2d: tuple[int, int]) -> None:
    import ckptio

    ckptio.save(mesh_tensors(world, shape2d), path)


def mesh_load(rank: int, world: int, path: str, shape2d: tuple[int, int]) -> Any:
    """Load into zeros laid out as Shard(1), Shard(0) / Replicate, Shard(0) on ``shape2d``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import ckptio

    mesh = init_device_mesh("cpu", shape2d)
    state = {"m": distribute_tensor(torch.zeros(5, 3), mesh, [Shard(1), Shard(0)]),
             "v": distribute_tensor(torch.zeros(2), mesh, [Replicate(), Shard(0)])}
    ckptio.load(path, state)
    return {"whole": whole(state), "local": [tuple(state[k].to_local().shape) for k in "mv"]}


# ------------------------------------------------------------------------------------------------
# the tests


def _same(got: dict[str, Any], ref: dict[str, Any]) -> None:
    """Every parameter and optimizer state tensor equal bit for bit."""
    for key, value in ref["model"].items():
        assert torch.equal(got["model"][key], value), key
    for name, fields in ref["optim"]["state"].items():
        for field, value in fields.items():
            assert torch.equal(got["optim"]["state"][name][field], value), (name, field)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, Any]]:
    """FSDP2 + AdamW trained on 2 ranks, saved with each rank's RNG and a key of rank 0 only."""
    path = str(tmp_path_factory.mktemp("elastic") / "ck")
    extra = {0: {"only0": torch.tensor([1.0, 2.0])}}
    ref = run_ranks(2, save_fsdp, path, DIMS, extra, timeout_s=TIMEOUT_S)
    return path, ref[0]


@pytest.mark.parametrize("world", [3, 1])
def test_fsdp2_two_ranks_into_other_world_sizes_bitwise(saved, world: int) -> None:
    path, ref = saved
    out = run_ranks(world, load_fsdp, path, DIMS, {"strict": False}, False,
                    timeout_s=TIMEOUT_S)
    for got in out:
        assert "error" not in got, got
        _same(got["whole"], ref)
        assert set(got["report"].unexpected) == {"only0", "step", "rng"}


def test_three_ranks_into_two(tmp_path: Path) -> None:
    path = str(tmp_path / "ck")
    ref = run_ranks(3, save_fsdp, path, DIMS, {}, timeout_s=TIMEOUT_S)[0]
    for got in run_ranks(2, load_fsdp, path, DIMS, {"strict": False}, False,
                         timeout_s=TIMEOUT_S):
        assert "error" not in got, got
        _same(got["whole"], ref)


def test_rank_zero_only_key_reaches_whichever_rank_asks(saved) -> None:
    path, _ = saved
    extra = {2: {"only0": torch.zeros(2)}}
    out = run_ranks(3, load_fsdp, path, DIMS, {"strict": False}, False, extra,
                    timeout_s=TIMEOUT_S)
    assert torch.equal(out[2]["extra"]["only0"], torch.tensor([1.0, 2.0]))
    assert "only0" in out[2]["report"].loaded and "only0" not in out[0]["report"].unexpected


def test_per_rank_rng_on_another_world_size_refused_then_chosen(saved) -> None:
    path, _ = saved
    for got in run_ranks(3, load_fsdp, path, DIMS, {"strict": False}, True,
                         timeout_s=TIMEOUT_S):
        assert got["ckpt"] and "['rng']" in got["msg"] and "per_rank_from" in got["msg"], got
    torch.manual_seed(100)  # what saved rank 0 had
    rank0 = torch.get_rng_state()
    for got in run_ranks(3, load_fsdp, path, DIMS,
                         {"strict": False, "per_rank_from": 0}, True, timeout_s=TIMEOUT_S):
        assert torch.equal(got["rng"], rank0)


def test_added_layer_strict_names_the_keys_on_every_rank(saved) -> None:
    path, ref = saved
    grown = (*DIMS, 3)
    for got in run_ranks(3, load_fsdp, path, grown, {"keys": ("model", "optim")}, False,
                         timeout_s=TIMEOUT_S):
        assert got["ckpt"] and "model.2.weight" in got["msg"] and "strict=False" in got["msg"]
    for got in run_ranks(3, load_fsdp, path, grown, {"strict": False}, False,
                         timeout_s=TIMEOUT_S):
        assert {"model.2.weight", "model.2.bias"} <= set(got["report"].missing)
        for key in ("0.weight", "1.bias"):
            assert torch.equal(got["whole"]["model"][key], ref["model"][key])


def test_resized_layer_leaves_all_its_optimizer_state(saved) -> None:
    """A resized parameter is left as built and so is ALL of its name-keyed optimizer state
    (get_optimizer_state_dict): its saved ``step`` beside fresh moments would be wrong Adam."""
    path, ref = saved
    resized = (DIMS[0], DIMS[1] + 1, DIMS[2])
    for got in run_ranks(3, load_fsdp, path, resized, {"strict": False}, False,
                         timeout_s=TIMEOUT_S):
        state = got["whole"]["optim"]["state"]
        assert float(state["0.weight"]["step"]) == 1.0  # as built (one step), not the saved 2
        assert any(m.startswith("optim.state.0.weight.step") for m in got["report"].mismatched)
        assert torch.equal(state["1.bias"]["exp_avg"], ref["optim"]["state"]["1.bias"]["exp_avg"])
        assert float(state["1.bias"]["step"]) == 2.0  # an unchanged parameter: loaded


@pytest.mark.parametrize("share", [True, False])  # Options.broadcast_replicated
@pytest.mark.parametrize("how", ["paths", "keys"])
def test_ranks_disagreeing_fail_on_every_rank_in_bounded_time(saved, how: str,
                                                               share: bool) -> None:
    path, _ = saved
    other = path + "-other"
    if how == "paths" and not Path(other).exists():
        run_ranks(2, save_fsdp, other, DIMS, {}, timeout_s=TIMEOUT_S)
    started = time.monotonic()
    out = run_ranks(3, load_diverging, path, DIMS, how, share, timeout_s=60)
    assert time.monotonic() - started < 60
    for got in out:
        assert got.get("ckpt"), got
    word = "the checkpoint" if how == "paths" else "keys="
    assert all(f"ranks disagree on {word}" in got["msg"] for got in out[1:])


def test_manager_restores_newest_step_on_new_world_sizes(tmp_path: Path) -> None:
    """The newest step, bitwise, on 3 ranks and 1; the per-rank RNG refused on 3 ranks (never
    a fall back to an older step), then taken from the saved rank per_rank_from names."""
    root = str(tmp_path / "run")
    ref = run_ranks(2, manager_cycle, root, DIMS, [1, 2, 3], False, True, timeout_s=TIMEOUT_S)
    for got in run_ranks(3, manager_cycle, root, DIMS, [], True, True, timeout_s=TIMEOUT_S):
        assert got["error"] == "StateMismatchError" and "step-3" in got["msg"], got
        assert "per_rank_from" in got["msg"]
    torch.manual_seed(101)  # saved rank 1's
    rank1 = torch.get_rng_state()
    for world in (3, 1):
        for got in run_ranks(world, manager_cycle, root, DIMS, [], True, True,
                             {"per_rank_from": 1}, timeout_s=TIMEOUT_S):
            assert got["step"] == 3
            _same(got["whole"], ref[0]["whole"])
            assert torch.equal(got["rng"], rank1)


@pytest.mark.parametrize(("world", "mesh"), [(3, (3, 1)), (1, (1, 1))])
def test_2d_mesh_into_another_mesh_shape(tmp_path: Path, world: int, mesh) -> None:
    path = str(tmp_path / "ck")
    run_ranks(4, mesh_save, path, (2, 2), timeout_s=TIMEOUT_S)
    ref = mesh_tensors(0, (1, 1))
    for got in run_ranks(world, mesh_load, path, mesh, timeout_s=TIMEOUT_S):
        for key in "mv":
            assert torch.equal(got["whole"][key], ref[key]), key
