"""The Store of a checkpoint in a local (or mounted) directory: the first implementation of
the contract in store_contract.py, for O_DIRECT / io_uring backends.

Commit: data files get names unique to one save (data-<save_id>-...), are written and fsynced
by the backend; the manifest is written to a temporary name, fsynced and renamed over
manifest.json (the atomic commit point); the directory (and its parent) is fsynced. So a save
into a directory that holds a checkpoint never harms it before the new one is committed, and a
kill at any moment leaves the last committed manifest and every file it names intact.

One save at a time per directory: exclusive() takes the flock lock of dirlock.py. Behind it,
two more rules keep the committed checkpoint whole where the lock is not honoured (no locks,
locks local to one client such as NFS with local_lock=flock or Lustre with localflock, or a
writer that ignores it): the commit is conditional (the manifest is replaced only if it is
still the one seen when the lock was taken), and a cleanup never removes a file the manifest
committed at that moment names (steps.remove_unreferenced). One window stays open: a commit
between another save's check and its rename. An object store needs the same rule as a
conditional write of the manifest (If-Match on its ETag, If-None-Match: * when there is none).

Owns: the directory's layout (path_of), the atomic commit, reading the committed manifest,
listing, sizes and removal of files there. Does not own: the lock itself (dirlock.py), the
claim that makes the commit conditional (local_claim.py), a file written and fsynced by path
(durable.py), the messages about what a directory holds instead (missing_manifest.py), the
order of a save (steps.py, saving/save_session.py), data bytes (the IOBackend,
saving/persist.py).
"""

from __future__ import annotations

import os
import shutil
import stat
import sys
from collections.abc import Iterable

from ckptio import io
from ckptio.errors import (
    CheckpointLockedError,
    CheckpointNotFoundError,
    CkptError,
    StorageIOError,
)
from ckptio.format.manifest import MANIFEST_NAME
from ckptio.io.posix import os_hint
from ckptio.options import Options
from ckptio.storage import missing_manifest, steps
from ckptio.storage.files import Capabilities
from ckptio.storage.local import dirlock
from ckptio.storage.local.durable import fsync_path, write_durably
from ckptio.storage.local.local_claim import LocalClaim, digest_of
from ckptio.storage.local.mapped import Mappings
from ckptio.storage.local.local_urls import shm_url
from ckptio.storage.steproot import is_tc_file
from ckptio.storage.store_contract import (
    TMP_PREFIX,
    Exclusive,
    TreeStore,
    claim_of,
    exact,
    is_ours,
    new_save_id,
    plain_name,
)

__all__ = ["LocalStore", "committed_at", "holds_tc"]


