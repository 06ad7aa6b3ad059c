"""One save, from start to end, in the order it happens.

    save = save_session.begin(context, state)      # the caller's thread, inside async_save:
        1 flatten    the state -> leaves and the tree that rebuilds it
        2 plan       this rank's writes and inline values (reused for an unchanged layout)
        3 agree      collective: who writes what; if one rank fails, every rank fails
        4 lay out    this rank's files, named for this save only; the rest queued (workers.py)
    save.capture_here()                        # still the caller's thread:
        5 capture    eager: the state copied into the staging pool here; lazy: only the
                     tensors no optimizer owns, the rest by the save's thread
    _run(...)                                  # the save's thread:
        - claim/open collective: the coordinator holds the directory's lock, opens the files
        6 drain      every checksum and write finished
        7 fsync      every file durable
        8 conclude   collective: every rank's keyed result to the coordinator
        9 commit     the coordinator writes the manifest last, atomically
       10 clean up   files no committed manifest names, in the background (cleanup.py)
       11 grow       an async save's pool grows (within Options.host_budget_bytes)
Everything the save needs is fixed in one SaveContext (save_context.py) when it starts; a
failure on any rank reaches every rank (a collective step) and is raised by wait().

Owns: the order of those steps. Does not own: planning (planning/), the collective steps
(distributed/collective.py), the bytes (persist.py, a rank's index file: rank_index.py), the
commit (the Store, storage/), the handle and its hand-over (handle.py, handover.py): the
session drives the caller's SaveHandle only through the HandleControl it makes for each save.
"""

from __future__ import annotations

import contextlib
import logging
import operator
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from ckptio.distributed import collective, rankplan, savelock
from ckptio.errors import CheckpointLockedError, CkptError
from ckptio.format import regular_section
from ckptio.format.flatten import flatten
from ckptio.format.manifest import MANIFEST_NAME
from ckptio.format.types import FileLayout, Manifest, Written
from ckptio.planning.layout import plan_files
from ckptio.planning.plan import PlanCache, SavePlan, build_plan
from ckptio.io import stall
from ckptio.saving import copy_streams, persist
from ckptio.saving.handle import (
    HandleControl,
    SaveHandle,
    check_unchanged,
    lazy_order,
    lazy_versions,
)
from ckptio.saving.packing import DeltaBase, Packer
from ckptio.saving.rank_index import write_index
from ckptio.saving.save_context import PACKED_FILE, RankPart, SaveContext
from ckptio.storage import steps
from ckptio.storage.entry_reader import EntryReader
from ckptio.storage.files import StoreFiles, mappable
from ckptio.storage.abandon import abandoned_when
from ckptio.storage.store_contract import Exclusive, Store
from ckptio.version import __version__

__all__ = ["Save", "begin", "default_meta", "planned_files"]

_NBYTES = operator.attrgetter("nbytes")
# a packed save's data files (packing.py): at least this, whole entries; small enough that
# writing one overlaps encoding the next
SEGMENT_NBYTES = 64 << 20

log = logging.getLogger("ckptio")


@dataclass(frozen=True)
class Save:
    """A save begun: the session's control of it (the caller gets ``handle``), and the
    Future of its steps on the save thread (done once they have all returned)."""

    control: HandleControl
    running: Future[None]
    lazy: bool

    @property
    def handle(self) -> SaveHandle:
        return self.control.handle

    def capture_here(self) -> None:
        """Step 5 on the caller's thread: an eager save's copy into the staging pool (handed
        over by the save's thread once the files are open); a lazy save's copy of the tensors
        no optimizer owns, the rest copied by the save's thread while the next optimizer step
        waits for it."""
        try:
            self.control.block_until_captured(lazy=self.lazy)
        finally:
            self.control.mark_returned()


def begin(ctx: SaveContext, state: Any) -> Save:
    """Steps 1-4 on the caller's thread; the rest queued on the save thread. Collective with
    peers."""
    plan, sources, agreement = _agree(ctx, state)
    activity: stall.Activity | None = None
    try:
        part = _lay_out(ctx, plan, sources, agreement)
        activity = stall.watched(ctx.store.location, ctx.group.rank,
                                 ctx.options.io_stall_warn_s)
        control = HandleControl(ctx.store.location, persist.Progress(part.nbytes),
                                tuple(f.name for f in part.files), ctx.started, activity)
        running = _queue(ctx, part, control)
    except BaseException as exc:
        if activity is not None:  # never queued (an error, Ctrl-C): unwatched, or the watch
            activity.finish()  # would run on and an exit would wait for it forever
        _report_failure(ctx, agreement, exc)  # the peers wait for this rank in the next steps
        raise
    return Save(control, running, ctx.lazy)


