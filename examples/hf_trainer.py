"""The Hugging Face Trainer with ckptio: `CkptioTrainer` is `transformers.Trainer` whose
checkpoints go through ckptio (no pickle on resume, every byte checksummed); a second run
resumes from the newest checkpoint.

    python examples/hf_trainer.py --out /tmp/ckptio-hf --steps 6

A 2-layer GPT-2 built from a config (nothing downloaded) on random tokens, on CPU. Needs
`pip install -e '.[hf-trainer]'`.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import transformers

from ckptio.hf_trainer import CkptioTrainer


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 32, length: int = 16, vocab: int = 64) -> None:
        generator = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(0, vocab, (n, length), generator=generator)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


class Steps(transformers.TrainerCallback):
    """Counts the optimizer steps this process ran."""

    ran = 0

    def on_step_end(self, *args: object, **kwargs: object) -> None:
        Steps.ran += 1


def train(out: str, max_steps: int, resume: bool) -> transformers.TrainerState:
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64,
                                     n_positions=32, bos_token_id=0, eos_token_id=0)
    args = transformers.TrainingArguments(
        output_dir=out, max_steps=max_steps, save_steps=2, per_device_train_batch_size=4,
        use_cpu=True, report_to=[], seed=0, disable_tqdm=True, logging_steps=1)
    trainer = CkptioTrainer(model=transformers.GPT2LMHeadModel(config), args=args,
                            train_dataset=Tokens(), callbacks=[Steps()])
    trainer.train(resume_from_checkpoint=True if resume else None)
    return trainer.state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None, help="a new directory under it per run")
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    out = tempfile.mkdtemp(prefix="ckptio-hf-", dir=args.out)  # so the command can be repeated
    train(out, args.steps, resume=False)
    Steps.ran = 0
    state = train(out, args.steps + 2, resume=True)  # from checkpoint-<steps>: 2 more steps
    assert state.global_step == args.steps + 2 and Steps.ran == 2, (state.global_step, Steps.ran)
    print(f"ok: resumed from {out}/checkpoint-{args.steps} (a ckptio checkpoint in its ckptio/ "
          f"folder) and trained to step {state.global_step}")


if __name__ == "__main__":
    main()
