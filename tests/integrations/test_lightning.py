"""ckptio.lightning through Lightning's real Trainer (CPU, a tiny model, seconds per run).

- A run killed with SIGKILL after a checkpoint committed, resumed in a fresh process from
  ``ckpt_path="last"`` and from an explicit path, continues with losses bitwise equal to an
  uninterrupted run's (sync and async plugins; every run is its own process, run side by side,
  forked from one that imported Lightning once: lightning_job.run_forked);
  a two-rank DDP run (gloo) resumes from a one-process checkpoint and saves from rank 0 alone.
- ModelCheckpoint's top-k with a monitor keeps exactly the k best ckptio checkpoints on disk,
  its "last" link resolves, and removal leaves nothing half-deleted.
- The async plugin returns while its write is held (the loop goes on), raises a failed save
  once (next save, or teardown), and every damaged checkpoint is a CkptError.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lightning")

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import ckptio
import ckptio.lightning
from ckptio.testing.faults import inject

sys.path.insert(0, str(Path(__file__).parent))
from lightning_job import STEPS_PER_EPOCH, Tiny, data, plugin, read_losses

ROOT = Path(__file__).resolve().parents[2]
JOB = Path(__file__).parent / "lightning_job.py"
FINAL_STEP = 4 * STEPS_PER_EPOCH  # 4 epochs
KILL_AT = 20  # in epoch 2: epochs 0 and 1 are checkpointed (steps 8 and 16)
DDP_KILL_AT = 10  # two ranks: epoch 2 too (epochs 0 and 1 checkpointed at steps 4 and 8)
QUIET = {"enable_progress_bar": False, "logger": False, "enable_model_summary": False,
         "accelerator": "cpu", "devices": 1, "num_sanity_val_steps": 0}


def _run_all(specs: dict[str, dict[str, Any]], logs: Path) -> dict[str, tuple[int, str]]:
    """Every spec at once, each its own process forked from one that imported Lightning, torch
    and ckptio (lightning_job.run_forked) -> {name: (exit code, output)}."""
    logs.mkdir(exist_ok=True)
    done = subprocess.run([sys.executable, str(JOB), "--forked", json.dumps(specs), str(logs)],
                          cwd=ROOT, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, timeout=480)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    codes = json.loads(done.stdout.splitlines()[-1])
    assert set(codes) == set(specs), (codes, done.stderr[-3000:])
    return {name: (codes[name], (logs / f"{name}.log").read_text()) for name in specs}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every process the resume tests compare, two phases of concurrent runs: an uninterrupted
    run and a sync and an async run killed at step 20, a two-rank DDP run with the async plugin
    and one killed at step 10; then the resumes: sync from "last", sync from epoch 0's path (a
    copy of the killed run's directory), async from "last", a two-rank DDP run from the
    uninterrupted run's epoch 1, and the killed DDP run from "last"."""
    base = tmp_path_factory.mktemp("lightning")
    spec = {name: {"dir": str(base / name), "losses": str(base / f"{name}.losses")}
            for name in ("reference", "sync", "async", "ddp-reference", "ddp-async")}
    spec["sync"]["kill_at"] = spec["async"]["kill_at"] = KILL_AT
    spec["async"].update(plugin="async", committed=str(base / "async" / "epoch=0-step=8.ckpt"))
    for name in ("ddp-reference", "ddp-async"):  # two ranks: 4 steps an epoch
        spec[name].update(devices=2, plugin="async", rng=True)
    spec["ddp-async"].update(kill_at=DDP_KILL_AT,
                             committed=str(base / "ddp-async" / "epoch=0-step=4.ckpt"))
    killed = _run_all(spec, base / "logs")
    shutil.copytree(base / "sync", base / "sync-path", symlinks=True)
    shutil.copytree(base / "reference" / "epoch=1-step=16.ckpt", base / "from-1-process")
    resumes = {
        "sync-last": {"dir": str(base / "sync"), "ckpt_path": "last"},
        "sync-path": {"dir": str(base / "sync-path"),
                      "ckpt_path": str(base / "sync-path" / "epoch=0-step=8.ckpt")},
        "async-last": {"dir": str(base / "async"), "ckpt_path": "last", "plugin": "async"},
        "ddp": {"dir": str(base / "ddp"), "ckpt_path": str(base / "from-1-process"),
                "devices": 2, "top_k": 1},
        "ddp-async-last": {"dir": str(base / "ddp-async"), "ckpt_path": "last", "devices": 2,
                           "plugin": "async", "rng": True},
    }
    for name, s in resumes.items():
        s["losses"] = str(base / f"{name}.losses")
    resumed = _run_all(resumes, base / "logs")
    return {"base": base, "exit": {**killed, **resumed},
            "losses": {name: read_losses(base / f"{name}.losses")
                       for name in [*spec, *resumes]}}


