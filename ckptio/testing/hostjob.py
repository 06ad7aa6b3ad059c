"""One job over the hosts of a ``Hosts`` (multihost.py): an agent process per host, as torchrun's
agent is, forks that host's ranks; every rank joins one gloo process group whose store (a
TCPStore) is held by global rank 0 on host 0's address; each returns a value, collected here.

Each rank sees, as under torchrun: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK
(its host's index), MASTER_ADDR, MASTER_PORT; plus CKPTIO_SHM_DIR (its host's memory directory)
and, in simulated mode, ``host_env`` = the host's name (the host-id override; in netns mode
each host has its own hostname instead, and ``host_env`` is not set). Global ranks are numbered
host by host.

netns mode: the agent runs as ``ip netns exec NS unshare --uts python -m ckptio.testing.hostjob
SPEC``, sets its hostname (only after checking that it is in a UTS namespace of its own), and
gloo binds to the namespace's ``eth0`` (GLOO_SOCKET_IFNAME). Every agent is the leader of its
own session: killing a host (``kill_host``) or the job kills the agent and its ranks.

Owns: the job spec, the agent, the rank bootstrap, collecting values and tracebacks. Does not
own: the hosts themselves (multihost.py). Test support only.
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from ckptio.testing.rank_processes import PRELOAD, RanksFailed, free_port

__all__ = ["Job", "RanksFailed"]

_PORTS = iter(range(29500, 29500 + 10_000))  # netns mode: each harness is its own network


class Job:
    """A running job on a Hosts (module doc). ``wait()`` -> each rank's value, in rank order."""

    def __init__(self, hosts: Any, fn: Callable[..., Any], args: tuple[Any, ...],
                 ranks_per_host: int | list[int], timeout_s: float, host_env: str | None,
                 env: dict[str, str]) -> None:
        n = len(hosts.hosts)
        counts = [ranks_per_host] * n if isinstance(ranks_per_host, int) else list(ranks_per_host)
        if len(counts) != n or min(counts) < 0 or max(counts) < 1:
            raise ValueError(f"ranks_per_host={ranks_per_host!r}: one count >= 0 per host ({n}; "
                             "0: a host left out of this job), one at least >= 1")
        self.hosts, self.timeout_s = hosts, timeout_s
        self.world = sum(counts)
        self.dir = Path(hosts.root) / "jobs" / f"job-{time.monotonic_ns()}"
        self.dir.mkdir(parents=True)
        netns = hosts.mode == "netns"
        port = next(_PORTS) if netns else free_port()
        first = 0
        self.procs: list[subprocess.Popen[bytes] | None] = []  # None: a host left out
        master = next(h for h, c in zip(hosts.hosts, counts) if c)
        self.ranks_of: list[list[int]] = []
        for host, count in zip(hosts.hosts, counts):
            ranks = list(range(first, first + count))
            first += count
            self.ranks_of.append(ranks)
            if not count:
                self.procs.append(None)
                continue
            rank_env = {**env, "CKPTIO_SHM_DIR": host.shm_dir, "GROUP_RANK": str(host.index),
                        "LOCAL_WORLD_SIZE": str(count), "WORLD_SIZE": str(self.world),
                        "MASTER_ADDR": master.addr, "MASTER_PORT": str(port)}
            if host_env and not netns:
                rank_env[host_env] = host.name
            if netns:
                rank_env["GLOO_SOCKET_IFNAME"] = "eth0"
            spec = {"fn": fn, "args": args, "ranks": ranks, "env": rank_env,
                    "results": str(self.dir), "timeout_s": timeout_s / 2,
                    "hostname": host.name if netns else None,
                    "parent_uts": os.readlink("/proc/self/ns/uts")}
            spec_path = self.dir / f"h{host.index}.spec"
            spec_path.write_bytes(pickle.dumps(spec))
            cmd = [sys.executable, "-m", "ckptio.testing.hostjob", str(spec_path)]
            if netns:
                cmd = ["ip", "netns", "exec", host.netns, "unshare", "--uts", *cmd]
            log = open(self.dir / f"h{host.index}.log", "wb")  # noqa: SIM115 - kept by Popen
            self.procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                               env=_agent_env(), start_new_session=True))
            log.close()
        self.deadline = time.monotonic() + timeout_s
        self.killed: set[int] = set()

    def kill_host(self, i: int) -> None:
        """SIGKILL host ``i``'s agent and ranks (a host lost mid-job); their values are None."""
        self.killed.add(i)
        proc = self.procs[i]
        if proc is not None:
            _killpg(proc)

    def kill(self) -> None:
        """SIGKILL every host's agent and ranks still running, and reap them."""
        for proc in self.procs:
            if proc is not None:
                _killpg(proc)

    def wait(self) -> list[Any]:
        """Each rank's value in global rank order, or RanksFailed with every rank's traceback
        (and the agents' output) when one raised, did not answer or the job ran past its
        timeout. A killed host's ranks answer None."""
        try:
            for proc in filter(None, self.procs):
                left = self.deadline - time.monotonic()
                try:
                    proc.wait(timeout=max(left, 0.1))
                except subprocess.TimeoutExpired:
                    break
        finally:
            self.kill()
        values: list[Any] = [None] * self.world
        failed, missing = [], []
        for i, ranks in enumerate(self.ranks_of):
            for rank in ranks:
                path = self.dir / f"rank-{rank}.pkl"
                if not path.exists():
                    if i not in self.killed:
                        missing.append(rank)
                    continue
                ok, value = pickle.loads(path.read_bytes())
                if ok:
                    values[rank] = value
                else:
                    failed.append(f"--- rank {rank} (host {i}) ---\n{value}")
        if failed or missing:
            logs = "\n".join(f"--- agent of host {i} ---\n{_tail(self.dir / f'h{i}.log')}"
                             for i, proc in enumerate(self.procs) if proc is not None)
            raise RanksFailed(f"ranks failed: {len(failed)}; no answer from {missing} (timeout "
                              f"{self.timeout_s} s)\n" + "\n".join(failed) + "\n" + logs)
        return values


