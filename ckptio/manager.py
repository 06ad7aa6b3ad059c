"""A directory (or S3 prefix) of checkpoints, one per training step: when to save, which to
keep, which to load.

    mgr = ckptio.CheckpointManager("ckpts", keep_last=3, keep_every=10_000, save_every=500,
                                   save_interval_s=1800, preemption=True)
    start = mgr.restore(state) or 0                # None: nothing saved there yet
    for step in range(start + 1, total_steps + 1):
        ...
        mgr.save(step, state, asynchronous=True,   # None unless due: step % save_every == 0,
                 metrics={"loss": loss})           # 30 min since the last save, or SIGTERM
        if mgr.reached_preemption(step):           # SIGTERM seen (by any rank): step is saved
            break
    mgr.close()                                    # waits for the last save, applies retention

The best k: ``CheckpointManager(d, keep_last=1, keep_best=3, monitor="val_loss")`` and
``save(step, state, metrics={"val_loss": v})``. ``metrics`` and ``metadata`` are stored in the
step's manifest (stepmeta.py), read back without the tensors by ``mgr.metadata(step)`` or
``ckptio.read_metadata(path)``.

With ``tiers=[ckptio.Tier("shm://run", ...), ckptio.Tier("/nvme/ckpt", every=10), ...]`` it
returns a tiered manager instead (tiering/manager.py: host memory first, drained in the
background to the slower tiers, restored from the fastest verified copy).

Layout: ``<directory>/step-<N>`` (N without leading zeros), each an ordinary ckptio checkpoint;
``directory`` may be ``s3://bucket/prefix`` (steps ``s3://bucket/prefix/step-<N>``). A step is
committed when its Store holds a committed manifest (storage.steps.is_committed). Each step is
reached through its Store (api.store_for); the root of the steps (listing step-<N>, hiding a
dropped step, removing it) is a stepdir.StepRoot, outside the per-checkpoint Store contract:
stepdir/local.py for a directory, stepdir/s3.py for a prefix.

Owns: naming and listing the step directories; the interval policy; retention (which committed
steps to delete, and deleting them crash-safely); choosing the step to restore and falling back
past damaged ones; agreeing on all of that across ranks. Does not own: saving, loading and
verifying one checkpoint (Checkpointer, api.py) or the commit protocol (storage/).

Choices:
- Retention (managing/retention.py says exactly what is kept) runs only after a save of ours
  has committed (sync: on return; async: in wait(), the next save() or close(), as SaveHandle
  has no done-callback), so a failed save never costs an older step; after close() nothing but
  the kept steps is left. Disk: with async saves step N-1's retention runs when save(N) starts,
  so up to keep_last + 2 step directories exist at once (keep_last kept, the one being written,
  the one dropped, until its background removal ends); sync saves: keep_last + 1, and + 1
  while a removal is still running; plus the steps kept by the other rules. A dropped
  step is first hidden from the listing (a directory: renamed to ``.deleting-step-<N>-<hex>``,
  the directory fsynced; a prefix: a marker object ``step-<N>/.deleting``, then its manifest
  deleted), and only then removed, in a thread joined by the next retention and close(): a
  kill never leaves a half-deleted step listed, and the next retention finishes such leftovers.
  A save into a step whose removal is pending (a marker) finishes that removal first.
- Only real directories (prefixes) named ``step-<N>`` and our hidden leftovers are ever
  deleted. Incomplete steps (no manifest: an interrupted save, or one still running elsewhere)
  never are: incomplete() lists them, restore() passes them with a warning, a save of that step
  saves over them.
- A committed step is never saved over (CkptError naming it), except one restore() found
  damaged in this process: the atomic commit replaces it safely.
- restore() with nothing committed (no directory, an empty one, or only incomplete steps, with
  a warning naming them) returns None. A location holding something else (a checkpoint not
  named step-<N>, DCP, torch.save files) raises CheckpointNotFoundError saying what; committed
  steps that are all damaged raise CorruptCheckpointError.
- restore() falls back on damage only (CorruptCheckpointError and ManifestError, a missing or
  truncated data file, IncompleteCheckpointError, a vanished directory). Anything else (a
  StateMismatchError is the caller's bug; an I/O error) is raised at once. A failed attempt may
  have filled part of ``state``: with ``strict=False`` or ``keys=``, a key only the damaged step
  holds keeps what it got from it.
- A save is due when ``step % save_every == 0``, or ``save_interval_s`` have passed since the
  last save started, or a preemption signal was seen (managing/triggers.py).
- Many ranks (torch.distributed initialised, or ``process_group``): every method but
  should_save() and path() is a collective; should_save() is one too with a clock or a
  preemption handler (one all-gather per step, reused by save() and reached_preemption() for
  that step: ask at the same steps on every rank). Rank 0 lists, decides and broadcasts
  (managing/ranks.py); only rank 0 hides and deletes; rank 0's clock, metrics and metadata are
  the ones that count (give every rank the same metrics: an all-reduced loss); a signal to any
  rank preempts all. After a failed load the ranks all-gather why, and all fall back together
  (damage seen by one rank makes the others raise RankFailedError).
- Deltas (``delta=ckptio.DeltaPolicy(...)``, managing/delta.py): each save is a delta against
  the newest full committed step or a full one, as the policy says (rank 0 decides among the
  committed steps; an async save still running is waited for first, as the Checkpointer would).
  ``compression=`` sets Options.compression of its saves. Retention keeps the base of every
  kept step and of the save in flight, and drops a base only after its last delta
  (managing/chains.py); restore() names a delta's base when it passes over it.
Not safe for concurrent use from several threads.
"""

