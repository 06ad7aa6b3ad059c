"""save / load as a handful of named steps, and the Checkpointer that owns reusable resources.

Owns: the public methods and their arguments, the save in flight and the agreement of a load's
ranks. A save's steps are saving/save_session.py's, a load's loading/load_session.py's; the steps
a load's ranks share and how they end are load_ranks.py's; the staging pool and backends they
borrow are ckptio/resources.py's; the ranks of a call and the plans of their last save are
distributed/rankgroups.py's.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ckptio import packed, stepmeta
from ckptio.distributed.dist import current_group, piece_of
from ckptio.distributed.rankgroups import RankGroups
from ckptio.errors import CkptError, SaveTimeoutError, StorageIOError, restated, seconds_to_wait
from ckptio.format.types import Manifest, Read
from ckptio.loading import load_session as loading
from ckptio.loading.fill import LoadReport
from ckptio.load_ranks import LoadRanks
from ckptio.loading.stored import KeyFilter, RankPolicy
from ckptio.options import Options
from ckptio.planning.plan import PlanCache
from ckptio.resources import ReusedIOResources
from ckptio.saving import at_exit, save_context, save_session
from ckptio.saving.handle import (
    HandleControl,
    SaveHandle,
    SaveResult,
    after_step_tensors,
    skipped_handle,
)
from ckptio.storage.select import checkpoint_path, store_for

AsyncSaveResult = SaveResult  # the result of an async save's handle.wait(): a save's fields
# what an in-place load's StorageIOError begins with (a manager's restore says its own instead)
PARTLY_FILLED = ("load() stopped on a storage error; the state it fills in place may hold some "
                 "of the checkpoint's tensors and keep its previous values elsewhere: load "
                 "again before using it, once the storage reads: ")

__all__ = [
    "AsyncSaveResult",
    "Checkpointer",
    "LoadReport",
    "PARTLY_FILLED",
    "SaveHandle",
    "SaveResult",
]


class Checkpointer:
    """Saves and loads with one reused staging pool and I/O backends.

    Create one per training job (or use the module-level ckptio.save/load, which share one);
    ``with Checkpointer() as ck:`` closes it at the end. Not safe for concurrent use from
    several threads; saves and loads run one at a time.
    """

    def __init__(self, options: Options | None = None) -> None:
        self.options = options or Options.from_env()
        self._resources = ReusedIOResources(self.options)
        self._plan_cache = PlanCache()
        self._ranks = RankGroups()  # the ranks of each call, and their last save's plans
        self._stale_hooks: list[HandleControl] = []  # lazy hooks to remove from their own thread
        self._inflight: HandleControl | None = None  # the control of the save in flight
        self._running: concurrent.futures.Future[None] | None = None  # its steps, queued
        self._pid = os.getpid()  # a forked child forgets the parent's save in flight

    def _in_flight(self) -> tuple[HandleControl | None, concurrent.futures.Future[None] | None]:
        """The save in flight and its steps; none in a forked child (the parent's never ends there)."""
        if self._pid != os.getpid():
            self._pid = os.getpid()
            self._inflight, self._running, self._stale_hooks = None, None, []
        return self._inflight, self._running

    def resources(self) -> ReusedIOResources:
        """This Checkpointer's staging pool and backends, the lock a save or load holds while
        it uses them, its cleanup of superseded files and its block checksum size, as a save
        driven from outside api.py sees them (``ckptio.DcpWriter``)."""
        return self._resources

    def _finish_cleanup(self) -> None:
        """Wait for the previous save's removal of superseded files (saving/cleanup.py)."""
        self._resources.cleanup.finish()

    @property
    def staging_nbytes(self) -> int:
        """Host memory the staging pool holds now: 0 before the first save or load and after
        close(); Options.pool_bytes at most, less for a smaller state (what its save, load or
        prepare(state=) stages, in whole buffers), or more once an async save has grown it (up
        to this rank's share of Options.host_budget_bytes, the budget of its host)."""
        pool = self._resources.pool
        return 0 if pool is None else pool.nbytes

    def prepare(self, path: str | os.PathLike[str] | None = None, state: Any = None, *,
                wait: bool | None = None) -> tuple[list[int], bool]:
        """Allocate and pre-fault the staging pool and start the I/O backend now, for the
        store of ``path``: call at startup so the first save or load does not pay for it (an
        ``s3://`` path: its boto3 client is made too, a visible part of a fresh process's
        first load: docs/BENCH_S3.md, "the client made at a job's start"; nothing is sent to
        the store). With ``state``: size the pool for async saves of it, as the first async
        save would (within Options.host_budget_bytes), so the first one returns at copy speed
        too. ``wait``: return only once every page is faulted in (and the pool pinned where
        the backend pins it); by default (None) so without a state, and with a state not: the
        pages are faulted in on the pool's own thread, buffer by buffer, while the caller goes
        on, and a save that comes before the end uses the buffers already faulted in and
        waits only for the ones it needs (CheckpointManager.restore() prepares so).
        -> the sizes of the data files a save of ``state`` writes and whether any of its
        tensors is on a CUDA device (([], False) without a state)."""
        planned: tuple[list[int], bool] = ([], False)
        if state is not None:  # first: the pool is then made once, at its grown size
            planned = self.planned(state)
            self._resources.fit(planned[0])
        store = None if path is None else self._resources.served(store_for(path, self.options))
        self._resources.prepare(store, wait=state is None if wait is None else wait,
                                whole=planned[0])  # a pool no larger than the state's files
        return planned

    def planned(self, state: Any) -> tuple[list[int], bool]:
        """The sizes of the data files a save of ``state`` writes, and whether a tensor of it
        is on a CUDA device, planned as its save plans: that save reuses the plan."""
        return save_session.planned_files(state, self.options.max_file_bytes, self._plan_cache)

    def close(self, timeout: float | None = None) -> None:
        """Wait for a save in flight, free the staging pool and stop I/O threads; the
        Checkpointer stays usable. A background error nobody has waited for is raised here.
        ``timeout``: SaveTimeoutError if the save in flight has not finished within that many
        seconds (naming the rank and the file it waits for); then nothing is freed (the save
        still uses the pool): close() again later."""
        timed_out = False
        timeout = seconds_to_wait("Checkpointer.close", timeout)
        try:
            self._settle(timeout)
        except SaveTimeoutError:
            timed_out = True
            raise
        finally:
            if not timed_out:
                self._resources.free()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def save(self, state: Any, path: str | os.PathLike[str], *, allow_pickle: bool = False,
             process_group: Any = None, metrics: Mapping[str, Any] | None = None,
             metadata: Mapping[str, Any] | None = None,
             base: str | os.PathLike[str] | None = None, overwrite: bool | None = None) -> SaveResult:
        """Write ``state`` to ``path``; returns once every byte is durable and committed
        (with many ranks: a collective, see async_save). ``metrics`` (str -> number) and
        ``metadata`` (str -> JSON) are stored in the manifest (stepmeta.py), read back without
        the tensors by ckptio.read_metadata(path). With many ranks rank 0's are stored; each
        rank checks its own before the save starts, so give every rank valid ones (a
        CheckpointManager checks rank 0's on behalf of all).
        ``base``: a delta save against that checkpoint (a sibling of ``path``, self-contained):
        a chunk equal to the base's is referenced, not written; a changed one may be stored as
        its XOR with the base's, compressed (Options.compression). Loading it reads the base
        too, so keep the base while the delta is kept.
        ``overwrite``: a checkpoint committed at ``path`` is replaced (atomically: the old one
        stays whole until this one commits), with a warning saying so (None, the default) or
        as asked (True: logged at INFO, e.g. Lightning's ``last.ckpt`` every epoch); False
        refuses (CheckpointLockedError, nothing written) if ``path`` holds a committed
        checkpoint once this save holds its lock, e.g. one another process committed while this
        save waited for it (a CheckpointManager never replaces a committed step)."""
        return self._start(state, path, lazy=False, optimizers=(), if_busy="wait",
                           allow_pickle=allow_pickle, process_group=process_group,
                           grow_staging=False, user_meta=stepmeta.encode(metrics, metadata),
                           base=base, overwrite=overwrite).wait()

    def async_save(
        self,
        state: Any,
        path: str | os.PathLike[str],
        *,
        lazy: bool = False,
        optimizers: Sequence[torch.optim.Optimizer] = (),
        after_step: Sequence[torch.nn.Module | torch.Tensor] = (),
        if_busy: str = "wait",
        allow_pickle: bool = False,
        process_group: Any = None,
        metrics: Mapping[str, Any] | None = None,
        metadata: Mapping[str, Any] | None = None,
        base: str | os.PathLike[str] | None = None,
        overwrite: bool | None = None,
    ) -> SaveHandle:
        """Start saving ``state`` to ``path``; bytes are persisted and committed in the background.

        Eager (default): returns once every tensor's bytes are copied into the staging pool (a
        state larger than the pool waits for the disk while the pool is full); the state may
        change from then on. Lazy (``lazy=True``): returns once the tensors that ``optimizers``
        do not own are copied; the rest is copied in the background while forward and backward
        run, and each optimizer's next step() waits until that copy is done. Do not change
        tensors an optimizer owns other than through its step() before then (CkptError if so).
        after_step (lazy only): modules (their parameters, not buffers: forward may change
        those) or tensors that, like the optimizers' own, change only in or after an
        optimizer's step, e.g. the bf16 weights of mixed-precision training that are copied
        from fp32 masters after ``opt.step()``; they are copied in the background too.
        if_busy: "wait" for a save still running, or "skip" (warn and return a skipped handle).
        Call ``wait()`` on the handle for the result; a background error is raised there, or
        else by the next save.
        With torch.distributed initialised (or ``process_group`` given), every rank calls this
        together: each writes its own part, replicas once, and the coordinator commits after
        every rank's bytes are durable. A failure on any rank raises on every rank.
        Staging: the first async save of a state larger than the pool grows it before its
        capture, up to Options.host_budget_bytes, the new pages faulted in on the pool's own
        thread buffer by buffer ahead of the copies (docs/BENCH_LOOP.md, "The first save");
        prepare(state=) (or CheckpointManager.restore()) does it before the first save, in
        the background, so that save copies into memory already faulted in.
        metrics, metadata, base, overwrite: as save().
        """
        return self._start(state, path, lazy=lazy, optimizers=optimizers,
                           after_step=after_step_tensors(after_step, lazy), if_busy=if_busy,
                           allow_pickle=allow_pickle, process_group=process_group,
                           grow_staging=True, user_meta=stepmeta.encode(metrics, metadata),
                           base=base, overwrite=overwrite)

    def _start(self, state: Any, path: str | os.PathLike[str], *, lazy: bool,
               optimizers: Sequence[torch.optim.Optimizer], if_busy: str, allow_pickle: bool,
               process_group: Any, grow_staging: bool,
               user_meta: dict[str, Any] | None = None,
               base: str | os.PathLike[str] | None = None,
               after_step: tuple[torch.Tensor, ...] = (), overwrite: bool | None = None) -> SaveHandle:
        started = time.perf_counter()
        if if_busy not in ("wait", "skip"):
            raise CkptError(f"async_save(if_busy={if_busy!r}): use 'wait' or 'skip'")
        if lazy and not optimizers:
            raise CkptError("async_save(lazy=True) needs optimizers=[...]: their step() is what "
                            "must wait for the capture")
        path = checkpoint_path(path)
        group = self._ranks.group(process_group, self.options)
        if group.size > 1 and if_busy == "skip":
            raise CkptError("async_save(if_busy='skip') is not available with many ranks: ranks "
                            "could decide differently and the save would hang; use 'wait'")
        previous, _ = self._in_flight()
        if previous is not None and not previous.done() and if_busy == "skip":
            warnings.warn(f"ckptio: save to {path} skipped: the save to {previous.path} is still "
                          "running (if_busy='skip')", stacklevel=2)
            return skipped_handle(path)
        previous_error: BaseException | None = None
        try:
            self._settle()
        except BaseException as exc:
            said = restated(exc, f"{path} was not saved (nothing of it was written): the save "
                                 f"before it, to {previous.path if previous else '?'}, failed "
                                 "in the background: ")
            if said is exc:  # an interrupt while waiting: itself
                raise
            said.__cause__ = exc  # the manager names the step from it (managing/inflight.py)
            if group.size == 1:
                raise said from exc
            previous_error = said
        self._stale_hooks = [c for c in self._stale_hooks if not c.remove_hooks()]
        store = self._resources.served(store_for(path, self.options))
        packing = packed.packing_for(self.options, store, base,
                                     block_nbytes=self._resources.block_nbytes)
        piece = piece_of(current_group(process_group))
        meta = {**save_session.default_meta(), **(user_meta or {}),
                **({} if piece is None else {"piece": {"rank": piece[0], "world_size": piece[1]}})}
        context = save_context.SaveContext(
            group=group, store=store, options=self.options,
            resources=self._resources, cleanup=self._resources.cleanup,
            commits=self._resources.commits,
            workers=self._resources.workers, memory=self._ranks.memory(group),
            plan_cache=self._plan_cache, meta=meta, piece=piece is not None,
            block_nbytes=self._resources.block_nbytes,
            allow_pickle=allow_pickle,
            lazy=lazy, optimizers=tuple(optimizers), after_step=after_step, started=started,
            previous_error=previous_error, grow_staging=grow_staging, packing=packing,
            overwrite=overwrite)
        save = save_session.begin(context, state)
        self._inflight, self._running = save.control, save.running
        at_exit.track(save.running, save.control)
        save.capture_here()
        return save.handle

    def settle(self, timeout: float | None = None) -> None:
        """Wait for the async save in flight (if any); raise its error if nobody has seen it
        yet (the next save would raise it first). A CheckpointManager calls it before it
        chooses a delta's base among the committed steps. ``timeout``: SaveTimeoutError if it
        has not finished within that many seconds (it goes on; settle again later)."""
        self._settle(seconds_to_wait("Checkpointer.settle", timeout))

    def _settle(self, timeout: float | None = None) -> None:
        """Wait for the save in flight; raise its error if nobody has seen it yet."""
        control, running = self._in_flight()
        if running is not None:
            concurrent.futures.wait([running], timeout)
            if not running.done():
                assert control is not None  # internal: set together with its steps
                raise control.timed_out(timeout)
        if control is not None:
            if not control.remove_hooks():  # another thread: the trainer's next save removes them
                self._stale_hooks.append(control)
            self._inflight, self._running = None, None
            error = control.unreported_error()
            if error is not None:
                raise error

    def manifest(self, path: str | os.PathLike[str], *, allow_pickle: bool = False) -> Manifest:
        """What the checkpoint at ``path`` holds, as a load sees it: its committed manifest, or
        the one made of a DCP checkpoint there (``ckptio ls``)."""
        store, file = self._resources.located(path)
        return loading.open_checkpoint(self._resources, store, file,
                                       allow_pickle=allow_pickle).record

    def read(self, path: str | os.PathLike[str], record: Manifest, reads: Sequence[Read], *,
             verify: bool | None = None) -> int:
        """Fill the destinations of ``reads`` (regions of ``record``'s entries, as
        ``manifest(path)`` gave it) in one coalesced pass through this Checkpointer's pool and
        the store's files, checksums checked unless ``verify`` is False (default
        Options.verify). For drivers that plan their own reads (ckptio.DcpReader). -> bytes read."""
        store, _file = self._resources.located(path)
        verify = self.options.verify if verify is None else verify
        return loading.read_fn(self._resources, store, record, verify=verify)(list(reads))

    def verify(self, path: str | os.PathLike[str], *, record: Manifest | None = None,
               progress: Callable[[int], None] | None = None) -> int:
        """Check everything a load checks, without loading; -> bytes read.

        The manifest (decoded and validated: bounds, chunks tiling each tensor, keys, tree),
        every inline value (decoded), every data file's size, and every stored byte against its
        checksum and its block checksums. So a checkpoint that verifies loads (pickled values
        still need allow_pickle=True, and per-rank values on another number of ranks
        per_rank_from). Nothing is copied out or unpickled; memory stays within the staging pool.
        ``progress``: called with the bytes read after each batch of entries (``ckptio verify``'s
        bar); without it everything is read in one pass. ``record``: what ``manifest(path)``
        gave, when the caller has it (not read again).
        """
        store, file = self._resources.located(path)
        opened = (loading.Opened(store, file, record) if record is not None else
                  loading.open_checkpoint(self._resources, store, file, allow_pickle=False))
        return loading.verify(self._resources, opened, progress)

    def load(
        self,
        path: str | os.PathLike[str],
        state: Any = None,
        *,
        strict: bool = True,
        keys: KeyFilter = None,
        cast: bool = False,
        verify: bool | None = None,
        allow_pickle: bool = False,
        per_rank_from: RankPolicy = None,
        process_group: Any = None,
        record: Manifest | None = None,
    ) -> Any:
        """Load into ``state`` in place (returns a LoadReport), or, with no state, return a new one.

        Every tensor leaf (plain tensor, DTensor, TensorShard, FlatShard) gets the region of the
        saved tensor it holds, whatever layout and number of ranks saved it; only the byte ranges
        that overlap it are read. With torch.distributed initialised (or ``process_group``
        given) an in-place load is a collective: a failure on any rank raises on every rank; a
        fresh one only over a ``process_group`` given (each byte read by one rank, sent on).
        strict: missing or unexpected keys raise (else they are only reported).
        keys: load only these keys (a key or a prefix of keys) or those a callable accepts.
        cast: allow a dtype conversion where the destination's dtype differs.
        verify: check checksums (default Options.verify).
        allow_pickle: unpickle objects saved with allow_pickle=True (only for trusted files).
        ``path`` may be a file written by ``torch.save(obj, path)`` (default zip format): its
        pickle is decoded with an allow-list (like ``torch.load(weights_only=True)``) and its
        tensors are read like any checkpoint's, checked against the zip's CRC-32s. A file
        holding other Python objects is refused (PickleRefusedError) unless
        ``allow_pickle=True`` and no ``state``: then this returns
        ``torch.load(path, weights_only=False, map_location="cpu")``, which runs its pickle.
        per_rank_from: which saved rank's value a per-rank key (saved differently by each rank,
        e.g. RNG state) gets on this rank: by default the same rank, which needs the same
        number of ranks; or a saved rank, a mapping or a function new rank -> saved rank.
        record: what ``manifest(path)`` returned just before, if the caller has it (not reread).
        """
        started = time.perf_counter()
        path = checkpoint_path(path)
        ranks = LoadRanks.of(self._ranks, process_group, path, self.options, keys,
                             in_place=state is not None)
        request = loading.LoadRequest(
            strict=strict, keys=keys, cast=cast,
            verify=self.options.verify if verify is None else verify, allow_pickle=allow_pickle,
            per_rank_from=per_rank_from, rank=ranks.rank, world_size=ranks.world_size,
            agree_unexpected=ranks.keys, shared_reads=ranks.reads, shared_manifest=ranks.manifest,
            record=record)
        try:
            self._settle()  # a save of ours in flight finishes first (and uses the same group)
            store, file = self._resources.located(path)
            result = loading.load(self._resources, store, file, state, request)
        except BaseException as exc:
            ranks.failed(exc)
            if state is not None and isinstance(exc, StorageIOError):  # reads may have begun
                raise restated(exc, PARTLY_FILLED) from exc.__cause__
            raise
        ranks.done()
        if state is None:
            return result
        return dataclasses.replace(result, seconds=time.perf_counter() - started)
