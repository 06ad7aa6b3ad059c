"""Redundancy benchmark: the memory tier protected across hosts (partner copies, XOR parity)
against no redundancy and NVRx's clique replication, on real hosts made on this machine
(ckptio.testing.multihost: network namespaces with their own tmpfs where permitted), checkpointing
every step (docs/BENCH_REDUNDANCY.md).

Per (engine, repetition): fresh hosts; a training job (benchmarks/redundancy_ranks.py); the
host memory each host's tmpfs holds at the end; then one host wiped (lost and replaced) and a
fresh job restores (timed); then, for the engines of ``--disk-restores``, every host's memory
wiped and a fresh job restores from the disk tier (timed). In the same run: the ceilings
(memcpy and XOR of one rank's state, and the disk's cold read of it).

    python -m benchmarks.redundancy --hosts 4 --ranks-per-host 1 --gb 0.01 --steps 20 \
        --reps 3 --json docs/results/redundancy/redundancy.json \
        --markdown docs/results/redundancy/redundancy.md

The engines run on benchmarks/harness.py's schedule (every engine once per repetition, the
order reversed on odd repetitions; ``harness.repeat``), each restore after ``harness.cold``.

Owns: which engine runs when on fresh hosts, the wipes, the measurements outside the ranks, the
ceilings. Does not own: the schedule, the page-cache drop (benchmarks/harness.py), the ranks'
bodies (redundancy_ranks.py), the report (redundancy_report.py), the hosts
(ckptio/testing/multihost.py).
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import REPO_ROOT, harness, write_reports
from benchmarks.redundancy_ranks import NVRX, TIERED, restore_rank, train_rank

ENGINES = ("none", "off", "partners", "partners2", "parity", "parity2", NVRX)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.redundancy",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--ranks-per-host", default="1", help="one count, or one per host: 1,2,1,2")
    p.add_argument("--gb", type=float, default=0.01, help="each rank's state in GB (AdamW in)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--every", type=int, default=10, help="the disk tier's interval K")
    p.add_argument("--k", type=int, default=3, help="parity group size (hosts)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--engines", default=",".join(ENGINES))
    p.add_argument("--asynchronous", action="store_true", help="mgr.save(asynchronous=True)")
    p.add_argument("--lost", default="1", help="the host wiped, or hosts: 1,3")
    p.add_argument("--disk-restores", default="off,parity", help="engines whose runs also "
                   "time a restore with every host's memory wiped (from the disk tier)")
    p.add_argument("--sharded", action="store_true", help="a Shard(0) DTensor state of --gb "
                   "per rank (FSDP2's layout), no training compute; ckptio's engines only")
    p.add_argument("--fewer-hosts", action="store_true", help="also restart on the hosts left "
                   "after the loss (another rank count: resharded from memory; --sharded)")
    p.add_argument("--mode", choices=("auto", "netns", "simulated"), default="auto")
    p.add_argument("--link-gbit", type=float, help="each host's outgoing link limited to this "
                   "many Gbit/s (tc tbf on its veth; netns mode only)")
    p.add_argument("--dir", type=Path, default=Path("bench-redundancy"))
    p.add_argument("--timeout", type=float, default=400, help="seconds per job")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path)
    p.add_argument("--markdown", type=Path)
    return p.parse_args(argv)


def _counts(args: argparse.Namespace) -> list[int]:
    counts = [int(c) for c in args.ranks_per_host.split(",")]
    return counts * args.hosts if len(counts) == 1 else counts


def _cfg(args: argparse.Namespace, engine: str, work: Path) -> dict[str, Any]:
    return {"engine": engine, "gb": args.gb, "steps": args.steps, "every": args.every,
            "k": args.k, "batch": args.batch, "seq": args.seq, "seed": args.seed,
            "asynchronous": args.asynchronous, "dir": str(work), "sharded": args.sharded}


def _bytes_under(root: str) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            try:
                total += os.stat(os.path.join(dirpath, name)).st_blocks * 512
            except OSError:
                pass
    return total


def _restore(hosts: Any, cfg: dict[str, Any], counts: list[int], args: argparse.Namespace,
             what: str) -> dict[str, Any]:
    harness.cold()
    t0 = time.perf_counter()
    ranks = hosts.run(restore_rank, cfg, ranks_per_host=counts, timeout_s=args.timeout)
    return {"what": what, "job_s": time.perf_counter() - t0, "ranks": ranks}


def one_run(args: argparse.Namespace, engine: str, rep: int, mode: str) -> dict[str, Any]:
    from ckptio.testing.multihost import Hosts

    counts = _counts(args)
    work = (args.dir / f"{engine}-r{rep}").resolve()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    cfg = _cfg(args, engine, work)
    lost = [int(h) for h in args.lost.split(",")]
    run: dict[str, Any] = {"engine": engine, "rep": rep, "counts": counts, "lost": lost}
    # a host's tmpfs holds its ranks' kept and new steps, the ring's slot and the copies or
    # parity it keeps for others (partners: as much again)
    tmpfs = f"{max(2, math.ceil(8 * args.gb * max(counts)))}g"
    with Hosts(args.hosts, work / "hosts", mode=mode, tmpfs_size=tmpfs,
               link_bps=args.link_gbit * 1e9 if args.link_gbit else None) as hosts:
        run["mode"], run["hosts"] = hosts.mode, hosts.describe()
        try:
            run["ranks"] = hosts.run(train_rank, cfg, ranks_per_host=counts,
                                     timeout_s=args.timeout)
        except AssertionError as exc:  # RanksFailed: recorded, the report says so
            run["error"] = _cut(str(exc))
            return run
        run["shm_bytes"] = [_bytes_under(h.shm_dir) for h in hosts.hosts]
        if engine == "none":
            return run
        restores = []
        for host in lost:
            hosts.wipe(host)
        if engine != NVRX or rep == 0:  # NVRx's fails the same way each time (on CPU)
            restores.append(_guarded(_restore, hosts, cfg, counts, args, "host_lost"))
        if args.fewer_hosts and engine in ("partners", "parity"):
            for host in lost:  # what the restore above brought back is lost again
                hosts.wipe(host)
            left = [0 if i in lost else c for i, c in enumerate(counts)]
            smaller = {**cfg, "saved_world": sum(counts), "k": min(cfg["k"], len(counts) - 2)}
            restores.append(_guarded(_restore, hosts, smaller, left, args, "fewer_hosts"))
        if engine in TIERED and engine in args.disk_restores.split(","):
            for i in range(len(hosts.hosts)):
                hosts.wipe(i)
            restores.append(_guarded(_restore, hosts, cfg, counts, args, "memory_lost"))
        run["restores"] = restores
    shutil.rmtree(work, ignore_errors=True)
    return run


def _guarded(fn: Any, *args: Any) -> dict[str, Any]:
    try:
        return fn(*args)
    except AssertionError as exc:  # RanksFailed
        return {"what": args[-1], "error": _cut(str(exc))}


def _cut(text: str, keep: int = 3000) -> str:
    """The first and last ``keep`` characters (the first error and how the job ended)."""
    return text if len(text) <= 2 * keep else f"{text[:keep]}\n[...]\n{text[-keep:]}"


def ceilings(args: argparse.Namespace, nbytes: int) -> dict[str, Any]:
    """memcpy and XOR of one rank's state (the parity encode's floor), and the disk's cold read
    of it (tuning/ceiling.py), measured now."""
    import torch

    from ckptio.tuning.ceiling import read_ceiling, write_ceiling

    a = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    b, out = torch.randint(0, 255, (nbytes,), dtype=torch.uint8), torch.empty(nbytes,
                                                                              dtype=torch.uint8)
    best_copy = best_xor = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        out.copy_(a)
        best_copy = min(best_copy, time.perf_counter() - t0)
        t0 = time.perf_counter()
        torch.bitwise_xor(a, b, out=out)
        best_xor = min(best_xor, time.perf_counter() - t0)
    path = args.dir / "ceiling.bin"
    write_ceiling(path, nbytes)
    read = read_ceiling(path, idle=1.0)
    path.unlink()
    return {"bytes": nbytes, "memcpy_gbps": nbytes / best_copy / 1e9,
            "xor_gbps": nbytes / best_xor / 1e9,
            "disk_read_gbps": read["bytes"] / read["seconds"] / 1e9,
            "disk_read_s": read["seconds"] * nbytes / read["bytes"]}


def main(argv: list[str] | None = None) -> int:
    from benchmarks.redundancy_report import markdown, summarize
    from ckptio.testing.multihost import best_mode, netns_possible
    from ckptio.tuning.state import gpt_config, state_nbytes

    args = parse_args(argv)
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))  # the ranks import benchmarks.* through it
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mode = best_mode() if args.mode == "auto" else args.mode
    engines = [e for e in args.engines.split(",") if e]
    unknown = sorted(set(engines) - set(ENGINES))
    if unknown:
        raise SystemExit(f"--engines: unknown {unknown}; known: {', '.join(ENGINES)}")
    args.dir.mkdir(parents=True, exist_ok=True)
    runs = harness.repeat(engines, args.reps, lambda engine, rep: one_run(args, engine, rep, mode),
                          progress=lambda run, i, n: f"run {i}/{n}: rep {run['rep']} "
                          f"{run['engine']}{' failed' if 'error' in run else ''}")
    result = {"args": {k: str(v) for k, v in vars(args).items()}, "mode": mode,
              "why_not_netns": netns_possible() if mode != "netns" else None,
              "ceilings": ceilings(args, state_nbytes(gpt_config(args.gb))), "runs": runs}
    result["summary"] = summarize(result)
    text = markdown(result, " ".join(["python -m benchmarks.redundancy", *(argv or sys.argv[1:])]))
    write_reports(result, args.json, args.markdown, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
