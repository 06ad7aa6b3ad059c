"""TorchTitan choosing ckptio by configuration: ``ckptio.torchtitan_manager.CkptioCheckpointManager``,
a subclass of TorchTitan's ``BaseCheckpointManager`` seam, built from its ``Config`` as TorchTitan's
Trainer builds ``config.checkpoint``. Skipped where torchtitan is not installed.

TorchTitan's Trainer does not run on a CPU-only torch (docs/guides/torchtitan.md says why), so
the checkpoint component is driven as TorchTitan's own tests drive it, with its own
OptimizersContainer and LRSchedulersContainer and a train state, here on 2 gloo ranks with FSDP2:

* a job saving every 2 steps is killed (SIGKILL) and a fresh job resumes from the newest
  committed step; its losses equal an uninterrupted run's bit for bit (each async_mode);
* the 2-rank FSDP2 checkpoint loads into one process and a plain model: parameters and Adam
  moments equal the gathered saved ones bit for bit, training goes on within a tolerance;
* keep_latest_k keeps exactly k steps; a newer step left partial is passed over;
* the last step model-only in export_dtype, and in Hugging Face safetensors (last_save_in_hf);
* initial_load_path from a checkpoint of TorchTitan's own DCP manager;
* selected through TorchTitan's ConfigManager (``--module``/``--config`` plus CLI overrides);
* TorchTitan's own manager through ckptio's DcpWriter (``dcp`` replaced in its module).
The s3:// round trip is in tests/s3/test_torchtitan_s3.py.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import ckptio

pytest.importorskip("torchtitan.components.checkpointer.base")
from torchtitan.components.checkpointer import CheckpointManager
from torchtitan.components.checkpointer import dcp as titan_dcp
from torchtitan.components.optimizer import LRSchedulersContainer
from torchtitan.components.optimizer.optimizer import default_adamw

from ckptio.errors import CheckpointNotFoundError, CkptError
from ckptio.testing.rank_processes import free_port, run_ranks
from ckptio.torchtitan_manager import CkptioCheckpointManager
from dist_cases import fully_shard_linears

DIMS = (12, 30, 17, 5)  # uneven over 2 ranks
BATCH = 8
STEPS = 8
RTOL, ATOL = 1e-5, 1e-6  # 1 rank after 2: other summation order (tests/test_fsdp2_resume.py)


class TrainState:
    """TorchTitan's Trainer is the train state it checkpoints: step and tokens seen."""

    def __init__(self) -> None:
        self.step = 0
        self.ntokens_seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.ntokens_seen = int(state["step"]), int(state["ntokens_seen"])


class Job:
    """The pieces TorchTitan's Trainer hands its checkpointer, around a small MLP."""

    def __init__(self, base_folder: str | os.PathLike[str], *, fsdp: bool = False,
                 manager: Any = CkptioCheckpointManager, sd_adapter: Any = None,
                 **config: Any) -> None:
        torch.manual_seed(0)
        layers: list[torch.nn.Module] = []
        for i, (a, b) in enumerate(zip(DIMS, DIMS[1:])):
            layers += [torch.nn.Linear(a, b)] + ([torch.nn.GELU()] if i < len(DIMS) - 2 else [])
        self.model = torch.nn.Sequential(*layers)
        if fsdp:
            fully_shard_linears(self.model)
        self.optimizers = default_adamw(lr=1e-2).build(model_parts=[self.model])
        self.schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(
            optimizers=self.optimizers, training_steps=STEPS)
        self.state = TrainState()
        settings = {"enable": True, "interval": 2, "keep_latest_k": 0,
                    "last_save_model_only": False, **config}
        self.checkpointer = manager.Config(**settings).build(
            dataloader=None, model_parts=[self.model], optimizers=self.optimizers,
            lr_schedulers=self.schedulers, states={"train_state": self.state},
            sd_adapter=sd_adapter,
            base_folder=os.fspath(base_folder))

    def step(self, rank: int = 0, world: int = 1) -> float:
        """One training step as the Trainer orders it -> the global batch's mean loss."""
        self.state.step += 1
        g = torch.Generator().manual_seed(10_000 + self.state.step)
        x, y = torch.randn(BATCH, DIMS[0], generator=g), torch.randn(BATCH, DIMS[-1], generator=g)
        n = BATCH // world
        err = (self.model(x[rank * n:(rank + 1) * n]) - y[rank * n:(rank + 1) * n]).pow(2)
        err.mean().backward()
        self.checkpointer.maybe_wait_for_staging()
        self.optimizers.step()
        self.schedulers.step()
        self.optimizers.zero_grad()
        self.state.ntokens_seen += BATCH
        total = err.detach().sum()
        if world > 1:
            torch.distributed.all_reduce(total)
        self.checkpointer.save(self.state.step, last_step=self.state.step == STEPS)
        return float(total) / (BATCH * DIMS[-1])


