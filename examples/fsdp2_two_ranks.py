"""FSDP2 on two gloo ranks (CPU): train, save with ckptio (each rank writes its own shards, no
gather), then load the checkpoint into one process, a plain model, bit for bit.

    torchrun --standalone --nproc-per-node 2 examples/fsdp2_two_ranks.py --dir /tmp/f2
    python examples/fsdp2_two_ranks.py --dir /tmp/f2 --load-on-one

The first command trains and saves on 2 ranks, and rank 0 keeps the full tensors (gathered by
torch, beside the checkpoint, for the check); the second loads into one process and compares.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

import ckptio


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_and_save(directory: str, steps: int) -> None:
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                         get_optimizer_state_dict)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model, _ = build()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    for _ in range(steps):
        model(torch.randn(16, 8, generator=generator)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt),
             "step": steps}
    result = ckptio.save(state, os.path.join(directory, f"step-{steps}"))  # every rank
    full = {k: v.full_tensor() for k, v in state["model"].items()}  # a collective
    if rank == 0:
        torch.save(full, os.path.join(directory, "full-model.pt"))
        print(f"saved step {steps} on 2 ranks: rank 0 wrote {result.nbytes} bytes")
    dist.destroy_process_group()


def load_on_one(directory: str, steps: int) -> None:
    model, opt = build()
    state = {"model": model.state_dict(), "step": 0}
    ckptio.load(os.path.join(directory, f"step-{steps}"), state, keys=["model", "step"])
    want = torch.load(os.path.join(directory, "full-model.pt"), weights_only=True)
    assert state["step"] == steps
    assert all(torch.equal(model.state_dict()[k], v) for k, v in want.items())
    print(f"ok: the 2-rank FSDP2 checkpoint loaded into one process, {len(want)} tensors bitwise")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--load-on-one", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.load_on_one:
        load_on_one(args.dir, args.steps)
    else:
        os.makedirs(args.dir, exist_ok=True)
        train_and_save(args.dir, args.steps)


if __name__ == "__main__":
    main()
