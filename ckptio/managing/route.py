"""The drain's route through a manager's tiers: TierRoute (tiering/drain.py's Route protocol).

The drain thread (on the coordinating rank) asks it where a step is read from (the fastest tier
before the target holding it committed), where it is written, which bases a delta needs first,
and tells it when a copy committed in a slower tier (that tier's retention then runs, here, on
the drain's thread).

Owns: those answers over the list of TierSteps. Does not own: the copy or the queue (drain.py),
the tiers' steps (level.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from ckptio.managing.level import TierSteps
from ckptio.storage.base import Store

__all__ = ["TierRoute"]


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

    def bases(self, step: int, tier: int) -> tuple[int, ...]:
        """The bases of ``step`` as the fastest tier before ``tier`` holding it has it."""
        holder = self._holder(step, tier)
        link = None if holder is None else holder.link(step)
        return () if link is None else link.bases

    def landed(self, step: int, tier: int) -> None:
        level = self._levels[tier]
        level.saved(step)
        level.retain(set())
