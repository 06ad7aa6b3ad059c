"""Host memory per node (issue 67): N ranks of one job on this host, each async-saving its own
state, against the host's staging budget (Options.host_budget_bytes, shared by the host's
ranks: ckptio/io/hostbudget.py).

Owns: one job of ``--ranks`` fresh processes (a gloo group, each told what torchrun tells a
rank: RANK, LOCAL_RANK, LOCAL_WORLD_SIZE, WORLD_SIZE, MASTER_ADDR/PORT), each building a
``--gb`` GB state of its own (ckptio/tuning/state.py, seeded by rank; on CUDA with
``--device cuda``, one GPU per local rank where there are enough), then ``--saves`` eager
async_save calls into one checkpoint per save, each waited for, and a load of the last one
checked against the state; each rank reports its staging (Checkpointer.staging_nbytes) and
its peak RSS. Meanwhile this process samples every rank's /proc status (VmRSS, VmPin, VmLck)
and the host's MemAvailable; it reports the peaks of their sums against the budget (the
given one, or the default: half of MemAvailable at the start). Does not own: the budget's
rule (ckptio) or the state.

    python -m benchmarks.node_budget --ranks 4 --gb 2 --budget-gb 4 --json node_budget.json
    python -m benchmarks.node_budget --ranks 4 --gb 2            # the default budget
    CKPTIO_POOL_BYTES=4194304 CKPTIO_BUFFER_BYTES=1048576 python -m benchmarks.node_budget \
        --ranks 4 --gb 0.05 --budget-gb 0.1 --saves 1                   # a smoke, seconds
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import harness, shown_path, worker_env, write_reports
from benchmarks.engines import reset_peak_rss, status_kib

GB = 1e9
SAMPLE_S = 0.02  # how often the ranks' /proc status is read
FIELDS = ("VmRSS", "VmPin", "VmLck")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.node_budget", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=4, help="ranks on this host (default 4)")
    p.add_argument("--gb", type=float, default=2.0, help="each rank's state in GB (default 2)")
    p.add_argument("--budget-gb", type=float, default=None,
                   help="Options.host_budget_bytes for the host, in GB (default: ckptio's "
                        "automatic budget, half of the memory available)")
    p.add_argument("--saves", type=int, default=2, help="async saves per rank (default 2)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where each rank's state lives (default cpu)")
    p.add_argument("--dir", type=Path, default=Path("bench-data/node_budget"),
                   help="scratch directory (removed at the end)")
    p.add_argument("--json", type=Path, help="write the runs and the summary here")
    p.add_argument("--markdown", type=Path, help="write the summary table here")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds the job may run")
    p.add_argument("--worker", type=int, help=argparse.SUPPRESS)  # this rank
    return p.parse_args(argv)


# ---------------------------------------------------------------- one rank


def worker(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    import ckptio
    from ckptio.tuning import state as states

    rank = args.worker
    dist.init_process_group("gloo", init_method="env://")
    src = states.build_state(args.gb, seed=rank)
    if args.device == "cuda":
        device = torch.device("cuda", rank % max(1, torch.cuda.device_count()))
        src = {k: _to(v, device) for k, v in src.items()}
    given = {} if args.budget_gb is None else {"host_budget_bytes": int(args.budget_gb * GB)}
    ck = ckptio.Checkpointer(ckptio.Options.from_env(use_profile=False, **given))
    rss0 = status_kib("VmRSS")
    reset_peak_rss()
    staging, calls = [], []
    for i in range(args.saves):
        dist.barrier()
        t0 = time.perf_counter()
        handle = ck.async_save(src, args.dir / f"s{i}")
        calls.append(time.perf_counter() - t0)
        staging.append(ck.staging_nbytes)
        handle.wait()
        staging.append(ck.staging_nbytes)
    peak_rss_mib = (status_kib("VmHWM") - rss0) / 1024
    loaded = ck.load(args.dir / f"s{args.saves - 1}")
    exact = states.digest(_to(src, torch.device("cpu"))) == states.digest(loaded)
    ck.close()
    dist.barrier()
    dist.destroy_process_group()
    return {"rank": rank, "bytes": states.tensor_nbytes(src), "staging_bytes": max(staging),
            "pool_bytes": ck.options.pool_bytes,
            "call_s": calls, "peak_rss_growth_mib": peak_rss_mib, "exact": exact}


def _to(value: Any, device: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    if isinstance(value, list):
        return [_to(v, device) for v in value]
    return value


# ---------------------------------------------------------------- the job


def _proc_kib(pid: int) -> dict[str, int]:
    """The FIELDS of process ``pid``'s status, in KiB (0 for a field absent or a process gone)."""
    got = dict.fromkeys(FIELDS, 0)
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                name = line.split(":", 1)[0]
                if name in got:
                    got[name] = int(line.split()[1])
    except OSError:
        pass
    return got


