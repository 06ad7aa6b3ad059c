"""Checkpoint every step into host memory, drained in the background to disk every --every
steps; a restart restores from the fastest tier holding the newest step, then from the disk
once the memory copy is gone (as after a host reboot).

    python examples/tiers_every_step.py --disk /tmp/ckptio-tiers --steps 30 --every 10
    python examples/tiers_every_step.py --device cuda    # a model on a GPU

`shm://NAME` lives in /dev/shm (host memory) and outlives the process: a restarted process on
the same host restores from memory. Lazy saves return at host-memory speed and copy what the
next optimizer step would change before it runs.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile

import torch

import ckptio


def build(device: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8))
    model.to(device)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def manager(memory: str, disk: str, every: int) -> ckptio.CheckpointManager:
    return ckptio.CheckpointManager(tiers=[
        ckptio.Tier(memory, keep_last=2),               # every step, in host memory
        ckptio.Tier(disk, every=every, keep_last=2),    # drained in the background
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--disk", default=None, help="the disk tier's directory")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--every", type=int, default=10, help="drain every N steps to disk")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda for a GPU")
    args = parser.parse_args()
    disk = args.disk or tempfile.mkdtemp(prefix="ckptio-tiers-")
    name = f"ckptio-example-{os.getpid()}"
    memory = f"shm://{name}"
    model, opt = build(args.device)
    state = {"model": model, "optim": opt, "step": 0}
    with manager(memory, disk, args.every) as mgr:
        for step in range(1, args.steps + 1):
            loss = model(torch.randn(64, 32, device=args.device)).pow(2).mean()
            loss.backward()
            opt.step()        # waits only if the last save still has bytes it would change
            opt.zero_grad(set_to_none=True)
            state["step"] = step
            mgr.save(step, state, lazy=True, optimizers=[opt])
        print("tiers:", [(t["location"], t["committed"]) for t in mgr.status()])
    want = {k: v.clone() for k, v in model.state_dict().items()}

    model, opt = build(args.device)  # a restart: fresh objects
    state = {"model": model, "optim": opt, "step": 0}
    with manager(memory, disk, args.every) as mgr:
        assert mgr.restore(state) == args.steps and mgr.last_restore is not None
        print(f"restored step {state['step']} from {mgr.last_restore['location']}")
    assert all(torch.equal(model.state_dict()[k], v) for k, v in want.items())

    # as after a reboot: shm://NAME is the directory NAME under /dev/shm/ckptio
    shutil.rmtree(os.path.join(os.environ.get("CKPTIO_SHM_DIR", "/dev/shm/ckptio"), name))
    model, opt = build(args.device)
    state = {"model": model, "optim": opt, "step": 0}
    with manager(memory, disk, args.every) as mgr:
        step = mgr.restore(state)
        print(f"memory gone: restored step {step} from {mgr.last_restore['location']}")
    shutil.rmtree(os.path.join(os.environ.get("CKPTIO_SHM_DIR", "/dev/shm/ckptio"), name),
                  ignore_errors=True)
    assert step == args.steps - args.steps % args.every
    print(f"ok ({args.device}): every step in memory, every {args.every}th on disk; "
          "restored from each")


if __name__ == "__main__":
    main()