def _whole(value: Any) -> np.ndarray:
    full = value.full_tensor() if hasattr(value, "full_tensor") else value
    return full.detach().float().numpy().copy()


def _snapshot(job: Job) -> dict[str, np.ndarray]:
    """Every parameter and optimizer state tensor, whole (collective under FSDP2)."""
    out = {f"model.{k}": _whole(v) for k, v in job.model.state_dict().items()}
    for key, value in job.optimizers.state_dict().items():
        if isinstance(value, torch.Tensor):
            out[f"optim.{key}"] = _whole(value)
    return out


# ------------------------------------------------------------------ on the ranks


def run_job(rank: int, world: int, folder: str, mode: str, kill_at: int,
            snapshot_at: int) -> dict[str, Any]:
    """A 2-rank FSDP2 job: resume what ``folder`` holds, train to STEPS saving every 2 steps;
    SIGKILL itself after step ``kill_at`` (0: never)."""
    torch.set_num_threads(1)
    job = Job(folder, fsdp=True, async_mode=mode)
    job.checkpointer.load()
    start, losses, snapshot = job.state.step, {}, None
    while job.state.step < STEPS:
        loss = job.step(rank, world)
        losses[job.state.step] = loss
        if job.state.step == snapshot_at:
            job.checkpointer.maybe_wait_for_saving()
            snapshot = _snapshot(job)
        if job.state.step == kill_at:
            torch.distributed.barrier()
            os.kill(os.getpid(), signal.SIGKILL)  # no close, a save may be in flight
    job.checkpointer.close()
    return {"start": start, "losses": losses, "snapshot": snapshot}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    folder = tmp_path_factory.mktemp("titan-uninterrupted")
    return folder, run_ranks(2, run_job, str(folder), "disabled", 0, 4)[0]


def _killed_job(folder: Path, mode: str, kill_at: int) -> None:
    """The job as its own 2 processes (gloo, env://), each SIGKILLing itself at ``kill_at``."""
    here = Path(__file__).resolve().parent
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(here.parent), str(here),
                                          os.environ.get("PYTHONPATH", "")])}
    code = ("import os, torch.distributed as dist, test_torchtitan as t\n"
            "dist.init_process_group('gloo')\n"
            f"t.run_job(dist.get_rank(), 2, {str(folder)!r}, {mode!r}, {kill_at}, 0)\n")
    ranks = [subprocess.Popen([sys.executable, "-c", code], env={**env, "RANK": str(r)})
             for r in range(2)]
    try:
        codes = [p.wait(timeout=120) for p in ranks]
    finally:
        for p in ranks:
            p.kill()
    assert codes == [-signal.SIGKILL] * 2, codes


