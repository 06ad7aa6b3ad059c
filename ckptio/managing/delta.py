"""A CheckpointManager's delta policy: DeltaPolicy, and which base a save takes (choose_base).

    mgr = ckptio.CheckpointManager("ckpts", keep_last=3,
                                   delta=ckptio.DeltaPolicy(full_every=10, max_ratio=0.5),
                                   compression="auto")   # Options.compression of its saves

With a policy, a save is a delta against the newest full (self-contained) committed step, its
base (Checkpointer.save(..., base=)): chunks equal to the base's are referenced, changed ones
stored as their XOR against it (docs/FORMAT.md, version 4). Chains have depth 1: every delta's
base is a full step. When a save is full instead: choose_base(). Call order: the manager asks
choose_base() on rank 0 before each save into its first tier (managing/level.py).

Owns: the policy's options and their checks, the choice of a base. Does not own: reading the
links (chains.py), saving (api.py), retention (retention.py, chains.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ckptio.errors import CkptError
from ckptio.managing.chains import Chains
from ckptio.options import Options

__all__ = ["DeltaPolicy", "check_delta", "choose_base", "delta_ratio", "with_compression"]


@dataclass(frozen=True)
class DeltaPolicy:
    """When a CheckpointManager saves a full step rather than a delta (choose_base)."""

    full_every: int = 10
    max_ratio: float = 0.5

    def __post_init__(self) -> None:
        value = self.full_every
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise CkptError(f"DeltaPolicy(full_every={value!r}): an integer >= 1 (1: every save "
                            "is full; 10: a full step, then 9 deltas against it)")
        ratio = self.max_ratio
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
            raise CkptError(f"DeltaPolicy(max_ratio={ratio!r}): a fraction in (0, 1]: a new full "
                            "step once the last delta stored more than this share of its base")


def check_delta(delta: Any) -> DeltaPolicy | None:
    """``CheckpointManager(delta=...)``: None, True (the defaults) or a DeltaPolicy."""
    if delta is None or delta is False:
        return None
    if delta is True:
        return DeltaPolicy()
    if not isinstance(delta, DeltaPolicy):
        raise CkptError(f"CheckpointManager(delta={delta!r}): give ckptio.DeltaPolicy("
                        "full_every=10, max_ratio=0.5), True for those defaults, or None")
    return delta


def with_compression(options: Options, compression: Any, checkpointer_given: bool) -> Options:
    """The manager's options with ``CheckpointManager(compression=...)`` in them (None: as
    they are). "auto", "off" or a codec's name, checked by Options (Options.compression)."""
    if compression is None:
        return options
    if not isinstance(compression, str) or not compression:
        raise CkptError(f"CheckpointManager(compression={compression!r}): 'auto', 'off' or a "
                        "codec's name such as 'bytegroup+zstd'")
    if checkpointer_given:
        raise CkptError("CheckpointManager(checkpointer=..., compression=...): the "
                        "Checkpointer's options decide; make it with Options(compression=...)")
    return dataclasses.replace(options, compression=compression)


def choose_base(policy: DeltaPolicy, step: int, committed: list[int], chains: Chains,
                damaged: Iterable[int], long_every: Iterable[int],
                made: Mapping[int, int] | None = None) -> int | None:
    """Rank 0: the step ``step`` is saved as a delta against, or None for a full save.
    ``committed``: ascending; ``damaged``: steps a load found damaged; ``long_every``: the
    keep_every intervals a full step is due at; ``made``: base -> the deltas this process
    saved against it. The save is full when any of these holds:

    - there is no committed full step yet (the first save), or the newest one restore() or a
      load found damaged;
    - ``full_every`` saves have been made since the newest full step, it included (default
      10: a full step, then 9 deltas). ``full_every=1`` makes every save full;
    - the newest delta against that base stored more than ``max_ratio`` of the base's stored
      bytes (default 0.5: deltas have stopped paying, the state has drifted from its base;
      keeping keep_last >= 2 steps, a delta whose base has left them costs the base plus
      keep_last deltas, no more than keep_last full steps up to (keep_last - 1) / keep_last
      >= 0.5 of its base; the manager then also makes the next saves full: level.py);
    - the step is one a retention keeps for long: divisible by ``keep_every`` of any tier.
      Such a step then stands alone, and an old delta never pins its base for as long; this
      is why the manager needs no compaction.

    The deltas made against a base are counted by the manager as it saves them; a restarted
    job counts those still committed (retention may have dropped older ones, so its first
    chain may run longer, bounded by ``max_ratio`` all the same). Sizes are read from the
    committed steps' manifests (chains.py)."""
    if any(step % every == 0 for every in long_every):
        return None
    bad = set(damaged)
    older = [s for s in committed if s < step]
    base = next((s for s in reversed(older) if _is_full(chains, s)), None)
    if base is None or base in bad:
        return None
    since = [s for s in older if s > base]
    if max(len(since), (made or {}).get(base, 0)) + 1 >= policy.full_every:
        return None
    last = next((s for s in reversed(since) if _delta_of(chains, s, base)), None)
    base_link = chains.link(base)
    if last is not None and base_link is not None:
        last_link = chains.link(last)
        if last_link is not None and last_link.stored > policy.max_ratio * base_link.stored:
            return None
    return base


def delta_ratio(chains: Chains, step: int) -> float | None:
    """Committed ``step``'s stored bytes over its base's; None if it is not a delta (one whose
    entries all changed stores none against its base: a full step) or cannot be read."""
    try:
        link = chains.link(step)
        base = chains.link(link.bases[0]) if link is not None and link.is_delta else None
    except CkptError:
        return None
    if link is None or base is None or not base.stored:
        return None
    return link.stored / base.stored


def _is_full(chains: Chains, step: int) -> bool:
    try:
        link = chains.link(step)
    except CkptError:
        return False  # unreadable now: not a base to build on
    return link is not None and not link.is_delta


def _delta_of(chains: Chains, step: int, base: int) -> bool:
    try:
        link = chains.link(step)
    except CkptError:
        return False
    return link is not None and base in link.bases
