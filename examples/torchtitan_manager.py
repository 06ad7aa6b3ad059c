"""TorchTitan's checkpoint component with ckptio chosen by configuration
(``CkptioCheckpointManager.Config``): a 2-rank FSDP2 job (gloo, CPU) killed with SIGKILL and
resumed by a fresh job, whose losses are checked bit for bit against an uninterrupted run's.

    python examples/torchtitan_manager.py --dir /tmp/ckptio-titan --steps 8 --kill-at 5

Three jobs, each launched with torchrun on 2 ranks: an uninterrupted run, a run that kills
itself after step --kill-at (saves every 2 steps, asynchronous: one may be in flight), and the
resume, which TorchTitan's ``checkpointer.load()`` starts from the newest committed step. The
model, TorchTitan's OptimizersContainer and LRSchedulersContainer and a train state are what
TorchTitan's Trainer hands its checkpointer (its Trainer itself needs a GPU). Needs torchtitan
(docs/guides/torchtitan.md). Each run writes into a new directory under --dir.
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
import torch.distributed as dist

STEPS_DEFAULT, BATCH = 8, 8


class TrainState:
    """What TorchTitan's Trainer checkpoints of itself."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = int(state["step"])


def job(folder: str, steps: int, kill_at: int, out: str) -> None:
    """One rank of the job: build, load, train, save every 2 steps (async), close."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchtitan.components.optimizer import LRSchedulersContainer
    from torchtitan.components.optimizer.optimizer import default_adamw

    from ckptio.torchtitan_manager import CkptioCheckpointManager

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 4))
    mesh = init_device_mesh("cpu", (world,))
    for layer in (model[0], model[2], model):
        fully_shard(layer, mesh=mesh)
    optimizers = default_adamw(lr=3e-3).build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(
        optimizers=optimizers, training_steps=steps)
    state = TrainState()
    config = CkptioCheckpointManager.Config(  # what a job's config sets as its checkpoint
        enable=True, folder="checkpoint", interval=2, keep_latest_k=2, async_mode="async",
        last_save_model_only=False)
    checkpointer = config.build(dataloader=None, model_parts=[model], optimizers=optimizers,
                                lr_schedulers=schedulers, states={"train_state": state},
                                sd_adapter=None, base_folder=folder)
    checkpointer.load()  # the newest committed step, if any
    losses = {"start": state.step}
    while state.step < steps:
        state.step += 1
        g = torch.Generator().manual_seed(state.step)
        x, y = torch.randn(BATCH, 16, generator=g), torch.randn(BATCH, 4, generator=g)
        n = BATCH // world
        loss = (model(x[rank * n:(rank + 1) * n]) - y[rank * n:(rank + 1) * n]).pow(2).mean()
        loss.backward()
        checkpointer.maybe_wait_for_staging()
        optimizers.step()
        schedulers.step()
        optimizers.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)  # the ranks' mean losses, summed
        losses[str(state.step)] = float(total).hex()
        checkpointer.save(state.step, last_step=state.step == steps)
        if state.step == kill_at:
            dist.barrier()
            os.kill(os.getpid(), signal.SIGKILL)  # no cleanup: as a crash
    checkpointer.close()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(losses, f)
    dist.destroy_process_group()


def launch(folder: str, steps: int, kill_at: int) -> dict[str, str] | None:
    """The job on 2 ranks with torchrun -> rank 0's losses (None: it was killed)."""
    out = os.path.join(folder, f"losses-{kill_at}.json")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", __file__, "--job", "--dir", folder,
               "--steps", str(steps), "--kill-at", str(kill_at), "--out", out]
    done = subprocess.run(command, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    if kill_at:
        assert done.returncode != 0, "the job was to kill itself"
        return None
    assert done.returncode == 0, done.stderr[-3000:]
    with open(out) as f:
        return dict(json.load(f))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default=None, help="runs go into a new directory under it")
    parser.add_argument("--steps", type=int, default=STEPS_DEFAULT)
    parser.add_argument("--kill-at", type=int, default=5)
    parser.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        job(args.dir, args.steps, args.kill_at, args.out)
        return
    if args.dir:
        os.makedirs(args.dir, exist_ok=True)
    root = tempfile.mkdtemp(prefix="run-", dir=args.dir)
    uninterrupted = launch(os.path.join(root, "uninterrupted"), args.steps, 0)
    launch(os.path.join(root, "run"), args.steps, args.kill_at)
    resumed = launch(os.path.join(root, "run"), args.steps, 0)
    assert uninterrupted is not None and resumed is not None
    start = int(resumed.pop("start"))
    assert 0 < start <= args.kill_at, start
    want = {s: v for s, v in uninterrupted.items() if s != "start" and int(s) > start}
    assert resumed == want, (resumed, want)
    kept = sorted(n for n in os.listdir(os.path.join(root, "run", "checkpoint"))
                  if n.startswith("step-"))
    print(f"ok: killed at step {args.kill_at}, resumed at step {start}; losses "
          f"{start + 1}-{args.steps} bitwise; kept {kept}")


if __name__ == "__main__":
    main()
