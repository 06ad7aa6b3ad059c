"""S3 benchmark driver: ckptio vs DCP (s3fs, s3torchconnector) and TorchSnapshot vs raw boto3.

One loopback SeaweedFS (``weed mini``, ckptio.testing.s3server) with its data on local disk.
Every (engine, repetition) gets a fresh server on an emptied data directory; a fresh process
saves (an untimed tiny warm-up save first: clients, pools, the server's volume), the server is
restarted and the page cache dropped, then another fresh process loads in place (cold). The
raw client ceiling is swept the same way (benchmarks/s3_ceiling.py): every (concurrency, part
size) cell writes S bytes as one multipart upload, then, after a restart, reads them back with
ranged GETs; the best cell is the ceiling, write and read separately. ckptio_best runs with the
best cell's concurrency of the same repetition.

    benchmarks/s3_setup.sh                      # the peers' venv, once (.venv/peers/dcp-s3)
    .venv/bin/python -m benchmarks.s3 --gb 1 --reps 3 \
        --json docs/results/s3/s3.json --markdown docs/results/s3/s3.md

Run from the checkout's root, nothing else running. The server's data lives in the checkout's
bench-data/s3 (git-ignored; on the disk under test, as the other benchmarks' bench-data) unless
--dir names another place.

Owns: the protocol (servers, order, fresh processes), spawning workers in the right venv.
Does not own: engines and the timed phase (s3_peers.py), the raw sweep (s3_ceiling.py), the
summary and the report (s3_report.py).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import REPO_ROOT, harness, shown_path, worker_env
from benchmarks import s3_report as report
from benchmarks.s3_peers import MAIN, engine

Run = dict[str, Any]
PEER_PYTHON = REPO_ROOT / ".venv" / "peers" / "dcp-s3" / "bin" / "python"  # s3_setup.sh's default
DATA_DIR = REPO_ROOT / "bench-data" / "s3"
DEFAULT_ENGINES = "ckptio,ckptio_best,dcp_fsspec_t1,dcp_fsspec_t8,dcp_s3tc_t1,torchsnapshot"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.s3", description=__doc__.split("\n")[0])
    p.add_argument("--gb", type=float, default=1.0, help="state size in GB (1e9 bytes); default 1")
    p.add_argument("--reps", type=int, default=3, help="repetitions (default 3)")
    p.add_argument("--dir", type=Path, default=DATA_DIR,
                   help="the server's data directory, on the disk under test (emptied, then "
                   f"removed; default {shown_path(DATA_DIR)} in this checkout)")
    p.add_argument("--engines", default=DEFAULT_ENGINES,
                   help=f"comma list (default {DEFAULT_ENGINES}); also ckptio[field=value;...]")
    p.add_argument("--concurrency", default="4,8,16,32", help="raw sweep: requests in flight")
    p.add_argument("--parts", default="8,16,32,64", help="raw sweep: part sizes in MiB")
    p.add_argument("--refine", type=int, default=3,
                   help="after the first repetition re-measure only the best N cells of each "
                   "direction (0: the whole sweep every repetition); default 3")
    p.add_argument("--no-ceiling", action="store_true", help="skip the raw sweep")
    p.add_argument("--direct-read", action="store_true",
                   help="also read every cell through http.client's readinto (experiment)")
    p.add_argument("--cold-client", action="store_true",
                   help="also read every cell in a process that makes its boto3 client inside "
                   "the clock (a context row: the fixed cost any boto3 user's fresh process pays)")
    p.add_argument("--peer-python", type=Path, default=PEER_PYTHON,
                   help=f"python of the peers' venv (default {shown_path(PEER_PYTHON)} in this "
                   "checkout, made by benchmarks/s3_setup.sh)")
    p.add_argument("--idle", type=float, default=2.0, help="idle seconds before each timed phase")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds allowed per worker")
    p.add_argument("--json", type=Path, help="write runs and summary as JSON here")
    p.add_argument("--markdown", type=Path, help="write the markdown report here")
    args = p.parse_args(argv)
    if args.reps < 1 or args.gb <= 0:
        p.error("--reps must be >= 1 and --gb > 0")
    return args


# ---------------------------------------------------------------- server


class Server:
    """The one SeaweedFS of the run: emptied and started fresh per item, restarted for reads."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.server: Any = None
        self.seconds: dict[str, float] = {}  # time spent starting, restarting, stopping

    def _count(self, what: str, t0: float) -> None:
        self.seconds[what] = self.seconds.get(what, 0.0) + time.perf_counter() - t0

    def fresh(self) -> Any:
        from ckptio.testing.s3server import SeaweedServer

        self.stop()
        t0 = time.perf_counter()
        shutil.rmtree(self.data_dir, ignore_errors=True)
        self._count("wipe", t0)
        t0 = time.perf_counter()
        self.server = SeaweedServer(self.data_dir).start()
        self._count("start", t0)
        return self.server

    def restart(self) -> Any:
        """SIGKILL and start again on the same data and ports: a cold server process (objects
        survive a kill, design doc S3.md 1; the bitwise check proves it). weed mini's SIGTERM
        often takes its full 10 s after a large write."""
        t0 = time.perf_counter()
        self.server.kill()
        self.server.restart()
        self._count("restart", t0)
        return self.server

    def stop(self) -> None:
        """SIGKILL (its data is wiped next anyway; SIGTERM can take 10 s after a load)."""
        if self.server is not None:
            t0 = time.perf_counter()
            self.server.kill()
            self.server.stop()
            self.server = None
            self._count("stop", t0)

    def idle_cpu(self, seconds: float = 5.0) -> float:
        """weed's own CPU while nobody talks to it (its background workers), in cores."""
        from benchmarks.s3_peers import proc_cpu

        c0 = proc_cpu(self.server.pid)
        time.sleep(seconds)
        return (proc_cpu(self.server.pid) - c0) / seconds


