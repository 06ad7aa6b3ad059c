"""The records a policy is asked with and the protocols a policy implements.

StepInfo: one committed step of one tier (its facts read lazily, through a StepFacts, when the
manager builds it). SaveMoment: what a save policy is asked. The protocols, one verb each:
RetentionPolicy.kept, SavePolicy.due, DeltaBasePolicy.base. kept_by / due_by / base_by call
a policy and check what it returned, naming the policy when it is not what the verb promises.

Owns: those records, protocols and checks. Does not own: the built-ins (builtins.py,
delta_base.py), running them (managing/).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from ckptio.errors import CkptError

__all__ = ["DeltaBasePolicy", "RetentionPolicy", "SaveMoment", "SavePolicy", "StepFacts",
           "StepInfo", "base_by", "due_by", "kept_by"]


class StepFacts(Protocol):
    """Where a StepInfo the manager builds reads what it is asked, once (managing/level.py)."""

    def metadata(self, step: int) -> Mapping[str, Any] | None: ...

    def bases(self, step: int) -> tuple[int, ...]: ...

    def nbytes(self, step: int) -> int | None: ...

    def damaged(self, step: int) -> bool: ...


class StepInfo:
    """One committed step of one tier, as a retention policy sees it: ``step``, ``tier`` (0:
    the first), ``committed_at`` (the Unix time of its save, its manifest's created_unix; None
    if unknown), ``nbytes`` (bytes its own files hold), ``metrics`` (what save(...,
    metrics=) stored), ``bases`` (the steps a delta step needs; () for a full one) and
    ``damaged`` (a load found it damaged). Build your own to test a policy; the manager's
    reads a step's manifest only when a policy asks for committed_at, nbytes, metrics or
    bases (``facts``: where it reads them, policies.StepFacts)."""

    __slots__ = ("step", "tier", "_given", "_facts")

    def __init__(self, step: int, *, tier: int = 0, committed_at: float | None = None,
                 nbytes: int | None = None, metrics: Mapping[str, float] | None = None,
                 bases: Sequence[int] = (), damaged: bool = False,
                 facts: StepFacts | None = None) -> None:
        self.step, self.tier = step, tier
        self._given: dict[str, Any] = {} if facts is not None else {
            "committed_at": committed_at, "nbytes": nbytes, "metrics": dict(metrics or {}),
            "bases": tuple(bases), "damaged": damaged}
        self._facts = facts  # given: each fact read from it when first asked

    @classmethod
    def read_from(cls, step: int, tier: int, facts: StepFacts) -> StepInfo:
        """The manager's StepInfo: each fact read from ``facts`` when first asked."""
        return cls(step, tier=tier, facts=facts)

    def _fact(self, name: str) -> Any:
        if name not in self._given:
            assert self._facts is not None  # internal: only read_from() leaves facts unread
            if name in ("committed_at", "metrics"):
                meta = self._facts.metadata(self.step) or {}
                self._given["committed_at"] = meta.get("created_unix")
                self._given["metrics"] = dict(meta.get("metrics") or {})
            else:
                self._given[name] = getattr(self._facts, name)(self.step)
        return self._given[name]

    @property
    def committed_at(self) -> float | None:
        return self._fact("committed_at")

    @property
    def nbytes(self) -> int | None:
        return self._fact("nbytes")

    @property
    def metrics(self) -> dict[str, float]:
        return self._fact("metrics")

    @property
    def bases(self) -> tuple[int, ...]:
        return self._fact("bases")

    @property
    def damaged(self) -> bool:
        return self._fact("damaged")

    @property
    def is_full(self) -> bool:
        """Self-contained, readable and undamaged: a step a delta may be saved against."""
        return not self.bases and self.nbytes is not None and not self.damaged

    def __repr__(self) -> str:
        return f"StepInfo(step={self.step}, tier={self.tier})"


@dataclass(frozen=True)
class SaveMoment:
    """What a save policy is asked: ``step``, ``now`` (Unix time; with many ranks rank 0's),
    the last save this manager started (``last_step``, None before the first, and
    ``last_time``, or when the manager was made) and ``preempted`` (a signal reached)."""

    step: int
    now: float
    last_step: int | None
    last_time: float
    preempted: bool = False


@runtime_checkable
class RetentionPolicy(Protocol):
    """Which committed steps of a tier to keep: ``kept(steps, now)`` -> a set of step numbers
    among ``steps`` (StepInfo, oldest first; ``now``: Unix time)."""

    def kept(self, steps: Sequence[StepInfo], now: float) -> Set[int]: ...


@runtime_checkable
class SavePolicy(Protocol):
    """When a save is due: ``due(moment)`` -> bool. With many ranks every rank asks it with
    rank 0's moment: answer from the moment alone, so every rank answers alike."""

    def due(self, moment: SaveMoment) -> bool: ...


@runtime_checkable
class DeltaBasePolicy(Protocol):
    """What a save is a delta against: ``base(step, steps)`` -> the step number of a full
    step among ``steps`` (StepInfo of the first tier's committed steps, oldest first) older
    than ``step``, or None for a full save. ckptio.DeltaPolicy is the built-in."""

    def base(self, step: int, steps: Sequence[StepInfo]) -> int | None: ...



def kept_by(policy: Any, steps: Sequence[StepInfo], now: float) -> set[int]:
    """``policy.kept(steps, now)``, checked: a set of step numbers among ``steps``, else a
    CkptError naming the policy and what it returned."""
    got = policy.kept(steps, now)
    known = {s.step for s in steps}
    if not isinstance(got, Set) or not all(
            isinstance(s, int) and not isinstance(s, bool) for s in got):
        raise CkptError(f"retention policy {policy!r}: kept() returned {_short(got)}; it must "
                        "return a set of step numbers (ints) among the StepInfo it was given")
    unknown = sorted(set(got) - known)
    if unknown:
        raise CkptError(f"retention policy {policy!r}: kept() returned steps {unknown[:8]}, "
                        f"which are not among the committed steps it was given "
                        f"({sorted(known)[:8]}{'...' if len(known) > 8 else ''}); return "
                        "only steps of the StepInfo passed to it")
    return set(got)


def due_by(policy: Any, moment: SaveMoment) -> bool:
    """``policy.due(moment)``, checked: a bool, else a CkptError naming the policy."""
    got = policy.due(moment)
    if not isinstance(got, bool):
        raise CkptError(f"save policy {policy!r}: due() returned {_short(got)}; it must return "
                        "True or False")
    return got


def base_by(policy: Any, step: int, steps: Sequence[StepInfo]) -> int | None:
    """``policy.base(step, steps)``, checked: None or a full, undamaged step older than
    ``step`` among ``steps`` (chains have depth 1), else a CkptError naming the policy."""
    got = policy.base(step, steps)
    if got is None:
        return None
    found = {s.step: s for s in steps}.get(got) if isinstance(got, int) and not isinstance(
        got, bool) else None
    if found is None or got >= step or not found.is_full:
        raise CkptError(f"delta-base policy {policy!r}: base({step}, ...) returned "
                        f"{_short(got)}; it must return None (a full save) or a full, "
                        f"undamaged committed step older than {step} among the StepInfo "
                        "given (one whose bases are (): a delta's base is self-contained)")
    return got


def _short(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:80]}{'...' if len(text) > 80 else ''}"

