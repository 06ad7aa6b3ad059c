"""The CheckpointManager's parts and their life (ManagerParts, which manager.py's
CheckpointManager extends with its public verbs): construction (declare the tiers and policies,
the Guard with redundancy, the Ranks, one TierSteps per tier, the followers, the run leases),
the save in flight up to its commit (wait, then the first tier's retention and the followers),
close(), and the rank-0 decisions every rank agrees on (managing/agreement.py).

Call order: constructed by CheckpointManager(...) on every rank together; the verbs in
manager.py call _room_for, _committed and _retain around each save; close() last.
Owns: the tiers at run time, the followers, the save in flight, when the run leases are taken
(leases.py holds them), the preemption handler, the agreement across ranks, what a manager never
closed does at exit. Does not own: the public verbs (manager.py), the policies (policies/), one
checkpoint's save and load (api.py), what gives way in a memory first tier before a save is
refused (headroom.py), the set of managers not closed and its exit hook (unclosed.py).
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ckptio.api import Checkpointer
from ckptio.distributed.dist import COORDINATOR, Group
from ckptio.errors import CheckpointLockedError, CkptError, SaveTimeoutError, seconds_to_wait
from ckptio.managing.agreement import Ranks
from ckptio.managing.all_tiers import list_tiers, make_levels
from ckptio.managing.declare import UNSET, declare, settings_of
from ckptio.managing.delta import check_delta
from ckptio.managing.drain import Drain
from ckptio.managing.follower import Follower
from ckptio.managing.guard import Guard
from ckptio.managing.headroom import FirstTierRoom
from ckptio.managing.inflight import InFlight
from ckptio.managing.leases import RunLeases
from ckptio.managing.restoring import where
from ckptio.managing.route import TierRoute, resume
from ckptio.managing.tier import Tier, one_host, state_nbytes
from ckptio.managing import unclosed
from ckptio.managing.triggers import Preemption, Saving, Triggers
from ckptio.options import Options
from ckptio.policies import (
    AnyOf,
    DeltaBasePolicy,
    DeltaPolicy,
    KeepEvery,
    RetentionPolicy,
    SaveOnPreemption,
    SavePolicy,
    leaves,
)
from ckptio.saving.handle import SaveResult
from ckptio.storage.select import checkpoint_path

__all__ = ["ManagerParts"]

log = logging.getLogger("ckptio")


class ManagerParts:
    """The state of a CheckpointManager and its life (module docstring); the verbs are
    CheckpointManager's (managing/manager.py)."""

    def __init__(self, directory: str | os.PathLike[str] | None = None, *,
                 keep_last: int | None = UNSET, keep_every: int | None = UNSET,
                 keep_best: int | None = None, monitor: str | None = None, mode: str = "min",
                 keep_without_metric: bool = False, save_every: int | None = UNSET,
                 save_interval_s: float | None = None, preemption: bool = False,
                 options: Options | None = None, checkpointer: Checkpointer | None = None,
                 process_group: Any = None, tiers: Sequence[Tier] | None = None,
                 delta: DeltaPolicy | DeltaBasePolicy | bool | None = None, compression: str | None = None,
                 drain_rate: float | None = None, take_over: bool = False,
                 keep: RetentionPolicy | None = None, save: SavePolicy | None = None) -> None:
        declared = declare(directory, tiers, keep_last=keep_last, keep_every=keep_every,
                           save_every=save_every, save_interval_s=save_interval_s,
                           best={"keep_best": keep_best, "monitor": monitor, "mode": mode,
                                 "keep_without_metric": keep_without_metric},
                           keep=keep, save=save)
        settings = settings_of(options, checkpointer, compression, preemption, drain_rate)
        self.delta = check_delta(delta)
        self.retention = declared.retentions[0]  # the keywords (None with keep=)
        self.keep_last = None if self.retention is None else self.retention.keep_last
        self.keep_every = None if self.retention is None else self.retention.keep_every
        self.keep_policies = declared.keeps  # per tier (ckptio/policies/)
        self.save_every = declared.save_every
        self.save_policy = _with_preemption(declared.save) if preemption else declared.save
        self._policy = Saving(self.save_policy, Triggers(Preemption()))
        self.tiers = declared.tiers
        self._guard: Guard | None = None
        job_group = process_group
        if self.tiers[0].redundancy is not None:  # rank-local tiers, protected across hosts
            self._guard = Guard(self.tiers, process_group, settings)
            self.tiers, process_group = self._guard.tiers, self._guard.single
        self._owns_checkpointer = checkpointer is None
        self._ck = checkpointer or Checkpointer(settings)
        self._process_group = process_group
        self._ranking = Ranks(process_group, self._ck.options,
                              checkpoint_path(self.tiers[0].location))
        self._levels = make_levels(self.tiers, declared.keeps, self._ck, self._ranking,
                                   process_group)
        self.directory = self._levels[0].directory
        self._named = where(self._levels[:1])  # messages' name: a memory tier's shm://NAME
        # the clock and the signal are agreed by the whole job (with redundancy, the saves'
        # group is this rank alone)
        self._job = self._ranking if self._guard is None else Ranks(job_group, settings,
                                                                   self.directory)
        # per tier, the keep_every intervals of its retention (a step kept there for good)
        self._tier_long_every = [tuple(p.steps for p in leaves(keep)
                                       if isinstance(p, KeepEvery) and p.steps)
                                 for keep in declared.keeps]
        self._long_every = tuple(n for every in self._tier_long_every for n in every)
        self._saves = InFlight(self._levels[0])
        # the first tier's room, checked before each save if it is host memory on this host
        self._room = FirstTierRoom.of(self._levels[0], self.tiers[0])
        self._bases: dict[int, tuple[int, ...]] = {}  # per save made: its bases (chains.py)
        self._drain: Drain | None = None
        self._followers: list[Follower] = []
        self.last_restore: dict[str, Any] | None = None  # tier, step, seconds, report
        self._leases = RunLeases(self._levels, take_over)  # rank 0's (one job per run)
        self._first_leased = False
        self._saved_here = False  # a save started: the staging is the one the saves sized
        self._closed = False  # close() ran: its leases, handlers and followers are let go
        try:
            self._agreed(self._leases.take, range(len(self._levels)), create=False)
            self._start(self._policy.wants_preemption, drain_rate)
        except BaseException:
            self._leases.release()
            self._policy.triggers.preemption.uninstall()
            if self._owns_checkpointer:
                self._ck.close()
            raise

    def _start(self, preemption: bool, drain_rate: float | None) -> None:
        if preemption:
            self.install_preemption_handler()
        if self._guard is None:
            one_host(self.tiers, self._ranks())
        else:
            self._guard.start(lambda s: checkpoint_path(self._levels[0].path(s)))
            self._followers.append(self._guard)
        if len(self._levels) > 1:
            if self._ranks().rank == COORDINATOR:
                self._drain = Drain(TierRoute(self._levels), [t.every for t in self.tiers],
                                    self._ck.options, rate=drain_rate,
                                    long_every=self._tier_long_every)
                self._ck.resources().commits.listen()
                self._followers.append(self._drain)
            self._agreed(resume, self._levels, self._drain, self._leases.held())

    def install_preemption_handler(self, signals: Sequence[int] = (signal.SIGTERM,)) -> None:
        """Record ``signals`` (default SIGTERM) instead of dying of them, until close()
        (managing/triggers.py). Call on every rank, from the main thread."""
        triggers = self._policy.triggers
        if triggers.preemption.installed:
            return
        triggers.preemption = Preemption(signals)
        triggers.preemption.install()

    def _said_at_exit(self) -> None:
        """A save started: until close(), an exit says this manager was not closed."""
        unclosed.track(self)

    def _room_for(self, state: Any) -> None:
        """Collective, before a save into a memory tier on this host: rank 0 refuses a save the
        tier cannot hold (managing/headroom.py; sized from ``state`` before a first step)."""
        if self._room is not None:
            others = None if self._guard is None else self._guard.for_others
            self._agreed(self._make_room, state, others)

    def _make_room(self, state: Any,
                   others: Callable[[int], tuple[int, int]] | None) -> None:
        """Rank 0: the first tier's room for the save of ``state`` (FirstTierRoom.make), the
        drain's retries and the retention's keeps told to it."""
        assert self._room is not None  # internal: _room_for calls it only for a memory tier
        give_up = None if self._drain is None else self._drain.give_up
        self._room.make(functools.partial(self._job_nbytes, state), others, give_up,
                        self._kept_in_first)

    def _job_nbytes(self, state: Any) -> int:
        """The bytes of ``state`` on every rank (each rank's taken to be as large as this one's)."""
        return state_nbytes(state) * self._ranks().size

    def wait(self, timeout: float | None = None) -> SaveResult | None:
        """Wait for the async save in flight (None if there is none), then apply the first
        tier's retention. Its error is raised here (and not again by close() or the next
        save). ``timeout``: SaveTimeoutError if it has not finished within that many seconds,
        naming the step, the rank and the file it waits for (it stays in flight: wait again).
        The followers are not waited for (drained(), protected()), except once preemption is
        reached: then the newest step goes on to every slower tier, unpaced, and wait()
        returns once it is durable there, within ``timeout`` too (docs/MANAGER.md,
        Preemption)."""
        timeout = seconds_to_wait("CheckpointManager.wait", timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        result, committed = self._saves.wait(timeout)
        for done in committed:
            self._committed(done)
        if self._drain is not None and self._policy.triggers.preempted:
            self._drain.final()
            self._followers_within(deadline, [self._drain], "wait", timeout)
        return result

    def _followers_within(self, deadline: float | None, followers: Sequence[Follower],
                          verb: str, timeout: float | None) -> None:
        """Wait for ``followers`` until ``deadline`` (None: for as long as they take), or
        SaveTimeoutError naming the steps the drain still copies and where (a copy blocked in
        the kernel, a hung fsync of a slower tier, cannot be cancelled: it goes on).
        ``verb`` and ``timeout``: the call that gave them that long, for the message."""
        for follower in followers:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if follower.wait(left):
                continue
            busy = [f"step {part.get('draining') or part.get('queued')} to tier {k} "
                    f"({self.tiers[k].location})" for k, part in follower.status().items()
                    if part.get("draining") is not None or part.get("queued") is not None]
            what = ("the drain's copy of " + ", ".join(busy)) if busy else "the protection"
            raise SaveTimeoutError(
                f"CheckpointManager.{verb}: {what} did not finish within {timeout} s. It goes "
                "on in the "
                "background (a call in the kernel cannot be cancelled): call "
                f"{verb}() again later, or kill the process; nothing partial is committed "
                "there, and the steps the first tier committed stay. Check that storage "
                "(dmesg, the network filesystem's server)")

    def _settle(self, before: int) -> None:
        """The async save in flight finishes before step ``before`` is saved (its unseen error
        raised here, saying it costs that step); committed, its retention runs."""
        for done in self._saves.settle(self._ck, before):
            self._committed(done)

    def close(self, timeout: float | None = None) -> None:
        """wait(), let the followers finish (their first error not raised yet is raised here,
        once), run the retention their pins and the delta chains held back, finish every
        tier's removals, put back the signal handlers, free the Checkpointer if the manager
        made it. ``timeout``: as wait()'s, for the save in flight and then the followers (a
        drain's copy blocked in a slower tier's storage): SaveTimeoutError naming what is still
        running; then nothing is closed (close() again later)."""
        timed_out = False
        timeout = seconds_to_wait("CheckpointManager.close", timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            self.wait(timeout)
            if deadline is not None:  # the followers too: close() closes them last
                self._followers_within(deadline, self._followers, "close", timeout)
        except SaveTimeoutError:
            timed_out = True
            raise
        finally:
            if not timed_out:
                self._close()

    def _close(self) -> None:
        """close() after its wait(): the followers, the last retention, the removals."""
        unclosed.forget(self)
        self._closed = True
        self._policy.triggers.preemption.uninstall()
        failed: CkptError | None = None  # a follower's error, raised after the retention
        try:
            for follower in self._followers:
                failed = _closed(follower, failed)
            self._last_retention()
            if failed is not None:
                raise failed
        finally:
            try:
                for level in self._levels:
                    level.join_removal()
                    level.drop_slots()
                if self._owns_checkpointer:
                    self._ck.close()
            finally:
                self._leases.release()
                if self._guard is not None:
                    self._guard.release()

    def _last_retention(self) -> None:
        """close()'s retention passes, once the followers closed (their pins let go)."""
        if self._ranking.gone():  # the job tore its process group down (a rank lost):
            return  # nothing to agree on; the next manager's first save runs retention
        if self._taken_over() is not None:  # the steps there are another job's now
            return
        # what the drain's pins kept past our last commit; a manager that never saved
        # (a reader of a live run) drops nothing: the steps are another job's
        if len(self._levels) > 1 and self._saved_here:
            self._retain(0)
        for k in range(len(self._levels)):  # bases kept back one pass (chains.py)
            if self._agreed(self._deferred, k):
                self._retain(k)

    def _committed(self, step: int) -> None:
        """Collective, after a save of ours committed in the first tier: its retention runs
        (rank 0 hides the steps it drops), then each follower takes the step."""
        self._levels[0].saved(step, self._bases.pop(step, None))
        self._bases = {s: b for s, b in self._bases.items() if s > step}  # failed saves' too
        if self._retain(0) is None:  # another job took the run over: its steps stay
            self._taken_over()
            return
        for follower in self._followers:
            follower.submit(step)

    def _retain(self, k: int) -> list[int] | None:
        """Collective: tier ``k``'s retention pass (rank 0), keeping what the save in flight
        and the followers need in the first tier -> the steps dropped; None: not run, a run
        lease was taken over by another job (its steps are not this job's to drop)."""
        also = self._kept_in_first() if k == 0 else set()
        dropped = self._agreed(self._retain_kept, k, also)
        return None if dropped is None else list(dropped)

    def _retain_kept(self, k: int, also: set[int]) -> list[int] | None:
        """Rank 0: tier ``k``'s retention, unless a run lease was taken over (None)."""
        if self._leases.lost() is not None:
            return None
        return list(self._levels[k].retain(also))

    def _kept_in_first(self) -> set[int]:
        """What the save in flight and the followers need kept in the first tier."""
        also = set(self._saves.base_in_flight())
        for follower in self._followers:
            also |= follower.pinned()
        return also

    # ---------------------------------------------------------------- rank 0's decisions

    def _listings(self) -> list[dict[str, list[Any]]]:
        """Rank 0: every tier's steps (all_tiers.list_tiers: a slower tier that cannot be listed
        counts as holding nothing, with a warning)."""
        return list_tiers(self._levels, stacklevel=4)

    def _ranks(self) -> Group:
        return self._ranking.group()

    def _refusal(self, step: int, metrics: Mapping[str, Any] | None,
                 metadata: Mapping[str, Any] | None) -> str | None:
        """Rank 0: why ``step`` may not be saved now (InFlight.refusal), or the refusal
        naming a run lease another job took over since it was taken."""
        lost = self._leases.lost()
        if lost is not None:
            self._leases.said()  # rank 0's: it decides whether close() says it again
            raise CheckpointLockedError(f"step {step} was not saved: {lost}")
        restored = None if self.last_restore is None else self.last_restore.get("step")
        return self._saves.refusal(self._levels, step, metrics, metadata,
                                   taken_over=restored if self._leases.taking_over else None)

    def _taken_over(self) -> str | None:
        """Collective: None while every run lease is kept; else the steps there are another
        job's: CheckpointLockedError the first time that is said, else ""."""
        lost = self._agreed(self._leases.lost_untold)
        if lost:
            raise CheckpointLockedError(f"CheckpointManager({self._named}): {lost}")
        return lost

    def at_exit(self) -> None:
        """At interpreter exit, unclosed after a save (managing/unclosed.py): say so, remove the
        memory tier's slots (host memory no step holds, no later save takes), let go of the
        run leases (silently where no save started: one refused before it began)."""
        if self._saved_here:
            log.warning("ckptio: CheckpointManager(%s) was not closed before exit: its saves "
                        "in flight were waited for, but its last retention pass, drain and "
                        "protection did not run (more steps than keep_last may remain); call "
                        "mgr.close(), or use it as `with CheckpointManager(...) as mgr:`",
                        self._named)
        try:
            for level in self._levels:
                level.drop_slots(at_exit=True)
        finally:
            self._leases.release()

    def _deferred(self, k: int) -> bool:
        """Rank 0: whether tier ``k`` kept bases back one retention pass (chains.py)."""
        return self._levels[k].deferred

    def _agreed(self, decide: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Collective: ``decide(*args, **kwargs)`` runs on rank 0, every rank gets its answer
        (managing/agreement.py); the arguments are made on every rank, so they are plain
        values the decision reads, never work of its own."""
        return self._ranking.agreed(functools.partial(decide, *args, **kwargs))


def _closed(follower: Follower, failed: CkptError | None) -> CkptError | None:
    """Close ``follower`` -> the first error of the followers closed so far (its own, unless
    an earlier one failed: that one is raised, this one logged)."""
    try:
        follower.close()
    except CkptError as exc:
        if failed is None:
            return exc
        log.warning("ckptio: closing %s also failed: %s", type(follower).__name__, exc)
    return failed


def _with_preemption(save: SavePolicy) -> SavePolicy:
    """``preemption=True``: the save policy, also due on preemption (SaveOnPreemption)."""
    if any(isinstance(p, SaveOnPreemption) for p in leaves(save)):
        return save
    members = save.policies if isinstance(save, AnyOf) else (save,)
    return AnyOf(*members, SaveOnPreemption())