class LocalStore:
    """One checkpoint directory. Cheap to make (no I/O until a method is called). A TreeStore
    (store_contract.py): a sub-location is a subdirectory; write_file and move_to are renames."""

    backend_kind = "local"

    def __init__(self, directory: str | os.PathLike[str], *,
                 mappings: Mappings | None = None) -> None:
        """``mappings``: where a memory tier's step keeps its files' mappings (its root's:
        LocalRoot.store_at); None: nothing is mapped (storage/files.mappable)."""
        text = os.fspath(directory)
        self.directory = os.fsdecode(text) if isinstance(text, bytes) else text
        self.location = self.directory
        self.mappings = mappings

    def __repr__(self) -> str:
        return f"LocalStore({self.directory!r})"

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(direct_io=True, registered_buffers=True, rename=True, locking=True,
                            conditional_commit=True, filesystem=self.directory)

    # -- the location ---------------------------------------------------------------------

    def prepare(self) -> None:
        self.make()

    def make(self) -> bool:
        """prepare(); -> whether this call created the directory."""
        return dirlock.make_dir(self.directory)

    def remove_if_empty(self) -> None:
        """Remove the directory if it holds nothing (after a failed first save into it)."""
        try:
            os.rmdir(self.directory)
        except OSError:  # not empty (another save's files, the user's) or gone: it stays
            pass

    def exclusive(self, if_locked: str) -> LocalClaim:
        held = dirlock.lock(self.directory, if_locked)
        try:
            return LocalClaim(held, self._digest())
        except BaseException:
            dirlock.unlock(held)
            raise

    def path_of(self, name: str) -> str:
        return os.path.join(self.directory, plain_name(name, self.location))

    def backend(self, options: Options) -> io.IOBackend:
        return io.create(options.io_backend, depth=options.io_depth,
                         direct_io=options.direct_io)

    def read_file(self, name: str, offset: int = 0, nbytes: int | None = None) -> bytes:
        path = self.path_of(name)
        try:
            with open(path, "rb") as file:
                file.seek(offset)
                data = file.read(-1 if nbytes is None else nbytes)
        except OSError as exc:
            raise StorageIOError(f"reading {path} failed: {exc.strerror or exc}") from None
        return exact(data, nbytes, path, offset)

    # -- the commit -----------------------------------------------------------------------

    def commit(self, manifest: bytes, save_id: str, held: Exclusive | None = None) -> None:
        """Make the save durable and visible in one rename; with ``held``, only if the manifest
        there is still the one seen when the lock was taken. If the directory's fsync after the
        rename fails, the rename is undone (_take_back): a save that raises is not committed."""
        claim = claim_of(held, LocalClaim, os.path.abspath(self.directory))
        tmp_name = f"{TMP_PREFIX}{save_id}.tmp"
        tmp = self.path_of(tmp_name)
        try:
            write_durably(tmp, manifest)
            previous = self._committed_bytes()
            if claim is not None:
                claim.check_unchanged(previous, self.location)
            os.rename(tmp, os.path.join(self.directory, MANIFEST_NAME))
        except OSError as exc:
            error = StorageIOError(f"committing the manifest of {self.location} failed: "
                                   f"{exc.strerror or exc}; the previous checkpoint there, if "
                                   f"any, is untouched; {os_hint(exc)}")
            steps.remove_quietly(self, [tmp_name], error)
            raise error from None
        except CheckpointLockedError as exc:
            steps.remove_quietly(self, [tmp_name], exc)
            raise
        try:
            fsync_path(self.directory)
            fsync_path(os.path.dirname(os.path.abspath(self.directory)))
        except OSError as exc:
            raise self._take_back(previous, save_id, exc) from None

    def _take_back(self, previous: bytes | None, save_id: str, exc: OSError) -> StorageIOError:
        """After the manifest's rename, the directory's fsync failed (``exc``): whether the
        rename reaches the disk is unknown. Undo it (the previous manifest written back, or
        none), so that what the save's error says is what a listing, a load and a retry find:
        not committed. -> the error to raise (saying so, or, if the undo fails too, that the
        new checkpoint is visible but not known to be durable)."""
        failed = (f"committing the manifest of {self.location} failed: fsync of the directory "
                  f"after the manifest's rename: {exc.strerror or exc}")
        target = os.path.join(self.directory, MANIFEST_NAME)
        back = self.path_of(f"{TMP_PREFIX}{save_id}.back.tmp")
        try:
            if previous is None:
                os.rename(target, back)
            else:
                write_durably(back, previous)
                os.rename(back, target)
        except OSError as undo:
            steps.remove_quietly(self, [os.path.basename(back)], undo)  # a copy not renamed
            return StorageIOError(
                f"{failed}; taking it back failed too ({undo.strerror or undo}): the new "
                f"checkpoint at {self.location} is visible and loads, but it is not known to be "
                "durable (a crash may lose it); the storage is failing: check it (dmesg) "
                "before saving there again")
        error = StorageIOError(
            f"{failed}; the manifest was taken back, so this save is not committed and the "
            "previous checkpoint there, if any, is in place; save again (the same step may be "
            "retried), and if it keeps failing check the storage (dmesg)")
        steps.remove_quietly(self, [os.path.basename(back)], error)  # the manifest taken back
        try:
            fsync_path(self.directory)
        except OSError:  # the undo's own: either manifest on disk names a whole checkpoint
            pass
        return error

    def _committed_bytes(self) -> bytes | None:
        """The manifest committed now (None: none, or unreadable)."""
        try:
            with open(os.path.join(self.directory, MANIFEST_NAME), "rb") as f:
                return f.read()
        except OSError:
            return None

    def _digest(self) -> bytes | None:
        return digest_of(self._committed_bytes())

    # -- reading --------------------------------------------------------------------------

    def read_manifest(self) -> bytes:
        path = self.directory
        if not os.path.exists(path):
            broken = dirlock.broken_link(path)
            raise CheckpointNotFoundError(
                f"no checkpoint at {path}: {broken}; fix the link or give its real path"
                if broken else f"no checkpoint at {shm_url(path)}: the path does not exist"
                f"{_nearby(path)}")
        if not os.path.isdir(path):
            raise CheckpointNotFoundError(f"{path} is a file, not a ckptio checkpoint directory"
                                          f"{missing_manifest.file_hint(os.path.basename(path))}")
        file = os.path.join(path, MANIFEST_NAME)
        try:
            with open(file, "rb") as f:
                return f.read()
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise StorageIOError(f"cannot read {file}: {exc.strerror or exc}") from None
        raise self._no_manifest()

    def in_flight(self) -> tuple[str | None, str | None, str | None]:
        """The save its lock file names (store_contract.TellsInFlight; dirlock.in_flight)."""
        return dirlock.in_flight(self.directory)

    def _no_manifest(self) -> CkptError:
        try:
            names = sorted(os.listdir(self.directory))
        except OSError as exc:
            return StorageIOError(f"cannot list {self.location}: {exc.strerror or exc}")
        saving, ended, elsewhere = self.in_flight()
        return missing_manifest.no_manifest(
            shm_url(self.location), names,  # a memory tier's step: as the user names it
            lambda name: os.path.isfile(os.path.join(self.directory, name, MANIFEST_NAME)),
            lambda name: holds_tc(os.path.join(self.directory, name)), saving, ended,
            elsewhere=elsewhere)

    def sizes(self, names: Iterable[str]) -> dict[str, int]:
        out: dict[str, int] = {}
        for name in names:
            file = self.path_of(name)
            try:
                info = os.stat(file)
            except (FileNotFoundError, NotADirectoryError):
                continue
            except OSError as exc:
                raise StorageIOError(f"cannot stat {file}: {exc.strerror or exc}") from None
            if stat.S_ISREG(info.st_mode):
                out[name] = info.st_size
        return out

    def names(self) -> list[str]:
        try:
            listing = os.listdir(self.directory)
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError as exc:
            raise StorageIOError(f"cannot list checkpoint directory {self.location}: "
                                 f"{exc.strerror or exc}") from None
        return sorted(name for name in listing if is_ours(name))

    def remove(self, names: Iterable[str]) -> list[str]:
        failed: list[str] = []
        for name in names:
            try:
                os.unlink(self.path_of(name))
            except FileNotFoundError:
                pass
            except (OSError, CkptError) as exc:
                failed.append(f"{name}: {getattr(exc, 'strerror', None) or exc}")
        return failed


    # -- the tree (store_contract.TreeStore) --------------------------------------------------------

    def child(self, name: str) -> LocalStore:
        return LocalStore(os.path.join(self.directory, plain_name(name, self.location)))

    def entries(self) -> list[str]:
        try:
            return sorted(os.listdir(self.directory))
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError as exc:
            raise StorageIOError(f"cannot list {self.location}: {exc.strerror or exc}") from None

    def write_file(self, name: str, data: bytes | memoryview) -> None:
        """A temporary file written and fsynced, renamed over ``name``, the directory fsynced."""
        path = self.path_of(name)
        self.make()
        tmp = self.path_of(f"{TMP_PREFIX}{new_save_id()}.tmp")
        try:
            write_durably(tmp, data)
            os.replace(tmp, path)
            fsync_path(self.directory)
        except OSError as exc:
            steps.remove_quietly(self, [os.path.basename(tmp)], exc)
            raise StorageIOError(f"writing {path} failed: {exc.strerror or exc}") from None

    def read_into(self, name: str, into: memoryview, offset: int = 0) -> int:
        path = self.path_of(name)
        done = 0
        try:
            with open(path, "rb", buffering=0) as file:
                file.seek(offset)
                while done < len(into):
                    got = file.readinto(into[done:])
                    if not got:
                        break
                    done += got
        except OSError as exc:
            raise StorageIOError(f"reading {path} failed: {exc.strerror or exc}") from None
        return done

    def remove_tree(self) -> list[str]:
        failed: list[str] = []

        def note(_func: object, path: str, exc: object) -> None:
            error = exc[1] if isinstance(exc, tuple) else exc
            failed.append(f"{path}: {getattr(error, 'strerror', None) or error}")

        if not os.path.lexists(self.directory):
            return []
        if sys.version_info >= (3, 12):
            shutil.rmtree(self.directory, onexc=note)
        else:
            shutil.rmtree(self.directory, onerror=note)
        return failed

    def move_to(self, target: TreeStore) -> None:
        """One rename of the directory (what ``target`` held removed first)."""
        if not isinstance(target, LocalStore):
            raise CkptError(f"cannot move {self.location} to {target.location}: another kind "
                            "of store (copy it instead)")
        problems = target.remove_tree()
        try:
            if problems:
                raise OSError(f"removing what it held failed: {'; '.join(problems)}")
            os.makedirs(os.path.dirname(os.path.abspath(target.directory)), exist_ok=True)
            os.replace(self.directory, target.directory)
            fsync_path(os.path.dirname(os.path.abspath(target.directory)))
        except OSError as exc:
            raise StorageIOError(f"moving {self.location} to {target.location} failed: "
                                 f"{exc.strerror or exc}") from None