def _agree(ctx: SaveContext, state: Any) -> tuple[SavePlan, dict[str, torch.Tensor],
                                                  collective.Agreement]:
    """1 flatten, 2 plan, 3 agree (again, once, for keys the ranks hold on disjoint device
    meshes: collective.Memory.across). A failure here is raised on every rank before any byte
    is written (the peers learn of it in agree())."""
    error: BaseException | None = None
    reuse = False
    plan, flat = SavePlan((), (), ()), None  # replaced, unless agree() raises
    sources: dict[str, torch.Tensor] = {}
    try:
        if ctx.previous_error is not None:
            raise ctx.previous_error
        flat = flatten(state, names=True, cache=ctx.plan_cache.flat)
        hits = ctx.plan_cache.hits
        plan, sources = build_plan(flat, allow_pickle=ctx.allow_pickle, cache=ctx.plan_cache)
        reuse = ctx.plan_cache.hits > hits
    except BaseException as exc:  # noqa: BLE001 - raised by agree() once the peers know
        error = exc
    for _ in range(2):
        mine: collective.RankPlan | None = None
        try:
            if error is None and flat is not None:
                mine = rankplan.local_plan(ctx.group, plan, sources, flat,
                                           regular=ctx.packing is None, across=ctx.memory.across)
        except BaseException as exc:  # noqa: BLE001 - raised by agree() once the peers know
            error = exc
        agreement = collective.agree(ctx.group, mine, error, ctx.memory, ctx.store.location,
                                     reuse, piece=ctx.piece)
        if not agreement.replan:
            return plan, sources, agreement
        ctx.memory.across |= agreement.replan
    raise CkptError(f"save to {ctx.store.location}: the ranks planned keys "
                    f"{sorted(agreement.replan)[:3]} again and still disagree (internal)")


def _lay_out(ctx: SaveContext, plan: SavePlan, sources: dict[str, torch.Tensor],
             agreement: collective.Agreement) -> RankPart:
    """4: the files this rank writes (a lazy save's non-optimizer items first)."""
    writes: Sequence[int] = agreement.assignment.writes
    items = tuple(map(plan.items.__getitem__, writes))
    eager_items = len(items)
    if ctx.lazy:
        items, eager_items = lazy_order(items, sources, ctx.optimizers, ctx.after_step)
    if ctx.packing is not None:  # one layout: the capture's order (packing.py writes the files)
        files = tuple(FileLayout(PACKED_FILE, f.nbytes, f.placements) for f in plan_files(
            items, save_id=agreement.save_id, rank=ctx.group.rank, max_file_bytes=1 << 62))
    else:
        files = plan_files(items, save_id=agreement.save_id, rank=ctx.group.rank,
                           max_file_bytes=ctx.options.max_file_bytes)
    index_file = (regular_section.index_name(agreement.save_id, ctx.group.rank) if agreement.regular
                  else None)
    return RankPart(agreement, tuple(files), sources, {plan.items[i].key: i for i in writes},
                 index_file, frozenset(plan.items[i].key for i in agreement.regular),
                 frozenset(plan.items[i].key for i in agreement.assignment.own), eager_items,
                 sum(map(_NBYTES, items)), copy_streams.ready_events(sources),
                 lazy_versions(items[eager_items:], sources) if ctx.lazy else {})


def _queue(ctx: SaveContext, part: RankPart, control: HandleControl) -> Future[None]:
    """_run queued on the Checkpointer's save thread (a save running at exit is finished:
    api.py waits for it before the threads stop)."""
    if ctx.lazy:  # before it is queued: no capture may begin unguarded
        control.hook_optimizers(ctx.optimizers)
    try:
        running = ctx.workers.calls("ckptio-save").submit(_run, ctx, part, control)
    except BaseException as exc:
        control.finished(0, exc)  # releases the hooks' wait
        control.remove_hooks()
        raise
    if ctx.lazy and part.eager_items == 0:  # nothing outside the optimizers to wait for
        control.eager_captured()
    return running


