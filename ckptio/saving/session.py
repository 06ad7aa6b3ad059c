"""One save on this rank, as its background thread runs it: wait until the coordinator holds
the lock of the checkpoint directory, capture and write this rank's part, then conclude with
the other ranks (the coordinator commits, then lets go of the lock).

Owns: the order of those steps, and that every failure on this rank reaches the other ranks
(they wait for it in a collective). Does not own: planning and agreement (api.py,
collective.py), the bytes (persist.py), the directory lock and the commit (collective.py,
commit.py).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch

from ckptio.distributed import collective
from ckptio.storage import commit
from ckptio.saving import persist
from ckptio.saving.handle import SaveHandle
from ckptio.distributed.dist import Group
from ckptio.io import IOBackend
from ckptio.io.stage import BufferPool
from ckptio.format.types import FileInfo, FileLayout, TensorEntry

log = logging.getLogger("ckptio")
Written = collective.Written


@dataclass(frozen=True)
class Finish:
    """What concluding a save with the other ranks needs."""

    group: Group
    agreement: collective.Agreement
    path: str
    algorithm: str
    block_nbytes: int
    meta: dict[str, Any]
    committed: Callable[[list[str]], None]  # on the coordinator, after the commit
    if_locked: str = "wait"  # Options.if_locked

    def exclusive(self) -> AbstractContextManager[commit.DirLock | None]:
        return collective.exclusive(self.group, self.path, self.if_locked)

    def conclude(self, written: Written | None, error: BaseException | None,
                 held: commit.DirLock | None = None) -> None:
        collective.conclude(self.group, self.agreement, written, error, self.path, self.meta,
                            self.algorithm, self.block_nbytes, self.committed, held)

    def failed(self, exc: BaseException, *, locked: bool = False) -> None:
        """Tell the peers this rank failed (conclude re-raises ``exc`` itself: expected).
        ``locked``: this rank has taken part in exclusive() (else it does so first)."""
        try:
            if not locked:
                collective.skip_exclusive(self.group, self.path, exc)
            self.conclude(None, exc)
        except BaseException as other:  # noqa: BLE001 - exc is what the caller reports
            if other is not exc:
                log.warning("ckptio: rank %d could not report its failed save of %s to the "
                            "other ranks: %s", self.group.rank, self.path, other)


@dataclass(frozen=True)
class SaveTask:
    handle: SaveHandle
    files: tuple[FileLayout, ...]
    sources: dict[str, torch.Tensor]
    eager_items: int
    ready: list[Any]
    lazy: bool
    index_of: dict[str, int]  # this rank's keys -> their item index in its plan (results are keyed by it)
    finish: Finish
    lock: threading.Lock  # the Checkpointer's: one save or load at a time
    wait_listed: Callable[[], None]  # the previous cleanup has listed the directory
    resources: Callable[[str], tuple[BufferPool, IOBackend]]


def run(task: SaveTask) -> None:
    """The save thread: write, conclude, and report the outcome on the handle."""
    handle, path = task.handle, task.finish.path
    if task.lazy and task.eager_items == 0:  # leave the GIL to the caller until it returns
        handle._wait_returned()
    concluded = False
    try:
        # exclusive() first: it runs on every rank (a collective), and no rank creates a file
        # before the coordinator holds the lock; attempt() removes this rank's files on failure.
        with (task.lock, task.finish.exclusive() as held,
              commit.attempt(path, [f.name for f in task.files])):
            # The previous save's cleanup must have listed its directory before this save
            # creates files there; its deleting may go on (ext4 frees ~0.2 s/GB).
            task.wait_listed()
            written, error = _write(task)
            concluded = True
            task.finish.conclude(written, error, held)
    except BaseException as exc:  # noqa: BLE001 - kept for wait(), which raises it
        if not concluded:  # e.g. the directory could not be made: the peers still wait
            task.finish.failed(exc, locked=True)
        handle._finished(0, exc)
        return
    handle._finished(handle.progress().nbytes_total)


def _write(task: SaveTask) -> tuple[Written | None, BaseException | None]:
    """This rank's bytes, captured and durable; -> (entries and files, None) or (None, why)."""
    job: persist.SaveJob | None = None
    handle, path = task.handle, task.finish.path
    try:
        pool, backend = task.resources(path)
        job = persist.SaveJob(path, task.files, task.sources, pool=pool, backend=backend,
                              algorithm=task.finish.algorithm, rank=task.finish.group.rank,
                              ready=task.ready, progress=handle.progress(),
                              block_nbytes=task.finish.block_nbytes)
        if task.lazy:
            job.capture(task.eager_items, handle._eager_captured)
        else:
            handle._run_on_caller(job.capture)
        handle._captured()
        entries, infos = job.finish()
        return ({task.index_of[e.key]: e for e in entries}, infos), None
    except BaseException as exc:  # noqa: BLE001 - returned: every rank must hear of it
        if job is not None:
            job.abandon()
        return None, exc
