"""Compression and delta benchmark (issue 28): a real training trajectory checkpointed every k
steps by each engine, on the local disk and on the object store, in one run.

Owns: the trajectory cache (compress_traj.py's snapshots, trained once per setting and kept
under --dir), the protocol (one fresh worker process per (store, repetition), the engines'
order rotated per repetition; per engine an untimed warm-up, then for each run and k a
sequence of --saves durable saves, then a cold load of each sequence's last checkpoint: page
cache dropped, and on the object store the server restarted first), the same-run ceilings
(local: O_DIRECT write/read of the full state's bytes, ckptio.tuning.ceiling; object store: raw
multipart PUT / ranged GETs of the same bytes, s3_ceiling.py), the codec's own speed per core
and on 2 threads, and the command line. Does not own: the engines and stored-bytes accounting
(compress_engines.py), the summary and markdown (compress_report.py), the training
(compress_traj.py).

    flock -x /tmp/cpu.lock .venv/bin/python -m benchmarks.compress --reps 3 \
        --json docs/results/compress/bench.json --markdown docs/results/compress/bench.md
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from benchmarks import (
    REPO_ROOT,
    compress_codecs,
    compress_traj,
    harness,
    shown_path,
    write_reports,
)
from benchmarks import compress_engines as ce
from benchmarks import compress_report as report
from benchmarks.compress_study import FRAME, frames, xor

Run = dict[str, Any]
DEFAULT_DIR = REPO_ROOT / "bench-data" / "compress"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.compress",
                                description=__doc__.split("\n")[0])
    p.add_argument("--runs", default="full,lora", help="trajectories: full (the GPT) and/or "
                   "lora (adapters over the frozen GPT); default full,lora")
    p.add_argument("--ks", default="1,10,100", help="checkpoint every k steps (default 1,10,100)")
    p.add_argument("--saves", type=int, default=3, help="checkpoints per sequence (default 3)")
    p.add_argument("--start", type=int, default=50, help="step of the first checkpoint")
    p.add_argument("--preset", default="study", choices=sorted(compress_traj.PRESETS))
    p.add_argument("--lr", type=float, default=3e-4, help="peak learning rate (default 3e-4)")
    p.add_argument("--lora-base-steps", type=int, default=100, help="steps the LoRA run's base "
                   "is trained before it is frozen (default 100)")
    p.add_argument("--stores", default="local,s3", help="local and/or s3 (default both)")
    p.add_argument("--engines", default=",".join(ce.ENGINES),
                   help=f"comma list (default all: {','.join(ce.ENGINES)})")
    p.add_argument("--codec", default="bytegroup+zstd", help="the named codec of ckptio_codec "
                   "and ckptio_delta (default bytegroup+zstd)")
    p.add_argument("--reps", type=int, default=3, help="repetitions (default 3)")
    p.add_argument("--dir", type=Path, default=DEFAULT_DIR, help="scratch directory on the disk "
                   f"under test (default {shown_path(DEFAULT_DIR)}); checkpoints are deleted, "
                   "the trajectory cache is kept")
    p.add_argument("--idle", type=float, default=0.3, help="idle seconds before a timed phase")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds allowed per worker")
    p.add_argument("--json", type=Path)
    p.add_argument("--markdown", type=Path)
    p.add_argument("--worker", choices=("local", "s3"), help=argparse.SUPPRESS)
    p.add_argument("--rep", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.run_list, args.k_list = args.runs.split(","), [int(k) for k in args.ks.split(",")]
    args.store_list, args.engine_list = args.stores.split(","), args.engines.split(",")
    if args.reps < 1 or args.saves < 2 or min(args.k_list) < 1:
        p.error("need --reps >= 1, --saves >= 2 and every k >= 1")
    return args


# ------------------------------------------------------------------------------ trajectory


def schedule(args: argparse.Namespace, k: int) -> list[int]:
    return [args.start + i * k for i in range(args.saves)]


def cache_path(args: argparse.Namespace) -> Path:
    tag = (f"{args.preset}-lr{args.lr:g}-s{args.start}-k{args.ks}-n{args.saves}-{args.runs}"
           f"-b{args.lora_base_steps}")
    return args.dir / f"trajectory-{tag.replace(',', '_')}.pt"


def trajectories(args: argparse.Namespace) -> tuple[dict[str, dict[int, Any]], dict[str, Any]]:
    """{run: {step: snapshot}} and the runs' descriptions, trained once and cached."""
    path = cache_path(args)
    if path.exists():
        cached = torch.load(path, weights_only=True)
        return cached["snaps"], json.loads(cached["info"])
    steps = sorted({s for k in args.k_list for s in schedule(args, k)})
    snaps, info = {}, {}
    for run in args.run_list:
        t0 = time.perf_counter()
        snaps[run], info[run] = compress_traj.trajectory(run, steps, args.preset, lr=args.lr,
                                                         base_steps=args.lora_base_steps)
        info[run]["train_s"] = round(time.perf_counter() - t0, 1)
        print(f"trained {run}: {info[run]}", file=sys.stderr, flush=True)
    args.dir.mkdir(parents=True, exist_ok=True)
    torch.save({"snaps": snaps, "info": json.dumps(info)}, path)
    return snaps, info


