"""The built-in delta-base policy: DeltaPolicy (a DeltaBasePolicy, records.py).

    mgr = ckptio.CheckpointManager("ckpts", keep_last=3,
                                   delta=ckptio.DeltaPolicy(full_every=10, max_ratio=0.5),
                                   compression="auto")   # Options.compression of its saves

With a policy, a save is a delta against the newest full (self-contained) committed step, its
base (Checkpointer.save(..., base=)): chunks equal to the base's are referenced, changed ones
stored as their XOR against it (docs/FORMAT.md, version 4). Chains have depth 1: every delta's
base is a full step. When a save is full instead: choose(). base() adds what one manager's
saves remember: the deltas made against each base, and the pause after a delta that took more
room than a full save (each manager holds its own copy of the policy, managing/delta.py).

Owns: the policy's options and checks, the choice of a base, that state. Does not own: what
every base policy must respect (a full, undamaged, older base: records.base_by; a long-kept
step saved full: managing/level.py), reading the steps (managing/chains.py), saving (api.py).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ckptio.errors import CkptError
from ckptio.policies.records import StepInfo

__all__ = ["DeltaPolicy"]

log = logging.getLogger("ckptio")


@dataclass
class _Saves:
    """What one manager's saves with a DeltaPolicy remember."""

    made: dict[int, int] = field(default_factory=dict)  # base -> delta saves started against it
    last: int | None = None  # the newest step saved as a delta, until judged
    full_left: int = 0  # saves that are full since a delta took too much room
    pauses: int = 0  # such deltas in a row


@dataclass(frozen=True)
class DeltaPolicy:
    """When a CheckpointManager saves a full step rather than a delta (choose(), base())."""

    full_every: int = 10
    max_ratio: float = 0.5
    _saves: _Saves = field(default_factory=_Saves, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        value = self.full_every
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise CkptError(f"DeltaPolicy(full_every={value!r}): an integer >= 1 (1: every save "
                            "is full; 10: a full step, then 9 deltas against it)")
        ratio = self.max_ratio
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
            raise CkptError(f"DeltaPolicy(max_ratio={ratio!r}): a fraction in (0, 1]: a new full "
                            "step once the last delta stored more than this share of its base")

    def base(self, step: int, steps: Sequence[StepInfo]) -> int | None:
        """The base of a delta save of ``step`` (choose()), or None: a full save, also the next
        ``full_every`` saves after a delta that stored more than ``max_ratio`` of its base
        (twice as many after each such delta in a row; before, a full-training run alternated
        full steps and deltas, each delta keeping its base beside the next full)."""
        if self._paused(steps):
            return None
        base = self.choose(step, steps, self._saves.made)
        if base is not None:
            self._saves.made[base] = self._saves.made.get(base, 0) + 1
            self._saves.last = step
        return base

    def choose(self, step: int, steps: Sequence[StepInfo],
               made: Mapping[int, int] | None = None) -> int | None:
        """The step ``step`` is saved as a delta against, or None for a full save. ``steps``:
        the committed steps, oldest first; ``made``: base -> the deltas saved against it. The
        save is full when any of these holds:

        - there is no full step yet (the first save), or the newest one is damaged;
        - ``full_every`` saves have been made since the newest full step, it included (default
          10: a full step, then 9 deltas). ``full_every=1`` makes every save full;
        - the newest delta against that base stored more than ``max_ratio`` of the base's
          stored bytes (default 0.5: deltas have stopped paying, the state has drifted; with
          keep_last >= 2 a delta whose base has left them costs the base plus keep_last
          deltas, no more than keep_last full steps up to (keep_last - 1) / keep_last >= 0.5).

        The manager also saves full every step a retention keeps for long (KeepEvery(steps=N)
        of any tier): it then stands alone, and an old delta never pins its base for as long.
        A restarted job counts the deltas still committed (retention may have dropped older
        ones, so its first chain may run longer, bounded by ``max_ratio`` all the same)."""
        older = [s for s in steps if s.step < step]
        base = next((s for s in reversed(older) if not s.bases and s.nbytes is not None), None)
        if base is None or base.damaged:
            return None
        since = [s for s in older if s.step > base.step]
        if max(len(since), (made or {}).get(base.step, 0)) + 1 >= self.full_every:
            return None
        last = next((s for s in reversed(since) if base.step in s.bases), None)
        if last is not None and last.nbytes is not None and base.nbytes is not None and (
                last.nbytes > self.max_ratio * base.nbytes):
            return None
        return base.step

    def _paused(self, steps: Sequence[StepInfo]) -> bool:
        """Whether this save is full because the last delta took more room than a full save."""
        saves = self._saves
        if saves.last is not None:
            ratio = _ratio(steps, saves.last)
            if ratio is not None and ratio > self.max_ratio:
                saves.full_left = self.full_every * 2 ** min(saves.pauses, 10)
                saves.pauses += 1
                log.info("ckptio: the last delta (step %d) stored %.0f %% of its base (more than "
                         "max_ratio's %.0f %%: more room than full saves): the next %d saves "
                         "are full", saves.last, 100 * ratio, 100 * self.max_ratio,
                         saves.full_left)
            elif ratio is not None:
                saves.pauses = 0
            saves.last = None
        if saves.full_left:
            saves.full_left -= 1
            return True
        return False


def _ratio(steps: Sequence[StepInfo], step: int) -> float | None:
    """Committed ``step``'s stored bytes over its base's; None if it is not a delta (one whose
    entries all changed stores none against its base: a full step) or cannot be read."""
    by_step = {s.step: s for s in steps}
    info = by_step.get(step)
    if info is None or not info.bases or info.nbytes is None:
        return None
    base = by_step.get(info.bases[0])
    if base is None or not base.nbytes:
        return None
    return info.nbytes / base.nbytes
