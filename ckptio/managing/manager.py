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

Owns: the public verbs (queries, save, restore, prepare, verify). Does not own: the parts they
use and their life (managing/parts.py ManagerParts, which this class extends: construction, the
save in flight up to its commit, close(), the rank-0 decisions), one checkpoint's save, load
and verify (api.py), the policies (policies/, run by managing/), the copies (managing/copy.py,
redundancy/).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ckptio.api import PARTLY_FILLED
from ckptio.distributed.dist import COORDINATOR
from ckptio.errors import (
    CheckpointNotFoundError,
    CkptError,
    SaveTimeoutError,
    StorageIOError,
    restated,
    seconds_to_wait,
)
from ckptio.managing import warn
from ckptio.managing.agreed import restore_guarded
from ckptio.managing.declare import check_step
from ckptio.managing.parts import ManagerParts
from ckptio.managing.restoring import (
    candidates,
    emptiness,
    first_only,
    incomplete,
    nothing_to_restore,
    restore_first,
    started_fresh,
    where,
)
from ckptio.managing.tier import is_memory
from ckptio.saving.handle import SaveHandle, SaveResult

__all__ = ["CheckpointManager"]

log = logging.getLogger("ckptio")


class CheckpointManager(ManagerParts):
    """Saves training steps into its first tier, keeps a bounded number in each tier, restores
    the newest loadable one (module docstring, docs/MANAGER.md). With many ranks, create and
    call it on every rank together."""

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
        return self._agreed(level.read_metadata, target)

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
        not raised yet. True without redundancy, once the save in flight committed."""
        timeout = seconds_to_wait("CheckpointManager.protected", timeout)
        left = self._saved_within(timeout)
        return left is not False and (self._guard is None or self._guard.wait(left))

    def drained(self, timeout: float | None = None) -> bool:
        """Wait until the drain has copied every due step (-> True) or ``timeout`` (-> False);
        raises, once, the first drain error not raised yet. True with one tier, and on the
        ranks not running the drain, once the save in flight committed (not within
        ``timeout``: False, like a copy still running)."""
        timeout = seconds_to_wait("CheckpointManager.drained", timeout)
        left = self._saved_within(timeout)
        return left is not False and (self._drain is None or self._drain.wait(left))

    def _saved_within(self, timeout: float | None) -> float | None | bool:
        """wait() for the save in flight, within ``timeout`` -> the seconds left (None: no
        limit), or False if it is still running then (a hung write or fsync of the first
        tier: nothing after it can be drained or protected yet; wait() names the file)."""
        started = time.monotonic()
        try:
            self.wait(timeout)
        except SaveTimeoutError:
            return False
        return None if timeout is None else max(0.0, timeout - (time.monotonic() - started))

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
        if self._closed:  # its lease, drain and protection are gone: a save would go unseen
            raise CkptError(f"step {step} was not saved: CheckpointManager({self._named}) "
                            "was closed; make a new CheckpointManager to save again (it takes "
                            "the run's lease again)")
        if not force and not self.should_save(step):
            return None
        self._said_at_exit()  # until close(): an exit after a save is said (unclosed.py)
        first = self._levels[0]
        if self.delta is not None or is_memory(self.tiers[0]):
            # a base is chosen among committed steps; a memory tier's retention runs before
            # the new save (its room then counts only the steps it keeps), which then reuses
            # the pages of the step dropped (storage/local/mapped.py)
            self._settle(step)
        self._room_for(state)
        if not self._first_leased:  # the run directory this save makes, and the slower
            # tiers' its drain will make: their incomplete steps are its drain's copies
            self._agreed(self._leases.take, range(len(self._levels)), create=True)
            self._first_leased = True
        refusal = self._agreed(self._refusal, step, metrics, metadata)
        if refusal is not None:
            raise CkptError(refusal)
        self._policy.triggers.saved(step)
        base = None if self.delta is None else self._agreed(
            first.choose_base, self.delta, step, self._long_every)
        if base is None:  # a full save: its retention reads no manifest; a delta's reads
            self._bases[step] = ()  # its manifest's bases (entries that all changed need none)
            first.saving(step, ())
        else:  # not a failed full save's of this step, retried as a delta
            self._bases.pop(step, None)
        if self._ranks().rank != COORDINATOR:  # rank 0's are stored; checked on rank 0 above
            metrics, metadata = None, None
        kwargs = {"metrics": metrics, "metadata": metadata, "allow_pickle": allow_pickle,
                  "process_group": self._process_group, "overwrite": first.is_damaged(step),
                  **({} if base is None else {"base": first.path(base)})}
        result: SaveResult | SaveHandle
        self._saved_here = True
        if not (asynchronous or lazy):
            result, committed = self._saves.save(self._ck, step, first.path(step), state,
                                                 base, kwargs)
        else:
            result, committed = self._saves.async_save(
                self._ck, step, first.path(step), state, base,
                {**kwargs, "lazy": lazy, "optimizers": optimizers, "after_step": after_step})
        for done in committed:
            self._committed(done)
        return result

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ---------------------------------------------------------------- restoring

    def restore(self, state: Any, step: int | None = None, *, required: bool = False,
                prepare: bool = True, **load_kwargs: Any) -> int | None:
        """Load the newest loadable step (or ``step``) into ``state`` in place (ckptio.load
        semantics; ``load_kwargs`` such as strict, keys, cast, per_rank_from go to it) -> the
        step restored; ``last_restore`` says from which tier and how long it took, and holds
        the load's LoadReport (``"report"``; strict=False also warns naming the keys it left
        out). Newest step first, fastest tier first, falling back on damage with one warning
        (managing/restoring.py). None if nothing was ever committed (a log line says so;
        ``required=True``: CheckpointNotFoundError instead); ``step=N`` with one tier: exactly
        that step. Whether or not it restores, it prepares the staging of async saves of
        ``state`` first, as prepare() does, unless this manager has saved already (a rollback:
        the staging stays as its saves sized it, and the restore pays for no pool dropped,
        made or faulted in). ``prepare=False``: this job's saves are synchronous, so nothing is
        prepared ahead: the load reads through a pool of its own size, faulted by its reads
        only, and a save's copies fault in what it stages. ``record``: the manifest of the newest
        (or ``step``) in tier 0, read just before: not read again. docs/MANAGER.md says the rest."""
        if state is None:
            raise CkptError("CheckpointManager.restore(state) loads in place: pass the state to "
                            "fill (for fresh tensors use ckptio.load(mgr.path(step)))")
        if "process_group" in load_kwargs:
            raise CkptError("restore(process_group=...): give it to CheckpointManager(...)")
        self.wait()
        # a rollback: the staging stays as this run's saves left it
        sizing = prepare and not self._saved_here
        planned = self._staging(state) if sizing else ([], False)  # the load reads through
        wanted = None if step is None else check_step(step)
        # listed before the load: a listing's storage error leaves the state untouched
        listings = self._agreed(self._listings) if self._lists_first(wanted) else None
        try:
            restored = self._restore(state, wanted, load_kwargs, listings)
        except StorageIOError as exc:  # not damage: no older step is tried in its place
            raise restated(exc, "restore() stopped on a storage error; the state it fills in "
                                "place may hold some of that step's tensors and keep its "
                                "previous values elsewhere: restore again before using it "
                                "(once the storage reads, or restore(state, step=N) for an "
                                "older step): ", replacing=PARTLY_FILLED) from None
        if restored is not None:
            self._report(restored, load_kwargs)
            if sizing:  # a pool that faulted in during the load is pinned now
                self._staging(None)
                planned = self._loaded_files(state, planned)
        elif step is None:
            started_fresh(self._levels, required, self._ranks().rank == COORDINATOR)
        self._slots_ahead(planned)  # after the load, which they would slow down
        return restored

    def _report(self, step: int, load_kwargs: dict[str, Any]) -> None:
        """``last_restore["report"]``: the load's LoadReport (restore returns the step); with
        strict=False, a warning naming the keys it left out (the load warns about the rest)."""
        record = self.last_restore if self.last_restore is not None else {}
        report = self._levels[int(record.get("tier", 0))].last_report
        self.last_restore = {**record, "step": step, "report": report}
        if load_kwargs.get("strict", True) or report is None or not (
                report.missing or report.unexpected):
            return
        said = [f"{what} {len(keys)} key(s) {where}: {list(keys[:8])}" for what, keys, where in (
            ("left", report.missing, "of the state as built, not in the checkpoint"),
            ("did not load", report.unexpected, "of the checkpoint, not in the state")) if keys]
        warn(f"ckptio: restore(strict=False) of step {step} {'; '.join(said)} (a layer added, "
             "removed or renamed, or a part left out of the state?); last_restore['report'] "
             "lists them all", stacklevel=3)

    def _staging(self, state: Any) -> tuple[list[int], bool]:
        """prepare(state) (None: only pin what has faulted in) -> Checkpointer.prepare's
        planned files; a failure is only logged: the load, or the first save, says what is
        wrong."""
        try:
            return self._ck.prepare(self.directory, state=state, wait=False)
        except CkptError as exc:
            log.info("ckptio: staging not prepared (%s); the first save sizes it", exc)
            return [], False

    def _loaded_files(self, state: Any, planned: tuple[list[int], bool]
                      ) -> tuple[list[int], bool]:
        """The files a save of the restored ``state`` writes: a torch optimizer has no state
        before its first step or a load, so the plan made before the load sized a resumed
        job's memory-tier slots for the model alone (no save could take them). Planned as a
        save plans (Checkpointer.planned): the first save reuses it. A failure is only
        logged, as the staging's: the slots planned before the load are made."""
        try:
            return self._ck.planned(state)
        except CkptError as exc:
            log.info("ckptio: the restored state's files not planned (%s)", exc)
            return planned

    def _slots_ahead(self, planned: tuple[list[int], bool]) -> None:
        """A memory tier's first saves' files made and mapped ahead, in the background
        (TierSteps.prepare_slots): those saves copy into resident pages from the first."""
        sizes, cuda = planned
        if sizes:
            for level in self._levels:
                level.prepare_slots(sizes, cuda)

    def _lists_first(self, step: int | None) -> bool:
        """Whether _restore() loads from the tiers' listings (not a guarded restore, nor an
        exact step of the one tier)."""
        return self._guard is None and not (step is not None and len(self._levels) == 1)

    def _restore(self, state: Any, step: int | None, load_kwargs: dict[str, Any],
                 listings: Any = None) -> int | None:
        """restore()'s load: the guarded one, an exact step, or the newest loadable of
        ``listings`` (the tiers', agreed: _lists_first())."""
        if self._guard is not None:
            record = restore_guarded(self._guard, self._levels, self._listings,
                                     self._ck.verify, state, step, first_only(load_kwargs, False))
            if record is None:
                return None
            self.last_restore = record
            return int(record["step"])
        if step is not None and len(self._levels) == 1:
            started = time.perf_counter()
            self._levels[0].load(step, state, load_kwargs)
            self._levels[0].succeeded(step)
            self.last_restore = {"step": step, "tier": 0, "location": self._levels[0].location,
                                 "seconds": time.perf_counter() - started}
            return step
        if listings is None:
            listings = self._agreed(self._listings)
        if step is None and not any(x["committed"] for x in listings):
            why = self._agreed(emptiness, self._levels, listings)
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
        nbytes = int(self._agreed(level.verify, target))
        level.succeeded(target)
        return nbytes
