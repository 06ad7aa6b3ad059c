"""The recovery, end to end (issue 66, docs/BENCH_RECOVERY.md): a training job under torchrun's
elastic agent (c10d rendezvous, restarts allowed) on hosts made on this machine
(ckptio.testing.multihost: network namespaces, each with its own tmpfs, where permitted), one
host killed mid-run (every process in it, its memory a fresh empty tmpfs, a replacement host's
agent started at once) or one rank killed, and every phase from the kill to the first step
completed after the resume, read from the events the agents and workers write: detection,
relaunch, rendezvous, the job's model build, the restore, the first step. Per source, one job
each: ckptio's memory tier with Partners(1) and with Parity(k), ckptio's disk tier alone, DCP
and torch_checkpointing from the disk; each rank's final state checked bitwise against an
uninterrupted run of the same seeds.

    python -m benchmarks.recovery --hosts 4 --mb 256 --reps 3 \
        --json docs/results/recovery/recovery.json --markdown docs/results/recovery/recovery.md
    python -m benchmarks.recovery --quick        # 2 hosts, a tiny state, partners only
    python -m benchmarks.recovery --restart inprocess ...  # no relaunch: a hot spare joins

With ``--restart inprocess`` (recovery_inproc.py) no agent restarts anything: the survivors keep
their processes and re-form the process group with a spare already running on a host of its own.

The sources run on benchmarks/harness.py's schedule (every source once per repetition, the
order reversed on odd repetitions; ``harness.repeat``); before each kill of a disk source its
checkpoints leave the page cache (``harness.cold(..., only=True)``).

Owns: which source runs when on fresh hosts, the agents' commands, the kill and the replacement,
collecting events. Does not own: the schedule, the page-cache drop (benchmarks/harness.py), the
job (recovery_worker.py), the agent's hooks (recovery_agent.py), the phases and the report
(recovery_report.py), the hosts (ckptio/testing/multihost.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import REPO_ROOT, harness, worker_env, write_reports
from benchmarks.recovery_worker import MEMORY, SOURCES

INPROCESS = ("partners", "parity", "disk")  # ckptio's: a new manager restores after re-forming

QUICK = {"hosts": 2, "mb": 2.0, "sources": "partners", "steps": 4, "kill_step": 2,
         "every": 2, "batch": 4, "reps": 1}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.recovery",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke run: " + json.dumps(QUICK))
    p.add_argument("--hosts", type=int, default=4, help="hosts of one rank each (<= 9)")
    p.add_argument("--mb", type=float, default=256, help="each rank's state in MiB (AdamW in)")
    p.add_argument("--sources", default=",".join(SOURCES))
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--kill-step", type=int, default=8, help="killed after this step is saved "
                   "(and protected) on every rank")
    p.add_argument("--kill-delay", type=float, default=0.3, help="seconds after that")
    p.add_argument("--kill", choices=("host", "rank"), default="host")
    p.add_argument("--restart", choices=("relaunch", "inprocess"), default="relaunch",
                   help="relaunch: torchrun's agents restart the job; inprocess: the survivors "
                   "keep their processes, a hot spare takes the lost rank (ckptio sources only)")
    p.add_argument("--victim", type=int, default=1, help="the host (or rank) killed; not 0, "
                   "whose agent holds the rendezvous store")
    p.add_argument("--every", type=int, default=4, help="disk saves every N steps")
    p.add_argument("--k", type=int, default=3, help="parity group size (hosts)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--max-restarts", type=int, default=3)
    p.add_argument("--monitor-interval", type=float, default=0.1)
    p.add_argument("--rdzv-conf", default="keep_alive_interval=1,keep_alive_max_attempt=3",
                   help="torchrun's --rdzv-conf (is_host is added per host)")
    p.add_argument("--mode", choices=("auto", "netns", "simulated"), default="auto")
    p.add_argument("--dir", type=Path, default=Path("bench-recovery"))
    p.add_argument("--timeout", type=float, default=300, help="seconds per job")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path)
    p.add_argument("--markdown", type=Path)
    argv = sys.argv[1:] if argv is None else argv  # --quick's defaults yield to those given
    args = p.parse_args(argv)
    if args.quick:
        given = {a.split("=")[0][2:].replace("-", "_") for a in argv if a[:2] == "--"}
        for key, value in QUICK.items():
            if key not in given:
                setattr(args, key, value)
    if not 0 < args.victim < args.hosts <= 9:
        p.error(f"--victim {args.victim} --hosts {args.hosts}: 0 < victim < hosts <= 9")
    if not 0 < args.kill_step < args.steps:
        p.error("--kill-step: between 1 and --steps - 1")
    if args.restart == "inprocess":
        _inprocess_args(p, args, given=any(a.startswith("--sources") for a in argv))
    return args


def _inprocess_args(p: argparse.ArgumentParser, args: argparse.Namespace, given: bool) -> None:
    if args.kill != "host":
        p.error("--restart inprocess: --kill host only (the spare runs on a host of its own)")
    if not given and not args.quick:
        args.sources = ",".join(INPROCESS)
    wrong = sorted(set(args.sources.split(",")) - set(INPROCESS) - {""})
    if wrong:
        p.error(f"--restart inprocess: sources {', '.join(INPROCESS)} only, not {wrong}")


def job_cfg(args: argparse.Namespace, source: str, work: Path) -> dict[str, Any]:
    return {"source": source, "mb": args.mb, "steps": args.steps, "kill_step": args.kill_step,
            "every": args.every, "k": min(args.k, args.hosts - 1), "batch": args.batch,
            "seed": args.seed, "world": args.hosts, "kill": args.kill, "pg_timeout": 120,
            "dir": str(work), "events": str(work / "events"),
            "victim": args.victim, "hold_s": args.timeout, "restart": args.restart}


class Agents:
    """One torchrun agent per host (recovery_agent.py), each the leader of its own session."""

    def __init__(self, args: argparse.Namespace, hosts: Any, cfg_path: Path, work: Path) -> None:
        from ckptio.testing.rank_processes import free_port

        self.args, self.hosts, self.cfg_path, self.work = args, hosts, cfg_path, work
        self.netns = hosts.mode == "netns"
        self.port = 29400 if self.netns else free_port()
        self.run_id = f"recovery-{os.getpid()}-{time.monotonic_ns()}"
        self.procs: list[subprocess.Popen[bytes]] = []
        self.all: list[subprocess.Popen[bytes]] = []

    def command(self, i: int) -> list[str]:
        host, a = self.hosts.hosts[i], self.args
        addr = host.addr if self.netns else f"127.0.0.{i + 1}"  # sorted: rank i on host i
        torchrun = ["--nnodes", str(a.hosts), "--nproc-per-node", "1",
                    "--max-restarts", str(a.max_restarts), "--rdzv-backend", "c10d",
                    "--rdzv-endpoint", f"{self.hosts.hosts[0].addr}:{self.port}",
                    "--rdzv-id", self.run_id,
                    "--rdzv-conf", f"{a.rdzv_conf},is_host={int(i == 0)}".lstrip(","),
                    "--local-addr", addr, "--monitor-interval", str(a.monitor_interval),
                    "-m", "benchmarks.recovery_worker", str(self.cfg_path)]
        cmd = [sys.executable, "-m", "benchmarks.recovery_agent",
               host.name if self.netns else "-", str(self.work / "events"), "--", *torchrun]
        if a.restart == "inprocess":  # the job itself: one process, the spare on the last host
            cmd = [sys.executable, "-m", "benchmarks.recovery_inproc",
                   host.name if self.netns else "-", str(self.cfg_path)]
        return ["ip", "netns", "exec", host.netns, "unshare", "--uts", *cmd] if self.netns \
            else cmd

    def start(self, i: int) -> None:
        host = self.hosts.hosts[i]
        env = {**worker_env(), "OMP_NUM_THREADS": "1", "CKPTIO_SHM_DIR": host.shm_dir,
               "BENCH_HOST": str(i), "BENCH_PARENT_UTS": os.readlink("/proc/self/ns/uts"),
               "GLOO_SOCKET_IFNAME": "eth0" if self.netns else "lo",
               # a replacement agent waits forever for the shared store's MASTER_ADDR key
               # otherwise (docs/BENCH_RECOVERY.md, "Settings the run needs")
               "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
        if not self.netns:
            env["CKPTIO_HOST_ID"] = host.name
        if self.args.restart == "inprocess":  # rank i on host i; -1: the spare
            env.update(RANK=str(i if i < self.args.hosts else -1), MASTER_PORT=str(self.port),
                       MASTER_ADDR=self.hosts.hosts[0].addr if self.netns else "127.0.0.1")
        log = open(self.work / f"agent-h{i}-{len(self.all)}.log", "wb")  # noqa: SIM115
        proc = subprocess.Popen(self.command(i), stdout=log, stderr=subprocess.STDOUT, env=env,
                                cwd=REPO_ROOT, start_new_session=True)
        log.close()
        if i < len(self.procs):
            self.procs[i] = proc
        else:
            self.procs.append(proc)
        self.all.append(proc)

    def kill_host(self, i: int) -> None:
        """SIGKILL every process of host ``i``: its namespace's (netns) and its agent's tree."""
        for _ in range(10):
            pids = _tree(self.procs[i].pid)
            if self.netns:
                out = subprocess.run(["ip", "netns", "pids", str(self.hosts.hosts[i].netns)],
                                     capture_output=True, text=True, check=False).stdout
                pids |= {int(p) for p in out.split()}
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.01)
        self.procs[i].wait(timeout=30)

    def wait(self, deadline: float) -> list[int | None]:
        """Every current agent's exit code (None: still running at ``deadline``)."""
        codes: list[int | None] = []
        for proc in self.procs:
            try:
                codes.append(proc.wait(timeout=max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
        return codes

    def close(self) -> None:
        for proc in self.all:
            for pid in _tree(proc.pid) | ({proc.pid} if proc.poll() is None else set()):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass


def _tree(root: int) -> set[int]:
    """``root``'s living descendants, and ``root`` itself when alive (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if Path(f"/proc/{pid}").exists():
            out.add(pid)
        todo += children.get(pid, [])
    return out


def read_events(root: Path) -> list[dict[str, Any]]:
    events = []
    for path in sorted(root.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                events.append({**json.loads(line), "kind": path.name[0]})
    return sorted(events, key=lambda e: e["t"])


def _wait_ready(events: Path, world: int, deadline: float, agents: Agents) -> None:
    spares = len(agents.procs) - world  # in-process: the spare is ready too
    while time.monotonic() < deadline:
        seen = read_events(events)
        ready = {e["rank"] for e in seen if e["ev"] == "ready"}
        if len(ready) == world and sum(e["ev"] == "spare_ready" for e in seen) == spares:
            return
        if any(p.poll() is not None for p in agents.procs):
            raise RuntimeError("an agent ended before the kill")
        time.sleep(0.02)
    raise TimeoutError("the ranks did not reach the kill step in time")


def one_run(args: argparse.Namespace, source: str, rep: int, mode: str) -> dict[str, Any]:
    from ckptio.testing.multihost import Hosts

    work = (args.dir / f"{source}-r{rep}").resolve()
    shutil.rmtree(work, ignore_errors=True)
    (work / "events").mkdir(parents=True)
    cfg = job_cfg(args, source, work)
    cfg_path = work / "cfg.json"
    cfg_path.write_text(json.dumps(cfg))
    run: dict[str, Any] = {"source": source, "rep": rep, "cfg": cfg}
    # a host's tmpfs: its rank's steps (the newest, the protected one, one being written) and
    # as many copies for its partner, or parity (a bound, not an allocation)
    tmpfs = f"{max(64, int(12 * args.mb))}m"
    inprocess = args.restart == "inprocess"
    with Hosts(args.hosts + inprocess, work / "hosts", mode=mode, tmpfs_size=tmpfs) as hosts:
        run["mode"], run["hosts"] = hosts.mode, hosts.describe()
        agents = Agents(args, hosts, cfg_path, work)
        try:
            for i in range(args.hosts + inprocess):
                agents.start(i)
            deadline = time.monotonic() + args.timeout
            _wait_ready(work / "events", args.hosts, deadline, agents)
            if source not in MEMORY:  # the checkpoints (durable by then) leave the page
                # cache; the job's own code stays cached
                run["cold"] = harness.cold([work / "disk"], only=True)
            time.sleep(args.kill_delay)
            run["t_kill"] = time.time()
            if inprocess:  # no replacement started: the spare takes the lost rank
                agents.kill_host(args.victim)
                run["t_killed"] = time.time()
            elif args.kill == "host":
                agents.kill_host(args.victim)
                run["t_killed"] = time.time()
                hosts.wipe(args.victim)
                run["t_wiped"] = time.time()
                agents.start(args.victim)
                run["t_replaced"] = time.time()
            else:
                _kill_rank(work / "events", args.victim)
            codes = agents.wait(deadline)
            run["codes"] = [c for i, c in enumerate(codes) if not inprocess or i != args.victim]
        except (RuntimeError, TimeoutError, OSError, subprocess.SubprocessError) as exc:
            run["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            agents.close()
        run["events"] = read_events(work / "events")
        run["logs"] = {p.name: p.read_bytes()[-3000:].decode(errors="replace")
                       for p in sorted(work.glob("agent-*.log"))}
    if "error" not in run and run.get("codes") == [0] * args.hosts:
        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"{source} rep {rep} failed: its files (agents' logs, events) kept in {work}",
              file=sys.stderr, flush=True)
    return run


def _kill_rank(events: Path, rank: int) -> None:
    """SIGKILL rank ``rank``'s worker (its agent lives and restarts it)."""
    pid = next(e["pid"] for e in read_events(events) if e["ev"] == "ready" and e["rank"] == rank)
    os.kill(pid, signal.SIGKILL)


def run_all(args: argparse.Namespace, sources: list[str], mode: str) -> list[dict[str, Any]]:
    """Every source ``args.reps`` times in harness.schedule's order, one job each (one_run)."""
    def progress(run: dict[str, Any], i: int, n: int) -> str:
        failed = "error" in run or run.get("codes") != [0] * args.hosts
        return f"run {i}/{n}: rep {run['rep']} {run['source']}{' failed' if failed else ''}"

    return harness.repeat(sources, args.reps, lambda source, rep: one_run(args, source, rep, mode),
                          progress=progress)


def references(args: argparse.Namespace) -> list[str]:
    """Each rank's final digest after an uninterrupted run (computed here, one thread)."""
    import torch

    from benchmarks.recovery_worker import reference

    torch.set_num_threads(1)
    cfg = job_cfg(args, "none", args.dir)
    return [reference(cfg, rank) for rank in range(args.hosts)]


def main(argv: list[str] | None = None) -> int:
    from benchmarks.recovery_report import markdown, summarize
    from ckptio.testing.multihost import best_mode, netns_possible

    args = parse_args(argv)
    mode = best_mode() if args.mode == "auto" else args.mode
    sources = [s for s in args.sources.split(",") if s]
    unknown = sorted(set(sources) - set(SOURCES))
    if unknown:
        raise SystemExit(f"--sources: unknown {unknown}; known: {', '.join(SOURCES)}")
    if "parity" in sources and args.hosts < 3:
        raise SystemExit("--sources parity: needs --hosts 3 or more")
    args.dir.mkdir(parents=True, exist_ok=True)
    runs = run_all(args, sources, mode)
    result = {"args": {k: str(v) for k, v in vars(args).items()}, "mode": mode,
              "why_not_netns": netns_possible() if mode != "netns" else None,
              "reference": references(args), "runs": runs}
    result["summary"] = summarize(result)
    command = " ".join(["python -m benchmarks.recovery", *(argv or sys.argv[1:])])
    write_reports(result, args.json, args.markdown, markdown(result, command))
    return 0 if all(r.get("ok") for r in result["summary"]["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
