"""Resume an FSDP2 training run on a different number of ranks and continue with the same losses.

A small MLP is trained with FSDP2 (``fully_shard``, parameters and Adam state are DTensors sharded
on dim 0) on 2 real gloo ranks. One run goes K + M steps uninterrupted; another, independent run
goes K steps and saves with ``ckptio.save`` (every rank, collectively). The checkpoint is then
loaded into freshly built (differently initialised) models on 1 rank (a plain, unsharded model,
and FSDP2 over a 1-rank mesh), on 2 ranks (the saving layout) and on 4 ranks, which train M more
steps. Checked:

* right after the load, every parameter and every optimizer state tensor (exp_avg, exp_avg_sq,
  step), gathered whole, equals what was saved bit for bit, on every layout;
* the M losses after the resume equal the uninterrupted run's last M losses: bit for bit on
  2 ranks, within a stated tolerance on 1 and 4 ranks (justified at RTOL below); on 2 ranks the
  final parameters also equal the uninterrupted run's bit for bit;
* a per-rank value (each rank's RNG state) comes back per rank on the same layout and, with
  ``per_rank_from=0``, as rank 0's on a different one;
* the comparison can fail: resuming with the model but a fresh optimizer (keys=... leaving out
  the optimizer) gives losses far outside the tolerance.

Dims 17 and 5 do not divide by 2 or 4, so shards are uneven; 5 rows over 4 ranks are 2, 2, 1, 0,
so one rank holds an empty shard of the last layer.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest
import torch

from ckptio.testing.rank_processes import run_ranks
from dist_cases import fully_shard_linears

DIMS = (12, 30, 17, 5)  # in -> hidden -> hidden -> out
BATCH = 8  # global batch: divisible by 1, 2 and 4 ranks
K = 3  # steps before the checkpoint
M = 3  # steps after it
LR = 1e-2
INIT_SEED = 0  # the trained runs' initialisation
OTHER_SEED = 1  # resumed models start elsewhere: a load that did nothing cannot pass
RNG_SEED = 100  # + rank: each rank's RNG state in the checkpoint (a per-rank value)

# Tolerance for resuming on 1 or 4 ranks. The checkpoint restores the saved state exactly (checked
# bitwise below), but the arithmetic after it is not the same arithmetic: with W ranks each rank's
# backward sums its BATCH/W samples, FSDP2 reduce-scatters (sums) the W partial gradients and
# divides by W, and the reported loss is an all-reduce of W partial sums (the plain 1-rank model
# sums all BATCH samples in one backward, no reduction). On 1 or 4 ranks these float32 sums are
# taken in a different order, so each gradient and loss element differs from the 2-rank run by a
# few ulps (relative ~1e-7). Adam divides by sqrt(exp_avg_sq), which after K steps of history is
# not near zero, so the update differences stay relative ~1e-7 too, and over M = 3 steps they grow
# by at most a small factor (measured here: losses and final parameters within 2e-7 relative).
# rtol 1e-5 / atol 1e-6 is ~50x that; a resume that lost the optimizer state is off by ~1e-2
# (asserted > 100 * RTOL in test_resume_needs_optimizer_state), so the check can tell them apart.
RTOL = 1e-5
ATOL = 1e-6


# ------------------------------------------------------------------------------------------------
# what every rank runs (module level: the ranks are other processes, which import this module)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: the same on every run and every layout."""
    gen = torch.Generator().manual_seed(10_000 + step)
    return torch.randn(BATCH, DIMS[0], generator=gen), torch.randn(BATCH, DIMS[-1], generator=gen)


