"""A CheckpointManager's ``delta=`` argument (check_delta), its compression (with_compression),
and choose_base(): the built-in DeltaPolicy's rules (ckptio/policies/delta_base.py) asked over a
root's Chains, as retention's own tests and tools see them.

Owns: those checks; each manager's own copy of a DeltaPolicy (its state counts that manager's
saves). Does not own: the policy (policies/delta_base.py), reading the links (chains.py), asking the
policy before a save (level.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from ckptio.errors import CkptError
from ckptio.managing.chains import Chains
from ckptio.options import Options
from ckptio.policies import DeltaBasePolicy, DeltaPolicy, StepInfo, check_base

__all__ = ["ChainFacts", "DeltaPolicy", "check_delta", "choose_base", "with_compression"]


def check_delta(delta: Any) -> DeltaBasePolicy | None:
    """``CheckpointManager(delta=...)``: None, True (the defaults), a DeltaPolicy (this
    manager's own copy: its state counts this manager's saves) or a policy with ``base``."""
    if delta is None or delta is False:
        return None
    if delta is True:
        return DeltaPolicy()
    if isinstance(delta, DeltaPolicy):
        return dataclasses.replace(delta)
    if isinstance(delta, (bool, int, float, str)) or not callable(getattr(delta, "base", None)):
        raise CkptError(f"CheckpointManager(delta={delta!r}): give ckptio.DeltaPolicy("
                        "full_every=10, max_ratio=0.5), True for those defaults, None, or a "
                        "delta-base policy of your own (a class with base(step, steps))")
    return check_base(delta, "CheckpointManager(delta")


def with_compression(options: Options, compression: Any, checkpointer_given: bool,
                     options_given: bool = False) -> Options:
    """The manager's options with ``CheckpointManager(compression=...)`` in them (None: as
    they are). "auto", "off" or a codec's name, checked by Options (Options.compression).
    ``options_given``: ``options`` are the caller's own, whose compression other than the
    default must not be contradicted (one of the two would be ignored)."""
    if compression is None:
        return options
    if not isinstance(compression, str) or not compression:
        raise CkptError(f"CheckpointManager(compression={compression!r}): 'auto', 'off' or a "
                        "codec's name such as 'bytegroup+zstd'")
    if checkpointer_given:
        raise CkptError("CheckpointManager(checkpointer=..., compression=...): the "
                        "Checkpointer's options decide; make it with Options(compression=...)")
    if options_given and options.compression not in ("off", compression):
        raise CkptError(f"CheckpointManager(compression={compression!r}, options=Options("
                        f"compression={options.compression!r})): two different compressions; "
                        "give one of them")
    return dataclasses.replace(options, compression=compression)


def choose_base(policy: DeltaPolicy, step: int, committed: list[int], chains: Chains,
                damaged: Iterable[int], long_every: Iterable[int],
                made: Mapping[int, int] | None = None) -> int | None:
    """Rank 0: the step ``step`` is saved as a delta against, or None for a full save, by
    ``policy.choose()`` over ``committed`` (ascending) read through ``chains``; ``damaged``:
    steps a load found damaged; ``long_every``: the keep_every intervals a full step is due at
    (those steps are full); ``made``: base -> the deltas this process saved against it."""
    if any(step % every == 0 for every in long_every):
        return None
    facts = ChainFacts(chains, set(damaged))
    return policy.choose(step, [StepInfo.read_from(s, 0, facts) for s in committed], made)


class ChainFacts:
    """A StepInfo's bases, bytes and damage read through ``chains`` (policies.StepFacts);
    unknown (no bytes: not a base) when a manifest cannot be read, and then in ``unreadable``.
    ``meta(step)``: its metadata, or None when it cannot be read."""

    def __init__(self, chains: Chains, damaged: set[int],
                 meta: Any = None) -> None:
        self._chains, self._damaged, self._meta = chains, damaged, meta
        self.unreadable: set[int] = set()

    def metadata(self, step: int) -> dict[str, Any] | None:
        return None if self._meta is None else self._meta(step)

    def bases(self, step: int) -> tuple[int, ...]:
        try:
            return self._chains.bases(step) or ()
        except CkptError:
            self.unreadable.add(step)
            return ()

    def nbytes(self, step: int) -> int | None:
        try:
            link = self._chains.link(step)
        except CkptError:
            self.unreadable.add(step)
            return None
        return None if link is None else link.stored

    def damaged(self, step: int) -> bool:
        return step in self._damaged
