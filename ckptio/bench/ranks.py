"""Many-rank save/load benchmark: ckptio vs DCP on the same FSDP2-like DTensor state, every run a
fresh set of gloo processes, resharded loads (N -> 1, N -> 2N) against the same-layout load.

Owns: the sharded state (state.py's GPT+AdamW state, every tensor of 2+ dims a DTensor
Shard(0) over a 1-D CPU mesh of N ranks, 1-D tensors (norms, biases) Replicate, 0-dim tensors
and Python values plain), the rank launcher (N fresh `python -m ckptio.bench.ranks --worker`
processes joined over tcp://127.0.0.1), the timed collective save and cold load, the bitwise
check of every load against digests computed from the reference state, and the summary. Reuses
(does not copy): state.py (state, digest, empty destination), engines.py (RSS, heap release,
disk settling), ceiling.py (page-cache drop), save_load.py (the ceiling worker, medians, report
helpers).

    python -m ckptio.bench.ranks --ranks 2 --gb 2 --reps 3
    ckptio bench save-load --ranks 2 --gb 2 --reps 3     # the same

Per repetition: one job per save engine (ckptio; DCP per --dcp-threads), each N fresh ranks that
build the state, save once untimed-for-the-median ("1st save") and once timed; then one job per
load (ckptio N->N, DCP N->N, ckptio N->1 into plain tensors without a process group, ckptio
N->2N into a 2N-rank mesh), each fresh ranks that allocate and touch the destination, drop the
page cache, idle, then load; then the O_DIRECT ceiling (save_load's worker). Order alternates
between repetitions. Every timed phase starts and ends with a barrier; the time is rank 0's.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import pickle
import shlex
import shutil
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

Run = dict[str, Any]
PACKAGE_ROOT = Path(__file__).resolve().parents[2]
PREFIX = "ranks-"  # everything this driver creates under --dir starts with it
EXPECT = PREFIX + "expect.pkl"


# ---------------------------------------------------------------- arguments


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m ckptio.bench.ranks",
        description="Durable N-rank save and cold loads (same layout and resharded) of a sharded "
        "GPT+AdamW state: ckptio vs DCP vs the raw O_DIRECT ceiling, fresh processes per run.")
    p.add_argument("--ranks", type=int, default=2, help="ranks that save (default 2)")
    p.add_argument("--gb", type=float, default=2.0, help="state size in GB (1e9 bytes); default 2")
    p.add_argument("--dir", type=Path, default=Path("bench-data"), help="scratch directory on the "
                   "disk under test (default ./bench-data); what this driver writes there is deleted")
    p.add_argument("--reps", type=int, default=3, help="repetitions (default 3)")
    p.add_argument("--dcp-threads", default="1,2,4", help="DCP FileSystemWriter thread_count "
                   "variants, comma list (default 1,2,4); the first one's checkpoint is loaded")
    p.add_argument("--loads", default="same,dcp,to1,to2n", help="loads: same (ckptio N->N), dcp "
                   "(DCP N->N), to1 (ckptio N->1, plain tensors), to2n (ckptio N->2N); default all")
    p.add_argument("--json", type=Path, help="write runs and summary as JSON here")
    p.add_argument("--markdown", type=Path, help="write the markdown report here")
    p.add_argument("--idle", type=float, default=2.0, help="idle seconds before each timed phase")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds allowed per job")
    p.add_argument("--no-ceiling", action="store_true", help="skip the O_DIRECT ceiling")
    p.add_argument("--cold-pool", action="store_true", help="ckptio loads also pay for making "
                   "their staging pool and I/O threads inside the clock (default: made before)")
    # worker side
    p.add_argument("--worker", help=argparse.SUPPRESS)  # save:ENGINE | load:ENGINE:WORLD | expect
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--rep", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--ckpt", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.reps < 1 or args.gb <= 0 or args.ranks < 1:
        p.error("--reps and --ranks must be >= 1 and --gb > 0")
    args.threads = [int(t) for t in args.dcp_threads.split(",") if t.strip()]
    args.load_kinds = [k.strip() for k in args.loads.split(",") if k.strip()]
    if bad := [k for k in args.load_kinds if k not in ("same", "dcp", "to1", "to2n")]:
        p.error(f"unknown --loads {bad}")
    return args


# ---------------------------------------------------------------- the sharded state


def split(size: int, parts: int, index: int) -> tuple[int, int]:
    """(start, length) of piece ``index`` of dim ``size`` cut in ``parts`` as Shard(0) does
    (torch.chunk: pieces of ceil(size / parts); trailing ones smaller or empty)."""
    full = -(-size // parts)
    start = min(full * index, size)
    return start, min(size, full * (index + 1)) - start


def placement_of(t: Any) -> str:
    """'shard' (2+ dims: weights, embeddings, their AdamW moments), 'replicate' (1-D: norms,
    biases), 'plain' (0-dim step counters, and any non-float leaf such as the RNG state)."""
    if t.dim() >= 2:
        return "shard"
    if t.dim() == 1 and t.is_floating_point():
        return "replicate"
    return "plain"


def local_view(value: Any, rank: int, world: int, memo: dict[int, Any] | None = None) -> Any:
    """The same nesting with each tensor replaced by the plain tensor rank ``rank`` of ``world``
    holds (a view: no copy). Tied tensors stay tied."""
    import torch

    memo = {} if memo is None else memo
    if isinstance(value, torch.Tensor):
        # state_dict() detaches every entry: tied weights are distinct objects over one storage
        ident = (value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape),
                 value.stride(), value.dtype)
        if ident not in memo:
            if placement_of(value) == "shard" and world > 1:
                start, length = split(value.shape[0], world, rank)
                memo[ident] = value.narrow(0, start, length)
            else:
                memo[ident] = value
        return memo[ident]
    if isinstance(value, dict):
        return type(value)({k: local_view(v, rank, world, memo) for k, v in value.items()})
    if isinstance(value, list):
        return [local_view(v, rank, world, memo) for v in value]
    if isinstance(value, tuple) and type(value) is tuple:
        return tuple(local_view(v, rank, world, memo) for v in value)
    return value


def to_dtensors(full: Any, local: Any, mesh: Any, memo: dict[int, Any] | None = None) -> Any:
    """Wrap each local tensor of ``local`` (from local_view of ``full``) as a DTensor with the
    placement of its full twin; plain leaves stay as they are."""
    import torch
    from torch.distributed.tensor import DTensor, Replicate, Shard

    memo = {} if memo is None else memo
    if isinstance(full, torch.Tensor):
        if id(local) not in memo:
            kind = placement_of(full)
            if kind == "plain":
                memo[id(local)] = local
            else:
                memo[id(local)] = DTensor.from_local(
                    local, mesh, [Shard(0) if kind == "shard" else Replicate()], run_check=False,
                    shape=full.shape, stride=full.stride())
        return memo[id(local)]
    if isinstance(full, dict):
        return type(full)({k: to_dtensors(v, local[k], mesh, memo) for k, v in full.items()})
    if isinstance(full, list):
        return [to_dtensors(f, l, mesh, memo) for f, l in zip(full, local)]
    if isinstance(full, tuple) and type(full) is tuple:
        return tuple(to_dtensors(f, l, mesh, memo) for f, l in zip(full, local))
    return local


def sharded_state(full: Any, rank: int, world: int, mesh: Any) -> Any:
    """This rank's DTensor state, its local shards copied out of ``full`` (which may be freed)."""
    memo: dict[int, Any] = {}
    local = local_view(full, rank, world)
    copies = _copy_tensors(local, memo)
    return to_dtensors(full, copies, mesh)


