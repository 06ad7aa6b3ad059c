"""Cold load of a DCP directory on 1 and 2 ranks: dcp.load (FileSystemReader), dcp.load through
ckptio.DcpReader and ckptio.load, against the same run's O_DIRECT read ceiling; optionally the
same engines from another checkout ("before"), back to back in one run.

Owns: the inputs (one DCP directory per rank count, written once, untimed, by dcp.save with
FileSystemWriter: 1 rank without a process group, 2 gloo ranks holding Shard(0) DTensors of the
same GPT+AdamW state), the load workers (fresh processes; 2 ranks join over tcp://127.0.0.1; a
barrier before and after the timed load, rank 0's clock; page cache dropped, then idle), the
bitwise check of every rank's destination and the table. Does not own: the state
(ckptio.tuning.state, benchmarks/ranks_state.py), the ceiling (save_load.py's worker).

    python -m benchmarks.interop_dcpload --gb 1 --reps 3 --before /tmp/main-snapshot

Each rank counts the full (generation-2) garbage collections inside its clock (``full_gcs_by_rank``
in the JSON); ``DCPLOAD_COLLECT=1`` (an experiment, docs/BENCH_INTEROP.md round six) runs
``gc.collect()`` on every rank before the clock, so no engine inherits a collection the
process already owed.

Each side's workers import ckptio from that side's checkout (``python -P`` with PYTHONPATH set
to it), so "before" and "after" differ only in ckptio.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pickle
import shlex
import socket
import sys
import time
import warnings
from pathlib import Path
from typing import Any

Run = dict[str, Any]
ENGINES = ("dcp_load", "dcp_load_ckptio_reader", "ckptio_load")
HERE = Path(__file__).resolve().parent.parent
COLLECT = "DCPLOAD_COLLECT"  # =1 (experiment): gc.collect() on every rank before the clock


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.interop_dcpload")
    p.add_argument("--gb", type=float, default=1.0)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--ranks", default="1,2")
    p.add_argument("--dir", type=Path, default=Path("bench-data/dcpload"))
    p.add_argument("--before", type=Path, help="another checkout whose ckptio runs first")
    p.add_argument("--idle", type=float, default=1.0)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--markdown", type=Path)
    p.add_argument("--json", type=Path)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--engine", default="", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---------------------------------------------------------------- workers (fresh processes)


def init_group(args: argparse.Namespace) -> Any:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if args.world == 1:
        return None
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank,
                            world_size=args.world)
    return init_device_mesh("cpu", (args.world,))


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def setup_worker(args: argparse.Namespace) -> Run:
    """Rank ``rank`` of ``world`` saves its part of the state with dcp.save; rank 0 stores the
    destination skeleton and every rank's expected digest."""
    import torch.distributed.checkpoint as dcp

    from benchmarks.ranks_state import local_view, sharded_state, skeleton
    from ckptio.tuning import state

    mesh = init_group(args)
    full = state.build_state(args.gb, 0)
    path = args.dir / f"dcp-{args.world}"
    if args.rank == 0:
        digests = [state.digest(local_view(full, r, args.world)) for r in range(args.world)]
        with open(args.dir / f"expect-{args.world}.pkl", "wb") as f:
            pickle.dump({"skeleton": skeleton(full), "digests": digests,
                         "bytes": state.tensor_nbytes(full)}, f)
    if mesh is None:
        dcp.save(full, storage_writer=dcp.FileSystemWriter(str(path)), no_dist=True)
    else:
        mine = sharded_state(full, args.rank, args.world, mesh)
        del full
        dcp.save(mine, storage_writer=dcp.FileSystemWriter(str(path)))
    barrier()
    return {"ok": True}


def load(engine: str, path: Path, dest: Any, world: int) -> None:
    import torch.distributed.checkpoint as dcp

    import ckptio

    if engine == "ckptio_load":
        ckptio.load(str(path), dest)
        return
    reader = dcp.FileSystemReader(str(path)) if engine == "dcp_load" else ckptio.DcpReader(str(path))
    dcp.load(dest, storage_reader=reader, no_dist=world == 1)


def load_worker(args: argparse.Namespace) -> Run:
    import torch.distributed.checkpoint  # noqa: F401  (imports before the clock)

    import ckptio.dcp
    import ckptio.shared
    from benchmarks.ranks_state import destination, local_digest
    from ckptio.tuning import ceiling

    mesh = init_group(args)
    with open(args.dir / f"expect-{args.world}.pkl", "rb") as f:
        expect = pickle.load(f)
    dest = destination(expect["skeleton"], args.rank, args.world, mesh)
    path = args.dir / f"dcp-{args.world}"
    barrier()
    if args.rank == 0:
        ceiling.drop_page_cache([path])
    if os.environ.get(COLLECT) == "1":
        gc.collect()
    time.sleep(args.idle)
    barrier()
    full0 = gc.get_stats()[2]["collections"]
    t0 = time.perf_counter()
    load(args.engine, path, dest, args.world)
    barrier()
    seconds = time.perf_counter() - t0
    full_gcs = gc.get_stats()[2]["collections"] - full0  # this rank's full collections in the clock
    ok = local_digest(dest) == expect["digests"][args.rank]
    return {"seconds": seconds, "bitwise_ok": ok, "bytes": expect["bytes"],
            "ckptio": ckptio.__file__, "full_gcs": full_gcs}