@pytest.mark.parametrize("mode", ["disabled", "async", "async_with_pinned_mem"])
def test_killed_job_resumes_bitwise_on_two_fsdp2_ranks(
        tmp_path: Path, mode: str, uninterrupted: tuple[Path, dict[str, Any]]) -> None:
    _killed_job(tmp_path, mode, 5)
    with ckptio.CheckpointManager(tmp_path / "checkpoint") as listing:
        committed = listing.steps()
    assert committed[-1] == 4 or (mode != "disabled" and committed[-1] == 2), committed
    resumed = run_ranks(2, run_job, str(tmp_path), mode, 0, 0)[0]
    assert resumed["start"] == committed[-1]  # the newest committed step, as a fresh job
    want = {s: v for s, v in uninterrupted[1]["losses"].items() if s > committed[-1]}
    assert resumed["losses"] == want  # bit for bit


def test_two_rank_fsdp2_checkpoint_loads_on_one_plain_process(
        tmp_path: Path, uninterrupted: tuple[Path, dict[str, Any]]) -> None:
    folder, reference = uninterrupted
    job = Job(folder, load_only=True)  # one process, no process group, a plain model
    assert job.checkpointer.load(step=4) and job.state.step == 4
    mine = _snapshot(job)
    assert mine.keys() == reference["snapshot"].keys()
    for key, value in reference["snapshot"].items():
        assert np.array_equal(mine[key], value), key  # bit for bit, moments included
    losses = {}
    while job.state.step < STEPS:
        loss = job.step()
        losses[job.state.step] = loss
    job.checkpointer.close()
    want = [reference["losses"][s] for s in losses]
    np.testing.assert_allclose(list(losses.values()), want, rtol=RTOL, atol=ATOL)


# ------------------------------------------------------------------ one process


def _train(job: Job, until: int = STEPS) -> list[float]:
    losses = [job.step() for _ in range(until - job.state.step)]
    job.checkpointer.close()
    return losses


def _steps(folder: Path) -> list[str]:
    return sorted(os.listdir(folder / "checkpoint"), key=lambda n: int(n.split("-")[1]))


@pytest.mark.parametrize("mode", ["disabled", "async"])
def test_keep_latest_k_keeps_exactly_k(tmp_path: Path, mode: str) -> None:
    _train(Job(tmp_path, interval=1, keep_latest_k=3, async_mode=mode))
    assert _steps(tmp_path) == ["step-6", "step-7", "step-8"]


def test_resume_passes_over_a_partial_newer_step(tmp_path: Path) -> None:
    uninterrupted = _train(Job(tmp_path / "a"))
    _train(Job(tmp_path / "b"), until=5)  # steps 2 and 4 committed
    partial = tmp_path / "b" / "checkpoint" / "step-6"
    shutil.copytree(tmp_path / "b" / "checkpoint" / "step-4", partial)
    (partial / "manifest.json").unlink()  # as a save killed before its commit leaves it
    job = Job(tmp_path / "b")
    assert job.checkpointer.load() and job.state.step == 4
    assert _train(job) == uninterrupted[4:]
    assert ckptio.verify(partial) > 0  # saved again, whole, by the resumed job


def test_load_step_from_an_older_step_refuses_its_first_save(tmp_path: Path) -> None:
    """The guide's Limits: resuming with load_step from an older step of a folder holding later
    ones fails at its first save, naming the later steps, which stay."""
    _train(Job(tmp_path, last_save_model_only=False), until=6)  # steps 2, 4, 6
    job = Job(tmp_path, last_save_model_only=False)
    assert job.checkpointer.load(step=2) and job.state.step == 2
    job.step()
    with pytest.raises(CkptError, match=r"step 4 not saved: .*load_step 2\).*later steps "
                                        r"\[4, 6\].*initial_load_path \S*step-2 "
                                        r"--checkpoint\.no_initial_load_model_only"):
        job.step()  # in TorchTitan's terms (it said ckptio's: a rollback, restore(step=N))
    job.checkpointer.close()
    assert _steps(tmp_path) == ["step-2", "step-4", "step-6"]
    assert all(ckptio.verify(tmp_path / "checkpoint" / n) > 0 for n in _steps(tmp_path))


