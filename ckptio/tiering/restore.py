"""The restore of a tiered manager with redundancy: one step agreed by every rank, each rank's
copy brought into its memory first where its host was lost.

1. rebuild.recover (via the Guard): the newest step every rank can hold in memory, verified,
   fetched from partners or rebuilt from parity where a rank's memory lacks it;
2. the newest step every rank holds in some tier (its memory or a slower tier), when newer than
   that or when 1 found none (two hosts of one parity group lost, a copy damaged): each rank
   restores it from the fastest of its tiers holding it, with a warning naming the hosts lost,
   the copies passed over and the step chosen;
3. every rank's load must succeed (agreed); a memory load that fails on any rank sends every
   rank to 2.

Owns: that order and its messages, ``last_restore``'s redundancy fields. Does not own: the
recovery (rebuild.py), the per-rank restore through the tiers (manager.py).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from ckptio.errors import CheckpointNotFoundError, CorruptCheckpointError, CkptError
from ckptio.managing import warn
from ckptio.tiering.guard import Guard, fallback_step

__all__ = ["restore_guarded"]

log = logging.getLogger("ckptio")


def restore_guarded(mgr: Any, guard: Guard, state: Any, step: int | None,
                    load_kwargs: dict[str, Any]) -> int | None:
    """TieredManager.restore with redundancy (module docstring); collective."""
    started = time.perf_counter()
    listing = mgr._listings()
    own = listing[0]["committed"]
    anywhere = sorted({s for tier in listing for s in tier["committed"]})
    recovery = guard.recover(own, anywhere, mgr._ck.verify, step)
    fallback = fallback_step(recovery, step)
    passed = list(recovery.skipped)
    if recovery.step is not None and (fallback is None or recovery.step >= fallback):
        why = mgr._levels[0]._try_load(recovery.step, state, load_kwargs)
        if guard.agree(why is None):
            source = recovery.sources[guard.rank]
            return _done(mgr, guard, recovery.step, 0, source, started, passed,
                         recovery.lost_hosts)
        passed.append(f"step {recovery.step} in memory: {why or 'failed on another rank'}")
        fallback = fallback_step(recovery, step)
    if fallback is None:
        if step is None and not any(recovery.anywhere):
            return None  # nothing saved anywhere, on any rank
        raise CheckpointNotFoundError(
            f"no step {'' if step is None else f'{step} '}can be restored on every rank: "
            f"memory: {'; '.join(passed) or 'no step every rank can obtain'}; hosts lost: "
            f"{', '.join(recovery.lost_hosts) or 'none'}; steps per rank in any tier: "
            f"{recovery.anywhere}")
    error: CkptError | None = None
    try:
        mgr._restore_tiers(state, fallback, load_kwargs)
    except CkptError as exc:
        error = exc
    if not guard.agree(error is None):
        raise error or CorruptCheckpointError(
            f"step {fallback} could not be restored on another rank (its warning says why); "
            "this rank's state may be partly loaded")
    tier = mgr.last_restore["tier"] if mgr.last_restore else 0
    lost = ", ".join(recovery.lost_hosts) or "none"
    warn(f"ckptio: restored step {fallback} from {mgr.tiers[tier].location} on rank "
         f"{guard.rank}: no newer step could be obtained in the memory of every rank (hosts "
         f"lost: {lost}; {guard.spec.describe()}"
         f"{'; passed over: ' + '; '.join(passed) if passed else ''})", stacklevel=4)
    return _done(mgr, guard, fallback, tier, "own" if tier == 0 else "disk", started, passed,
                 recovery.lost_hosts)


def _done(mgr: Any, guard: Guard, step: int, tier: int, source: str, started: float,
          passed: list[str], lost: list[str]) -> int:
    mgr._levels[tier]._succeeded(step)
    mgr.last_restore = {"step": step, "tier": tier, "location": mgr.tiers[tier].location,
                        "seconds": time.perf_counter() - started, "source": source,
                        "redundancy": guard.spec.describe(), "lost_hosts": lost,
                        "skipped": passed}
    log.info("ckptio: rank %d restored step %d (%s) in %.3f s", guard.rank, step, source,
             mgr.last_restore["seconds"])
    return step
