"""When a checkpoint exists: the commit protocol on a local directory, and the lock that lets
only one save at a time run it on one directory.

Protocol: data files get names unique to one save (data-<save_id>-...), are written and fsynced;
the manifest is written to a temporary name, fsynced and renamed over manifest.json (the atomic
commit point); the directory is fsynced. Only then are files no committed manifest names (an
older save's, or an interrupted save's) removed. So a save into a directory that holds a
checkpoint never harms it before the new one is committed, and a kill at any moment leaves the
last committed manifest and every file it names intact.

One save at a time per directory (see lock()): two processes saving into one path at once each
removed, in their cleanup, the files the other's manifest named, and left no checkpoint at all.
So the committing process (the coordinator, rank 0) holds an exclusive lock on
``<dir>/.ckptio.lock`` from before any data file of its save is created until its cleanup has
chosen what to remove. Behind the lock, two more rules keep the committed checkpoint whole even
where the lock is not honoured (see lock()): the commit is conditional (the manifest is replaced
only if it is still the one seen when the lock was taken), and a cleanup never removes a file the
manifest committed at that moment names. An object store will need the same rule as a
conditional write of the manifest (If-Match on the manifest's ETag, If-None-Match: * when there
is none): there is no rename there, and no lock either.

Owns: directory creation, the directory lock, the commit, finding a committed manifest (and
saying what a directory without one holds), cleaning leftovers.
Does not own: the manifest's content (manifest.py), data bytes (persist.py), which rank takes
the lock (collective.py).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import secrets
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

from ckptio.errors import (CheckpointLockedError, CheckpointNotFoundError, CkptError, CorruptCheckpointError, IncompleteCheckpointError, StorageIOError)
from ckptio.format.manifest import MANIFEST_NAME
from ckptio.format.types import Manifest

log = logging.getLogger("ckptio")
_TMP_PREFIX = ".manifest-"
# exactly the names a ckptio save creates (layout.data_file_name, the manifest's temporary
# name): a cleanup never touches anything else, e.g. a dataset's "data-00000-of-00001.arrow"
_OURS = re.compile(r"(data-[0-9a-f]{19,}-r\d{5}-\d{4}\.bin|\.manifest-[0-9a-f]{19,}\.tmp)", re.ASCII)


def is_ours(name: str) -> bool:
    """True for a file name a ckptio save creates."""
    return _OURS.fullmatch(name) is not None
LOCK_NAME = ".ckptio.lock"
IF_LOCKED = ("wait", "raise")
# flock() errors that mean "this filesystem has no locks" (NFS without lockd, Lustre mounted
# without -o flock, some FUSE filesystems), not "the lock is taken"
_NO_LOCKS = frozenset({errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS})
_NAMED = re.compile(rb'"(data-[^"\\]*)"')  # file names in manifest.json (and any such string)
_DCP_FILE = re.compile(r"^__\d+_\d+\.distcp$")
_TORCH_SUFFIXES = (".pt", ".pth", ".bin")
_HOLDER_READS = 20  # x 10 ms
_unlockable_warned: set[int] = set()  # st_dev of filesystems already reported without locks


def new_save_id() -> str:
    """Time-ordered and unique: milliseconds since the epoch, then random bits."""
    return f"{int(time.time() * 1000):011x}{secrets.token_hex(4)}"


# -- the directory --------------------------------------------------------------------------------

def _make_dir(path: str) -> bool:
    """Create the checkpoint directory if needed; -> whether this call created it. A path that
    is something else is refused first (mkdir would only say "File exists")."""
    if os.path.lexists(path) and not os.path.isdir(path):
        raise StorageIOError(f"checkpoint path {path} exists and is not a directory; "
                             "choose another path")
    created = not os.path.exists(path)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise StorageIOError(f"cannot create checkpoint directory {path}: "
                             f"{exc.strerror or exc}") from None
    return created


@contextlib.contextmanager
def attempt(path: str, names: list[str]) -> Iterator[None]:
    """Create the checkpoint directory; if the body fails, remove the save's files ``names``
    (and the directory, if this call created it and it is empty). Nothing else is touched.
    A failure of that removal is logged and noted on the error, never raised in its place."""
    created = _make_dir(path)
    try:
        yield
    except BaseException as exc:
        if _references(path, names):
            raise  # renamed into place before the failure (e.g. a directory fsync): keep its files
        _remove_quietly(path, names, exc)
        if created:
            with contextlib.suppress(OSError):  # not empty (another save's files): it stays
                os.rmdir(path)
        raise


def _remove_quietly(path: str, names: list[str], cause: BaseException) -> None:
    """discard() after a failure: what cannot be removed is logged and noted on ``cause``."""
    failed = discard(path, names)
    if failed:
        note = (f"ckptio: after this failure, {len(failed)} file(s) of the failed save could not "
                f"be removed from {path} ({failed[0]}); the next save there removes them")
        log.warning("%s", note)
        add_note = getattr(cause, "add_note", None)  # Python >= 3.11; the log line suffices before
        if add_note is not None:
            add_note(note)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- the directory lock ---------------------------------------------------------------------------

@dataclass
class DirLock:
    """The lock of one checkpoint directory, as held by the process that commits there."""

    path: str
    fd: int | None  # None: the filesystem has no locks (logged); the commit check still runs
    created: bool  # lock() created the directory
    seen: bytes | None  # digest of the manifest committed when the lock was taken; None: none

    def check_unchanged(self) -> None:
        """Before the commit: refuse if another save has committed here since the lock was
        taken, which only a save that does not honour the lock can have done."""
        if _manifest_digest(self.path) != self.seen:
            raise CheckpointLockedError(
                f"another save committed {self.path} while this one was writing, so the lock "
                f"{os.path.join(self.path, LOCK_NAME)} is not honoured there (a filesystem whose "
                "locks are local to one machine, e.g. NFS mounted with local_lock, or a writer "
                "that is not ckptio); this save was not committed and the checkpoint there is "
                "kept: give each job its own path, or make them save one at a time")


def lock(path: str, if_locked: str) -> DirLock:
    """Create the directory ``path`` if needed and take its exclusive lock: at once, or, if
    another save holds it, after that save (``if_locked="wait"``, logged) or not at all
    (``"raise"``: CheckpointLockedError naming the holder's host and pid).

    Why flock(2) on a lock file inside the directory:
    - the kernel drops it when its holder exits, however (SIGKILL, OOM; on NFS, once the server
      learns the client is gone: NFSv4 lease expiry, NLM reboot notice), so a crashed save
      never leaves the path locked;
    - it belongs to the open file, not the process: two Checkpointers (or threads) of one
      process exclude each other too, and opening the lock file again (to read the holder)
      does not release it. fcntl/lockf locks belong to the process: a second lock from the same
      process is granted, and closing any descriptor of the file drops them (a trap here);
    - on NFS, Linux (since 2.6.12) implements flock as a whole-file fcntl lock, so it is seen
      by every client. Where a filesystem has no locks at all (ENOLCK, ENOSYS, EOPNOTSUPP: NFS
      without lockd, Lustre without -o flock) the save goes on unlocked, with a warning (once
      per filesystem), and leaves no lock file.
    Only the committing process holds it (collective.exclusive): with many ranks, rank 0 takes
    it before any rank creates a file, in the save's background thread, so a save waiting for
    it or refused reports that at wait(). It is held until the cleanup after the commit has
    chosen what to remove (removing may go on after: no later save's file is on that list).
    The lock file is removed by its holder before it lets go (a checkpoint directory holds only
    manifest.json and data files); so a process that gets the lock of a file already removed
    (it waited on it) drops it and locks the file now at that name. A file left by a killed
    holder is reused, and removed by the next save. (On NFS that check relies on the client's
    lookup cache being current: a stale entry could let two waiters through, which the rules
    below then catch.) The lock file holds the holder's host, pid and start time, for the
    message of a save that waits or is refused.

    Where the lock is not honoured (no locks, locks local to one client such as NFS with
    local_lock=flock or Lustre with localflock, or a writer that ignores it) saves may overlap;
    then DirLock.check_unchanged() refuses to commit a save that started before another one
    committed, and remove_unreferenced() never removes a file of the manifest committed at that
    moment; one window stays open: a commit between another save's check and its rename.
    """
    if if_locked not in IF_LOCKED:
        raise CkptError(f"if_locked={if_locked!r}: use 'wait' or 'raise'")
    created = _make_dir(path)
    fd = _acquire(path, if_locked)
    try:
        return DirLock(path, fd, created, _manifest_digest(path))
    except BaseException:
        if fd is not None:
            _let_go(path, fd)
        raise


def unlock(held: DirLock, *, failed: bool = False) -> None:
    """Let go of the lock (removing the lock file first, still holding it); after a failed save
    into a directory lock() created, remove the directory if nothing else is in it. Never
    raises: a failure here is logged (the save's own outcome is what the caller reports)."""
    if held.fd is not None:
        _let_go(held.path, held.fd)
    if failed and held.created:
        with contextlib.suppress(OSError):  # not empty: it holds other files and stays
            os.rmdir(held.path)


def _acquire(path: str, if_locked: str) -> int | None:
    """The descriptor of the lock file now at ``path``/LOCK_NAME, locked; None: no locks."""
    file = os.path.join(path, LOCK_NAME)
    while True:
        fd = _open_lock_file(path, file)
        try:
            taken = _take(fd, path, if_locked)
            if taken and _still_linked(fd, file):
                _record_holder(fd)
                return fd
        except BaseException:
            os.close(fd)
            raise
        if not taken:  # no locks here, for anyone: the file would only be left behind
            _let_go(path, fd)
            return None
        os.close(fd)  # the holder we waited for removed the file: lock the one now there


def _open_lock_file(path: str, file: str) -> int:
    try:
        os.makedirs(path, exist_ok=True)  # again: a failed first save may have removed it
        return os.open(file, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise StorageIOError(f"cannot open the lock file {file} of checkpoint {path}: "
                             f"{exc.strerror or exc}") from None


def _take(fd: int, path: str, if_locked: str) -> bool:
    """flock ``fd`` exclusively; -> False where the filesystem has no locks."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        pass
    except OSError as exc:
        return _no_locks(fd, path, exc)
    holder = _holder(fd)
    if if_locked == "raise":
        raise CheckpointLockedError(
            f"{path} is being saved by another save ({holder}); this save did not start and "
            "the checkpoint there is untouched: wait for that save to finish, save to another "
            "path, or use Options(if_locked='wait') to wait for it")
    log.warning("ckptio: waiting for the lock of %s: another save is running there (%s)",
                path, holder)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError as exc:
        return _no_locks(fd, path, exc)
    return True


def _no_locks(fd: int, path: str, exc: OSError) -> bool:
    if exc.errno not in _NO_LOCKS:
        raise StorageIOError(f"cannot lock {os.path.join(path, LOCK_NAME)}: "
                             f"{exc.strerror or exc}") from None
    device = os.fstat(fd).st_dev
    if device not in _unlockable_warned:
        _unlockable_warned.add(device)
        log.warning("ckptio: the filesystem of %s has no file locks (%s): saves into one path "
                    "from several processes are not serialised there; only the commit check "
                    "protects the checkpoint", path, exc.strerror or exc)
    return False


def _still_linked(fd: int, file: str) -> bool:
    try:
        now = os.stat(file)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino) and mine.st_nlink > 0


def _record_holder(fd: int) -> None:
    """Who holds the lock, for the message of a save refused or waiting (best effort)."""
    me = {"host": socket.gethostname(), "pid": os.getpid(),
          "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
    except OSError as exc:  # only the message of a waiting save loses the holder's name
        log.debug("ckptio: could not record the lock holder: %s", exc)


def _holder(fd: int) -> str:
    """Who holds the lock of ``fd``'s file; a holder that has just taken it writes its name
    right after, so an empty file is read again for a moment."""
    for _ in range(_HOLDER_READS):
        try:
            who = json.loads(os.pread(fd, 4096, 0))
            host, pid, since = str(who["host"]), int(who["pid"]), str(who["since"])
            break
        except (OSError, ValueError, KeyError, TypeError):
            time.sleep(0.01)
    else:
        return "holder unknown"
    this = " (this process)" if host == socket.gethostname() and pid == os.getpid() else ""
    return f"held by host {host}, pid {pid}{this}, since {since}"


def _let_go(path: str, fd: int) -> None:
    file = os.path.join(path, LOCK_NAME)
    try:
        os.unlink(file)  # still holding it: who locks this file next sees it removed
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("ckptio: could not remove the lock file %s: %s (it is reused by the next "
                    "save)", file, exc.strerror or exc)
    try:
        # Explicitly: a process forked meanwhile (a DataLoader worker) shares this open file,
        # and close() alone would leave the lock held until that process exits.
        fcntl.flock(fd, fcntl.LOCK_UN)
    except OSError as exc:
        if exc.errno not in _NO_LOCKS:
            log.warning("ckptio: unlocking %s failed: %s", file, exc.strerror or exc)
    try:
        os.close(fd)
    except OSError as exc:
        log.warning("ckptio: closing the lock file %s failed: %s", file, exc.strerror or exc)


# -- the commit -----------------------------------------------------------------------------------

def _committed_text(path: str) -> bytes | None:
    """The bytes of manifest.json at ``path``; None if there is none (or it cannot be read)."""
    try:
        with open(os.path.join(path, MANIFEST_NAME), "rb") as f:
            return f.read()
    except OSError:
        return None


def _manifest_digest(path: str) -> bytes | None:
    text = _committed_text(path)
    return None if text is None else hashlib.blake2b(text, digest_size=16).digest()


def _named(text: bytes) -> set[str]:
    """Every file name the manifest ``text`` mentions (a superset: any "data-..." string)."""
    return {m.decode(errors="replace") for m in _NAMED.findall(text)}


def _references(path: str, names: list[str]) -> bool:
    """Whether the committed manifest at ``path`` names any of ``names`` (unique per save)."""
    text = _committed_text(path)
    return text is not None and not _named(text).isdisjoint(names)


def commit(path: str, manifest_bytes: bytes, save_id: str, held: DirLock | None = None) -> None:
    """Make the save durable and visible in one rename; with ``held``, only if the manifest
    there is still the one seen when the lock was taken (see DirLock.check_unchanged)."""
    tmp = os.path.join(path, f"{_TMP_PREFIX}{save_id}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            view = memoryview(manifest_bytes)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        if held is not None:
            held.check_unchanged()
        os.rename(tmp, os.path.join(path, MANIFEST_NAME))
        _fsync_dir(path)
        _fsync_dir(os.path.dirname(os.path.abspath(path)))
    except OSError as exc:
        error = StorageIOError(f"committing the manifest of {path} failed: "
                               f"{exc.strerror or exc}; the previous checkpoint there, if any, "
                               "is untouched")
        _remove_quietly(path, [os.path.basename(tmp)], error)
        raise error from None
    except CheckpointLockedError as exc:
        _remove_quietly(path, [os.path.basename(tmp)], exc)
        raise


# -- reading ------------------------------------------------------------------------------------

def read_committed(path: str) -> bytes:
    """The committed manifest's bytes, or an error saying why there is none and what the path
    holds instead."""
    if not os.path.exists(path):
        raise CheckpointNotFoundError(f"no checkpoint at {path}: the path does not exist")
    if not os.path.isdir(path):
        raise CheckpointNotFoundError(f"{path} is a file, not a ckptio checkpoint directory"
                                      f"{_file_hint(os.path.basename(path))}")
    try:
        with open(os.path.join(path, MANIFEST_NAME), "rb") as f:
            return f.read()
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise StorageIOError(f"cannot read {os.path.join(path, MANIFEST_NAME)}: "
                             f"{exc.strerror or exc}") from None
    raise _no_manifest(path)


def _file_hint(name: str) -> str:
    if name.endswith(".safetensors"):
        return ": a safetensors file, load it with safetensors.torch.load_file"
    if name.endswith(_TORCH_SUFFIXES):
        return ": a torch.save file? load it with torch.load"
    return ""


def _some(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _no_manifest(path: str) -> CkptError:
    """The error for a directory without manifest.json, saying what it holds. Never advises
    deleting it: it may be another library's good checkpoint."""
    try:
        names = sorted(os.listdir(path))
    except OSError as exc:
        return StorageIOError(f"cannot list {path}: {exc.strerror or exc}")
    partial = [n for n in names if is_ours(n) or n == LOCK_NAME]
    if partial:
        return IncompleteCheckpointError(
            f"{path} holds no committed manifest ({MANIFEST_NAME}), only {len(partial)} partial "
            f"file(s) of a ckptio save that was interrupted before its commit, or is still "
            f"running ({_some(partial)}): no committed checkpoint exists here. Load an earlier "
            "checkpoint; saving into this path again replaces the leftovers")
    return CheckpointNotFoundError(f"{path} {_what_it_holds(path, names)}")


def _what_it_holds(path: str, names: list[str]) -> str:
    if ".metadata" in names or any(_DCP_FILE.match(n) for n in names):
        return ("is a torch.distributed.checkpoint (DCP) checkpoint, not a ckptio one: load it "
                "with torch.distributed.checkpoint.load")
    safetensors = [n for n in names if n.endswith(".safetensors")]
    if safetensors:
        return (f"holds safetensors files ({_some(safetensors)}), not a ckptio checkpoint: load "
                "them with safetensors.torch.load_file (a Hugging Face model folder: with "
                "from_pretrained)")
    torch_files = [n for n in names if n.endswith(_TORCH_SUFFIXES)]
    if torch_files:
        return (f"holds torch.save files ({_some(torch_files)}), not a ckptio checkpoint: load "
                "them with torch.load")
    checkpoints = _natural([n for n in names
                            if os.path.isfile(os.path.join(path, n, MANIFEST_NAME))])
    if checkpoints:
        shown = (", ".join(checkpoints) if len(checkpoints) <= 3
                 else f"{checkpoints[0]} ... {checkpoints[-1]}")
        plural = "s" if len(checkpoints) > 1 else ""
        return (f"holds {len(checkpoints)} ckptio checkpoint{plural} ({shown}) but is not one "
                "itself: pass one of them, or use ckptio.CheckpointManager")
    found = f"; it holds {_some(names)}" if names else "; it is empty"
    return f"holds no ckptio checkpoint (no {MANIFEST_NAME}){found}"


def _natural(names: list[str]) -> list[str]:
    """step-9 before step-10."""
    return sorted(names, key=lambda n: [(0, int(p), "") if p.isdigit() else (1, 0, p)
                                        for p in re.split(r"(\d+)", n)])


# -- leftovers ----------------------------------------------------------------------------------

def discard(path: str, names: list[str]) -> list[str]:
    """Remove files of a save that will not be committed (or superseded ones); a file already
    gone is fine. -> "name: why" of each file that could not be removed (never raises: the
    caller reports them beside the error or outcome that matters)."""
    failed: list[str] = []
    for name in names:
        try:
            os.unlink(os.path.join(path, name))
        except FileNotFoundError:
            pass
        except OSError as exc:
            failed.append(f"{name}: {exc.strerror or exc}")
    return failed


def remove_unreferenced(path: str, keep: set[str], listed: threading.Event | None = None) -> list[str]:
    """After a commit: delete data and temporary files the committed manifest does not name.

    ``listed`` is set once the files to remove are chosen: the committing save holds the
    directory lock until then, so no other save has files there yet (a later save may create
    files from then on: they are not on the list). Before removing, the manifest committed at
    that moment is read again and every file it names is kept as well: where the lock is not
    honoured, another save may have committed since. Failures are logged, not raised: the
    checkpoint is already committed and whole; a leftover file is removed by the next save.
    """
    try:
        try:
            chosen = [
                name for name in os.listdir(path)
                if is_ours(name) and name not in keep
            ]
        finally:
            if listed is not None:
                listed.set()
        text = _committed_text(path)
        if text is None:  # no manifest readable: nothing is known to be superseded
            log.warning("ckptio: %s has no readable %s after a commit; removing nothing",
                        path, MANIFEST_NAME)
            return []
        named = _named(text)
        removed = [name for name in chosen if name not in named]
        failed = discard(path, removed)
    except OSError as exc:
        log.warning("ckptio: could not remove superseded files in %s: %s", path, exc)
        return []
    if failed:
        log.warning("ckptio: could not remove superseded files in %s: %s", path, "; ".join(failed))
    return removed


def check_files(path: str, record: Manifest) -> None:
    for info in record.files:
        file = os.path.join(path, info.name)
        try:
            size = os.stat(file).st_size
        except FileNotFoundError:
            raise CorruptCheckpointError(
                f"data file {file} named by the manifest is missing; the checkpoint is damaged: "
                "load an earlier one") from None
        if size < info.nbytes:
            raise CorruptCheckpointError(
                f"data file {file} is truncated: {size} of {info.nbytes} bytes; the checkpoint is "
                "damaged: load an earlier one")
