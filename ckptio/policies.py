"""A CheckpointManager's policies as objects: when to save, which steps to keep.

    class KeepFirstOfEachEpoch:                       # a user's own, in the user's own file
        def kept(self, steps, now):
            return {s.step for s in steps if s.step % 1000 == 0}

    ckptio.Tier("ckpts", keep=ckptio.AnyOf(ckptio.KeepLatest(2), KeepFirstOfEachEpoch()))

Two one-verb protocols: a retention policy's ``kept(steps, now)`` (the StepInfo of every
committed step of one tier, oldest first, and the time) returns the set of step numbers to
keep; a save policy's ``due(moment)`` (a SaveMoment) says whether a save is due. The built-ins
cover the keyword spellings (keep_last, keep_every, keep_best, save_every, save_interval_s,
preemption, which build them) plus time-based retention; AnyOf unions them.

What no policy can change: the manager keeps the newest committed step, the step restored or
verified last, the bases of every kept delta (managing/chains.py) and what its followers pin.

Owns: StepInfo, SaveMoment, the protocols, the built-ins, the checks of what a policy returns.
Does not own: running them (managing/level.py, managing/triggers.py), the keyword sugar
(managing/declare.py, managing/retention.py).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence, Set
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from ckptio.errors import CkptError

__all__ = ["AnyOf", "KeepAll", "KeepBest", "KeepEvery", "KeepLatest", "KeepRecent",
           "RetentionPolicy", "SaveEvery", "SaveMoment", "SaveOnPreemption", "SavePolicy",
           "StepFacts", "StepInfo", "check_keep", "check_save", "due_by", "kept_by", "leaves"]


class StepFacts(Protocol):
    """Where a StepInfo the manager builds reads what it is asked, once (managing/level.py)."""

    def metadata(self, step: int) -> Mapping[str, Any] | None: ...

    def bases(self, step: int) -> tuple[int, ...]: ...

    def nbytes(self, step: int) -> int | None: ...


class StepInfo:
    """One committed step of one tier, as a retention policy sees it: ``step``, ``tier`` (0:
    the first), ``committed_at`` (Unix time the save started, None if unknown), ``nbytes``
    (bytes its own files hold), ``metrics`` (what save(..., metrics=) stored) and ``bases``
    (the steps a delta step needs; () for a full one). Build your own to test a policy; the
    manager's reads a step's manifest only when a policy asks for one of the last four."""

    __slots__ = ("step", "tier", "_given", "_facts")

    def __init__(self, step: int, *, tier: int = 0, committed_at: float | None = None,
                 nbytes: int | None = None, metrics: Mapping[str, float] | None = None,
                 bases: Sequence[int] = ()) -> None:
        self.step, self.tier = step, tier
        self._given: dict[str, Any] = {"committed_at": committed_at, "nbytes": nbytes,
                                       "metrics": dict(metrics or {}), "bases": tuple(bases)}
        self._facts: StepFacts | None = None

    @classmethod
    def read_from(cls, step: int, tier: int, facts: StepFacts) -> StepInfo:
        """The manager's StepInfo: each fact read from ``facts`` when first asked."""
        info = cls(step, tier=tier)
        info._given, info._facts = {}, facts
        return info

    def _fact(self, name: str) -> Any:
        if name not in self._given:
            assert self._facts is not None  # internal: only read_from() leaves facts unread
            if name in ("committed_at", "metrics"):
                meta = self._facts.metadata(self.step) or {}
                self._given["committed_at"] = meta.get("created_unix")
                self._given["metrics"] = dict(meta.get("metrics") or {})
            elif name == "bases":
                self._given["bases"] = self._facts.bases(self.step)
            else:
                self._given["nbytes"] = self._facts.nbytes(self.step)
        return self._given[name]

    @property
    def committed_at(self) -> float | None:
        return self._fact("committed_at")  # type: ignore[no-any-return]

    @property
    def nbytes(self) -> int | None:
        return self._fact("nbytes")  # type: ignore[no-any-return]

    @property
    def metrics(self) -> dict[str, float]:
        return self._fact("metrics")  # type: ignore[no-any-return]

    @property
    def bases(self) -> tuple[int, ...]:
        return self._fact("bases")  # type: ignore[no-any-return]

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
    example = "KeepLatest(3)" if verb == "kept" else "SaveEvery(steps=100)"
    for leaf in leaves(policy):
        if not callable(getattr(leaf, verb, None)):
            raise CkptError(f"{where}={leaf!r}): not a {kind} policy, which has a method "
                            f"{verb}(...); e.g. ckptio.{example}, or a class of your own with "
                            f"{verb}()")
    return policy


def check_keep(policy: Any, where: str) -> RetentionPolicy:
    """``policy`` if it (every member of an AnyOf) has ``kept``, else CkptError naming
    ``where`` (e.g. ``Tier('ckpts', keep``)."""
    return _check(policy, "kept", "retention", where)  # type: ignore[no-any-return]


def check_save(policy: Any, where: str) -> SavePolicy:
    """``policy`` if it (every member of an AnyOf) has ``due``, else CkptError."""
    return _check(policy, "due", "save", where)  # type: ignore[no-any-return]


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


def _short(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:80]}{'...' if len(text) > 80 else ''}"

