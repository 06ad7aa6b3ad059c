"""The Lightning and Hugging Face Trainer plugins configured the way their users point them at
faster or remote storage (red team: plugins with tiers, URLs and resources).

- ``TrainingArguments(output_dir="shm://run")`` (host memory, as a CheckpointManager's first
  tier is named): the ckptio checkpoints went to /dev/shm/ckptio/run while transformers wrote
  trainer_state.json into a local folder named ``shm:`` in the working directory and rotated
  only those (``save_total_limit`` never freed the memory), and ``resume_from_checkpoint=True``
  then found no checkpoint. Refused by ``train()`` now, naming output_dir and the fix, before
  anything is written.
- A CkptioTrainer's saves went through the process-wide Checkpointer, whose staging pool and
  I/O threads stayed after ``train()`` returned (the Lightning plugin frees its own at
  teardown). The trainer's own Checkpointer is closed when ``train()`` ends now.
- ``AsyncCheckpointIO`` with ``ModelCheckpoint(save_top_k=k, save_last="link")``: Lightning
  starts the new top-k save, removes the checkpoint it replaces, and points ``last.ckpt`` at
  the new one. The removal ran at once, while the new save was still being written: a job
  killed then (SIGKILL) held neither, and ``ckpt_path="last"`` fell back to an older
  checkpoint (one killed at step 7 with saves every 2 steps resumed from step 2, not 4).
  Removals of other checkpoints now wait until the save in flight commits, and are dropped
  (the older checkpoint kept) if it fails.
- Two CkptioTrainer jobs started on one output_dir both trained, each replacing the other's
  ``checkpoint-N/ckptio`` and trainer_state.json (a checkpoint could hold one job's weights
  and the other's step and metrics). The trainer takes the run lease a CheckpointManager
  takes (storage/local/runlease.py) for ``train()``: the second job is refused before it
  trains, naming the holder's pid and the output_dir; the lease goes when ``train()`` ends.
- The Lightning plugin saved and loaded ``shm://`` checkpoints (``trainer.save_checkpoint``,
  ``fit(ckpt_path=...)``) but refused to remove one as not local; it removes them now (their
  directory, crash-safely, as a local one).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptio
from ckptio.testing.faults import HeldWrites
import ckptio.shared

IO_THREADS = ("ckptio-save", "ckptio-hash", "ckptio-io", "ckptio-uring", "ckptio-cleanup")


def _io_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.is_alive() and t.name.startswith(IO_THREADS)}


def _hf() -> Any:
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from tests.integrations import hf_trainer_run

    return hf_trainer_run


@pytest.mark.parametrize("url", ["shm://my-run", "s3://bucket/my-run", "file:///tmp/my-run"])
def test_hf_output_dir_a_url_is_refused_before_anything_is_written(
        tmp_path: Path, shm_root: Path, monkeypatch: pytest.MonkeyPatch, url: str) -> None:
    run = _hf()
    from ckptio.hf_trainer import CkptioTrainer

    monkeypatch.chdir(tmp_path)
    trainer = CkptioTrainer(model=run.tiny_model(),
                            args=run.training_args(url, max_steps=2, save_steps=1),
                            train_dataset=run.TokenData())
    with pytest.raises(ckptio.UnsupportedPathError) as err:
        trainer.train()
    text = str(err.value)
    assert f"output_dir={url!r}" in text and "local or mounted directory" in text, text
    assert trainer.state.global_step == 0
    assert not list(shm_root.iterdir())
    assert not list(tmp_path.glob("**/checkpoint-*"))  # transformers' folder "shm:" stays empty


def test_hf_trainer_frees_its_staging_pool_and_io_threads_when_train_returns(
        tmp_path: Path) -> None:
    run = _hf()
    from ckptio.hf_trainer import CkptioTrainer

    ckptio.shared.checkpointer().close()  # the process-wide one: no threads of its own now
    before = _io_threads()
    trainer = CkptioTrainer(model=run.tiny_model(),
                            args=run.training_args(str(tmp_path / "out"), max_steps=2,
                                                   save_steps=1),
                            train_dataset=run.TokenData())
    trainer.train()
    assert (tmp_path / "out" / "checkpoint-2" / "ckptio" / "manifest.json").exists()
    left = {t.name for t in _io_threads() - before}
    assert not left, f"ckptio threads left running after train(): {sorted(left)}"
    resumed = CkptioTrainer(model=run.tiny_model(),
                            args=run.training_args(str(tmp_path / "out"), max_steps=3,
                                                   save_steps=1),
                            train_dataset=run.TokenData())
    resumed.train(resume_from_checkpoint=True)  # a later train() makes a Checkpointer again
    assert resumed.state.global_step == 3
    assert not {t.name for t in _io_threads() - before}


@pytest.mark.parametrize("kind", ["CheckpointIO", "AsyncCheckpointIO"])
def test_lightning_saves_resumes_and_removes_a_checkpoint_in_host_memory(
        shm_root: Path, kind: str) -> None:
    L = pytest.importorskip("lightning")
    import ckptio.lightning
    from tests.integrations.lightning_job import OPTIONS, Tiny, data

    quiet = {"enable_progress_bar": False, "logger": False, "enable_model_summary": False,
             "accelerator": "cpu", "devices": 1, "num_sanity_val_steps": 0,
             "enable_checkpointing": False}
    plugin = getattr(ckptio.lightning, kind)(OPTIONS)
    trainer = L.Trainer(max_epochs=1, plugins=[plugin], **quiet)
    torch.manual_seed(0)
    trainer.fit(Tiny(), data(32, 1))
    trainer.save_checkpoint("shm://run/epoch=0-step=8.ckpt")
    if kind == "AsyncCheckpointIO":  # after fit's teardown: nothing else waits for it
        plugin.wait()
    resumed = L.Trainer(max_epochs=2, plugins=[getattr(ckptio.lightning, kind)(OPTIONS)],
                        **quiet)
    resumed.fit(Tiny(), data(32, 1), ckpt_path="shm://run/epoch=0-step=8.ckpt")
    assert resumed.global_step == 16
    plugin.remove_checkpoint("shm://run/epoch=0-step=8.ckpt")  # used to be refused as not local
    plugin.teardown()  # and lets go of the run lease its save took
    assert os.listdir(shm_root / "run") == []


def test_async_top_k_removal_waits_for_the_save_that_replaces_it(tmp_path: Path) -> None:
    """What a SIGKILL at the start of step 5 would find on disk: step 4's save still in flight
    (its writes held), and the committed step 2 it replaces still there."""
    L = pytest.importorskip("lightning")
    import ckptio.lightning
    from lightning.pytorch.callbacks import ModelCheckpoint
    from tests.integrations.lightning_job import OPTIONS, Tiny, data

    io = ckptio.lightning.AsyncCheckpointIO(OPTIONS)
    found: list[list[str]] = []
    gate: list[HeldWrites] = []

    class AtStep(L.Callback):  # type: ignore[misc,name-defined]
        def on_train_batch_start(self, trainer: Any, *_: Any) -> None:
            if trainer.global_step == 3:  # the next save (step 4's) is held in flight
                io.wait()
                gate.append(HeldWrites(io.checkpointer))
            if trainer.global_step == 4:
                found.append(sorted(p.name for p in (tmp_path / "ck").iterdir()
                                    if (p / "manifest.json").exists()))
                gate[0].opened.set()

    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=2, save_top_k=1,
                                  save_last="link")
    trainer = L.Trainer(max_steps=6, plugins=[io], callbacks=[AtStep(), checkpoints],
                        enable_progress_bar=False, logger=False, enable_model_summary=False,
                        accelerator="cpu", devices=1)
    torch.manual_seed(0)
    trainer.fit(Tiny(), data(32, 1))
    assert found == [["epoch=0-step=2.ckpt"]], found  # kept while step 4 was in flight
    assert sorted(os.listdir(tmp_path / "ck")) == ["epoch=0-step=6.ckpt", "last.ckpt"]
    assert os.readlink(tmp_path / "ck" / "last.ckpt") == "epoch=0-step=6.ckpt"


def test_async_removal_waiting_for_a_save_that_fails_keeps_the_older_checkpoint(
        tmp_path: Path) -> None:
    import ckptio.lightning
    from ckptio.testing.faults import inject

    io = ckptio.lightning.AsyncCheckpointIO()
    io.save_checkpoint({"w": torch.ones(10), "global_step": 2}, tmp_path / "a.ckpt")
    io.wait()
    inject(io.checkpointer, fail_write=1)
    io.save_checkpoint({"w": torch.ones(10), "global_step": 4}, tmp_path / "b.ckpt")
    io.remove_checkpoint(tmp_path / "a.ckpt")  # Lightning: b replaces a
    with pytest.raises(ckptio.StorageIOError, match="injected fault"):
        io.teardown()
    assert io.load_checkpoint(tmp_path / "a.ckpt")["global_step"] == 2
    io.remove_checkpoint(tmp_path / "a.ckpt")  # nothing in flight: removed at once
    assert not (tmp_path / "a.ckpt").exists()


HOLDER = """
import sys
from ckptio.storage.local import runlease
lease = runlease.take(sys.argv[1], False, create=True)
print("held", flush=True)
sys.stdin.read()
lease.release()
"""


def test_hf_a_second_job_on_one_output_dir_is_refused_before_it_trains(tmp_path: Path) -> None:
    run = _hf()
    from ckptio.hf_trainer import CkptioTrainer

    out = tmp_path / "out"
    out.mkdir()
    other = subprocess.Popen([sys.executable, "-c", HOLDER, str(out)], text=True,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        assert other.stdout is not None and other.stdout.readline() == "held\n"
        trainer = CkptioTrainer(model=run.tiny_model(),
                                args=run.training_args(str(out), max_steps=2, save_steps=1),
                                train_dataset=run.TokenData())
        with pytest.raises(ckptio.CheckpointLockedError) as err:
            trainer.train()
        text = str(err.value)
        assert str(out) in text and f"pid {other.pid}" in text, text
        assert "this CkptioTrainer did not train" in text and "CheckpointManager" not in text
        assert trainer.state.global_step == 0 and not list(out.glob("checkpoint-*"))
    finally:
        other.communicate("", timeout=30)
    trainer.train()  # the other job is gone: this one trains, and lets go when train() ends
    assert (out / "checkpoint-2" / "ckptio" / "manifest.json").exists()
    assert not (out / ".ckptio-run.lease").exists()
