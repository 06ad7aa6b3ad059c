"""One training process of the demo: build, maybe restore, train, checkpoint, write the losses.

    python -m ckptio.demo.train --out run.json --dir ckpts --steps 200 --save-every 20
    python -m ckptio.demo.train ... --kill-at 120      # SIGKILLs itself mid-save of step 120
    python -m ckptio.demo.train ... --resume           # restores the latest checkpoint first

With RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set (as torchrun sets them) the ranks train
data-parallel over gloo: each its own shard of every batch and its own dropout generator, the
gradients averaged by DistributedDataParallel; the checkpoint keeps each rank's RNG state.

Owns: the training loop, the checkpointed state (the objects themselves: ckptio calls their
state_dict() when saving and load_state_dict() when restoring), the progress bar, the kill, and
the JSON it writes (every loss as float.hex, so the comparison is bitwise). Does not own: the
model, data and optimizer (model.py), or starting processes and comparing runs (launch.py, main.py).
"""

from __future__ import annotations

import argparse
import gc
import json
import mmap
import os
import signal
import sys
import threading
import time
import warnings
from datetime import timedelta
from typing import Any

import torch
from tqdm import tqdm

import ckptio
from ckptio.demo import model as gpt

__all__ = ["main"]

# staging memory for the background saves: small, allocated once per process
OPTIONS = ckptio.Options(buffer_bytes=1 << 20, pool_bytes=4 << 20)
KILL_NOTE_BYTES = 4096


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m ckptio.demo.train", description=__doc__.split(
        "\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="JSON file of this run's losses (rank r > 0 "
                   "writes OUT.rank<r>)")
    p.add_argument("--dir", help="checkpoint directory (required unless --no-save)")
    p.add_argument("--preset", choices=sorted(gpt.PRESETS), default="default")
    p.add_argument("--steps", type=int, required=True, help="train until this many steps")
    p.add_argument("--save-every", type=int, default=20, help="checkpoint interval in steps")
    p.add_argument("--mode", choices=["eager", "lazy", "sync"], default="eager",
                   help="async eager, async lazy (copies while the next step runs) or blocking")
    p.add_argument("--no-save", action="store_true", help="no checkpoints (the reference run)")
    p.add_argument("--resume", action="store_true", help="restore the latest checkpoint first")
    p.add_argument("--kill-at", type=int, help="SIGKILL this process right after the save of "
                   "this step has started (a checkpoint step; an async save's commit is held back "
                   "so that the kill lands mid-save however fast the disk)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--forget", help=argparse.SUPPRESS)  # tests: restore all but this key
    p.add_argument("--threads", type=int, default=1, help="torch threads (runs compared bitwise "
                   "must use the same number)")
    args = p.parse_args(argv)
    if not args.no_save and not args.dir:
        p.error("--dir is required unless --no-save")
    if args.kill_at is not None and (args.no_save or args.kill_at % args.save_every):
        p.error("--kill-at must be a checkpoint step (a multiple of --save-every)")
    return args