def _assert_bitwise_from(losses: dict[int, str], reference: dict[int, str], first: int,
                         end: int = FINAL_STEP) -> None:
    """Steps first..end-1 were run, each with the uninterrupted run's loss, bit for bit."""
    assert sorted(losses) == list(range(first, end)), sorted(losses)
    different = [step for step in losses if losses[step] != reference[step]]
    assert not different, f"steps {different} differ from the uninterrupted run"


def test_sigkill_then_resume_from_last_and_from_a_path_is_bitwise(runs: dict[str, Any]) -> None:
    exits, losses = runs["exit"], runs["losses"]
    assert exits["reference"][0] == 0, exits["reference"][1][-3000:]
    assert exits["sync"][0] == -9, exits["sync"][1][-3000:]  # SIGKILL, at step 20
    for name in ("sync-last", "sync-path"):
        assert exits[name][0] == 0, exits[name][1][-3000:]
    reference = losses["reference"]
    assert sorted(reference) == list(range(FINAL_STEP))
    _assert_bitwise_from(losses["sync"], reference, 0, KILL_AT)
    _assert_bitwise_from(losses["sync-last"], reference, 2 * STEPS_PER_EPOCH)  # last.ckpt: 16
    _assert_bitwise_from(losses["sync-path"], reference, STEPS_PER_EPOCH)  # epoch=0-step=8
    assert "Restored all states from the checkpoint at" in exits["sync-last"][1]
    for name in ("epoch=1-step=16.ckpt", "last.ckpt", "epoch=3-step=32.ckpt"):
        ckpt = runs["base"] / "sync" / name
        assert ckpt.is_dir() and (ckpt / "manifest.json").is_file(), name  # ckptio's
        assert ckptio.verify(ckpt) > 0
    resumed_last = ckptio.load(runs["base"] / "sync" / "last.ckpt")
    assert resumed_last["global_step"] == FINAL_STEP and resumed_last["epoch"] == 3


def test_async_plugin_sigkill_then_resume_is_bitwise(runs: dict[str, Any]) -> None:
    """Killed at step 20 with epoch 0 committed (the script checks) and epoch 1's saves perhaps
    still in flight: "last" is whichever last.ckpt committed (8 or 16), never a torn one."""
    exits, losses = runs["exit"], runs["losses"]
    assert exits["async"][0] == -9, exits["async"][1][-3000:]
    assert exits["async-last"][0] == 0, exits["async-last"][1][-3000:]
    _assert_bitwise_from(losses["async"], losses["reference"], 0, KILL_AT)
    first = min(losses["async-last"])
    assert first in (STEPS_PER_EPOCH, 2 * STEPS_PER_EPOCH), first
    _assert_bitwise_from(losses["async-last"], losses["reference"], first)
    assert ckptio.load(runs["base"] / "async" / "last.ckpt")["global_step"] == FINAL_STEP


# ------------------------------------------------------------------------------------------------
# in this process: ModelCheckpoint's top-k, the async plugin's timing and errors, damage


class Scored(Tiny):
    """Logs a fixed, non-monotonic ``score`` per epoch, so top-k both skips and removes."""

    SCORES = (0.5, 0.2, 0.9, 0.1, 0.7)

    def on_validation_epoch_end(self) -> None:
        self.log("score", self.SCORES[self.current_epoch])


