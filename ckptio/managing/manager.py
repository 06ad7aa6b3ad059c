"""CheckpointManager: a training run's checkpoints, one per step, in one or several tiers: when to
save, which steps to keep, which to load.

    mgr = ckptio.CheckpointManager("ckpts", keep_last=3, save_every=500)      # one tier
    mgr = ckptio.CheckpointManager(tiers=[ckptio.Tier("shm://run", keep_last=2),
                                          ckptio.Tier("/nvme/ckpt", every=10)])
    start = mgr.restore(state) or 0          # None: nothing saved there yet (prepares too)
    for step in range(start + 1, total + 1):
        ...
        mgr.save(step, state, asynchronous=True, metrics={"loss": loss})   # None unless due
    mgr.close()

A directory is a manager with one tier. Call order: construct (every rank together), then
restore() (or prepare(), in a loop that never restores), then save() per step, then close().
Every save goes into the first tier; once it commits there the first tier's retention runs and
its followers (managing/follower.py: the protection across hosts, the drain to the slower
tiers) take the step. The specification of each choice is on the methods and in
docs/MANAGER.md.

Owns: the tiers at run time (managing/level.py, one TierSteps each), the followers, the save in
flight, the agreement across ranks (one managing/agreement.py Ranks). Does not own: one
checkpoint's save, load and verify (api.py), the policies (policies/, run by managing/), the
copies (managing/copy.py, redundancy/).
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ckptio.api import Checkpointer
from ckptio.distributed.dist import COORDINATOR, Group
from ckptio.errors import CheckpointNotFoundError, CkptError, SaveTimeoutError
from ckptio.managing.agreed import restore_guarded
from ckptio.managing.agreement import Ranks
from ckptio.managing.declare import UNSET, check_step, declare, settings_of
from ckptio.managing.delta import check_delta
from ckptio.managing.drain import Drain
from ckptio.managing.follower import Follower
from ckptio.managing.guard import Guard
from ckptio.managing.inflight import InFlight
from ckptio.managing.level import list_tiers, make_levels
from ckptio.managing.restoring import (
    candidates,
    emptiness,
    incomplete,
    nothing_to_restore,
    restore_first,
    started_fresh,
    where,
)
from ckptio.managing.route import TierRoute, resume
from ckptio.managing.tier import Tier, check_budget, is_memory, one_host, state_nbytes, step_sizes
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
from ckptio.saving.handle import SaveHandle, SaveResult
from ckptio.storage.local.runlease import RunLease
from ckptio.storage.select import checkpoint_path, scheme_of

__all__ = ["CheckpointManager"]

log = logging.getLogger("ckptio")


class CheckpointManager:
    """Saves training steps into its first tier, keeps a bounded number in each tier, restores
    the newest loadable one (module docstring, docs/MANAGER.md). With many ranks, create and
    call it on every rank together."""

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
            self._guard = Guard(self.tiers, process_group, settings.step_timeout_s,
                                settings.peer_timeout_s)
            self.tiers, process_group = self._guard.tiers, self._guard.single
        self._owns_checkpointer = checkpointer is None
        self._ck = checkpointer or Checkpointer(settings)
        self._process_group = process_group
        self._ranking = Ranks(process_group, self._ck.options,
                              checkpoint_path(self.tiers[0].location))
        self._levels = make_levels(self.tiers, declared.keeps, self._ck, self._ranking,
                                   process_group)
        self.directory = self._levels[0].directory
        # the clock and the signal are agreed by the whole job (with redundancy, the saves'
        # group is this rank alone)
        self._job = self._ranking if self._guard is None else Ranks(job_group, settings,
                                                                   self.directory)
        self._long_every = tuple(p.steps for keep in declared.keeps for p in leaves(keep)
                                 if isinstance(p, KeepEvery) and p.steps)
        self._saves = InFlight()
        self._bases: dict[int, tuple[int, ...]] = {}  # per save made: its bases (chains.py)
        self._drain: Drain | None = None
        self._followers: list[Follower] = []
        self.last_restore: dict[str, Any] | None = None  # which tier, step and seconds
        self._leases: dict[int, RunLease] = {}  # tier -> its lease (one job per local run)
        self._take_over, self._first_leased = take_over, False
        self._saved_here = False  # a save started: the staging is the one the saves sized
        try:
            self._agreed(lambda: self._take_leases(range(len(self._levels)), create=False))
            self._start(self._policy.wants_preemption, drain_rate)
        except BaseException:
            self._let_go_leases()
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
                                    self._ck.options, rate=drain_rate)
                self._followers.append(self._drain)
            self._agreed(lambda: resume(self._levels, self._drain))

    # ---------------------------------------------------------------- queries

    def should_save(self, step: int) -> bool:
        """Whether a save of ``step`` is due: as the save policy (``save_policy``: ``save=``, or
        built from save_every / save_interval_s / preemption) says, asked with rank 0's moment,
        or preemption reached. A collective unless the policy is only step intervals and no
        preemption handler is installed (managing/triggers.py)."""
        return self._policy.due(check_step(step), self._job.group)

    def reached_preemption(self, step: int) -> bool:
        """True once a preemption signal (SIGTERM) has reached any rank, from the first step
        asked after it on, the same on every rank (a collective with many ranks). The loop then
        saves ``step`` (should_save() is True for it) and exits after close(), which finishes
        the save in flight and lets the followers finish. False without a handler."""
        step = check_step(step)
        if not self._policy.triggers.preemption.installed:
            return False
        return self._policy.triggers.at(step, self._job.group())["preempted"]

    def install_preemption_handler(self, signals: Sequence[int] = (signal.SIGTERM,)) -> None:
        """Record ``signals`` (default SIGTERM) instead of dying of them, until close()
        (managing/triggers.py). Call on every rank, from the main thread."""
        triggers = self._policy.triggers
        if triggers.preemption.installed:
            return
        triggers.preemption = Preemption(signals)
        triggers.preemption.install()

    def metadata(self, step: int | None = None) -> dict[str, Any]:
        """The metrics and metadata saved with ``step`` (default: the newest committed), read
        from the manifest of the fastest tier holding it (rank 0 reads; a collective)."""
        listings = self._agreed(self._listings)
        found = candidates(listings, None if step is None else check_step(step))
        if not found:
            held = sorted({s for x in listings for s in x["committed"]})
            what = "step" if step is None else f"step {step}"
            raise CheckpointNotFoundError(f"no committed {what} in {where(self._levels)} (it "
                                          f"holds {held}): no metadata")
        target, holders = found[0]
        level = self._levels[holders[0]]
        return self._agreed(lambda: level.read_metadata(target))

    def path(self, step: int, tier: int = 0) -> str:
        """Where ``step`` is (or would be) in tier ``tier`` (0: the first)."""
        if isinstance(tier, bool) or not isinstance(tier, int) or not 0 <= tier < len(self.tiers):
            raise CkptError(f"tier={tier!r}: this manager has tiers 0..{len(self.tiers) - 1}")
        return self._levels[tier].path(check_step(step))

    def steps(self) -> list[int]:
        """Steps committed in any tier, ascending (collective with many ranks; with redundancy:
        in any tier of any rank)."""
        steps = sorted({s for x in self._agreed(self._listings) for s in x["committed"]})
        return steps if self._guard is None else self._guard.union(steps)

    def latest(self) -> int | None:
        """The newest committed step, or None (collective with many ranks)."""
        steps = self.steps()
        return steps[-1] if steps else None

    def incomplete(self) -> list[int]:
        """Steps some tier holds with no committed manifest (interrupted saves or copies, or
        ones still running, this manager's own included) and no tier holds committed. Never
        deleted by the manager."""
        return incomplete(self._agreed(self._listings))

    def status(self) -> list[dict[str, Any]]:
        """Per tier (this process's view, not a collective): location, every, the committed
        and incomplete steps, ``pinned`` (the steps kept beyond keep_last and its other
        rules, each with why: the step restored or verified last, a kept delta's base), and
        what the followers say of it (the drain: the step being
        copied, the one queued, the steps skipped, the last copies, the last error; the
        protection: how the first tier's steps are protected across hosts)."""
        said: dict[int, dict[str, Any]] = {}
        for follower in self._followers:
            for k, part in follower.status().items():
                said.setdefault(k, {}).update(part)
        return [{"tier": k, "location": tier.location, "every": tier.every, **listing,
                 "pinned": level.pins(listing["committed"]), **said.get(k, {})}
                for k, (tier, level, listing)
                in enumerate(zip(self.tiers, self._levels, self._listings()))]

    def protected(self, timeout: float | None = None) -> bool:
        """Wait until every step saved so far is protected across hosts (or given up, said in
        status()) -> True, or ``timeout`` -> False; raises, once, the first protection error
        not raised yet. True at once without redundancy."""
        self.wait()
        return True if self._guard is None else self._guard.wait(timeout)

    def drained(self, timeout: float | None = None) -> bool:
        """Wait until the drain has copied every due step (-> True) or ``timeout`` (-> False);
        raises, once, the first drain error not raised yet. True at once with one tier, and
        on the ranks not running the drain."""
        self.wait()
        return True if self._drain is None else self._drain.wait(timeout)

    # ---------------------------------------------------------------- saving

    def save(self, step: int, state: Any, *, asynchronous: bool = False, lazy: bool = False,
             optimizers: Sequence[torch.optim.Optimizer] = (),
             after_step: Sequence[torch.nn.Module | torch.Tensor] = (), force: bool = False,
             allow_pickle: bool = False, metrics: Mapping[str, Any] | None = None,
             metadata: Mapping[str, Any] | None = None) -> SaveResult | SaveHandle | None:
        """Save ``state`` as ``step`` into the first tier if ``should_save(step)`` or
        ``force``; else -> None. -> SaveResult once committed, or a SaveHandle
        (``asynchronous=True``: eager; ``lazy=True`` implies asynchronous; ``optimizers``,
        ``after_step`` as in Checkpointer.async_save). An unseen error of the previous async
        save is raised here instead. ``metrics`` (str -> number, what ``monitor`` reads) and
        ``metadata`` (str -> JSON) are stored with the step; rank 0's count. A committed step
        is never saved over (docs/MANAGER.md)."""
        step = check_step(step)
        if not force and not self.should_save(step):
            return None
        _unclosed.add(self)  # until close(): an exit after a save is said (_say_unclosed)
        first = self._levels[0]
        if is_memory(self.tiers[0]) and scheme_of(checkpoint_path(self.directory)) is None:
            others = None if self._guard is None else self._guard.for_others
            self._agreed(lambda: check_budget(  # rank 0: refuse a save the tier cannot hold
                self.tiers[0], checkpoint_path(self.directory),
                step_sizes(first.path(s) for s in first.scan()["committed"]),
                lambda: state_nbytes(state) * self._ranks().size, others))  # before a 1st step
        refusal = self._agreed(lambda: self._saves.refusal(first, step, metrics, metadata))
        if refusal is not None:
            raise CkptError(refusal)
        if not self._first_leased:  # the run directory this save makes
            self._agreed(lambda: self._take_leases([0], create=True))
            self._first_leased = True
        if self.delta is not None or is_memory(self.tiers[0]):
            # a base is chosen among committed steps; a memory tier's retention runs before
            # the new save, which then reuses the pages of the step dropped (storage/local/mapped.py)
            self._settle()
        self._policy.triggers.saved(step)
        base = None if self.delta is None else self._agreed(
            lambda: first.choose_base(self.delta, step, self._long_every))  # type: ignore[arg-type]
        if base is None:  # a full save: its retention reads no manifest; a delta's reads
            self._bases[step] = ()  # its manifest's bases (entries that all changed need none)
        if self._ranks().rank != COORDINATOR:  # rank 0's are stored; checked on rank 0 above
            metrics, metadata = None, None
        kwargs = {"metrics": metrics, "metadata": metadata, "allow_pickle": allow_pickle,
                  "process_group": self._process_group, "overwrite": first.is_damaged(step),
                  **({} if base is None else {"base": first.path(base)})}
        result: SaveResult | SaveHandle
        self._saved_here = True
        if not (asynchronous or lazy):
            result, committed = self._saves.save(self._ck, step, first.path(step), state, kwargs)
        else:
            result, committed = self._saves.async_save(
                self._ck, step, first.path(step), state, base,
                {**kwargs, "lazy": lazy, "optimizers": optimizers, "after_step": after_step})
        for done in committed:
            self._committed(done)
        return result

    def wait(self, timeout: float | None = None) -> SaveResult | None:
        """Wait for the async save in flight (None if there is none), then apply the first
        tier's retention. Its error is raised here (and not again by close() or the next
        save). ``timeout``: SaveTimeoutError if it has not finished within that many seconds,
        naming the step, the rank and the file it waits for (it stays in flight: wait again).
        The followers are not waited for (drained(), protected()), except once preemption is
        reached: then the newest step goes on to every slower tier, unpaced, and wait()
        returns once it is durable there (docs/MANAGER.md, Preemption)."""
        result, committed = self._saves.wait(timeout)
        for done in committed:
            self._committed(done)
        if self._drain is not None and self._policy.triggers.preempted:
            self._drain.final()
            self._drain.wait()
        return result

    def _settle(self) -> None:
        """The async save in flight finishes (its unseen error raised here); committed, its
        retention runs."""
        for done in self._saves.settle(self._ck):
            self._committed(done)

    def close(self, timeout: float | None = None) -> None:
        """wait(), let the followers finish (their first error not raised yet is raised here,
        once), run the retention their pins and the delta chains held back, finish every
        tier's removals, put back the signal handlers, free the Checkpointer if the manager
        made it. ``timeout``: as wait()'s, for the save in flight; then nothing is closed
        (close() again later)."""
        timed_out = False
        try:
            self.wait(timeout)
        except SaveTimeoutError:
            timed_out = True
            raise
        finally:
            if not timed_out:
                self._close()

    def _close(self) -> None:
        """close() after its wait(): the followers, the last retention, the removals."""
        _unclosed.discard(self)
        self._policy.triggers.preemption.uninstall()
        try:
            for follower in self._followers:
                follower.close()
            if self._ranking.gone():  # the job tore its process group down (a rank lost):
                return  # nothing to agree on; the next manager's first save runs retention
            if len(self._levels) > 1:  # what the drain's pins kept past the last commit
                self._retain(0)
            for k in range(len(self._levels)):  # bases kept back one pass (chains.py)
                if self._agreed(lambda: self._levels[k].deferred):
                    self._retain(k)
        finally:
            try:
                for level in self._levels:
                    level.join_removal()
                    level.drop_slots()
                if self._owns_checkpointer:
                    self._ck.close()
            finally:
                self._let_go_leases()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _committed(self, step: int) -> None:
        """Collective, after a save of ours committed in the first tier: its retention runs
        (rank 0 hides the steps it drops), then each follower takes the step."""
        self._levels[0].saved(step, self._bases.pop(step, None))
        self._bases = {s: b for s, b in self._bases.items() if s > step}  # failed saves' too
        self._retain(0)
        for follower in self._followers:
            follower.submit(step)

    def _retain(self, k: int) -> list[int]:
        """Collective: tier ``k``'s retention pass (rank 0), keeping what the save in flight
        and the followers need in the first tier."""
        also: set[int] = set()
        if k == 0:
            also = set(self._saves.base_in_flight())
            for follower in self._followers:
                also |= follower.pinned()
        return list(self._agreed(lambda: self._levels[k].retain(also)))

    # ---------------------------------------------------------------- restoring

    def restore(self, state: Any, step: int | None = None, *, required: bool = False,
                **load_kwargs: Any) -> int | None:
        """Load the newest loadable step (or ``step``) into ``state`` in place (ckptio.load
        semantics; ``load_kwargs`` such as strict, keys, cast, per_rank_from go to it) -> the
        step restored; ``last_restore`` says from which tier and how long it took. Newest
        step first, fastest tier first, falling back on damage with one warning
        (managing/restoring.py). None if nothing was ever committed (a log line says so;
        ``required=True``: CheckpointNotFoundError instead); ``step=N`` with one tier: exactly
        that step. Whether or not it restores, it prepares the staging of async saves of
        ``state`` first, as prepare() does, unless this manager has saved already (a rollback:
        the staging stays as its saves sized it, and the restore pays for no pool dropped,
        made or faulted in). docs/MANAGER.md says the rest."""
        if state is None:
            raise CkptError("CheckpointManager.restore(state) loads in place: pass the state to "
                            "fill (for fresh tensors use ckptio.load(mgr.path(step)))")
        if "process_group" in load_kwargs:
            raise CkptError("restore(process_group=...): give it to CheckpointManager(...)")
        self.wait()
        sizing = not self._saved_here  # a rollback: the staging stays as this run's saves left it
        planned = self._staging(state) if sizing else ([], False)  # the load reads through
        restored = self._restore(state, None if step is None else check_step(step), load_kwargs)
        if restored is not None:
            if sizing:  # a pool that faulted in during the load is pinned now
                self._staging(None)
        elif step is None:
            started_fresh(self._levels, required, self._ranks().rank == COORDINATOR)
        self._slots_ahead(planned)  # after the load, which they would slow down
        return restored

    def _staging(self, state: Any) -> tuple[list[int], bool]:
        """prepare(state) (None: only pin what has faulted in) -> Checkpointer.prepare's
        planned files; a failure is only logged: the load, or the first save, says what is
        wrong."""
        try:
            return self._ck.prepare(self.directory, state=state, wait=False)
        except CkptError as exc:
            log.info("ckptio: staging not prepared (%s); the first save sizes it", exc)
            return [], False

    def _slots_ahead(self, planned: tuple[list[int], bool]) -> None:
        """A memory tier's first saves' files made and mapped ahead, in the background
        (TierSteps.prepare_slots): those saves copy into resident pages from the first."""
        sizes, cuda = planned
        if sizes:
            for level in self._levels:
                level.prepare_slots(sizes, cuda)

    def _restore(self, state: Any, step: int | None, load_kwargs: dict[str, Any]) -> int | None:
        """restore()'s load: the guarded one, an exact step, or the newest loadable."""
        if self._guard is not None:
            record = restore_guarded(self._guard, self._levels, self._listings,
                                     self._ck.verify, state, step, load_kwargs)
            if record is None:
                return None
            self.last_restore = record
            return int(record["step"])
        if step is not None and len(self._levels) == 1:
            self._levels[0].load(step, state, load_kwargs)
            self._levels[0].succeeded(step)
            return step
        listings = self._agreed(self._listings)
        if step is None and not any(x["committed"] for x in listings):
            why = self._agreed(lambda: emptiness(self._levels, listings))
            nothing_to_restore(self._levels, listings, why, stacklevel=4)
            return None
        restored = restore_first(self._levels, listings, state, step, load_kwargs,
                                 stacklevel=4)
        self.last_restore = restored.record()
        log.info("ckptio: restored step %d from tier %d (%s) in %.3f s", restored.step,
                 restored.tier, restored.location, restored.seconds)
        return restored.step

    def prepare(self, state: Any, *, wait: bool = False) -> None:
        """Size the staging of async saves of ``state`` (within Options.host_budget_bytes) and
        start faulting it in on the pool's own thread; returns without waiting for that, and
        a save that comes first waits only for the buffers it needs, so the first save of the
        job costs what later ones do; a memory tier's first saves' files are made and mapped
        ahead too, in the background. ``wait``: return once all of it is done (at startup,
        before the loop). restore() does it; call it in a loop that never restores (this
        rank only, not a collective)."""
        self._slots_ahead(self._ck.prepare(self.directory, state=state, wait=wait))
        if wait:
            for level in self._levels:
                level.join_removal()

    def verify(self, step: int | None = None) -> int:
        """Read back every byte of ``step`` (default: the newest committed) in the fastest
        tier holding it and check it; on success it counts as verified for retention. -> bytes
        read (rank 0 reads)."""
        self.wait()
        listings = self._agreed(self._listings)
        found = candidates(listings, None if step is None else check_step(step))
        if not found and step is not None and len(self._levels) == 1:
            found = [(check_step(step), [0])]  # the load's own error says what is wrong
        if not found:
            what = "committed step" if step is None else f"committed step {step}"
            raise CheckpointNotFoundError(f"no {what} in {where(self._levels)} to verify")
        target, holders = found[0]
        level = self._levels[holders[0]]
        nbytes = int(self._agreed(lambda: level.verify(target)))
        level.succeeded(target)
        return nbytes

    # ---------------------------------------------------------------- rank 0's decisions

    def _listings(self) -> list[dict[str, list[Any]]]:
        """Rank 0: every tier's steps (level.list_tiers: a slower tier that cannot be listed
        counts as holding nothing, with a warning)."""
        return list_tiers(self._levels, stacklevel=4)

    def _ranks(self) -> Group:
        return self._ranking.group()

    def _take_leases(self, tiers: Sequence[int], *, create: bool) -> None:
        """Rank 0: these local tiers' run leases (those not held yet), or the refusal naming the
        job holding one (storage/local/runlease.py)."""
        for k in tiers:
            if k not in self._leases:
                lease = self._levels[k].lease(self._take_over, create=create)
                if lease is not None:
                    self._leases[k] = lease

    def _let_go_leases(self) -> None:
        for lease in self._leases.values():
            lease.release()
        self._leases.clear()

    def _agreed(self, decide: Callable[[], Any]) -> Any:
        """Collective: ``decide()`` runs on rank 0, every rank gets its answer (managing/agreement.py)."""
        return self._ranking.agreed(decide)


def _with_preemption(save: SavePolicy) -> SavePolicy:
    """``preemption=True``: the save policy, also due on preemption (SaveOnPreemption)."""
    if any(isinstance(p, SaveOnPreemption) for p in leaves(save)):
        return save
    members = save.policies if isinstance(save, AnyOf) else (save,)
    return AnyOf(*members, SaveOnPreemption())


_unclosed: weakref.WeakSet[CheckpointManager] = weakref.WeakSet()


def _say_unclosed() -> None:
    """At interpreter exit: each manager that saved and was never closed, named (its saves in
    flight finish, by api.py's own exit hook, but close()'s last retention pass and its
    followers' do not)."""
    for mgr in list(_unclosed):
        log.warning("ckptio: CheckpointManager(%s) was not closed before exit: its saves "
                    "finished, but its last retention pass, drain and protection did not run "
                    "(more steps than keep_last may remain); call mgr.close(), or use it as "
                    "`with CheckpointManager(...) as mgr:`", mgr.directory)


atexit.register(_say_unclosed)