def _build(layout: str, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The MLP (initialised from ``seed`` on every rank alike) and its Adam. ``fsdp``: each
    Linear and the root are ``fully_shard``-ed over every rank; ``plain``: an ordinary module."""
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for i, (a, b) in enumerate(zip(DIMS, DIMS[1:])):
        layers.append(torch.nn.Linear(a, b))
        if i < len(DIMS) - 2:
            layers.append(torch.nn.ReLU())
    model = torch.nn.Sequential(*layers)
    if layout == "fsdp":
        fully_shard_linears(model)
    else:
        assert layout == "plain", layout
    return model, torch.optim.Adam(model.parameters(), lr=LR)


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int, rank: int,
                world: int) -> float:
    """One step on this rank's slice of the global batch; -> the global batch's mean loss."""
    import torch.distributed as dist

    x, y = _batch(step)
    n = BATCH // world
    err = (model(x[rank * n:(rank + 1) * n]) - y[rank * n:(rank + 1) * n]).pow(2)
    # mean over the local slice: FSDP2 averages the gradients over the ranks, so the update is
    # that of the mean over the global batch (equal slices)
    err.mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    total = err.detach().sum()
    dist.all_reduce(total)
    return float(total) / (BATCH * DIMS[-1])


def _whole(value: torch.Tensor) -> np.ndarray:
    """The full tensor (a collective for a DTensor), as a numpy copy: run_ranks hands results
    back through a multiprocessing queue, where torch's reducers would send a tensor as a shared
    memory handle that dies with the rank process (see .scratch/fsdp2_bug_ranks_tensor_return.py);
    numpy arrays travel by value."""
    full = value.full_tensor() if hasattr(value, "full_tensor") else value
    return full.detach().numpy().copy()


def _snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, np.ndarray]:
    """Every parameter and optimizer state tensor, whole, by FQN (collective under FSDP2)."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    out = {f"model.{k}": _whole(v) for k, v in get_model_state_dict(model).items()}
    for fqn, slots in get_optimizer_state_dict(model, opt)["state"].items():
        for name, value in slots.items():
            out[f"optim.{fqn}.{name}"] = _whole(value)
    return out


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer | None, step: int,
           rng: torch.Tensor) -> dict[str, object]:
    """What is checkpointed: FQN-keyed model and optimizer state dicts (DTensor values under
    FSDP2, the very tensors the model and optimizer hold), the step, and this rank's RNG state."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    state: dict[str, object] = {"model": get_model_state_dict(model)}
    if opt is not None:
        # on a fresh optimizer this first creates its state (a step with zero grads and lr 0),
        # so the load has exp_avg / exp_avg_sq / step tensors of the right layout to fill
        state["optim"] = get_optimizer_state_dict(model, opt)
    state["step"] = step
    state["rng"] = rng
    return state


def _rng_of(saved_rank: int) -> torch.Tensor:
    """The RNG state rank ``saved_rank`` saved (each rank's differs: a per-rank value)."""
    gen = torch.Generator().manual_seed(RNG_SEED + saved_rank)
    return gen.get_state()


def reference_runs(rank: int, world: int, path: str) -> dict[str, object]:
    """On 2 ranks: K + M uninterrupted steps, then, from scratch, K steps and a save to ``path``."""
    import ckptio

    torch.set_num_threads(1)
    model, opt = _build("fsdp", INIT_SEED)
    losses = [_train_step(model, opt, s, rank, world) for s in range(K + M)]
    final = _snapshot(model, opt)
    del model, opt

    model, opt = _build("fsdp", INIT_SEED)
    saver_losses = [_train_step(model, opt, s, rank, world) for s in range(K)]
    ckptio.save(_state(model, opt, K, _rng_of(rank)), path)
    saved = _snapshot(model, opt)
    return {"losses": losses, "final": final, "saver_losses": saver_losses, "saved": saved}


def _resume_one(rank: int, world: int, path: str, layout: str, saved_world: int,
                restore_optim: bool) -> dict[str, object]:
    """Build a fresh model elsewhere, load the checkpoint into it, train M steps."""
    import ckptio
    from ckptio.errors import StateMismatchError
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    torch.set_num_threads(1)
    model, opt = _build(layout, OTHER_SEED)
    state = _state(model, opt if restore_optim else None, 0, torch.zeros_like(_rng_of(0)))
    # "rng" is the only per-rank key (every rank saved its own); the model and optimizer state
    # are DTensor chunks or equal on every rank (Adam's step, param_groups, "step"). The same
    # number of ranks gets its own rank's by default; another number must choose: here every
    # rank takes saved rank 0's (per_rank_from=0).
    same = world == saved_world
    if not same:  # without a rule, every rank refuses (before reading anything) and can go on
        with pytest.raises(StateMismatchError, match="per_rank_from"):
            ckptio.load(path, state)
    per_rank_from = None if same else 0
    keys = None if restore_optim else ("model", "step", "rng")
    report = ckptio.load(path, state, keys=keys, per_rank_from=per_rank_from)
    assert not report.missing and not report.unexpected and not report.mismatched, report
    set_model_state_dict(model, state["model"])
    if restore_optim:
        set_optimizer_state_dict(model, opt, state["optim"])

    assert state["step"] == K, state["step"]
    want_rng = _rng_of(rank if same else 0)
    assert torch.equal(state["rng"], want_rng), f"rank {rank}: RNG state is not saved rank's"
    loaded = _snapshot(model, opt) if restore_optim else None
    local_shapes = {k: tuple(v.to_local().shape) for k, v in state["model"].items()
                    if hasattr(v, "to_local")}
    losses = [_train_step(model, opt, s, rank, world) for s in range(K, K + M)]
    return {"loaded": loaded, "losses": losses, "final": _snapshot(model, opt),
            "local_shapes": local_shapes}


def resume(rank: int, world: int, path: str, saved_world: int,
           variants: list[tuple[str, bool]]) -> list[dict[str, object]]:
    """_resume_one for each (layout, restore_optim), one after the other, each from scratch: one
    set of rank processes serves several cases (spawning ranks that import torch and FSDP is
    most of this file's runtime)."""
    return [_resume_one(rank, world, path, layout, saved_world, restore_optim)
            for layout, restore_optim in variants]


# ------------------------------------------------------------------------------------------------
# the tests


SAVED_WORLD = 2
# only bounds a hang: 4 ranks that each import torch and FSDP on a busy 2-core machine can take
# most of run_ranks' default 120 s (its process group timeout is half of this)
RANKS_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    path = str(tmp_path_factory.mktemp("fsdp2") / "ckpt")
    per_rank = run_ranks(SAVED_WORLD, reference_runs, path, timeout_s=RANKS_TIMEOUT_S)
    ref = per_rank[0]
    # the loss is all-reduced: every rank reports the same numbers
    assert all(r["losses"] == ref["losses"] for r in per_rank), [r["losses"] for r in per_rank]
    # the saving run is the same computation as the first K steps of the uninterrupted one
    assert ref["saver_losses"] == ref["losses"][:K]
    # training moved: the losses are not all equal (else equal losses would prove nothing)
    assert len(set(ref["losses"])) == K + M, ref["losses"]
    return {"path": path, **ref}


def _assert_bitwise(got: dict[str, np.ndarray], want: dict[str, np.ndarray], what: str) -> None:
    assert sorted(got) == sorted(want), f"{what}: keys {sorted(got)} != {sorted(want)}"
    for key in want:
        g, w = got[key], want[key]
        assert g.dtype == w.dtype and g.shape == w.shape, (key, g.dtype, g.shape, w.dtype, w.shape)
        assert g.tobytes() == w.tobytes(), (
            f"{what}: {key} differs, max |diff| "
            f"{np.abs(g.astype(np.float64) - w.astype(np.float64)).max():.3g}")


# what runs on each number of ranks: (layout, restore the optimizer state)
VARIANTS = {
    1: [("plain", True), ("fsdp", True)],
    2: [("fsdp", True), ("fsdp", False)],
    4: [("fsdp", True)],
}


@pytest.fixture(scope="module")
def resumed(reference: dict[str, object]) -> Callable[[int, str, bool], list[dict[str, object]]]:
    """(world, layout, restore_optim) -> each rank's result of that resume; the ranks of one world
    size run once for all its variants."""
    runs: dict[int, list[list[dict[str, object]]]] = {}

    def get(world: int, layout: str, restore_optim: bool) -> list[dict[str, object]]:
        if world not in runs:
            runs[world] = run_ranks(world, resume, reference["path"], SAVED_WORLD, VARIANTS[world],
                                   timeout_s=RANKS_TIMEOUT_S)
        index = VARIANTS[world].index((layout, restore_optim))
        return [per_variant[index] for per_variant in runs[world]]

    return get


LAYOUTS = [
    pytest.param("plain", 1, id="1-rank-plain"),
    pytest.param("fsdp", 1, id="1-rank-fsdp"),
    pytest.param("fsdp", 2, id="2-ranks-fsdp"),
    pytest.param("fsdp", 4, id="4-ranks-fsdp"),
]


@pytest.mark.parametrize(("layout", "world"), LAYOUTS)
def test_resume_continues_with_same_losses(reference: dict[str, object], resumed: Callable[
        [int, str, bool], list[dict[str, object]]], layout: str, world: int) -> None:
    per_rank = resumed(world, layout, True)
    got = per_rank[0]
    if layout == "fsdp" and world == 4:  # the layout really is uneven, with an empty shard
        shapes = [r["local_shapes"]["4.weight"] for r in per_rank]
        assert shapes == [(2, 17), (2, 17), (1, 17), (0, 17)], shapes

    # the load restores exactly what was saved, whatever the layout
    _assert_bitwise(got["loaded"], reference["saved"], f"after load on {world} rank(s)")

    want = reference["losses"][K:]
    assert all(r["losses"] == got["losses"] for r in per_rank), [r["losses"] for r in per_rank]
    if world == SAVED_WORLD:
        # same layout, same arithmetic: bit for bit, losses and the final state
        assert got["losses"] == want, (got["losses"], want)
        _assert_bitwise(got["final"], reference["final"], "after the resumed steps")
    else:
        # another reduction order: within RTOL / ATOL (see there)
        for step, (g, w) in enumerate(zip(got["losses"], want), start=K):
            assert math.isclose(g, w, rel_tol=RTOL, abs_tol=ATOL), (
                f"step {step}: loss {g!r} resumed on {world} rank(s), {w!r} uninterrupted "
                f"(rel diff {abs(g - w) / abs(w):.3g})")
        for key, w in reference["final"].items():
            torch.testing.assert_close(torch.from_numpy(got["final"][key]), torch.from_numpy(w),
                                       rtol=RTOL * 10, atol=ATOL * 10,
                                       msg=lambda m, key=key: f"{key}: {m}")


def test_resume_needs_optimizer_state(reference: dict[str, object], resumed: Callable[
        [int, str, bool], list[dict[str, object]]]) -> None:
    """The loss comparison would notice a lost optimizer state: resuming the model alone (fresh
    Adam: no moments, step 0) on the saving layout continues with clearly different losses."""
    per_rank = resumed(SAVED_WORLD, "fsdp", False)
    got = per_rank[0]["losses"]
    want = reference["losses"][K:]
    # the first resumed loss is computed before any step, from the restored parameters
    assert got[0] == want[0], (got, want)
    worst = max(abs(g - w) / abs(w) for g, w in zip(got[1:], want[1:]))
    assert worst > 100 * RTOL, (
        f"a resume without the optimizer state is within {worst:.3g} of the uninterrupted run: "
        "the loss tolerance could not tell a lost optimizer state from rounding")
