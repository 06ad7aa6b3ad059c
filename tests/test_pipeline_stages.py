"""Pipeline stages: their optimizers saved by parameter name, resumed in any other pipeline layout.

A 4-layer MLP (``layers`` is a ModuleDict keyed by the layer's index, so every stage's parameters
keep the whole model's names, as torchtitan splits models) is trained on real gloo processes in a
hand-written pipeline: a layout is (stages, data-parallel ranks, layers per stage); rank
``stage * dp + d`` runs ``stage`` on slice ``d`` of the global batch, activations go forward and
their gradients back with ``dist.send``/``recv``, and each stage's gradients are summed over its
data-parallel ranks with ``all_reduce``. AdamW (weight decay) with a StepLR schedule. Each rank
checkpoints ``{"model": stage, "optim": ckptio.OptimizerState(stage, opt), "sched": sched}``.

The reference job (2 stages x 2 data-parallel ranks) runs K + M steps uninterrupted; another runs
K steps and saves. Resumed into fresh, differently initialised stages, checked:

* the loaded optimizer state (exp_avg, exp_avg_sq, step of every parameter, and every parameter
  group's hyperparameters, lr as the schedule left it) and parameters equal what was saved, bit
  for bit, in every layout: 2x2 as saved, 2x2 with another split of the layers (1 + 3), 4 stages
  x 1 layer, 1 stage x 4 data-parallel ranks, and one process without torch.distributed;
* the M losses after the resume: bit for bit where the arithmetic is the same (see RTOL);
* the refusals that remain: a parameter group whose parameters were saved with different
  hyperparameters (stages with different learning rates, loaded as one group), a plain
  index-keyed optimizer on stages of different sizes (its param_groups lists differ), one on
  stages of equal sizes loaded with the stages swapped between ranks (the names the save
  recorded differ), and OptimizerState given parameters it cannot name;
* the same checkpoints through DCP (the keys are DCP's flattened optimizer state dict's, both
  ways, ckptio.DcpWriter included), Hugging Face export of the stages' weights, a tie held by
  one stage only, and a rank holding two model parts with an optimizer each.
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np
import pytest
import torch

from ckptio.testing.rank_processes import run_ranks

H = 8  # every layer H -> H
N_LAYERS = 4
BATCH = 8  # global batch: divides by 1, 2 and 4 data-parallel ranks
K = 3  # steps before the checkpoint
M = 3  # steps after it
LR = 1e-2
INIT_SEED = 0
OTHER_SEED = 1  # resumed stages start elsewhere: a load that did nothing cannot pass

# Tolerance for resuming with another number of data-parallel ranks. The load restores the saved
# state exactly (checked bitwise), and splitting the layers over stages does not change the
# arithmetic (an activation and its gradient cross a send/recv unchanged, every layer runs the
# same ops): so 2x2 resumed as 2x2 with another split is bit for bit the reference, and 4 stages
# x 1 rank is bit for bit one process (both compute each step's gradient in one backward over the
# whole batch). What changes the bits is the data-parallel degree: with d ranks each backward sums
# BATCH/d samples and all_reduce adds the d partial gradients (the loss likewise), so the float32
# sums are taken in another order; each element differs by a few ulps (relative ~1e-7). AdamW
# divides by sqrt(exp_avg_sq), which after K steps of history is not near zero, so the updates
# differ by relative ~1e-7 too and grow by a small factor over M steps (measured here: losses
# within 1.1e-7 relative). rtol 1e-5 / atol 1e-6 is far above that and far below the effect of a
# lost optimizer state (test_the_comparison_sees_a_lost_optimizer_state: > 100 x RTOL).
RTOL = 1e-5
ATOL = 1e-6

REFERENCE = (2, 2, (2, 2))  # (stages, data-parallel ranks, layers per stage)


def _layers_of(split: tuple[int, ...], stage: int) -> list[int]:
    first = sum(split[:stage])
    return list(range(first, first + split[stage]))


def _build(split: tuple[int, ...], stage: int, seed: int, lr_scale: float = 1.0
           ) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    """Stage ``stage`` of the model (every layout initialises the whole model from ``seed``
    alike and keeps its own layers), its AdamW and StepLR."""
    torch.manual_seed(seed)
    every = [torch.nn.Linear(H, H) for _ in range(N_LAYERS)]
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleDict({str(i): every[i] for i in _layers_of(split, stage)})
    opt = torch.optim.AdamW(model.parameters(), lr=LR * lr_scale, weight_decay=0.1)
    return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def _forward(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    for name in sorted(model.layers, key=int):
        x = torch.tanh(model.layers[name](x))
    return x


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(10_000 + step)
    return torch.randn(BATCH, H, generator=gen), torch.randn(BATCH, H, generator=gen)


class _Job:
    """This rank's place in a layout, and its training step (a 1-stage, 1-rank layout runs
    without torch.distributed)."""

    def __init__(self, rank: int, layout: tuple[int, int, tuple[int, ...]], seed: int,
                 lr_scale: float = 1.0) -> None:
        import torch.distributed as dist

        self.stages, self.dp, self.split = layout
        self.rank, self.stage, self.d = rank, rank // self.dp, rank % self.dp
        self.distributed = dist.is_initialized()
        self.dp_group = None
        if self.dp > 1:  # every rank creates every stage's group, in the same order
            groups = [dist.new_group(list(range(s * self.dp, (s + 1) * self.dp)))
                      for s in range(self.stages)]
            self.dp_group = groups[self.stage]
        scale = lr_scale ** self.stage
        self.model, self.opt, self.sched = _build(self.split, self.stage, seed, scale)

    def state(self, step: int) -> dict[str, Any]:
        import ckptio

        return {"model": self.model, "optim": ckptio.OptimizerState(self.model, self.opt),
                "sched": self.sched, "step": step}

    def step(self, step: int) -> float:
        """One training step; -> the global batch's mean loss (the same on every rank)."""
        import torch.distributed as dist

        x, y = _batch(step)
        n = BATCH // self.dp
        xs, ys = x[self.d * n:(self.d + 1) * n], y[self.d * n:(self.d + 1) * n]
        first, last = self.stage == 0, self.stage == self.stages - 1
        inp = xs if first else torch.empty(n, H)
        if not first:
            dist.recv(inp, src=self.rank - self.dp)
            inp.requires_grad_()
        out = _forward(self.model, inp)
        if last:
            err = (out - ys).pow(2)
            (err.sum() / (BATCH * H)).backward()
            local = err.detach().sum()
        else:
            dist.send(out.detach(), dst=self.rank + self.dp)
            grad = torch.empty_like(out)
            dist.recv(grad, src=self.rank + self.dp)
            out.backward(grad)
            local = torch.zeros(())
        if not first:
            dist.send(inp.grad, dst=self.rank - self.dp)
        if self.dp_group is not None:
            for p in self.model.parameters():
                dist.all_reduce(p.grad, group=self.dp_group)
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        if self.distributed:
            dist.all_reduce(local)
        return float(local) / (BATCH * H)

    def snapshot(self) -> dict[str, Any]:
        return _snapshot(self.model, self.opt)


