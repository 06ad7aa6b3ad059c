"""When a manager's save is due: its save policy (ckptio/policies/) run by Saving, asked with
a SaveMoment agreed across ranks (Triggers: rank 0's clock and last save, a preemption signal
(Preemption) seen by any rank).

Preemption: ``install()`` replaces the handlers of ``signals`` (default SIGTERM, what SLURM,
Kubernetes and most schedulers send before killing a job) with one that only records the
signal (no I/O, no lock: it runs between two bytecodes of the main thread); ``uninstall()``
puts the previous handlers back. The previous handler is not chained: it would usually be the
default, which ends the process before the final checkpoint. Later signals are recorded too;
a job that must die at once is sent SIGKILL.

Triggers agrees on the moment, once per step, in one all-gather: rank 0's time and the time of
its last save; preemption is reached once any rank has received a signal, and stays reached
(``preempted``: then the manager's wait() and close() make its newest step durable in every
tier, docs/MANAGER.md). A policy made only of SaveEvery(steps=N) needs no agreement.

Owns: the clock, the signal handlers, the per-step agreement, running the save policy. Does
not own: the policies (policies/), what the manager does about a save.
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
from ckptio.policies import SaveEvery, SaveMoment, SaveOnPreemption, SavePolicy, due_by, leaves

__all__ = ["Preemption", "Saving", "Triggers"]


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

    def __init__(self, preemption: Preemption) -> None:
        self.preemption = preemption
        self._preempted = False  # latched: once reached, reached at every later step
        self._last: tuple[int, dict[str, Any]] | None = None  # the step last agreed on
        self.last_step: int | None = None  # the last save started
        self._last_started = time.monotonic()  # when: a clock that a wall-clock jump leaves alone

    @property
    def preempted(self) -> bool:
        """Whether preemption was reached at a step agreed on so far (latched)."""
        return self._preempted

    def at(self, step: int, group: Group) -> dict[str, Any]:
        """``{"now": rank 0's time, "last": when rank 0's last save started, "preempted": any
        rank signalled}`` for ``step``, the same on every rank. A collective the first time per
        step; asked again for the same step (should_save, then save, then
        reached_preemption), the answer is reused."""
        if self._last is not None and self._last[0] == step:
            return self._last[1]
        now = time.time()  # Unix time, as StepInfo.committed_at; "last" is as long ago as the
        # monotonic clock says, so a save interval is not stretched or cut by a clock jump
        mine = {"now": now, "last": now - (time.monotonic() - self._last_started),
                "signal": self.preemption.received is not None}
        if group.size > 1:
            reports = [json.loads(b) for b in group.all_gather(json.dumps(mine).encode())]
            mine = {**reports[0], "signal": any(r["signal"] for r in reports)}
        self._preempted = self._preempted or bool(mine["signal"])
        agreed = {"now": float(mine["now"]), "last": float(mine["last"]),
                  "preempted": self._preempted}
        self._last = (step, agreed)
        return agreed

    def saved(self, step: int) -> None:
        """A save of ``step`` started: the clock restarts (a later ask for ``step`` keeps its
        answer)."""
        self.last_step, self._last_started = step, time.monotonic()


class Saving:
    """Runs a manager's save policy: ``due(step)`` asks it with the agreed SaveMoment; a save is
    due at once, with no agreement, where a SaveEvery(steps=N) in it says so, and whenever
    preemption is reached with a handler installed."""

    def __init__(self, policy: SavePolicy, triggers: Triggers) -> None:
        self.policy = policy
        self.triggers = triggers
        parts = list(leaves(policy))
        self._every = [p.steps for p in parts if isinstance(p, SaveEvery) and p.steps]
        self._steps_only = len(self._every) == len(parts)
        self.wants_preemption = any(isinstance(p, SaveOnPreemption) for p in parts)

    def due(self, step: int, group: Callable[[], Group]) -> bool:
        """Whether a save of ``step`` is due; a collective (over ``group()``) unless the
        policy is only step intervals and no preemption handler is installed."""
        if any(step % every == 0 for every in self._every):
            return True
        if self._steps_only and not self.triggers.preemption.installed:
            return False
        agreed = self.triggers.at(step, group())
        if agreed["preempted"]:
            return True
        return due_by(self.policy, SaveMoment(step, agreed["now"], self.triggers.last_step,
                                              agreed["last"], False))
