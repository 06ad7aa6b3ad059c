"""A plain PyTorch training loop checkpointed by ckptio.CheckpointManager, killed with SIGKILL
and resumed in a fresh process; the losses after the resume are checked, bit for bit, against
an uninterrupted run's.

    python examples/plain_loop.py --dir /tmp/ckptio-plain --steps 40 --kill-at 27
    python examples/plain_loop.py --device cuda    # the same on a GPU (RNGState holds CUDA's)

Three processes: an uninterrupted run, a run that kills itself at --kill-at (an async save may
be in flight: the newest committed step is what a resume finds), and the resume. Each run of
the script writes into a new directory under --dir, so the command can be run again.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile

import torch

import ckptio


def build(device: str) -> tuple[torch.nn.Module, torch.optim.Optimizer, object]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))
    model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=100)
    return model, opt, sched


def train(directory: str, steps: int, kill_at: int | None, device: str) -> dict[int, str]:
    """Train to ``steps`` (resuming if ``directory`` holds a step) -> {step: loss as hex}."""
    model, opt, sched = build(device)
    state = {"model": model, "optim": opt, "sched": sched, "rng": ckptio.RNGState(), "step": 0}
    losses: dict[int, str] = {}
    with ckptio.CheckpointManager(directory, save_every=5, keep_last=2) as mgr:
        start = mgr.restore(state) or 0
        for step in range(start + 1, steps + 1):
            if kill_at and step == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)  # no cleanup: as a crash
            x = torch.randn(32, 16, device=device)
            loss = (model(x) - x[:, :1] * x[:, 1:2]).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
            losses[step] = loss.item().hex()
            state["step"] = step
            mgr.save(step, state, asynchronous=True, metrics={"loss": loss.item()})
    return losses


def _child(directory: str, steps: int, kill_at: int | None, device: str) -> dict[int, str]:
    out = os.path.join(directory, "..", f"losses-{os.getpid()}-{kill_at}.json")
    command = [sys.executable, __file__, "--child", "--dir", directory, "--steps", str(steps),
               "--out", out, "--device", device, "--kill-at", str(kill_at or 0)]  # 0: never
    done = subprocess.run(command)
    if kill_at:
        assert done.returncode == -signal.SIGKILL, done.returncode
        return {}
    assert done.returncode == 0, done.returncode
    with open(out) as f:
        return {int(k): v for k, v in json.load(f).items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", default=None, help="the run's checkpoint directory")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--kill-at", type=int, default=27,
                        help="the step at which the second run kills itself (SIGKILL)")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda for a GPU")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        losses = train(args.dir, args.steps, args.kill_at, args.device)
        with open(args.out, "w") as f:
            json.dump(losses, f)
        return
    if args.dir:
        os.makedirs(args.dir, exist_ok=True)
    root = tempfile.mkdtemp(prefix="ckptio-plain-", dir=args.dir)  # a new one per run
    whole = _child(os.path.join(root, "whole"), args.steps, None, args.device)
    _child(os.path.join(root, "run"), args.steps, args.kill_at, args.device)
    resumed = _child(os.path.join(root, "run"), args.steps, None, args.device)
    first = min(resumed)
    assert all(resumed[s] == whole[s] for s in resumed), "a loss after the resume differs"
    print(f"ok ({args.device}): killed at step {args.kill_at}, resumed at step {first}; "
          f"losses {first}-{args.steps} bitwise equal to the uninterrupted run's ({root})")


if __name__ == "__main__":
    main()