def _snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Parameters, optimizer state and hyperparameters by name (numpy copies and Python values:
    they travel back from the rank processes by value)."""
    import ckptio

    out: dict[str, Any] = {f"model.{k}": v.detach().numpy().copy()
                           for k, v in model.state_dict().items()}
    view = ckptio.OptimizerState(model, opt).state_dict()
    for fqn, slots in view["state"].items():
        out.update({f"state.{fqn}.{k}": v.numpy().copy() for k, v in slots.items()})
    for fqn, hyper in view["param_groups"].items():
        out.update({f"group.{fqn}.{k}": v for k, v in hyper.items()})
    return out


def _dcp_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """DCP's state dicts of a stage, its optimizer's flattened (as torchtitan saves pipeline
    stages): keyed state.<fqn>.<name> and param_groups.<fqn>.<name>, as OptimizerState's."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    model_sd, optim_sd = get_state_dict(model, opt, options=flat)
    return {"model": model_sd, "optim": optim_sd}


# ------------------------------------------------------------------------------------------------
# what the rank processes run (module level: they import this module)


def reference_job(rank: int, world: int, root: str) -> dict[str, Any]:
    """2 stages x 2 ranks: K + M steps uninterrupted; K steps and a save; a save of stages with
    different learning rates; a plain optimizer's save on stages of different sizes (refused)."""
    import torch.distributed.checkpoint as dcp

    import ckptio
    from ckptio.errors import CkptError

    torch.set_num_threads(1)
    job = _Job(rank, REFERENCE, INIT_SEED)
    losses = [job.step(s) for s in range(K + M)]
    final = job.snapshot()

    job = _Job(rank, REFERENCE, INIT_SEED)
    saver_losses = [job.step(s) for s in range(K)]
    ckptio.save(job.state(K), f"{root}/ckpt")
    saved = job.snapshot()
    dcp.save(_dcp_state(job.model, job.opt), checkpoint_id=f"{root}/dcp")  # the same, by DCP
    dcp.save(_dcp_state(job.model, job.opt), storage_writer=ckptio.DcpWriter(f"{root}/dcpw"))
    # stage 0 ties two keys to one tensor (an embedding and an output head, say); stage 1
    # holds neither
    weights = dict(job.model.state_dict())
    if job.stage == 0:
        weights = {"embed": job.model.layers["0"].weight, "head": job.model.layers["0"].weight}
    ckptio.save({"model": weights}, f"{root}/tied")

    job = _Job(rank, REFERENCE, INIT_SEED, lr_scale=2.0)  # stage 1 learns twice as fast
    job.step(0)
    ckptio.save({"model": job.model, "optim": ckptio.OptimizerState(job.model, job.opt)},
                f"{root}/two_lrs")

    job = _Job(rank, (2, 2, (1, 3)), INIT_SEED)
    job.step(0)
    try:
        ckptio.save({"model": job.model, "optim": job.opt}, f"{root}/plain")
        refusal = None
    except CkptError as exc:
        refusal = (type(exc).__name__, str(exc))
    return {"losses": losses, "final": final, "saver_losses": saver_losses, "saved": saved,
            "refusal": refusal}