def _run(ctx: SaveContext, part: RankPart, control: HandleControl) -> None:
    """The save's thread: claim, open, 5-7 write (_write), 8-9 conclude and commit, 11 grow.

    The open's failure removes this save's files again. The drain (6) starts a synchronous
    save's writes with its first full buffer, an async one's once the capture is done. An
    async save of a state larger than the staging pool grows the pool (11) before wait()
    returns, so the next one never waits for the disk."""
    if ctx.lazy and part.eager_items == 0:  # leave the GIL to the caller until it returns
        control.wait_returned()
    concluded = False
    mapped = False
    try:
        # claim first: a collective on every rank, and no rank creates a file before the
        # coordinator holds the lock; attempt() removes this rank's files on failure.
        with (ctx.resources.lock, abandoned_when(control.abandoned),
              savelock.exclusive(ctx.group, ctx.store, ctx.options.if_locked) as held,
              _opened(ctx.store, part.names)):
            # The previous save's cleanup must have listed its directory before this save
            # creates files there; its deleting may go on.
            ctx.cleanup.wait_listed()
            if held is not None:
                steps.foreign_there(ctx.store, "a ckptio save")
            replacing = held is not None and steps.is_committed(ctx.store)
            if replacing and ctx.overwrite is False:
                raise _committed_there(ctx.store.location)
            mapped = _mapped(ctx, [f.nbytes for f in part.files])
            written, error = _write(ctx, part, control, mapped)
            concluded = True
            _conclude(ctx, part.agreement, written, error, held, control.activity)
            if replacing:  # said, not silent (a warning unless the caller asked for it)
                log.log(logging.INFO if ctx.overwrite else logging.WARNING,
                        "ckptio: the save replaced the checkpoint committed at %s (the old one "
                        "stayed intact until this one committed)", ctx.store.location)
    except BaseException as exc:  # noqa: BLE001 - kept for wait(), which raises it
        if not concluded:  # e.g. the directory could not be made: the peers still wait
            _report_failure(ctx, part.agreement, exc, claimed=True)
        control.finished(0, exc)
        return
    try:
        if ctx.grow_staging and not mapped:  # 11: before wait() returns, so the next
            # save finds it done (a mapped save stages nothing)
            ctx.resources.fit([f.nbytes for f in part.files])
    finally:
        control.finished(control.progress.nbytes_total)


def _committed_there(location: str) -> CheckpointLockedError:
    return CheckpointLockedError(
        f"{location} holds a committed checkpoint once this save holds its lock, and "
        "overwrite=False refuses to replace it: this save wrote nothing and that checkpoint is "
        "kept. Save under another name, or pass overwrite=True to replace it. If nothing was "
        "committed there when the save began (a CheckpointManager checks), it was committed by "
        "another save while this one waited for the lock (another process, or a job started on "
        "the same run directory): give each job its own directory")


@contextlib.contextmanager
def _opened(store: Store, names: list[str]) -> Iterator[None]:
    """The location made (every rank: only the coordinator claimed it); if the body fails, this
    save's files ``names`` are removed again (storage/steps.attempt)."""
    store.prepare()
    with steps.attempt(store, names):
        yield


def _write(ctx: SaveContext, part: RankPart, control: HandleControl, mapped: bool) -> tuple[
        Written | None, BaseException | None]:
    """5 capture, 6 drain, 7 fsync: this rank's bytes durable (``mapped``: copied into its
    files' pages); -> (its results keyed by item index, None) or (None, why)."""
    job: persist.SaveJob | None = None
    try:
        staged = (None if ctx.packing is not None else
                  0 if mapped else sum(f.nbytes for f in part.files))
        # a pool no larger than the state (the smallest for a mapped save, which copies into
        # its files' pages), faulted in by the capture's own copies; an async save's first
        # grows it to hold the state, faulted in buffer by buffer ahead of the capture
        grow = [f.nbytes for f in part.files] if ctx.grow_staging and staged else []
        pool, target = ctx.resources.files(ctx.store, staged, copy_faults=True,
                                           behind=ctx.grow_staging, fit=grow)
        job = persist.SaveJob(target, part.files, part.sources, pool=pool,
                              algorithm=ctx.options.checksum, rank=ctx.group.rank,
                              ready=part.ready, progress=control.progress,
                              block_nbytes=ctx.block_nbytes, packer=_packer(ctx, part, target),
                              write_at_once=not ctx.grow_staging,  # a synchronous save
                              mapped=mapped, activity=control.activity,
                              hashing=ctx.workers.calls("ckptio-hash"))
        if ctx.lazy:
            job.capture(part.eager_items, control.eager_captured)
            check_unchanged(ctx.store.location, part.versions, part.sources)  # before a step
        else:
            control.run_on_caller(job.capture)
        control.captured()
        part.sources.clear()  # the state's tensors, copied: not held while the bytes persist
        # (an eager save's thousands of them would outlive the collector's young generations)
        entries, infos = job.finish()
        if job.packer is not None:
            control.files_written(tuple(i.name for i in infos))
        index = None
        if part.index_file is not None:  # the regular items' rows go to the index file
            rows = [e for e in entries if e.key in part.regular]
            index, info = write_index(ctx, part.index_file, part.agreement.save_id, rows,
                                      control.activity)
            entries, infos = [e for e in entries if e.key not in part.regular], [*infos, info]
        return Written({part.index_of[e.key]: e for e in entries}, tuple(infos), index), None
    except BaseException as exc:  # noqa: BLE001 - returned: every rank must hear of it
        if job is not None:
            job.abandon()
        return None, exc


