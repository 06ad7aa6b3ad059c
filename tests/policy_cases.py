"""Per-rank bodies of tests/test_manager_policy.py's two-rank tests (module-level: ranks are
spawned by ckptio.testing.ranks.run_ranks and import them by name)."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import torch

import ckptio
from ckptio.manager import CheckpointManager

SMALL = ckptio.Options(buffer_bytes=1 << 20, pool_bytes=4 << 20)


def _state(rank: int, step: int) -> dict[str, Any]:
    return {"w": torch.full((64,), float(step * 10 + rank)), "step": step}


def preempted_by_one_rank(rank: int, world: int, root: str) -> dict[str, Any]:
    """SIGTERM reaches rank 1 only, during step 3: both ranks see reached_preemption from step
    3 on, both save step 3 (due by nothing else: save_every=100) and stop there."""
    before = signal.getsignal(signal.SIGTERM)
    mgr = CheckpointManager(root, save_every=100, keep_last=2, preemption=True, options=SMALL)
    seen, saved = [], []
    for step in range(1, 50):
        if rank == 1 and step == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # a real signal, to this rank's process only
        if mgr.save(step, _state(rank, step), asynchronous=True) is not None:
            saved.append(step)
        seen.append(mgr.reached_preemption(step))
        if seen[-1]:
            break
    mgr.close()
    handler_back = signal.getsignal(signal.SIGTERM) == before
    return {"seen": seen, "saved": saved, "steps": CheckpointManager(root, options=SMALL).steps(),
            "handler_back": handler_back}


def clock_of_rank_0(rank: int, world: int, root: str, sleeper: int) -> dict[str, Any]:
    """save_interval_s=0.5, save_every=None. Before asking at step 1, rank ``sleeper`` sleeps
    0.8 s (so its own clock says due and the other's, which asked at once and waits in the
    all-gather, says not): every rank gets rank 0's answer."""
    mgr = CheckpointManager(root, save_interval_s=0.5, options=SMALL)
    if rank == sleeper:
        time.sleep(0.8)
    due = [mgr.should_save(1)]
    saved = mgr.save(1, _state(rank, 1)) is not None  # the same answer, not asked again
    mgr.close()
    return {"due": due, "saved": saved}


def best_by_rank_0(rank: int, world: int, root: str) -> dict[str, Any]:
    """keep_best=1 by 'loss' (min), keep_last=1; rank 1 passes the opposite losses: rank 0's
    decide which step is kept and are what is stored."""
    mgr = CheckpointManager(root, keep_last=1, keep_best=1, monitor="loss", options=SMALL)
    losses = {1: 3.0, 2: 1.0, 3: 2.0, 4: 5.0}
    for step, loss in losses.items():
        mine = loss if rank == 0 else -loss
        mgr.save(step, _state(rank, step), asynchronous=step % 2 == 0,
                 metrics={"loss": mine}, metadata={"rank": rank})
    mgr.wait()
    out = {"steps": mgr.steps(), "meta": mgr.metadata(2)}
    mgr.close()
    return out