def _resume(rank: int, path: str, layout: tuple[int, int, tuple[int, ...]],
            restore_optim: bool = True) -> dict[str, Any]:
    import ckptio

    job = _Job(rank, layout, OTHER_SEED)
    state = job.state(0)
    keys = None if restore_optim else ("model", "step")
    report = ckptio.load(path, state, keys=keys)
    assert not report.missing and not report.unexpected and not report.mismatched, report
    assert state["step"] == K
    loaded = job.snapshot()
    return {"loaded": loaded, "losses": [job.step(s) for s in range(K, K + M)],
            "keys": report.loaded, "layers": _layers_of(job.split, job.stage)}


FOUR_RANK_LAYOUTS = [(2, 2, (2, 2)), (2, 2, (1, 3)), (4, 1, (1, 1, 1, 1)), (1, 4, (4,))]


def resume_job(rank: int, world: int, path: str) -> list[dict[str, Any]]:
    """Every 4-rank layout, one after the other, each from fresh stages; and the saving layout
    with the model but a fresh optimizer."""
    torch.set_num_threads(1)
    results = [_resume(rank, path, layout) for layout in FOUR_RANK_LAYOUTS]
    return [*results, _resume(rank, path, REFERENCE, restore_optim=False)]


# ------------------------------------------------------------------------------------------------
# the tests


RANKS_TIMEOUT_S = 300  # bounds a hang only