def _fit(tmp: Path, io: Any, *, epochs: int, callbacks: list[Any], model: Any = None,
         ckpt_path: str | None = None, **kwargs: Any) -> L.Trainer:
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(max_epochs=epochs, plugins=[io] if io is not None else None,
                        callbacks=callbacks,
                        default_root_dir=tmp, **QUIET, **kwargs)
    trainer.fit(model or Tiny(), data(4 * STEPS_PER_EPOCH, seed=1), data(8, seed=2),
                ckpt_path=ckpt_path)
    return trainer


@pytest.mark.parametrize("mode", ["sync", "async"])  # async: removals once the next commits
def test_top_k_with_monitor_keeps_exactly_the_k_best(tmp_path: Path, mode: str) -> None:
    ckpts = tmp_path / "ckpts"
    best = ModelCheckpoint(dirpath=ckpts, monitor="score", mode="min", save_top_k=2,
                           save_last="link")
    _fit(tmp_path, plugin(mode), epochs=5, callbacks=[best], model=Scored())
    # scores 0.5 0.2 0.9 0.1 0.7: epoch 2 and 4 never saved, epoch 0 removed once epoch 3 came
    kept = {"epoch=1-step=16.ckpt", "epoch=3-step=32.ckpt"}
    assert set(os.listdir(ckpts)) == kept | {"last.ckpt"}, os.listdir(ckpts)
    assert {Path(p).name for p in best.best_k_models} == kept
    for name in kept:
        assert (ckpts / name / "manifest.json").is_file() and ckptio.verify(ckpts / name) > 0
    assert (ckpts / "last.ckpt").is_symlink()
    assert os.path.realpath(ckpts / "last.ckpt") == str(ckpts / "epoch=3-step=32.ckpt")
    assert Path(best.best_model_path).name == "epoch=3-step=32.ckpt"
    # "last" resolves through the link, and the plugin reads the directory behind it
    trainer = L.Trainer(plugins=[plugin("sync")], callbacks=[
        ModelCheckpoint(dirpath=ckpts, save_last="link")], **QUIET)
    validated = trainer.validate(Scored(), data(8, seed=2), ckpt_path="last", verbose=False)
    assert trainer.ckpt_path == str(ckpts / "last.ckpt")
    stored = ckptio.load(ckpts / "epoch=3-step=32.ckpt")
    model = Scored()
    model.load_state_dict(stored["state_dict"])
    x, y = data(8, seed=2).dataset.tensors
    expected = torch.nn.functional.mse_loss(model.net(x), y).item()
    assert validated[0]["val_loss"] == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_save_last_every_epoch_replaces_last_ckpt_without_a_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, mode: str) -> None:
    """Lightning saves over last.ckpt every epoch on purpose: replaced as asked (logged at
    INFO), not warned about three times."""
    ckpts = tmp_path / "ckpts"
    with caplog.at_level(logging.INFO, logger="ckptio"):
        _fit(tmp_path, plugin(mode), epochs=3,
             callbacks=[ModelCheckpoint(dirpath=ckpts, save_last=True)])
    ckptio_records = [r for r in caplog.records if r.name == "ckptio"]
    assert [r.getMessage() for r in ckptio_records if r.levelno >= logging.WARNING] == []
    assert sum("replaced the checkpoint" in r.getMessage() for r in ckptio_records) == 2
    assert ckptio.load(ckpts / "last.ckpt", keys=["global_step"])["global_step"] == 3 * STEPS_PER_EPOCH


