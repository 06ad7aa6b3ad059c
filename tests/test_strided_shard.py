"""FSDP2 over tensor parallelism (``_StridedShard`` placements) saved without a gather and resumed
in other layouts.

A small transformer (an input projection, 2 blocks of 4-head causal attention and an MLP, hidden
32, a LayerNorm and a Linear outside the TP plan, an output head) is trained on 4 real gloo ranks
with tensor parallelism (Colwise q/k/v/up and input projection, Rowwise o/down/head) on the "tp"
dim of a 2x2 ("dp", "tp") CPU mesh and FSDP2 (``fully_shard``) on the "dp" dim: torch lays the
column-parallel weights out as ``(_StridedShard(0, sf=2), Shard(0))``, the row-parallel ones as
``(Shard(0), Shard(1))``, their biases as ``(Shard(0), Replicate())``, the modules outside the
plan as ``(Shard(0),)`` on each TP rank's own dp submesh (replicas across submeshes: stored
once), Adam's moments alike. That run goes K steps, saves with
``ckptio.save`` (each rank writes the box it holds: no gather) and goes on M steps (a save only
reads the state), so its last M losses are the uninterrupted run's.

Resumed from the checkpoint, each in freshly built (differently initialised) models:

* 2x2, the saving layout: losses and final state bit for bit equal to the uninterrupted run;
* TP 2 only, FSDP 4 only, one process, and the 2x2 mesh transposed (tp groups {0, 2}, {1, 3}:
  every rank holds another box than it saved): the loaded state, gathered whole, is bit for bit
  the saved one; the M losses are bit for bit those of a reference run *in that layout* that
  starts from a full-state copy of the checkpoint (``ckptio.load(path)`` in one process, given
  to torch's ``set_state_dict(full_state_dict=True)``), and within RTOL of the uninterrupted
  2x2 run (a different reduction order: see RTOL);
* each rank of the resharded 4-rank loads reads less than half of the checkpoint's bytes
  (its box, widened to checksum blocks), not all of it;
* and back: the 1-process resumed state saved again loads into the 2x2 layout bitwise.

In one process (torch's "fake" process group: each rank's real DeviceMesh and DTensor, no
peers), every placement combination torch makes for FSDP2 over TP (2x2 even, uneven and with an
empty piece, sharded on dim 1, dp 4 x tp 2, dp 2 x tp 4, row-parallel, TP-replicated, HSDP x TP
on 2x2x2) is one box per rank whose bytes are the local tensor, and the grid ckptio records
gives every rank's box; an interleaving ``_StridedShard`` and ``Partial`` are refused.

``ckptio.export_hf`` of the 2x2 checkpoint gives the full tensors; ``dcp.save`` through
``ckptio.DcpWriter`` of the 2x2 state and ``dcp.load`` through ``ckptio.DcpReader`` of the ckptio
checkpoint into the 2x2 layout round-trip bitwise, as DCP's own save and load do (the control).
Pipeline stages holding one name on their own submeshes (the same layout as a module outside the
plan) are stored once while equal and refused once they differ, hand-made shards alike.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import numpy as np
import pytest
import torch

from ckptio.testing.rank_processes import run_ranks

IN, HIDDEN, HEADS, OUT, SEQ = 6, 32, 4, 5, 4
BATCH = 8  # global batch: divisible by 1, 2 and 4 data-parallel ranks
K, M = 2, 2  # steps before the checkpoint, after it
LR = 1e-2
INIT_SEED, OTHER_SEED = 0, 1
RANKS_TIMEOUT_S = 300  # bounds a hang only

# Tolerance against the uninterrupted 2x2 run. The state is restored bit for bit (checked), but
# another layout does other arithmetic: the row-parallel products are summed over 1, 2 or no TP
# ranks, FSDP averages the gradients of 4, 2 or 1 slices of the batch, and the loss is summed
# over other slices, so each float32 sum is taken in another order and differs by a few ulps
# (relative ~1e-7). Adam's update divides by sqrt(exp_avg_sq), which after K steps is away from
# zero, so the losses stay within relative ~1e-7 over M = 2 steps (measured here, printed by
# test_resharded_resume under -s: 8e-8 for TP 2 and FSDP 4, 9e-8 for one process, 0 for the
# transposed mesh, whose few sums happen to round alike). rtol 1e-5 is 100x that, and a load
# that left the fresh (OTHER_SEED) weights in place, or dropped the optimizer state, is off by
# more than 1e-3 (tests/test_fsdp2_resume.py shows the latter for the same optimizer). Against
# the reference run in the same layout the comparison is bitwise: same layout, same starting
# bytes, same arithmetic.
RTOL, ATOL = 1e-5, 1e-6


# ------------------------------------------------------------------------------------------------
# what every rank runs


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (torch.nn.Linear(HIDDEN, HIDDEN) for _ in range(4))
        self.up, self.down = torch.nn.Linear(HIDDEN, 2 * HIDDEN), torch.nn.Linear(2 * HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        heads = [p(x).view(b, t, -1, HIDDEN // HEADS).transpose(1, 2) for p in (self.q, self.k, self.v)]
        a = torch.nn.functional.scaled_dot_product_attention(*heads, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, -1))  # -1: this TP rank's heads
        return x + self.down(torch.relu(self.up(x)))


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(IN, HIDDEN)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(2))
        # outside the TP plan (as norms, routers and gates often are): on 2x2 each TP rank
        # holds them as DTensors on its own dp submesh, replicas of one another
        self.norm, self.mix = torch.nn.LayerNorm(HIDDEN), torch.nn.Linear(HIDDEN, HIDDEN)
        self.head = torch.nn.Linear(HIDDEN, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.mix(self.norm(x)))


def _tp_plan() -> dict[str, Any]:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict[str, Any] = {"inp": ColwiseParallel(output_layouts=Replicate()),
                            "head": RowwiseParallel(input_layouts=Replicate())}
    for i in range(2):
        for name in ("q", "k", "v", "up"):
            plan[f"blocks.{i}.{name}"] = ColwiseParallel()
        for name in ("o", "down"):
            plan[f"blocks.{i}.{name}"] = RowwiseParallel()
    return plan


class Layout:
    """A parallel layout: ``dp`` ranks share out the batch (FSDP2 when > 1, or when ``fsdp``),
    ``tp`` ranks split the layers; ``mesh_names`` orders the 2x2 mesh's dims."""

    def __init__(self, name: str, world: int) -> None:
        self.name, self.world = name, world
        self.mesh: Any = None

    def build(self, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import parallelize_module

        torch.manual_seed(seed)
        model = Net()
        if self.name in ("2d", "2d-transposed"):
            names = ("dp", "tp") if self.name == "2d" else ("tp", "dp")
            self.mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=names)
            parallelize_module(model, self.mesh["tp"], _tp_plan())
            for block in model.blocks:
                fully_shard(block, mesh=self.mesh["dp"])
            fully_shard(model, mesh=self.mesh["dp"])
        elif self.name == "tp":
            self.mesh = init_device_mesh("cpu", (self.world,), mesh_dim_names=("tp",))
            parallelize_module(model, self.mesh["tp"], _tp_plan())
        elif self.name == "fsdp":
            self.mesh = init_device_mesh("cpu", (self.world,), mesh_dim_names=("dp",))
            for block in model.blocks:
                fully_shard(block, mesh=self.mesh["dp"])
            fully_shard(model, mesh=self.mesh["dp"])
        return model, torch.optim.Adam(model.parameters(), lr=LR)

    def data_rank(self) -> tuple[int, int, Any]:
        """(this rank's data slice, number of slices, the group its loss is summed over)."""
        if self.mesh is None or "dp" not in (self.mesh.mesh_dim_names or ()):
            return 0, 1, None
        dp = self.mesh["dp"]
        return dp.get_local_rank(), dp.size(), dp.get_group()