def _mapped(ctx: SaveContext, sizes: list[int]) -> bool:
    """Whether this save of files of ``sizes`` copies straight into their pages
    (Options.memory_mapped: a plain save into a directory on tmpfs whose slots of those sizes
    are mapped ahead; storage/files.mappable)."""
    return (ctx.options.memory_mapped != "off" and ctx.packing is None
            and mappable(ctx.store, sizes))


def _packer(ctx: SaveContext, part: RankPart, target: StoreFiles) -> Packer | None:
    """The packer of a packed save (None for a plain one)."""
    packing = ctx.packing
    if packing is None:
        return None
    delta = None
    if packing.base is not None:
        reader = EntryReader(StoreFiles(packing.base.store, target.backend),
                             block_nbytes=ctx.block_nbytes, algorithm=ctx.options.checksum,
                             bases=None)
        delta = DeltaBase(packing.base, reader, part.per_rank, ctx.group.rank)
    (layout,) = part.files or (FileLayout(PACKED_FILE, 0, ()),)
    return Packer(target, layout.placements, first_index=0, save_id=part.agreement.save_id,
                  rank=ctx.group.rank, compression=packing.compression, base=delta,
                  block_nbytes=ctx.block_nbytes, algorithm=ctx.options.checksum,
                  segment_nbytes=min(SEGMENT_NBYTES, ctx.options.max_file_bytes))


def _conclude(ctx: SaveContext, agreement: collective.Agreement,
              written: Written | None, error: BaseException | None,
              held: Exclusive | None, activity: stall.Activity) -> None:
    """8 conclude, 9 commit (on the coordinator, watched), 10 clean up started after it."""
    manifest = ctx.store.path_of(MANIFEST_NAME)

    def committed(record: Manifest, data: bytes) -> None:
        if ctx.commits is not None:
            ctx.commits.remember(ctx.store.location, data, record)
        ctx.cleanup.start(ctx.store, [f.name for f in record.files])

    collective.conclude(ctx.group, agreement, written, error, ctx.store, ctx.meta,
                        ctx.options.checksum, ctx.block_nbytes, committed, held,
                        lambda: activity.call("commit", manifest))


def _report_failure(ctx: SaveContext, agreement: collective.Agreement, exc: BaseException, *,
                    claimed: bool = False) -> None:
    """Take part in the steps the peers wait in, with this rank's failure (the caller raises
    ``exc`` itself). ``claimed``: this rank has already taken part in the claim."""
    try:
        if not claimed:
            savelock.skip_exclusive(ctx.group, ctx.store.location, exc)
        collective.conclude(ctx.group, agreement, None, exc, ctx.store, ctx.meta,
                            ctx.options.checksum, ctx.block_nbytes, lambda _record, _data: None)
    except BaseException as other:  # noqa: BLE001 - exc is what the caller reports
        if other is not exc:
            log.warning("ckptio: rank %d could not report its failed save of %s to the other "
                        "ranks: %s", ctx.group.rank, ctx.store.location, other)


def planned_files(state: Any, max_file_bytes: int,
                  cache: PlanCache | None = None) -> tuple[list[int], bool]:
    """The sizes of the data files one process's save of ``state`` writes (as planned): what
    the staging pool must hold for async saves of it to return at copy speed; and whether any
    of its tensors is on a CUDA device. ``cache``: the Checkpointer's plan cache, so that its
    first save reuses this plan as later ones do."""
    flat = flatten(state, names=True, cache=None if cache is None else cache.flat)  # as a save
    plan, sources = build_plan(flat, allow_pickle=True, cache=cache)
    sizes = [f.nbytes for f in plan_files(plan.items, save_id="size", rank=0,
                                          max_file_bytes=max_file_bytes)]
    return sizes, any(isinstance(t, torch.Tensor) and t.is_cuda for t in sources.values())


def default_meta() -> dict[str, Any]:
    """The manifest's ``meta`` of a save through ckptio's own API."""
    return {"ckptio_version": __version__, "torch_version": torch.__version__,
            "created_unix": time.time()}
