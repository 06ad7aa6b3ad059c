"""GPU benchmark: device-to-host staging against the PCIe ceiling, the stall a checkpoint puts on
a real mixed-precision training loop, and cold loads straight into CUDA tensors.

Owns: the phases and their workers (one fresh process per engine and repetition), what each
measures, the command line and the JSON/markdown outputs of docs/BENCH_GPU.md. Does not own: the
trainer and the peers' savers (gpu_engines.py), the tables (gpu_report.py), the ckptio saver,
the save timeline and the loaders (train_engines.py, train.py, engines.py).

    python -m benchmarks.gpu --gb 2 --reps 3 --json out.json --markdown out.md

Phases: ``d2h`` (pinned-copy ceiling; ckptio's eager capture, DCP's stager and DataStates'
copies of the same device state), ``train10`` (checkpoint every 10 steps to --dir, durable),
``train1`` (every step, to --shm-dir: memory-speed storage, so the engines and not the disk
decide), ``load`` (cold loads into the trainer's CUDA tensors against the O_DIRECT read ceiling).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import gpu_engines as ge
from benchmarks import harness, write_reports
from ckptio.tuning.state import tensor_nbytes

Run = dict[str, Any]
PHASES = ("d2h", "train10", "train1", "load")
TRAIN_ENGINES = ("none", "ckptio_eager", "ckptio_lazy", "ckptio_lazy_sized", "ckptio_tiers",
                 "ckptio_tiers_ready",
                 "dcp_async_best", "datastates")
LOAD_ENGINES = ("ckptio", "dcp", "torch_save")
GB = 1e9


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__.split("\n")[0])
    p.add_argument("--gb", type=float, default=2.0, help="training state in GB (default 2)")
    p.add_argument("--phases", default=",".join(PHASES))
    p.add_argument("--engines", default=",".join(TRAIN_ENGINES))
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=32, help="steps of train10 (train1: a third)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--accum", type=int, default=32, help="micro-batches per optimizer step")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dir", type=Path, default=Path("bench-gpu"))
    p.add_argument("--shm-dir", type=Path, default=Path("/dev/shm/bench-gpu"))
    p.add_argument("--json", type=Path)
    p.add_argument("--markdown", type=Path)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--merge", type=Path, nargs="+", help="no runs: the tables of these JSON "
                   "reports together (phases run by separate commands)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--engine", help=argparse.SUPPRESS)
    p.add_argument("--every", type=int, default=10, help=argparse.SUPPRESS)
    p.add_argument("--rep", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.steps <= 10 and not args.worker and not args.merge:
        p.error("--steps must exceed 10: train10 checkpoints after every 10th step but the last")
    return args


# ---------------------------------------------------------------- d2h


def timed(fn: Any) -> float:
    ge.sync()
    t0 = time.perf_counter()
    fn()
    ge.sync()
    return time.perf_counter() - t0


def copy_ceiling(nbytes: int, registered: bool) -> float:
    """GB/s of one device->host copy of ``nbytes`` into page-locked memory (median of 5):
    torch's pinned allocator, or an mmap registered with cudaHostRegister as ckptio's pool is."""
    import mmap

    src = torch.ones(nbytes, dtype=torch.uint8, device="cuda")
    if registered:
        mapping = mmap.mmap(-1, nbytes)
        dst = torch.frombuffer(mapping, dtype=torch.uint8)
        dst.zero_()
        torch.cuda.cudart().cudaHostRegister(dst.data_ptr(), nbytes, 0)
    else:
        dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    gbps = statistics.median(nbytes / GB / timed(lambda: dst.copy_(src, non_blocking=True))
                             for _ in range(5))
    if registered:
        torch.cuda.cudart().cudaHostUnregister(dst.data_ptr())
    return gbps


def d2h_worker(args: argparse.Namespace) -> Run:
    """The same device state copied out by each engine, five times after a first, untimed."""
    import ckptio
    from benchmarks.train_engines import Context

    trainer = build(args)
    trainer.forward_backward()
    trainer.optimizer_step()
    state = trainer.state(1)
    nbytes = tensor_nbytes(state)
    out: Run = {"bytes": nbytes, "ceiling_pinned_gbps": copy_ceiling(1 << 30, False),
                "ceiling_registered_gbps": copy_ceiling(1 << 30, True)}
    ck = ckptio.Checkpointer(ckptio.Options.from_env(use_profile=False))
    root = args.shm_dir / "d2h"
    ck.prepare(str(root / "c0"), state=state, wait=True)  # the pool grown to the state, pinned: at startup
    calls, captures = [], []
    for i in range(6):
        t0 = time.perf_counter()
        handle = ck.async_save(state, str(root / f"c{i}"))
        calls.append(time.perf_counter() - t0)
        captures.append(handle.wait().capture_s)
        shutil.rmtree(root / f"c{i}")
    out.update(ckptio_call_s=calls[1:], ckptio_capture_s=captures[1:],
               ckptio_pinned_bytes=ck.staging_nbytes)
    ck.close()
    out.update(tier_capture_s=tier_captures(state, args.shm_dir / "d2h-tier"))
    try:
        out.update(dcp_stage_s=_dcp_stage_times(state))
    except Exception as exc:  # noqa: BLE001 - a peer's failure is a result, recorded by name
        out.update(dcp_stage_error=f"{type(exc).__name__}: {exc}")
    if ge.datastates_unavailable() is None:
        saver = ge.DataStatesSaver(Context(trainer.opt, 0), int(nbytes * 1.05) + (64 << 20))
        copies = []
        for i in range(6):
            t0 = time.perf_counter()
            pending = saver.start(state, root / f"d{i}")
            saver.engine.wait()
            copies.append(time.perf_counter() - t0)
            pending.durable()
            shutil.rmtree(root / f"d{i}")
        saver.close()
        out.update(datastates_copy_s=copies[1:])
    return out


def tier_captures(state: Any, root: Path) -> list[float]:
    """capture_s of eager saves into a manager's memory tier (keep_last=1) once its ring is
    warm: the device->host copies land in the tier's registered tmpfs pages (the mapped save)."""
    import ckptio

    root.mkdir(parents=True, exist_ok=True)
    os.environ["CKPTIO_SHM_DIR"] = str(root)
    captures = []
    with ckptio.CheckpointManager(tiers=[ckptio.Tier("shm://d2h", keep_last=1)]) as mgr:
        mgr.prepare(state)
        for step in range(8):
            handle = mgr.save(step, state, asynchronous=True)
            captures.append(handle.wait().capture_s)
    shutil.rmtree(root, ignore_errors=True)
    return captures[4:]  # the first two through the pool (no dropped slot yet), then mapped


