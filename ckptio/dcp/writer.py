"""``ckptio.DcpWriter``: a ``torch.distributed.checkpoint`` StorageWriter that saves through
ckptio, so that ``dcp.save(state, storage_writer=ckptio.DcpWriter(path))`` (or
``dcp.async_save``) writes an ordinary ckptio checkpoint that ``ckptio.load`` reads in place
into any layout. DCP's planners decide what each rank writes; ckptio writes it.

DCP's calls, in order (docs/design/INTEROP.md 2.3):
  set_up_storage_writer   per-save state; a claim left by a failed save is released;
                          ``use_collectives=False`` is refused (one manifest for all ranks)
  prepare_local_plan      every tensor's dtype checked, so a refusal reaches every rank first
  prepare_global_plan     the coordinator claims the location (Store.exclusive, ``if_locked``)
                          before any rank creates a file, and names the save
  write_data              this rank's items through the staging pool of the process's shared
                          Checkpointer into its own files (removed again if it fails)
  finish                  the coordinator builds the manifest from every rank's results and
                          DCP's metadata, commits it (the commit point), lets go of the claim
A failed save, one save at a time per writer, and what the writer pickles to: on DcpWriter.

Owns: DCP's StorageWriter calls and their order. Does not own: the translation (writeplan.py),
bytes (saving/persist.py), the claim and commit (storage/), the pool (api.Checkpointer).
"""

from __future__ import annotations

import dataclasses
import os
import time
import weakref
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ckptio.dcp import writeplan
from ckptio.errors import CkptError, restated
from ckptio.format import manifest
from ckptio.format.types import WriteItem
from ckptio.options import Options
from ckptio.planning.layout import plan_files
from ckptio.saving.persist import SaveJob
from ckptio.shared import checkpointer
from ckptio.storage import steps
from ckptio.storage.select import checkpoint_path, is_checkpoint_id, store_for
from ckptio.storage.store_contract import Exclusive, Store, check_if_locked, new_save_id
from ckptio.version import __version__

__all__ = ["DcpWriter"]


class _Claim:
    """The coordinator's claim on the location, from prepare_global_plan to finish."""

    def __init__(self) -> None:
        self.held: Exclusive | None = None
        self.store: Store | None = None
        self.save_id: str | None = None

    def release(self, failed: bool = False) -> None:
        held, self.held, self.save_id = self.held, None, None
        if held is not None:
            held.release(failed=failed)