BIG = (256, 1024)  # float32: 1 MiB, most of the checkpoint's bytes


def _big(model: torch.nn.Module, fill: bool) -> torch.Tensor:
    """A tensor of shape BIG laid out as ``model`` lays out its column-parallel weights
    (``fill``: with its values, else zeros): what a rank reads of it shows whether it read
    its box or everything."""
    from torch.distributed.tensor import distribute_tensor

    full = torch.randn(BIG, generator=torch.Generator().manual_seed(7)) if fill else torch.zeros(BIG)
    like = model.blocks[0].q.weight
    if hasattr(like, "placements"):
        return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None)
    return full


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(10_000 + step)
    return torch.randn(BATCH, SEQ, IN, generator=gen), torch.randn(BATCH, SEQ, OUT, generator=gen)


def _train_step(layout: Layout, model: torch.nn.Module, opt: torch.optim.Optimizer,
                step: int) -> float:
    """One step on this rank's slice of the global batch -> the global batch's mean loss."""
    import torch.distributed as dist

    x, y = _batch(step)
    index, slices, group = layout.data_rank()
    n = BATCH // slices
    err = (model(x[index * n:(index + 1) * n]) - y[index * n:(index + 1) * n]).pow(2)
    err.mean().backward()  # FSDP2 averages the slices' gradients: the global batch's mean
    opt.step()
    opt.zero_grad(set_to_none=True)
    total = err.detach().sum()
    if slices > 1:
        dist.all_reduce(total, group=group)
    return float(total) / total_elements()