def _dcp_stage_times(state: Any) -> list[float]:
    """DCP's DefaultStager at its GPU defaults staging the state (the first, untimed, pins)."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    stager = ge.keep_stager_open(DefaultStager(StagingOptions()))
    times = []
    for _ in range(6):
        t0 = time.perf_counter()
        staged = stager.stage(state)
        if hasattr(staged, "result"):
            staged.result()
        ge.sync()
        times.append(time.perf_counter() - t0)
    stager.close()
    return times[1:]


def build(args: argparse.Namespace) -> Any:
    return ge.build_trainer(args.gb, args.device, 0, args.batch, args.seq, args.accum)


# ---------------------------------------------------------------- workers and driver


def worker_main(args: argparse.Namespace) -> int:
    from benchmarks import gpu_phases

    if args.worker == "d2h":
        run = d2h_worker(args)
    elif args.worker == "train":
        run = gpu_phases.train_worker(args, build(args))
    elif args.worker == "load-setup":
        run = gpu_phases.load_setup(args, build(args))
    elif args.worker == "load":
        run = gpu_phases.load_worker(args, build(args))
    else:
        raise SystemExit(f"unknown worker {args.worker!r}")
    return harness.emit(run)


def spawn(args: argparse.Namespace, worker: str, engine: str = "-", every: int = 10,
          rep: int = 0) -> Run:
    """One fresh process; its last stdout line is the run (or the error it died of)."""
    cmd = [sys.executable, "-m", "benchmarks.gpu", "--worker", worker, "--engine", engine,
           "--every", str(every), "--rep", str(rep), "--gb", str(args.gb), "--steps",
           str(args.steps), "--batch", str(args.batch), "--seq", str(args.seq), "--accum",
           str(args.accum), "--device", args.device, "--dir", str(args.dir), "--shm-dir",
           str(args.shm_dir)]
    head = {"worker": worker, "engine": engine, "every": every, "rep": rep}
    return harness.spawn(cmd, timeout=args.timeout, label=head, tail=40)


def run_phases(args: argparse.Namespace) -> list[Run]:
    from benchmarks import gpu_phases

    phases = [p for p in args.phases.split(",") if p]
    engines = [e for e in args.engines.split(",") if e]
    skipped = {"datastates": ge.datastates_unavailable()}
    runs: list[Run] = []
    for phase in phases:
        if phase == "d2h":
            runs.append(spawn(args, "d2h"))
            progress(runs[-1], args, runs)
        elif phase in ("train10", "train1"):
            every = 10 if phase == "train10" else 1
            for rep in range(args.reps):
                for engine in engines:
                    if skipped.get(engine):
                        continue
                    runs.append(spawn(args, "train", engine, every, rep))
                    progress(runs[-1], args, runs)
        elif phase == "load":
            runs.append(spawn(args, "load-setup"))
            for rep in range(args.reps):
                for engine in ("ceiling",) + LOAD_ENGINES:
                    runs.append(spawn(args, "load", engine, rep=rep))
                    progress(runs[-1], args, runs)
            gpu_phases.remove_load_files(args)
    runs.append({"worker": "skipped", "reasons": {k: v for k, v in skipped.items() if v}})
    return runs


def progress(run: Run, args: argparse.Namespace | None = None, runs: list[Run] | None = None) -> None:
    """One line per run; with ``args.json``, the runs so far written there (a run cut short by
    a time limit keeps what it measured)."""
    if args is not None and args.json and runs is not None:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                         "env": environment(), "runs": runs}, indent=1))
    keys = ("worker", "engine", "every", "rep", "wall_s", "error", "load_s", "bitwise_ok")
    print(json.dumps({k: run[k] for k in keys if k in run})[:600], flush=True)


def environment() -> Run:
    env: Run = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0],
                "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,pcie.link.gen.max,"
                              "pcie.link.width.max", "--format=csv,noheader"],
                             capture_output=True, text=True)
        env["driver_pcie"] = smi.stdout.strip()
    env["cpus"] = os.cpu_count()
    return env


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker_main(args)
    from benchmarks.gpu_report import markdown

    if args.merge:
        parts = [json.loads(p.read_text()) for p in args.merge]
        report = {"args": [p["args"] for p in parts], "env": parts[0]["env"],
                  "runs": [r for p in parts for r in p["runs"]]}
    else:
        args.dir.mkdir(parents=True, exist_ok=True)
        report = {"args": {k: str(v) for k, v in vars(args).items()}, "env": environment(),
                  "runs": run_phases(args)}
        shutil.rmtree(args.shm_dir, ignore_errors=True)
    write_reports(report, args.json, args.markdown, markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