def _copy_tensors(value: Any, memo: dict[int, Any]) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        if id(value) not in memo:
            memo[id(value)] = value.clone()
        return memo[id(value)]
    if isinstance(value, dict):
        return type(value)({k: _copy_tensors(v, memo) for k, v in value.items()})
    if isinstance(value, list):
        return [_copy_tensors(v, memo) for v in value]
    if isinstance(value, tuple) and type(value) is tuple:
        return tuple(_copy_tensors(v, memo) for v in value)
    return value


@dataclass(frozen=True)
class Spec:
    """A tensor leaf of the destination skeleton: shape, stride and dtype, and which of the
    source's tensors it is (tied tensors share ``ident``)."""

    ident: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: Any
    kind: str  # placement_of


def skeleton(full: Any) -> Any:
    """state.empty_destination(full) (scalars poisoned) with tensors replaced by Specs."""
    import torch

    from . import state

    empty = state.empty_destination(full)
    ids: dict[int, int] = {}

    def walk(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            n = ids.setdefault(id(value), len(ids))
            return Spec(n, tuple(value.shape), tuple(value.stride()), value.dtype, placement_of(value))
        if isinstance(value, dict):
            return type(value)({k: walk(v) for k, v in value.items()})
        if isinstance(value, list):
            return [walk(v) for v in value]
        if isinstance(value, tuple) and type(value) is tuple:
            return tuple(walk(v) for v in value)
        return value

    return walk(empty)


def destination(skel: Any, rank: int, world: int, mesh: Any) -> Any:
    """A touched (zeroed) destination for rank ``rank`` of ``world``: DTensors on ``mesh``, or
    plain full tensors when ``mesh`` is None."""
    import torch
    from torch.distributed.tensor import DTensor, Replicate, Shard

    made: dict[int, Any] = {}

    def walk(value: Any) -> Any:
        if isinstance(value, Spec):
            if value.ident not in made:
                if value.kind == "shard" and mesh is not None:
                    shape = (split(value.shape[0], world, rank)[1], *value.shape[1:])
                    local = torch.zeros(shape, dtype=value.dtype)
                else:
                    local = torch.empty_strided(value.shape, value.stride, dtype=value.dtype).zero_()
                if mesh is not None and value.kind != "plain":
                    placement = Shard(0) if value.kind == "shard" else Replicate()
                    local = DTensor.from_local(local, mesh, [placement], run_check=False,
                                               shape=torch.Size(value.shape), stride=value.stride)
                made[value.ident] = local
            return made[value.ident]
        if isinstance(value, dict):
            return type(value)({k: walk(v) for k, v in value.items()})
        if isinstance(value, list):
            return [walk(v) for v in value]
        if isinstance(value, tuple) and type(value) is tuple:
            return tuple(walk(v) for v in value)
        return value

    return walk(skel)


def local_digest(value: Any) -> str:
    """state.digest of the state with every DTensor replaced by its local tensor."""
    from ..sharding import is_dtensor
    from . import state

    def walk(v: Any) -> Any:
        if is_dtensor(v):
            return v.to_local()
        if isinstance(v, dict):
            return {k: walk(x) for k, x in v.items()}
        if isinstance(v, list):
            return [walk(x) for x in v]
        if isinstance(v, tuple) and type(v) is tuple:
            return tuple(walk(x) for x in v)
        return v

    return state.digest(walk(value))


def load_worlds(args: argparse.Namespace) -> dict[str, int]:
    worlds = {"same": args.ranks, "to1": 1, "to2n": 2 * args.ranks}
    return {k: worlds[k] for k in args.load_kinds if k in worlds}


# ---------------------------------------------------------------- workers


def expect_worker(args: argparse.Namespace) -> Run:
    """Build the reference state once; store the destination skeleton and, for every world size
    a load uses, each rank's expected digest."""
    from . import state

    t0 = time.perf_counter()
    full = state.build_state(args.gb, args.seed)
    worlds = sorted({args.ranks, *load_worlds(args).values()})
    digests = {w: [state.digest(local_view(full, r, w)) for r in range(w)] for w in worlds}
    record = {"skeleton": skeleton(full), "digests": digests, "bytes": state.tensor_nbytes(full),
              "tensors": len(state.tensor_leaves(full))}
    with open(args.dir / EXPECT, "wb") as f:
        pickle.dump(record, f)
    return {"job": "expect", "bytes": record["bytes"], "tensors": record["tensors"],
            "seconds": time.perf_counter() - t0, "bitwise_ok": True}


def init_group(args: argparse.Namespace) -> Any:
    """The gloo group and a 1-D CPU mesh over it (None, None for a single unjoined process)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if args.port == 0:
        return None
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank,
                            world_size=args.world, timeout=timedelta(seconds=args.timeout))
    return init_device_mesh("cpu", (args.world,))


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def timed(fn: Any, idle: float, reset_peak: bool = True) -> tuple[float, float, Any]:
    """engines.timed_phase with barriers: every rank settles, idles, then all start together
    and the clock stops when the last rank is done. -> (seconds, extra RSS MiB, result)."""
    from . import engines

    gc.collect()
    engines.release_free_heap()
    engines.settle_disk()
    barrier()
    time.sleep(idle)
    before = engines.status_kib("VmRSS")
    if reset_peak:
        engines.reset_peak_rss()
    barrier()
    t0 = time.perf_counter()
    out = fn()
    barrier()
    seconds = time.perf_counter() - t0
    return seconds, (engines.status_kib("VmHWM") - before) / 1024, out


def ckptio_save(state: Any, path: Path) -> None:
    from . import engines

    engines.ENGINES["ckptio"].save(state, path)  # durable + committed when it returns


def dcp_save(threads: int) -> Any:
    def save(state: Any, path: Path) -> None:
        import torch.distributed.checkpoint as dcp

        writer = dcp.FileSystemWriter(str(path), thread_count=threads, sync_files=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(state, storage_writer=writer)
        os.sync()  # .metadata and the directory entries: sync_files fsyncs only the data files
    return save


def ckptio_loader(path: Path, warm_pool: bool) -> Any:
    """ckptio.load with the engines' options (POSIX backend, no tuned profile) through its own
    Checkpointer; with ``warm_pool`` its staging pool and I/O threads are made before the clock
    (as in save_load.py, where the process saved before it loads)."""
    import ckptio

    from . import engines

    checkpointer = ckptio.Checkpointer(engines._ckptio_options("posix"))
    if warm_pool:
        checkpointer.prepare(path)
    return lambda path, dest: checkpointer.load(str(path), dest)


def dcp_load(path: Path, dest: Any) -> object:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(dest, storage_reader=dcp.FileSystemReader(str(path)))
    return None


def gather(value: Any) -> list[Any]:
    import torch.distributed as dist

    if not dist.is_initialized():
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def ckpt_dir(args: argparse.Namespace, engine: str, rep: int) -> Path:
    """Where save engine ``engine`` writes in repetition ``rep``; the load engine "dcp" reads
    what the first DCP variant wrote."""
    if engine == "dcp":
        engine = save_engines(args)[1]
    return args.dir / f"{PREFIX}{engine}-r{rep}"


def save_worker(args: argparse.Namespace, engine: str) -> Run:
    from . import engines, save_load, state

    engines.ENGINES["ckptio" if engine == "ckptio" else "dcp_t1"].prepare()
    mesh = init_group(args)
    t0 = time.perf_counter()
    full = state.build_state(args.gb, args.seed)
    nbytes = state.tensor_nbytes(full)
    src = sharded_state(full, args.rank, args.world, mesh)
    del full
    gc.collect()
    build_s = time.perf_counter() - t0
    save = ckptio_save if engine == "ckptio" else dcp_save(int(engine.removeprefix("dcp_t")))
    ckpt = args.ckpt
    first_dir = ckpt.with_name(ckpt.name + "-first")
    if args.rank == 0:
        shutil.rmtree(ckpt, ignore_errors=True)
        shutil.rmtree(first_dir, ignore_errors=True)
    barrier()
    rss_before = engines.status_kib("VmRSS")
    first_s, _, _ = timed(lambda: save(src, first_dir), args.idle)
    barrier()
    if args.rank == 0:
        shutil.rmtree(first_dir)
    save_s, _, _ = timed(lambda: save(src, ckpt), args.idle, reset_peak=False)
    rss = (engines.status_kib("VmHWM") - rss_before) / 1024
    rsses = gather(rss)
    files, on_disk, apparent = save_load.disk_usage(ckpt) if args.rank == 0 else (0, 0, 0)
    return {"job": "save", "engine": engine, "rep": args.rep, "ranks": args.world, "bytes": nbytes,
            "build_s": build_s, "first_save_s": first_s, "save_s": save_s,
            "save_rss_mib": max(rsses), "files": files, "disk_bytes": on_disk,
            "apparent_bytes": apparent, "bitwise_ok": True}


def load_worker(args: argparse.Namespace, engine: str) -> Run:
    from . import ceiling, engines

    engines.ENGINES["ckptio" if engine == "ckptio" else "dcp_t1"].prepare()
    mesh = init_group(args)
    with open(args.dir / EXPECT, "rb") as f:
        expect = pickle.load(f)
    dest = destination(expect["skeleton"], args.rank, args.world, mesh)
    gc.collect()
    barrier()
    cache_drop = ceiling.drop_page_cache([args.ckpt]) if args.rank == 0 else ""
    load = ckptio_loader(args.ckpt, not args.cold_pool) if engine == "ckptio" else dcp_load
    seconds, rss, report = timed(lambda: load(args.ckpt, dest), args.idle)
    ok = local_digest(dest) == expect["digests"][args.world][args.rank]
    oks, rsses = gather(ok), gather(rss)
    read = gather(getattr(report, "nbytes_read", None))
    return {"job": "load", "engine": engine, "rep": args.rep, "ranks": args.world,
            "saved_ranks": args.ranks, "bytes": expect["bytes"], "load_s": seconds,
            "load_rss_mib": max(rsses), "cache_drop": cache_drop, "bitwise_ok": all(oks),
            "bitwise_by_rank": oks, "nbytes_read": None if None in read else sum(read),
            "report": _report(report)}


def _report(report: object) -> object:
    from .save_load import report_fields

    return report_fields(report)


def worker_main(args: argparse.Namespace) -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    kind, _, engine = args.worker.partition(":")
    if kind == "expect":
        run = expect_worker(args)
    elif kind == "save":
        run = save_worker(args, engine)
    else:
        run = load_worker(args, engine)
    if args.rank == 0:
        print(json.dumps(run), flush=True)
    import torch.distributed as dist

    if dist.is_initialized():
        with contextlib.suppress(Exception):  # teardown only: the result is already out
            dist.destroy_process_group()
    return 0 if run["bitwise_ok"] else 3


# ---------------------------------------------------------------- driver


def launch(args: argparse.Namespace, worker: str, world: int, rep: int, ckpt: Path | None,
           joined: bool = True) -> Run:
    """``world`` fresh worker processes (joined in one gloo group unless ``joined`` is False);
    rank 0's JSON line is the result."""
    from ..testing.ranks import free_port

    path = [str(PACKAGE_ROOT), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p)}
    env.setdefault("OMP_NUM_THREADS", "1")
    port = free_port() if joined else 0
    base = [sys.executable, "-m", "ckptio.bench.ranks", "--worker", worker, "--world", str(world),
            "--port", str(port), "--ranks", str(args.ranks), "--gb", repr(args.gb), "--dir",
            str(args.dir), "--rep", str(rep), "--idle", repr(args.idle), "--seed", str(args.seed),
            "--timeout", repr(args.timeout), "--loads", args.loads]
    if args.cold_pool:
        base.append("--cold-pool")
    if ckpt is not None:
        base += ["--ckpt", str(ckpt)]
    failed: Run = {"job": worker, "rep": rep, "ranks": world}
    t0 = time.perf_counter()
    procs = [subprocess.Popen(base + ["--rank", str(r)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for r in range(world)]
    outs: list[tuple[str, str]] = []
    try:
        for p in procs:
            remaining = max(1.0, args.timeout - (time.perf_counter() - t0))
            outs.append(p.communicate(timeout=remaining))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()
        return {**failed, "error": f"timed out after {args.timeout} s"}
    for r, (_, err) in enumerate(outs):
        for line in err.strip().splitlines()[-12:]:
            print(f"    | r{r} {line}", file=sys.stderr)
    lines = [ln for ln in outs[0][0].splitlines() if ln.startswith("{")]
    codes = [p.returncode for p in procs]
    if not lines:
        return {**failed, "error": f"workers exited {codes} without a result (see above)"}
    run: Run = json.loads(lines[-1])
    run["wall_s"] = time.perf_counter() - t0
    if any(c not in (0, 3) for c in codes):
        run["error"] = f"workers exited {codes}"
    return run


def run_ceiling(args: argparse.Namespace, rep: int) -> Run:
    from . import save_load

    run = save_load.spawn(args, save_load.CEILING, "gpt", rep)
    run["job"] = "ceiling"
    return run


def save_engines(args: argparse.Namespace) -> list[str]:
    return ["ckptio", *[f"dcp_t{t}" for t in args.threads]]


def schedule(args: argparse.Namespace) -> tuple[list[str], list[tuple[str, int]]]:
    saves = save_engines(args)
    loads = [("ckptio", w) for w in load_worlds(args).values()]
    if args.threads and "dcp" in args.load_kinds:
        loads.insert(1, ("dcp", args.ranks))
    return saves, loads


def progress(run: Run) -> str:
    head = f"[rep {run.get('rep', 0) + 1}] {run.get('job')} {run.get('engine', '')}"
    if "error" in run:
        return f"{head}: FAILED {run['error']}"
    gb = run.get("bytes", 0) / 1e9
    if run["job"] == "save":
        return (f"{head} {run['ranks']} ranks: save {run['save_s']:.2f} s ({gb / run['save_s']:.2f} "
                f"GB/s), 1st {run['first_save_s']:.2f} s, RSS+ {run['save_rss_mib']:.0f} MiB, "
                f"wall {run['wall_s']:.1f} s")
    if run["job"] == "load":
        ok = "ok" if run["bitwise_ok"] else "MISMATCH"
        return (f"{head} {run['saved_ranks']}->{run['ranks']}: load {run['load_s']:.2f} s "
                f"({gb / run['load_s']:.2f} GB/s), RSS+ {run['load_rss_mib']:.0f} MiB, bitwise {ok}, "
                f"wall {run['wall_s']:.1f} s")
    if run["job"] == "ceiling":
        return (f"{head}: write {run['write_s']:.2f} s ({gb / run['write_s']:.2f} GB/s), read "
                f"{run['read_s']:.2f} s ({gb / run['read_s']:.2f} GB/s)")
    return f"{head}: {run}"


def run_all(args: argparse.Namespace) -> list[Run]:
    saves, loads = schedule(args)
    runs = [launch(args, "expect", 1, 0, None, joined=False)]
    print(progress(runs[-1]), file=sys.stderr, flush=True)
    if "error" in runs[-1]:
        return runs
    for rep in range(args.reps):
        order = 1 if rep % 2 == 0 else -1
        for engine in saves[::order]:
            ckpt = ckpt_dir(args, engine, rep)
            keep = engine in saves[:2]  # ckptio and the DCP variant whose checkpoint is loaded
            runs.append(launch(args, f"save:{engine}", args.ranks, rep, ckpt))
            print(progress(runs[-1]), file=sys.stderr, flush=True)
            if not keep:
                shutil.rmtree(ckpt, ignore_errors=True)
        for engine, world in loads[::order]:
            ckpt = ckpt_dir(args, engine, rep)
            run = launch(args, f"load:{engine}", world, rep, ckpt, joined=world > 1)
            run.setdefault("engine", engine)
            run["layout"] = f"{args.ranks}->{world}"
            runs.append(run)
            print(progress(run), file=sys.stderr, flush=True)
        for engine in saves:
            shutil.rmtree(ckpt_dir(args, engine, rep), ignore_errors=True)
        if not args.no_ceiling:
            runs.append(run_ceiling(args, rep))
            print(progress(runs[-1]), file=sys.stderr, flush=True)
    return runs


# ---------------------------------------------------------------- summary

TARGET_SAVE_PCT = 90.0
TARGET_SAVE_VS_DCP = 3.0
TARGET_RESHARD = 1.15


def summarize(runs: list[Run], args: argparse.Namespace) -> dict[str, Any]:
    from .save_load import gbps, median

    good = [r for r in runs if "error" not in r]
    expect = next((r for r in good if r["job"] == "expect"), None)
    ceil = {r["rep"]: r for r in good if r["job"] == "ceiling"}
    out: dict[str, Any] = {
        "ranks": args.ranks, "bytes": expect["bytes"] if expect else None,
        "tensors": expect["tensors"] if expect else None,
        "ceiling_write_gbps": median([gbps(r, "write_s") for r in ceil.values()]),
        "ceiling_read_gbps": median([gbps(r, "read_s") for r in ceil.values()]),
        "ceiling_write_s": median([r["write_s"] for r in ceil.values()]),
        "ceiling_read_s": median([r["read_s"] for r in ceil.values()]),
    }

    def pct(r: Run, seconds: str, ceil_seconds: str) -> float | None:
        c = ceil.get(r["rep"])
        return None if c is None else 100 * gbps(r, seconds) / gbps(c, ceil_seconds)

    def med(rs: list[Run], fn: Any) -> float | None:
        return median([v for r in rs if (v := fn(r)) is not None])

    saves = []
    for engine in save_engines(args):
        all_rs = [r for r in runs if r.get("job") == "save" and r.get("engine") == engine]
        rs = [r for r in all_rs if "error" not in r]
        saves.append({
            "engine": engine, "ranks": args.ranks, "runs": len(all_rs), "failed": len(all_rs) - len(rs),
            "first_save_s": med(rs, lambda r: r["first_save_s"]), "save_s": med(rs, lambda r: r["save_s"]),
            "save_gbps": med(rs, lambda r: gbps(r, "save_s")),
            "save_pct": med(rs, lambda r: pct(r, "save_s", "write_s")),
            "save_rss_mib": med(rs, lambda r: r["save_rss_mib"]),
            "files": med(rs, lambda r: r["files"]), "disk_mb": med(rs, lambda r: r["disk_bytes"] / 1e6)})
    loads = []
    _, planned = schedule(args)
    for engine, world in planned:
        layout = f"{args.ranks}->{world}"
        all_rs = [r for r in runs if r.get("job") == "load" and r.get("engine") == engine
                  and r.get("layout") == layout]
        rs = [r for r in all_rs if "error" not in r]
        loads.append({
            "engine": engine, "layout": layout, "ranks": world, "runs": len(all_rs),
            "failed": len(all_rs) - len(rs), "load_s": med(rs, lambda r: r["load_s"]),
            "load_gbps": med(rs, lambda r: gbps(r, "load_s")),
            "load_pct": med(rs, lambda r: pct(r, "load_s", "read_s")),
            "load_rss_mib": med(rs, lambda r: r["load_rss_mib"]),
            "read_mb": med(rs, lambda r: None if r.get("nbytes_read") is None else r["nbytes_read"] / 1e6),
            "bitwise_ok": bool(rs) and len(rs) == len(all_rs) and all(r["bitwise_ok"] for r in rs)})
    out["saves"], out["loads"] = saves, loads
    out["checks"] = checks(saves, loads, args)
    return out


def checks(saves: list[dict[str, Any]], loads: list[dict[str, Any]],
           args: argparse.Namespace) -> list[dict[str, Any]]:
    """The issue's targets, each as value vs target (medians; ratios of medians)."""
    out: list[dict[str, Any]] = []
    mine = next((s for s in saves if s["engine"] == "ckptio"), None)
    dcp = [s for s in saves if s["engine"] != "ckptio" and s["save_gbps"]]
    best = max(dcp, key=lambda s: s["save_gbps"], default=None)
    if mine and mine["save_pct"] is not None:
        out.append({"what": "ckptio save, % of write ceiling", "value": mine["save_pct"],
                    "target": f">= {TARGET_SAVE_PCT:.0f}", "ok": mine["save_pct"] >= TARGET_SAVE_PCT})
    if mine and mine["save_gbps"] and best:
        ratio = mine["save_gbps"] / best["save_gbps"]
        out.append({"what": f"ckptio save / best DCP save ({best['engine']})", "value": ratio,
                    "target": f">= {TARGET_SAVE_VS_DCP:.0f}", "ok": ratio >= TARGET_SAVE_VS_DCP})
    same = next((l for l in loads if l["engine"] == "ckptio" and l["ranks"] == args.ranks), None)
    dcp_load = next((l for l in loads if l["engine"] == "dcp"), None)
    if same and same["load_s"] and dcp_load and dcp_load["load_s"]:
        out.append({"what": f"ckptio / DCP load GB/s, {same['layout']}",
                    "value": dcp_load["load_s"] / same["load_s"], "target": "-", "ok": None})
    for l in loads:
        if l["engine"] == "ckptio" and l is not same and same and same["load_s"] and l["load_s"]:
            ratio = l["load_s"] / same["load_s"]
            out.append({"what": f"ckptio load {l['layout']} / {same['layout']} (time)", "value": ratio,
                        "target": f"<= {TARGET_RESHARD}", "ok": ratio <= TARGET_RESHARD})
    return out


# ---------------------------------------------------------------- markdown


def markdown(summary: dict[str, Any], args: argparse.Namespace, argv: list[str]) -> str:
    from . import ceiling, state
    from .save_load import fmt

    cfg = state.gpt_config(args.gb)
    command = shlex.join(["python", "-m", "ckptio.bench.ranks", *argv])
    nbytes = summary["bytes"] or 0
    lines = [
        f"## {args.ranks}-rank durable save and cold load (resharded)", "", f"`{command}`  ",
        (f"{time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPUs, dir `{args.dir.resolve()}`, "
        f"{args.reps} reps, fresh gloo processes per job (OMP_NUM_THREADS=1), medians  "),
        (f"state: GPT+AdamW of state.py, S = {nbytes:,} bytes ({summary['tensors']} tensor leaves), "
        f"d_model {cfg.d_model}, {cfg.n_layers} blocks, vocab {cfg.vocab}; 2+-dim tensors DTensor "
        f"Shard(0) over a 1-D CPU mesh of {args.ranks}, 1-D (norms, biases) Replicate, 0-dim and "
        "RNG plain (same on every rank)  "),
        "ceiling: save_load's O_DIRECT worker, S bytes, every rep, best of "
        + ", ".join(f"{c >> 20} MiB x {t} threads" for c, t in ceiling.GEOMETRIES), "",
        "| engine | ranks | 1st save s | save s | save GB/s | % write ceil | RSS+ MiB/rank | files | disk MB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in summary["saves"]:
        fail = f" ({s['failed']} failed)" if s["failed"] else ""
        lines.append(f"| {s['engine']}{fail} | {s['ranks']} | {fmt(s['first_save_s'])} | {fmt(s['save_s'])} "
                     f"| {fmt(s['save_gbps'])} | {fmt(s['save_pct'], '.0f')} | {fmt(s['save_rss_mib'], '.0f')} "
                     f"| {fmt(s['files'], '.0f')} | {fmt(s['disk_mb'], '.0f')} |")
    lines.append(f"| O_DIRECT ceiling | - | - | {fmt(summary['ceiling_write_s'])} "
                 f"| {fmt(summary['ceiling_write_gbps'])} | 100 | - | 1 | {nbytes / 1e6:.0f} |")
    lines += ["", ("| engine | layout | load s | load GB/s | % read ceil | RSS+ MiB/rank | read MB (all ranks) "
              "| bitwise |"), "|---|---|---:|---:|---:|---:|---:|---|"]
    for l in summary["loads"]:
        ok = ("ok" if l["bitwise_ok"] else "MISMATCH") + (f" ({l['failed']} failed)" if l["failed"] else "")
        lines.append(f"| {l['engine']} | {l['layout']} | {fmt(l['load_s'])} | {fmt(l['load_gbps'])} "
                     f"| {fmt(l['load_pct'], '.0f')} | {fmt(l['load_rss_mib'], '.0f')} "
                     f"| {fmt(l['read_mb'], '.0f')} | {ok} |")
    lines.append(f"| O_DIRECT ceiling | - | {fmt(summary['ceiling_read_s'])} "
                 f"| {fmt(summary['ceiling_read_gbps'])} | 100 | - | {nbytes / 1e6:.0f} | - |")
    lines += ["", "| check | value | target | met |", "|---|---:|---|---|"]
    for c in summary["checks"]:
        met = "-" if c["ok"] is None else ("yes" if c["ok"] else "NO")
        lines.append(f"| {c['what']} | {c['value']:.2f} | {c['target']} | {met} |")
    lines += [
        "", ("- save: barrier, clock, save, barrier (rank 0's clock: the slowest rank counts); 1st "
        "save: the first in the process, save: a second one (what a training job pays every time)"),
        ("- ckptio: ckptio.save, durable and committed when it returns (POSIX backend, no tuned "
        "profile); DCP: dcp.save with FileSystemWriter(thread_count=k, sync_files=True), then "
        "os.sync() on every rank inside the clock (.metadata and directory entries)"),
        "- load: fresh ranks allocate and zero the destination, rank 0 drops the page cache, idle, "
        f"then the clock; {args.ranks}->1 loads into plain full tensors in one process without a "
        "process group; DCP loads the checkpoint of its first --dcp-threads variant; ckptio's "
        + ("staging pool is made inside the clock (--cold-pool)" if args.cold_pool else
           "staging pool and I/O threads are made before the clock (Checkpointer.prepare)"),
        ("- read MB: ckptio's LoadReport.nbytes_read summed over the loading ranks (S is the "
        "minimum; more means over-reading)"),
        ("- bitwise: xxh3 of each rank's local tensors and every other leaf, against digests of "
        "the same region of the reference state (untimed)"), ""]
    return "\n".join(lines)


# ---------------------------------------------------------------- entry point


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.worker:
        return worker_main(args)
    created = not args.dir.exists()
    args.dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    try:
        runs = run_all(args)
    finally:
        cleanup(args.dir, created)
    print(f"{len(runs)} runs in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    summary = summarize(runs, args)
    text = markdown(summary, args, argv)
    print(text)
    if args.markdown:
        args.markdown.write_text(text)
    if args.json:
        args.json.write_text(json.dumps({"argv": argv, "runs": runs, "summary": summary}, indent=1))
    failed = any("error" in r or not r.get("bitwise_ok", True) for r in runs)
    return 1 if failed else 0


def cleanup(root: Path, created: bool) -> None:
    """Remove what this driver (and the ceiling worker) left under ``root``."""
    from .save_load import cleanup as save_load_cleanup

    for p in root.glob(PREFIX + "*"):
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    save_load_cleanup(root, created)


if __name__ == "__main__":
    sys.exit(main())