def total_elements() -> int:
    return BATCH * SEQ * OUT


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    """FQN-keyed model and optimizer state dicts (the DTensors the model and Adam hold)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt),
            "step": step}


def _apply(model: torch.nn.Module, opt: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])


def _whole(value: torch.Tensor) -> np.ndarray:
    """The full tensor (a collective for a DTensor) as numpy: it travels back by value."""
    full = value.full_tensor() if hasattr(value, "full_tensor") else value
    return full.detach().numpy().copy()


def _snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, np.ndarray]:
    state = _state(model, opt, 0)
    out = {f"model.{k}": _whole(v) for k, v in state["model"].items()}
    for fqn, slots in state["optim"]["state"].items():
        for name, value in slots.items():
            out[f"optim.{fqn}.{name}"] = _whole(value)
    return out


def _placements(state: dict[str, Any]) -> dict[str, str]:
    return {k: repr(tuple(v.placements)) for k, v in state["model"].items()
            if hasattr(v, "placements")}


def train_and_save(rank: int, world: int, root: str) -> dict[str, Any]:
    """2x2: K steps, ckptio.save and dcp.save through ckptio.DcpWriter, M more steps."""
    import torch.distributed.checkpoint as dcp

    import ckptio

    torch.set_num_threads(1)
    layout = Layout("2d", world)
    model, opt = layout.build(INIT_SEED)
    losses = [_train_step(layout, model, opt, s) for s in range(K)]
    state = _state(model, opt, K) | {"big": _big(model, True)}
    ckptio.save(state, os.path.join(root, "ckpt"))
    dcp.save(state, storage_writer=ckptio.DcpWriter(os.path.join(root, "via_dcp")))
    dcp.save(state, checkpoint_id=os.path.join(root, "dcp_own"))  # the control: DCP alone
    saved = _snapshot(model, opt)
    losses += [_train_step(layout, model, opt, s) for s in range(K, K + M)]
    return {"losses": losses, "saved": saved, "final": _snapshot(model, opt),
            "placements": _placements(state)}


def resume(rank: int, world: int, root: str, name: str, full: dict[str, Any] | None,
           source: str = "ckpt") -> dict[str, Any]:
    """Load ``root/source`` into a fresh ``name`` layout and train M steps; with ``full`` (the
    checkpoint's state, whole, as numpy) also the reference run from that full state."""
    import ckptio

    torch.set_num_threads(1)
    layout = Layout(name, world)
    model, opt = layout.build(OTHER_SEED)
    state = _state(model, opt, 0) | {"big": _big(model, False)}
    report = ckptio.load(os.path.join(root, source), state)
    _apply(model, opt, state)
    assert state["step"] == K, state["step"]
    out: dict[str, Any] = {"loaded": _snapshot(model, opt), "nbytes_read": report.nbytes_read,
                           "big": _whole(state["big"]),
                           "placements": _placements(state)}
    out["losses"] = [_train_step(layout, model, opt, s) for s in range(K, K + M)]
    out["final"] = _snapshot(model, opt)
    if name == "one":  # and back: this layout's state saved again, for the 2x2 load
        ckptio.save(_state(model, opt, K), os.path.join(root, "from_one"))
    if full is not None:
        out["reference"], out["reference_final"] = _reference(layout, full)
    return out


def _reference(layout: Layout, full: dict[str, Any]) -> tuple[list[float], dict[str, np.ndarray]]:
    """The uninterrupted run in ``layout`` from the checkpoint's full state, distributed by
    torch's own set_state_dict(full_state_dict=True), not by ckptio."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    model, opt = layout.build(OTHER_SEED)
    tensors = lambda d: {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v  # noqa: E731
                         for k, v in d.items()}
    optim = {"state": {fqn: tensors(slots) for fqn, slots in full["optim"]["state"].items()},
             "param_groups": full["optim"]["param_groups"]}
    set_state_dict(model, opt, model_state_dict=tensors(full["model"]), optim_state_dict=optim,
                   options=StateDictOptions(full_state_dict=True))
    losses = [_train_step(layout, model, opt, s) for s in range(K, K + M)]
    return losses, _snapshot(model, opt)


def load_into_2d(rank: int, world: int, root: str, source: str) -> dict[str, Any]:
    """Load ``root/source`` into the 2x2 layout, with ckptio and with dcp.load through
    ckptio.DcpReader (and DCP's own save loaded by DCP alone: the control); -> the states,
    whole."""
    import torch.distributed.checkpoint as dcp

    import ckptio

    torch.set_num_threads(1)
    out = {}
    for how in ("ckptio", "dcp", "dcp_own"):
        layout = Layout("2d", world)
        model, opt = layout.build(OTHER_SEED)
        state = _state(model, opt, 0)
        if how == "ckptio":
            ckptio.load(os.path.join(root, source), state, keys=("model", "optim", "step"))
        elif how == "dcp":
            dcp.load(state, storage_reader=ckptio.DcpReader(os.path.join(root, source)))
        else:
            dcp.load(state, checkpoint_id=os.path.join(root, "dcp_own"))
        _apply(model, opt, state)
        out[how] = _snapshot(model, opt)
    return out


# ------------------------------------------------------------------------------------------------
# the tests


def _as_numpy(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.numpy().copy()
    if isinstance(tree, dict):
        return {k: _as_numpy(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_as_numpy(v) for v in tree]
    return tree


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    import ckptio

    root = str(tmp_path_factory.mktemp("strided"))
    per_rank = run_ranks(4, train_and_save, root, timeout_s=RANKS_TIMEOUT_S)
    ref = per_rank[0]
    assert all(r["losses"] == ref["losses"] for r in per_rank)
    assert len(set(ref["losses"])) == K + M, ref["losses"]  # training moved
    full = _as_numpy(ckptio.load(os.path.join(root, "ckpt")))  # the full-state copy
    return {"root": root, "full": full, **ref}


def _assert_bitwise(got: dict[str, np.ndarray], want: dict[str, np.ndarray], what: str) -> None:
    assert sorted(got) == sorted(want), f"{what}: keys {sorted(got)} != {sorted(want)}"
    for key, w in want.items():
        g = got[key]
        assert g.dtype == w.dtype and g.shape == w.shape, (what, key, g.shape, w.shape)
        assert g.tobytes() == w.tobytes(), (
            f"{what}: {key} differs, max |diff| "
            f"{np.abs(g.astype(np.float64) - w.astype(np.float64)).max():.3g}")


def test_fsdp2_over_tp_is_saved_as_strided_shards(saved: dict[str, Any]) -> None:
    """The layout is the one the issue is about, and the checkpoint holds the full tensors."""
    placements = saved["placements"]
    assert placements["blocks.0.q.weight"] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))"
    assert placements["blocks.0.o.weight"] == "(Shard(dim=0), Shard(dim=1))"
    assert placements["blocks.0.o.bias"] == "(Shard(dim=0), Replicate())"
    # outside the TP plan: on each TP rank's own dp submesh, replicas across them
    assert placements["norm.weight"] == placements["mix.weight"] == "(Shard(dim=0),)"
    # described once per tensor (a grid over the mesh in cutting order: tp, then dp), not per
    # chunk; no chunk entry of it in the manifest
    with open(os.path.join(saved["root"], "ckpt", "manifest.json"), "rb") as f:
        body = json.loads(f.read().split(b"\n", 1)[1])
    regular = {r["key"]: body["grids"][r["grid"]] for r in body["regular"]}
    for key in ("model.blocks.0.q.weight", "optim.state.blocks.1.up.weight.exp_avg", "big"):
        assert regular[key]["dims"] == [0, 0] and regular[key]["ranks"] == [0, 2, 1, 3], (
            key, regular.get(key))
    assert not {t["key"] for t in body["tensors"]} & set(regular)
    # those replicas are stored once: one row per dp piece, not one per TP rank
    for key in ("model.norm.weight", "model.mix.weight", "optim.state.mix.weight.exp_avg"):
        rows = [t for t in body["tensors"] if t["key"] == key]
        assert len(rows) == 2 and key not in regular, (key, rows)
    full = saved["full"]
    for key, want in saved["saved"].items():
        kind, rest = key.split(".", 1)
        got = full["model"][rest] if kind == "model" else _optim_slot(full, rest)
        assert got.tobytes() == want.tobytes(), key


def _optim_slot(full: dict[str, Any], rest: str) -> np.ndarray:
    fqn, slot = rest.rsplit(".", 1)
    value = full["optim"]["state"][fqn][slot]
    return value if isinstance(value, np.ndarray) else np.asarray(value)


def test_same_layout_resume_is_bitwise(saved: dict[str, Any]) -> None:
    per_rank = run_ranks(4, resume, saved["root"], "2d", None, timeout_s=RANKS_TIMEOUT_S)
    got = per_rank[0]
    _assert_bitwise(got["loaded"], saved["saved"], "2x2 after load")
    assert got["losses"] == saved["losses"][K:], (got["losses"], saved["losses"][K:])
    _assert_bitwise(got["final"], saved["final"], "2x2 after the resumed steps")


RESHARDED = [pytest.param("tp", 2, id="tp2"), pytest.param("fsdp", 4, id="fsdp4"),
             pytest.param("2d-transposed", 4, id="2x2-transposed"),
             pytest.param("one", 1, id="one-process")]


@pytest.mark.parametrize(("name", "world"), RESHARDED)
def test_resharded_resume(saved: dict[str, Any], name: str, world: int) -> None:
    per_rank = run_ranks(world, resume, saved["root"], name, saved["full"],
                         timeout_s=RANKS_TIMEOUT_S)
    got = per_rank[0]
    for rank, result in enumerate(per_rank):
        _assert_bitwise(result["loaded"], saved["saved"], f"{name} rank {rank} after load")
    if name == "2d-transposed":
        assert got["placements"]["blocks.0.q.weight"] == saved["placements"]["blocks.0.q.weight"]
    want_big = torch.randn(BIG, generator=torch.Generator().manual_seed(7)).numpy()
    assert all(r["big"].tobytes() == want_big.tobytes() for r in per_rank), name
    if world == 4:  # each rank read its box (widened to checksum blocks), not the checkpoint
        total = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in
                    os.walk(os.path.join(saved["root"], "ckpt")) for f in fs)
        assert all(r["nbytes_read"] < total / 2 for r in per_rank), (
            [r["nbytes_read"] for r in per_rank], total)
    # the same layout from the full-state copy: the same arithmetic, bit for bit
    assert got["losses"] == got["reference"], (got["losses"], got["reference"])
    worst = max(abs(g - w) / abs(w) for g, w in zip(got["losses"], saved["losses"][K:]))
    print(f"{name}: losses within {worst:.3g} (relative) of the 2x2 run; bytes read per rank "
          f"{[r['nbytes_read'] for r in per_rank]}")
    # the 2x2 run: another reduction order, within RTOL (see there)
    for step, (g, w) in enumerate(zip(got["losses"], saved["losses"][K:]), start=K):
        assert math.isclose(g, w, rel_tol=RTOL, abs_tol=ATOL), (name, step, g, w)
    # and the state it ends in is the reference run's, bit for bit (against the 2x2 run's it is
    # not within RTOL everywhere: Adam divides each gradient element by its own running
    # magnitude, so an element whose gradient is all rounding noise moves by ~lr either way)
    _assert_bitwise(got["final"], got["reference_final"], f"{name} after the resumed steps")
    if name == "one":  # and back: what one process saved loads into 2x2, bit for bit
        back = run_ranks(4, load_into_2d, saved["root"], "from_one", timeout_s=RANKS_TIMEOUT_S)
        _assert_bitwise(back[0]["ckptio"], got["final"], "one process -> 2x2")


def test_dcp_writer_and_reader_take_strided_shards(saved: dict[str, Any]) -> None:
    """dcp.save through DcpWriter of the 2x2 state is a ckptio checkpoint of the full tensors;
    dcp.load through DcpReader of the ckptio checkpoint fills the 2x2 layout bitwise."""
    import ckptio

    via_dcp = _as_numpy(ckptio.load(os.path.join(saved["root"], "via_dcp")))
    for key, want in saved["saved"].items():
        kind, rest = key.split(".", 1)
        got = via_dcp["model"][rest] if kind == "model" else _optim_slot(via_dcp, rest)
        assert got.tobytes() == want.tobytes(), key
    per_rank = run_ranks(4, load_into_2d, saved["root"], "ckpt", timeout_s=RANKS_TIMEOUT_S)
    _assert_bitwise(per_rank[0]["dcp_own"], saved["saved"], "DCP alone (the control) on 2x2")
    _assert_bitwise(per_rank[0]["dcp"], saved["saved"], "dcp.load via DcpReader into 2x2")
    _assert_bitwise(per_rank[0]["ckptio"], saved["saved"], "ckptio.load into 2x2")


def test_export_hf_takes_strided_shards(saved: dict[str, Any], tmp_path: Any) -> None:
    from safetensors.numpy import load_file

    import ckptio

    ckptio.export_hf(os.path.join(saved["root"], "ckpt"), tmp_path / "hf")
    exported: dict[str, np.ndarray] = {}
    for f in sorted((tmp_path / "hf").glob("*.safetensors")):
        exported |= load_file(str(f))
    want = {k.split(".", 1)[1]: v for k, v in saved["saved"].items() if k.startswith("model.")}
    _assert_bitwise(exported, want, "export_hf")


def stages_under_one_name(rank: int, world: int, root: str) -> dict[str, Any]:
    """Pipeline stages on a ("pp", "dp") mesh, each holding key "w" as a DTensor on its own dp
    submesh (the same layout as a module outside a TP plan): equal values are one tensor's
    replicas, stored once; once they differ the save is refused, the first checkpoint intact."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import ckptio

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    stage = mesh["pp"].get_local_rank()
    full = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    out = {}
    for kind in ("dtensor", "shard"):  # and hand-made shards, replicas by their bytes alike
        saver = ckptio.Checkpointer()
        w = distribute_tensor(full, mesh["dp"], [Shard(0)], src_data_rank=None).to_local() \
            if kind == "shard" else distribute_tensor(full, mesh["dp"], [Shard(0)],
                                                      src_data_rank=None)
        local = w if kind == "shard" else w.to_local()
        value = (lambda: ckptio.TensorShard(local, (6, 4), (3 * mesh["dp"].get_local_rank(), 0))
                 ) if kind == "shard" else (lambda: w)
        saver.save({"w": value()}, os.path.join(root, kind, "equal"))  # built alike at step 0
        local.add_(stage)  # a step later they are not
        try:
            saver.save({"w": value()}, os.path.join(root, kind, "differ"))
            out[kind] = None
        except ckptio.CkptError as exc:
            out[kind] = str(exc)
    return out


def test_stages_under_one_name_are_refused_once_their_values_differ(tmp_path: Any) -> None:
    import ckptio

    per_rank = run_ranks(4, stages_under_one_name, str(tmp_path), timeout_s=RANKS_TIMEOUT_S)
    for kind in ("dtensor", "shard"):
        for result in per_rank:
            assert result[kind] is not None, f"{kind}: a save keeping one stage's values committed"
        error = per_rank[0][kind]
        assert "'w'" in error and "different values" in error and "pipeline stages" in error, error
        assert not os.path.exists(tmp_path / kind / "differ" / "manifest.json")
        equal = ckptio.load(str(tmp_path / kind / "equal"))  # the first: committed, whole
        assert torch.equal(equal["w"], torch.arange(24, dtype=torch.float32).reshape(6, 4))


# ------------------------------------------------------------------------------------------------
# every placement combination torch makes for FSDP2 over TP, on larger meshes, in one process:
# torch's "fake" process group gives each rank's real DeviceMesh and DTensor without a peer


def _as_rank(rank: int, world: int) -> None:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)


def _layouts() -> list[Any]:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard as SS

    return [  # (mesh shape, placements, global shape, the grid's ranks in cutting order)
        pytest.param((2, 2), [SS(0, split_factor=2), Shard(0)], (8, 4), [0, 2, 1, 3], id="2x2"),
        pytest.param((2, 2), [SS(0, split_factor=2), Shard(0)], (10, 3), [0, 2, 1, 3],
                     id="2x2-uneven"),
        pytest.param((2, 2), [SS(0, split_factor=2), Shard(0)], (3, 5), [0, 2, 1, 3],
                     id="2x2-empty-piece"),
        pytest.param((2, 2), [SS(1, split_factor=2), Shard(1)], (4, 12), [0, 2, 1, 3], id="dim1"),
        pytest.param((4, 2), [SS(0, split_factor=2), Shard(0)], (24, 2), [0, 2, 4, 6, 1, 3, 5, 7],
                     id="dp4xtp2"),
        pytest.param((2, 4), [SS(0, split_factor=4), Shard(0)], (16, 2), [0, 4, 1, 5, 2, 6, 3, 7],
                     id="dp2xtp4"),
        pytest.param((2, 2), [Shard(0), Shard(1)], (6, 4), [0, 1, 2, 3], id="row-parallel"),
        pytest.param((2, 2), [Shard(0), Replicate()], (6,), [0, 1, 2, 3], id="tp-replicated"),
        pytest.param((2, 2, 2), [Replicate(), SS(0, split_factor=2), Shard(0)], (10, 3),
                     [0, 2, 1, 3, 4, 6, 5, 7], id="hsdp-tp"),
    ]


@pytest.mark.parametrize(("mesh_shape", "placements", "shape", "ranks"), _layouts())
def test_every_fsdp_tp_placement_is_one_box_on_a_grid(mesh_shape: tuple[int, ...],
                                                      placements: list[Any], shape: tuple[int, ...],
                                                      ranks: list[int]) -> None:
    """Each rank's local tensor is the box ckptio records (its bytes equal that region of the
    full tensor), and the grid (the mesh in cutting order) gives every rank's box: what the
    manifest's regular row stands for is what the ranks hold."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    from ckptio.planning.sharding import held

    world = math.prod(mesh_shape)
    full = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
    boxes, grids = {}, set()
    try:
        for rank in range(world):
            _as_rank(rank, world)
            mesh = init_device_mesh("cpu", mesh_shape)
            t = distribute_tensor(full, mesh, placements, src_data_rank=None)
            region = held(t, "w")
            box = full[tuple(slice(o, o + s) for o, s in zip(region.chunk.offsets,
                                                              region.chunk.sizes))]
            assert torch.equal(box, t.to_local()), (rank, region.chunk)
            boxes[rank] = region.chunk
            grids.add(region.grid)
    finally:
        dist.destroy_process_group()
    assert len(grids) == 1 and None not in grids, grids
    grid = grids.pop()
    assert list(grid.ranks) == ranks, grid
    for rank, chunk in boxes.items():
        mine = grid.chunk(shape, grid.coordinate(rank))
        assert mine == chunk or mine.numel == chunk.numel == 0, (rank, mine, chunk)
    # the boxes tile the tensor (replicas counted once)
    assert sum(c.numel for c in set(boxes.values())) == full.numel()


def test_placements_that_are_no_box_are_refused_in_place() -> None:
    """An interleaving _StridedShard and a Partial: UnsupportedStateError naming the key, what
    the rank holds and the fix (tests/test_dist.py checks that nothing is written)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    from ckptio.errors import UnsupportedStateError
    from ckptio.planning.sharding import held

    try:
        _as_rank(1, 4)
        mesh = init_device_mesh("cpu", (2, 2))
        t = distribute_tensor(torch.zeros(8, 2), mesh, [Shard(0), _StridedShard(0, split_factor=2)],
                              src_data_rank=None)
        with pytest.raises(UnsupportedStateError, match=r"key 'w'.*indices \[1, 3\] of dim 0"):
            held(t, "w")
        p = DTensor.from_local(torch.zeros(2), mesh, [Partial(), Partial()])
        with pytest.raises(UnsupportedStateError, match=r"key 'g'.*pending reduction.*redistribute"):
            held(p, "g")
    finally:
        dist.destroy_process_group()
