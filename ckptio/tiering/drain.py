"""The background drain: copies each step the first tier commits to the slower tiers due for it.

One thread per manager (on the coordinating rank), with its own small staging (a few buffers of
the Checkpointer's size, never the training saves' pool, so a save never waits for a drain and
a drain never holds more host memory than that), at a lowered CPU priority (``nice``; the
threads it starts inherit it), optionally held to ``rate`` bytes per second. For each slower
tier it keeps only the newest step due: a drain that falls behind skips to the newest step
rather than queueing without bound, and says so (a log line, ``status()["skipped"]``).

Copies are tiering/copy.py's (verified source, files, manifest last). A delta step (its
manifest references a base step, docs/FORMAT.md version 4) is copied after its base: when the
slower tier does not hold the base committed, the base is copied there first (from the fastest
tier holding it), then the delta; that tier's retention runs only once the delta is committed,
and it keeps a kept delta's base. Why base-first rather than a self-contained copy: a copy moves
bytes through the drain's two staging buffers and never decodes; making a delta self-contained
means reading base and delta, XORing and writing a full step, the state's size in host memory
and CPU, and every drained step then costs a full step on the slow store. Base-first moves
each base once however many of its deltas follow (for each drained step: its delta, plus at
most one base per base change). A kill between the two copies leaves the base committed and
the delta incomplete: restore never picks the delta, and retention removes the lone base later. A copy that fails is
logged at once, the next due step is tried as usual, and the first unseen error is raised
once by wait() (or close()). Which store to read and write, and what follows a commit in a
tier (its retention), are the manager's (a Route).

Owns: the queue of due steps per tier, the thread, its pace and priority, its status and the
stored error. Does not own: the copy (copy.py), the tiers and their retention (manager.py).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from ckptio.errors import CkptError
from ckptio.options import GiB, Options
from ckptio.resources import Resources
from ckptio.storage.base import Store
from ckptio.tiering.copy import copy_checkpoint

__all__ = ["DRAIN_BUFFERS", "Drain", "Route"]

log = logging.getLogger("ckptio")
DRAIN_BUFFERS = 2  # the drain's staging: this many buffers of Options.buffer_bytes


class Route(Protocol):
    """What the drain asks the manager: stores by (step, tier), and what follows a commit."""

    def source(self, step: int, tier: int) -> Store | None:
        """The store of the fastest tier before ``tier`` that holds ``step`` committed."""
        ...

    def target(self, step: int, tier: int) -> Store:
        ...

    def holds(self, step: int, tier: int) -> bool:
        """Whether ``tier`` holds ``step`` committed already."""
        ...

    def bases(self, step: int, tier: int) -> tuple[int, ...]:
        """The steps ``step`` is a delta against (() for a full step), as the source has it."""
        ...

    def landed(self, step: int, tier: int) -> None:
        """``step`` was committed in ``tier``: apply that tier's retention."""
        ...


@dataclass
class _Lane:
    """One slower tier's queue and record."""

    every: int
    wanted: tuple[int, float] | None = None  # the newest step due and when it was submitted
    busy: int | None = None
    skipped: list[int] = field(default_factory=list)
    copied: list[dict[str, Any]] = field(default_factory=list)  # the last few copies
    error: str | None = None


