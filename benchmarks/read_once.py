"""Read once, send to the others (issue 67): N gloo ranks on this host loading a replicated (DDP-
like) state in place, cold, from a local directory: the bytes the kernel read from storage per
rank and in all, and the load's time, for ckptio with its shared reads (the default), ckptio
with them off (``Options(broadcast_replicated=False)``), DCP (``dcp.load``, FileSystemReader)
and ckptio loading DCP's own directory (``ckptio_dcp_dir``, shared reads) in the same run.

Owns: one job of ``--ranks`` fresh processes (ckptio.testing.rank_processes: gloo over
127.0.0.1), each building the same ``--gb`` GB state (``--tensors`` float32 tensors, seeded
alike); a save by each engine (ckptio.save and dcp.save, collectively: a replicated tensor is
written once); then per repetition and engine: every rank zeroes its state, rank 0 drops the
page cache (echo 3 > /proc/sys/vm/drop_caches), a barrier, the load (timed on each rank; the
load's time is the slowest rank's), a barrier, and each rank's /proc/self/io read_bytes over
the load (what the kernel fetched from storage for it: a page already cached by another rank's
buffered read is not counted again; each engine loads once unmeasured first, so the loaders'
code pages, faulted in then, are not counted). Every load is checked bitwise. Does not own: the rule
(ckptio/planning/shared_reads.py, ckptio/distributed/).

    python -m benchmarks.read_once --ranks 4 --gb 0.4 --reps 3 --dir /tmp/read-once \
        --json docs/results/i67/read_once.json --markdown docs/results/i67/read_once.md
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import harness, shown_path, write_reports

ENGINES = ("ckptio", "ckptio_each_reads", "dcp", "ckptio_dcp_dir")


def state(gb: float, tensors: int) -> dict[str, torch.Tensor]:
    """The same ``gb`` GB on every rank: ``tensors`` float32 tensors, seeded alike."""
    g = torch.Generator().manual_seed(0)
    each = int(gb * 1e9) // 4 // tensors
    return {f"layer{i}.weight": torch.randn(each, generator=g) for i in range(tensors)}


def disk_read_so_far() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))


def drop_caches_on_all(rank: int) -> None:
    """Rank 0 drops the page cache (benchmarks/harness.py's ``cold``: drop_caches, as root)
    between two barriers: every rank's next read is cold."""
    import torch.distributed as dist

    dist.barrier()
    if rank == 0:
        harness.cold()
    dist.barrier()


def _load(engine: str, path: Path, dest: dict[str, torch.Tensor]) -> None:
    import ckptio

    if engine == "dcp":
        import torch.distributed.checkpoint as dcp

        dcp.load(dest, storage_reader=dcp.FileSystemReader(str(path)))
        return
    options = ckptio.Options(broadcast_replicated=engine != "ckptio_each_reads")
    ckptio.load(str(path), dest, options=options)


def job(rank: int, world: int, root: str, gb: float, tensors: int, reps: int) -> list[dict[str, Any]]:
    """One rank: save with each engine, then ``reps`` cold loads of each, interleaved."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import ckptio

    expect = state(gb, tensors)
    paths = {"ckptio": Path(root) / "ckptio", "dcp": Path(root) / "dcp"}
    ckptio.save(expect, str(paths["ckptio"]))
    dcp.save(expect, storage_writer=dcp.FileSystemWriter(str(paths["dcp"])))
    dest = {k: torch.empty_like(v) for k, v in expect.items()}
    for engine in ENGINES:  # each loader's code run once, unmeasured: its pages stay mapped
        _load(engine, paths["dcp" if "dcp" in engine else "ckptio"], dest)  # through the drops
    rows = []
    for rep, engine in harness.schedule(ENGINES, reps):  # the order reversed on odd reps
        for t in dest.values():
            t.zero_()
        drop_caches_on_all(rank)
        before, t0 = disk_read_so_far(), time.perf_counter()
        _load(engine, paths["dcp" if "dcp" in engine else "ckptio"], dest)
        seconds = time.perf_counter() - t0
        read = disk_read_so_far() - before
        dist.barrier()
        ok = all(torch.equal(dest[k], v) for k, v in expect.items())
        rows.append({"rep": rep, "engine": engine, "rank": rank, "seconds": seconds,
                     "read_bytes": read, "bitwise_ok": ok})
    return rows


def summary(runs: list[dict[str, Any]], ranks: int, nbytes: int) -> list[dict[str, Any]]:
    """Per engine: the load's time (the slowest rank's, median and range over repetitions),
    the bytes read from storage by all ranks (median) and by each, and the bitwise check."""
    out = []
    for engine in ENGINES:
        mine = [r for r in runs if r["engine"] == engine]
        reps = sorted({r["rep"] for r in mine})
        per_rep = [[r for r in mine if r["rep"] == rep] for rep in reps]
        times = harness.spread(max(r["seconds"] for r in rows) for rows in per_rep)
        totals = harness.spread(sum(r["read_bytes"] for r in rows) for rows in per_rep)
        assert times is not None and totals is not None  # every rank returns every row
        per_rank = [statistics.median(r["read_bytes"] for r in mine if r["rank"] == k)
                    for k in range(ranks)]
        out.append({"engine": engine, "load_s": times["median"],
                    "load_s_range": [times["min"], times["max"]],
                    "read_mb": totals["median"] / 1e6,
                    "read_x": totals["median"] / nbytes,
                    "per_rank_read_mb": [b / 1e6 for b in per_rank],
                    "bitwise_ok": all(r["bitwise_ok"] for r in mine)})
    return out


def markdown(rows: list[dict[str, Any]], args: argparse.Namespace, nbytes: int) -> str:
    head = (f"{args.ranks} gloo ranks on one host, a replicated {nbytes / 1e6:.0f} MB state "
            f"({args.tensors} tensors), page cache dropped before each load, medians of "
            f"{args.reps} (dir {shown_path(args.dir)})")
    table = harness.markdown_table(
        ["engine", "load s (range)", "read from storage MB", "x the checkpoint", "per rank MB",
         "bitwise"],
        [(r["engine"], f"{r['load_s']:.3f} ({r['load_s_range'][0]:.3f}-{r['load_s_range'][1]:.3f})",
          f"{r['read_mb']:.0f}", f"{r['read_x']:.2f}",
          " / ".join(f"{b:.0f}" for b in r["per_rank_read_mb"]), r["bitwise_ok"]) for r in rows],
        align="lrrrll")
    return f"{head}\n\n{table}\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.read_once", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--gb", type=float, default=0.4)
    p.add_argument("--tensors", type=int, default=100)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dir", type=Path, default=Path("/tmp/read-once"))
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--json", type=Path)
    p.add_argument("--markdown", type=Path)
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    from ckptio.testing.rank_processes import run_ranks

    shutil.rmtree(args.dir, ignore_errors=True)
    args.dir.mkdir(parents=True)
    try:
        results = run_ranks(args.ranks, job, str(args.dir), args.gb, args.tensors, args.reps,
                            timeout_s=args.timeout)
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    runs = [row for rank in range(args.ranks) for row in results[rank]]
    nbytes = sum(t.numel() * 4 for t in state(args.gb, args.tensors).values())
    rows = summary(runs, args.ranks, nbytes)
    doc = {"argv": sys.argv[1:] if argv is None else argv, "bytes": nbytes,
           "summary": rows, "runs": runs}
    write_reports(doc, args.json, args.markdown, markdown(rows, args, nbytes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
