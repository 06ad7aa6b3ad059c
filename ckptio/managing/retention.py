"""The keyword spelling of a CheckpointManager's retention (Retention), and rank 0's cache of
each step's metadata (StepMeta), which the StepInfo of a retention pass read.

``keep_last`` / ``keep_every`` / ``keep_best`` / ``monitor`` / ``mode`` /
``keep_without_metric`` are sugar: Retention.checked() checks them as given, and policy()
builds the equivalent built-in of ckptio/policies/ (their union, AnyOf):

- ``keep_last=n``: KeepLatest(n) (None: KeepAll(), so nothing is ever dropped);
- ``keep_every=N``: KeepEvery(steps=N);
- ``keep_best=k, monitor=NAME, mode, keep_without_metric``: KeepBest(k, NAME, mode, ...).

What no policy changes (the newest committed step, the newest step restore()/verify()
succeeded on, steps whose metadata could not be read, the bases of kept deltas, what a tiered
manager pins) is added by the tier at run time (managing/level.py).

Owns: the options' checks, their translation, the metadata cache (StepMeta: a committed step's
manifest never changes, so it is read once). Does not own: the rules (policies/), the
metadata's format (stepmeta.py), listing or deleting steps (level.py, storage/steproot.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ckptio.errors import CkptError
from ckptio.managing import warn
from ckptio.policies import AnyOf, KeepAll, KeepBest, KeepEvery, KeepLatest, RetentionPolicy, StepInfo, kept_by

__all__ = ["MODES", "Retention", "StepMeta"]

MODES = ("min", "max")


@dataclass(frozen=True)
class Retention:
    """A retention policy (module docstring); build it with Retention.checked()."""

    keep_last: int | None = 3
    keep_every: int | None = None
    keep_best: int | None = None
    monitor: str | None = None
    mode: str = "min"
    keep_without_metric: bool = False

    @classmethod
    def checked(cls, *, keep_last: Any = 3, keep_every: Any = None, keep_best: Any = None,
                monitor: Any = None, mode: Any = "min",
                keep_without_metric: Any = False) -> Retention:
        """The policy, or a CkptError naming the option and the fix."""
        for name, value in (("keep_last", keep_last), ("keep_every", keep_every),
                            ("keep_best", keep_best)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise CkptError(f"CheckpointManager({name}={value!r}): must be an integer >= 1")
        if mode not in MODES:
            raise CkptError(f"CheckpointManager(mode={mode!r}): 'min' (lower is better, a loss) "
                            "or 'max' (higher is better, an accuracy)")
        if not isinstance(keep_without_metric, bool):
            raise CkptError(f"CheckpointManager(keep_without_metric={keep_without_metric!r}): "
                            "True or False")
        if (keep_best is None) != (monitor is None):
            raise CkptError("CheckpointManager(keep_best=k, monitor='val_loss'): give both (the "
                            "k best steps by that metric, passed as save(..., metrics={...}))")
        if monitor is not None and (not isinstance(monitor, str) or not monitor):
            raise CkptError(f"CheckpointManager(monitor={monitor!r}): the name of a metric")
        if keep_best is not None and keep_last is None:
            raise CkptError("CheckpointManager(keep_best=..., keep_last=None): keep_last=None "
                            "keeps every step, so keep_best would drop nothing; give keep_last=1 "
                            "to keep only the newest step besides the best")
        return cls(keep_last, keep_every, keep_best, monitor, mode, keep_without_metric)

    def policy(self) -> RetentionPolicy:
        """The built-in policy these options spell (module docstring)."""
        rules: list[RetentionPolicy] = [
            KeepAll() if self.keep_last is None else KeepLatest(self.keep_last)]
        if self.keep_every is not None:
            rules.append(KeepEvery(steps=self.keep_every))
        if self.keep_best is not None and self.monitor is not None:
            rules.append(KeepBest(self.keep_best, self.monitor, self.mode,
                                  self.keep_without_metric))
        return rules[0] if len(rules) == 1 else AnyOf(*rules)

    def kept(self, committed: list[int], metrics: Mapping[int, float | None],
             also: Iterable[int] = ()) -> set[int]:
        """The steps of ``committed`` (ascending) to keep: policy()'s, the newest and
        ``also``. ``metrics``: each step's value of the monitored metric (None: without)."""
        name = self.monitor or ""
        values = {s: v for s, v in metrics.items() if v is not None}
        infos = [StepInfo(s, metrics={name: values[s]} if s in values else None)
                 for s in committed]
        return kept_by(self.policy(), infos, time.time()) | set(committed[-1:]) | set(also)


class StepMeta:
    """Each step's metadata (``read(step)``: stepmeta.read_metadata of the step), read once
    and kept; forget() a step saved again. A step whose metadata cannot be read now is
    warned of and listed in ``unreadable`` (retention keeps it; it is asked again later)."""

    def __init__(self, read: Callable[[int], dict[str, Any]], where: str) -> None:
        self._read = read
        self._where = where
        self._known: dict[int, dict[str, Any]] = {}
        self.unreadable: set[int] = set()  # since the last pass began (begin())

    def begin(self) -> None:
        """A retention pass starts: forget which steps could not be read."""
        self.unreadable = set()

    def of(self, step: int) -> dict[str, Any] | None:
        """``step``'s metadata, or None (with a warning) when it cannot be read now."""
        if step not in self._known:
            try:
                self._known[step] = self._read(step)
            except CkptError as exc:
                if step not in self.unreadable:
                    warn(f"ckptio: retention keeps step {step} of {self._where}: its metadata "
                         f"(metrics, commit time) cannot be read ({type(exc).__name__}: "
                         f"{exc})", stacklevel=5)
                self.unreadable.add(step)
                return None
        return self._known[step]

    def forget(self, step: int) -> None:
        self._known.pop(step, None)