# ---------------------------------------------------------------- workers


def split_name(name: str) -> tuple[str, dict[str, str]]:
    """``ckptio[io_depth=8]@OMP_NUM_THREADS=1`` -> ("ckptio[io_depth=8]", {"OMP_NUM_THREADS": "1"}):
    an engine and environment variables for its workers (experiments)."""
    base, *assignments = name.split("@")
    return base, dict(a.split("=", 1) for a in assignments)


def spawn(command: list[str], server: Any, timeout: float, extra: dict[str, str] | None = None) -> Run:
    """Run one worker; its last JSON line on stdout is the result (stderr tail passed on)."""
    env = {**worker_env(), **server.env(), **(extra or {})}
    return harness.spawn(command, timeout=timeout, env=env, cwd=REPO_ROOT, echo=12)


def python_for(name: str, args: argparse.Namespace) -> str:
    return sys.executable if engine(split_name(name)[0]).venv == MAIN else str(args.peer_python)


def ceiling_rep(args: argparse.Namespace, srv: Server, rep: int, cells: list[str]) -> Run:
    """One repetition of the raw sweep, each cell as an engine is measured: a fresh server,
    the write in one process, a restart (+ page cache drop), the read in another (and, with
    --direct-read, another restart and the http.client read of the same object; with
    --cold-client, another restart and a boto3 read whose client is made inside the clock)."""
    phases = ("write", "read") + (("read_direct",) if args.direct_read else ()) + (
        ("read_cold",) if args.cold_client else ())
    out: Run = {"engine": report.CEILING, "rep": rep, **{p: {"cells": []} for p in phases}}
    base = [sys.executable, "-m", "benchmarks.s3_ceiling", "--gb", repr(args.gb), "--prefix",
            f"ceiling-r{rep}", "--seed", str(args.seed), "--idle", repr(min(args.idle, 1.0))]
    for cell in cells:
        server = srv.fresh()
        for phase in phases:
            if phase != "write":
                server = srv.restart()
            flags = {"read_direct": ["--phase", "read", "--direct"],
                     "read_cold": ["--phase", "read", "--cold-client"]}.get(phase,
                                                                            ["--phase", phase])
            got = spawn([*base, *flags, "--cells", cell, "--server-pid", str(server.pid)], server,
                        args.timeout)
            if "error" in got:
                out[phase].setdefault("errors", []).append(f"{cell}: {got['error']}")
                break
            out[phase]["cells"] += got.pop("cells")
            out[phase].update(got)
        srv.stop()
    for phase in phases:
        if not out[phase]["cells"]:
            out[phase]["error"] = "; ".join(out[phase].get("errors", ["no cell measured"]))
    return out


