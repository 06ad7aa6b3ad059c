"""A CheckpointManager's steps in a local (or mounted) directory: LocalRoot.

Steps are real directories named ``step-N``; whether each is committed its Store's rule says
(local_store.committed_at). A
retention hides a dropped step by renaming it ``.deleting-step-<N>-<hex>`` (atomic), fsyncs
the directory, and only then removes it (shutil.rmtree, on the manager's thread): a kill never
leaves a half-deleted step listed, and the next retention finishes such leftovers. On tmpfs
(``slots``: Options.memory_mapped) the newest dropped step's data files are first moved into
``.ckptio-slots`` (storage/local/slots.py), where the next mapped save takes its files from: the
memory tier reuses their pages, a ring of keep_last + 1 steps' worth; ``drop_slots()`` (the
manager's close) removes them.

Owns: LocalRoot (listing, the rename, the fsync, the removal, what a directory holds instead
of steps). Does not own: the hidden names (steproot.py), which steps to keep or restore
(managing/manager.py) or one checkpoint's files (storage/).
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
from collections.abc import Callable, Sequence

from ckptio.errors import StorageIOError
from ckptio.storage.local.local_store import LocalStore, committed_at
from ckptio.storage.local.mapped import MappedFile, Mappings, on_tmpfs
from ckptio.storage.local import runlease
from ckptio.storage.local.runlease import RunLease, not_a_run_directory
from ckptio.storage.local.slots import (
    SLOT_STEPS,
    SLOTS_DIR,
    drop_slots,
    keep_slots,
    make_slots,
    warm_slots,
)
from ckptio.storage.steproot import (
    HIDDEN_PREFIX,
    Listing,
    Nothing,
    Removal,
    Usage,
    hidden_name,
    is_hidden,
    nothing_message,
    step_name,
    step_of,
    warn,
)

__all__ = ["HIDDEN_PREFIX", "LocalRoot", "fsync_dir", "hidden", "is_committed", "remove"]

log = logging.getLogger("ckptio")


class LocalRoot:
    """A directory of ``step-N`` directories (see the module docstring)."""

    def __init__(self, directory: str, *, slots: bool = False) -> None:
        """``slots``: keep a dropped step's data files for later saves, on tmpfs (their
        mappings in ``mappings``, which this root owns and its steps' stores carry)."""
        self.location = directory
        self._joined = (directory, os.path.join(directory, ""))  # (location, with its separator)
        self.slots = slots
        self.mappings = Mappings()
        self._slot_budget: int | None = None  # bytes its steps and slots may hold (bound_slots)

    def bound_slots(self, max_bytes: int) -> None:
        """The memory tier's max_bytes: its slots (kept and made ahead) hold no more than that,
        less the bytes of the steps it holds."""
        self._slot_budget = max_bytes

    def _slot_room(self) -> int | None:
        """Bytes the slots may hold now (None: no bound)."""
        if self._slot_budget is None:
            return None
        held = sum(self.usage(entry.path)[0] for entry in _entries(self.location)
                   if step_of(entry.name) is not None and entry.is_dir(follow_symlinks=False))
        return max(0, self._slot_budget - held)

    def store_at(self, location: str) -> LocalStore:
        """The store of step directory ``location`` (one of this root's), carrying the root's
        mappings where it keeps slots: a save there maps its files into them."""
        return LocalStore(location, mappings=self.mappings if self.slots else None)

    def __repr__(self) -> str:
        return f"LocalRoot({self.location!r})"

    def path(self, step: int) -> str:
        location = self.location
        if location is not self._joined[0]:  # os.path.join's prefix, made once per location
            self._joined = (location, os.path.join(location, ""))
        return f"{self._joined[1]}{step_name(step)}"

    def lease(self, take_over: bool, *, create: bool) -> RunLease | None:
        """LeasedRoot: the run directory's lease (runlease.py), if it exists or ``create`` (a
        manager's first save: its refusal says that save was not made)."""
        refusal = runlease.FIRST_SAVE_REFUSAL if create else runlease.MANAGER_REFUSAL
        return runlease.take(self.location, take_over, create=create, refusal=refusal)

    def scan(self) -> Listing:
        """The step directories, committed and incomplete, ascending."""
        out: Listing = {"committed": [], "incomplete": []}
        for entry in _entries(self.location):
            step = step_of(entry.name)
            if step is not None and entry.is_dir(follow_symlinks=False):
                out["committed" if committed_at(entry.path) else "incomplete"].append(step)
        return {kind: sorted(steps) for kind, steps in out.items()}

    def is_committed(self, step: int) -> bool:
        return is_committed(self.path(step))

    def hide(self, step: int) -> bool:
        """Rename the step out of the listing (atomic); False (and a warning) if that failed."""
        path = self.path(step)
        target = os.path.join(self.location, hidden_name(step))
        try:
            os.rename(path, target)
        except OSError as exc:
            _warn(f"ckptio: retention could not remove {path} ({exc.strerror or exc}); it is "
                  "kept and tried again after the next save")
            return False
        return True

    def removal(self, step: int | None = None) -> Removal | None:
        """Removing every hidden leftover, once the renames are durable (the directory fsynced).
        A hidden step has another name, so a save into ``step`` never waits for it: None."""
        if step is not None:
            return None
        leftovers = hidden(self.location)
        if leftovers and fsync_dir(self.location):
            if self.slots and on_tmpfs(self.location):  # renames only: the thread deletes
                keep_slots(self.location, sorted((_hidden_step(p), p) for p in leftovers),
                           self._slot_room())
                # Here, not on the removal thread: the next save maps the slots only if they
                # are mapped ahead (storage/files.mappable), and it starts right after this
                # pass. Only slots written through the pool cost anything: a mapped save's
                # files are mapped here already.
                warm_slots(self.location, self.mappings)
            return functools.partial(remove, leftovers)
        return None

    def prepare_slots(self, sizes: Sequence[int],
                      on_mapped: Callable[[MappedFile], object] | None = None) -> None:
        """A manager knows its state (prepare): slots of the data files' ``sizes`` for the
        saves before retention drops a step, made and mapped ahead (``on_mapped``: each new
        mapping, page-locked for device copies), so those saves too copy into resident pages
        rather than through the pool. Where no slots are kept: nothing."""
        if not (self.slots and on_tmpfs(self.location)):
            return
        try:
            make_slots(self.location, sizes, SLOT_STEPS + 1, self._slot_room())
        except OSError as exc:  # a full tmpfs, say: the first saves go through the pool
            log.info("ckptio: no slots made ahead in %s (%s)", self.location, exc)
        warm_slots(self.location, self.mappings, on_mapped)

    def drop_slots(self, *, unmap: bool = True) -> None:
        """The manager lets go: the dropped steps' data files kept for its saves are removed,
        and (``unmap``) the idle mappings of its steps' files go; without ``unmap`` (at
        interpreter exit) the files alone."""
        if self.slots:
            drop_slots(self.location, self.mappings if unmap else None)
            if unmap:
                self.mappings.forget()

    def being_deleted(self) -> list[tuple[int, str]]:
        """The hidden step directories not yet removed (ListedRoot)."""
        return [(_hidden_step(p), p) for p in hidden(self.location)]

    def usage(self, where: str) -> Usage:
        """Bytes, files and newest modification time under the directory ``where``."""
        nbytes = files = 0
        newest: float | None = None
        for dirpath, _dirs, names in os.walk(where):
            for name in names:
                try:
                    st = os.lstat(os.path.join(dirpath, name))
                except FileNotFoundError:
                    continue  # removed while listed (a removal running)
                nbytes, files = nbytes + st.st_size, files + 1
                newest = st.st_mtime if newest is None else max(newest, st.st_mtime)
        return nbytes, files, newest

    def nothing_here(self) -> str:
        """Why there is no step to restore, and what the directory holds instead."""
        directory = self.location
        if not os.path.isdir(directory):
            return Nothing(f"no checkpoint to restore: {directory} does not exist (nothing saved "
                           "there yet)", empty=True)
        names = sorted(n for n in os.listdir(directory) if not is_hidden(n) and n != SLOTS_DIR)
        return nothing_message(
            directory, names, itself=is_committed(directory), noun="directory",
            checkpoints=[n for n in names if is_committed(os.path.join(directory, n))])