def _union(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """The ranks' snapshots as one (replicas of a stage hold equal values: checked)."""
    out: dict[str, Any] = {}
    for snap in per_rank:
        for key, value in snap.items():
            if key in out:
                assert _equal(out[key], value), f"{key}: replicas differ"
            out[key] = value
    return out


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray):
        return (isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape
                and a.tobytes() == b.tobytes())
    return type(a) is type(b) and a == b


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = str(tmp_path_factory.mktemp("pipeline"))
    per_rank = run_ranks(4, reference_job, root, timeout_s=RANKS_TIMEOUT_S)
    ref = per_rank[0]
    assert all(r["losses"] == ref["losses"] for r in per_rank)
    assert ref["saver_losses"] == ref["losses"][:K]
    assert len(set(ref["losses"])) == K + M, ref["losses"]  # training moved
    saved = _union([r["saved"] for r in per_rank])
    assert len([k for k in saved if k.startswith("state.")]) == 3 * 2 * N_LAYERS  # 3 per param
    return {"root": root, "path": f"{root}/ckpt", "saved": saved,
            "final": _union([r["final"] for r in per_rank]), "losses": ref["losses"],
            "refusals": [r["refusal"] for r in per_rank]}


@pytest.fixture(scope="module")
def resumed(reference: dict[str, Any]) -> dict[Any, list[dict[str, Any]]]:
    """Layout -> each rank's result; "fresh optimizer" -> the saving layout without it; and
    "one process": the load and M steps here, without torch.distributed."""
    per_rank = run_ranks(4, resume_job, reference["path"], timeout_s=RANKS_TIMEOUT_S)
    out: dict[Any, list[dict[str, Any]]] = {
        layout: [r[i] for r in per_rank] for i, layout in enumerate(FOUR_RANK_LAYOUTS)}
    out["fresh optimizer"] = [r[len(FOUR_RANK_LAYOUTS)] for r in per_rank]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out["one process"] = [_resume(0, reference["path"], (1, 1, (N_LAYERS,)))]
    finally:
        torch.set_num_threads(threads)
    return out


LAYOUTS = [pytest.param(layout, id=f"{layout[0]}x{layout[1]}-split{'+'.join(map(str, layout[2]))}")
           for layout in FOUR_RANK_LAYOUTS] + [pytest.param("one process", id="one-process")]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_resume_in_another_pipeline_layout(reference: dict[str, Any], resumed: dict[
        Any, list[dict[str, Any]]], layout: Any) -> None:
    per_rank = resumed[layout]
    # every parameter's optimizer state and hyperparameters, and the parameters, as saved
    loaded = _union([r["loaded"] for r in per_rank])
    assert sorted(loaded) == sorted(reference["saved"])
    for key, want in reference["saved"].items():
        assert _equal(loaded[key], want), f"{layout}: {key} loaded {loaded[key]!r}"
    assert loaded["group.layers.3.weight.lr"] == LR * 0.5  # StepLR halved it at step 2
    got = per_rank[0]["losses"]
    assert all(r["losses"] == got for r in per_rank)
    want = reference["losses"][K:]
    data_parallel = 1 if layout == "one process" else layout[1]
    if data_parallel == REFERENCE[1]:  # the same arithmetic: bit for bit
        assert got == want, (got, want)
    else:
        for step, (g, w) in enumerate(zip(got, want), start=K):
            assert math.isclose(g, w, rel_tol=RTOL, abs_tol=ATOL), (
                f"step {step}: {g!r} resumed as {layout}, {w!r} uninterrupted "
                f"(rel diff {abs(g - w) / abs(w):.3g})")


def test_stages_without_data_parallelism_match_one_process_bitwise(
        resumed: dict[Any, list[dict[str, Any]]]) -> None:
    """4 stages x 1 rank is the arithmetic of one process: bit for bit the same losses."""
    assert resumed[(4, 1, (1, 1, 1, 1))][0]["losses"] == resumed["one process"][0]["losses"]