def test_save_at_a_symlink_replaces_the_link_not_its_target(tmp_path: Path) -> None:
    io = plugin("sync")
    io.save_checkpoint({"w": torch.ones(3), "step": 1}, tmp_path / "epoch=0.ckpt")
    os.symlink("epoch=0.ckpt", tmp_path / "last.ckpt")
    io.save_checkpoint({"w": torch.zeros(3), "step": 2}, tmp_path / "last.ckpt")
    assert not (tmp_path / "last.ckpt").is_symlink()
    assert io.load_checkpoint(tmp_path / "epoch=0.ckpt")["step"] == 1  # untouched
    assert io.load_checkpoint(tmp_path / "last.ckpt")["step"] == 2
    # a removal killed after its rename left a hidden directory: the next removal finishes it
    io.save_checkpoint({"w": torch.zeros(3)}, tmp_path / ".deleting-epoch=9.ckpt-0123abcd")
    io.remove_checkpoint(tmp_path / "last.ckpt")
    io.remove_checkpoint(tmp_path / "gone.ckpt")  # nothing there: nothing to do
    io.teardown()  # lets go of the run lease of tmp_path, taken at the first save
    assert os.listdir(tmp_path) == ["epoch=0.ckpt"]
    with pytest.raises(ckptio.UnsupportedPathError, match="nope://b/epoch=0.ckpt"):
        io.remove_checkpoint("nope://b/epoch=0.ckpt")  # s3:// ones: tests/s3/test_rt_plugins_s3


class _Gate:
    """Holds every write of a Checkpointer's saves until opened (test_async.py's way)."""

    def __init__(self, ck: ckptio.Checkpointer) -> None:
        self.opened = threading.Event()
        backend = inject(ck)
        passing = backend.submit_write

        def held(*args: Any, **kwargs: Any) -> Any:
            self.opened.wait(60)
            return passing(*args, **kwargs)

        backend.submit_write = held


class _Watch(L.Callback):
    """At each batch end, records the save the async plugin still has in flight and lets it
    go: its writes are held until then, so if the plugin waited for them, no batch would end
    with one in flight (the gate lets go after 60 s and the test fails)."""

    def __init__(self, io: ckptio.lightning.AsyncCheckpointIO, gate: _Gate) -> None:
        self.io, self.gate, self.seen = io, gate, []

    def on_train_batch_end(self, trainer: L.Trainer, *_args: Any) -> None:
        path = self.io.in_flight()
        if path is not None:
            self.seen.append((trainer.global_step, Path(path).name))
            self.gate.opened.set()


def test_async_save_returns_before_its_write_and_is_waited_for_at_teardown(
        tmp_path: Path) -> None:
    io = plugin("async")
    gate = _Gate(io.checkpointer)
    watch = _Watch(io, gate)
    every = ModelCheckpoint(dirpath=tmp_path / "ckpts", every_n_train_steps=3, save_top_k=-1)
    _fit(tmp_path, io, epochs=1, callbacks=[watch, every], max_steps=4)
    # saved at the end of step 3 (ModelCheckpoint runs after _Watch), seen in flight at step 4
    assert watch.seen == [(4, "epoch=0-step=3.ckpt")], watch.seen
    assert io.in_flight() is None  # teardown waited
    assert ckptio.load(tmp_path / "ckpts" / "epoch=0-step=3.ckpt")["global_step"] == 3



def test_async_removing_the_path_in_flight_waits_for_its_save(tmp_path: Path) -> None:
    """The removal renames the directory away: done under a save still writing there, that save
    would fail. It waits for it instead (the gate opens from another thread, 0.3 s later)."""
    io = plugin("async")
    gate = _Gate(io.checkpointer)
    io.save_checkpoint({"w": torch.ones(1000), "step": 1}, tmp_path / "a.ckpt")
    assert io.in_flight() is not None
    threading.Timer(0.3, gate.opened.set).start()
    io.remove_checkpoint(tmp_path / "a.ckpt")
    assert gate.opened.is_set() and io.in_flight() is None
    io.teardown()  # the save committed before its removal: no error to raise
    assert os.listdir(tmp_path) == []  # removed, nothing hidden left behind (nor the lease)