def _killpg(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
    _reap_group(proc.pid)


def _reap_group(pgid: int) -> None:
    """SIGKILL what is left of session/group ``pgid`` (ranks outliving their agent)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _tail(path: Path, limit: int = 3000) -> str:
    try:
        return path.read_bytes()[-limit:].decode(errors="replace")
    except OSError:
        return "(no output)"


def _agent_env() -> dict[str, str]:
    """The agent imports what the test process imports: its sys.path on PYTHONPATH."""
    path = [p for p in sys.path if p] + [os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}


# ---------------------------------------------------------------- inside a host


def _agent(spec_path: str) -> int:
    spec = pickle.loads(Path(spec_path).read_bytes())
    if spec["hostname"]:
        if os.readlink("/proc/self/ns/uts") == spec["parent_uts"]:
            raise SystemExit("hostjob: not in a UTS namespace of its own; hostname left alone")
        import socket

        socket.sethostname(spec["hostname"])
    import importlib
    import multiprocessing as mp

    if len(spec["ranks"]) > 1:  # imported once, before the forks, not once per rank (a host
        for name in PRELOAD:    # of one rank: by the rank, as far as its case needs)
            importlib.import_module(name)
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_rank, args=(spec, local, rank))
             for local, rank in enumerate(spec["ranks"])]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    return max((p.exitcode or 0) != 0 for p in procs)


def _rank(spec: dict[str, Any], local: int, rank: int) -> None:
    import torch.distributed as dist

    os.environ.update(spec["env"], RANK=str(rank), LOCAL_RANK=str(local))
    out = Path(spec["results"]) / f"rank-{rank}.pkl"
    env = spec["env"]
    try:
        timeout = timedelta(seconds=spec["timeout_s"])
        dist.init_process_group("gloo", init_method=f"tcp://{env['MASTER_ADDR']}:"
                                f"{env['MASTER_PORT']}", rank=rank,
                                world_size=int(env["WORLD_SIZE"]), timeout=timeout)
        # every rank connected before any runs: a rank whose case makes no collective call
        # could otherwise finish and close its sockets while a peer's connectFullMesh still
        # reads from them ("Connection closed by peer" on that peer)
        dist.barrier()
        try:
            body = pickle.dumps((True, spec["fn"](rank, int(env["WORLD_SIZE"]), *spec["args"])))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the test, which raises it
        body = pickle.dumps((False, traceback.format_exc()))
    tmp = out.with_suffix(".tmp")
    tmp.write_bytes(body)
    os.replace(tmp, out)


if __name__ == "__main__":
    sys.exit(_agent(sys.argv[1]))
