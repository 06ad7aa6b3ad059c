"""The Lightning plugin with an ``s3://`` destination on a real SeaweedFS server (red team:
plugins with tiers and URLs).

A checkpoint saved through the plugin at an ``s3://`` path (``trainer.save_checkpoint``, or a
ModelCheckpoint whose dirpath Lightning lists through fsspec) is saved and resumed from, but
``remove_checkpoint`` (ModelCheckpoint's rotation of a worse or older checkpoint) refused it as
not local: a run died at its first rotation, after its first checkpoints had been written. It
removes the checkpoint's objects now, manifest first; the async plugin waits for a save in
flight at that path first.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("lightning")

import lightning as L  # noqa: E402 - only once it is there

import ckptio  # noqa: E402
import ckptio.lightning  # noqa: E402
from ckptio.storage.s3.s3path import S3Path  # noqa: E402

QUIET = {"enable_progress_bar": False, "logger": False, "enable_model_summary": False,
         "accelerator": "cpu", "devices": 1, "num_sanity_val_steps": 0,
         "enable_checkpointing": False}
SMALL = ckptio.Options(buffer_bytes=1 << 20, pool_bytes=4 << 20)


class Tiny(L.LightningModule):  # type: ignore[misc,name-defined]
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 1)

    def training_step(self, batch: Any, _: int) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=0.01)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)]


def _keys(s3_client: Any, url: str) -> list[str]:
    """Every object under ``url``, relative to it (straight from the server)."""
    where = S3Path.parse(url)
    found = s3_client.list_objects_v2(Bucket=where.bucket, Prefix=where.dir_prefix)
    return sorted(o["Key"][len(where.dir_prefix):] for o in found.get("Contents", []))


def _data() -> Any:
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(0))
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)),
                                       batch_size=4)


@pytest.mark.parametrize("kind", ["CheckpointIO", "AsyncCheckpointIO"])
def test_an_s3_checkpoint_saves_resumes_and_is_removed(s3_env: str, s3_client: Any,
                                                       kind: str) -> None:
    url = f"{s3_env}/run/epoch=1-step=8.ckpt"
    plugin = getattr(ckptio.lightning, kind)(SMALL)
    trainer = L.Trainer(max_epochs=2, plugins=[plugin], **QUIET)
    torch.manual_seed(0)
    trainer.fit(Tiny(), _data())
    trainer.save_checkpoint(url)
    if kind == "AsyncCheckpointIO":  # after fit's teardown: nothing else waits for it
        plugin.wait()
    plugin.remove_checkpoint(f"{s3_env}/run/never-saved.ckpt")  # none there: nothing to do
    resumed = L.Trainer(max_epochs=3, plugins=[getattr(ckptio.lightning, kind)(SMALL)], **QUIET)
    resumed.fit(Tiny(), _data(), ckpt_path=url)
    assert resumed.global_step == 12 and resumed.lr_scheduler_configs[0].scheduler.last_epoch == 3
    assert "manifest.json" in _keys(s3_client, url)

    plugin.remove_checkpoint(url)
    assert _keys(s3_client, url) == []
    with pytest.raises(ckptio.CheckpointNotFoundError):
        plugin.load_checkpoint(url)
    plugin.teardown()


def test_the_async_plugin_removes_an_s3_path_only_once_its_save_is_over(
        s3_env: str, s3_client: Any, tmp_path: Path) -> None:
    url = f"{s3_env}/run/last.ckpt"
    plugin = ckptio.lightning.AsyncCheckpointIO(SMALL)
    plugin.save_checkpoint({"w": torch.ones(3), "global_step": 2}, f"{url}2")  # a name beside
    plugin.save_checkpoint({"w": torch.randn(1 << 20), "global_step": 3}, url)
    plugin.remove_checkpoint(url)  # waits for the save in flight, then removes every object
    assert plugin.in_flight() is None
    assert _keys(s3_client, url) == []
    assert plugin.load_checkpoint(f"{url}2")["global_step"] == 2  # not under the removed one
    plugin.teardown()
