"""Per-rank bodies of tests/test_manager_policy.py's two-rank tests (module-level: ranks are
spawned by ckptio.testing.rank_processes.run_ranks and import them by name)."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import torch

import ckptio
from ckptio.managing.manager import CheckpointManager

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


class AfterHalfASecond:
    """A user's save policy: due half a second after the last save started (or the start)."""

    def due(self, moment: Any) -> bool:
        return bool(moment.now - moment.last_time >= 0.5)


def users_policy_on_rank_0s_moment(rank: int, world: int, root: str,
                                   sleeper: int) -> dict[str, Any]:
    """clock_of_rank_0 with a user's save policy: every rank asks it with rank 0's moment."""
    mgr = CheckpointManager(root, save=AfterHalfASecond(), options=SMALL)
    if rank == sleeper:
        time.sleep(0.8)
    due = [mgr.should_save(1)]
    saved = mgr.save(1, _state(rank, 1)) is not None
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


def deltas_on_two_ranks(rank: int, world: int, root: str) -> dict[str, Any]:
    """Two ranks each hold half of a frozen block and of moving weights, saved with a delta
    policy (full_every=3) and keep_last=2: rank 0 decides each base, both ranks save against
    it; then every kept step is loaded whole by each rank and compared, and restore() on a
    fresh manager resumes the newest."""
    from ckptio.format.manifest import MANIFEST_NAME, bases_of, decode
    from ckptio.storage.select import store_for

    def whole(step: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(0)
        frozen = torch.randn(64, 256, generator=g)
        w = torch.randn(64, 64, generator=g).to(torch.bfloat16)
        w[: step % 64] += step
        return {"frozen": frozen, "w": w}

    def shards(step: int) -> dict[str, Any]:
        rows = slice(32 * rank, 32 * rank + 32)
        return {k: ckptio.TensorShard(v[rows].clone(), tuple(v.shape), (32 * rank, 0))
                for k, v in whole(step).items()}

    mgr = CheckpointManager(root, keep_last=2, options=SMALL,
                            delta=ckptio.DeltaPolicy(full_every=3))
    bases = {}
    for step in range(1, 6):
        mgr.save(step, {**shards(step), "step": step})
        store = store_for(mgr.path(step))
        bases[step] = list(bases_of(decode(store.read_manifest(), store.path_of(MANIFEST_NAME))))
    kept = mgr.steps()
    exact = []
    for step in kept:
        out = ckptio.load(mgr.path(step))
        exact.append(all(torch.equal(out[k].view(torch.uint8), v.view(torch.uint8))
                         for k, v in whole(step).items()))
    mgr.close()
    fresh = CheckpointManager(root, keep_last=2, options=SMALL)
    after_close = fresh.steps()
    state = {**shards(0), "step": 0}
    restored = fresh.restore(state)
    fresh.close()
    return {"bases": bases, "kept": kept, "exact": exact, "restored": restored,
            "after_close": after_close,
            "w": bool(torch.equal(state["w"].local, shards(restored)["w"].local))}