def test_a_stage_loads_only_its_own_layers(resumed: dict[Any, list[dict[str, Any]]]) -> None:
    """Each of 4 stages loads its own layer's parameters and optimizer state, not the others'
    (a fresh optimizer's missing state is created for its own parameters only)."""
    for result in resumed[(4, 1, (1, 1, 1, 1))]:
        (layer,) = result["layers"]
        layers = {key.split("layers.")[1].split(".")[0] for key in result["keys"]
                  if key.startswith(("model.", "optim."))}
        assert layers == {str(layer)}, (layer, sorted(result["keys"]))
        created = [k for k in result["keys"] if k.startswith("optim.state.")]
        assert len(created) == 3 * 2, created  # step, exp_avg, exp_avg_sq of weight and bias


def test_the_comparison_sees_a_lost_optimizer_state(reference: dict[str, Any], resumed: dict[
        Any, list[dict[str, Any]]]) -> None:
    got = resumed["fresh optimizer"][0]["losses"]
    want = reference["losses"][K:]
    assert got[0] == want[0]  # computed from the restored parameters, before any step
    worst = max(abs(g - w) / abs(w) for g, w in zip(got[1:], want[1:]))
    assert worst > 100 * RTOL, worst


def test_a_plain_optimizer_on_uneven_stages_is_refused_naming_the_fix(
        reference: dict[str, Any]) -> None:
    """Index-keyed param_groups of stages with 2 and 6 parameters differ: every rank raises a
    CkptError naming the key and ckptio.OptimizerState, and nothing is committed."""
    import ckptio.errors

    for refusal in reference["refusals"]:
        assert refusal is not None, "a plain optimizer's save on uneven stages was accepted"
        name, message = refusal
        assert issubclass(getattr(ckptio.errors, name), ckptio.errors.CkptError), name
        assert "'optim.param_groups' differs between ranks" in message, message
        assert "save ckptio.OptimizerState(model, optimizer) in its place" in message, message
    assert not os.path.exists(f"{reference['root']}/plain/manifest.json")