def test_async_failed_save_is_raised_once_by_the_next_save_and_at_teardown(
        tmp_path: Path) -> None:
    io = plugin("async")
    faults = inject(io.checkpointer, fail_write=1)
    every = ModelCheckpoint(dirpath=tmp_path / "a", save_top_k=-1)
    with pytest.raises(ckptio.StorageIOError, match="injected fault") as caught:
        _fit(tmp_path, io, epochs=2, callbacks=[every])
    assert faults.injected and "epoch=0-step=8.ckpt" in str(caught.value)
    assert not (tmp_path / "a" / "epoch=0-step=8.ckpt" / "manifest.json").exists()
    # raised once: the same plugin's next fit saves and commits
    _fit(tmp_path, io, epochs=1, callbacks=[ModelCheckpoint(dirpath=tmp_path / "b")])
    assert ckptio.verify(tmp_path / "b" / "epoch=0-step=8.ckpt") > 0
    # the only save of a fit fails: raised at teardown, when fit ends
    inject(io.checkpointer, fail_write=1)
    with pytest.raises(ckptio.StorageIOError, match="injected fault"):
        _fit(tmp_path, io, epochs=1, callbacks=[ModelCheckpoint(dirpath=tmp_path / "c")])



def test_async_error_raised_by_the_next_save_is_not_raised_again(tmp_path: Path) -> None:
    io = plugin("async")
    inject(io.checkpointer, fail_write=1)
    io.save_checkpoint({"w": torch.ones(10), "step": 1}, tmp_path / "a.ckpt")
    with pytest.raises(ckptio.StorageIOError, match="injected fault"):
        io.save_checkpoint({"w": torch.ones(10), "step": 2}, tmp_path / "b.ckpt")
    assert io.wait() is None and io.in_flight() is None
    io.remove_checkpoint(tmp_path / "a.ckpt")  # the failed save's leftovers, if any
    io.save_checkpoint({"w": torch.ones(10), "step": 2}, tmp_path / "b.ckpt")
    io.teardown()
    assert io.load_checkpoint(tmp_path / "b.ckpt")["step"] == 2

