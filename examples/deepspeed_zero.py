"""DeepSpeed ZeRO on two gloo ranks (CPU) saving through ckptio: train, save_checkpoint, train
on; then a fresh job resumes from DeepSpeed's 'latest' tag and must train on bit for bit.

    torchrun --standalone --nproc-per-node 2 examples/deepspeed_zero.py --dir /tmp/ckptio-ds --stage 3
    torchrun --standalone --nproc-per-node 2 examples/deepspeed_zero.py --dir /tmp/ckptio-ds --stage 3 --resume

The first command trains 6 steps, saving at step 3 through ckptio (each file DeepSpeed writes
under /tmp/ckptio-ds/global_step3 is a ckptio checkpoint directory), and keeps the losses of
steps 4-6 beside it; the second loads the checkpoint into a new engine and compares. Needs
DeepSpeed: pip install --no-deps deepspeed==0.19.8 and the deepspeed extra's needs.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os

import torch

import ckptio.deepspeed_engine

SAVE_AT, STEPS = 3, 6


def make_engine(stage: int, decoupled: bool) -> object:
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    # DeepSpeed's CPU backend compiles a shared-memory allreduce (for inference) with g++ at
    # initialize, which takes minutes; training does not use it
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    config = {"train_micro_batch_size_per_gpu": 4,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4}},
              "zero_optimization": {"stage": stage}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=config)
    # saves and loads through ckptio; allow_pickle: ZeRO's loss scaler and slice mappings
    ckptio.deepspeed_engine.use(engine, decoupled=decoupled, allow_pickle=True)
    return engine


def step(engine: object) -> float:
    rank = torch.distributed.get_rank()
    g = torch.Generator().manual_seed(1000 * engine.global_steps + rank)  # type: ignore[attr-defined]
    loss = (engine(torch.randn(4, 8, generator=g)) - 1).pow(2).mean()  # type: ignore[operator]
    engine.backward(loss)  # type: ignore[attr-defined]
    engine.step()  # type: ignore[attr-defined]
    return loss.item()


def finish(engine: object) -> None:
    """Waits for the saves in flight, then ends the process group: torch 2.13's gloo groups
    left to the interpreter's exit abort the process now and then ("terminate called without
    an active exception"), with or without ckptio."""
    engine.destroy()  # type: ignore[attr-defined]
    torch.distributed.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--stage", type=int, default=3, choices=(1, 2, 3))
    parser.add_argument("--decoupled", action="store_true",
                        help="save_checkpoint returns once staged; the next step commits")
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()
    engine = make_engine(args.stage, args.decoupled)
    rank = torch.distributed.get_rank()
    expected = os.path.join(args.dir, f"losses-rank{rank}.json")
    if not args.resume:
        for _ in range(SAVE_AT):
            step(engine)
        engine.save_checkpoint(args.dir)  # type: ignore[attr-defined]
        losses = [step(engine) for _ in range(STEPS - SAVE_AT)]
        finish(engine)
        with open(expected, "w") as f:
            json.dump(losses, f)
        if rank == 0:
            print(f"saved global_step{SAVE_AT} through ckptio, trained to step {STEPS}")
        return
    path, _ = engine.load_checkpoint(args.dir)  # type: ignore[attr-defined]
    losses = [step(engine) for _ in range(STEPS - SAVE_AT)]
    finish(engine)
    with open(expected) as f:
        assert losses == json.load(f), "the resumed run differs from the uninterrupted one"
    if rank == 0:
        print(f"ok: resumed {os.path.basename(os.path.dirname(path))} on ZeRO stage "
              f"{args.stage}; losses of steps {SAVE_AT + 1}-{STEPS} bitwise")


if __name__ == "__main__":
    main()
