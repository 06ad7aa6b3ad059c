"""Rank bodies (for run_ranks) of a save or load during which one rank is killed (SIGKILL) or
frozen (SIGSTOP) at a chosen phase, and what every other rank saw: tests/test_rank_death.py and
benchmarks/rank_death.py. Test support only.

Each body first saves (or has saved) a complete checkpoint, then arms the victim: a function
the save or load calls at that phase is replaced, in the victim's process only, by one that
writes the time to ``mark`` and kills the process (or, with ``how="freeze"``, stops it). The
victim writes its process id to ``mark + ".pid"`` when armed. Survivors return (what they
raised, when, its message, RankFailedError.ranks, and the victim's process state when they
returned: process_state(), or "not armed"). ``PHASES`` names every phase.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch

import ckptio
from ckptio.distributed import collective, loadsteps, rankplan, storegroup
from ckptio.saving import persist

__all__ = ["PHASES", "arm", "killer", "load_killed", "options", "process_state", "save_for_load",
           "restore_killed", "save_killed", "save_then_exit", "victim_pid"]

PHASES = ("save:plan", "save:agree", "save:write", "save:conclude", "load:keys", "load:read",
          "load:end")


def options(deadline_s: float) -> ckptio.Options:
    """A small pool (each rank would otherwise pre-fault 256 MiB) and a short deadline."""
    return dataclasses.replace(ckptio.Options(buffer_bytes=1 << 20, pool_bytes=4 << 20),
                               rank_timeout_s=deadline_s, step_timeout_s=120.0)


def state(rank: int, step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(256, 256, generator=g), "b": torch.randn(256, generator=g)},
            f"rank{rank}": torch.full((1000,), float(rank * 100 + step)), "step": step}


def killer(mark: str, how: str = "kill") -> Any:
    """A function that writes the time to ``mark`` and kills this process (SIGKILL), or with
    ``how="freeze"`` stops it (SIGSTOP: alive, holding its sockets, answering nothing). A
    frozen victim that something continues (SIGCONT: the kernel sends one, after SIGHUP, to a
    stopped process whose group becomes orphaned, and SIGHUP is ignored under nohup) stops
    again: it never returns into the code it replaced, so it never answers."""
    def kill(*_args: Any, **_kwargs: Any) -> Any:
        Path(mark).write_text(repr(time.time()))
        while True:  # SIGKILL does not return; a stopped process returns only if continued
            os.kill(os.getpid(), signal.SIGSTOP if how == "freeze" else signal.SIGKILL)

    return kill


def victim_pid(mark: str) -> int | None:
    """The process id the victim wrote when it was armed (None: not armed yet)."""
    written = Path(f"{mark}.pid")
    return int(written.read_text()) if written.exists() else None


def process_state(pid: int) -> str:
    """The state letter of process ``pid`` (/proc/<pid>/stat: "T" stopped, "Z" exited but not
    yet reaped, "S" sleeping...), or "gone"."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return "gone"
    return stat.rsplit(")", 1)[1].split()[0]  # after "pid (name)": the name may hold spaces


def arm(phase: str, mark: str, how: str) -> None:
    """Make this process die (or freeze) at ``phase``."""
    Path(f"{mark}.pid.tmp").write_text(str(os.getpid()))
    os.replace(f"{mark}.pid.tmp", f"{mark}.pid")  # whole when it appears
    from ckptio.loading import read

    targets: dict[str, tuple[Any, str]] = {
        "save:plan": (rankplan, "local_plan"),  # while planning, before sending its plan
        "save:agree": (storegroup.StoreGroup, "scatter"),  # plan sent, waiting for the answer
        "save:write": (persist.SaveJob, "finish"),  # writing its share
        "save:conclude": (collective, "conclude"),  # written, before reporting it
        "load:keys": (loadsteps.UnexpectedKeys, "__call__"),  # before the keys step
        "load:read": (read, "read_regions"),  # reading its share
        "load:end": (loadsteps, "agree_loaded"),  # loaded, before the final agreement
    }
    if phase not in targets:
        raise ValueError(phase)
    owner, name = targets[phase]
    if not hasattr(owner, name):  # a renamed function: arming would silently do nothing
        raise AttributeError(f"killed: {owner!r} has no {name!r} to replace for {phase}")
    setattr(owner, name, killer(mark, how))


def _outcome(body: Any, mark: str) -> tuple[str, float, str, tuple[int, ...], str]:
    try:
        body()
    except ckptio.RankFailedError as exc:
        kind, when, message, ranks = "RankFailedError", time.time(), str(exc), exc.ranks
    except Exception as exc:  # noqa: BLE001 - the test shows which type escaped
        kind, when, message, ranks = type(exc).__name__, time.time(), str(exc), ()
    else:
        kind, when, message, ranks = "ok", time.time(), "", ()
    pid = victim_pid(mark)
    return kind, when, message, ranks, "not armed" if pid is None else process_state(pid)


def save_killed(rank: int, world: int, path: str, phase: str, victim: int, mark: str,
                deadline_s: float, how: str = "kill") -> Any:
    ckptio.save(state(rank, 1), path, options=options(deadline_s))
    if rank == victim:
        arm(phase, mark, how)
    return _outcome(lambda: ckptio.save(state(rank, 2), path, options=options(deadline_s)),
                    mark)


def save_for_load(rank: int, world: int, path: str) -> None:
    ckptio.save(state(rank, 1), path, options=options(60.0))


def load_killed(rank: int, world: int, path: str, phase: str, victim: int, mark: str,
                deadline_s: float, how: str = "kill") -> Any:
    if rank == victim:
        arm(phase, mark, how)
    into = state(rank, 0)
    return _outcome(lambda: ckptio.load(path, into, options=options(deadline_s)), mark)


def restore_killed(rank: int, world: int, root: str, phase: str, victim: int, mark: str,
                   deadline_s: float, how: str = "kill") -> Any:
    """A CheckpointManager under ``root`` saves step 1 on every rank; then, the victim armed,
    every rank restores it into a fresh state (a job's restart, in the same processes)."""
    with ckptio.CheckpointManager(root, options=options(deadline_s)) as manager:
        manager.save(1, state(rank, 1))
    if rank == victim:
        arm(phase, mark, how)
    into = state(rank, 0)
    manager = ckptio.CheckpointManager(root, options=options(deadline_s))
    return _outcome(lambda: manager.restore(into), mark)


def save_then_exit(rank: int, world: int, path: str, victim: int,
                   deadline_s: float) -> Any:
    """Every rank saves step 1; then ``victim`` returns, and its interpreter ends (a spawned
    rank finalizes: a script that ended or raised), while the others save step 2 -> on them,
    _outcome's tuple and the seconds their save took."""
    ckptio.save(state(rank, 1), path, options=options(deadline_s))
    if rank == victim:
        return None
    started = time.monotonic()
    outcome = _outcome(lambda: ckptio.save(state(rank, 2), path, options=options(deadline_s)),
                       path + ".no-mark")
    return (*outcome, time.monotonic() - started)
