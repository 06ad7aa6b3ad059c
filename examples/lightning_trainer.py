"""Lightning with ckptio: every checkpoint Lightning writes goes through ckptio (asynchronous,
committed atomically, every byte checksummed); a second fit resumes from `last`.

    python examples/lightning_trainer.py --dir /tmp/ckptio-lightning --epochs 3

Needs `pip install -e '.[lightning]'`.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

import ckptio
import ckptio.lightning


class Regressor(L.LightningModule):
    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(),
                                       torch.nn.Linear(16, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)]


def data() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 4, generator=g)
    return DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=8)


def fit(directory: str, epochs: int) -> L.Trainer:
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(max_epochs=epochs, accelerator="cpu", logger=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        plugins=[ckptio.lightning.AsyncCheckpointIO()],
                        callbacks=[ModelCheckpoint(dirpath=directory, save_last=True)])
    trainer.fit(Regressor(), data(), ckpt_path="last" if os.path.exists(
        os.path.join(directory, "last.ckpt")) else None)
    return trainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", default=None, help="a new directory under it per run")
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    if args.dir:
        os.makedirs(args.dir, exist_ok=True)
    directory = tempfile.mkdtemp(prefix="ckptio-lightning-", dir=args.dir)  # so runs can repeat
    first = fit(directory, args.epochs)
    resumed = fit(directory, args.epochs + 1)  # resumes from last.ckpt, one more epoch
    assert resumed.current_epoch == args.epochs + 1, resumed.current_epoch
    assert resumed.global_step == first.global_step * (args.epochs + 1) // args.epochs
    last = ckptio.load(os.path.join(directory, "last.ckpt"))
    print(f"ok: resumed at epoch {args.epochs}, trained to global step {resumed.global_step}; "
          f"last.ckpt is a ckptio checkpoint of {len(last['state_dict'])} tensors "
          f"(ckptio verify {os.path.join(directory, 'last.ckpt')})")


if __name__ == "__main__":
    main()