def _nearby(path: str) -> str:
    """missing_manifest.nearby for a local path that does not exist, for its first missing
    component (``run7/step-12`` where ``run7`` is missing: the names spelled like ``run7``)."""
    parent, name = os.path.split(os.path.normpath(path))
    while parent and not os.path.isdir(parent):
        parent, name = os.path.split(parent)
    try:
        near = missing_manifest.nearby(name, os.listdir(parent or "."))
    except OSError:
        return ""
    return near.replace("; did you mean", f"; {name}: did you mean", 1) if near and \
        name != os.path.basename(os.path.normpath(path)) else near


def committed_at(directory: str) -> bool:
    """``steps.is_committed(LocalStore(directory))`` as one stat, for a listing of many steps:
    whether a regular file named MANIFEST_NAME is in ``directory`` (LocalStore.sizes' rule:
    missing is False, another failure StorageIOError)."""
    file = os.path.join(directory, MANIFEST_NAME)
    try:
        info = os.stat(file)
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError as exc:
        raise StorageIOError(f"cannot stat {file}: {exc.strerror or exc}") from None
    return stat.S_ISREG(info.st_mode)


def holds_tc(path: str) -> bool:
    """Whether directory ``path`` holds a torch_checkpointing checkpoint's files
    (steproot.is_tc_file); False where it cannot be listed (a load there says why)."""
    try:
        with os.scandir(path) as it:
            return any(is_tc_file(e.name) for e in it)
    except OSError:
        return False