def worker_main(args: argparse.Namespace) -> int:
    warnings.simplefilter("ignore")
    run = setup_worker(args) if args.worker == "setup" else load_worker(args)
    print(json.dumps(run), flush=True)
    return 0


# ---------------------------------------------------------------- driver


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(args: argparse.Namespace, root: Path, worker: str, world: int, engine: str = "") -> Run:
    """``world`` fresh ranks of ``worker`` importing ckptio from ``root``; rank 0's result
    (bitwise_ok: every rank's)."""
    from benchmarks import harness  # the driver's: a worker may run another checkout's

    port = free_port() if world > 1 else 0
    env = {**os.environ, "PYTHONPATH": f"{root}:{HERE}", "OMP_NUM_THREADS": "1"}
    outs = harness.spawn_ranks(lambda r: [
        sys.executable, "-P", str(Path(__file__).resolve()), "--worker", worker, "--engine", engine,
        "--gb", repr(args.gb), "--dir", str(args.dir.resolve()), "--idle", repr(args.idle),
        "--rank", str(r), "--world", str(world), "--port", str(port)],
        world, env=env, timeout=args.timeout)
    if errors := [o["error"] for o in outs if "error" in o]:
        return {"error": errors[0]}
    return {**outs[0], "bitwise_ok": all(o.get("bitwise_ok", True) for o in outs),
            "full_gcs_by_rank": [o.get("full_gcs") for o in outs]}


def run_ceiling(args: argparse.Namespace, rep: int) -> Run:
    from benchmarks import harness  # the driver's: a worker may run another checkout's

    r = harness.spawn(harness.command("benchmarks.save_load", "ceiling", "--gb", repr(args.gb),
                                      "--dir", args.dir.resolve(), "--rep", rep, "--idle",
                                      repr(args.idle)), timeout=args.timeout, cwd=HERE)
    return r if "error" in r else {"read_gbps": r["bytes"] / 1e9 / r["read_s"]}


def run_all(args: argparse.Namespace, sides: dict[str, Path], worlds: list[int]) -> list[Run]:
    runs: list[Run] = []
    for world in worlds:
        setup = launch(args, HERE, "setup", world)
        if "error" in setup:
            raise SystemExit(f"setup of {world} rank(s) failed: {setup['error']}")
    jobs = [(side, world, engine) for side in sides for world in worlds for engine in ENGINES]
    for rep in range(args.reps):
        order = jobs if rep % 2 == 0 else jobs[::-1]
        for side, world, engine in order:
            run = {"side": side, "ranks": world, "engine": engine, "rep": rep,
                   **launch(args, sides[side], "load", world, engine)}
            runs.append(run)
            print(json.dumps(run), file=sys.stderr, flush=True)
        runs.append({"engine": "ceiling", "rep": rep, **run_ceiling(args, rep)})
        print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
    return runs


def markdown(runs: list[Run], argv: list[str]) -> str:
    from benchmarks import median  # the driver's: a worker may run another checkout's

    ceil = median([r["read_gbps"] for r in runs if r["engine"] == "ceiling" and "read_gbps" in r])
    lines = [f"`{shlex.join(['python', '-m', 'benchmarks.interop_dcpload', *argv])}`  ",
             (f"{time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPUs; medians (min-max) of "
             f"fresh processes; page cache dropped before every load; O_DIRECT read ceiling "
             f"{ceil:.2f} GB/s (median)"), "",
             "| ranks | side | engine | s (min-max) | GB/s | % ceiling | x dcp.load | bitwise |",
             "|---:|---|---|---|---:|---:|---:|---|"]
    keys = list(dict.fromkeys((r["ranks"], r["side"], r["engine"]) for r in runs if "ranks" in r))
    base: dict[tuple[int, str], float] = {}
    for world, side, engine in sorted(keys, key=lambda k: (k[0], k[1] != "before", ENGINES.index(k[2]))):
        mine = [r for r in runs if (r.get("ranks"), r.get("side"), r["engine"]) == (world, side, engine)]
        good = [r for r in mine if "error" not in r]
        if not good:
            lines.append(f"| {world} | {side} | {engine} | FAILED: {mine[0].get('error')} | | | | |")
            continue
        s = median([r["seconds"] for r in good])
        gbps = good[0]["bytes"] / 1e9 / s
        if engine == "dcp_load":
            base[(world, side)] = s
        ratio = base.get((world, side), float("nan")) / s
        ok = "ok" if all(r["bitwise_ok"] for r in good) and len(good) == len(mine) else "MISMATCH/FAILED"
        lines.append(f"| {world} | {side} | {engine} | {s:.3f} ({min(r['seconds'] for r in good):.3f}-"
                     f"{max(r['seconds'] for r in good):.3f}) | {gbps:.2f} | {100 * gbps / ceil:.0f} | "
                     f"{ratio:.2f} | {ok} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.worker:
        return worker_main(args)
    args.dir.mkdir(parents=True, exist_ok=True)
    sides = {**({"before": args.before.resolve()} if args.before else {}), "after": HERE}
    runs = run_all(args, sides, [int(w) for w in args.ranks.split(",")])
    text = markdown(runs, argv)
    print(text)
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(text)
    if args.json:
        args.json.write_text(json.dumps({"argv": argv, "runs": runs}, indent=1))
    return 1 if any("error" in r or not r.get("bitwise_ok", True) for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
