"""TorchTitan's checkpoint managers side by side on one small FSDP2 model (2 gloo ranks, CPU):
ckptio's CkptioCheckpointManager against TorchTitan's DCP CheckpointManager, each async_mode.

    python -m benchmarks.torchtitan_managers --dir /tmp/titan-bench --runs 3

Per run, a fresh 2-rank job (ckptio.testing.rank_processes): build the model, TorchTitan's
OptimizersContainer and LRSchedulersContainer, train, save at step 2 (waited for: the first
save sets up staging), train, then save at step 4, measured: the stall (save() returning) and
the time to durable (save() until maybe_wait_for_saving() returns). Then the checkpoint's
files leave the page cache (harness.cold(only=True): a resume on a new node reads from the
disk; ckptio writes with O_DIRECT, DCP through the page cache, so a warm resume favours DCP)
and another fresh 2-rank job builds everything again and times load() (the resume, cold).
``--warm``: the resume with the files as the save left them in the page cache instead. Host
peak RSS: the largest ru_maxrss of the ranks, of the save job and of the resume job. Medians
over --runs runs.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import harness
from ckptio.testing.rank_processes import run_ranks

WIDTH, LAYERS, BATCH = 2048, 8, 16
MANAGERS = [("ckptio", "disabled"), ("ckptio", "async"), ("ckptio", "async_with_pinned_mem"),
            ("dcp", "disabled"), ("dcp", "async"), ("dcp", "async_with_pinned_mem")]


def _job(folder: str, manager: str, mode: str) -> tuple[Any, Any, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchtitan.components.checkpointer import CheckpointManager
    from torchtitan.components.optimizer import LRSchedulersContainer
    from torchtitan.components.optimizer.optimizer import default_adamw

    from ckptio.torchtitan_manager import CkptioCheckpointManager

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    for layer in [*model, model]:
        fully_shard(layer, mesh=mesh)
    optimizers = default_adamw(lr=1e-4).build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=1).build(optimizers=optimizers,
                                                                   training_steps=10)
    cls = CkptioCheckpointManager if manager == "ckptio" else CheckpointManager
    checkpointer = cls.Config(enable=True, interval=2, keep_latest_k=0, async_mode=mode,
                              last_save_model_only=False).build(
        dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=schedulers,
        states={}, sd_adapter=None, base_folder=folder)
    return model, optimizers, checkpointer


def _train(model: Any, optimizers: Any, checkpointer: Any) -> None:
    model(torch.randn(BATCH, WIDTH)).pow(2).mean().backward()
    checkpointer.maybe_wait_for_staging()
    optimizers.step()
    optimizers.zero_grad()


def save_job(rank: int, world: int, folder: str, manager: str, mode: str) -> dict[str, float]:
    torch.set_num_threads(1)
    model, optimizers, checkpointer = _job(folder, manager, mode)
    _train(model, optimizers, checkpointer)
    checkpointer.save(2)
    checkpointer.maybe_wait_for_saving()
    _train(model, optimizers, checkpointer)
    torch.distributed.barrier()
    began = time.perf_counter()
    checkpointer.save(4)
    stall = time.perf_counter() - began
    checkpointer.maybe_wait_for_saving()
    durable = time.perf_counter() - began
    checkpointer.close()
    return {"stall_s": stall, "durable_s": durable,
            "save_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def load_job(rank: int, world: int, folder: str, manager: str, mode: str) -> dict[str, float]:
    torch.set_num_threads(1)
    model, optimizers, checkpointer = _job(folder, manager, mode)
    torch.distributed.barrier()
    began = time.perf_counter()
    assert checkpointer.load(step=4)
    resume = time.perf_counter() - began
    checkpointer.close()
    return {"resume_s": resume,
            "load_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default="/tmp/titan-bench")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--warm", action="store_true",
                        help="resume from the page cache the save left (default: cold)")
    args = parser.parse_args()
    nbytes = LAYERS * (WIDTH * WIDTH + WIDTH) * 4 * 3  # parameters and Adam's two moments
    cache = "warm (as the save left the page cache)" if args.warm else "cold (files dropped)"
    print(f"model + Adam state: {nbytes / 2**20:.0f} MiB over 2 ranks; medians of {args.runs}; "
          f"resume {cache}")
    print(f"| manager | async_mode | stall s | durable s | {'warm' if args.warm else 'cold'} "
          "resume s | save peak RSS MiB | resume peak RSS MiB |")
    print("|---|---|---|---|---|---|---|")
    for manager, mode in MANAGERS:
        rows: list[dict[str, float]] = []
        for run in range(args.runs):
            folder = os.path.join(args.dir, f"{manager}-{mode}-{run}")
            shutil.rmtree(folder, ignore_errors=True)
            try:
                saved = run_ranks(2, save_job, folder, manager, mode, timeout_s=600)
                if not args.warm:  # the checkpoint's files only: the code stays cached
                    harness.cold([Path(folder)], only=True)
                loaded = run_ranks(2, load_job, folder, manager, mode, timeout_s=600)
            except Exception as exc:  # noqa: BLE001 - a peer that fails is a row that says so
                print(f"| {manager} | {mode} | failed: {str(exc).splitlines()[-1][:200]} |")
                break
            finally:
                shutil.rmtree(folder, ignore_errors=True)
            rows.append({"stall_s": max(r["stall_s"] for r in saved),
                         "durable_s": max(r["durable_s"] for r in saved),
                         "resume_s": max(r["resume_s"] for r in loaded),
                         "save_rss_mib": max(r["save_rss_mib"] for r in saved),
                         "load_rss_mib": max(r["load_rss_mib"] for r in loaded)})
        if len(rows) == args.runs:
            m = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
            print(f"| {manager} | {mode} | {m['stall_s']:.3f} | {m['durable_s']:.3f} | "
                  f"{m['resume_s']:.3f} | {m['save_rss_mib']:.0f} | {m['load_rss_mib']:.0f} |",
                  flush=True)


if __name__ == "__main__":
    main()
