"""Rank bodies (for run_ranks) of a save or load during which one rank is killed (SIGKILL, at a
chosen phase), and what every other rank saw: tests/test_rank_death.py and
benchmarks/rank_death.py. Test support only.

Each body first saves (or has saved) a complete checkpoint, then arms the victim: a function
the save or load calls at that phase is replaced, in the victim's process only, by one that
writes the time to ``mark`` and kills the process. Survivors return (what they raised, when,
its message, RankFailedError.ranks). ``PHASES`` names every phase.
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
from ckptio.distributed import collective, rankplan, storegroup
from ckptio.saving import persist

__all__ = ["PHASES", "killer", "load_killed", "options", "save_for_load", "save_killed"]

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
    ``how="freeze"`` stops it (SIGSTOP: alive, holding its sockets, answering nothing)."""
    def kill(*_args: Any, **_kwargs: Any) -> Any:
        Path(mark).write_text(repr(time.time()))
        os.kill(os.getpid(), signal.SIGSTOP if how == "freeze" else signal.SIGKILL)

    return kill


def _arm(phase: str, mark: str, how: str) -> None:
    """Make this process die (or freeze) at ``phase``."""
    kill = killer(mark, how)
    if phase == "save:plan":  # while planning, before sending its plan
        rankplan.local_plan = kill
    elif phase == "save:agree":  # its plan sent, waiting for the coordinator's answer
        storegroup.StoreGroup.scatter = kill
    elif phase == "save:write":  # writing its share
        persist.SaveJob.finish = kill
    elif phase == "save:conclude":  # written, before reporting it
        collective.conclude = kill
    elif phase == "load:keys":  # before the step that checks every rank's keys
        collective.UnexpectedKeys.__call__ = kill
    elif phase == "load:read":  # reading its share
        import ckptio.api

        ckptio.api.read_regions = kill
    elif phase == "load:end":  # loaded, before the final agreement
        collective.agree_loaded = kill
    else:
        raise ValueError(phase)


def _outcome(body: Any) -> tuple[str, float, str, tuple[int, ...]]:
    try:
        body()
    except ckptio.RankFailedError as exc:
        return "RankFailedError", time.time(), str(exc), exc.ranks
    except Exception as exc:  # noqa: BLE001 - the test shows which type escaped
        return type(exc).__name__, time.time(), str(exc), ()
    return "ok", time.time(), "", ()


def save_killed(rank: int, world: int, path: str, phase: str, victim: int, mark: str,
                deadline_s: float, how: str = "kill") -> Any:
    ckptio.save(state(rank, 1), path, options=options(deadline_s))
    if rank == victim:
        _arm(phase, mark, how)
    return _outcome(lambda: ckptio.save(state(rank, 2), path, options=options(deadline_s)))


def save_for_load(rank: int, world: int, path: str) -> None:
    ckptio.save(state(rank, 1), path, options=options(60.0))


def load_killed(rank: int, world: int, path: str, phase: str, victim: int, mark: str,
                deadline_s: float, how: str = "kill") -> Any:
    if rank == victim:
        _arm(phase, mark, how)
    into = state(rank, 0)
    return _outcome(lambda: ckptio.load(path, into, options=options(deadline_s)))
