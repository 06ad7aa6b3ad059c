"""ckptio.hf_trainer: real transformers.Trainer runs (a 2-layer GPT-2 on CPU) saving and resuming
through ckptio.

- A run killed with SIGKILL inside a checkpoint save, resumed in a fresh process with
  ``resume_from_checkpoint=True``, continues with every loss bitwise equal to an uninterrupted
  run's, ends with bitwise equal weights, and unpickles nothing (torch.load fails there).
- ``save_total_limit`` leaves exactly the expected checkpoint-N directories, each complete.
- An explicit checkpoint path resumes; a damaged or incomplete one is a CkptError naming it.
"""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import ckptio

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from ckptio.hf_trainer import CkptioTrainer, checkpoint_problem  # noqa: E402 - needs transformers

from .hf_trainer_run import (  # noqa: E402 - imports transformers, only once it is there
    RecordingHFTrainer,
    RecordingTrainer,
    TokenData,
    tiny_model,
    training_args,
)

ROOT = Path(__file__).resolve().parents[2]
RUN = Path(__file__).with_name("hf_trainer_run.py")
PICKLE_FILES = ("optimizer.pt", "scheduler.pt", "rng_state.pth", "training_args.bin",
                "model.safetensors", "pytorch_model.bin", "scaler.pt")


class Runs:
    """hf_trainer_run.py's runs, each a fresh process forked from one that imported transformers,
    torch and ckptio once (``hf_trainer_run.py --serve``), not a fresh interpreter each."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
        self.server = subprocess.Popen([sys.executable, str(RUN), "--serve"], text=True,
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       env={**os.environ, "PYTHONPATH": path})

    def __enter__(self) -> Runs:
        return self

    def __exit__(self, *exc: object) -> None:
        """End of input: the server kills a run still going (after a failed assert), then ends."""
        self.server.communicate(timeout=60)

    def _send(self, *line: str) -> None:
        assert self.server.stdin is not None
        self.server.stdin.write(json.dumps(line) + "\n")
        self.server.stdin.flush()

    def start(self, name: str, out: Path, losses: Path, *flags: str) -> None:
        self._send("start", name, str(self.tmp / f"{name}.log"), str(out), str(losses), *flags)

    def finish(self, name: str) -> tuple[int, str]:
        """-> (return code, output) once the run ``name`` ends."""
        self._send("wait", name)
        assert self.server.stdout is not None
        ready, _, _ = select.select([self.server.stdout], [], [], 240)
        assert ready, f"the run {name} did not end in 240 s"
        reply = self.server.stdout.readline()
        assert reply, f"hf_trainer_run.py --serve ended: {self.server.wait(timeout=60)}"
        return int(reply), (self.tmp / f"{name}.log").read_text()


def start_ddp(out: Path, losses: Path, *flags: str) -> subprocess.Popen[str]:
    """hf_trainer_run.py on two processes under torchrun: DDP over gloo."""
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                             "2", "--master-port", str(_free_port()), str(RUN), str(out),
                             str(losses), "--ddp", *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": path})


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def finish(proc: subprocess.Popen[str]) -> tuple[int, str]:
    """-> (return code, stderr) once it ends."""
    _, err = proc.communicate(timeout=240)
    return proc.returncode, err


def read_losses(path: Path) -> dict[int, str]:
    steps = [line.split() for line in path.read_text().splitlines()]
    return {int(step): loss for step, loss in steps}


def weights(out: Path) -> dict[str, torch.Tensor]:
    return ckptio.load(out / "final")["model"]


def test_killed_in_a_save_and_resumed_in_a_fresh_process_continues_bitwise(tmp_path):
    with Runs(tmp_path) as runs:
        runs.start("ref", tmp_path / "ref", tmp_path / "ref.txt")  # alongside the others
        runs.start("killed", tmp_path / "run", tmp_path / "killed.txt", "--kill-in-save", "6")
        code, err = runs.finish("killed")
        assert code == -9, err[-3000:]
        ckpt6 = tmp_path / "run" / "checkpoint-6"
        assert (ckpt6 / "ckptio" / "manifest.json").exists()
        assert not (ckpt6 / "trainer_state.json").exists()
        runs.start("resumed", tmp_path / "run", tmp_path / "resumed.txt", "--resume")
        code, err = runs.finish("resumed")
        assert code == 0, err[-3000:]
        assert f"passes over {ckpt6}" in err  # the incomplete newest one, then step 4
        code, err = runs.finish("ref")
        assert code == 0, err[-3000:]

    expected = read_losses(tmp_path / "ref.txt")
    assert sorted(expected) == list(range(1, 9))
    assert read_losses(tmp_path / "killed.txt") == {s: expected[s] for s in range(1, 7)}
    after = read_losses(tmp_path / "resumed.txt")
    assert sorted(after) == [5, 6, 7, 8], after  # resumed from checkpoint-4, not from scratch
    assert after == {s: expected[s] for s in range(5, 9)}
    final, reference = weights(tmp_path / "run"), weights(tmp_path / "ref")
    assert final.keys() == reference.keys()
    for key in reference:
        assert torch.equal(final[key], reference[key]), key

    # checkpoint-6 was saved again over the stale one; every checkpoint is complete and holds
    # no pickle (nor model.safetensors: the weights are in the ckptio checkpoint)
    for step in (2, 4, 6, 8):
        ckpt = tmp_path / "run" / f"checkpoint-{step}"
        assert checkpoint_problem(str(ckpt)) is None, step
        assert not [n for n in PICKLE_FILES if (ckpt / n).exists()], sorted(os.listdir(ckpt))
        assert (ckpt / "config.json").exists()
    held = ckptio.load(tmp_path / "run" / "checkpoint-8" / "ckptio", keys=["parts"])["parts"]
    assert held == ["model", "optimizer", "rng", "scheduler"]


def test_ddp_on_two_gloo_processes_killed_in_a_save_resumes_bitwise(tmp_path):
    """DDP over gloo, two processes under torchrun: every checkpoint is one ckptio checkpoint
    saved by both processes together (the replicated model and optimizer once, each process's
    generators as its own), killed inside checkpoint-4's save, resumed on two processes from
    checkpoint-2 with no pickle: both processes' losses and the final weights bitwise equal to
    an uninterrupted two-process run's."""
    code, err = finish(start_ddp(tmp_path / "ref", tmp_path / "ref.txt"))
    assert code == 0, err[-3000:]
    code, err = finish(start_ddp(tmp_path / "run", tmp_path / "killed.txt", "--kill-in-save", "4"))
    assert code != 0, err[-3000:]
    assert not (tmp_path / "run" / "checkpoint-4" / "trainer_state.json").exists()
    code, err = finish(start_ddp(tmp_path / "run", tmp_path / "resumed.txt", "--resume"))
    assert code == 0, err[-3000:]
    for suffix in ("", ".r1"):  # the main process's losses, then the other's
        expected = read_losses(tmp_path / f"ref.txt{suffix}")
        assert sorted(expected) == list(range(1, 9))
        after = read_losses(tmp_path / f"resumed.txt{suffix}")
        assert after == {s: expected[s] for s in range(3, 9)}, suffix  # from checkpoint-2
    final, reference = weights(tmp_path / "run"), weights(tmp_path / "ref")
    assert all(torch.equal(final[key], reference[key]) for key in reference)
    ckpt = str(tmp_path / "run" / "checkpoint-8" / "ckptio")
    listing = subprocess.run([sys.executable, "-m", "ckptio", "ls", ckpt], capture_output=True,
                             text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}).stdout
    assert "by 2 rank(s)" in listing and re.search(r"^  rng\* ", listing, re.M), listing


