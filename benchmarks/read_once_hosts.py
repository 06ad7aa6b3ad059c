"""Read once, send to the others, across hosts (issue 67): ``--hosts`` namespace hosts (one rank
each) loading a replicated (DDP-like) and an HSDP-like state (2 replicas of 2 shards, DTensor on
a 2 x 2 mesh) in place, cold, from a SeaweedFS S3 server on a host of its own whose link to
each host is held to ``--storage-gbit`` (the host-to-host links are not limited, as a
cluster's are faster than its share of storage), and from a local directory: the load's time
and the bytes each rank read from storage, for ckptio with shared reads (the default), ckptio
with them off (``Options(broadcast_replicated=False)``) and DCP (``dcp.load``; local directory
only: DCP has no S3 reader in its base install) in the same run.

Owns: the hosts (ckptio.testing.multihost: network namespaces; refused where they cannot be
made), the storage host's shaping (an htb class per destination host on its eth0), the server
in its namespace (ckptio.testing.s3server ``netns=``), one job of every rank: each builds the
layouts' states (seeded alike), saves each with each engine and source, then per repetition,
layout, source and engine zeroes its state, drops the page cache (rank 0; the hosts share one
kernel), loads (timed on each rank; a load's time is the slowest rank's), checks it bitwise and
counts the bytes read from storage: for S3 the bytes of the ranged GETs its store's files
submitted, for the directory /proc/self/io read_bytes. Does not own: the rule
(ckptio/planning/shared_reads.py, ckptio/distributed/).

    python -m benchmarks.read_once_hosts --hosts 4 --gb 0.2 --reps 3 --storage-gbit 1 \\
        --dir /tmp/read-once-hosts --json docs/results/i67/read_once_hosts.json \\
        --markdown docs/results/i67/read_once_hosts.md
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import shown_path, write_reports
from benchmarks.read_once import drop_caches_on_all, disk_read_so_far

ENGINES = ("ckptio", "ckptio_each_reads", "dcp")
LAYOUTS = ("replicated", "hsdp")
SOURCES = ("s3", "dir")


def _full(gb: float, tensors: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    each = int(gb * 1e9) // 4 // tensors // 4 * 4  # divisible by the two shards
    return {f"layer{i}.weight": torch.randn(each, generator=g) for i in range(tensors)}


def _state(layout: str, gb: float, tensors: int) -> dict[str, Any]:
    full = _full(gb, tensors)
    if layout == "replicated":
        return full
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    return {k: distribute_tensor(v, mesh, [Replicate(), Shard(0)]) for k, v in full.items()}


def _local(t: Any) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _where(source: str, layout: str, engine: str, root: str) -> str:
    name = f"{layout}-{'dcp' if engine == 'dcp' else 'ckptio'}"
    return f"s3://ckpt/{name}" if source == "s3" else f"{root}/{name}"


def _runs(rank: int, root: str, gb: float, tensors: int, reps: int) -> list[dict[str, Any]]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import ckptio
    from ckptio.testing.readcount import count_store_reads

    store_reads = count_store_reads()
    rows = []
    for layout in LAYOUTS:
        expect = _state(layout, gb, tensors)
        for source in SOURCES:
            ckptio.save(expect, _where(source, layout, "ckptio", root))
            if source == "dir":
                dcp.save(expect, storage_writer=dcp.FileSystemWriter(
                    _where(source, layout, "dcp", root)))
        dest = _state(layout, gb, tensors)
        for rep in range(reps):
            for source in SOURCES:
                for engine in ENGINES:
                    if engine == "dcp" and source == "s3":
                        continue
                    for t in dest.values():
                        _local(t).zero_()
                    drop_caches_on_all(rank)
                    where = _where(source, layout, engine, root)
                    before, counted, t0 = disk_read_so_far(), store_reads(), time.perf_counter()
                    if engine == "dcp":
                        dcp.load(dest, storage_reader=dcp.FileSystemReader(where))
                    else:
                        ckptio.load(where, dest, options=ckptio.Options(
                            broadcast_replicated=engine == "ckptio"))
                    seconds = time.perf_counter() - t0
                    read = (store_reads() - counted) if source == "s3" else disk_read_so_far() - before
                    dist.barrier()
                    ok = all(torch.equal(_local(dest[k]), _local(v)) for k, v in expect.items())
                    rows.append({"rep": rep, "layout": layout, "source": source,
                                 "engine": engine, "rank": rank, "seconds": seconds,
                                 "read_bytes": read, "bitwise_ok": ok})
    return rows


def job(rank: int, world: int, root: str, gb: float, tensors: int, reps: int,
        s3_env: dict[str, str]) -> list[dict[str, Any]]:
    """One rank (in the job's process group): the S3 server's address and keys from
    ``s3_env``, then every run."""
    import os

    os.environ.update(s3_env)
    return _runs(rank, root, gb, tensors, reps)


def _shape(netns: str, addrs: list[str], gbit: float) -> None:
    """The storage host's link to each of ``addrs`` held to ``gbit`` Gbit/s (htb, one class
    per destination; other traffic unlimited)."""
    def tc(*args: str) -> None:
        subprocess.run(["ip", "netns", "exec", netns, "tc", *args], check=True,
                       capture_output=True, timeout=30)

    tc("qdisc", "add", "dev", "eth0", "root", "handle", "1:", "htb", "default", "99")
    tc("class", "add", "dev", "eth0", "parent", "1:", "classid", "1:99", "htb", "rate",
       "100gbit")
    for i, addr in enumerate(addrs):
        rate = f"{int(gbit * 1000)}mbit"
        tc("class", "add", "dev", "eth0", "parent", "1:", "classid", f"1:{10 + i}", "htb",
           "rate", rate, "ceil", rate)
        tc("filter", "add", "dev", "eth0", "protocol", "ip", "parent", "1:", "prio", "1",
           "u32", "match", "ip", "dst", f"{addr}/32", "flowid", f"1:{10 + i}")


def summary(runs: list[dict[str, Any]], ranks: int, nbytes: int) -> list[dict[str, Any]]:
    out = []
    for layout in LAYOUTS:
        for source in SOURCES:
            for engine in ENGINES:
                mine = [r for r in runs if (r["layout"], r["source"], r["engine"]) ==
                        (layout, source, engine)]
                if not mine:
                    continue
                reps = sorted({r["rep"] for r in mine})
                per_rep = [[r for r in mine if r["rep"] == rep] for rep in reps]
                totals = [sum(r["read_bytes"] for r in rows) for rows in per_rep]
                times = [max(r["seconds"] for r in rows) for rows in per_rep]
                out.append({"layout": layout, "source": source, "engine": engine,
                            "load_s": statistics.median(times),
                            "load_s_range": [min(times), max(times)],
                            "read_mb": statistics.median(totals) / 1e6,
                            "read_x": statistics.median(totals) / nbytes,
                            "per_rank_read_mb": [statistics.median(
                                r["read_bytes"] for r in mine if r["rank"] == k) / 1e6
                                for k in range(ranks)],
                            "bitwise_ok": all(r["bitwise_ok"] for r in mine)})
    return out


def markdown(rows: list[dict[str, Any]], args: argparse.Namespace, nbytes: int,
             hosts: str) -> str:
    lines = [f"{hosts}; storage's link to each host {args.storage_gbit:g} Gbit/s; a "
             f"{nbytes / 1e6:.0f} MB state ({args.tensors} tensors), page cache dropped before "
             f"each load, medians of {args.reps} (dir {shown_path(args.dir)})", "",
             "| layout | source | engine | load s (range) | read from storage MB | x the "
             "checkpoint | per rank MB | bitwise |", "|---|---|---|---:|---:|---:|---|---|"]
    for r in rows:
        lo, hi = r["load_s_range"]
        per = " / ".join(f"{b:.0f}" for b in r["per_rank_read_mb"])
        lines.append(f"| {r['layout']} | {r['source']} | {r['engine']} | {r['load_s']:.3f} "
                     f"({lo:.3f}-{hi:.3f}) | {r['read_mb']:.0f} | {r['read_x']:.2f} | {per} | "
                     f"{r['bitwise_ok']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.read_once_hosts", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hosts", type=int, default=4, help="hosts of one rank (4: the HSDP mesh)")
    p.add_argument("--gb", type=float, default=0.2)
    p.add_argument("--tensors", type=int, default=50)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--storage-gbit", type=float, default=1.0)
    p.add_argument("--dir", type=Path, default=Path("/tmp/read-once-hosts"))
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--json", type=Path)
    p.add_argument("--markdown", type=Path)
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    if args.hosts != 4:
        p.error("--hosts 4: the HSDP layout is a 2 x 2 mesh of one rank per host")
    from benchmarks.read_once_hosts import job as rank_job  # importable by the hosts' ranks
    from ckptio.testing.multihost import Hosts
    from ckptio.testing.s3server import SeaweedServer

    shutil.rmtree(args.dir, ignore_errors=True)
    args.dir.mkdir(parents=True)
    try:
        with Hosts(args.hosts + 1, args.dir / "hosts", mode="netns") as hosts:
            storage = hosts.hosts[-1]
            assert storage.netns is not None
            _shape(storage.netns, [h.addr for h in hosts.hosts[:-1]], args.storage_gbit)
            with SeaweedServer(args.dir / "weed", host=storage.addr,
                               netns=storage.netns) as server:
                results = hosts.run(rank_job, str(args.dir / "data"), args.gb, args.tensors,
                                    args.reps, server.env(),
                                    ranks_per_host=[1] * args.hosts + [0],
                                    timeout_s=args.timeout)
            described = hosts.describe()
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    runs = [row for rank in range(args.hosts) for row in results[rank]]
    nbytes = sum(t.numel() * 4 for t in _full(args.gb, args.tensors).values())
    rows = summary(runs, args.hosts, nbytes)
    doc = {"argv": sys.argv[1:] if argv is None else argv, "bytes": nbytes, "hosts": described,
           "summary": rows, "runs": runs}
    write_reports(doc, args.json, args.markdown, markdown(rows, args, nbytes, described))
    return 0


if __name__ == "__main__":
    sys.exit(main())
