"""A torch.profiler trace of checkpointed training steps on the GPU (issue 65), summarised.

Owns: one fresh process that builds the GPU benchmark's trainer, checkpoints it with one
engine of benchmarks/gpu_phases.py, and profiles the first checkpoint and a steady-state one:
from the save call through the next step (the lazy capture overlaps its forward/backward and
the optimizer step waits for it), each phase under a ``record_function`` label. Writes the
labels' wall times, the profiler's tables (by CPU and by device time) and the steady-state
trace (Chrome JSON, gzipped), and counts the interpreter's generation-2 collections during the
checkpointed steps. Does not own: the trainer or savers (gpu_engines.py, gpu_phases.py).

    python -m benchmarks.gpu_profile --engine ckptio_lazy --out OUT_DIR
"""

from __future__ import annotations

import argparse
import gc
import gzip
import json
import shutil
import time
from pathlib import Path
from typing import Any

from torch.profiler import ProfilerActivity, profile, record_function

from benchmarks import gpu_engines as ge
from benchmarks.gpu_phases import make_saver
from ckptio.tuning.state import tensor_nbytes


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_profile")
    p.add_argument("--engine", default="ckptio_lazy")
    p.add_argument("--gb", type=float, default=2.0)
    p.add_argument("--accum", type=int, default=16)
    p.add_argument("--every", type=int, default=5, help="steps between checkpoints")
    p.add_argument("--dir", type=Path, default=Path("/tmp/bench-gpu-prof"))
    p.add_argument("--shm-dir", type=Path, default=Path("/dev/shm/bench-gpu-prof"))
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    args.rep = 0
    return args


class Gen2:
    """Counts and times the interpreter's generation-2 collections (gc.callbacks)."""

    def __init__(self) -> None:
        self.count, self.seconds, self._t0 = 0, 0.0, 0.0
        gc.callbacks.append(self._cb)

    def _cb(self, phase: str, info: dict[str, Any]) -> None:
        if info.get("generation") != 2:
            return
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.count += 1
            self.seconds += time.perf_counter() - self._t0


def step(trainer: ge.Trainer, walls: dict[str, float]) -> None:
    """One training step as the benchmark's loop runs it, each phase labelled and timed."""
    t0 = time.perf_counter()
    with record_function("fwdbwd"):
        loss = trainer.forward_backward()
    t1 = time.perf_counter()
    with record_function("optimizer_step"):
        trainer.optimizer_step()
    t2 = time.perf_counter()
    with record_function("loss_item"):
        loss.item()
    walls.update(fwdbwd=t1 - t0, optimizer_step=t2 - t1, loss_item=time.perf_counter() - t2)


def checkpointed(trainer: ge.Trainer, saver: Any, pending: Any, n: int,
                 root: Path) -> tuple[Any, dict[str, float]]:
    """Wait for the previous save, call the next, then one training step; wall times."""
    walls: dict[str, float] = {}
    t0 = time.perf_counter()
    with record_function("wait_previous_save"):
        if pending is not None:
            pending.report()
    walls["wait_previous"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    with record_function("ckpt_call"):
        pending = saver.start(trainer.state(n), root / f"step-{n}")
    walls["ckpt_call"] = time.perf_counter() - t0
    step(trainer, walls)
    ge.sync()
    return pending, walls


def main() -> None:
    args = parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    trainer = ge.build_trainer(args.gb, args.device, 0, 8, 512, args.accum)
    plain: dict[str, float] = {}
    for _ in range(4):
        step(trainer, plain)
    root = args.dir / args.engine
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    saver = make_saver(args.engine, trainer, tensor_nbytes(trainer.state(0)), args)
    gen2, report, pending = Gen2(), {"engine": args.engine, "plain_step": plain}, None
    gen2_before = gen2.count
    for n in range(1, 4 * args.every + 2):
        if n % args.every != 1:
            step(trainer, {})
            continue
        label = "first" if n == 1 else "steady"
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda"
                                         else [])
        with profile(activities=acts) as prof:
            pending, walls = checkpointed(trainer, saver, pending, n, root)
        report[f"{label}_{n}"] = walls
        if label == "first" or n == 3 * args.every + 1:
            write_tables(prof, args.out / f"{args.engine}_{label}.txt")
        if n == 3 * args.every + 1:
            with gzip.open(args.out / f"{args.engine}_trace.json.gz", "wt") as f:
                path = args.dir / "trace.json"
                prof.export_chrome_trace(str(path))
                f.write(path.read_text())
                path.unlink()
    if pending is not None:
        pending.report()
    report["gen2_during_checkpointed_steps"] = {"count": gen2.count - gen2_before,
                                                "seconds": gen2.seconds}
    saver.close()
    shutil.rmtree(root, ignore_errors=True)
    (args.out / f"{args.engine}_walls.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


def write_tables(prof: Any, path: Path) -> None:
    avg = prof.key_averages()
    with path.open("w") as f:
        f.write("# by CPU time (total)\n")
        f.write(avg.table(sort_by="cpu_time_total", row_limit=30, max_name_column_width=60))
        f.write("\n# by device time (self)\n")
        f.write(avg.table(sort_by="self_cuda_time_total", row_limit=20,
                          max_name_column_width=60))


if __name__ == "__main__":
    main()