def engine_rep(args: argparse.Namespace, srv: Server, rep: int, name: str,
               best: tuple[int, int] | None) -> Run:
    server = srv.fresh()
    idle_cpu = srv.idle_cpu(2.0)
    base, extra = split_name(name)
    url = "s3://ckpt/" + re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-") + f"-r{rep}"
    common = ["--engine", base, "--url", url, "--gb", repr(args.gb), "--seed", str(args.seed),
              "--idle", repr(args.idle)]
    if best:
        common += ["--concurrency", str(best[0]), "--read-concurrency", str(best[1])]
    command = [python_for(name, args), "-m", "benchmarks.s3_peers"]
    save = spawn([*command, "--phase", "save", *common, "--server-pid", str(server.pid)], server,
                 args.timeout, extra)
    load: Run = {"error": "not run: the save failed"}
    if "error" not in save:
        server = srv.restart()
        load = spawn([*command, "--phase", "load", *common, "--server-pid", str(server.pid)],
                     server, args.timeout, extra)
    srv.stop()
    return {"engine": name, "rep": rep, "save": save, "load": load, "server_idle_cores": idle_cpu,
            "concurrency": list(best) if best else None}


def check_engines(args: argparse.Namespace, names: list[str]) -> list[str]:
    """The engines that import in their venv (the rest reported and skipped)."""
    ok = []
    for name in names:
        python = python_for(name, args)
        if not Path(python).exists():
            print(f"skipping {name}: {python} does not exist (run benchmarks/s3_setup.sh)",
                  file=sys.stderr)
            continue
        proc = subprocess.run([python, "-m", "benchmarks.s3_peers", "--phase", "probe",
                               "--engine", split_name(name)[0]], capture_output=True, text=True, check=False,
                              env=worker_env(), cwd=REPO_ROOT)
        if proc.returncode:
            last = (proc.stderr.strip().splitlines() or ["?"])[-1]
            print(f"skipping {name}: {last}", file=sys.stderr)
            continue
        ok.append(name)
    return ok


def run_all(args: argparse.Namespace, names: list[str]) -> list[Run]:
    srv = Server(args.dir)
    runs: list[Run] = []
    full = [f"{c}x{p}" for p in args.parts.split(",") for c in args.concurrency.split(",")]
    try:
        for rep in range(args.reps):
            best = None
            if not args.no_ceiling:
                cells = full if rep == 0 or not args.refine else report.top_cells(runs, args.refine)
                runs.append(ceiling_rep(args, srv, rep, cells))
                print(report.progress(runs[-1]), file=sys.stderr, flush=True)
                best = report.best_concurrency(runs[-1])
            for name in names if rep % 2 == 0 else names[::-1]:
                runs.append(engine_rep(args, srv, rep, name, best))
                print(report.progress(runs[-1]), file=sys.stderr, flush=True)
    finally:
        srv.stop()
        shutil.rmtree(args.dir, ignore_errors=True)
        print(f"server: {', '.join(f'{k} {v:.0f} s' for k, v in srv.seconds.items())}",
              file=sys.stderr)
    return runs


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    names = [n.strip() for n in args.engines.replace(";", "\0").split(",") if n.strip()]
    names = [n.replace("\0", ",") for n in names]  # ckptio[a=1;b=2] keeps its commas
    names = check_engines(args, names)
    machine = report.machine(args)
    t0 = time.perf_counter()
    runs = run_all(args, names)
    print(f"{len(runs)} items in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    summary = report.summarize(runs)
    text = report.markdown(summary, args, argv, names, machine)
    print(text)
    if args.markdown:
        args.markdown.write_text(text)
    if args.json:
        args.json.write_text(json.dumps({"argv": argv, "machine": machine, "runs": runs,
                                         "summary": summary}, indent=1))
    return 1 if report.failed(runs) else 0


if __name__ == "__main__":
    sys.exit(main())
