"""DeepSpeed checkpoint engines side by side on this machine: DeepSpeed's default
TorchCheckpointEngine, ckptio's engine (sync and decoupled), and DeepSpeed's Fast, Decoupled and
DataStates engines where they run (on a CPU-only machine they fail; their error is reported).

Owns: the launcher (2 fresh `python -m benchmarks.deepspeed_engines --worker` processes per
job, joined over tcp://127.0.0.1, DeepSpeed's CPU accelerator) and the timed phases: save stall
(what save_checkpoint blocks), time to durable (torch engine: plus an fsync of every file it
wrote, which it does not do itself; ckptio sync: the stall; decoupled: until commit_now), load
time in a fresh job (page cache warm), and the save's peak host RSS increase (VmRSS sampled
during the save to durable, less the RSS just before; the larger rank's). Each phase starts
after a barrier; times are the slower rank's.

    python -m benchmarks.deepspeed_engines --mb 400 --reps 3 --stage 2

Writes a markdown table to stdout (medians over --reps fresh jobs per engine).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

ENGINES = ("torch", "ckptio", "ckptio-decoupled", "fast", "fast-decoupled", "datastates")
TIMED = ("torch", "ckptio", "ckptio-decoupled")


def _config(engine: str, stage: int) -> dict[str, Any]:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": stage}, "steps_per_print": 10**6}
    if engine.startswith("fast"):
        config["checkpoint"] = {"writer": {"type": "fast", "decoupled": engine.endswith("coupled"),
                                           "data_parallel": "socket"}}
    if engine == "datastates":
        config["datastates_ckpt"] = {"enabled": True}
    return config


def _engine(engine: str, stage: int, mb: int) -> Any:
    import deepspeed
    import torch

    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None  # inference op
    torch.manual_seed(0)
    width = 2048
    layers = max(1, mb * 2**20 // (4 * width * width))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    ds, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                  config=_config(engine, stage))
    if engine.startswith("ckptio"):
        import ckptio.deepspeed_engine

        ckptio.deepspeed_engine.use(ds, decoupled=engine == "ckptio-decoupled",
                                   allow_pickle=True)
    for _ in range(2):
        loss = ds(torch.randn(2, width)).pow(2).mean()
        ds.backward(loss)
        ds.step()
    return ds


def _slowest(value: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


class _PeakRss:
    """The highest VmRSS of this process while the block runs, sampled every few ms."""

    def __enter__(self) -> _PeakRss:
        self.before = self.peak = _rss_mb()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, _rss_mb())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_mb())


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _fsync_tree(path: str) -> None:
    for here, _dirs, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(here, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    dist.init_process_group("gloo")
    out: dict[str, Any] = {}
    try:
        ds = _engine(args.engine, args.stage, args.mb)
        if args.phase == "save":
            dist.barrier()
            with _PeakRss() as rss:
                t0 = time.perf_counter()
                ds.save_checkpoint(args.dir, tag="bench")
                stall = time.perf_counter() - t0
                if args.engine == "ckptio-decoupled":
                    import ckptio.deepspeed_engine

                    ckptio.deepspeed_engine.commit_now(ds)
                elif args.engine == "torch":
                    _fsync_tree(os.path.join(args.dir, "bench"))
                durable = time.perf_counter() - t0
            out = {"stall_s": _slowest(stall), "durable_s": _slowest(durable),
                   "peak_rss_mb": _slowest(rss.peak - rss.before)}
            ds.destroy()
        else:
            dist.barrier()
            t0 = time.perf_counter()
            path, _ = ds.load_checkpoint(args.dir, tag="bench")
            assert path is not None
            out = {"load_s": _slowest(time.perf_counter() - t0)}
    except Exception as exc:  # noqa: BLE001 - the engine's own error is the result
        out = {"error": f"{type(exc).__name__}: {exc}"}
    if dist.get_rank() == 0:
        with open(args.result, "w") as f:
            json.dump(out, f)
    os._exit(0)  # DeepSpeed's writer processes and threads: the job is over


def _job(engine: str, phase: str, directory: str, args: argparse.Namespace) -> dict[str, Any]:
    result = tempfile.mktemp(prefix="ds-bench-", suffix=".json")
    port = 29500 + (os.getpid() + int(time.time())) % 2000
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "WORLD_SIZE": "2", "CROSS_RANK": "0", "CROSS_SIZE": "1",
           "LOCAL_SIZE": "2", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "benchmarks.deepspeed_engines", "--worker", "--engine", engine,
           "--phase", phase, "--dir", directory, "--result", result, "--mb", str(args.mb),
           "--stage", str(args.stage)]
    procs = [subprocess.Popen(cmd, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
             for r in range(2)]
    errs = [p.communicate(timeout=args.timeout)[1] for p in procs]
    if not os.path.exists(result):
        return {"error": f"no result: {errs[0].decode(errors='replace')[-800:]}"}
    with open(result) as f:
        got: dict[str, Any] = json.load(f)
    os.remove(result)
    return got


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--engine", default="torch", choices=ENGINES)
    parser.add_argument("--phase", default="save", choices=("save", "load"))
    parser.add_argument("--dir", default="")
    parser.add_argument("--result", default="")
    parser.add_argument("--mb", type=int, default=400, help="model parameters, MB of fp32")
    parser.add_argument("--stage", type=int, default=2, choices=(1, 2, 3))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--root", default="/tmp/ckptio-ds-bench")
    parser.add_argument("--timeout", type=float, default=900)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    rows: dict[str, list[dict[str, Any]]] = {e: [] for e in ENGINES}
    for rep in range(args.reps):
        order = TIMED if rep % 2 == 0 else TIMED[::-1]
        for engine in order + (ENGINES[len(TIMED):] if rep == 0 else ()):
            directory = os.path.join(args.root, engine)
            shutil.rmtree(directory, ignore_errors=True)
            saved = _job(engine, "save", directory, args)
            if "error" not in saved:
                saved.update(_job(engine, "load", directory, args))
            rows[engine].append(saved)
            print(f"# rep {rep} {engine}: {saved}", file=sys.stderr, flush=True)
            shutil.rmtree(directory, ignore_errors=True)
    print(f"ZeRO stage {args.stage}, {args.mb} MB of fp32 parameters, 2 gloo ranks, "
          f"medians of {args.reps} fresh jobs\n")
    print("| engine | save stall s | durable s | load s | peak RSS +MB |\n| --- | --- | --- | --- | --- |")
    for engine, got in rows.items():
        ok = [g for g in got if "error" not in g and "load_s" in g]
        if not ok:
            error = got[0].get("error", "?") if got else "not run"
            print(f"| {engine} | fails: {error[:300]} | | | |")
            continue
        med = {k: statistics.median(g[k] for g in ok) for k in ok[0]}
        print(f"| {engine} | {med['stall_s']:.2f} | {med['durable_s']:.2f} | "
              f"{med['load_s']:.2f} | {med['peak_rss_mb']:.0f} |")


if __name__ == "__main__":
    main()