def test_stages_with_different_hyperparameters(reference: dict[str, Any]) -> None:
    """Stage 1 saved with twice stage 0's learning rate. One group over every layer is refused
    (naming the group, two parameters and both values); a group per saved value loads them;
    leaving out the hyperparameters keeps the live ones."""
    import ckptio
    from ckptio.errors import StateMismatchError

    path = f"{reference['root']}/two_lrs"
    model, opt, _sched = _build((N_LAYERS,), 0, OTHER_SEED)
    with pytest.raises(StateMismatchError, match=r"group 0 of AdamW holds 'layers\.0\.weight' "
                       r"and 'layers\.2\.weight', saved with lr=0\.01 and lr=0\.02"):
        ckptio.load(path, {"model": model, "optim": ckptio.OptimizerState(model, opt)})

    layers = model.layers
    opt = torch.optim.AdamW([{"params": [*layers["0"].parameters(), *layers["1"].parameters()]},
                             {"params": [*layers["2"].parameters(), *layers["3"].parameters()]}],
                            lr=1.0)
    ckptio.load(path, {"model": model, "optim": ckptio.OptimizerState(model, opt)})
    assert [g["lr"] for g in opt.param_groups] == [LR, 2 * LR]
    assert len(opt.state) == 2 * N_LAYERS

    model, opt, _sched = _build((N_LAYERS,), 0, OTHER_SEED)
    ckptio.load(path, {"model": model, "optim": ckptio.OptimizerState(model, opt)},
                keys=lambda k: ".param_groups." not in k)
    assert opt.param_groups[0]["lr"] == LR and len(opt.state) == 2 * N_LAYERS


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_reads_these_checkpoints_and_writes_the_same_keys(reference: dict[str, Any]) -> None:
    """The keys are those of DCP's flattened optimizer state dict: in one process, DCP loads the
    4 ranks' ckptio checkpoint through ckptio.DcpReader, and ckptio loads into OptimizerState
    the 4 ranks' dcp.save, written by DCP's own writer or by ckptio.DcpWriter; each gives back
    exactly what was saved."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    import ckptio

    model, opt, _sched = _build((N_LAYERS,), 0, OTHER_SEED)
    state = _dcp_state(model, opt)  # DCP creates a fresh optimizer's state (a step, lr 0)
    dcp.load(state, storage_reader=ckptio.DcpReader(reference["path"]))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=StateDictOptions(flatten_optimizer_state_dict=True))
    through_dcp = _snapshot(model, opt)

    loaded = {}
    for name in ("dcp", "dcpw"):  # written by DCP's FileSystemWriter, by ckptio.DcpWriter
        model, opt, _sched = _build((N_LAYERS,), 0, OTHER_SEED)
        ckptio.load(f"{reference['root']}/{name}", {"model": model,
                                                   "optim": ckptio.OptimizerState(model, opt)})
        loaded[name] = _snapshot(model, opt)
    for name, got in (("through DcpReader", through_dcp), *loaded.items()):
        assert sorted(got) == sorted(reference["saved"]), name
        for key, want in reference["saved"].items():
            assert _equal(got[key], want), key


def test_an_optimizer_with_state_is_filled_in_place(reference: dict[str, Any]) -> None:
    """One process whose optimizer has stepped (its moments exist) gets the 4 ranks' values
    copied into its own tensors."""
    import ckptio

    model, opt, sched = _build((N_LAYERS,), 0, OTHER_SEED)
    _forward(model, torch.ones(2, H)).sum().backward()
    opt.step()
    before = {id(p): opt.state[p]["exp_avg"] for p in model.parameters()}
    ckptio.load(reference["path"], {"model": model, "optim": ckptio.OptimizerState(model, opt),
                                    "sched": sched, "step": 0})
    assert all(opt.state[p]["exp_avg"] is before[id(p)] for p in model.parameters())
    got = _snapshot(model, opt)
    assert all(_equal(got[k], want) for k, want in reference["saved"].items())
    assert sched.last_epoch == K


def test_hugging_face_export_of_the_stages_weights(reference: dict[str, Any],
                                                   tmp_path: Any) -> None:
    """export_hf writes the 4 ranks' weights (each stage's own layers) as one safetensors model."""
    from safetensors.torch import load_file

    import ckptio

    ckptio.export_hf(reference["path"], tmp_path / "hf")
    exported = {}
    for shard in sorted((tmp_path / "hf").glob("*.safetensors")):
        exported.update(load_file(shard))
    assert sorted(exported) == sorted(k[len("model."):] for k in reference["saved"]
                                      if k.startswith("model."))
    for key, value in exported.items():
        assert _equal(value.numpy(), reference["saved"][f"model.{key}"]), key


def test_a_tie_held_by_one_stage_only(reference: dict[str, Any]) -> None:
    """Stage 0's two keys sharing one tensor are stored once (an alias); stage 1, which holds
    neither, does not make the save refuse the tie."""
    import ckptio

    back = ckptio.load(f"{reference['root']}/tied")
    assert back["model"]["embed"] is back["model"]["head"]
    assert _equal(back["model"]["embed"].numpy(), reference["saved"]["model.layers.0.weight"])
    assert sorted(back["model"]) == ["embed", "head", "layers.2.bias", "layers.2.weight",
                                     "layers.3.bias", "layers.3.weight"]


def test_model_parts_with_an_optimizer_each(reference: dict[str, Any]) -> None:
    """A rank holding two stages (an interleaved schedule: model parts, an optimizer each) names
    them all in one OptimizerState and gets each part's entries (the parts' weights in one dict
    by FQN, filled in place)."""
    import ckptio

    parts = [_build((1, 3), stage, OTHER_SEED) for stage in (0, 1)]
    models, opts = [p[0] for p in parts], [p[1] for p in parts]
    weights = {k: v for m in models for k, v in m.state_dict().items()}  # one dict, by FQN
    ckptio.load(reference["path"], {"model": weights, "optim": ckptio.OptimizerState(models, opts)},
                keys=("model", "optim"))
    got = _union([_snapshot(m, o) for m, o in zip(models, opts)])
    assert sorted(got) == sorted(reference["saved"])
    assert all(_equal(got[k], want) for k, want in reference["saved"].items())


def test_optimizer_state_refuses_parameters_it_cannot_name() -> None:
    import ckptio
    from ckptio.errors import UnsupportedStateError

    model, _opt, _sched = _build((N_LAYERS,), 0, INIT_SEED)
    stray = torch.nn.Parameter(torch.zeros(3, 5))
    opt = torch.optim.AdamW([*model.parameters(), stray])
    with pytest.raises(UnsupportedStateError, match=r"shape \(3, 5\) that no module given has"):
        ckptio.OptimizerState(model, opt)
    a, _o, _s = _build((2, 2), 0, INIT_SEED)
    b, _o, _s = _build((2, 2), 0, OTHER_SEED)  # layers 0 and 1 again: the same names
    with pytest.raises(UnsupportedStateError, match="both name a parameter 'layers.0.weight'"):
        ckptio.OptimizerState([a, b], torch.optim.AdamW([*a.parameters(), *b.parameters()]))


def equal_stages_job(rank: int, world: int, root: str) -> dict[str, Any]:
    """2 stages of one layer each (equal shapes), a plain index-keyed AdamW, one step, saved;
    then loaded into fresh stages as saved, and with the stages swapped between the ranks (a
    launcher that orders ranks another way): -> what each load did."""
    import ckptio

    torch.set_num_threads(1)
    model, opt, _sched = _build((1, 1), rank, INIT_SEED)
    _forward(model, torch.ones(2, H)).sum().backward()
    opt.step()
    ckptio.save({"model": model, "optim": opt}, f"{root}/plain_equal")
    saved = _snapshot(model, opt)
    out: dict[str, Any] = {}
    for name, stage in (("same", rank), ("swapped", 1 - rank)):
        fresh, fresh_opt, _s = _build((1, 1), stage, OTHER_SEED)
        fresh_opt.step()  # AdamW's state exists: the load fills it in place
        try:
            ckptio.load(f"{root}/plain_equal", {"model": fresh, "optim": fresh_opt})
            got = _snapshot(fresh, fresh_opt)
            out[name] = sorted(got) == sorted(saved) and all(_equal(got[k], v)
                                                              for k, v in saved.items())
        except ckptio.CkptError as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
    return out


def test_a_plain_optimizer_on_equal_stages_loaded_on_another_split_is_refused(
        tmp_path: Any) -> None:
    """Equal stages give every rank the same optimizer indices and shapes: loaded with the
    stages swapped between ranks, an index-keyed optimizer would take the other stage's
    moments without a word. The save records each optimizer's parameter names, so that load
    raises on every rank before anything is read, naming both parameter lists and
    ckptio.OptimizerState; the load on the split that saved it is bitwise."""
    got = run_ranks(2, equal_stages_job, str(tmp_path), timeout_s=RANKS_TIMEOUT_S)
    for rank, result in enumerate(got):
        assert result["same"] is True, (rank, result["same"])
        refusal = result["swapped"]
        assert isinstance(refusal, str) and refusal.startswith("StateMismatchError"), refusal
        saved, held = (f"layers.{rank}.weight", f"layers.{1 - rank}.weight")
        assert f"param group 0 was saved (saved rank {rank}) for the parameters ['{saved}'" \
            in refusal, refusal
        assert f"this state's optimizer holds ['{held}'" in refusal, refusal
        assert "Save ckptio.OptimizerState(model, optimizer) in its place" in refusal, refusal