from __future__ import annotations

import logging
import operator
import os
import signal
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ckptio import stepmeta
from ckptio.api import Checkpointer
from ckptio.distributed.dist import COORDINATOR, Group
from ckptio.errors import (CheckpointNotFoundError, CkptError, CorruptCheckpointError,
                           IncompleteCheckpointError)
from ckptio.format.manifest import MANIFEST_NAME, decode
from ckptio.format.types import Manifest
from ckptio.managing import warn
from ckptio.managing.chains import Chains
from ckptio.managing.delta import DeltaPolicy, check_delta, choose_base, with_compression
from ckptio.managing.ranks import Ranks
from ckptio.managing.retention import Retention, StepMetrics
from ckptio.managing.triggers import Preemption, SaveClock, Triggers
from ckptio.options import Options
from ckptio.saving.handle import SaveHandle, SaveResult
from ckptio.storage.select import root_for, store_for
from ckptio.storage.steproot import is_empty

__all__ = ["CheckpointManager"]

log = logging.getLogger("ckptio")
_UNSET: Any = object()  # save_every not given: 1, or None (time only) with save_interval_s


class CheckpointManager:
    """Saves training steps into ``directory/step-<N>``, keeps a bounded number, restores the
    newest loadable one. See the module docstring for the policies; with many ranks, create and
    call it on every rank together."""

    def __new__(cls, directory: str | os.PathLike[str] | None = None, *args: Any,
                tiers: Any = None, **kwargs: Any) -> Any:
        """``CheckpointManager(tiers=[ckptio.Tier(...), ...])`` makes a tiered manager
        (tiering/manager.py): host memory first, drained to disk and object storage."""
        if tiers is None or cls is not CheckpointManager:
            return super().__new__(cls)
        if directory is not None or args:
            raise CkptError("CheckpointManager(directory, tiers=...): give a directory or "
                            "tiers, not both (a directory is one tier: ckptio.Tier(directory))")
        from ckptio.tiering.manager import TieredManager

        return TieredManager(tiers, **kwargs)

    def __init__(self, directory: str | os.PathLike[str] | None = None, *,
                 keep_last: int | None = 3, keep_every: int | None = None,
                 keep_best: int | None = None, monitor: str | None = None, mode: str = "min",
                 keep_without_metric: bool = False, save_every: int | None = _UNSET,
                 save_interval_s: float | None = None, preemption: bool = False,
                 options: Options | None = None, checkpointer: Checkpointer | None = None,
                 process_group: Any = None, tiers: None = None,
                 delta: DeltaPolicy | bool | None = None, compression: str | None = None) -> None:
        if directory is None:
            raise CkptError("CheckpointManager(): give the directory of the steps, or "
                            "tiers=[ckptio.Tier(...), ...]")
        self.retention = Retention.checked(
            keep_last=keep_last, keep_every=keep_every, keep_best=keep_best, monitor=monitor,
            mode=mode, keep_without_metric=keep_without_metric)
        self.keep_last, self.keep_every = keep_last, keep_every
        self.save_every = _save_every(save_every, save_interval_s)
        clock = None if save_interval_s is None else SaveClock(save_interval_s)
        if not isinstance(preemption, bool):
            raise CkptError(f"CheckpointManager(preemption={preemption!r}): True installs a "
                            "SIGTERM handler (see reached_preemption)")
        self._triggers = Triggers(clock, Preemption())
        if options is not None and checkpointer is not None:
            raise CkptError("CheckpointManager(options=..., checkpointer=...): give one of them; "
                            "a Checkpointer already has its options")
        if checkpointer is not None:
            options = checkpointer.options
        options = with_compression(options or Options.from_env(), compression,
                                   checkpointer is not None)
        self._root = root_for(directory, options)
        self.directory = self._root.location
        self._owns_checkpointer = checkpointer is None
        self._ck = checkpointer if checkpointer is not None else Checkpointer(options)
        self._process_group = process_group
        self._ranking = Ranks(process_group, self._ck.options, self.directory)
        self._pending: tuple[int, SaveHandle] | None = None  # an async save of ours
        self._verified: int | None = None  # newest step restore() or verify() succeeded on
        self._damaged: set[int] = set()  # committed steps restore() found damaged
        self._removal: threading.Thread | None = None
        # delta checkpoints (managing/delta.py, managing/chains.py)
        self.delta = check_delta(delta)
        self._chains = Chains(self._manifest, self.directory)
        self._long_every: tuple[int, ...] = (keep_every,) if keep_every else ()
        self._saving_base: int | None = None  # the base of the delta save in flight
        self._deltas_made: dict[int, int] = {}  # rank 0: base -> delta saves started against it
        self._metrics = StepMetrics(  # rank 0: each step's monitored metric
            lambda step: stepmeta.read_metadata(self.path(step), self._ck.options), self.directory)
        if preemption:
            try:
                self.install_preemption_handler()
            except CkptError:
                if self._owns_checkpointer:
                    self._ck.close()
                raise
        # set by a tiered manager (tiering/manager.py) that builds on this one per tier:
        self._after_commit: Callable[[int], None] | None = None  # a step of ours committed
        self._also_keep: Callable[[], set[int]] | None = None  # steps retention keeps too

    # ---------------------------------------------------------------- queries

    def should_save(self, step: int) -> bool:
        """Whether a save of ``step`` is due: ``step % save_every == 0``, or ``save_interval_s``
        since the last save started (rank 0's clock), or preemption reached. With a clock or
        a preemption handler, a collective (module docstring)."""
        step = _check_step(step)
        if self.save_every is not None and step % self.save_every == 0:
            return True
        if not self._triggers.active():
            return False
        due = self._triggers.at(step, self._ranks())
        return due["time"] or due["preempted"]

    def reached_preemption(self, step: int) -> bool:
        """True once a preemption signal (SIGTERM) has reached any rank, from the first step
        asked after it on, the same on every rank (a collective with many ranks). The loop then
        saves ``step`` (should_save() is True for it: ``save()`` takes it) and exits after
        close(), which finishes an async save in flight. False without a handler."""
        step = _check_step(step)
        if not self._triggers.preemption.installed:
            return False
        return self._triggers.at(step, self._ranks())["preempted"]

    def install_preemption_handler(self, signals: Sequence[int] = (signal.SIGTERM,)) -> None:
        """Record ``signals`` (default SIGTERM) instead of dying of them, until close()
        (managing/triggers.py). Call on every rank, from the main thread."""
        if self._triggers.preemption.installed:
            return
        self._triggers.preemption = Preemption(signals)
        self._triggers.preemption.install()

    def metadata(self, step: int | None = None) -> dict[str, Any]:
        """The metrics and metadata saved with ``step`` (default: the newest committed), read
        from its manifest only (stepmeta.read_metadata; rank 0 reads, a collective)."""
        committed = self.steps()
        target = (committed[-1] if committed else None) if step is None else _check_step(step)
        if target is None:
            raise CheckpointNotFoundError(f"no committed step in {self.directory}: no metadata")
        if target not in committed:
            raise CheckpointNotFoundError(f"no committed step {target} in {self.directory} "
                                          f"(it holds {committed}): no metadata")
        return self._agreed(lambda: stepmeta.read_metadata(self.path(target), self._ck.options))

    def path(self, step: int) -> str:
        """The directory (or s3:// prefix) of ``step`` (whether or not it exists)."""
        return self._root.path(_check_step(step))

    def steps(self) -> list[int]:
        """Committed steps, ascending (collective with many ranks)."""
        return list(self._agreed(self._root.scan)["committed"])

    def latest(self) -> int | None:
        """The newest committed step, or None (collective with many ranks)."""
        steps = self.steps()
        return steps[-1] if steps else None

    def incomplete(self) -> list[int]:
        """Steps (directories, prefixes) with no committed manifest: interrupted saves, or saves
        still running (this manager's own async save included). Never deleted by the manager."""
        return list(self._agreed(self._root.scan)["incomplete"])

    # ---------------------------------------------------------------- saving

    def save(self, step: int, state: Any, *, asynchronous: bool = False, lazy: bool = False,
             optimizers: Sequence[torch.optim.Optimizer] = (),
             after_step: Sequence[torch.nn.Module | torch.Tensor] = (), force: bool = False,
             allow_pickle: bool = False, metrics: Mapping[str, Any] | None = None,
             metadata: Mapping[str, Any] | None = None) -> SaveResult | SaveHandle | None:
        """Save ``state`` as ``step`` if ``should_save(step)`` or ``force``; else -> None.

        -> SaveResult once committed, or a SaveHandle (``asynchronous=True``: eager; ``lazy=True``
        implies asynchronous; ``optimizers`` and ``after_step`` as in Checkpointer.async_save).
        An unseen error of the previous async save is raised here instead, and this save does
        not start. ``metrics`` (str -> number,
        what ``monitor`` reads) and ``metadata`` (str -> JSON) are stored with the step
        (stepmeta.py); rank 0's are the ones stored.
        """
        step = _check_step(step)
        if not force and not self.should_save(step):
            return None
        refusal = self._agreed(lambda: self._refusal(step, metrics, metadata))
        if refusal is not None:
            raise CkptError(refusal)
        if self.delta is not None and self._pending is not None:
            self._settle_pending()  # a base is chosen among committed steps
        self._triggers.saved(step)
        base = None if self.delta is None else self._agreed(lambda: self._choose_base(step))
        if self._ranks().rank != COORDINATOR:  # rank 0's are stored; checked on rank 0 above
            metrics, metadata = None, None
        previous, path, group = self._pending, self.path(step), self._process_group
        extra = {"metrics": metrics, "metadata": metadata,
                 **({} if base is None else {"base": self.path(base)})}
        self._saving_base = base
        try:  # either call first settles the previous save (raising its unseen error)
            if not (asynchronous or lazy):
                result = self._ck.save(state, path, allow_pickle=allow_pickle, process_group=group,
                                       **extra)
            else:
                handle = self._ck.async_save(state, path, lazy=lazy, optimizers=optimizers,
                                             after_step=after_step, allow_pickle=allow_pickle,
                                             process_group=group, **extra)
        finally:
            if previous is not None and self._pending is previous and previous[1].done():
                self._pending = None
        if not (asynchronous or lazy):
            self._committed(step)
            return result
        self._pending = (step, handle)
        if previous is not None and _committed_ok(previous[1]):
            self._committed(previous[0])
        return handle

    def _refusal(self, step: int, metrics: Mapping[str, Any] | None,
                 metadata: Mapping[str, Any] | None) -> str | None:
        """Rank 0: why ``step`` may not be saved now, or None; a CkptError for bad metrics or
        metadata. Finishes a removal of ``step`` still pending there first (an S3 marker would
        hide the new checkpoint)."""
        stepmeta.encode(metrics, metadata)
        path, pending = self.path(step), self._pending
        if pending is not None and pending[0] == step and not pending[1].done():
            return f"step {step} is being saved already ({path}): wait() for it, or save another"
        finish = self._root.removal(step)
        if finish is not None:
            self._join_removal()  # it may be removing this very step
            finish()
        if step in self._damaged or not self._root.is_committed(step):
            return None
        return (f"step {step} already has a committed checkpoint at {path}; steps are never saved "
                f"over: save under another step number, or remove {path} first to replace it")

    def _settle_pending(self) -> None:
        """The async save in flight finishes (as the Checkpointer's next save would wait for
        it, on every rank alike), its unseen error raised here (this save does not start);
        committed, its retention runs."""
        pending = self._pending
        assert pending is not None  # internal: called only with a save in flight
        try:
            self._ck._settle()
        finally:
            self._pending = None
        if _committed_ok(pending[1]):
            self._committed(pending[0])

    def _choose_base(self, step: int) -> int | None:
        """Rank 0: the base of a delta save of ``step``, or None: a full save (delta.py)."""
        assert self.delta is not None  # internal: called only with a policy
        base = choose_base(self.delta, step, self._root.scan()["committed"], self._chains,
                           self._damaged, self._long_every, self._deltas_made)
        if base is not None:
            self._deltas_made[base] = self._deltas_made.get(base, 0) + 1
        return base

    def _manifest(self, step: int) -> Manifest:
        """``step``'s decoded manifest (chains.py reads each step's link from it once)."""
        store = store_for(self.path(step), self._ck.options)
        return decode(store.read_manifest(), store.path_of(MANIFEST_NAME))

    def wait(self) -> SaveResult | None:
        """Wait for the async save in flight (None if there is none), then apply retention.
        Its error is raised here (and not again by close() or the next save)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        result = pending[1].wait()
        self._committed(pending[0])
        return result

    def close(self) -> None:
        """wait(), finish removing old steps, put back the signal handlers a preemption
        handler replaced, and free the Checkpointer if the manager made it."""
        try:
            self.wait()
            self._drop_deferred()
        finally:
            self._triggers.preemption.uninstall()
            self._join_removal()
            if self._owns_checkpointer:
                self._ck.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ---------------------------------------------------------------- retention

    def _committed(self, step: int) -> list[int]:
        """Collective, after a save of ours committed: rank 0 hides the steps the policy drops
        and removes them in the background. -> the steps dropped (the same on every rank)."""
        self._damaged.discard(step)
        self._metrics.forget(step)  # a damaged step saved again: read its metric anew
        self._chains.forget(step)
        self._saving_base = None
        dropped = list(self._agreed(self._drop_old))
        if self._after_commit is not None:
            self._after_commit(step)
        return dropped

    def _drop_old(self) -> list[int]:
        self._join_removal()  # one removal at a time: it may still hold hidden directories
        hidden = [step for step in self._doomed(self._root.scan()["committed"])
                  if self._root.hide(step)]
        removal = self._root.removal()  # None until the hiding is durable
        if removal is not None:
            self._removal = threading.Thread(target=removal, name="ckptio-retention")
            self._removal.start()  # not a daemon: a removal running at exit is finished
        if hidden:
            log.info("ckptio: retention removes steps %s from %s", hidden, self.directory)
        return hidden

    def _doomed(self, committed: list[int]) -> list[int]:
        """The committed steps the policy does not keep."""
        also = {s for s in (self._verified, self._saving_base) if s is not None}
        if self._also_keep is not None:
            also.update(self._also_keep())
        values: dict[int, float | None] = {}
        if self.retention.monitor is not None:
            values, unreadable = self._metrics.of(committed, self.retention.monitor)
            also.update(unreadable)
        keep = self._chains.closure(committed, self.retention.kept(committed, values, also))
        return self._chains.doomed(committed, keep)  # a base goes with or after its deltas

    def _drop_deferred(self) -> None:
        """Collective: the retention pass a base kept back for (chains.py), once its deltas'
        removal is durable."""
        if self._agreed(lambda: self._chains.deferred):
            self._agreed(self._drop_old)  # joins the removal first

    def _join_removal(self) -> None:
        if self._removal is not None:
            self._removal.join()
            self._removal = None

    # ---------------------------------------------------------------- restoring

    def restore(self, state: Any, step: int | None = None, **load_kwargs: Any) -> int | None:
        """Load a step into ``state`` in place (ckptio.load semantics; ``load_kwargs`` such as
        strict, keys, cast, per_rank_from go to it) -> the step restored.

        ``step=None``: the newest committed step; if it is damaged (or newer step directories
        are incomplete) falls back to the previous one, with a warning naming each step passed
        over and why. None if nothing was ever committed there (module docstring): the loop
        starts from scratch. ``step=N``: exactly that step, no fallback.
        """
        if state is None:
            raise CkptError("CheckpointManager.restore(state) loads in place: pass the state to "
                            "fill (for fresh tensors use ckptio.load(mgr.path(step)))")
        if "process_group" in load_kwargs:
            raise CkptError("restore(process_group=...): give it to CheckpointManager(...)")
        self.wait()
        if step is not None:
            step = _check_step(step)
            self._ck.load(self.path(step), state, process_group=self._process_group, **load_kwargs)
            self._succeeded(step)
            return step
        plan = self._agreed(self._restore_plan)
        if not any(committed for _, committed in plan["steps"]):
            return self._nothing_to_restore(plan)
        passed: list[str] = []
        for candidate, committed in plan["steps"]:
            why = self._try_load(candidate, state, load_kwargs) if committed else (
                f"incomplete: no committed {MANIFEST_NAME} (an interrupted save, or one running)")
            if why is None:
                self._passed_over(candidate, passed)
                self._succeeded(candidate)
                return int(candidate)
            passed.append(f"step {candidate}{self._chain_note(candidate)}: {why}")
            if committed:
                self._damaged.add(candidate)
        damaged = any(committed for _, committed in plan["steps"])
        error = CorruptCheckpointError if damaged else IncompleteCheckpointError
        raise error(f"no step in {self.directory} could be restored: {'; '.join(passed)}. The "
                    "directories are left as they are; restore(state, step=N) loads one step")

    def _nothing_to_restore(self, plan: dict[str, Any], stacklevel: int = 3) -> None:
        """No committed step: None (a warning naming incomplete steps), unless the location
        holds something else: CheckpointNotFoundError saying what."""
        if plan["missing"] is not None and not plan["missing"]["empty"]:
            raise CheckpointNotFoundError(plan["missing"]["why"])
        if plan["steps"]:
            warn(f"ckptio: nothing to restore in {self.directory}: no step was ever committed "
                 f"there; incomplete steps {sorted(s for s, _ in plan['steps'])} (interrupted "
                 "saves) are left as they are, a save of the same step replaces one",
                 stacklevel=stacklevel)

    def verify(self, step: int | None = None) -> int:
        """Read back every byte of ``step`` (default: the newest committed) and check it; on
        success it counts as verified for retention. -> bytes read (rank 0 reads)."""
        self.wait()
        target = self.latest() if step is None else _check_step(step)
        if target is None:
            raise CheckpointNotFoundError(f"no committed step in {self.directory} to verify")
        nbytes = int(self._agreed(lambda: self._ck.verify(self.path(target))))
        self._succeeded(target)
        return nbytes

    def _succeeded(self, step: int) -> None:
        self._verified = step if self._verified is None else max(self._verified, step)
        self._damaged.discard(step)

    def _restore_plan(self) -> dict[str, Any]:
        """Rank 0: every step, newest first, with whether it is committed."""
        listing = self._root.scan()
        steps = sorted([[s, True] for s in listing["committed"]]
                       + [[s, False] for s in listing["incomplete"]], reverse=True)
        if steps:
            return {"steps": steps, "missing": None}
        why = self._root.nothing_here()
        return {"steps": steps, "missing": {"why": why, "empty": is_empty(why)}}

    def _try_load(self, step: int, state: Any, load_kwargs: dict[str, Any]) -> str | None:
        """Load ``step``; -> None, or why it is damaged (the same on every rank). Other errors
        are raised (on every rank: the load is a collective)."""
        try:
            self._ck.load(self.path(step), state, process_group=self._process_group, **load_kwargs)
        except Exception as exc:
            damaged, why = self._ranking.verdict(exc)
            if not damaged:
                raise
            return why
        return None

    def _chain_note(self, step: int) -> str:
        """`` (a delta against base step B)`` for a delta step, else '' (its manifest unread)."""
        try:
            self._chains.link(step)
        except CkptError:
            return ""
        return self._chains.describe(step)

    def _passed_over(self, step: int, passed: list[str]) -> None:
        if passed:
            warn(f"ckptio: restored step {step} from {self.directory}, not a newer one: "
                  f"{'; '.join(passed)}. Those directories are left in place; a later save of "
                  "the same step replaces one", stacklevel=3)  # restore()'s caller

    # ---------------------------------------------------------------- ranks

    def _ranks(self) -> Group:
        return self._ranking.group()

    def _agreed(self, decide: Callable[[], Any]) -> Any:
        """Collective: ``decide()`` runs on rank 0, every rank gets its answer (ranks.py)."""
        return self._ranking.agreed(decide)


# -------------------------------------------------------------------- small helpers


def _committed_ok(handle: SaveHandle) -> bool:
    """Whether a finished async save committed. Its error, if any, has been reported already:
    async_save raises an error nobody has seen, so reaching here means the caller's own wait()
    raised it. It is only looked at here, not raised a second time."""
    if not handle.done():
        return False
    try:
        handle.wait()
    except Exception:  # noqa: BLE001 - reported already (see above)
        return False
    return True


def _check_step(step: Any) -> int:
    try:
        value = operator.index(step)
    except TypeError:
        value = -1
    if isinstance(step, bool) or value < 0:
        raise CkptError(f"step must be an integer >= 0, got {step!r}")
    return value


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise CkptError(f"CheckpointManager({name}={value!r}): must be an integer >= 1")
    return value


def _save_every(save_every: Any, save_interval_s: float | None) -> int | None:
    """save_every as given; unset: 1, or None (time only) with ``save_interval_s``."""
    if save_every is _UNSET:
        return 1 if save_interval_s is None else None
    if save_every is None and save_interval_s is None:
        raise CkptError("CheckpointManager(save_every=None): nothing would be due; give "
                        "save_every=N, or save_interval_s=seconds for time only")
    return None if save_every is None else _positive("save_every", save_every)
