"""torchtitan's checkpointer (``torchtitan.components.checkpoint.CheckpointManager``, which
calls ``dcp.save`` / ``dcp.load``) saving and resuming through ``ckptio.DcpWriter`` /
``ckptio.DcpReader``. Skipped where torchtitan is not installed (it is not a dependency).

torchtitan's Trainer does not run on a CPU-only torch (it picks device "cuda" when no
accelerator is found, its debug model trains only with flex or varlen attention, neither of
which has a CPU backward), so this drives the checkpointer the Trainer builds with a small CPU
model, torchtitan's own OptimizersContainer and LRSchedulersContainer, and a train state. The
checkpointer offers no storage-writer hook for its DCP saves, so ``dcp`` in its module is
replaced by one that passes ckptio's writer and reader. Its resume scan looks for DCP's
``.metadata`` and so does not see a ckptio step: the step is given (``load(step=N)``,
``--checkpoint.load_step``).
"""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckptio

pytest.importorskip("torchtitan.components.checkpoint")
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.checkpointer import dcp as titan_dcp
from torchtitan.components.optimizer import LRSchedulersContainer
from torchtitan.components.optimizer.optimizer import default_adamw


@pytest.fixture
def through_ckptio(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """torchtitan's dcp.save / dcp.load, with ckptio's StorageWriter / StorageReader."""
    calls: list[tuple[str, str]] = []

    def save(state: dict[str, Any], *, checkpoint_id: str | None = None,
             storage_writer: Any = None, **kwargs: Any) -> Any:
        calls.append(("save", str(checkpoint_id)))  # torchtitan's HF export keeps its writer
        writer = storage_writer or ckptio.DcpWriter(checkpoint_id)
        return dcp.save(state, storage_writer=writer, **kwargs)

    def load(state: dict[str, Any], *, checkpoint_id: str | None = None,
             storage_reader: Any = None, **kwargs: Any) -> Any:
        calls.append(("load", str(checkpoint_id)))  # and its HF import its reader
        reader = storage_reader or ckptio.DcpReader(checkpoint_id)
        return dcp.load(state, storage_reader=reader, **kwargs)

    monkeypatch.setattr(titan_dcp, "dcp", types.SimpleNamespace(save=save, load=load))
    return calls


class _TrainState:
    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])


def _train(folder: Path, steps: int, stop: int | None = None,
           resume: int | None = None) -> list[float]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    optimizers = default_adamw(lr=1e-2).build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers,
                                                                   training_steps=steps)
    state = _TrainState()
    checkpointer = CheckpointManager.Config(
        enable=True, folder="checkpoint", interval=2, keep_latest_k=0,
        last_save_model_only=False).build(
        dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=schedulers,
        states={"train_state": state}, sd_adapter=None, base_folder=str(folder))
    if resume is not None:
        assert checkpointer.load(step=resume)
        assert state.step == resume
    losses = []
    try:
        while state.step < steps:
            state.step += 1
            g = torch.Generator().manual_seed(state.step)
            x, y = torch.randn(4, 16, generator=g), torch.randn(4, 8, generator=g)
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizers.step()
            schedulers.step()
            optimizers.zero_grad()
            losses.append(loss.item())
            checkpointer.save(state.step, last_step=state.step == steps)
            if state.step == stop:
                break
    finally:
        checkpointer.close()
    return losses


def test_torchtitan_checkpointer_saves_and_resumes_through_ckptio(
        tmp_path: Path, through_ckptio: list[tuple[str, str]]) -> None:
    uninterrupted = _train(tmp_path / "a", 6)
    first = _train(tmp_path / "b", 6, stop=4)
    step4 = tmp_path / "b" / "checkpoint" / "step-4"
    assert (step4 / "manifest.json").is_file() and not (step4 / ".metadata").exists()
    assert ckptio.verify(step4) > 0
    saved = ckptio.load(step4)
    assert saved["train_state"] == {"step": 4}
    assert {"0.weight", "2.bias"} <= set(saved)  # torchtitan flattens the model's keys
    assert any(k.startswith("optimizer") for k in saved) and "lr_scheduler" in saved
    rest = _train(tmp_path / "b", 6, resume=4)
    assert first + rest == uninterrupted  # the same losses, bit for bit
    assert ("load", str(step4)) in through_ckptio
    assert [c for c in through_ckptio if c[0] == "save"]
