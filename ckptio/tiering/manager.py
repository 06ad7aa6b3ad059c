"""A CheckpointManager over tiers: every save into the fastest tier, drained in the background to
the slower ones, restored from the newest step any tier holds verified, fastest tier first.

    mgr = ckptio.CheckpointManager(tiers=[
        ckptio.Tier("shm://run-7", keep_last=2),                        # host memory
        ckptio.Tier("/nvme/ckpt", every=10, keep_last=2),                # local disk
        ckptio.Tier("s3://bucket/run-7", every=100, keep_every=1000),   # the durable copy
    ])
    start = mgr.restore(state) if mgr.latest() is not None else 0
    for step in range(start + 1, total + 1):
        ...
        mgr.save(step, state, lazy=True, optimizers=[opt])   # returns at host-memory speed
    mgr.close()                                               # waits for the drain too

Each tier is a manager.CheckpointManager of its own (its root, its retention, its loads and
their verdicts), sharing one Checkpointer; this module adds what spans tiers:

- **save** goes to the first tier (sync, eager or lazy, as CheckpointManager.save). When that
  step commits there, the coordinating rank hands it to the drain (drain.py), which copies it,
  verified and manifest last, to each slower tier whose ``every`` divides it, at low priority
  with its own small staging. A memory tier's budget is checked before each save (tier.py).
- **retention** is each tier's own, after a commit in that tier; the first tier also keeps the
  steps the drain still has to copy. Every tier keeps the base of each delta it keeps.
- **deltas** (``delta=ckptio.DeltaPolicy(...)``, ``compression=``): the first tier's saves
  follow the policy (managing/delta.py); a step divisible by any tier's ``keep_every`` is saved
  full. The drain copies a delta's base to the slower tier before the delta, when that tier
  does not hold it yet (drain.py says why base-first rather than a self-contained copy). Each tier keeps its newest committed step, so the newest
  copy of anything is never deleted.
- **restore** lists every tier (rank 0, agreed by all ranks), takes the newest step committed in
  any tier, and loads it from the fastest tier holding it (every byte checked as it is read);
  on damage it falls back to the next tier holding that step, then to older steps, with a
  warning naming each copy passed over and why. A resharded restore is an ordinary load from
  the chosen tier. With redundancy, restore.py agrees on one step across ranks first, fetching
  or rebuilding a lost host's memory from its partners or its parity group.
- **on start** the drain resumes: for each slower tier, the newest step a faster tier holds that
  is due there and newer than what it holds is copied again (a copy cut short by a crash left
  no manifest there, so restore never picked it).

The memory tier (``shm://NAME``: a directory on /dev/shm, a tmpfs) outlives the process: a
restarted process on the same host restores from it. Without redundancy all ranks of a job
must share that host (each host's tmpfs holds its own ranks' files and the manifest is on rank
0's: with ranks on several hosts such a memory tier is refused at construction). With
``Tier(..., redundancy=ckptio.Partners(n) | ckptio.Parity(k))`` the tiers are rank-local and
each step is protected in other hosts' memory (guard.py, protect.py; restore: restore.py,
rebuild.py).

Owns: the tiers' composition, the route the drain follows, restore across tiers, the status
view. Does not own: one tier's listing, retention and loads (manager.py), copies (copy.py),
the queue and thread (drain.py).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import socket
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ckptio import stepmeta
from ckptio.api import Checkpointer
from ckptio.distributed.dist import COORDINATOR
from ckptio.errors import CheckpointNotFoundError, CkptError, CorruptCheckpointError
from ckptio.format.flatten import flatten
from ckptio.manager import CheckpointManager
from ckptio.managing import warn
from ckptio.managing.delta import DeltaPolicy, with_compression
from ckptio.options import Options
from ckptio.saving.handle import SaveHandle, SaveResult
from ckptio.storage import holder
from ckptio.storage.base import Store
from ckptio.storage.select import checkpoint_path, root_for, scheme_of, store_for
from ckptio.storage.steproot import is_empty
from ckptio.tiering.drain import Drain
from ckptio.tiering.guard import Guard
from ckptio.tiering.restore import restore_guarded
from ckptio.tiering.tier import Tier, check_budget, check_tiers, is_memory

__all__ = ["PROBE_DEADLINE_S", "TieredManager"]

log = logging.getLogger("ckptio")
PROBE_DEADLINE_S = 10.0  # a tier unreachable this long: refused at start, passed over later
_NOT_WITH_TIERS = ("keep_best", "monitor", "mode", "keep_without_metric", "save_interval_s",
                   "save_every")


class TieredManager:
    """What ``ckptio.CheckpointManager(tiers=[...])`` returns (module docstring). With many
    ranks, create and call it on every rank together; the drain runs on rank 0."""

    def __init__(self, tiers: Sequence[Tier], *, options: Options | None = None,
                 checkpointer: Checkpointer | None = None, process_group: Any = None,
                 drain_rate: float | None = None, preemption: bool = False,
                 delta: DeltaPolicy | bool | None = None, compression: str | None = None,
                 **unknown: Any) -> None:
        refused = sorted(set(unknown) & set(_NOT_WITH_TIERS))
        if refused:
            raise CkptError(f"CheckpointManager(tiers=..., {', '.join(refused)}=...): not "
                            "available with tiers (each tier keeps its own steps, by "
                            "ckptio.Tier(every=, keep_last=, keep_every=)); a best-k retention "
                            "or a time interval needs a manager without tiers")
        if unknown:
            raise CkptError(f"CheckpointManager(tiers=..., {', '.join(sorted(unknown))}=...): "
                            "with tiers, give keep_last, keep_every and every per ckptio.Tier; "
                            "the manager takes options, checkpointer, process_group, drain_rate, "
                            "preemption, delta, compression")
        if not isinstance(preemption, bool):
            raise CkptError(f"CheckpointManager(preemption={preemption!r}): True or False")
        if drain_rate is not None and not drain_rate > 0:
            raise CkptError(f"CheckpointManager(drain_rate={drain_rate!r}): bytes per second > 0")
        self.tiers = check_tiers(tiers)
        if options is not None and checkpointer is not None:
            raise CkptError("CheckpointManager(options=..., checkpointer=...): give one of them")
        settings = checkpointer.options if checkpointer else options or Options.from_env()
        settings = with_compression(settings, compression, checkpointer is not None)
        self._guard: Guard | None = None
        if self.tiers[0].redundancy is not None:  # rank-local tiers, protected across hosts
            self._guard = Guard(self.tiers, process_group, settings.step_timeout_s,
                                settings.peer_timeout_s)
            self.tiers, process_group = self._guard.tiers, self._guard.single
        self._owns_checkpointer = checkpointer is None
        self._ck = checkpointer or Checkpointer(settings)
        self._levels = [CheckpointManager(t.location, keep_last=t.keep_last,
                                          keep_every=t.keep_every, save_every=t.every,
                                          checkpointer=self._ck, process_group=process_group,
                                          delta=delta if k == 0 else None)
                        for k, t in enumerate(self.tiers)]
        self._first = self._levels[0]
        # a step some tier keeps for long is saved full (managing/delta.py)
        self._first._long_every = tuple(t.keep_every for t in self.tiers if t.keep_every)
        quick = dataclasses.replace(self._ck.options, s3_retry_deadline_s=min(
            PROBE_DEADLINE_S, self._ck.options.s3_retry_deadline_s))
        # listing gives up on an unreachable tier after PROBE_DEADLINE_S (restore goes on)
        self._listers = [root_for(t.location, quick) for t in self.tiers]
        self._drain_rate = drain_rate
        self._drain: Drain | None = None
        self.last_restore: dict[str, Any] | None = None  # which tier, step and seconds
        try:
            if preemption:  # the first tier's manager takes every save: its should_save asks
                self._first.install_preemption_handler()
            if self._guard is None:
                self._one_host()
            else:
                self._guard.start(lambda s: checkpoint_path(self._first.path(s)))
            if self._ranks_rank() == COORDINATOR and len(self.tiers) > 1:
                self._drain = Drain(self, [t.every for t in self.tiers], self._ck.options,
                                    rate=drain_rate)
            if self._drain is not None or self._guard is not None:
                self._first._also_keep = self._pinned
                self._first._after_commit = self._committed
            self._first._agreed(self._resume)
        except BaseException:
            self._first._triggers.preemption.uninstall()
            if self._owns_checkpointer:
                self._ck.close()
            raise

    # ---------------------------------------------------------------- queries

    @property
    def directory(self) -> str:
        """The first tier's location (where saves land)."""
        return self._first.directory

    def should_save(self, step: int) -> bool:
        """The first tier's ``every``, or preemption reached (CheckpointManager.should_save)."""
        return self._first.should_save(step)

    def reached_preemption(self, step: int) -> bool:
        """CheckpointManager.reached_preemption (``preemption=True``): save ``step``, close()
        (which waits for the first tier's save and lets the drain finish), exit."""
        return self._first.reached_preemption(step)

    def install_preemption_handler(self, signals: Sequence[int] = (signal.SIGTERM,)) -> None:
        self._first.install_preemption_handler(signals)

    def metadata(self, step: int | None = None) -> dict[str, Any]:
        """The metrics and metadata saved with ``step`` (default: the newest), from the fastest
        tier holding it (stepmeta.read_metadata: its manifest only)."""
        listing = self._first._agreed(self._listings)
        candidates = _candidates(listing, step)
        if not candidates:
            raise CheckpointNotFoundError(self._nothing(listing, step))
        target, holders = candidates[0]
        level = self._levels[holders[0]]
        return level._agreed(lambda: stepmeta.read_metadata(level.path(target), self._ck.options))

    def path(self, step: int, tier: int = 0) -> str:
        """Where ``step`` is (or would be) in tier ``tier`` (0: the first)."""
        return self._levels[self._tier_index(tier)].path(step)

    def steps(self) -> list[int]:
        """Steps committed in any tier, ascending (collective with many ranks; with redundancy:
        in any tier of any rank)."""
        listing = self._first._agreed(self._listings)
        steps = sorted({s for tier in listing for s in tier["committed"]})
        return steps if self._guard is None else self._guard.union(steps)

    def latest(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def incomplete(self) -> list[int]:
        """Steps some tier holds incomplete (an interrupted save or copy, or one running) and
        no tier holds committed."""
        return _incomplete(self._first._agreed(self._listings))

    def status(self) -> list[dict[str, Any]]:
        """Per tier (this process's view, not a collective): location, every, the committed
        and incomplete steps, and for slower tiers on the rank running the drain, the step
        being drained, the one queued, the steps skipped, the last copies, the last error."""
        drained = self._drain.status() if self._drain is not None else {}
        if self._guard is not None:  # tier 0: how its steps are protected across hosts
            drained[0] = self._guard.status()
        out = []
        for k, (tier, listing) in enumerate(zip(self.tiers, self._listings())):
            out.append({"tier": k, "location": tier.location, "every": tier.every, **listing,
                        **drained.get(k, {})})
        return out

    def protected(self, timeout: float | None = None) -> bool:
        """Wait until every step saved so far is protected across hosts (or given up, said in
        status()) -> True, or ``timeout`` -> False; raises, once, the first protection error
        not raised yet. True at once without redundancy."""
        self._first.wait()
        if self._guard is None or self._guard.protector is None:
            return True
        return self._guard.protector.wait(timeout)

    # ---------------------------------------------------------------- saving

    def save(self, step: int, state: Any, *, asynchronous: bool = False, lazy: bool = False,
             optimizers: Sequence[torch.optim.Optimizer] = (), force: bool = False,
             allow_pickle: bool = False, metrics: Mapping[str, Any] | None = None,
             metadata: Mapping[str, Any] | None = None) -> SaveResult | SaveHandle | None:
        """CheckpointManager.save into the first tier (-> None unless should_save(step) or
        ``force``); the drain copies it on once committed, metrics and metadata included (they
        are in the manifest)."""
        if not force and not self._first.should_save(step):
            return None
        if is_memory(self.tiers[0]) and scheme_of(checkpoint_path(self.directory)) is None:
            estimate = _state_nbytes(state)
            self._first._agreed(lambda: self._check_budget(estimate))
        return self._first.save(step, state, asynchronous=asynchronous, lazy=lazy,
                                optimizers=optimizers, force=True, allow_pickle=allow_pickle,
                                metrics=metrics, metadata=metadata)

    def wait(self) -> SaveResult | None:
        """Wait for the first tier's save in flight (CheckpointManager.wait); not the drain."""
        return self._first.wait()

    def drained(self, timeout: float | None = None) -> bool:
        """Wait until the drain has copied every due step (-> True) or ``timeout`` (-> False);
        raises, once, the first drain error not raised yet. Other ranks return True at once."""
        self._first.wait()
        return True if self._drain is None else self._drain.wait(timeout)

    def close(self) -> None:
        """wait(), let the drain copy what is due (its error is raised here, once), apply the
        first tier's retention to the steps the drain kept there, finish the removals of every
        tier, free the Checkpointer if the manager made it."""
        try:
            self._first.wait()
        finally:
            self._first._triggers.preemption.uninstall()
            try:
                if self._guard is not None and self._guard.protector is not None:
                    self._guard.protector.close()
                if self._drain is not None:
                    self._drain.close()
                if len(self._levels) > 1:  # what the drain's pins kept past the last commit
                    self._first._agreed(self._first._drop_old)
                for level in self._levels:  # bases kept back one pass (managing/chains.py)
                    level._drop_deferred()
            finally:
                for level in self._levels:
                    level._join_removal()
                if self._owns_checkpointer:
                    self._ck.close()

    def __enter__(self) -> TieredManager:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ---------------------------------------------------------------- restoring

    def restore(self, state: Any, step: int | None = None, **load_kwargs: Any) -> int | None:
        """Load the newest step any tier holds (or ``step``) into ``state``, from the fastest
        tier holding it, falling back tier by tier and then step by step on damage (module
        docstring) -> the step restored. ``last_restore`` says from where and how long.
        None when no tier ever committed a step and every tier was listed (as
        CheckpointManager.restore; a tier that cannot be listed makes it raise instead)."""
        if state is None:
            raise CkptError("CheckpointManager.restore(state) loads in place: pass the state to "
                            "fill (for fresh tensors use ckptio.load(mgr.path(step, tier)))")
        if "process_group" in load_kwargs:
            raise CkptError("restore(process_group=...): give it to CheckpointManager(...)")
        self._first.wait()
        if self._guard is not None:
            return restore_guarded(self, self._guard, state, step, load_kwargs)
        return self._restore_tiers(state, step, load_kwargs)

    def _restore_tiers(self, state: Any, step: int | None, load_kwargs: dict[str, Any]
                       ) -> int | None:
        """restore() through this manager's tiers (with redundancy: this rank's alone)."""
        listing = self._first._agreed(self._listings)
        candidates = _candidates(listing, step)
        if not candidates and step is None and self._first._agreed(self._empty):
            return self._first._nothing_to_restore(
                {"steps": [[s, False] for s in _incomplete(listing)], "missing": None},
                stacklevel=4)
        if not candidates:
            raise CheckpointNotFoundError(self._nothing(listing, step))
        passed: list[str] = []
        for candidate, holders in candidates:
            for k in holders:
                level = self._levels[k]
                started = time.perf_counter()
                why = level._try_load(candidate, state, load_kwargs)
                if why is None:
                    return self._restored(candidate, k, time.perf_counter() - started,
                                          passed, listing)
                passed.append(f"step {candidate}{level._chain_note(candidate)} in "
                              f"{self.tiers[k].location}: {why}")
                level._damaged.add(candidate)
        raise CorruptCheckpointError(
            f"no copy of {'any step' if step is None else f'step {step}'} in the tiers "
            f"{', '.join(t.location for t in self.tiers)} could be restored: "
            f"{'; '.join(passed)}. The copies are left as they are")

    def verify(self, step: int | None = None) -> int:
        """Read back and check every byte of ``step`` (default: the newest) in the fastest tier
        holding it; -> bytes read."""
        self._first.wait()
        listing = self._first._agreed(self._listings)
        candidates = _candidates(listing, step)
        if not candidates:
            raise CheckpointNotFoundError(self._nothing(listing, step))
        target, holders = candidates[0]
        return self._levels[holders[0]].verify(target)

    def _restored(self, step: int, k: int, seconds: float, passed: list[str],
                  listing: list[dict[str, list[int]]]) -> int:
        self._levels[k]._succeeded(step)
        committed = {s for t in listing for s in t["committed"]}
        newer = sorted({s for t in listing for s in t["incomplete"]
                        if s > step and s not in committed})
        if newer:
            passed.append(f"steps {newer}: incomplete (an interrupted save or copy)")
        if passed:
            warn(f"ckptio: restored step {step} from {self.tiers[k].location}, not a newer "
                 f"copy: {'; '.join(passed)}", stacklevel=3)
        self.last_restore = {"step": step, "tier": k, "location": self.tiers[k].location,
                             "seconds": seconds}
        log.info("ckptio: restored step %d from tier %d (%s) in %.3f s", step, k,
                 self.tiers[k].location, seconds)
        return step

    def _empty(self) -> bool:
        """Rank 0: whether every tier can be listed and holds nothing a restore could mean."""
        try:
            return all(is_empty(root.nothing_here()) for root in self._listers)
        except CkptError:
            return False  # a tier that cannot be listed may hold the steps: not "nothing"

    def _nothing(self, listing: list[dict[str, list[int]]], step: int | None) -> str:
        held = "; ".join(f"{t.location}: committed {x['committed'] or 'none'}, incomplete "
                         f"{x['incomplete'] or 'none'}" for t, x in zip(self.tiers, listing))
        what = "no committed step" if step is None else f"step {step} is committed nowhere"
        return f"{what} in any tier to restore ({held})"

    # ---------------------------------------------------------------- the drain's route

    def source(self, step: int, tier: int) -> Store | None:
        for k in range(tier):
            if self._levels[k]._root.is_committed(step):
                return store_for(self._levels[k].path(step), self._ck.options)
        return None

    def target(self, step: int, tier: int) -> Store:
        return store_for(self._levels[tier].path(step), self._ck.options)

    def bases(self, step: int, tier: int) -> tuple[int, ...]:
        """The bases of ``step`` as the fastest tier before ``tier`` holding it has it: the
        drain copies them to ``tier`` first (a delta is loadable only beside its base)."""
        for k in range(tier):
            if self._levels[k]._root.is_committed(step):
                link = self._levels[k]._chains.link(step)
                return () if link is None else link.bases
        return ()

    def holds(self, step: int, tier: int) -> bool:
        return self._levels[tier]._root.is_committed(step)

    def _pinned(self) -> set[int]:
        """Steps the first tier keeps for the drain and for the protection."""
        return ((self._drain.pinned() if self._drain is not None else set())
                | (self._guard.pinned() if self._guard is not None else set()))

    def _committed(self, step: int) -> None:
        """``step`` committed in the first tier: protect it, drain it."""
        if self._guard is not None and self._guard.protector is not None:
            self._guard.protector.submit(step)
        if self._drain is not None:
            self._drain.submit(step)

    def landed(self, step: int, tier: int) -> None:
        level = self._levels[tier]
        level._damaged.discard(step)
        level._drop_old()

    # ---------------------------------------------------------------- rank 0's decisions

    def _listings(self) -> list[dict[str, list[Any]]]:
        """Every tier's steps; a tier that cannot be listed now (an object store gone away for
        PROBE_DEADLINE_S) counts as holding nothing, with a warning naming it and why."""
        out = []
        for tier, root in zip(self.tiers, self._listers):
            try:
                out.append(dict(root.scan()))
            except CkptError as exc:
                warn(f"ckptio: tier {tier.location} cannot be listed, so its steps are passed "
                     f"over: {type(exc).__name__}: {exc}", stacklevel=3)
                out.append({"committed": [], "incomplete": [], "unreachable": [str(exc)]})
        return out

    def _probe(self) -> None:
        """Rank 0, at start: every tier must be listable within PROBE_DEADLINE_S (a wrong
        endpoint or missing credentials fails here, not at the first drain hours later)."""
        for tier, root in zip(self.tiers, self._listers):
            try:
                root.scan()
            except CkptError as exc:
                raise type(exc)(
                    f"tier {tier.location} cannot be reached: {exc}. Fix its location or "
                    "credentials; to restore from the other tiers meanwhile, leave it out of "
                    "tiers=") from None

    def _resume(self) -> None:
        """Rank 0, at start: probe the tiers; hand the drain each slower tier's newest due step that a faster
        tier holds and it does not (a drain cut short, or never run)."""
        self._probe()
        if self._drain is None:
            return
        listing = self._listings()
        for k in range(1, len(self.tiers)):
            faster = {s for x in listing[:k] for s in x["committed"]}
            due = [s for s in faster if s % self.tiers[k].every == 0]
            held = listing[k]["committed"]
            if due and (not held or max(due) > held[-1]):
                log.info("ckptio: the drain resumes: step %d to %s", max(due),
                         self.tiers[k].location)
                self._drain.submit_to(max(due), k)

    def _check_budget(self, estimate: int) -> None:
        """Rank 0: refuse a save the memory tier has no room for (tier.check_budget); the
        step's size is the newest committed one's there, else ``estimate``. With redundancy
        (every rank its own), the copies and parity this rank holds for others count too."""
        directory = checkpoint_path(self.directory)
        sizes = _step_sizes(self._first._root.scan()["committed"], self._first)
        step_nbytes = sizes[-1] if sizes else estimate * self._first._ranks().size
        others = self._guard.for_others(step_nbytes) if self._guard is not None else (0, 0)
        check_budget(self.tiers[0], directory, sum(sizes), step_nbytes, others)

    def _one_host(self) -> None:
        """A memory tier needs every rank on one host (module docstring)."""
        if not any(is_memory(t) for t in self.tiers):
            return
        group = self._first._ranks()
        if group.size == 1:
            return
        hosts = sorted({h.decode() for h in group.all_gather(_host_id().encode())})
        if len(hosts) > 1:
            raise CkptError(
                f"memory tier {self.tiers[0].location}: the ranks run on {len(hosts)} hosts "
                f"({', '.join(hosts[:4])}); a memory tier needs them on one (each host's "
                "memory holds only its own ranks' files): give the memory tier redundancy="
                "ckptio.Partners(1) or ckptio.Parity(k=...) (rank-local, protected across "
                "hosts), or use a shared disk as the first tier")

    def _ranks_rank(self) -> int:
        return self._first._ranks().rank

    def _tier_index(self, tier: int) -> int:
        if isinstance(tier, bool) or not isinstance(tier, int) or not 0 <= tier < len(self.tiers):
            raise CkptError(f"tier={tier!r}: this manager has tiers 0..{len(self.tiers) - 1}")
        return tier


def _incomplete(listing: list[dict[str, list[int]]]) -> list[int]:
    """Steps some tier holds incomplete and no tier holds committed."""
    committed = {s for tier in listing for s in tier["committed"]}
    return sorted({s for tier in listing for s in tier["incomplete"]} - committed)


def _candidates(listing: list[dict[str, list[int]]],
                step: int | None) -> list[tuple[int, list[int]]]:
    """(step, tiers holding it committed, fastest first), newest step first."""
    committed = sorted({s for x in listing for s in x["committed"]}, reverse=True)
    if step is not None:
        committed = [s for s in committed if s == step]
    return [(s, [k for k, x in enumerate(listing) if s in x["committed"]]) for s in committed]


def _state_nbytes(state: Any) -> int:
    """The bytes of ``state``'s tensors (this rank's part): a first save's size estimate."""
    leaves = flatten(state).leaves.values()
    return sum(leaf.value.numel() * leaf.value.element_size() for leaf in leaves
               if isinstance(leaf.value, torch.Tensor))


def _step_sizes(steps: list[int], level: CheckpointManager) -> list[int]:
    """Bytes each committed step of ``level`` (a local directory) holds, ascending."""
    sizes = []
    for step in steps:
        path = level.path(step)
        try:
            sizes.append(sum(e.stat().st_size for e in os.scandir(path) if e.is_file()))
        except OSError:
            continue  # removed meanwhile
    return sizes


def _host_id() -> str:
    return f"{socket.gethostname()}:{holder.boot_id()}"