def init_ranks() -> tuple[int, int]:
    """(rank, world size); joins the gloo process group when WORLD_SIZE > 1."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    return dist.get_rank(), world


def out_path(out: str, rank: int) -> str:
    return out if rank == 0 else f"{out}.rank{rank}"


def write_json(path: str, record: dict[str, Any]) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(record, f, indent=1)
    os.replace(tmp, path)


class Trainer:
    """The model, optimizer, schedule and loader of one process, and one step of training."""

    def __init__(self, args: argparse.Namespace, rank: int, world: int) -> None:
        self.args, self.rank, self.world = args, rank, world
        self.cfg = gpt.PRESETS[args.preset]
        self.parts = gpt.build(self.cfg, args.steps, args.seed, rank, world)
        self.net: torch.nn.Module = self.parts.model
        if world > 1:
            from torch.nn.parallel import DistributedDataParallel

            self.net = DistributedDataParallel(self.parts.model)

    def state(self, step: int) -> dict[str, Any]:
        """What a checkpoint holds: the objects themselves (Stateful), and the step."""
        p = self.parts
        return {"model": p.model, "optim": p.opt, "sched": p.sched, "loader": p.loader,
                "rng": ckptio.RNGState(), "step": step}

    def step(self) -> float:
        """One optimizer step; -> the loss, averaged over the ranks."""
        p = self.parts
        x, y = p.loader.next_batch()
        loss = self.net(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(p.model.parameters(), 1.0)
        p.opt.step()
        p.opt.zero_grad(set_to_none=True)
        p.sched.step()
        value = loss.detach()
        if self.world > 1:
            import torch.distributed as dist

            dist.all_reduce(value)
            value = value / self.world
        return float(value)


def ckpt_status(last: tuple[int, Any] | None, saving: bool) -> str:
    """A few words for the progress bar: the latest save and how far it has got."""
    if last is None:
        return "no checkpoint yet" if saving else "no checkpoints (reference run)"
    step, saved = last
    if isinstance(saved, ckptio.SaveResult):  # a synchronous save: committed on return
        return f"ckpt step-{step} saved"
    if saved.done():
        saved.wait()  # raises here, loudly, if the background save failed
        return f"ckpt step-{step} saved"
    progress = saved.progress()
    pct = 100 * progress.nbytes_written / max(1, progress.nbytes_total)
    return f"ckpt step-{step} saving {pct:.0f}%"


def hold_commits(mgr: Any) -> None:
    """Let the previous save finish, then keep every later save from committing: its data is
    written, but never fsynced nor committed. So the SIGKILL right after an async save returns
    lands mid-save on any machine (a small save on a fast disk, or a kill delayed by a busy CPU,
    could otherwise see the save committed first, and the kill would test nothing)."""
    from ckptio.saving import persist

    mgr.wait()
    never = threading.Event()  # never set: the process is killed while its save waits here
    finish = persist.SaveJob.finish

    def held(job: persist.SaveJob) -> Any:
        never.wait()
        return finish(job)

    persist.SaveJob.finish = held  # type: ignore[method-assign,assignment]


def kill_now(note: mmap.mmap, step: int, handle: Any) -> None:
    """SIGKILL this process, leaving a note of how far the save of ``step`` had got. The note
    goes into a file mapped beforehand: no system call between the save's return and the kill
    (one would let the save's thread run, and perhaps finish)."""
    if isinstance(handle, ckptio.SaveResult):  # synchronous: committed already
        record = {"step": step, "done": True, "written": handle.nbytes, "staged": handle.nbytes,
                  "total": handle.nbytes}
    else:
        progress = handle.progress()
        record = {"step": step, "done": handle.done(), "written": progress.nbytes_written,
                  "staged": progress.nbytes_staged, "total": progress.nbytes_total}
    note[:KILL_NOTE_BYTES] = json.dumps(record).encode().ljust(KILL_NOTE_BYTES)
    os.kill(os.getpid(), signal.SIGKILL)


def map_kill_note(path: str) -> mmap.mmap:
    with open(path, "wb+") as f:
        f.write(b" " * KILL_NOTE_BYTES)
        f.flush()
        return mmap.mmap(f.fileno(), KILL_NOTE_BYTES)


def restore(mgr: Any, state: dict[str, Any], record: dict[str, Any], where: str,
            forget: str | None = None) -> int:
    """Restore the latest complete checkpoint into ``state``'s objects; -> its step. Records
    the complete and the incomplete (interrupted) step directories it found. ``forget``: a key
    not to restore (tests show that the comparison then fails)."""
    record["found"], record["incomplete"] = mgr.steps(), mgr.incomplete()
    if not record["found"]:
        raise SystemExit(f"--resume: no complete checkpoint in {where}")
    with warnings.catch_warnings(record=True) as caught:  # why a newer step was passed over:
        warnings.simplefilter("always")                   # printed as a line of the demo
        keys = None if forget is None else (lambda key: key.split(".")[0] != forget)
        step: int | None = mgr.restore(state, keys=keys)
    for warning in caught:
        print(warning.message, file=sys.stderr, flush=True)
    if step is None:  # steps() found some a moment ago; gone since
        raise SystemExit(f"--resume: no complete checkpoint in {where}")
    if state["step"] != step:
        raise SystemExit(f"restored checkpoint step-{step} holds step {state['step']}")
    if record["rank"] == 0:
        print(f"restored step-{step}: model, optimizer, schedule, loader position and RNG state "
              f"(complete checkpoints: {record['found']}, incomplete: {record['incomplete']})",
              flush=True)
    return step


def train(args: argparse.Namespace, rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    trainer = Trainer(args, rank, world)
    mgr = None if args.no_save else ckptio.CheckpointManager(
        args.dir, keep_last=3, save_every=args.save_every, options=OPTIONS)
    record: dict[str, Any] = {"rank": rank, "world": world, "steps": args.steps,
                              "mode": args.mode, "params": gpt.n_params(trainer.parts.model),
                              "text": trainer.parts.source, "losses": {}}
    start = 0
    if args.resume and mgr is not None:
        start = restore(mgr, trainer.state(0), record, args.dir, args.forget)
    record["start"], record["start_epoch"] = start, trainer.parts.loader.epoch
    note = map_kill_note(f"{out_path(args.out, rank)}.kill") if args.kill_at is not None else None
    began = time.perf_counter()
    loop(trainer, mgr, start, record, note)
    record["seconds"], record["epoch"] = time.perf_counter() - began, trainer.parts.loader.epoch
    if mgr is not None:
        mgr.close()  # waits: the last save is durable and committed (or its error raised here)
    return record


def leave_ranks() -> None:
    """Tear the process group down together, once the model (DDP) and manager are gone: a rank
    leaving while a peer still tears down its gloo threads can abort that peer."""
    import torch.distributed as dist

    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def loop(trainer: Trainer, mgr: Any, start: int, record: dict[str, Any],
         note: mmap.mmap | None) -> None:
    args, rank = trainer.args, trainer.rank
    bar = tqdm(total=args.steps, initial=start, unit="step", leave=True, dynamic_ncols=True,
               desc="resumed" if args.resume else "training",
               disable=rank != 0 or not sys.stderr.isatty())
    last: tuple[int, Any] | None = None
    for i in range(start, args.steps):
        loss = trainer.step()
        done = i + 1  # steps finished; the checkpoint "step-N" holds the state after N steps
        record["losses"][str(done)] = float.hex(loss)
        if done == args.kill_at:  # what this process did up to here is on record before the save
            write_json(out_path(args.out, rank), record)
            bar.close()
            if mgr is not None and args.mode != "sync":
                hold_commits(mgr)
        handle = None if mgr is None else mgr.save(
            done, trainer.state(done), asynchronous=args.mode != "sync", lazy=args.mode == "lazy",
            optimizers=[trainer.parts.opt] if args.mode == "lazy" else ())
        if handle is not None:
            last = (done, handle)
        if done == args.kill_at and note is not None:
            if handle is None:
                raise SystemExit(f"--kill-at {done}: the manager did not save this step")
            kill_now(note, done, handle)
        status = ckpt_status(last, mgr is not None)
        bar.set_postfix_str(f"loss {loss:.4f} | {status}", refresh=False)
        bar.update(1)
        if bar.disable and rank == 0 and (done % args.save_every == 0 or done == args.steps):
            print(f"  step {done:4d}/{args.steps}  loss {loss:.4f}  {status}", flush=True)
    bar.close()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rank, world = init_ranks()
    record = train(args, rank, world)
    write_json(out_path(args.out, rank), record)
    if world > 1:
        leave_ranks()
    return 0


if __name__ == "__main__":
    sys.exit(main())