def _available() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))


def run_job(args: argparse.Namespace) -> dict[str, Any]:
    """Start the ranks, sample them until they exit; -> their answers and the sampled peaks."""
    from benchmarks.train_engines import free_port

    env = {**worker_env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "WORLD_SIZE": str(args.ranks), "LOCAL_WORLD_SIZE": str(args.ranks),
           "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "benchmarks.node_budget", "--gb", repr(args.gb),
            "--saves", str(args.saves), "--device", args.device, "--dir", str(args.dir)]
    if args.budget_gb is not None:
        argv += ["--budget-gb", repr(args.budget_gb)]
    available0 = _available()
    peaks = dict.fromkeys(FIELDS, 0)
    least_available = [available0]

    def sample(pids: list[int]) -> None:
        sampled = [_proc_kib(pid) for pid in pids]
        for name in FIELDS:
            peaks[name] = max(peaks[name], sum(s[name] for s in sampled))
        least_available[0] = min(least_available[0], _available())

    ranks = harness.spawn_ranks(lambda r: [*argv, "--worker", str(r)], args.ranks, env=env,
                                timeout=args.timeout, tail=40, sample=sample, every_s=SAMPLE_S)
    failed = [r for r in ranks if "error" in r]
    if failed:  # a killed rank first (the kernel's OOM killer, see dmesg): the others follow
        raise SystemExit("\n".join(f"rank {r['rank']} failed: {r['error']}" for r in sorted(
            failed, key=lambda r: "killed by signal 9" not in r["error"])))
    budget = int(args.budget_gb * GB) if args.budget_gb is not None else available0 // 2
    return {"ranks": ranks, "budget_bytes": budget, "budget_given": args.budget_gb is not None,
            "available_start_bytes": available0,
            "available_drop_bytes": available0 - least_available[0],
            "peak_sum_mib": {name: kib / 1024 for name, kib in peaks.items()}}


def report(run: dict[str, Any], args: argparse.Namespace) -> str:
    staging = sum(r["staging_bytes"] for r in run["ranks"])
    budget = run["budget_bytes"]
    kind = "given" if run["budget_given"] else "default: half of MemAvailable at the start"
    peak = run["peak_sum_mib"]
    out = [f"# {args.ranks} ranks on one host, {args.gb} GB each, {args.saves} async saves, "
           f"{args.device}; scratch {shown_path(args.dir)}", "",
           f"budget {budget / GB:.3f} GB ({kind}); floor: {args.ranks} x Options.pool_bytes "
           f"= {args.ranks * run['ranks'][0]['pool_bytes'] / GB:.3f} GB (a pool never shrinks "
           "below it, nor grows past a state's size)", "",
           "| measure (host, all ranks) | GB | of the budget |", "|---|---:|---:|",
           f"| staging held (sum of staging_nbytes) | {staging / GB:.3f} | "
           f"{staging / budget:.2f} |"]
    for name in FIELDS:
        out.append(f"| peak sum of {name} | {peak[name] * 2**20 / GB:.3f} | "
                   f"{peak[name] * 2**20 / budget:.2f} |")
    drop = run["available_drop_bytes"]
    out.append(f"| MemAvailable drop | {drop / GB:.3f} | {drop / budget:.2f} |")
    out += ["", "| rank | state GB | staging GB | peak RSS growth GB | loads exactly |",
            "|---:|---:|---:|---:|---|"]
    out += [f"| {r['rank']} | {r['bytes'] / GB:.3f} | {r['staging_bytes'] / GB:.3f} | "
            f"{r['peak_rss_growth_mib'] * 2**20 / GB:.3f} | {r['exact']} |" for r in run["ranks"]]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        return harness.emit(worker(args))
    if args.ranks < 1 or args.saves < 1:
        raise SystemExit("--ranks and --saves: at least 1")
    shutil.rmtree(args.dir, ignore_errors=True)
    args.dir.mkdir(parents=True)
    try:
        run = run_job(args)
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    text = report(run, args)
    write_reports({"argv": sys.argv, "run": run}, args.json, args.markdown, text)
    return 0 if all(r["exact"] for r in run["ranks"]) else 1


if __name__ == "__main__":
    sys.exit(main())