class DcpWriter(StorageWriter):
    """A StorageWriter for ``dcp.save`` / ``dcp.async_save`` that writes a ckptio checkpoint.

    path: a local directory or ``s3://bucket/prefix`` (a ``checkpoint_id`` given to dcp.save
    replaces it). options: ckptio Options (default: ``Options.from_env()`` in the process that
    writes). if_locked: "wait" for another save into ``path``, or "raise"
    CheckpointLockedError. overwrite: False refuses (CkptError, on every rank, before a byte
    is written) a path where a checkpoint is committed, as DCP's FileSystemWriter does and in
    its words ("Checkpoint already exists"; dcp.save raises it in a CheckpointException). Every
    rank passes its own DcpWriter; DCP must run with collectives (the default).

    If any rank fails DCP never calls ``finish``: nothing is committed, the previous
    checkpoint stays, and the files of the ranks that did write are removed after the next
    commit. The claim is then released by the writer's next save, ``reset``, its garbage
    collection or process exit. One save at a time per writer object (as with DCP's
    FileSystemWriter): a writer whose save is still in flight must not be handed to another
    save; make one per save. The writer pickles to ``{path, options, if_locked, overwrite}`` (DCP's
    PROCESS executor sends it to its daemon for every save); pool, backend, claim and threads
    live in the process that uses them."""

    def __init__(self, path: str | os.PathLike[str], *, options: Options | None = None,
                 if_locked: str = "wait", overwrite: bool = True) -> None:
        super().__init__()
        self.path = checkpoint_path(path)
        self.options = options
        self.if_locked = check_if_locked(if_locked)
        self.overwrite = overwrite
        self._start()

    def _start(self) -> None:
        """The per-process part: never pickled."""
        self._claim = _Claim()
        self._rank = 0
        weakref.finalize(self, self._claim.release, failed=True)

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "options": self.options, "if_locked": self.if_locked,
                "overwrite": self.overwrite}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.path, self.options = state["path"], state["options"]
        self.if_locked = check_if_locked(state["if_locked"])
        self.overwrite = bool(state.get("overwrite", True))
        self._start()

    def __repr__(self) -> str:
        return f"DcpWriter({self.path!r}, if_locked={self.if_locked!r})"

    @property
    def checkpoint_id(self) -> str:
        return self.path

    # ------------------------------------------------------------------ DCP's calls, in order

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self._claim.release(failed=True)  # a failed save's, which DCP never finished
        if checkpoint_id is not None:
            self.path = checkpoint_path(checkpoint_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("use_collectives", True) is False:
            raise CkptError(
                f"dcp.save(use_collectives=False) into {self.path}: ckptio.DcpWriter commits one "
                "manifest for all ranks, which needs DCP's collectives; call dcp.save with "
                "use_collectives=True (the default), or use DCP's FileSystemWriter")
        self._claim.release(failed=True)
        self._rank = int(kwargs.get("rank", 0) or 0)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.path)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        store = store_for(self.path, self._options())  # a bad path fails every rank here
        try:
            steps.foreign_there(store, "dcp.save through ckptio.DcpWriter")
        except CkptError as exc:  # overwrite=False: in DCP's words, as FileSystemWriter's
            raise exc if self.overwrite else restated(
                exc, "Checkpoint already exists and self.overwrite=False: ") from None
        if not self.overwrite and steps.is_committed(store):
            raise CkptError(f"Checkpoint already exists and self.overwrite=False: dcp.save into "
                            f"{self.path}: a checkpoint is committed there and the DcpWriter was "
                            "made with overwrite=False (DCP's FileSystemWriter refuses in the "
                            "same words); it is left as it was. Choose another path, or pass "
                            "overwrite=True to replace it")
        writeplan.check_plan(plan, self._rank, self.path)
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        store = store_for(self.path, self._options())
        self._claim.release(failed=True)
        self._claim.held = store.exclusive(self.if_locked)
        self._claim.store = store
        save_id = self._claim.save_id = new_save_id()
        return [_with_storage(plan, writeplan.RankStorage(save_id, rank))
                for rank, plan in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        storage = plan.storage_data
        if not isinstance(storage, writeplan.RankStorage):
            raise CkptError(f"save to {self.path}: the plan carries no ckptio save id (the "
                            "coordinator's writer is not a ckptio.DcpWriter?); every rank must "
                            "pass one")
        results: list[WriteResult] = []
        items: list[WriteItem] = []
        sources: dict[str, torch.Tensor] = {}
        index_of: dict[str, Any] = {}
        for item in plan.items:
            data = planner.resolve_data(item)
            inline = writeplan.inline_value(item, data)
            if isinstance(inline, writeplan.InlineValue):  # stored inline: nothing to write
                results.append(WriteResult(index=item.index, size_in_bytes=0, storage_data=inline))
                continue
            ours, tensor = writeplan.write_item(item, data, self.path, inline)
            items.append(ours)
            sources[ours.key] = tensor
            index_of[ours.key] = item.index
        if items:
            results += self._write(storage, items, sources, index_of)
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def _write(self, storage: writeplan.RankStorage, items: list[WriteItem],
               sources: dict[str, torch.Tensor], index_of: dict[str, Any]) -> list[WriteResult]:
        """This rank's items into its own files, durable; -> DCP's results."""
        owner = checkpointer(self.options)
        resources = owner.resources()
        store = store_for(self.path, owner.options)
        files = plan_files(items, save_id=storage.save_id, rank=storage.rank,
                           max_file_bytes=owner.options.max_file_bytes)
        by_key = {item.key: item for item in items}
        with resources.lock, steps.attempt(store, [f.name for f in files]):
            resources.cleanup.wait_listed()  # the last commit's cleanup has listed its files
            pool, target = resources.files(store)
            job = SaveJob(target, files, sources, pool=pool,
                          algorithm=owner.options.checksum, rank=storage.rank,
                          block_nbytes=resources.block_nbytes)
            try:
                job.capture()
                entries, infos = job.finish()
            except BaseException:
                job.abandon()
                raise
        sizes = {info.name: info.nbytes for info in infos}
        return [WriteResult(index=index_of[e.key], size_in_bytes=e.nbytes,
                            storage_data=writeplan.written(by_key[e.key], e, storage.rank,
                                                           sizes[e.file]))
                for e in entries]

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        claim = self._claim
        if claim.held is None or claim.store is None or claim.save_id is None:
            raise CkptError(f"save to {self.path}: finish() without prepare_global_plan() on "
                            "this writer; nothing was committed")
        store, save_id = claim.store, claim.save_id
        metadata.version = CURRENT_DCP_VERSION
        metadata.storage_data = {r.index: r.storage_data for rs in results for r in rs}
        metadata.storage_meta = self.storage_meta()
        owner = checkpointer(self.options)
        resources = owner.resources()
        try:
            record = writeplan.manifest_of(
                metadata, results, save_id=save_id, algorithm=owner.options.checksum,
                block_nbytes=resources.block_nbytes, meta=_meta(metadata),
                where=store.path_of(manifest.MANIFEST_NAME))
            with resources.lock:
                store.commit(manifest.encode(record), save_id, claim.held)
                resources.cleanup.start(store, [f.name for f in record.files])
        except BaseException:
            claim.release(failed=True)
            raise
        claim.release()

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return is_checkpoint_id(checkpoint_id)

    def _options(self) -> Options:
        return self.options if self.options is not None else Options.from_env()


def _with_storage(plan: SavePlan, storage: writeplan.RankStorage) -> SavePlan:
    return dataclasses.replace(plan, storage_data=storage)


def _meta(metadata: Metadata) -> dict[str, Any]:
    return {"ckptio_version": __version__, "torch_version": torch.__version__,
            "created_unix": time.time(), "dcp": {"version": str(metadata.version)}}
