"""The drain's route through a manager's tiers: TierRoute (managing/drain.py's Route protocol).

The drain thread (on the coordinating rank) asks it where a step is read from (the fastest tier
before the target holding it committed), where it is written, which bases a delta needs first,
and tells it when a copy committed in a slower tier (that tier's retention then runs, here, on
the drain's thread).

At start (``resume``) every tier must be listable, and the drain is handed what a run cut
short left undrained. Owns: those answers over the list of TierSteps. Does not own: the copy
or the queue (drain.py), the tiers' steps (level.py).
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from typing import Any

from ckptio.errors import CkptError
from ckptio.managing.copy import Known
from ckptio.managing.level import TierSteps
from ckptio.storage.store_contract import Store

__all__ = ["TierRoute", "resume"]

log = logging.getLogger("ckptio")


class TierRoute:
    """The Route of the drain over ``levels`` (fastest first)."""

    def __init__(self, levels: Sequence[TierSteps]) -> None:
        self._levels = list(levels)

    def _holder(self, step: int, tier: int) -> TierSteps | None:
        return next((lv for lv in self._levels[:tier] if lv.is_committed(step)), None)

    def source(self, step: int, tier: int) -> Store | None:
        holder = self._holder(step, tier)
        return None if holder is None else holder.store(step)

    def target(self, step: int, tier: int) -> Store:
        return self._levels[tier].store(step)

    def holds(self, step: int, tier: int) -> bool:
        return self._levels[tier].is_committed(step)

    def known(self, step: int, tier: int) -> Known | None:
        """The source's manifest of ``step`` as this process committed it, by its bytes."""
        holder = self._holder(step, tier)
        return None if holder is None else (lambda data: holder.committed_here(step, data))

    def done(self, step: int) -> None:
        """The drain copies ``step`` no more: the record its save kept goes (saves commit only
        in the first tier)."""
        self._levels[0].drained(step)

    def bases(self, step: int, tier: int) -> tuple[int, ...]:
        """The bases of ``step`` as the fastest tier before ``tier`` holding it has it."""
        holder = self._holder(step, tier)
        bases = None if holder is None else holder.bases(step)
        return () if bases is None else bases

    def landed(self, step: int, tier: int) -> None:
        """The copy of ``step`` committed in ``tier``: its bases are the source's (the same
        bytes), so that tier's retention reads no manifest of it; then the retention runs."""
        holder = self._holder(step, tier)
        try:
            bases = None if holder is None else holder.bases(step)
        except CkptError:  # the source unreadable now: the copy's own manifest is read
            bases = None
        level = self._levels[tier]
        level.saved(step, bases)
        level.retain(set())


def resume(levels: Sequence[TierSteps], drain: Any, leased: Collection[int] = ()) -> None:
    """Rank 0, at start with several tiers: every tier must be listable now (a wrong endpoint
    or missing credentials fails here, not at the first drain hours later); ``drain`` (None on
    the other ranks: then only the probe) gets each slower tier's newest due step a faster tier
    holds and it does not (a drain cut short, or never run), after each older one in the
    first tier that tier keeps for good (its keep_every: never skipped, as Drain.submit), once
    the incomplete copies a drain cut short left in the slower tiers this manager holds the
    run lease of (``leased``: tier indices) are removed (TierSteps.drop_incomplete)."""
    listings = []
    for level in levels:
        try:
            listings.append(level.listing())
        except CkptError as exc:
            raise type(exc)(
                f"tier {level.location} cannot be reached: {exc}. Fix its location or "
                "credentials; to restore from the other tiers meanwhile, leave it out of "
                "tiers=") from None
    if drain is None:
        return
    for k in range(1, len(levels)):
        if k in leased and listings[k]["incomplete"]:
            levels[k].drop_incomplete()
        faster = {s for x in listings[:k] for s in x["committed"]}
        held = listings[k]["committed"]
        due = sorted(s for s in faster if s % levels[k].every == 0 and (not held or s > held[-1]))
        # the newest step due, after each older one the tier keeps for good that the first
        # tier holds (a drain cut short by a kill left it there only: its retention would
        # drop it once skipped, lost for good)
        # (or a copy that failed: any age, not only those newer than the tier's newest)
        kept = [s for s in listings[0]["committed"] if s % levels[k].every == 0
                and s not in held and s not in due[-1:] and drain.kept_for_good(s, k)]
        for step in kept + due[-1:]:
            log.info("ckptio: the drain resumes: step %d to %s", step, levels[k].location)
            drain.submit_to(step, k)
