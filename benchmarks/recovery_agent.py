"""torchrun with its elastic agent, as the recovery benchmark (benchmarks/recovery.py) runs it
on each host: ``python -m benchmarks.recovery_agent HOSTNAME EVENTS_DIR -- <torchrun args>``.

It is ``torch.distributed.run.main`` itself (the same arguments, rendezvous and restarts),
with its LocalElasticAgent's steps written to ``EVENTS_DIR/a<host>-<pid>.jsonl`` as they
happen (``time.time()``): the agent up, a worker group seen failed or new nodes seen waiting
(the detection), each restart, stop, rendezvous and start of workers. In netns mode it first
gives its UTS namespace the host's name (refusing where it shares the machine's), as a cluster
node has its own hostname: ckptio tells hosts apart by it.

Owns: the hooks around the agent's methods, the hostname. Does not own: the agent (torch), the
hosts, the kill (recovery.py).
"""

from __future__ import annotations

import time

T0 = time.time()

import functools  # noqa: E402 - after T0 on purpose
import json  # noqa: E402
import os  # noqa: E402
import socket  # noqa: E402
import sys  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402


class AgentEvents:
    def __init__(self, root: str, host: str) -> None:
        self.path = Path(root) / f"a{host}-{os.getpid()}.jsonl"
        self.base = {"host": host, "pid": os.getpid()}
        self.seen: set[str] = set()  # detections written since the last restart

    def __call__(self, ev: str, t: float | None = None, **extra: Any) -> None:
        line = json.dumps({"t": time.time() if t is None else t, "ev": ev, **self.base, **extra})
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line + "\n")


def _around(cls: Any, name: str, ev: AgentEvents) -> None:
    """``cls.name`` wrapped: ``<name>_begin`` and ``<name>_end`` events around each call."""
    original: Callable[..., Any] = getattr(cls, name)

    @functools.wraps(original)
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        ev(f"{name.strip('_')}_begin")
        try:
            return original(self, *args, **kwargs)
        finally:
            ev(f"{name.strip('_')}_end")
    setattr(cls, name, wrapped)


def hook(ev: AgentEvents) -> None:
    """The agent's steps written as they happen (module doc)."""
    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    monitor = LocalElasticAgent._monitor_workers
    waiting = DynamicRendezvousHandler.num_nodes_waiting

    def monitored(self: Any, group: Any) -> Any:
        result = monitor(self, group)
        state = result.state
        if state in (WorkerState.FAILED, WorkerState.UNHEALTHY) and "failed" not in ev.seen:
            ev.seen.add("failed")
            ev("workers_failed", state=state.name)
        return result

    def nodes_waiting(self: Any) -> int:
        n = int(waiting(self))
        if n > 0 and "waiting" not in ev.seen:
            ev.seen.add("waiting")
            ev("nodes_waiting", n=n)
        return n

    LocalElasticAgent._monitor_workers = monitored  # type: ignore[method-assign]
    DynamicRendezvousHandler.num_nodes_waiting = nodes_waiting  # type: ignore[method-assign]
    for name in ("_restart_workers", "_stop_workers", "_rendezvous", "_start_workers"):
        _around(LocalElasticAgent, name, ev)
    restart = LocalElasticAgent._restart_workers

    def restarted(self: Any, group: Any) -> Any:
        ev.seen.clear()
        return restart(self, group)
    LocalElasticAgent._restart_workers = restarted  # type: ignore[method-assign]


def set_hostname(name: str) -> None:
    """This UTS namespace's hostname := ``name``; refused in the driver's namespace
    ($BENCH_PARENT_UTS)."""
    if os.readlink("/proc/self/ns/uts") == os.environ.get("BENCH_PARENT_UTS"):
        raise SystemExit("recovery_agent: not in a UTS namespace of its own; hostname left alone")
    socket.sethostname(name)


def main(argv: list[str]) -> int:
    hostname, events, dash, *torchrun = argv
    if dash != "--":
        raise SystemExit("usage: python -m benchmarks.recovery_agent HOSTNAME|- EVENTS -- ARGS")
    if hostname != "-":
        set_hostname(hostname)
    ev = AgentEvents(events, os.environ.get("BENCH_HOST", "?"))
    ev("agent_start", t=T0)
    hook(ev)
    ev("agent_ready")
    from torch.distributed.run import main as torchrun_main

    torchrun_main(torchrun)
    ev("agent_exit")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
