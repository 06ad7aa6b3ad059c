"""A small, deterministic Lightning training run checkpointing through ckptio.lightning, for
tests/integrations/test_lightning.py (run as a script in a fresh process, or imported).

    python tests/integrations/lightning_job.py '{"dir": ..., "losses": ..., "plugin": "sync"}'

Every training step appends ``<global_step> <loss as float.hex()>`` to ``losses`` (flushed:
a SIGKILL loses nothing already written). ``kill_at``: the process kills itself (SIGKILL) at
the start of that global step; in "async" mode it first waits until ``committed`` names a
committed checkpoint (the kill then lands while a later save may still be in flight).
``ckpt_path``: resume from it ("last" or a path). ModelCheckpoint saves every epoch into
``dir`` (the ``top_k`` newest, by default all, plus last.ckpt), through the plugin.
``devices``: 2 runs DDP on CPU (gloo; rank 0 writes the losses).

    python tests/integrations/lightning_job.py --forked '{"name": {spec}, ...}' LOGDIR

runs each spec at once in its own process forked from this one (Lightning, torch and ckptio
imported once, here, not once per run), its output in LOGDIR/name.log, and prints
``{name: exit code}`` (-9: SIGKILL) once every process it started, DDP's second ranks
included, has ended (run_forked).
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

import ckptio
import ckptio.lightning

STEPS_PER_EPOCH = 8
OPTIONS = ckptio.Options(buffer_bytes=1 << 20, pool_bytes=4 << 20)


class Tiny(L.LightningModule):
    """Two linear layers, AdamW and a per-epoch StepLR: optimizer and scheduler state matter."""

    def __init__(self, width: int = 16, lr: float = 0.05, losses: str = "") -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.Tanh(),
                                       torch.nn.Linear(width, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        if self.hparams.losses and self.global_rank == 0:
            with open(self.hparams.losses, "a") as out:
                out.write(f"{self.global_step} {loss.item().hex()}\n")
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)]


def data(n: int, seed: int) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    y = (x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1 * torch.randn(n, 1, generator=g))
    return DataLoader(TensorDataset(x, y), batch_size=4, shuffle=False)


class Killer(L.Callback):
    """SIGKILL this process at the start of global step ``at`` (after ``committed`` commits)."""

    def __init__(self, at: int, committed: str | None) -> None:
        self.at, self.committed = at, committed

    def on_train_batch_start(self, trainer: L.Trainer, *_args: Any) -> None:
        if trainer.global_step != self.at:
            return
        if self.committed is not None and not os.path.exists(
                os.path.join(self.committed, "manifest.json")):
            raise RuntimeError(f"{self.committed} is not committed at step {self.at}")
        os.kill(os.getpid(), signal.SIGKILL)


def plugin(kind: str, **kwargs: Any) -> ckptio.lightning.CheckpointIO:
    cls = {"sync": ckptio.lightning.CheckpointIO, "async": ckptio.lightning.AsyncCheckpointIO}
    return cls[kind](OPTIONS, **kwargs)


def run(spec: dict[str, Any]) -> L.Trainer:
    L.seed_everything(0, verbose=False)
    model = Tiny(losses=spec.get("losses", ""))
    callbacks: list[L.Callback] = [ModelCheckpoint(dirpath=spec["dir"], save_last=True,
                                                   save_top_k=spec.get("top_k", -1))]
    if spec.get("kill_at") is not None:
        callbacks.append(Killer(spec["kill_at"], spec.get("committed")))
    if spec.get("rng"):  # every rank's generators in the checkpoint (gathered over DDP's group)
        callbacks.append(ckptio.lightning.RNGStateCallback())
    devices = spec.get("devices", 1)  # 2: DDP over gloo (Lightning starts the second process)
    trainer = L.Trainer(max_epochs=spec.get("epochs", 4), accelerator="cpu", devices=devices,
                        strategy="ddp" if devices > 1 else "auto",
                        enable_progress_bar=False, logger=False, enable_model_summary=False,
                        deterministic=True, plugins=[plugin(spec.get("plugin", "sync"))],
                        callbacks=callbacks, default_root_dir=spec["dir"])
    trainer.fit(model, data(STEPS_PER_EPOCH * 4, seed=1), data(8, seed=2),
                ckpt_path=spec.get("ckpt_path"))
    return trainer


def read_losses(path: str | Path) -> dict[int, str]:
    """{global step: loss hex} as a run wrote them (a step written twice must agree)."""
    found: dict[int, str] = {}
    for line in Path(path).read_text().splitlines():
        step, loss = line.split()
        if found.setdefault(int(step), loss) != loss:
            raise AssertionError(f"step {step} written twice with different losses")
    return found


_PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h


def run_forked(specs: dict[str, dict[str, Any]], logs: str) -> dict[str, int]:
    """Each of ``specs`` in a child forked from this process, all at once; -> {name: exit code}
    once every process below this one has ended. A child is a run as the script runs it: its
    argv the script's with that spec (Lightning's DDP launcher starts the second rank from it, a
    fresh interpreter as before), its output in ``logs``/name.log, and it ends as the
    interpreter does (run, then SystemExit: threads joined, atexit, flush). This process is the
    children's subreaper, so a second rank orphaned by its killed rank 0 is waited for too."""
    if ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")
    children: dict[int, str] = {}
    for name, spec in specs.items():
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(spec, os.path.join(logs, f"{name}.log"))
        children[pid] = name
    codes: dict[str, int] = {}
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:  # none left, orphaned grandchildren included
            return codes
        if pid in children:
            codes[children[pid]] = os.waitstatus_to_exitcode(status)


def _child(spec: dict[str, Any], log: str) -> None:
    """The forked child: output to ``log``, argv as ``python lightning_job.py SPEC``, then the
    run; ends by SystemExit (or the run's own exception), never returning to the fork loop."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.argv = [os.path.abspath(__file__), json.dumps(spec)]
    run(spec)
    sys.exit(0)


if __name__ == "__main__":
    if sys.argv[1] == "--forked":
        print(json.dumps(run_forked(json.loads(sys.argv[2]), sys.argv[3])))
    else:
        run(json.loads(sys.argv[1]))
