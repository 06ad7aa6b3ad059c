"""The built-in policies (ckptio/policies/__init__.py says what a policy is).

Retention: KeepAll, KeepLatest(n), KeepEvery(steps=N | seconds=S), KeepRecent(seconds),
KeepBest(n, metric, mode). Saving: SaveEvery(steps=N | seconds=S), SaveOnPreemption. AnyOf
unions either kind. The keyword arguments of the manager and Tier build these
(managing/declare.py, managing/retention.py).

Owns: the built-ins, walking an AnyOf tree (leaves), the checks that an object is a policy of
a kind (check_keep, check_save, check_base). Does not own: the records and protocols
(records.py), the delta-base built-in (delta_base.py), running them (managing/).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from ckptio.errors import CkptError
from ckptio.policies.records import DeltaBasePolicy, RetentionPolicy, SaveMoment, SavePolicy, StepInfo, due_by, kept_by

__all__ = ["AnyOf", "KeepAll", "KeepBest", "KeepEvery", "KeepLatest", "KeepRecent",
           "SaveEvery", "SaveOnPreemption", "check_base", "check_keep", "check_save", "leaves"]


# ------------------------------------------------------------------------ built-ins: retention


def _count(owner: str, name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise CkptError(f"{owner}({name}={value!r}): an integer >= 1")


def _seconds(owner: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            0 < value < float("inf")):
        raise CkptError(f"{owner}(seconds={value!r}): a number of seconds > 0")
    return float(value)


def _steps_or_seconds(owner: str, steps: Any, seconds: Any) -> None:
    if (steps is None) == (seconds is None):
        raise CkptError(f"{owner}(steps=N) or {owner}(seconds=S): give one of them")
    if steps is not None:
        _count(owner, "steps", steps)
    else:
        _seconds(owner, seconds)


@dataclass(frozen=True)
class KeepAll:
    """Keep every step (``keep_last=None``)."""

    def kept(self, steps: Sequence[StepInfo], now: float) -> set[int]:
        return {s.step for s in steps}


@dataclass(frozen=True)
class KeepLatest:
    """The newest ``n`` steps (``keep_last=n``)."""

    n: int

    def __post_init__(self) -> None:
        _count("KeepLatest", "n", self.n)

    def kept(self, steps: Sequence[StepInfo], now: float) -> set[int]:
        return {s.step for s in steps[-self.n:]}


@dataclass(frozen=True)
class KeepEvery:
    """``steps=N``: every step divisible by N (``keep_every=N``). ``seconds=S``: one step per
    S seconds of commit time: the oldest, then each committed at least S after the one kept
    before it (a step whose commit time is unknown is kept by the other rules only)."""

    steps: int | None = None
    seconds: float | None = None

    def __post_init__(self) -> None:
        _steps_or_seconds("KeepEvery", self.steps, self.seconds)

    def kept(self, steps: Sequence[StepInfo], now: float) -> set[int]:
        if self.steps is not None:
            return {s.step for s in steps if s.step % self.steps == 0}
        assert self.seconds is not None  # __post_init__: one of them
        out, last = set(), -math.inf
        for info in steps:
            at = info.committed_at
            if at is not None and at - last >= self.seconds:
                out.add(info.step)
                last = at
        return out


@dataclass(frozen=True)
class KeepRecent:
    """Every step committed within the last ``seconds`` before now."""

    seconds: float

    def __post_init__(self) -> None:
        _seconds("KeepRecent", self.seconds)

    def kept(self, steps: Sequence[StepInfo], now: float) -> set[int]:
        return {s.step for s in steps
                if s.committed_at is not None and now - s.committed_at <= self.seconds}


@dataclass(frozen=True)
class KeepBest:
    """The ``n`` steps with the best value of ``metric`` (``mode`` "min": lowest; "max":
    highest) among those saved with it (``keep_best=n, monitor=metric``). NaN ranks worst;
    on a tie the newer step ranks first. ``keep_without_metric``: also every step saved
    without it."""

    n: int
    metric: str
    mode: str = "min"
    keep_without_metric: bool = False

    def __post_init__(self) -> None:
        _count("KeepBest", "n", self.n)
        if not isinstance(self.metric, str) or not self.metric:
            raise CkptError(f"KeepBest(metric={self.metric!r}): the name of a metric")
        if self.mode not in ("min", "max"):
            raise CkptError(f"KeepBest(mode={self.mode!r}): 'min' (lower is better, a loss) "
                            "or 'max' (higher is better, an accuracy)")

    def kept(self, steps: Sequence[StepInfo], now: float) -> set[int]:
        scored = [s for s in steps if s.metrics.get(self.metric) is not None]
        best = sorted(scored, key=self._rank)[:self.n]
        out = {s.step for s in best}
        if self.keep_without_metric:
            out.update(s.step for s in steps if s.metrics.get(self.metric) is None)
        return out

    def _rank(self, info: StepInfo) -> tuple[bool, float, int]:
        """Sort key, best first: NaN last, then by value in ``mode``'s order, newer first."""
        value = float(info.metrics[self.metric])
        if math.isnan(value):
            return True, 0.0, -info.step
        return False, value if self.mode == "min" else -value, -info.step


