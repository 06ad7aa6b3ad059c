"""The restore of a manager with redundancy: one step agreed by every rank, each rank's copy
brought into its memory first where its host was lost (called by CheckpointManager.restore).

1. rebuild.recover (via the Guard): the newest step every rank can hold in memory, verified,
   fetched from partners or rebuilt from parity where a rank's memory lacks it;
2. the newest step every rank holds in some tier (its memory or a slower tier), when newer than
   that or when 1 found none (two hosts of one parity group lost, a copy damaged): each rank
   restores it from the fastest of its tiers holding it, with a warning naming the hosts lost,
   the copies passed over and the step chosen. Steps saved by a job of another number of
   ranks (each rank's piece says so) are left out of 1 and 2: the newest of them whose every
   piece survives in memory is restored resharded (redundancy/elastic.py) when newer than what 1
   and 2 find; else the error names them;
3. every rank's load must succeed: each rank's outcome (loaded / damaged and why / another
   error) is exchanged with every rank right after its load. Damage on any rank makes every
   rank go through 1 once more, a damaged copy in a rank's own memory counted as lost (its
   partner's copy or its parity brings the step back), then 2; any other error on any rank
   makes every rank raise RankFailedError naming each failing rank and its error at once (no
   rank is left waiting for a timeout).

Owns: that order and its messages, ``last_restore``'s redundancy fields. Does not own: the
recovery (rebuild.py), the per-rank restore through the tiers (managing/restoring.py, the
manager's one restore loop, which step 2 calls).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from ckptio.errors import CheckpointNotFoundError, CkptError, RankFailedError
from ckptio.managing import warn
from ckptio.managing.guard import Guard, fallback_step
from ckptio.managing.level import TierSteps
from ckptio.managing.restoring import Restored, restore_first
from ckptio.redundancy.rebuild import Recovery

__all__ = ["restore_guarded"]

log = logging.getLogger("ckptio")


def restore_guarded(guard: Guard, levels: Sequence[TierSteps],
                    listings: Callable[[], list[dict[str, list[Any]]]],
                    verify: Callable[[str], Any], state: Any, step: int | None,
                    load_kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """CheckpointManager.restore with redundancy (module docstring); collective. ``levels``:
    this rank's tiers; ``listings()``: their steps. -> the manager's ``last_restore`` record,
    or None when nothing was saved anywhere, on any rank.

    A restore of the newest step (``step`` None) that agreed on an older step than this rank
    holds committed (a step another rank lost before it was protected) leaves those newer
    steps unusable as the job's: the saves after the resume may replace them, as they
    replace a step a load found damaged. Every tier is listed once (those newer steps are
    read from the same listing: the restore commits no newer step in the first tier)."""
    started = time.perf_counter()
    failed = None
    try:
        guard.settle()  # a previous restore's step still being written: listed once written
    except Exception as exc:  # noqa: BLE001 - said to every rank at the inventory and raised
        # there (guard.recover): no rank waits for this one (step_timeout_s)
        failed = f"{type(exc).__name__}: {exc}"
    listing = listings()
    record = _restore(guard, levels, listing, listings, verify, state, step, load_kwargs,
                      started, failed=failed)
    if record is not None and step is None:
        for level, tier in zip(levels, listing):
            for newer in (s for s in tier["committed"] if s > record["step"]):
                level.mark_damaged(newer)
    return record


def _restore(guard: Guard, levels: Sequence[TierSteps], listing: list[dict[str, list[Any]]],
             listings: Callable[[], list[dict[str, list[Any]]]],
             verify: Callable[[str], Any], state: Any, step: int | None,
             load_kwargs: dict[str, Any], started: float,
             damaged: int | None = None, passed: list[str] | None = None,
             failed: str | None = None) -> dict[str, Any] | None:
    """restore_guarded's restore, from ``listing`` (every tier's steps, listed once);
    ``listings()`` lists them anew for the fallback to slower tiers. ``damaged``: the step
    whose load from this rank's memory found it damaged (the restore made again, once,
    with that copy counted as lost: a partner's copy or its parity rebuild it, else the
    fallback leaves it out); ``passed``: what the first try passed over; ``failed``: this
    rank's error before (its landing's write: guard.recover says it to every rank)."""
    others = set[int]()
    kept = [_this_world(level, tier["committed"], guard.world, others)  # each manifest once
            for level, tier in zip(levels, listing)]
    kept[0] = [s for s in kept[0] if s != damaged]
    own, anywhere = kept[0], sorted({s for steps in kept for s in steps})
    recovery = guard.recover(own, anywhere, verify, step, sorted(others), failed)
    # every rank's, gathered with the inventory: alike on every rank, one outcome everywhere
    others = {s for extra in recovery.extras for s in extra["others"]}
    fallback = fallback_step(recovery, step)
    retry, passed = passed is None, [*(passed or []), *recovery.skipped]
    newest = max((s for s in (recovery.step, fallback) if s is not None), default=None)
    resharded = _resharded(guard, recovery, levels[0], state, step, newest, load_kwargs,
                           passed)
    if resharded is not None:
        return _done(guard, levels, resharded[0], 0, "resharded", started, passed, [],
                     resharded[1])
    if recovery.step is not None and (fallback is None or recovery.step >= fallback):
        memory = recovery.step
        landed = recovery.landed  # received from peers, still being written: from memory
        checked = {**load_kwargs, "verify": False}  # every entry checked as it landed
        mine: list[str | None] = []

        def load_memory() -> str | None:
            mine.append(levels[0].try_load(memory, state, load_kwargs) if landed is None
                        else levels[0].try_load_at(landed, state, checked))
            return mine[0]

        why = _agreed(guard, f"loading step {memory} from memory", load_memory)
        guard.start_writes()  # its load done: the received step written into the tier now
        if why is None:
            source = recovery.sources[guard.rank]
            return _done(guard, levels, memory, 0, source, started, passed, recovery.lost_hosts,
                         recovery.received, recovery.received_from)
        passed.append(f"step {memory} in memory: {why}")
        if retry:  # every rank again, a damaged copy counted as lost (once)
            return _restore(guard, levels, listing, listings, verify, state, step,
                            load_kwargs, started, memory if mine and mine[0] else None, passed)
        fallback = fallback_step(recovery, step)
    if fallback is None:
        if step is None and not any(recovery.anywhere) and not others:
            return None  # nothing saved anywhere, on any rank
        raise CheckpointNotFoundError(
            f"no step {'' if step is None else f'{step} '}can be restored on every rank: "
            f"memory: {'; '.join(passed) or 'no step every rank can obtain'}; "
            f"{_lost_or_other(recovery, others, guard.world, levels[1:])}")
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
                 recovery.lost_hosts, recovery.received, recovery.received_from)


def _this_world(level: TierSteps, steps: list[int], world: int, others: set[int]) -> list[int]:
    """The steps of ``level`` saved by a job of ``world`` ranks (or by one whose pieces do not
    say: older checkpoints); the others are added to ``others``."""
    kept = []
    for step in steps:
        try:
            piece = level.manifest(step).meta.get("piece")
        except CkptError:
            piece = None  # damaged or gone: the restore names it when it tries the step
        if isinstance(piece, dict) and piece.get("world_size") != world:
            others.add(step)
        else:
            kept.append(step)
    return kept


def _lost_or_other(recovery: Recovery, others: set[int], world: int,
                   slower: Sequence[TierSteps]) -> str:
    """The end of the error when no step can be restored: the hosts lost and each rank's
    steps, or (steps of another rank count found) what a restart on another count needs.
    ``slower``: the tiers after the memory tier."""
    if not others:
        keeps = ("a slower tier (tiers=[Tier('shm://...', redundancy=...), Tier('/disk/run', "
                 "every=...)]) keeps one for the next time" if not slower else
                 "the slower tiers (" + ", ".join(f"{t.location}, every={t.every}"
                                                   for t in slower)
                 + ") hold no step every rank can load: each receives only the steps its "
                 "every= divides")
        fix = ("" if not recovery.lost_hosts else ". More hosts were lost than the memory "
               "tier's redundancy rebuilds: start from scratch or from a step kept elsewhere; "
               + keeps)
        return (f"hosts lost: {', '.join(recovery.lost_hosts) or 'none'}; steps per rank in "
                f"any tier: {recovery.anywhere}{fix}")
    return (f"steps {sorted(others)} were saved by a job of another number of ranks (each "
            f"rank's own piece): a job of {world} ranks restores them only from memory, where "
            "every rank's piece must survive, or its partner's copy, or enough of its parity "
            "group to rebuild it (delta steps: not resharded from memory); restart with the "
            "rank count that saved them")


def _resharded(guard: Guard, recovery: Recovery, level: TierSteps, state: Any, step: int | None,
               newest: int | None, load_kwargs: dict[str, Any],
               passed: list[str]) -> tuple[int, int] | None:
    """Collective: the newest step (``step`` only, when given) a job of another number of ranks
    left in memory, newer than ``newest``, restored resharded into ``state`` -> (that step, the
    bytes this rank received); None when there is none or its load found damage (named in
    ``passed``)."""
    restart = guard.restart(passed, recovery)
    try:
        # a step of this rank count too, newer than ``newest``: its pieces in other hosts'
        # memories (the ranks restarted on other hosts), every one held somewhere
        while (choice := restart.next(step, -1 if newest is None else newest)) is not None:
            if newest is not None and choice.step <= newest:
                return None
            fetched = restart.fetch(choice, state, load_kwargs)
            if fetched is None:
                continue  # a piece failed its check: passed over, the plan made again
            kwargs = {k: v for k, v in load_kwargs.items() if k != "per_rank_from"}  # applied

            def load() -> str | None:
                where = restart.install(fetched)
                try:
                    return level.try_load_at(where.location, state, kwargs)
                finally:
                    where.remove_tree()

            why = _agreed(guard, f"restoring step {choice.step} resharded from memory", load)
            if why is None:
                return choice.step, fetched.received
            passed.append(f"step {choice.step} resharded from the memory of {choice.world} ranks: "
                          f"{why}")
            return None
        return None
    finally:
        restart.close()  # the pieces it rebuilt from parity (in this process's memory)


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
          started: float, passed: list[str], lost: list[str],
          received: int = 0, received_from: dict[int, int] | None = None) -> dict[str, Any]:
    if source != "resharded":  # the step was another job's: nothing of this rank's to keep
        levels[tier].succeeded(step)
    record = {"step": step, "tier": tier, "location": levels[tier].location,
              "seconds": time.perf_counter() - started, "source": source,
              "redundancy": guard.spec.describe(), "lost_hosts": lost, "skipped": passed,
              "received_bytes": received, "received_from": dict(received_from or {})}
    log.info("ckptio: rank %d restored step %d (%s) in %.3f s", guard.rank, step, source,
             record["seconds"])
    return record