@pytest.fixture(scope="module")
def rotated(tmp_path_factory):
    """A 5-step in-process run saving every step with save_total_limit=2: (output dir, the
    losses it logged)."""
    out = tmp_path_factory.mktemp("rotated")
    transformers.set_seed(0)
    trainer = RecordingTrainer(model=tiny_model(), losses=str(out / "losses.txt"),
                               args=training_args(str(out), max_steps=5, save_steps=1,
                                                  save_total_limit=2), train_dataset=TokenData())
    trainer.train()
    return out, read_losses(out / "losses.txt")


def trainer_for(out: Path, eval_dataset: TokenData | None = None, *, allow_pickle: bool = False,
                **overrides) -> CkptioTrainer:
    transformers.set_seed(0)
    return RecordingTrainer(model=tiny_model(), losses=str(out / "more-losses.txt"),
                            args=training_args(str(out), **overrides), train_dataset=TokenData(),
                            eval_dataset=eval_dataset, allow_pickle=allow_pickle)


def copy_run(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.txt"))
    return dst


def test_save_total_limit_keeps_exactly_the_newest_checkpoints(rotated):
    out, _ = rotated
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["checkpoint-4", "checkpoint-5"]
    assert transformers.trainer_utils.get_last_checkpoint(str(out)) == str(out / "checkpoint-5")
    for name in ("checkpoint-4", "checkpoint-5"):
        assert checkpoint_problem(str(out / name)) is None
        assert ckptio.verify(out / name / "ckptio") > 0


def test_an_explicit_checkpoint_path_resumes(rotated, tmp_path):
    out, losses = rotated
    run_dir = copy_run(out, tmp_path / "run")
    trainer = trainer_for(run_dir, max_steps=5, save_steps=10)
    trainer.train(resume_from_checkpoint=str(run_dir / "checkpoint-4"))
    assert read_losses(run_dir / "more-losses.txt") == {5: losses[5]}


def flip_a_byte(ckpt: Path) -> Path:
    (data,) = (ckpt / "ckptio").glob("data-*.bin")
    with open(data, "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    return data


def test_damaged_data_is_a_corrupt_checkpoint_error_naming_the_file(rotated, tmp_path):
    run_dir = copy_run(rotated[0], tmp_path / "run")
    data = flip_a_byte(run_dir / "checkpoint-5")
    with pytest.raises(ckptio.CorruptCheckpointError, match=data.name):
        trainer_for(run_dir).train(resume_from_checkpoint=True)
    assert ckptio.verify(run_dir / "checkpoint-4" / "ckptio") > 0  # the older one untouched


@pytest.mark.parametrize(("damage", "error", "says"), [
    ("truncated trainer_state.json", ckptio.CorruptCheckpointError,
     "has a trainer_state.json that cannot be read"),
    ("no trainer_state.json", ckptio.CorruptCheckpointError, "has no trainer_state.json"),
    ("no manifest", ckptio.IncompleteCheckpointError, "that never committed"),
    ("no ckptio checkpoint", ckptio.CheckpointNotFoundError, "holds no ckptio checkpoint"),
])
def test_an_incomplete_checkpoint_is_refused_by_path_and_passed_over_by_true(
        rotated, tmp_path, damage, error, says):
    out, losses = rotated
    run_dir = copy_run(out, tmp_path / "run")
    ckpt5 = run_dir / "checkpoint-5"
    if damage == "truncated trainer_state.json":
        state = ckpt5 / "trainer_state.json"
        state.write_text(state.read_text()[:40])
    elif damage == "no trainer_state.json":
        (ckpt5 / "trainer_state.json").unlink()
    elif damage == "no manifest":
        (ckpt5 / "ckptio" / "manifest.json").unlink()
    else:
        shutil.rmtree(ckpt5 / "ckptio")
    with pytest.raises(error, match=re.escape(f"cannot resume from {ckpt5}: it ") + ".*"
                       + re.escape(says)):
        trainer_for(run_dir).train(resume_from_checkpoint=str(ckpt5))

    trainer = trainer_for(run_dir, max_steps=5, save_steps=10)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train(resume_from_checkpoint=True)  # falls back to checkpoint-4
    passed = [str(w.message) for w in caught if "passes over" in str(w.message)]
    assert len(passed) == 1 and str(ckpt5) in passed[0] and says in passed[0], passed
    assert read_losses(run_dir / "more-losses.txt") == {5: losses[5]}


def test_nothing_to_resume_is_a_checkpoint_not_found_error(tmp_path):
    with pytest.raises(ckptio.CheckpointNotFoundError, match="holds no checkpoint-N"):
        trainer_for(tmp_path).train(resume_from_checkpoint=True)


def test_load_best_model_at_end_loads_the_best_ckptio_checkpoint(tmp_path):
    """A learning rate that makes the eval loss grow: the best checkpoint is the first, the one
    save_total_limit=1 keeps at the end, and the model ends with its weights, not the last
    step's."""
    trainer = trainer_for(tmp_path, TokenData(n=8), max_steps=4, save_steps=1,
                          eval_strategy="steps", eval_steps=1, load_best_model_at_end=True,
                          metric_for_best_model="loss", greater_is_better=False,
                          learning_rate=1.0, save_total_limit=1)
    trainer.train()
    evals = [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h]
    assert len(evals) == 4 and min(evals) == evals[0] < evals[-1], evals
    assert trainer.state.best_model_checkpoint == str(tmp_path / "checkpoint-1")
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["checkpoint-1"]
    best = ckptio.load(tmp_path / "checkpoint-1" / "ckptio", keys=["model"])["model"]
    now = trainer.model.state_dict()
    assert best.keys() == now.keys()
    for key in best:
        assert torch.equal(best[key], now[key]), key


def test_pushing_every_checkpoint_to_the_hub_is_refused_before_training(tmp_path):
    trainer = trainer_for(tmp_path)
    trainer.args.push_to_hub, trainer.args.hub_strategy = True, "every_save"
    with pytest.raises(ckptio.UnsupportedStateError, match="hub_strategy='end'"):
        trainer.train()
    assert not list(tmp_path.glob("checkpoint-*"))


def test_a_run_of_transformers_own_trainer_resumes_with_allow_pickle_only(tmp_path):
    """Switching a run over: checkpoint-2 of transformers' own Trainer (torch.save files) is
    refused by default, resumed bitwise with allow_pickle=True; the next save is ckptio's."""
    transformers.set_seed(0)
    RecordingHFTrainer(model=tiny_model(), losses=str(tmp_path / "plain.txt"),
                       args=training_args(str(tmp_path), max_steps=4, save_steps=2),
                       train_dataset=TokenData()).train()
    expected = read_losses(tmp_path / "plain.txt")
    shutil.rmtree(tmp_path / "checkpoint-4")
    ckpt2 = tmp_path / "checkpoint-2"
    assert (ckpt2 / "optimizer.pt").exists() and not (ckpt2 / "ckptio").exists()
    with pytest.raises(ckptio.CheckpointNotFoundError, match="allow_pickle=True resumes"):
        trainer_for(tmp_path).train(resume_from_checkpoint=str(ckpt2))

    trainer_for(tmp_path, allow_pickle=True, max_steps=4, save_steps=2).train(
        resume_from_checkpoint=True)
    assert read_losses(tmp_path / "more-losses.txt") == {3: expected[3], 4: expected[4]}
    assert checkpoint_problem(str(tmp_path / "checkpoint-4")) is None
    assert not (tmp_path / "checkpoint-4" / "optimizer.pt").exists()


@pytest.mark.parametrize("change", [{"optim": "sgd"}, {"lr_scheduler_type": "constant"},
                                    {"lr_scheduler_type": "cosine"}, {"model": "wider"}])
def test_resuming_with_another_model_optimizer_or_schedule_says_so_in_trainer_terms(
        rotated, tmp_path, change):
    """A changed configuration is refused naming the checkpoint and what differs, with a fix
    the Trainer offers (not the load's strict=False, which the Trainer cannot pass)."""
    out = copy_run(rotated[0], tmp_path / "run")
    overrides = {k: v for k, v in change.items() if k != "model"}
    trainer = trainer_for(out, max_steps=7, **overrides)
    if "model" in change:
        config = transformers.GPT2Config(n_layer=2, n_embd=48, n_head=2, vocab_size=64,
                                         n_positions=32, bos_token_id=0, eos_token_id=0)
        trainer.model = transformers.GPT2LMHeadModel(config)
        trainer.model_wrapped = trainer.model
    with pytest.raises(ckptio.StateMismatchError) as err:
        trainer.train(resume_from_checkpoint=True)
    text = str(err.value)
    assert f"cannot resume from {out / 'checkpoint-5'}" in text, text
    assert "lr_scheduler_type" in text and "new run" in text, text
    assert "Pass strict=False" not in text and "pass strict=False" not in text, text
    part = "model" if "model" in change else "optimizer / scheduler"
    if "lr_scheduler_type" in change:  # cosine's state is linear's: told by the arguments
        part = f"lr_scheduler_type {change['lr_scheduler_type']!r} differs from the 'linear'"
    assert f"this trainer's {part}" in text, text


def test_resuming_a_save_only_model_checkpoint_warns_it_is_not_bitwise(tmp_path):
    """save_only_model=True checkpoints hold the model alone: a resume goes on (as transformers'
    own Trainer does) with a fresh optimizer, scheduler and generators, saying so once."""
    trainer_for(tmp_path, max_steps=2, save_steps=2, save_only_model=True).train()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer_for(tmp_path, max_steps=3, save_steps=100, save_only_model=True).train(
            resume_from_checkpoint=True)
    said = [str(w.message) for w in caught if "holds no" in str(w.message)]
    assert len(said) == 1, [str(w.message) for w in caught]
    assert f"{tmp_path / 'checkpoint-2'} holds no optimizer, rng, scheduler" in said[0], said
    assert "not continue the saved run bitwise" in said[0], said


def test_a_second_ddp_job_on_one_output_dir_is_refused_on_every_process(tmp_path):
    """A job (this process) holds output_dir's run lease: a DDP job started there raises
    CheckpointLockedError on both of its processes, the second's saying it is rank 0's
    refusal (before: the second died of gloo's "connection closed" once the first exited),
    within seconds, and writes no checkpoint."""
    from ckptio.storage.local import runlease

    out = tmp_path / "run"
    out.mkdir()
    lease = runlease.take(str(out), False, create=True)
    assert lease is not None
    try:
        code, err = finish(start_ddp(out, tmp_path / "l.txt"))
    finally:
        lease.release()
    assert code != 0
    refusals = [line for line in err.splitlines() if "CheckpointLockedError: " in line]
    assert any(line.startswith("[rank0]") and f"pid {os.getpid()}" in line
               for line in refusals), err[-3000:]
    assert any(line.startswith("[rank1]") and "CheckpointLockedError: rank 0: " in line
               for line in refusals), err[-3000:]
    assert "Connection closed" not in err
    assert not list(out.glob("checkpoint-*"))
