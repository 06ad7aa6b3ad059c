"""One real transformers.Trainer run through ckptio.hf_trainer.CkptioTrainer, for the tests
(tests/integrations/test_hf_trainer.py runs it in fresh processes; not a test file itself).

    python hf_trainer_run.py OUT LOSSES [--max-steps 8] [--resume] [--kill-in-save STEP]
    python -m torch.distributed.run --nproc-per-node 2 hf_trainer_run.py ... --ddp

A 2-layer GPT-2 (hidden 32, dropout on, random init, nothing downloaded) on a fixed random token
dataset, on CPU. Every optimizer step's loss is appended to LOSSES as ``step float.hex()`` (the
exact float the loss tensor holds), the line flushed before the next step. --kill-in-save STEP:
SIGKILL this process inside checkpoint-STEP's save, after its ckptio checkpoint committed and
before transformers writes its trainer_state.json. --resume: resume_from_checkpoint=True, with
torch.load made to fail (resuming must unpickle nothing). At the end the model's weights are
saved with ckptio to OUT/final. --ddp (under torchrun): DDP over gloo; the main process records
LOSSES, the others LOSSES.r<rank>.

    python hf_trainer_run.py --serve

reads JSON lines from its standard input: ``["start", NAME, LOG, ARG...]`` forks a child that
is the run above with those arguments (transformers, torch and ckptio imported once, here, not
once per run), its output in LOG; ``["wait", NAME]`` waits for that child and prints its exit
code (-9: SIGKILL) as a line (serve).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from typing import Any

import torch
import transformers
from transformers.trainer_callback import TrainerState

import ckptio
from ckptio.hf_trainer import CkptioTrainer


class TokenData(torch.utils.data.Dataset):
    """``n`` fixed random sequences of ``length`` tokens; the labels are the inputs (causal LM)."""

    def __init__(self, n: int = 32, length: int = 16, vocab: int = 64) -> None:
        generator = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(0, vocab, (n, length), generator=generator)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


def tiny_model() -> transformers.GPT2LMHeadModel:
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def training_args(out: str, **overrides: Any) -> transformers.TrainingArguments:
    settings: dict[str, Any] = {
        "output_dir": out, "use_cpu": True, "report_to": [], "seed": 0,
        "dataloader_num_workers": 0, "per_device_train_batch_size": 4, "max_steps": 8,
        "save_steps": 2, "logging_steps": 1, "learning_rate": 1e-3, "warmup_steps": 2,
        "disable_tqdm": True}
    settings.update(overrides)
    return transformers.TrainingArguments(**settings)


class LossRecorder:
    """Appends each step's loss (the exact float) to the file ``losses``."""

    def __init__(self, *args: Any, losses: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.losses = losses

    def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        loss = super().training_step(*args, **kwargs)  # type: ignore[misc]
        step = self.state.global_step + 1  # type: ignore[attr-defined]
        rank = self.args.process_index  # type: ignore[attr-defined]
        with open(self.losses if rank == 0 else f"{self.losses}.r{rank}", "a",
                  encoding="utf-8") as f:
            f.write(f"{step} {float(loss.item()).hex()}\n")
        return loss


class RecordingTrainer(LossRecorder, CkptioTrainer):
    """CkptioTrainer, recording its losses."""


class RecordingHFTrainer(LossRecorder, transformers.Trainer):
    """transformers' own Trainer, recording its losses."""


def kill_in_save(step: int) -> None:
    """SIGKILL this process when transformers is about to write checkpoint-``step``'s
    trainer_state.json (its ckptio checkpoint is committed by then)."""
    write = TrainerState.save_to_json

    def killing(self: TrainerState, json_path: str) -> None:
        if self.global_step == step:
            os.kill(os.getpid(), signal.SIGKILL)
        write(self, json_path)

    TrainerState.save_to_json = killing  # type: ignore[method-assign]


def refuse_torch_load() -> None:
    def refused(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("torch.load called while resuming: the resume unpickled something")

    torch.load = refused  # type: ignore[assignment]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("losses")
    parser.add_argument("--max-steps", type=int, default=8)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--kill-in-save", type=int)
    parser.add_argument("--ddp", action="store_true", help="under torchrun: DDP over gloo")
    a = parser.parse_args()
    if a.kill_in_save is not None:
        kill_in_save(a.kill_in_save)
    transformers.set_seed(0)
    extra = {"ddp_backend": "gloo"} if a.ddp else {}
    trainer = RecordingTrainer(model=tiny_model(),
                               args=training_args(a.out, max_steps=a.max_steps, **extra),
                               train_dataset=TokenData(), losses=a.losses)
    if a.resume:
        refuse_torch_load()
    trainer.train(resume_from_checkpoint=True if a.resume else None)
    if trainer.args.process_index == 0:
        ckptio.save({"model": trainer.model}, os.path.join(a.out, "final"),
                    process_group=_alone())


def _alone() -> Any:
    """This process alone as a group (None without torch.distributed): the final weights,
    saved by the main process only."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.new_group([dist.get_rank()], use_local_synchronization=True)


def serve() -> None:
    """Each "start" line a child forked from this process, run as ``python hf_trainer_run.py
    ARG...`` runs: its argv those arguments, its output in LOG, standard input empty, and it
    ends as the interpreter does (main, then SystemExit: atexit, flush); each "wait" line that
    child's exit code; at the end of input, a child not waited for is killed. This process
    reads its lines alone: no thread runs at a fork."""
    children: dict[str, int] = {}
    for line in sys.stdin:  # until the end of input: then a run not waited for is killed
        verb, name, *rest = json.loads(line)
        if verb == "wait":
            _, status = os.waitpid(children.pop(name), 0)
            print(os.waitstatus_to_exitcode(status), flush=True)
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            log, *argv = rest
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.close(fd)
            os.close(null)
            sys.argv = [os.path.abspath(__file__), *argv]
            main()
            sys.exit(0)
        children[name] = pid
    for pid in children.values():
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve"]:
        serve()
    else:
        main()