@pytest.fixture(scope="module")
def one_epoch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ckptio checkpoint written by a real one-epoch fit."""
    tmp = tmp_path_factory.mktemp("one-epoch")
    _fit(tmp, plugin("sync"), epochs=1, callbacks=[ModelCheckpoint(dirpath=tmp / "ckpts")])
    return tmp / "ckpts" / "epoch=0-step=8.ckpt"


def _flip_data_byte(ckpt: Path) -> None:
    data_file = next(ckpt.glob("data-*"))
    raw = bytearray(data_file.read_bytes())
    raw[100] ^= 0xFF
    data_file.write_bytes(bytes(raw))


def _truncate_manifest(ckpt: Path) -> None:
    manifest = ckpt / "manifest.json"
    manifest.write_bytes(manifest.read_bytes()[:200])


def _remove_manifest(ckpt: Path) -> None:
    (ckpt / "manifest.json").unlink()


@pytest.mark.parametrize(("damage", "error"), [
    (_flip_data_byte, ckptio.CorruptCheckpointError),
    (_truncate_manifest, ckptio.ManifestError),
    (_remove_manifest, ckptio.IncompleteCheckpointError),
    (shutil.rmtree, ckptio.CheckpointNotFoundError),
])
def test_a_damaged_checkpoint_is_a_ckpt_error(tmp_path: Path, one_epoch: Path, damage: Any,
                                               error: type[Exception]) -> None:
    ckpt = tmp_path / one_epoch.name
    shutil.copytree(one_epoch, ckpt)
    damage(ckpt)
    with pytest.raises(error, match=str(ckpt).replace("=", ".")):
        _fit(tmp_path, plugin("sync"), epochs=2, callbacks=[], enable_checkpointing=False,
             ckpt_path=str(ckpt))


def test_resume_from_last_passes_over_an_uncommitted_last_to_the_newest_committed(
        tmp_path: Path) -> None:
    """A job killed during its first save of last.ckpt leaves it uncommitted (no manifest):
    ``ckpt_path="last"`` resumes from the newest committed checkpoint beside it, warning,
    instead of raising (an explicit path to an uncommitted checkpoint still raises: above).
    The newest is the furthest step, not the latest file time (step 8's folder copied after
    step 16's was chosen before)."""
    ckpts = tmp_path / "ckpts"
    every = ModelCheckpoint(dirpath=ckpts, save_top_k=-1, save_last=True)
    _fit(tmp_path, plugin("sync"), epochs=2, callbacks=[every])
    assert sorted(os.listdir(ckpts)) == ["epoch=0-step=8.ckpt", "epoch=1-step=16.ckpt",
                                         "last.ckpt"]
    _remove_manifest(ckpts / "last.ckpt")
    later = (ckpts / "epoch=1-step=16.ckpt" / "manifest.json").stat().st_mtime + 60
    os.utime(ckpts / "epoch=0-step=8.ckpt" / "manifest.json", (later, later))  # copied later
    with pytest.warns(UserWarning, match=r"last\.ckpt was never committed .* resuming from "
                      r".*epoch=1-step=16\.ckpt"):
        trainer = _fit(tmp_path, plugin("sync"), epochs=3, ckpt_path="last",
                       callbacks=[ModelCheckpoint(dirpath=ckpts, save_top_k=-1, save_last=True)])
    assert trainer.global_step == 3 * STEPS_PER_EPOCH  # one epoch after step 16


def test_load_from_checkpoint_for_inference_reads_a_ckptio_checkpoint(one_epoch: Path) -> None:
    """Lightning's load_from_checkpoint calls torch.load, which cannot read a ckptio checkpoint
    (a directory); ckptio.lightning.load_from_checkpoint runs Lightning's same steps with the
    plugin's read: the model, its hyper-parameters, kwargs overriding them."""
    import lightning.pytorch.core.saving as saving

    with pytest.raises(IsADirectoryError):
        Tiny.load_from_checkpoint(one_epoch)
    original = saving.pl_load
    model = ckptio.lightning.load_from_checkpoint(Tiny, one_epoch, map_location="cpu", lr=0.5)
    assert saving.pl_load is original  # put back
    stored = ckptio.load(one_epoch)
    assert isinstance(model, Tiny) and model.hparams.width == 16 and model.hparams.lr == 0.5
    state = model.state_dict()
    assert state.keys() == stored["state_dict"].keys()
    assert all(torch.equal(state[k], v) for k, v in stored["state_dict"].items())
    with pytest.raises(RuntimeError, match="size mismatch"):  # strict, as Lightning's
        ckptio.lightning.load_from_checkpoint(Tiny, one_epoch, width=8)
    assert saving.pl_load is original


def test_python_objects_need_allow_pickle_both_ways(tmp_path: Path, one_epoch: Path) -> None:
    checkpoint = ckptio.load(one_epoch)
    checkpoint["hyper_parameters"]["data_dir"] = pathlib.Path("/data")
    with pytest.raises(ckptio.UnsupportedStateError,
                       match=r"hyper_parameters\.data_dir.*CheckpointIO\(allow_pickle=True\)"):
        plugin("sync").save_checkpoint(checkpoint, tmp_path / "a.ckpt")
    assert not (tmp_path / "a.ckpt" / "manifest.json").exists()
    with pytest.raises(ckptio.UnsupportedStateError,  # the class the user made
                       match=r"ckptio\.lightning\.AsyncCheckpointIO\(allow_pickle=True\)"):
        plugin("async").save_checkpoint(checkpoint, tmp_path / "a.ckpt")
    plugin("sync", allow_pickle=True).save_checkpoint(checkpoint, tmp_path / "a.ckpt")
    with pytest.raises(ckptio.PickleRefusedError, match="hyper_parameters.data_dir"):
        plugin("sync").load_checkpoint(tmp_path / "a.ckpt")
    with pytest.raises(ckptio.PickleRefusedError):  # Lightning's weights_only=True wins
        plugin("sync", allow_pickle=True).load_checkpoint(tmp_path / "a.ckpt", weights_only=True)
    back = plugin("sync", allow_pickle=True).load_checkpoint(tmp_path / "a.ckpt")
    assert back["hyper_parameters"]["data_dir"] == pathlib.Path("/data")


def test_map_location_a_device_moves_the_tensors_anything_else_is_refused(one_epoch: Path) -> None:
    moved = plugin("sync").load_checkpoint(one_epoch, map_location="meta")
    assert all(t.device.type == "meta" for t in moved["state_dict"].values())
    assert moved["optimizer_states"][0]["state"][0]["exp_avg"].device.type == "meta"
    with pytest.raises(ckptio.CkptError, match="map_location"):
        plugin("sync").load_checkpoint(one_epoch, map_location={"cuda:0": "cpu"})


def test_resume_from_a_torch_save_ckpt_of_lightnings_own_plugin(tmp_path: Path) -> None:
    """Switching plugins mid-run: a .ckpt file TorchCheckpointIO wrote loads through ckptio
    (its pickle decoded with an allow-list), and training goes on into ckptio checkpoints."""
    _fit(tmp_path, None, epochs=1, callbacks=[ModelCheckpoint(dirpath=tmp_path / "torch")])
    old = tmp_path / "torch" / "epoch=0-step=8.ckpt"
    assert old.is_file()
    _fit(tmp_path, plugin("sync"), epochs=2, callbacks=[ModelCheckpoint(dirpath=tmp_path / "c")],
         ckpt_path=str(old))
    assert ckptio.load(tmp_path / "c" / "epoch=1-step=16.ckpt")["global_step"] == 16


def test_a_switch_in_the_same_dirpath_replaces_lightnings_own_last_ckpt(tmp_path: Path) -> None:
    """Resumed from the ``last.ckpt`` file TorchCheckpointIO wrote, with ``save_last=True`` in
    the same dirpath: the next save of ``last.ckpt`` replaces that file by a ckptio checkpoint
    (it was refused: "exists and is not a directory")."""
    ckpts = tmp_path / "ckpts"
    _fit(tmp_path, None, epochs=1, callbacks=[ModelCheckpoint(dirpath=ckpts, save_last=True)])
    assert (ckpts / "last.ckpt").is_file()
    _fit(tmp_path, plugin("sync"), epochs=2,
         callbacks=[ModelCheckpoint(dirpath=ckpts, save_last=True)], ckpt_path="last")
    assert ckptio.load(ckpts / "last.ckpt", keys=["global_step"])["global_step"] == 16


_HOLDER = """
import sys, torch, ckptio.lightning
io = ckptio.lightning.CheckpointIO()
io.save_checkpoint({"w": torch.ones(1)}, sys.argv[1] + "/a.ckpt")
print("SAVED", flush=True)
sys.stdin.read()
"""


def test_a_locked_dirpath_names_the_async_plugin_in_its_take_over_fix(tmp_path: Path) -> None:
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(tmp_path)], cwd=ROOT,
                              env={**os.environ, "PYTHONPATH": str(ROOT)}, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "SAVED"
        with pytest.raises(ckptio.CheckpointLockedError) as caught:
            plugin("async").save_checkpoint({"w": torch.ones(1)}, tmp_path / "b.ckpt")
        assert "ckptio.lightning.AsyncCheckpointIO(take_over=True)" in str(caught.value)
    finally:
        holder.communicate("", timeout=60)


