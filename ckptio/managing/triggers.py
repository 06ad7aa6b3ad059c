"""What makes a save due besides the step interval: a time interval (SaveClock) and a
preemption signal (Preemption). Both are this process's view; the manager agrees on them
across ranks (rank 0's clock; a signal seen by any rank).

Preemption: ``install()`` replaces the handlers of ``signals`` (default SIGTERM, what SLURM,
Kubernetes and most schedulers send before killing a job) with one that only records the
signal (no I/O, no lock: it runs between two bytecodes of the main thread); ``uninstall()``
puts the previous handlers back. The previous handler is not chained: it would usually be the
default, which ends the process before the final checkpoint. Later signals are recorded too;
a job that must die at once is sent SIGKILL.

Triggers agrees on both, once per step, in one all-gather: the time is due when rank 0's clock
says so; preemption is reached once any rank has received a signal, and stays reached
(``preempted``: then the manager's wait() and close() make its newest step durable in every
tier, docs/MANAGER.md).

Owns: the clock, the signal handlers, the per-step agreement. Does not own: what the manager
does about them.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any

from ckptio.distributed.dist import Group
from ckptio.errors import CkptError

__all__ = ["Preemption", "SaveClock", "SavePolicy", "Triggers"]


class SaveClock:
    """Whether ``interval_s`` seconds have passed since the last save started (or since the
    clock was made)."""

    def __init__(self, interval_s: float) -> None:
        if isinstance(interval_s, bool) or not isinstance(interval_s, (int, float)) or not (
                0 < interval_s < float("inf")):
            raise CkptError(f"CheckpointManager(save_interval_s={interval_s!r}): seconds > 0")
        self.interval_s = float(interval_s)
        self._last = time.monotonic()

    def due(self) -> bool:
        return time.monotonic() - self._last >= self.interval_s

    def saved(self) -> None:
        """A save started now: the next one is due ``interval_s`` from now."""
        self._last = time.monotonic()


class Preemption:
    """Records the preemption signals this process receives (module docstring)."""

    def __init__(self, signals: Sequence[int] = (signal.SIGTERM,)) -> None:
        try:
            self.signals = tuple(signal.Signals(s) for s in signals)
        except (TypeError, ValueError):
            raise CkptError(f"install_preemption_handler(signals={signals!r}): a sequence of "
                            "signal numbers, e.g. [signal.SIGTERM, signal.SIGUSR1]") from None
        self.received: signal.Signals | None = None  # the first signal seen
        self._previous: dict[signal.Signals, Any] = {}

    def install(self) -> None:
        """Catch ``signals`` from now on. Only the main thread of the main interpreter may."""
        if threading.current_thread() is not threading.main_thread():
            raise CkptError("CheckpointManager(preemption=True) / install_preemption_handler(): "
                            "signal handlers can only be installed from the main thread; create "
                            "the manager there")
        for sig in self.signals:
            if sig not in self._previous:
                try:
                    self._previous[sig] = signal.signal(sig, self._record)
                except (OSError, ValueError) as exc:  # SIGKILL, SIGSTOP: not catchable
                    self.uninstall()
                    raise CkptError(f"install_preemption_handler: {sig.name} cannot be caught "
                                    f"({exc}); use SIGTERM, SIGINT or SIGUSR1/2") from None

    def uninstall(self) -> None:
        """Put the previous handlers back (where ours is still the one installed)."""
        if threading.current_thread() is not threading.main_thread():
            return  # a manager closed elsewhere: its handler stays (it only records)
        for sig, previous in self._previous.items():
            if signal.getsignal(sig) == self._record:
                signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()

    @property
    def installed(self) -> bool:
        return bool(self._previous)

    def _record(self, signum: int, _frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signal.Signals(signum)


class Triggers:
    """A manager's clock and preemption handler, agreed across ranks once per step."""

    def __init__(self, clock: SaveClock | None, preemption: Preemption) -> None:
        self.clock = clock
        self.preemption = preemption
        self._preempted = False  # latched: once reached, reached at every later step
        self._last: tuple[int, dict[str, bool]] | None = None  # the step last agreed on

    def active(self) -> bool:
        """Whether anything but the step interval can make a save due (else no collective)."""
        return self.clock is not None or self.preemption.installed

    @property
    def preempted(self) -> bool:
        """Whether preemption was reached at a step agreed on so far (latched)."""
        return self._preempted

    def at(self, step: int, group: Group) -> dict[str, bool]:
        """``{"time": due by rank 0's clock, "preempted": any rank signalled}`` for ``step``,
        the same on every rank. A collective the first time per step; asked again for the same
        step (should_save, then save, then reached_preemption), the answer is reused."""
        if self._last is not None and self._last[0] == step:
            return self._last[1]
        mine = {"time": self.clock is not None and self.clock.due(),
                "signal": self.preemption.received is not None}
        if group.size > 1:
            reports = [json.loads(b) for b in group.all_gather(json.dumps(mine).encode())]
            mine = {"time": bool(reports[0]["time"]),
                    "signal": any(r["signal"] for r in reports)}
        self._preempted = self._preempted or mine["signal"]
        agreed = {"time": mine["time"], "preempted": self._preempted}
        self._last = (step, agreed)
        return agreed

    def saved(self, step: int) -> None:
        """A save of ``step`` started: the clock restarts (a later ask for ``step`` keeps its
        answer)."""
        if self.clock is not None:
            self.clock.saved()


class SavePolicy:
    """When a manager's save is due: every ``every`` steps (None: by time or signal only), or
    when its Triggers say so (rank 0's clock, a preemption signal on any rank)."""

    def __init__(self, every: int | None, triggers: Triggers) -> None:
        self.every = every
        self.triggers = triggers

    def due(self, step: int, group: Callable[[], Group]) -> bool:
        """Whether a save of ``step`` is due; a collective (over ``group()``) only with a clock
        or a preemption handler."""
        if self.every is not None and step % self.every == 0:
            return True
        if not self.triggers.active():
            return False
        due = self.triggers.at(step, group())
        return due["time"] or due["preempted"]
