"""Save and load time of a 2-D (FSDP x TP) state on 4 gloo ranks: ckptio against DCP.

    python -m benchmarks.strided --mib 512 --reps 3 --dir bench-data/strided   # docs/BENCH_STRIDED.md

The state: ``--mib`` MiB of float32 weights as FSDP2 lays them out over tensor parallelism on a
2x2 ("dp", "tp") CPU mesh: half column-parallel, ``(_StridedShard(0, sf=2), Shard(0))``, half
row-parallel, ``(Shard(0), Shard(1))``, built with ``distribute_tensor`` (no model: the layout,
not the arithmetic, is what is measured). Each engine saves it (durable: DCP with
``sync_files=True``, ckptio always fsyncs), then loads it cold (each rank evicts the checkpoint's
files from the page cache with posix_fadvise before the phase) into:

* ``2x2``: the saving layout;
* ``fsdp4``: ``Shard(0)`` over 4 ranks (FSDP only);
* ``tp2``: ranks 0 and 1 hold ``Shard(0)`` / ``Shard(1)`` over a 2-rank mesh (TP only), ranks 2
  and 3 of the job load nothing;
* ``one``: rank 0 loads every tensor whole (one process), the others nothing.

Every load is checked: each rank's local bytes are compared (xxh3) with the same region of the
saved tensors; a load that fails or fills wrong bytes is reported as such, not timed. Bytes
read per rank: ``rchar`` of /proc/self/io over the phase (every read system call, whichever
engine). Times: the slowest rank's, median over ``--reps`` (after one warm-up round, not reported).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

WORLD = 4
LAYOUTS = ("2x2", "fsdp4", "tp2", "one")


def _tensors(mib: int) -> dict[str, tuple[tuple[int, int], str]]:
    """name -> (global shape, "col" or "row"): 8 weights of 1024 columns summing to ``mib`` MiB."""
    rows = max(8, (mib << 20) // (8 * 4 * 1024)) // 8 * 8
    return {f"layer{i}.{'col' if i % 2 == 0 else 'row'}": ((rows, 1024), "col" if i % 2 == 0 else "row")
            for i in range(8)}


def _full(name: str, shape: tuple[int, int]) -> torch.Tensor:
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    return torch.randn(shape, generator=gen)


def _placements(layout: str, kind: str) -> list[Any]:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if layout == "2x2":
        return [_StridedShard(0, split_factor=2), Shard(0)] if kind == "col" else [Shard(0), Shard(1)]
    if layout == "tp2":
        return [Shard(0) if kind == "col" else Shard(1)]
    if layout == "fsdp4":
        return [Shard(0)]
    return [Replicate()]


def _state(layout: str, mib: int, fill: bool, rank: int) -> dict[str, Any] | None:
    """The state in ``layout`` on this rank (None: this rank holds nothing in it)."""
    from torch.distributed.tensor import distribute_tensor

    if layout in ("tp2", "one") and rank >= {"tp2": 2, "one": 1}[layout]:
        return None
    state: dict[str, Any] = {}
    for name, (shape, kind) in _tensors(mib).items():
        full = _full(name, shape) if fill else torch.zeros(shape)
        if layout == "one":
            state[name] = full
            continue
        mesh = _MESHES[layout]
        state[name] = distribute_tensor(full, mesh, _placements(layout, kind), src_data_rank=None)
    return state


_MESHES: dict[str, Any] = {}


def _make_meshes() -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    _MESHES["2x2"] = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    _MESHES["fsdp4"] = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    group = dist.new_group([0, 1])  # every rank calls new_group; only 0 and 1 are in it
    if dist.get_rank() < 2:
        _MESHES["tp2"] = DeviceMesh.from_group(group, "cpu", mesh_dim_names=("tp",))
    _MESHES["tp2_group"] = group


def _digest(state: dict[str, Any] | None) -> bool:
    """Whether each local tensor equals its region of the saved tensors."""
    from ckptio.planning.sharding import held

    if state is None:
        return True
    for name, value in state.items():
        region = held(value, name)
        full = _full(name, region.shape)
        want = full[tuple(slice(o, o + s) for o, s in zip(region.chunk.offsets, region.chunk.sizes))]
        if not torch.equal(region.local, want):
            return False
    return True


def _evict(path: Path) -> None:
    for d, _, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(d, f), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar"))


def _timed(fn: Any) -> tuple[float, int, str | None]:
    """(seconds, bytes read, error) of ``fn()``, between two barriers."""
    import torch.distributed as dist

    dist.barrier()
    before, t0 = _rchar(), time.perf_counter()
    error = None
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - a bench reports an engine that cannot do it, it does not stop
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
    seconds, nbytes = time.perf_counter() - t0, _rchar() - before
    dist.barrier()
    return seconds, nbytes, error


def _save(engine: str, state: dict[str, Any], path: str) -> None:
    import torch.distributed.checkpoint as dcp

    import ckptio

    if engine == "ckptio":
        ckptio.save(state, path)
    else:
        dcp.save(state, storage_writer=dcp.FileSystemWriter(path, sync_files=True))


def _load(engine: str, layout: str, state: dict[str, Any] | None, path: str) -> None:
    import torch.distributed.checkpoint as dcp

    import ckptio

    group = _MESHES["tp2_group"] if layout == "tp2" else None
    if state is None:
        return
    if engine == "ckptio":
        if layout == "one":
            ckptio.load(path, state, process_group=_single())
        else:
            ckptio.load(path, state, process_group=group)
    elif layout == "one":
        dcp.load(state, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    else:
        dcp.load(state, storage_reader=dcp.FileSystemReader(path), process_group=group)


_SINGLE: list[Any] = []


def _single() -> Any:
    return _SINGLE[0]


def worker(rank: int, world: int, root: str, mib: int, reps: int) -> list[dict[str, Any]]:
    import torch.distributed as dist

    torch.set_num_threads(2)
    _make_meshes()
    _SINGLE.append(dist.new_group([0]))
    saved = _state("2x2", mib, True, rank)
    rows: list[dict[str, Any]] = []
    for rep in range(reps + 1):  # rep 0 warms up (first save's pool, imports): not reported
        for engine in ("ckptio", "dcp"):
            path = os.path.join(root, f"{engine}-{rep}")
            seconds, nbytes, error = _timed(lambda: _save(engine, saved, path))
            rows.append({"engine": engine, "phase": "save 2x2", "rep": rep, "s": seconds,
                         "read": nbytes, "error": error, "ok": error is None})
            for layout in LAYOUTS:
                dest = _state(layout, mib, False, rank) if layout != "tp2" or rank < 2 else None
                _evict(Path(path))
                seconds, nbytes, error = _timed(lambda: _load(engine, layout, dest, path))
                rows.append({"engine": engine, "phase": f"load {layout}", "rep": rep,
                             "s": seconds, "read": nbytes, "error": error,
                             "ok": error is None and _digest(dest)})
                dist.barrier()
    return rows


def summarize(per_rank: list[list[dict[str, Any]]], total: int) -> str:
    lines = ["| engine | phase | time (s), median of slowest rank "
             "| bytes read per rank (MiB, ranks 0-3) | bytes right |",
             "|---|---|---:|---|---|"]
    keys = sorted({(r["engine"], r["phase"]) for r in per_rank[0]},
                  key=lambda k: (["save 2x2", *[f"load {x}" for x in LAYOUTS]].index(k[1]), k[0]))
    for engine, phase in keys:
        reps = [[r for r in rows if (r["engine"], r["phase"]) == (engine, phase) and r["rep"]]
                for rows in per_rank]
        errors = {r["error"] for rank in reps for r in rank if r["error"]}
        ok = all(r["ok"] for rank in reps for r in rank)
        if errors:
            lines.append(f"| {engine} | {phase} | fails: {sorted(errors)[0]} | | |")
            continue
        slowest = [max(rank[i]["s"] for rank in reps) for i in range(len(reps[0]))]
        read = " / ".join(f"{statistics.median(r['read'] for r in rank) / 2**20:.1f}" for rank in reps)
        lines.append(f"| {engine} | {phase} | {statistics.median(slowest):.3f} | {read} | "
                     f"{'yes' if ok else 'NO: wrong bytes'} |")
    lines.append(f"\nState: {total / 2**20:.0f} MiB in all ({total / 2**20 / WORLD:.0f} MiB per rank in 2x2).")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from benchmarks.strided import worker as importable_worker  # not __main__'s: ranks import it
    from ckptio.testing.rank_processes import run_ranks

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dir", default="bench-data/strided")
    args = parser.parse_args(argv)
    root = Path(args.dir).resolve()
    root.mkdir(parents=True, exist_ok=True)
    per_rank = run_ranks(WORLD, importable_worker, str(root), args.mib, args.reps, timeout_s=3600)
    total = sum(shape[0] * shape[1] * 4 for shape, _ in _tensors(args.mib).values())
    print(f"python -m benchmarks.strided {' '.join(sys.argv[1:] if argv is None else argv)}")
    print(summarize(per_rank, total))
    return 0


if __name__ == "__main__":
    sys.exit(main())
