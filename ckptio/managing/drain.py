"""The background drain: copies each step the first tier commits to the slower tiers due for it.

Call order (the manager, on the coordinating rank): ``Drain(route, everies, options)``;
``submit(step)`` after each commit in tier 0 (``submit_to`` for a drain resumed at start;
``final()`` once the job is preempted: its newest step to every slower tier, unpaced);
``pinned()`` from tier 0's retention; ``status()`` any time; ``wait()`` / ``close()`` last.
How a step is queued, skipped when the drain is behind, and copied after its base:
``Drain.submit`` and ``Drain.run``; once no tier wants a step any more (copied, skipped or
due nowhere) the route is told (``Route.done``: the save's kept record goes).

Owns: the queue of due steps per tier, their pace (``rate``, shared by the tiers), each tier's
small staging (a few buffers, never the saves' pool), its status. Each slower tier's copies run
on a Worker of their own (worker.py: the thread, its priority, the error raised once), so a
tier that is slow or retrying (an object store away) holds up only its own copies, not the
disk's. Does not own: the copy (copy.py), which stores to read and write and the tiers'
retention (the manager, through a Route).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from ckptio.errors import CkptError, CorruptCheckpointError
from ckptio.io.worker import NICE, Worker
from ckptio.managing.copy import Known, copy_checkpoint
from ckptio.options import GiB, Options
from ckptio.resources import ReusedIOResources
from ckptio.storage.store_contract import Store

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

    def known(self, step: int, tier: int) -> Known | None:
        """The source's manifest of ``step`` by its bytes, where this process committed it
        (copy.py's Known); None: the copy decodes it."""
        ...

    def landed(self, step: int, tier: int) -> None:
        """``step`` was committed in ``tier``: apply that tier's retention."""
        ...

    def done(self, step: int) -> None:
        """No copy of ``step`` is due or running any more: what ``known`` kept of it goes."""
        ...


@dataclass
class _Lane:
    """One slower tier's queue and record."""

    every: int
    long_every: tuple[int, ...] = ()  # the tier keeps a step divisible by one for good
    wanted: tuple[int, float] | None = None  # the newest step due and when it was submitted
    held: list[tuple[int, float]] = field(default_factory=list)  # kept-for-good steps passed
    failed: list[tuple[int, float]] = field(default_factory=list)  # kept for good, copy failed
    busy: int | None = None
    ending: bool = False  # the copy of ``busy`` has ended: finish() comes next
    skipped: list[int] = field(default_factory=list)
    copied: list[dict[str, Any]] = field(default_factory=list)  # the last few copies
    error: str | None = None


@dataclass
class _Copy:
    """One job of the drain's worker: ``step`` to tier ``tier``, due since ``since``."""

    tier: int
    step: int
    since: float
    record: dict[str, Any] | None = None  # set once copied: step, nbytes, durable_s


class Drain:
    """The drain of one manager (module docstring); ``everies[k]`` is tier k's interval
    (tier 0, the source of every step, included).

    Args:
        route: the manager's stores and retention (Route).
        everies: per tier, every how many steps a step is due there.
        options: the Checkpointer's Options (the drain's staging uses its buffer size).
        rate: bytes per second the drain may copy (None: as fast as it can).
        nice: the drain thread's CPU priority.
        long_every: per tier, its retention's keep_every intervals (a step divisible by one
            is kept there for good: never skipped, see submit).
    """

    def __init__(self, route: Route, everies: list[int], options: Options, *,
                 rate: float | None = None, nice: int = NICE,
                 long_every: list[tuple[int, ...]] | None = None) -> None:
        self._route = route
        lasting = long_every or [() for _ in everies]
        self._lanes = {k: _Lane(every, lasting[k]) for k, every in enumerate(everies) if k > 0}
        pool = DRAIN_BUFFERS * options.buffer_bytes
        staging = dataclasses.replace(options, pool_bytes=pool, host_budget_bytes=pool,
                                      use_profile=False)
        self._resources = {k: ReusedIOResources(staging) for k in self._lanes}
        self._rate = rate
        self._lock = threading.Condition()  # guards the lanes; the workers sleep on it
        self._workers: dict[int, Worker[_Copy]] = {
            k: Worker(f"ckptio-drain-{k}", _LaneJobs(self, k), nice=nice, lock=self._lock)
            for k in self._lanes}
        self._closed = False
        self._next_free = 0.0  # pace: when the bytes copied so far are paid for
        self._newest: int | None = None  # the newest step submitted
        self._final: int | None = None  # the newest step final() made due everywhere

    # ---------------------------------------------------------------- the training side

    def submit(self, step: int) -> None:
        """``step`` is committed in tier 0: due for every tier whose ``every`` divides it.

        Each slower tier keeps only the newest step due: a drain that falls behind skips to the
        newest step rather than queueing without bound, and says so (a log line,
        ``status()[tier]["skipped"]``), except a step that tier keeps for good (divisible by
        its keep_every): it stays due, copied before the newer one (tier 0's retention keeps
        it meanwhile), as the slower tier would otherwise never hold it. CkptError after
        close()."""
        with self._lock:
            self._newest = step if self._newest is None else max(self._newest, step)
        self._submit(step, [k for k, lane in self._lanes.items() if step % lane.every == 0])

    def submit_to(self, step: int, tier: int) -> None:
        """Copy ``step`` to ``tier`` (a drain resumed at start)."""
        self._submit(step, [tier])

    def kept_for_good(self, step: int, tier: int) -> bool:
        """Whether ``tier`` keeps ``step`` for good (divisible by one of its keep_every)."""
        return any(step % n == 0 for n in self._lanes[tier].long_every)

    def _submit(self, step: int, tiers: list[int], *, final: bool = False) -> None:
        """``final``: the job's last step; every older one due is skipped, even those kept
        for good (the grace period is for the last step)."""
        left: set[int] = set()  # the steps this submit may leave due nowhere: let go below
        taken = False
        with self._lock:
            if self._closed:  # first: nothing runs any more (a step due nowhere included)
                raise CkptError("ckptio-drain: a step was submitted after close(); it will "
                                "not be copied. Submit steps only while the manager is open")
            for worker in self._workers.values():  # every lane's thread started by the
                worker.wake()  # first step (as one thread was), running once the lock is free
            for k in tiers:
                lane = self._lanes[k]
                lane.held, lane.failed = [*lane.failed, *lane.held], []  # tried again first
                for held, _since in lane.held if final else ():
                    lane.skipped.append(held)
                    left.add(held)
                    log.warning("ckptio: the job is preempted: step %d is not copied to "
                                "tier %d, step %d is", held, k, step)
                lane.held = [] if final else lane.held
                if (not final and lane.wanted is not None and lane.wanted[0] < step
                        and any(lane.wanted[0] % n == 0 for n in lane.long_every)):
                    lane.held.append(lane.wanted)
                    lane.wanted = None
                if lane.wanted is not None and lane.wanted[0] < step:
                    lane.skipped.append(lane.wanted[0])
                    left.add(lane.wanted[0])
                    log.warning("ckptio: the drain to tier %d is behind: step %d skipped, step "
                                "%d is copied next", k, lane.wanted[0], step)
                if lane.wanted is None or lane.wanted[0] < step:
                    lane.wanted = (step, time.monotonic())
                taken = taken or lane.wanted[0] == step
        self._let_go(left if taken else left | {step})

    def _let_go(self, steps: set[int], ending: int | None = None) -> None:
        """Tell the route of each of ``steps`` no lane wants or copies any more (``ending``:
        the tier whose copy just ended). Not under the lock: the route reaches the stores."""
        with self._lock:
            if ending is not None:
                self._lanes[ending].ending = True
            for lane in self._lanes.values():
                steps -= {lane.wanted[0] if lane.wanted else None,
                          None if lane.ending else lane.busy,
                          *(s for s, _ in (*lane.held, *lane.failed))}
        for step in sorted(steps):
            self._route.done(step)

    def final(self) -> None:
        """The job is preempted: the newest step submitted is due for every slower tier
        whatever its ``every``, and the rate limit is lifted from now on (the copy running
        included): the job has only its grace period left. Once per step submitted."""
        with self._lock:
            self._rate = None
            step = self._newest
            if step is None or step == self._final:
                return
            self._final = step
        self._submit(step, list(self._lanes), final=True)

    def pinned(self) -> set[int]:
        """Steps the drain is copying or will copy: tier 0's retention keeps them."""
        with self._lock:
            return {s for lane in self._lanes.values()
                    for s in (lane.busy, lane.wanted[0] if lane.wanted else None,
                              *(s for s, _ in (*lane.held, *lane.failed)))
                    if s is not None}

    def give_up(self) -> list[int]:
        """Stop trying again the failed copies (``status()[tier]["retrying"]``): tier 0's
        retention may drop those steps now (a save into memory needs their room), each
        named in a warning as lost for that tier -> the steps let go."""
        with self._lock:
            lost = [(k, s) for k, lane in self._lanes.items() for s, _ in lane.failed]
            for lane in self._lanes.values():
                lane.skipped += [s for s, _ in lane.failed]
                lane.failed = []
        for k, step in lost:
            log.warning("ckptio: step %d, kept for good in tier %d, whose copy there failed, "
                        "is given up to make room in the first tier: tier %d will not hold it",
                        step, k, k)
        self._let_go({s for _, s in lost})
        return sorted({s for _, s in lost})

    def status(self) -> dict[int, dict[str, Any]]:
        """Per slower tier: the step being copied, the one queued, the steps skipped, the last
        copies (step, bytes, seconds from commit in tier 0 to durable here), the last error,
        the steps it keeps for good whose copy failed, tried again with the next step due
        (``retrying``: tier 0 keeps them meanwhile)."""
        with self._lock:
            return {k: {"draining": lane.busy,
                        "queued": lane.wanted[0] if lane.wanted else None,
                        "retrying": [s for s, _ in lane.failed],
                        "skipped": list(lane.skipped), "copied": list(lane.copied),
                        "error": lane.error}
                    for k, lane in self._lanes.items()}

    def wait(self, timeout: float | None = None) -> bool:
        """Until nothing is due or being copied in any tier (-> True), or ``timeout`` (->
        False). The first copy error not raised yet is raised here, once (each tier's)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        first: Exception | None = None
        done = True
        for worker in self._workers.values():
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                done = worker.wait(left) and done
            except Exception as exc:  # noqa: BLE001 - a tier's copy error: the first is raised
                first = first or exc
        if first is not None:
            raise first
        return done

    def close(self) -> None:
        """wait(), stop the threads, free the staging (the first error is raised after)."""
        with self._lock:
            self._closed = True
        first: Exception | None = None
        try:
            for worker in self._workers.values():
                try:
                    worker.close()
                except Exception as exc:  # noqa: BLE001 - every tier closed; the first raised
                    first = first or exc
        finally:
            for resources in self._resources.values():
                resources.free()
        if first is not None:
            raise first

    # ---------------------------- the workers' Jobs (worker.py, through _LaneJobs): their threads

    def take(self, tier: int) -> _Copy | None:
        """Tier ``tier``'s next copy (under the lock): a step it keeps for good that a newer
        one passed first (submitted first), else the step due."""
        lane = self._lanes[tier]
        if lane.held:
            step, since = lane.held.pop(0)
        elif lane.wanted is not None:
            (step, since), lane.wanted = lane.wanted, None
        else:
            return None
        lane.busy, lane.ending = step, False
        return _Copy(tier, step, since)

    def pending(self, tier: int) -> bool:
        """Whether a step is due or being copied in tier ``tier`` (under the lock)."""
        lane = self._lanes[tier]
        return bool(lane.wanted or lane.held or lane.busy is not None)

    def finish(self, job: _Copy, error: Exception | None) -> None:
        """Record ``job``'s outcome (under the lock). A failed copy is logged at once and the
        next due step is tried as usual; the worker raises the first error once."""
        lane = self._lanes[job.tier]
        lane.busy = None
        if error is not None:
            log.warning("ckptio: the drain of step %d to tier %d failed: %s: %s", job.step,
                        job.tier, type(error).__name__, error)
            lane.error = f"step {job.step}: {type(error).__name__}: {error}"
        elif job.record is not None:
            lane.copied = [*lane.copied[-9:], job.record]
            lane.error = None

    def run(self, job: _Copy) -> None:
        """Copy ``job.step`` to its tier (copy.py: verified source, files, manifest last).

        A delta step (docs/FORMAT.md version 4) is copied after its base, which is copied
        first where the tier lacks it (each base moves once however many deltas follow; a
        copy never decodes); the tier's retention runs once the delta is committed and keeps
        a kept delta's base. A kill between the two leaves the delta incomplete (never
        restored) and the lone base to retention. Once no other lane wants ``step``, the
        route is told (``done``). A failed copy of a step its tier keeps for good is tried
        again at the next step due there (tier 0 keeps it meanwhile)."""
        try:
            self._run(job)
        except BaseException as exc:
            self._retry_later(job, exc)
            raise
        finally:
            self._let_go({job.step}, ending=job.tier)

    def _retry_later(self, job: _Copy, error: BaseException) -> None:
        """``job`` failed: keep its step to try again at the next submit to its tier, where
        that tier keeps it for good, the job was not preempted (final() lets it go) and the
        source is not damaged (a damaged copy is never drained: trying again cannot help)."""
        with self._lock:
            if (self.kept_for_good(job.step, job.tier) and self._final is None
                    and not isinstance(error, CorruptCheckpointError)):
                self._lanes[job.tier].failed.append((job.step, job.since))

    def _run(self, job: _Copy) -> None:
        k, step = job.tier, job.step
        if self._route.holds(step, k):
            return
        source = self._route.source(step, k)
        if source is None:
            log.warning("ckptio: the drain skips step %d for tier %d: no faster tier holds it "
                        "committed any more", step, k)
            with self._lock:
                self._lanes[k].skipped.append(step)
            return
        nbytes = self._copy_bases(k, step)
        nbytes += copy_checkpoint(self._resources[k], source, self._route.target(step, k),
                                  self._pace if self._rate else None,
                                  known=self._route.known(step, k))
        durable_s = time.monotonic() - job.since
        log.info("ckptio: step %d durable in tier %d, %.2f s after its commit (%.3f GiB)",
                 step, k, durable_s, nbytes / GiB)
        self._route.landed(step, k)
        job.record = {"step": step, "nbytes": nbytes, "durable_s": durable_s}

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
            nbytes += copy_checkpoint(self._resources[k], source, self._route.target(base, k),
                                      self._pace if self._rate else None,
                                      known=self._route.known(base, k))
        return nbytes

    def _pace(self, nbytes: int) -> None:
        """The rate is the drain's, whatever the tiers copying at once: each copy's bytes are
        paid for after those of every copy before them."""
        with self._lock:
            if not self._rate:  # lifted by final()
                return
            now = time.monotonic()
            self._next_free = max(self._next_free, now) + nbytes / float(self._rate)
            if self._next_free > now:  # final() wakes it early: the rate lifted
                self._lock.wait_for(lambda: not self._rate,
                                    min(self._next_free - now, threading.TIMEOUT_MAX))


@dataclass
class _LaneJobs:
    """The Jobs (worker.py) of tier ``tier``'s worker: that tier's lane of ``drain``."""

    drain: Drain
    tier: int

    def take(self) -> _Copy | None:
        return self.drain.take(self.tier)

    def pending(self) -> bool:
        return self.drain.pending(self.tier)

    def run(self, job: _Copy) -> None:
        self.drain.run(job)

    def finish(self, job: _Copy, error: Exception | None) -> None:
        self.drain.finish(job, error)
