"""Room for the next save in a manager's first tier when that tier is host memory on this
host: FirstTierRoom, what gives way to the save before it is refused.

Call order: ManagerParts (managing/parts.py) makes one at construction (FirstTierRoom.of: None
when the first tier is not a memory tier on this host); before each save, rank 0 calls make()
inside the agreement every rank waits for. The committed steps' sizes are listed here (without
max_bytes only the newest one counts); the save's own size is asked for only before a first
step. A save that does not fit first lets go of the step a restore loaded (kept beyond
keep_last until a newer one is verified) and of the steps kept only for the drain to try their
failed copies again; it is refused only if it still does not fit.

Owns: that order of giving way, the sizes listed for the check. Does not own: the budget check
and its message (managing/tier.py check_budget), the retention pass (managing/level.py), the
drain (managing/drain.py), the agreement across ranks (managing/agreement.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ckptio.errors import CkptError
from ckptio.managing.level import TierSteps
from ckptio.managing.tier import Tier, check_budget, is_memory, newest_size, step_sizes
from ckptio.storage.select import checkpoint_path, scheme_of

__all__ = ["FirstTierRoom"]

log = logging.getLogger("ckptio")


class FirstTierRoom:
    """The first (memory) tier's room for the next save (module docstring)."""

    def __init__(self, first: TierSteps, tier: Tier, directory: str) -> None:
        self._first = first
        self._tier = tier
        self._directory = directory  # the tier's local directory (its tmpfs is asked too)

    @classmethod
    def of(cls, first: TierSteps, tier: Tier) -> FirstTierRoom | None:
        """The room to check before each save into ``first``, or None: the tier is not host
        memory on this host (nothing to check)."""
        local = checkpoint_path(first.directory)
        return cls(first, tier, local) if is_memory(tier) and scheme_of(local) is None else None

    def make(self, estimate: Callable[[], int],
             others: Callable[[int], tuple[int, int]] | None,
             give_up: Callable[[], list[int]] | None, kept: Callable[[], set[int]]) -> None:
        """Rank 0: refuse a save the tier cannot hold (CkptError, managing/tier.py
        check_budget), once what may give way to it is gone (module docstring).
        ``estimate``: the save's bytes on every rank; ``others``: the protection's share
        (redundancy); ``give_up``: the drain's steps it stops retrying (None: no drain);
        ``kept``: what the first tier's retention must keep for the save in flight and the
        followers."""
        first, tier = self._first, self._tier
        committed = first.scan()["committed"]
        if tier.max_bytes is None:  # only the newest step's size counts (check_budget)
            sizes = newest_size(first.path(s) for s in reversed(committed))
        else:
            sizes = step_sizes(first.path(s) for s in committed)
        try:
            check_budget(tier, self._directory, sizes, estimate, others)
        except CkptError:
            # the step a restore loaded, kept beyond keep_last until a newer one is verified,
            # gives way to the save (the budget sized for keep_last + 1 steps holds after a
            # restart too); the save is refused only if it still does not fit
            # so do the steps kept only for the drain to try their failed copies again
            pinned = first.unpin_verified(committed) if tier.max_bytes is not None else None
            given_up = [] if give_up is None else give_up()
            if pinned is None and not given_up:
                raise
            first.retain(kept())
            if pinned is not None:
                log.warning("ckptio: memory tier %s: step %d (restored last, kept beyond "
                            "keep_last=%s) removed to keep the save within max_bytes",
                            tier.location, pinned, tier.keep_last)
            now = first.scan()["committed"]
            check_budget(tier, self._directory, step_sizes(first.path(s) for s in now),
                         estimate, others)