def nbytes(state: Any) -> int:
    return sum(t.numel() * t.element_size() for part in state.values() for t in part.values())


def empty_like(state: Any) -> Any:
    return {c: {n: torch.zeros_like(t) for n, t in part.items()} for c, part in state.items()}


def bitwise_equal(a: Any, b: Any) -> bool:
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return all(torch.equal(a[c][n].view(ints[t.element_size()]), t.view(ints[t.element_size()]))
               for c, part in b.items() for n, t in part.items())


# ------------------------------------------------------------------------------ one worker


def worker(args: argparse.Namespace) -> Run:
    """Every available engine on one store, one repetition, in this process."""
    from ckptio.testing.s3server import SeaweedServer

    snaps, _info = trajectories(args)
    store = args.worker
    names = [n for n in args.engine_list if ce.unavailable_reason(n, store) is None]
    names = names[args.rep % len(names):] + names[:args.rep % len(names)] if names else []
    work = args.dir / f"{store}-r{args.rep}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    server = None
    if store == "s3":
        import os

        server = SeaweedServer(work / "weed").start()
        os.environ.update(server.env())
    try:
        full = snaps[args.run_list[0]][args.start]
        out: Run = {"store": store, "rep": args.rep, "order": names,
                    "ceiling": ceiling(store, work, nbytes(full), server)}
        out["saves"], out["loads"] = [], []
        for name in names:
            root = f"s3://{server.bucket}/{name}" if server else str(work / name)
            saves, loads = engine_run(args, name, root, snaps, server)
            out["saves"] += saves
            out["loads"] += loads
            remove(root)
        return out
    finally:
        if server is not None:
            server.close()
        shutil.rmtree(work, ignore_errors=True)


def engine_run(args: argparse.Namespace, name: str, root: str, snaps: dict[str, dict[int, Any]],
               server: Any) -> tuple[list[Run], list[Run]]:
    from benchmarks.engines import timed_phase
    from ckptio.tuning.ceiling import drop_page_cache

    engine = ce.ENGINES[name]
    session = engine.session(args.codec)
    tiny = {c: {"t": torch.zeros(64)} for c in compress_traj.CLASSES}
    session.load(session.save(f"{root}/warmup", 1, tiny), empty_like(tiny))  # untimed
    saves, last = [], []
    try:
        for run in args.run_list:
            for k in args.k_list:
                seq = f"{root}/{run}-k{k}"
                for i, step in enumerate(schedule(args, k)):
                    state = snaps[run][step]
                    phase = timed_phase(lambda: session.save(seq, step, state), args.idle)
                    path = session.path(seq, step)
                    saves.append({"engine": name, "run": run, "k": k, "i": i, "step": step,
                                  "save_s": phase.seconds, "logical": nbytes(state),
                                  "stored": ce.stored_bytes(path),
                                  "classes": ce.class_bytes(path) if engine.ckptio else None})
                last.append((run, k, step, path))
        if server is not None:
            server.restart()
        loads = []
        for run, k, step, path in last:
            dest = empty_like(snaps[run][step])
            drop = drop_page_cache([Path(args.dir)])
            phase = timed_phase(lambda: session.load(path, dest), args.idle)
            loads.append({"engine": name, "run": run, "k": k, "step": step, "cache_drop": drop,
                          "load_s": phase.seconds, "logical": nbytes(dest),
                          "bitwise_ok": bitwise_equal(dest, snaps[run][step])})
    finally:
        session.close()
    return saves, loads


def remove(root: str) -> None:
    if not root.startswith("s3://"):
        shutil.rmtree(root, ignore_errors=True)
        return
    import os

    from ckptio.storage.s3.client import client
    from ckptio.storage.s3.settings import S3Settings

    bucket, _, prefix = root[5:].partition("/")
    c = client(S3Settings(endpoint_url=os.environ["AWS_ENDPOINT_URL"]))
    for page in c.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            c.delete_objects(Bucket=bucket, Delete={"Objects": keys})


