"""MLPerf Storage's checkpoint workload through DLIO, scaled to this machine, per engine.

    python -m benchmarks.dlio_run [--engines torch,torch_fsync,ckptio,s3torch] [--repeats 3]
        [--np 2] [--num-write 10] [--num-read 10] [--s3-num 3] [--dir /work/cache/dlio-run]
        [--venv /work/cache/dlio-venv] [--out bench-dlio/dlio.json] [--workload W]
        [--set KEY=VALUE ...] [--fio-gib G]

Runs with ckptio's own venv (it starts SeaweedFS through ckptio.testing.s3server); DLIO runs
under ``mpirun -np N`` in the venv benchmarks/dlio_setup.sh builds, on the workload
benchmarks/dlio_configs/workload/llama3_8b_scaled.yaml. Per repeat, on benchmarks/harness.py's
schedule (the order reversed on odd repeats): fio's write and read ceiling on the same disk,
and per engine as the rules order: a write phase (``num_checkpoints_read=0``), the page cache
dropped (``drop_caches``, as root), a read phase (``num_checkpoints_write=0``). Each
checkpoint's duration is the maximum over ranks of DLIO's per-rank duration, its throughput
DLIO's size over that (the minimum over ranks). Engines: DLIO's torch.save (as shipped),
torch.save with fsync and ckptio (benchmarks/dlio_ckptio.py), DLIO's s3torchconnector one against a local SeaweedFS
(benchmarks/dlio_s3torch.py: its read run's checkpoint count fixed), fewer checkpoints there.

Owns: running and summarising. Does not own: the engines, the venv, the fio job's options
(benchmarks/fio_ceiling.py's fio_jobs_ceiling).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import harness
from benchmarks.fio_ceiling import fio_jobs_ceiling

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "benchmarks" / "dlio_configs"
WORKLOAD = "llama3_8b_scaled"
ENGINES = {  # name -> DLIO overrides choosing it
    "torch": [],
    "torch_fsync": ["++workload.checkpoint.checkpoint_mechanism_classname="
                    "benchmarks.dlio_ckptio.TorchFsyncCheckpointing"],
    "ckptio": ["++workload.checkpoint.checkpoint_mechanism_classname="
               "benchmarks.dlio_ckptio.CkptioCheckpointing"],
    # DLIO's PyTorchS3Checkpointing, its read run able to count what its write run stored;
    # storage overrides added once the server is up
    "s3torch": ["++workload.checkpoint.checkpoint_mechanism_classname="
                "benchmarks.dlio_s3torch.S3TorchCheckpointing"],
}


def dlio(args: argparse.Namespace, folder: str, out: Path, extra: list[str], *, write: bool,
         num: int, env: dict[str, str]) -> dict[str, Any]:
    """One DLIO phase under mpirun -> per-checkpoint durations (max over ranks) and size."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    counts = ([f"++workload.checkpoint.num_checkpoints_write={num}",
               "++workload.checkpoint.num_checkpoints_read=0"] if write else
              ["++workload.checkpoint.num_checkpoints_write=0",
               f"++workload.checkpoint.num_checkpoints_read={num}"])
    command = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(args.np),
               "-x", "PYTHONPATH", *[a for k in env for a in ("-x", k)],
               str(Path(args.venv) / "bin" / "dlio_benchmark"), f"--config-dir={CONFIGS}",
               f"workload={args.workload}", f"++workload.checkpoint.checkpoint_folder={folder}",
               f"++workload.output.folder={out}", f"hydra.run.dir={out / 'hydra'}", *counts, *extra,
               *[f"++workload.{kv}" for kv in args.set]]
    done = subprocess.run(command, cwd=out, env={**os.environ, "PYTHONPATH": str(ROOT), **env},
                          capture_output=True, text=True, timeout=1800)
    (out / "log.txt").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise RuntimeError(f"DLIO failed ({done.returncode}), log {out / 'log.txt'}:\n"
                           + (done.stdout + done.stderr)[-3000:])
    return {**read_phase(out, args.np, write=write), "command": " ".join(command)}


def read_phase(out: Path, ranks: int, *, write: bool) -> dict[str, Any]:
    """DLIO's per-rank stats of one phase -> each checkpoint's duration, the maximum over ranks
    (MLPerf Storage's rule; its throughput, size over that, is the minimum over ranks)."""
    kind = "save_ckpt" if write else "load_ckpt"
    stats = [json.loads((out / f"{r}_per_epoch_stats.json").read_text())["1"] for r in range(ranks)]
    blocks = sorted({k for rank in stats for k in rank if k.startswith(kind)},
                    key=lambda k: int(k.removeprefix(kind)))
    size = json.loads((out / "summary.json").read_text())["metric"]["checkpoint_size_GB"]
    return {"size_GB": size, "durations_s": [max(rank[b]["duration"] for rank in stats)
                                             for b in blocks]}