def test_last_step_model_only_in_export_dtype_and_a_restart_loads_it(tmp_path: Path) -> None:
    job = Job(tmp_path, last_save_model_only=True, export_dtype="bfloat16")
    _train(job)
    saved = ckptio.load(tmp_path / "checkpoint" / "step-8")
    assert set(saved) == set(job.model.state_dict())  # the model only
    assert {v.dtype for v in saved.values()} == {torch.bfloat16}
    again = Job(tmp_path, last_save_model_only=True)  # the finished job restarted
    assert again.checkpointer.load() and again.state.step == 0  # model only, as a seed
    for key, value in again.model.state_dict().items():
        assert torch.equal(value, saved[key].float()), key
    again.checkpointer.close()


class RenamingAdapter:
    """A state-dict adapter as TorchTitan's models have: ``model.`` prefixed HF names."""

    fqn_to_index_mapping = None
    hf_assets_path = None

    def to_hf(self, state: dict[str, Any]) -> dict[str, Any]:
        return {f"model.{k}": v for k, v in state.items()}

    def from_hf(self, state: dict[str, Any]) -> dict[str, Any]:
        return {k.removeprefix("model."): v for k, v in state.items()}


def test_last_step_in_hugging_face_safetensors(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    job = Job(tmp_path, last_save_model_only=True, last_save_in_hf=True,
              sd_adapter=RenamingAdapter())
    _train(job)
    files = tmp_path / "checkpoint" / "hf" / "step-8"
    exported = load_file(files / "model.safetensors")
    want = {f"model.{k}": v for k, v in job.model.state_dict().items()}
    assert exported.keys() == want.keys()
    assert all(torch.equal(exported[k], v) for k, v in want.items())
    assert not [p for p in (tmp_path / "checkpoint").iterdir() if p.name.startswith(".hf")]


def test_initial_load_from_torchtitans_own_dcp_checkpoint(tmp_path: Path) -> None:
    titan = Job(tmp_path / "dcp", manager=CheckpointManager)
    _train(titan, until=4)
    assert (tmp_path / "dcp" / "checkpoint" / "step-4" / ".metadata").is_file()
    job = Job(tmp_path / "ckptio", initial_load_model_only=False,
              initial_load_path=str(tmp_path / "dcp" / "checkpoint" / "step-4"))
    assert job.checkpointer.load() and job.state.step == 4
    assert _snapshot(job).keys() == _snapshot(titan).keys()
    assert all(np.array_equal(a, _snapshot(titan)[k]) for k, a in _snapshot(job).items())
    job.checkpointer.close()


# TorchTitan's own tests of its manager (tests/unit_tests/test_checkpoint.py), the ones that
# are about behaviour rather than its calls to dcp, on this manager


def test_load_returns_false_without_a_checkpoint(tmp_path: Path) -> None:
    job = Job(tmp_path)
    assert job.checkpointer.load() is False and job.state.step == 0
    with pytest.raises(CheckpointNotFoundError, match="load_step=3"):
        job.checkpointer.load(step=3)
    job.checkpointer.close()
    missing = Job(tmp_path / "b", initial_load_path=str(tmp_path / "nowhere"))
    with pytest.raises(CheckpointNotFoundError, match="nowhere"):
        missing.checkpointer.load()
    missing.checkpointer.close()
    with pytest.raises(CkptError, match="sd_adapter"):
        Job(tmp_path / "c", last_save_model_only=True, last_save_in_hf=True)


def test_interval_first_step_and_load_only(tmp_path: Path) -> None:
    _train(Job(tmp_path / "a", interval=3, enable_first_step_checkpoint=True))
    assert _steps(tmp_path / "a") == ["step-1", "step-3", "step-6", "step-8"]
    _train(Job(tmp_path / "b", load_only=True))
    assert not (tmp_path / "b" / "checkpoint").exists()


def test_disabled_manager_waits_are_no_ops(tmp_path: Path) -> None:
    job = Job(tmp_path, enable=False)
    job.checkpointer.maybe_wait_for_staging()
    job.checkpointer.maybe_wait_for_saving()
    assert job.checkpointer.save(2) is False and job.checkpointer.load() is False
    job.checkpointer.close()
    assert not (tmp_path / "checkpoint").exists()


def titan_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: list[str]) -> Any:
    """TorchTitan's ConfigManager parsing the command line ``args`` for a job module of
    ``tmp_path`` whose checkpoint is ckptio's (enabled, interval 5) -> the job's config."""
    pytest.importorskip("typeguard")  # tyro's, for TorchTitan's command line
    from torchtitan.config import ConfigManager

    (tmp_path / "my_job.py").write_text(
        "from dataclasses import dataclass, field\n"
        "from torchtitan.components.checkpointer import BaseCheckpointManager, CheckpointManager\n"
        "from ckptio.torchtitan_manager import CkptioCheckpointManager\n\n"
        "@dataclass(kw_only=True, slots=True)\n"
        "class Job:\n"  # the fields of Trainer.Config that ConfigManager reads
        "    hf_assets_path: str = '.'\n"
        "    checkpoint: BaseCheckpointManager.Config = field(\n"
        "        default_factory=CheckpointManager.Config)\n\n"
        "def ckptio_job():\n"
        "    return Job(checkpoint=CkptioCheckpointManager.Config(enable=True, interval=5))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return ConfigManager().parse_args(["--module", "my_job", "--config", "ckptio_job", *args])


def test_chosen_by_torchtitans_config_manager(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    config = titan_config(tmp_path, monkeypatch, [
        "--checkpoint.keep_latest_k", "3", "--checkpoint.async_mode", "async",
        "--checkpoint.folder", "s3://bucket/run"])
    assert type(config.checkpoint) is CkptioCheckpointManager.Config
    assert (config.checkpoint.keep_latest_k, config.checkpoint.async_mode,
            config.checkpoint.folder, config.checkpoint.interval) == (3, "async",
                                                                      "s3://bucket/run", 5)
    assert config.checkpoint._owner is CkptioCheckpointManager  # what build() constructs


# ------------------------------------------------------------------ TorchTitan's DCP manager


@pytest.fixture
def through_ckptio(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """TorchTitan's DCP manager's dcp.save / dcp.load, with ckptio's StorageWriter / Reader."""
    import torch.distributed.checkpoint as dcp

    calls: list[tuple[str, str]] = []

    def save(state: dict[str, Any], *, checkpoint_id: str | None = None,
             storage_writer: Any = None, **kwargs: Any) -> Any:
        calls.append(("save", str(checkpoint_id)))
        return dcp.save(state, storage_writer=storage_writer or ckptio.DcpWriter(checkpoint_id),
                        **kwargs)

    def load(state: dict[str, Any], *, checkpoint_id: str | None = None,
             storage_reader: Any = None, **kwargs: Any) -> Any:
        calls.append(("load", str(checkpoint_id)))
        return dcp.load(state, storage_reader=storage_reader or ckptio.DcpReader(checkpoint_id),
                        **kwargs)

    monkeypatch.setattr(titan_dcp, "dcp", types.SimpleNamespace(save=save, load=load))
    return calls


def test_torchtitans_dcp_manager_through_ckptios_dcp_writer(
        tmp_path: Path, through_ckptio: list[tuple[str, str]]) -> None:
    uninterrupted = _train(Job(tmp_path / "a", manager=CheckpointManager))
    _train(Job(tmp_path / "b", manager=CheckpointManager), until=4)
    step4 = tmp_path / "b" / "checkpoint" / "step-4"
    assert (step4 / "manifest.json").is_file() and not (step4 / ".metadata").exists()
    job = Job(tmp_path / "b", manager=CheckpointManager)
    assert job.checkpointer.load(step=4)  # its scan looks for .metadata: the step is given
    assert _train(job) == uninterrupted[4:]
    assert ("load", str(step4)) in through_ckptio


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