def ceiling(store: str, work: Path, size: int, server: Any) -> Run:
    """The store's raw ceiling for ``size`` bytes, best geometry of each direction."""
    if store == "local":
        from ckptio.tuning import ceiling as c

        path, tries = work / "ceiling.bin", []
        for chunk, threads in c.GEOMETRIES:
            w = c.write_ceiling(path, size, chunk, threads)
            r = c.read_ceiling(path, 0.3, chunk, threads)
            tries.append((w["seconds"], r["seconds"]))
            path.unlink()
        return {"nbytes": size, "write_s": min(t[0] for t in tries),
                "read_s": min(t[1] for t in tries), "how": "O_DIRECT, best of "
                + ", ".join(f"{ch >> 20} MiB x {t}" for ch, t in c.GEOMETRIES)}
    from benchmarks import s3_ceiling as s3c
    from ckptio.tuning.ceiling import drop_page_cache

    view = memoryview(s3c.source(size, 0))
    cells, writes, reads = [(4, 8 << 20), (8, 16 << 20)], [], []  # parts >= 5 MiB (S3)
    for conc, part in cells:
        t0 = time.perf_counter()
        s3c.write_cell(view, f"ceiling-{conc}", (conc, part))
        writes.append(time.perf_counter() - t0)
    server.restart()
    drop_page_cache()
    for conc, part in cells:
        t0 = time.perf_counter()
        s3c.read_cell(view, f"ceiling-{conc}", (conc, part))
        reads.append(time.perf_counter() - t0)
    return {"nbytes": size, "write_s": min(writes), "read_s": min(reads),
            "how": "raw boto3 multipart PUT / ranged GETs, best of "
            + ", ".join(f"{c} x {p >> 20} MiB" for c, p in cells)}


# ------------------------------------------------------------------------------ codec speed


def ckptio_codec(codec: str) -> compress_codecs.Codec | None:
    """ckptio's own frame codec (format version 4), if this ckptio has it."""
    try:
        from ckptio.format import codec as cc
    except ImportError:
        return None

    def encode(frame: memoryview, size: int) -> bytes:
        return bytes(cc.encode_frame(cc.stored_name(codec, size), frame))

    def decode(blob: bytes, size: int, n: int) -> bytes:
        out = bytearray(n)
        cc.decode_frame(cc.stored_name(codec, size), blob, memoryview(out))
        return bytes(out)

    return compress_codecs.Codec(f"ckptio {codec}", "ckptio", encode, decode)


def codec_speed(args: argparse.Namespace, snaps: dict[str, dict[int, Any]]) -> list[Run]:
    """The chosen codec per class on the first full snapshot and its XOR one k later: ratio,
    GB/s on one thread and on two (frames split between two threads)."""
    codec = ckptio_codec(args.codec)
    if codec is None:  # before the engine: the study's equivalent
        same = {"bytegroup+zstd": "bgcat+zstd-1", "zstd": "zstd-1"}.get(args.codec)
        found = compress_codecs.available([same]) if same else []
        if not found:
            return []
        codec = found[0]
    run = snaps[args.run_list[0]]
    base, next_ = run[args.start], run[args.start + min(args.k_list)]
    rows = []
    for data, state in (("state", base), (f"xor {min(args.k_list)}", None)):
        for cls in compress_traj.CLASSES:
            tensors = state[cls] if state is not None else xor(next_[cls], base[cls])
            for threads in (1, 2):
                rows.append({"codec": codec.name, "data": data, "class": cls, "threads": threads,
                             **throughput(codec, tensors, threads, args.reps)})
    return rows


def throughput(codec: compress_codecs.Codec, tensors: dict[str, torch.Tensor], threads: int,
               reps: int) -> Run:
    parts = list(frames(tensors))
    logical = sum(len(f) for f, _ in parts)
    enc, dec = [], []
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(reps):
            t0 = time.perf_counter()
            blobs = list(pool.map(lambda p: codec.encode(*p), parts))
            enc.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            list(pool.map(lambda bp: codec.decode(bp[0], bp[1][1], len(bp[1][0])),
                          zip(blobs, parts)))
            dec.append(time.perf_counter() - t0)
    return {"logical": logical, "stored": sum(len(b) for b in blobs), "frame": FRAME,
            "compress_gbs": logical / statistics.median(enc) / 1e9,
            "decompress_gbs": logical / statistics.median(dec) / 1e9}


# ------------------------------------------------------------------------------ driver


def spawn(args: argparse.Namespace, argv: list[str], store: str, rep: int) -> Run:
    cmd = [sys.executable, "-m", "benchmarks.compress", *argv, "--worker", store, "--rep", str(rep)]
    return harness.spawn(cmd, timeout=args.timeout, strict=True, cwd=REPO_ROOT)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.worker:
        return harness.emit(worker(args))
    snaps, info = trajectories(args)
    workers = harness.repeat(args.store_list, args.reps,
                             lambda store, rep: spawn(args, argv, store, rep),
                             lambda run, i, n: f"[{i}/{n}] {run['wall_s']:.0f} s")
    skipped = {f"{n} on {s}": why for s in args.store_list for n in args.engine_list
               if (why := ce.unavailable_reason(n, s))}
    result = {"command": "python -m benchmarks.compress " + shlex.join(argv), "runs": info,
              "args": {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str))},
              "schedules": {k: schedule(args, k) for k in args.k_list}, "skipped": skipped,
              "workers": workers, "codec_speed": codec_speed(args, snaps)}
    result["summary"] = report.summarize(result)
    write_reports(result, args.json, args.markdown, report.markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
