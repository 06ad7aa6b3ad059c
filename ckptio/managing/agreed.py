"""The restore of a manager with redundancy: one step agreed by every rank, each rank's copy
brought into its memory first where its host was lost (called by CheckpointManager.restore).

1. rebuild.recover (via the Guard): the newest step every rank can hold in memory, verified,
   fetched from partners or rebuilt from parity where a rank's memory lacks it;
2. the newest step every rank holds in some tier (its memory or a slower tier), when newer than
   that or when 1 found none (two hosts of one parity group lost, a copy damaged): each rank
   restores it from the fastest of its tiers holding it, with a warning naming the hosts lost,
   the copies passed over and the step chosen;
3. every rank's load must succeed: each rank's outcome (loaded / damaged and why / another
   error) is exchanged with every rank right after its load. Damage on any rank sends every
   rank to 2; any other error on any rank makes every rank raise RankFailedError naming each
   failing rank and its error at once (no rank is left waiting for a timeout).

Owns: that order and its messages, ``last_restore``'s redundancy fields. Does not own: the
recovery (rebuild.py), the per-rank restore through the tiers (managing/restoring.py, the
manager's one restore loop, which step 2 calls).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from ckptio.errors import CheckpointNotFoundError, RankFailedError
from ckptio.managing import warn
from ckptio.managing.level import TierSteps
from ckptio.managing.restoring import Restored, restore_first
from ckptio.tiering.guard import Guard, fallback_step

__all__ = ["restore_guarded"]

log = logging.getLogger("ckptio")


def restore_guarded(guard: Guard, levels: Sequence[TierSteps],
                    listings: Callable[[], list[dict[str, list[Any]]]],
                    verify: Callable[[str], Any], state: Any, step: int | None,
                    load_kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """CheckpointManager.restore with redundancy (module docstring); collective. ``levels``:
    this rank's tiers; ``listings()``: their steps. -> the manager's ``last_restore`` record,
    or None when nothing was saved anywhere, on any rank."""
    started = time.perf_counter()
    listing = listings()
    own = listing[0]["committed"]
    anywhere = sorted({s for tier in listing for s in tier["committed"]})
    recovery = guard.recover(own, anywhere, verify, step)
    fallback = fallback_step(recovery, step)
    passed = list(recovery.skipped)
    if recovery.step is not None and (fallback is None or recovery.step >= fallback):
        memory = recovery.step
        why = _agreed(guard, f"loading step {memory} from memory",
                      lambda: levels[0].try_load(memory, state, load_kwargs))
        if why is None:
            source = recovery.sources[guard.rank]
            return _done(guard, levels, memory, 0, source, started, passed, recovery.lost_hosts)
        passed.append(f"step {memory} in memory: {why}")
        fallback = fallback_step(recovery, step)
    if fallback is None:
        if step is None and not any(recovery.anywhere):
            return None  # nothing saved anywhere, on any rank
        raise CheckpointNotFoundError(
            f"no step {'' if step is None else f'{step} '}can be restored on every rank: "
            f"memory: {'; '.join(passed) or 'no step every rank can obtain'}; hosts lost: "
            f"{', '.join(recovery.lost_hosts) or 'none'}; steps per rank in any tier: "
            f"{recovery.anywhere}")
    restored: list[Restored] = []

    def load_fallback() -> None:  # the manager's one restore loop, for that step
        restored.append(restore_first(levels, listings(), state, fallback, load_kwargs,
                                      stacklevel=6))

    _agreed(guard, f"restoring step {fallback} from its tiers", load_fallback)
    tier = restored[0].tier if restored else 0
    lost = ", ".join(recovery.lost_hosts) or "none"
    warn(f"ckptio: restored step {fallback} from {levels[tier].location} on rank "
         f"{guard.rank}: no newer step could be obtained in the memory of every rank (hosts "
         f"lost: {lost}; {guard.spec.describe()}"
         f"{'; passed over: ' + '; '.join(passed) if passed else ''})", stacklevel=4)
    return _done(guard, levels, fallback, tier, "own" if tier == 0 else "disk", started, passed,
                 recovery.lost_hosts)


def _agreed(guard: Guard, what: str, load: Callable[[], str | None]) -> str | None:
    """Run ``load`` on this rank and exchange every rank's outcome (collective): -> None when
    every rank loaded, else every damaged rank's reason (the restore falls back). An error on
    any rank that is not damage -> RankFailedError on every rank, naming each failing rank and
    its error, as soon as every rank has tried (never a wait for a timeout)."""
    why: str | None = None
    error: Exception | None = None
    try:
        why = load()
    except Exception as exc:  # noqa: BLE001 - exchanged, then raised on every rank below
        error = exc
    text = None if error is None else f"{type(error).__name__}: {error}"
    outcomes = guard.outcomes({"why": why, "error": text})
    failed = {r: o["error"] for r, o in enumerate(outcomes) if o["error"] is not None}
    if failed:
        named = "; ".join(f"rank {r}: {e}" for r, e in failed.items())
        raise RankFailedError(
            f"restore on rank {guard.rank}: {what} failed on {len(failed)} rank(s): {named}. "
            "This rank's state may be partly loaded; fix that error and restore again",
            tuple(failed)) from error
    damaged = [f"rank {r}: {o['why']}" for r, o in enumerate(outcomes) if o["why"] is not None]
    return "; ".join(damaged) or None


def _done(guard: Guard, levels: Sequence[TierSteps], step: int, tier: int, source: str,
          started: float, passed: list[str], lost: list[str]) -> dict[str, Any]:
    levels[tier].succeeded(step)
    record = {"step": step, "tier": tier, "location": levels[tier].location,
              "seconds": time.perf_counter() - started, "source": source,
              "redundancy": guard.spec.describe(), "lost_hosts": lost, "skipped": passed}
    log.info("ckptio: rank %d restored step %d (%s) in %.3f s", guard.rank, step, source,
             record["seconds"])
    return record
