"""Which committed steps a CheckpointManager keeps: Retention.

The kept set is the union of:

- the newest ``keep_last`` committed steps (None: every step, so nothing is ever dropped);
- every step divisible by ``keep_every``;
- with ``keep_best=k, monitor=NAME``: the k steps with the best value of metric NAME (``mode``
  "min": lowest; "max": highest), among the steps saved with that metric. NaN ranks worst.
  Ties: the newer step ranks first (as Orbax; Lightning keeps the older);
- steps saved without the metric only if ``keep_without_metric`` (default False: they are
  kept by the rules above only; Orbax keeps them forever by default, which fills a disk when
  most saves carry no evaluation);
- and, from the manager: the newest committed step, the newest step restore()/verify()
  succeeded on, steps whose metric could not be read, and what a tiered manager pins.

Owns: the options' checks, the kept set, rank 0's cache of each step's metric (StepMetrics:
a committed step's manifest never changes, so it is read once). Does not own: the metadata's
format (stepmeta.py), listing or deleting steps (manager.py, storage/steproot.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ckptio.errors import CkptError
from ckptio.managing import warn

__all__ = ["MODES", "Retention", "StepMetrics"]

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

    def kept(self, committed: list[int], metrics: Mapping[int, float | None],
             also: Iterable[int] = ()) -> set[int]:
        """The steps of ``committed`` (ascending) to keep. ``metrics``: each step's value of
        the monitored metric (None: saved without it); ``also``: steps kept regardless."""
        keep = set(committed if self.keep_last is None else committed[-self.keep_last:])
        if self.keep_every is not None:
            keep.update(s for s in committed if s % self.keep_every == 0)
        keep.update(committed[-1:])
        keep.update(also)
        if self.keep_best is not None:
            scored = [s for s in committed if metrics.get(s) is not None]
            keep.update(sorted(scored, key=lambda s: self._rank(metrics[s], s))[:self.keep_best])
            if self.keep_without_metric:
                keep.update(s for s in committed if metrics.get(s) is None)
        return keep

    def _rank(self, value: float | None, step: int) -> tuple[bool, float, int]:
        """Sort key, best first: NaN last, then by value in ``mode``'s order, then newer first."""
        assert value is not None  # internal: only steps with the metric are ranked
        if math.isnan(value):
            return True, 0.0, -step
        return False, value if self.mode == "min" else -value, -step


class StepMetrics:
    """Each step's value of one metric, read (``read(step)``: stepmeta.read_metadata of the
    step) once and kept; forget() a step saved again."""

    def __init__(self, read: Callable[[int], dict[str, Any]], where: str) -> None:
        self._read = read
        self._where = where
        self._known: dict[int, float | None] = {}

    def of(self, steps: list[int], name: str) -> tuple[dict[int, float | None], set[int]]:
        """-> (each step's value of ``name``, None where saved without it; the steps whose
        metadata cannot be read now, with a warning: keep them, they are asked again later)."""
        unreadable = set()
        for step in steps:
            if step in self._known:
                continue
            try:
                self._known[step] = self._read(step)["metrics"].get(name)
            except CkptError as exc:
                warn(f"ckptio: retention keeps step {step} of {self._where}: its metric "
                     f"{name!r} cannot be read ({type(exc).__name__}: {exc})", stacklevel=4)
                unreadable.add(step)
        return {s: self._known[s] for s in steps if s not in unreadable}, unreadable

    def forget(self, step: int) -> None:
        self._known.pop(step, None)