class Drain:
    """The drain of one manager (module docstring); ``everies[k]`` is tier k's interval
    (tier 0, the source of every step, included)."""

    def __init__(self, route: Route, everies: list[int], options: Options, *,
                 rate: float | None = None, nice: int = 10) -> None:
        self._route = route
        self._lanes = {k: _Lane(every) for k, every in enumerate(everies) if k > 0}
        pool = DRAIN_BUFFERS * options.buffer_bytes
        self._staging = Resources(dataclasses.replace(
            options, pool_bytes=pool, host_budget_bytes=pool, use_profile=False))
        self._rate = rate
        self._nice = nice
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._error: BaseException | None = None  # the first one wait() has not raised yet
        self._next_free = 0.0  # pace: when the bytes copied so far are paid for

    # ---------------------------------------------------------------- the training side

    def submit(self, step: int) -> None:
        """``step`` is committed in tier 0: due for every tier whose ``every`` divides it."""
        self._submit(step, [k for k, lane in self._lanes.items() if step % lane.every == 0])

    def submit_to(self, step: int, tier: int) -> None:
        """Copy ``step`` to ``tier`` (a drain resumed at start)."""
        self._submit(step, [tier])

    def _submit(self, step: int, tiers: list[int]) -> None:
        with self._cond:
            for k in tiers:
                lane = self._lanes[k]
                if lane.wanted is not None and lane.wanted[0] < step:
                    lane.skipped.append(lane.wanted[0])
                    log.warning("ckptio: the drain to tier %d is behind: step %d skipped, step "
                                "%d is copied next", k, lane.wanted[0], step)
                if lane.wanted is None or lane.wanted[0] < step:
                    lane.wanted = (step, time.monotonic())
            self._start()
            self._cond.notify_all()

    def pinned(self) -> set[int]:
        """Steps the drain is copying or will copy: tier 0's retention keeps them."""
        with self._cond:
            return {s for lane in self._lanes.values()
                    for s in (lane.busy, lane.wanted[0] if lane.wanted else None)
                    if s is not None}

    def status(self) -> dict[int, dict[str, Any]]:
        """Per slower tier: the step being copied, the one queued, the steps skipped, the last
        copies (step, bytes, seconds from commit in tier 0 to durable here), the last error."""
        with self._cond:
            return {k: {"draining": lane.busy,
                        "queued": lane.wanted[0] if lane.wanted else None,
                        "skipped": list(lane.skipped), "copied": list(lane.copied),
                        "error": lane.error}
                    for k, lane in self._lanes.items()}

    def wait(self, timeout: float | None = None) -> bool:
        """Until nothing is due or being copied (-> True), or ``timeout`` (-> False). The
        first copy error not raised yet is raised here, once."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while any(lane.wanted or lane.busy is not None for lane in self._lanes.values()):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
            error, self._error = self._error, None
        if error is not None:
            raise error
        return True

    def close(self) -> None:
        """wait(), stop the thread, free the staging (the error is raised after)."""
        try:
            self.wait()
        finally:
            with self._cond:
                self._closed = True
                self._cond.notify_all()
            if self._thread is not None:
                self._thread.join()
            self._staging.free()

    # ---------------------------------------------------------------- the drain thread

    def _start(self) -> None:
        if self._thread is None and not self._closed:
            self._thread = threading.Thread(target=self._run, name="ckptio-drain", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        try:  # Linux: per thread; the backend threads it starts inherit it
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self._nice)
        except (OSError, AttributeError):
            log.debug("ckptio: the drain runs at normal priority (setpriority refused)")
        while True:
            with self._cond:
                job = self._next_job()
                while job is None and not self._closed:
                    self._cond.wait()
                    job = self._next_job()
                if job is None:
                    return
            self._copy(*job)

    def _next_job(self) -> tuple[int, int, float] | None:
        """The step waiting longest (a tie: the faster tier's), so no tier starves."""
        waiting = [(lane.wanted[1], k) for k, lane in self._lanes.items() if lane.wanted]
        if not waiting:
            return None
        k = min(waiting)[1]
        lane = self._lanes[k]
        (step, since), lane.wanted = lane.wanted, None  # type: ignore[misc]
        lane.busy = step
        return k, step, since

    def _copy(self, k: int, step: int, since: float) -> None:
        lane = self._lanes[k]
        record: dict[str, Any] | None = None
        try:
            record = self._copied(k, step, since)
        except Exception as exc:  # stored, logged, raised once by wait(); the next step is tried
            log.warning("ckptio: the drain of step %d to tier %d failed: %s: %s", step, k,
                        type(exc).__name__, exc)
            with self._cond:
                lane.error = f"step {step}: {type(exc).__name__}: {exc}"
                if self._error is None:
                    self._error = exc
        finally:
            with self._cond:
                lane.busy = None
                if record is not None:
                    lane.copied = [*lane.copied[-9:], record]
                    lane.error = None
                self._cond.notify_all()

    def _copied(self, k: int, step: int, since: float) -> dict[str, Any] | None:
        if self._route.holds(step, k):
            return None
        source = self._route.source(step, k)
        if source is None:
            log.warning("ckptio: the drain skips step %d for tier %d: no faster tier holds it "
                        "committed any more", step, k)
            with self._cond:
                self._lanes[k].skipped.append(step)
            return None
        nbytes = self._copy_bases(k, step)
        nbytes += copy_checkpoint(self._staging, source, self._route.target(step, k),
                                  self._pace if self._rate else None)
        durable_s = time.monotonic() - since
        log.info("ckptio: step %d durable in tier %d, %.2f s after its commit (%.3f GiB)",
                 step, k, durable_s, nbytes / GiB)
        self._route.landed(step, k)
        return {"step": step, "nbytes": nbytes, "durable_s": durable_s}

    def _copy_bases(self, k: int, step: int) -> int:
        """Copy to tier ``k`` each base of ``step`` it does not hold -> bytes copied."""
        nbytes = 0
        for base in self._route.bases(step, k):
            if self._route.holds(base, k):
                continue
            source = self._route.source(base, k)
            if source is None:
                raise CkptError(f"the drain cannot copy step {step} to tier {k}: it is a delta "
                                f"against step {base}, which no faster tier holds committed")
            log.info("ckptio: the drain copies base step %d to tier %d before its delta %d",
                     base, k, step)
            nbytes += copy_checkpoint(self._staging, source, self._route.target(base, k),
                                      self._pace if self._rate else None)
        return nbytes

    def _pace(self, nbytes: int) -> None:
        now = time.monotonic()
        self._next_free = max(self._next_free, now) + nbytes / float(self._rate or 1)
        if self._next_free > now:
            time.sleep(self._next_free - now)
