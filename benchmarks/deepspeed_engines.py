"""DeepSpeed checkpoint engines side by side on this machine: DeepSpeed's default
TorchCheckpointEngine, ckptio's engine (sync and decoupled), and DeepSpeed's Fast, Decoupled and
DataStates engines where they run (on a CPU-only machine they fail; their error is reported).

Owns: the job (2 fresh `python -m benchmarks.deepspeed_engines --worker` ranks per job, started
by benchmarks/harness.py's spawn_ranks, joined over tcp://127.0.0.1, DeepSpeed's CPU
accelerator; each rank's record printed with harness.emit) and the timed phases: save stall
(what save_checkpoint blocks), time to durable (torch engine: plus an fsync of every file it
wrote, which it does not do itself; ckptio sync: the stall; decoupled: until commit_now), load
time in a fresh job (page cache warm), and the save's peak host RSS increase (VmRSS sampled
during the save to durable, less the RSS just before; the larger rank's). Each phase starts
after a barrier; times are the slower rank's.

    python -m benchmarks.deepspeed_engines --mb 400 --reps 3 --stage 2

Writes a markdown table to stdout (medians over --reps fresh jobs per engine: harness.spread,
harness.markdown_table; the timed engines alternate as harness.schedule orders them, the others
run once, in the first repetition).
"""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import sys
import threading
import time
from typing import Any

from benchmarks import harness, worker_env

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
    harness.emit(out if dist.get_rank() == 0 else {"rank": dist.get_rank()})  # every rank's
    os._exit(0)  # DeepSpeed's writer processes and threads: the job is over


def _job(engine: str, phase: str, directory: str, args: argparse.Namespace) -> dict[str, Any]:
    """One job of 2 ranks (harness.spawn_ranks) -> rank 0's record, or the first failed
    rank's error."""
    port = 29500 + (os.getpid() + int(time.time())) % 2000
    env = {**worker_env(), "DS_ACCELERATOR": "cpu", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "WORLD_SIZE": "2", "CROSS_RANK": "0", "CROSS_SIZE": "1",
           "LOCAL_SIZE": "2", "OMP_NUM_THREADS": "1"}
    cmd = [*harness.command("benchmarks.deepspeed_engines"), "--engine", engine, "--phase",
           phase, "--dir", directory, "--mb", args.mb, "--stage", args.stage]
    ranks = harness.spawn_ranks([str(c) for c in cmd], 2, env=env, timeout=args.timeout, tail=8)
    failed = [run for run in ranks if "error" in run and "rank" in run]  # no record at all
    if failed:
        return {"error": f"no result: {failed[0]['error'][-800:]}"}
    ranks[0].pop("peak_rss_mib", None)  # the worker's whole-life peak; peak_rss_mb is the save's
    return ranks[0]


def plan(reps: int) -> list[tuple[int, str]]:
    """(rep, engine) in run order: the timed engines every repetition (harness.schedule), the
    others once, after the first repetition's."""
    order = list(harness.schedule(TIMED, reps))
    order[len(TIMED):len(TIMED)] = [(0, e) for e in ENGINES[len(TIMED):]]
    return order


def table(rows: dict[str, list[dict[str, Any]]]) -> str:
    """The markdown table of each engine's medians (or its first error)."""
    lines = []
    for engine, got in rows.items():
        ok = [g for g in got if "error" not in g and "load_s" in g]
        if not ok:
            error = got[0].get("error", "?") if got else "not run"
            lines.append([engine, f"fails: {error[:300]}", "", "", ""])
            continue
        med = {k: (harness.spread(g[k] for g in ok) or {}).get("median", 0.0)
               for k in ("stall_s", "durable_s", "load_s", "peak_rss_mb")}
        lines.append([engine, f"{med['stall_s']:.2f}", f"{med['durable_s']:.2f}",
                      f"{med['load_s']:.2f}", f"{med['peak_rss_mb']:.0f}"])
    return harness.markdown_table(
        ["engine", "save stall s", "durable s", "load s", "peak RSS +MB"], lines, "lllll")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--engine", default="torch", choices=ENGINES)
    parser.add_argument("--phase", default="save", choices=("save", "load"))
    parser.add_argument("--dir", default="")
    parser.add_argument("--mb", type=int, default=400, help="model parameters, MB of fp32")
    parser.add_argument("--stage", type=int, default=2, choices=(1, 2, 3))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--root", default="/tmp/ckptio-ds-bench")
    parser.add_argument("--timeout", type=float, default=900)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return
    rows: dict[str, list[dict[str, Any]]] = {e: [] for e in ENGINES}
    for rep, engine in plan(args.reps):
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
    print(table(rows))


if __name__ == "__main__":
    main(sys.argv[1:])
