"""One tier of a CheckpointManager at run time: TierSteps.

The manager holds one TierSteps per tier (a directory is a manager with one tier) and reaches a
tier's steps only through it: their root (path, listing, committed or not), their retention
(ask the retention policy with each step's StepInfo, hide what it drops, remove it in a
background thread, joined by the next pass and by the manager's close()), their delta chains
and the base a delta-base policy chooses among them, which of them a load found damaged or succeeded
on, and loading one of them. Call order per save: ``saved(step)`` once the step committed in
this tier, then ``retain(also)``; ``join_removal()`` and ``drop_slots()`` before the manager
lets go.

Decisions here run on the coordinating rank (the manager agrees on them across ranks through
its one Ranks object, managing/agreement.py); try_load() is a collective (the load is).

Owns: that tier's caches (links, metrics, damaged and verified steps) and what its background
thread runs. Does not own: the retention rules (retention.py), the chains' rules (chains.py),
listing and hiding (storage/steproot.py), when to save or which tier to load from
(managing/manager.py, restoring.py), making every tier's TierSteps and listing them all
(all_tiers.py), running its background threads one at a time (tier_thread.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

from ckptio import stepmeta
from ckptio.api import Checkpointer
from ckptio.errors import (CheckpointNotFoundError, CkptError, CorruptCheckpointError,
                           StorageIOError, restated)
from ckptio.format.manifest import MANIFEST_NAME, decode
from ckptio.format.types import Manifest
from ckptio.managing import warn
from ckptio.managing.agreement import Ranks
from ckptio.managing.chains import Chains, Link, read_link
from ckptio.managing.delta import ChainFacts
from ckptio.managing.retention import StepMeta
from ckptio.managing.tier_thread import TierThread
from ckptio.options import Options
from ckptio.policies import DeltaBasePolicy, RetentionPolicy, StepInfo, base_by, kept_by
from ckptio.saving.mapped_regions import pin
from ckptio.storage.local.local_root import LocalRoot
from ckptio.storage.local.mapped import MappedFile
from ckptio.storage.steps import check_files
from ckptio.storage.select import store_for
from ckptio.storage.steproot import Lease, LeasedRoot, Listing, StepRoot, foreign_steps
from ckptio.storage.store_contract import Store

__all__ = ["TierSteps"]

log = logging.getLogger("ckptio")


class TierSteps:
    """The steps of one tier: ``root`` lists and hides them (storage.select.root_for), ``lister``
    lists them for a restore or a status (a root with shorter deadlines, or ``root``).
    ``location``: the tier as declared (what a restore's messages name); ``directory``: the
    root's location (a directory, or an s3:// URL); ``every``: the tier's interval; ``keep``:
    its retention policy; ``index``: its place (0: the first)."""

    def __init__(self, location: str, every: int, root: StepRoot,
                 lister: StepRoot, keep: RetentionPolicy, checkpointer: Checkpointer,
                 ranks: Ranks, process_group: Any, index: int = 0) -> None:
        self.location = location
        self.index = index
        self.every = every  # the steps this tier receives: those divisible by it
        self.directory: str = root.location
        self._root = root
        self._lister = lister
        self.keep = keep
        self._ck = checkpointer
        self._ranks = ranks
        self._process_group = process_group
        self._chains = Chains(lambda step: read_link(self.store(step)), self.directory)
        self._meta = StepMeta(self.read_metadata, self.directory)
        self._damaged: set[int] = set()  # committed steps a load found damaged
        self.verified: int | None = None  # newest step a load or verify succeeded on
        self.last_report: Any = None  # the LoadReport of this tier's last load that succeeded
        self._base_read: tuple[int, Manifest] | None = None  # the last delta base's manifest
        self._behind = TierThread()  # its removals and slots made ahead, one at a time
        if isinstance(root, LocalRoot):  # its steps' stores are the root's (its mappings)
            checkpointer.resources().serve(root)

    # ---------------------------------------------------------------- the root

    @property
    def options(self) -> Options:
        return self._ck.options

    def path(self, step: int) -> str:
        """The directory (or prefix) of ``step``, whether or not it exists."""
        return self._root.path(step)

    def store(self, step: int) -> Store:
        return self._ck.resources().served(store_for(self.path(step), self._ck.options))

    def scan(self) -> Listing:
        """Rank 0: {"committed": [...], "incomplete": [...]}, ascending."""
        return self._root.scan()

    def listing(self) -> Listing:
        """scan() through the lister (a restore's or status's view); raises a CkptError when
        the tier cannot be listed."""
        return self._lister.scan()

    def foreign(self, incomplete: list[int], *, listed: bool = False) -> list[int]:
        """Those of ``incomplete`` (the last scan()'s, or listing()'s where ``listed``) that
        hold a torch_checkpointing checkpoint (steproot.foreign_steps: any root, its steps'
        Stores looked at where the root's listing cannot tell)."""
        root = self._lister if listed else self._root
        return foreign_steps(root, incomplete, lambda where: store_for(where, self.options))

    def lease(self, take_over: bool, *, create: bool) -> Lease | None:
        """Rank 0: this tier's run lease, where its root keeps one live job per run (a local
        directory that exists or ``create`` makes, an S3 prefix at the first save:
        steproot.LeasedRoot); None elsewhere."""
        if not isinstance(self._root, LeasedRoot):
            return None
        return self._root.lease(take_over, create=create)

    def is_committed(self, step: int) -> bool:
        return self._root.is_committed(step)

    def committed_here(self, step: int, data: bytes) -> Manifest | None:
        """The manifest a save through this manager's Checkpointer committed as ``step``, if
        its bytes were ``data`` (saving/commits.py); else None: decode ``data``."""
        return self._ck.resources().commits.known(self.store(step).location, data)

    def drained(self, step: int) -> None:
        """No copy of ``step`` out of this tier is due any more: the record its save kept goes
        (saving/commits.py; committed_here() asked for it later says None: decode)."""
        self._ck.resources().commits.forget(self.store(step).location)

    def nothing_here(self) -> str:
        """Why the tier has no step to restore (steproot.is_empty() of it says whether the
        location holds anything else)."""
        return self._lister.nothing_here()

    def read_metadata(self, step: int) -> dict[str, Any]:
        return stepmeta.read_metadata(self.path(step), self._ck.options)

    # ---------------------------------------------------------------- chains

    def manifest(self, step: int) -> Manifest:
        """``step``'s decoded manifest."""
        store = self.store(step)
        return decode(store.read_manifest(), store.path_of(MANIFEST_NAME))

    def link(self, step: int) -> Link | None:
        """``step``'s bases and stored bytes (chains.py); None if damaged or gone."""
        return self._chains.link(step)

    def bases(self, step: int) -> tuple[int, ...] | None:
        """``step``'s bases: as told by saved(), else from its link; None if damaged or gone."""
        return self._chains.bases(step)

    def describe(self, step: int) -> str:
        """`` (a delta against base step B)`` for a delta step, else '' (never raises)."""
        try:
            self._chains.link(step)
        except CkptError:
            return ""
        return self._chains.describe(step)

    def choose_base(self, policy: DeltaBasePolicy, step: int, long_every: tuple[int, ...]
                    ) -> int | None:
        """Rank 0: the base of a delta save of ``step`` here (``policy.base()``, checked:
        policies.base_by), or None: a full save, always for a step a retention keeps for long
        (divisible by ``long_every``: it then stands alone, so no old delta pins its base)."""
        if any(step % every == 0 for every in long_every):
            return None
        base = base_by(policy, step, self._infos(self.scan()["committed"])[0])
        return base if base is None or self._whole(base, step) else None

    def _whole(self, base: int, step: int) -> bool:
        """Whether the chosen base still holds every data file its manifest names, whole; a
        base damaged since it committed (a file removed or cut short by hand) is marked
        damaged, said once, and ``step`` saved full (else every later save would fail on it)."""
        try:
            if self._base_read is None or self._base_read[0] != base:  # a committed manifest
                self._base_read = (base, self.manifest(base))  # never changes: read once
            check_files(self.store(base), self._base_read[1])
        except (CorruptCheckpointError, CheckpointNotFoundError) as exc:
            self.mark_damaged(base)
            warn(f"ckptio: step {step} is saved full, not as a delta of step {base}: {exc}")
            return False
        except StorageIOError as exc:  # not damage: the storage may read again
            name = self.path(base).rstrip("/").rsplit("/", 1)[-1]
            raise restated(exc, f"step {step} was not saved: its base checkpoint {name} cannot "
                                "be read now: ") from None
        return True

    def base_failed(self, base: int, exc: BaseException) -> None:
        """A delta save against ``base`` failed with ``exc``: damage found in a file of the
        base (its bytes, read to be XORed) marks it damaged, so the next save is full."""
        name = self.path(base).rstrip("/").rsplit("/", 1)[-1]
        if isinstance(exc, CorruptCheckpointError) and exc.base == name:
            self.mark_damaged(base)

    def _infos(self, committed: list[int]) -> tuple[list[StepInfo], ChainFacts]:
        """The StepInfo of ``committed``, reading through one ChainFacts (its unreadable)."""
        facts = ChainFacts(self._chains, self._damaged, self._meta.of)
        return [StepInfo.read_from(s, self.index, facts) for s in committed], facts

    # ---------------------------------------------------------------- damaged and verified

    def is_damaged(self, step: int) -> bool:
        return step in self._damaged

    def mark_damaged(self, step: int) -> None:
        self._damaged.add(step)

    def succeeded(self, step: int) -> None:
        """A load or a verify of ``step`` succeeded: retention keeps it (the newest such)."""
        self.verified = step if self.verified is None else max(self.verified, step)
        self._damaged.discard(step)

    def saved(self, step: int, bases: tuple[int, ...] | None = None) -> None:
        """``step`` committed here anew (a save or a copy): forget what was known of it;
        ``bases``: the steps it was saved against, when the caller made it (chains.py)."""
        self._damaged.discard(step)
        self._meta.forget(step)
        self._chains.forget(step)
        if self._base_read is not None and self._base_read[0] == step:  # saved anew
            self._base_read = None
        if bases is not None:
            self._chains.made(step, bases)

    def saving(self, step: int, bases: tuple[int, ...]) -> None:
        """A save of ``step`` against ``bases`` started here: a retention pass that finds it
        committed before the manager hears of its commit (an async save done quickly) reads
        no manifest for it (chains.py); saved() records it again at the commit."""
        self._chains.made(step, bases)

    # ---------------------------------------------------------------- loading

    def try_load(self, step: int, state: Any, load_kwargs: dict[str, Any], *,
                 unreadable: bool = False) -> str | None:
        """Collective: load ``step`` into ``state`` -> None, or why it is damaged (the same on
        every rank). Other errors are raised (on every rank: the load is a collective);
        ``unreadable``: a storage error is returned as damage is (another copy is at hand)."""
        return self.try_load_at(self.path(step), state, load_kwargs, unreadable=unreadable)

    def try_load_at(self, path: str, state: Any, load_kwargs: dict[str, Any], *,
                    unreadable: bool = False) -> str | None:
        """try_load of the checkpoint at ``path`` (one this tier holds beside its steps)."""
        try:
            self.last_report = self._ck.load(path, state, process_group=self._process_group,
                                             **load_kwargs)
        except Exception as exc:  # noqa: BLE001 - damage is returned, the rest raised below
            damaged, why = self._ranks.verdict(exc, unreadable=unreadable)
            if not damaged:
                raise
            return why
        return None

    def load(self, step: int, state: Any, load_kwargs: dict[str, Any]) -> None:
        """Collective: load ``step`` into ``state``; its error is raised as it is."""
        self.last_report = self._ck.load(self.path(step), state,
                                         process_group=self._process_group, **load_kwargs)

    def verify(self, step: int) -> int:
        """Rank 0: read back and check every byte of ``step`` -> bytes read."""
        return int(self._ck.verify(self.path(step)))

    # ---------------------------------------------------------------- retention

    @property
    def deferred(self) -> bool:
        """The last pass kept a base back until its deltas' removal is durable (chains.py)."""
        return self._chains.deferred

    def retain(self, also: set[int]) -> list[int]:
        """Rank 0: hide the committed steps the retention drops (keeping ``also``, the newest
        verified step and the bases of what is kept) and remove them in a background thread.
        -> the steps hidden."""
        self.join_removal()  # one removal at a time: it may still hold hidden directories
        hidden = self._remove([step for step in self._doomed(self.scan()["committed"], also)])
        if hidden:
            log.info("ckptio: retention removes steps %s from %s", hidden, self.directory)
        return hidden

    def drop_incomplete(self) -> list[int]:
        """Rank 0, at a manager's start, for a slower tier whose run lease it holds (only its
        drain writes there, and no other job runs there): hide and remove its incomplete
        steps, copies a killed drain cut short, which no later copy completes once the faster
        tiers move on; never a step holding a torch_checkpointing checkpoint (no drain wrote
        it: the user's files). -> the steps hidden."""
        self.join_removal()
        incomplete = self.scan()["incomplete"]
        foreign = set(self.foreign(incomplete))
        hidden = self._remove([step for step in incomplete if step not in foreign])
        if hidden:
            log.warning("ckptio: %s held the incomplete copies of steps %s, left by a drain "
                        "cut short (a process killed while copying): removed", self.directory,
                        hidden)
        return hidden

    def _remove(self, steps: list[int]) -> list[int]:
        """Hide ``steps`` (atomic renames) and remove every hidden leftover in a background
        thread, joined by the next removal -> the steps hidden."""
        hidden = [step for step in steps if self._root.hide(step)]
        removal = self._root.removal()  # None until the hiding is durable
        if removal is not None:
            # not a daemon: a removal running at exit is finished
            self._behind.run(threading.Thread(target=removal, name="ckptio-retention"))
        return hidden

    def _doomed(self, committed: list[int], also: set[int]) -> list[int]:
        keep = set(also) | ({self.verified} if self.verified is not None else set())
        kept = self._chains.closure(committed, keep | self._own(committed))
        return self._chains.doomed(committed, kept)  # a base goes with or after its deltas

    def _own(self, committed: list[int]) -> set[int]:
        """What the policy keeps of ``committed``, its output checked (policies.kept_by), plus
        what no policy drops: the newest step, those whose metadata cannot be read now and
        those ahead() (not asked about: they would count as the newest, and a run that
        restored below them would see each of its saves dropped at once)."""
        self._meta.begin()
        ahead = self.ahead(committed)
        infos, facts = self._infos([s for s in committed if s not in ahead])
        kept = kept_by(self.keep, infos, time.time())
        return kept | set(committed[-1:]) | ahead | self._meta.unreadable | facts.unreadable

    def ahead(self, committed: list[int]) -> set[int]:
        """The steps of ``committed`` a load found damaged and newer than every undamaged one
        (a damaged base and its deltas, say): a run that fell back past them saves below them
        (inflight.py allows it) and its saves of those steps replace them; kept until then."""
        sound = [s for s in committed if s not in self._damaged]
        return {s for s in committed if s in self._damaged and (not sound or s > sound[-1])}

    def unpin_verified(self, committed: list[int]) -> int | None:
        """Let go of the step restored or verified last where nothing else keeps it (a memory
        tier's max_bytes needs its room) -> that step, or None (no such pin)."""
        step = self.verified
        if step is None or step not in committed or step in self._own(committed):
            return None
        self.verified = None
        return step

    def pins(self, committed: list[int]) -> dict[int, str]:
        """The committed steps kept beyond the retention's own rules, and why (status())."""
        own = self._own(committed)
        why: dict[int, str] = {}
        if self.verified in committed and self.verified not in own:
            why[self.verified] = "restored or verified last (kept until a newer step is)"
        for step in sorted(self.ahead(committed)):
            why[step] = "damaged, newer than the loadable steps (kept until a save replaces it)"
        for step in sorted(self._chains.closure(committed, own | set(why)) - own - set(why)):
            why[step] = "the base of a kept delta"
        return why

    def finish_removal(self, step: int) -> None:
        """Rank 0, before a save of ``step``: finish a removal of it still pending (an S3
        marker would hide the new checkpoint)."""
        finish = self._root.removal(step)
        if finish is not None:
            self.join_removal()  # it may be removing this very step
            finish()

    def join_removal(self) -> None:
        """Until this tier's background thread (a removal, slots made ahead) has ended
        (managing/tier_thread.py)."""
        self._behind.join()

    def prepare_slots(self, sizes: Sequence[int], cuda: bool) -> None:
        """The manager knows the state: a root keeping slots (a memory tier) makes and maps
        them for files of ``sizes`` (page-locked for device copies where ``cuda``) on this
        tier's background thread; the next retention pass joins it."""
        if not isinstance(self._root, _KeepsSlots):
            return
        on_mapped = pin if cuda else None
        self._behind.run(threading.Thread(target=self._root.prepare_slots,
                                          args=(sizes, on_mapped), name="ckptio-slots"))

    def drop_slots(self, *, at_exit: bool = False) -> None:
        """The manager lets go: a root keeping dropped steps' files for later saves (a local
        one on tmpfs, storage/local/local_root.py) removes them (``at_exit``: the files alone,
        unmapped by the process's exit, no wait for a removal running)."""
        if isinstance(self._root, _KeepsSlots):
            if not at_exit:
                self.join_removal()  # slots being made ahead are removed too
            self._root.drop_slots(unmap=not at_exit)


@runtime_checkable
class _KeepsSlots(Protocol):
    """A root that keeps dropped steps' data files for the next saves (LocalRoot)."""

    def prepare_slots(self, sizes: Sequence[int],
                      on_mapped: Callable[[MappedFile], object] | None = None) -> None: ...

    def drop_slots(self, *, unmap: bool = True) -> None: ...