def phase_summary(phase: dict[str, Any]) -> dict[str, float]:
    """Mean over checkpoints (DLIO's summary statistic) of duration and throughput."""
    d = phase["durations_s"]
    return {"s": statistics.mean(d), "GBps": statistics.mean(phase["size_GB"] / x for x in d)}


def run_engine(args: argparse.Namespace, name: str, rep: int, s3: Any) -> dict[str, Any]:
    """Write phase, page cache dropped, read phase; the checkpoints removed after."""
    out = Path(args.dir) / "out" / f"{name}-{rep}"
    extra, env = list(ENGINES[name]), {}
    if name == "s3torch":
        folder = f"s3://{s3.bucket}/dlio/{rep}"
        extra += ["++workload.storage.storage_type=s3", f"++workload.storage.storage_root={s3.bucket}",
                  "++workload.dataset.format=npz",
                  f"++workload.storage.storage_options.endpoint_url={s3.endpoint}",
                  f"++workload.storage.storage_options.access_key_id={s3.access_key}",
                  f"++workload.storage.storage_options.secret_access_key={s3.secret_key}",
                  f"++workload.storage.storage_options.region={s3.region}",
                  "++workload.storage.storage_options.s3_force_path_style='true'"]
    else:
        folder = str(Path(args.dir) / "ckpt" / name)
        shutil.rmtree(folder, ignore_errors=True)
    try:
        s3_num = args.s3_num if name == "s3torch" else None
        write = dlio(args, folder, out / "write", extra, write=True, num=s3_num or args.num_write,
                     env=env)
        method = harness.cold([Path(args.dir)])
        read = dlio(args, folder, out / "read", extra, write=False, num=s3_num or args.num_read,
                    env=env)
    finally:
        if name != "s3torch":
            shutil.rmtree(folder, ignore_errors=True)
        else:
            empty_bucket(s3, f"dlio/{rep}/")
    return {"engine": name, "rep": rep, "cache": method, "write": {**write, **phase_summary(write)},
            "read": {**read, **phase_summary(read)}}


def empty_bucket(s3: Any, prefix: str) -> None:
    from ckptio.testing.s3server import make_client

    client = make_client(s3)
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=s3.bucket, Prefix=prefix):
        for obj in page.get("Contents", []):
            client.delete_object(Bucket=s3.bucket, Key=obj["Key"])


def report(runs: list[dict[str, Any]]) -> str:
    """Markdown rows: medians over repeats of each engine's write and read."""
    rows = []
    for name in dict.fromkeys(r["engine"] for r in runs):
        mine = [r for r in runs if r["engine"] == name]
        med = {f"{p}_{k}": statistics.median(r[p][k] for r in mine)
               for p in ("write", "read") for k in ("GBps", "s")}
        rows.append((name, f"{med['write_GBps']:.3f}", f"{med['write_s']:.2f}",
                     f"{med['read_GBps']:.3f}", f"{med['read_s']:.2f}", len(mine)))
    return harness.markdown_table(["engine", "write GB/s", "write s", "read GB/s", "read s",
                                   "repeats"], rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engines", default="torch,torch_fsync,ckptio,s3torch")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--num-write", type=int, default=10)
    p.add_argument("--num-read", type=int, default=10)
    p.add_argument("--s3-num", type=int, default=3, help="checkpoints written and read over S3")
    p.add_argument("--workload", default=WORKLOAD, help="a DLIO workload (its own, or ours)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a DLIO workload override, e.g. checkpoint.mode=subset")
    p.add_argument("--fio-gib", type=float, default=1.716, help="bytes fio moves (the checkpoint's)")
    p.add_argument("--dir", default="/work/cache/dlio-run")
    p.add_argument("--venv", default="/work/cache/dlio-venv")
    p.add_argument("--out", default=str(ROOT / "bench-dlio" / "dlio.json"))
    args = p.parse_args(argv)
    engines = args.engines.split(",")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    runs: list[dict[str, Any]] = []
    s3 = None
    if "s3torch" in engines:
        from ckptio.testing.s3server import SeaweedServer

        s3 = SeaweedServer(Path(args.dir) / "weed").start()  # data on the same disk
    try:
        for rep, name in harness.schedule(["fio", *engines], args.repeats):
            began = time.monotonic()
            if name == "fio":
                fio = fio_jobs_ceiling(Path(args.dir), int(args.fio_gib * 2**30), args.np)
                runs.append({"engine": "fio", "rep": rep, **fio})
            else:
                runs.append(run_engine(args, name, rep, s3))
            print(f"rep {rep} {name}: {time.monotonic() - began:.0f} s", file=sys.stderr, flush=True)
            Path(args.out).write_text(json.dumps(runs, indent=1))
    finally:
        if s3 is not None:
            s3.close()
    fio = [r for r in runs if r["engine"] == "fio"]
    print(report([r for r in runs if r["engine"] != "fio"]))
    print(f"fio ceiling (median): write {statistics.median(r['write_GBps'] for r in fio):.3f} GB/s, "
          f"read {statistics.median(r['read_GBps'] for r in fio):.3f} GB/s; GB = GiB, as DLIO counts")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