# ------------------------------------------------------------------------ built-ins: saving


@dataclass(frozen=True)
class SaveEvery:
    """``steps=N``: every step divisible by N (``save_every=N``). ``seconds=S``: once S
    seconds have passed since the last save started (``save_interval_s=S``)."""

    steps: int | None = None
    seconds: float | None = None

    def __post_init__(self) -> None:
        _steps_or_seconds("SaveEvery", self.steps, self.seconds)

    def due(self, moment: SaveMoment) -> bool:
        if self.steps is not None:
            return moment.step % self.steps == 0
        assert self.seconds is not None  # __post_init__: one of them
        return moment.now - moment.last_time >= self.seconds


@dataclass(frozen=True)
class SaveOnPreemption:
    """Due once a preemption signal (SIGTERM) reached any rank (``preemption=True``); the
    manager installs the handler when its save policy holds this."""

    def due(self, moment: SaveMoment) -> bool:
        return moment.preempted


class AnyOf:
    """The union of retention policies (a step kept by any), or of save policies (due when
    any is)."""

    def __init__(self, *policies: Any) -> None:
        if not policies:
            raise CkptError("AnyOf(): give at least one policy")
        self.policies = tuple(policies)

    def kept(self, steps: Sequence[StepInfo], now: float) -> set[int]:
        out: set[int] = set()
        for policy in self.policies:
            out |= kept_by(policy, steps, now)
        return out

    def due(self, moment: SaveMoment) -> bool:
        return any(due_by(policy, moment) for policy in self.policies)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, AnyOf) and other.policies == self.policies

    def __hash__(self) -> int:
        return hash(self.policies)

    def __repr__(self) -> str:
        return f"AnyOf({', '.join(map(repr, self.policies))})"


# ------------------------------------------------------------------------ checks


def leaves(policy: Any) -> Iterator[Any]:
    """The policies an AnyOf tree is made of (the policy itself when it is no AnyOf)."""
    if isinstance(policy, AnyOf):
        for member in policy.policies:
            yield from leaves(member)
    else:
        yield policy


def _check(policy: Any, verb: str, kind: str, where: str) -> Any:
    example = {"kept": "KeepLatest(3)", "due": "SaveEvery(steps=100)",
               "base": "DeltaPolicy()"}[verb]
    for leaf in leaves(policy):
        if not callable(getattr(leaf, verb, None)):
            raise CkptError(f"{where}={leaf!r}): not a {kind} policy, which has a method "
                            f"{verb}(...); e.g. ckptio.{example}, or a class of your own with "
                            f"{verb}()")
    return policy


def check_keep(policy: Any, where: str) -> RetentionPolicy:
    """``policy`` if it (every member of an AnyOf) has ``kept``, else CkptError naming
    ``where`` (e.g. ``Tier('ckpts', keep``)."""
    return _check(policy, "kept", "retention", where)


def check_save(policy: Any, where: str) -> SavePolicy:
    """``policy`` if it (every member of an AnyOf) has ``due``, else CkptError."""
    return _check(policy, "due", "save", where)


def check_base(policy: Any, where: str) -> DeltaBasePolicy:
    """``policy`` if it has ``base`` (an AnyOf of them is not one), else CkptError."""
    if isinstance(policy, AnyOf):
        raise CkptError(f"{where}={policy!r}): one delta-base policy, not an AnyOf")
    return _check(policy, "base", "delta-base", where)