def _hidden_step(path: str) -> int:
    """The step of a hidden step directory (``.deleting-step-<N>-<hex>``)."""
    return int(os.path.basename(path)[len(HIDDEN_PREFIX):].split("-")[0])


def _warn(message: str) -> None:
    warn(message, stacklevel=3)  # once, through warnings (steproot.warn)


def _entries(directory: str) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(directory) as it:
            return list(it)
    except FileNotFoundError:
        return []
    except NotADirectoryError:
        raise not_a_run_directory(directory) from None
    except OSError as exc:
        raise StorageIOError(f"cannot list checkpoint directory {directory}: "
                             f"{exc.strerror or exc}") from None


def is_committed(path: str) -> bool:
    """Whether the checkpoint at ``path`` has a committed manifest (its Store's rule, as one
    stat: local_store.committed_at; a path-like or bytes ``path`` as LocalStore takes it)."""
    text = os.fspath(path)
    return committed_at(os.fsdecode(text) if isinstance(text, bytes) else text)


def hidden(directory: str) -> list[str]:
    """Steps hidden by a retention and not yet removed (by a removal killed half-way, say)."""
    return [e.path for e in _entries(directory)
            if is_hidden(e.name) and e.is_dir(follow_symlinks=False)]


def remove(paths: list[str]) -> None:
    """The removal thread: failures are logged; the leftover is removed by the next retention."""
    for path in paths:
        try:
            shutil.rmtree(path)
        except OSError as exc:
            log.warning("ckptio: could not remove %s (an old step, already out of the listing): "
                        "%s; the next retention tries again", path, exc)


def fsync_dir(path: str) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        _warn(f"ckptio: could not fsync {path} ({exc.strerror or exc}): old steps already out of "
              "the listing are removed by the next retention")
        return False
    return True