def test_the_standalone_pytorch_lightning_trainer_takes_the_plugins(tmp_path: Path) -> None:
    """``pytorch_lightning`` (its own CheckpointIO class, from ``lightning_fabric``) accepts
    both plugins: they are registered with its CheckpointIO too; save, resume and top-k work."""
    pl = pytest.importorskip("pytorch_lightning")

    class PlTiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(4, 1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    for io in (plugin("sync"), plugin("async")):
        ckpts = tmp_path / type(io).__name__
        for epochs in (1, 2):  # the second fit resumes from the first's last.ckpt
            trainer = pl.Trainer(max_epochs=epochs, plugins=[io], **QUIET, callbacks=[
                pl.callbacks.ModelCheckpoint(dirpath=ckpts, save_top_k=1, save_last=True)])
            trainer.fit(PlTiny(), data(4 * STEPS_PER_EPOCH, seed=1), ckpt_path="last")
        assert trainer.strategy.checkpoint_io is io
        assert sorted(os.listdir(ckpts)) == ["epoch=1-step=16.ckpt", "last.ckpt"]  # top-1
        assert ckptio.load(ckpts / "last.ckpt")["global_step"] == 16


def test_ddp_two_ranks_resume_and_rank_0_saves_alone(runs: dict[str, Any]) -> None:
    """DDP on CPU (gloo): every rank loads the one-process run's epoch 1, Lightning saves on
    rank 0 only (the plugin's save runs over a group of rank 0 alone: nobody waits for rank 1),
    and top-1 removes the older checkpoint on rank 0."""
    exits, losses = runs["exit"], runs["losses"]
    assert exits["ddp"][0] == 0, exits["ddp"][1][-3000:]
    assert "Restored all states from the checkpoint at" in exits["ddp"][1]
    half = STEPS_PER_EPOCH // 2  # each rank takes half of each epoch's batches
    assert sorted(losses["ddp"]) == list(range(16, 16 + 2 * half))
    ckpts = runs["base"] / "ddp"
    assert sorted(os.listdir(ckpts)) == [f"epoch=3-step={16 + 2 * half}.ckpt", "last.ckpt"]
    for name in os.listdir(ckpts):
        assert ckptio.verify(ckpts / name) > 0
        assert ckptio.load(ckpts / name)["global_step"] == 16 + 2 * half


def test_ddp_async_sigkill_then_resume_from_last_is_bitwise(runs: dict[str, Any]) -> None:
    """Two gloo ranks with AsyncCheckpointIO, both killed at step 10 (epochs 0 and 1 saved,
    the second perhaps still in flight), resumed on two ranks from "last": every loss after
    the resume equals the uninterrupted two-rank run's, bit for bit. RNGStateCallback in these
    runs: the checkpoint holds both ranks' generators (gathered over DDP's group)."""
    exits, losses = runs["exit"], runs["losses"]
    assert exits["ddp-reference"][0] == 0, exits["ddp-reference"][1][-3000:]
    assert exits["ddp-async"][0] != 0  # killed
    assert exits["ddp-async-last"][0] == 0, exits["ddp-async-last"][1][-3000:]
    end = 4 * STEPS_PER_EPOCH // 2
    reference = losses["ddp-reference"]
    assert sorted(reference) == list(range(end))
    _assert_bitwise_from(losses["ddp-async"], reference, 0, DDP_KILL_AT)
    first = min(losses["ddp-async-last"])
    assert first in (STEPS_PER_EPOCH // 2, STEPS_PER_EPOCH), first
    _assert_bitwise_from(losses["ddp-async-last"], reference, first, end)
    last = ckptio.load(runs["base"] / "ddp-async" / "last.ckpt")
    assert last["global_step"] == end
    generators = last["callbacks"]["ckptio.RNGState"]["ranks"]
    assert len(generators) == 2 and all(g["torch"].dtype == torch.uint8 for g in generators)


class _Dropout(Tiny):
    """Tiny with dropout: its losses depend on torch's global generator."""

    def __init__(self, losses: str = "") -> None:
        super().__init__(losses=losses)
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Dropout(0.3),
                                       torch.nn.Linear(16, 1))


def test_resume_of_a_run_with_dropout_is_bitwise_with_the_rng_callback(tmp_path: Path) -> None:
    """Lightning's checkpoint holds no generator state: with dropout, every step after an
    epoch-boundary resume differed from the uninterrupted run's. ckptio.lightning's
    RNGStateCallback saves the generators and restores them when the fit resumes: bitwise."""
    def run(name: str, epochs: int, ckpt_path: str | None = None) -> dict[int, str]:
        losses = tmp_path / f"{name}.losses"
        torch.manual_seed(0)
        _fit(tmp_path, plugin("sync"), epochs=epochs, model=_Dropout(str(losses)),
             ckpt_path=ckpt_path,
             callbacks=[ModelCheckpoint(dirpath=tmp_path / name.split("-")[0], save_last=True),
                        ckptio.lightning.RNGStateCallback()])
        return read_losses(losses)

    reference = run("reference", 2)
    run("resumed-first", 1)
    _assert_bitwise_from(run("resumed-second", 2, ckpt_path="last"), reference,
                         STEPS_PER_EPOCH, 2 * STEPS_PER_EPOCH)
