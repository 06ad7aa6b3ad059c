"""The lock that lets only one save at a time commit into one local directory.

The committing process (the coordinator, rank 0) holds an exclusive flock(2) on
``<dir>/.ckptio.lock`` from before any data file of its save is created until its cleanup has
chosen what to remove, so two saves into one path cannot remove each other's files. Why flock,
what happens on NFS and on filesystems without locks, and the lock file's life:
docs/BEHAVIOUR.md, "ckptio.storage.local.dirlock".

Call order: ``lock(path, if_locked)`` (creates the directory if needed; waits, trying again
until a save its caller abandoned gives up (storage/abandon.py), or raises
CheckpointLockedError naming the holder) -> the save writes and commits -> ``unlock(held,
failed=...)`` (removes the lock file, still holding it, then lets go; never raises).

Owns: creating the directory it locks, the lock file, taking and letting go of the lock, the
holder's name in messages. Does not own: what the lock protects (local.py: the conditional
commit, LocalStore.exclusive), which rank takes it (distributed/collective.py).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import time
from dataclasses import dataclass

from ckptio.errors import CheckpointLockedError, CkptError, StorageIOError
from ckptio.io.posix import os_hint
from ckptio.storage import abandon
from ckptio.storage import holder as holders
from ckptio.storage.store_contract import check_if_locked

__all__ = ["LOCK_NAME", "DirLock", "broken_link", "in_flight", "lock", "make_dir", "still_linked",
           "unlock"]

log = logging.getLogger("ckptio")
LOCK_NAME = ".ckptio.lock"
SILLY_NAMES = (".nfs", ".fuse_hidden")  # a file removed while open, until it is closed
SILLY_WAIT_S = 1.0  # how long unlock() waits for them to go (they go within milliseconds)
# flock() errors that mean "this filesystem has no locks" (NFS without lockd, Lustre mounted
# without -o flock, some FUSE filesystems), not "the lock is taken"
_NO_LOCKS = frozenset({errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS})
_HOLDER_READS = 20  # x 10 ms
_FIRST_PAUSE_S, _MOST_PAUSE_S = 0.01, 0.2  # between tries of a lock another save holds
_unlockable_warned: set[int] = set()  # st_dev of filesystems already reported without locks


def broken_link(path: str) -> str | None:
    """``path`` named as a symbolic link that leads nowhere (its target missing, or links that
    loop), or None when it is not one."""
    if not os.path.islink(path) or os.path.exists(path):
        return None
    return f"{path} is a symbolic link to {os.readlink(path)}, which does not exist (or the " \
        "links loop)"


def make_dir(path: str) -> bool:
    """Create the checkpoint directory if needed; -> whether this call created it. A path that
    is something else is refused first (mkdir would only say "File exists")."""
    if (broken := broken_link(path)) is not None:
        raise StorageIOError(f"checkpoint path {broken}; fix the link or choose another path")
    if os.path.lexists(path) and not os.path.isdir(path):
        raise StorageIOError(f"checkpoint path {path} exists and is not a directory; "
                             "choose another path")
    created = not os.path.exists(path)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise StorageIOError(f"cannot create checkpoint directory {path}: "
                             f"{exc.strerror or exc}; {os_hint(exc)}") from None
    return created


@dataclass
class DirLock:
    """The lock of one checkpoint directory, as held by the process that commits there."""

    path: str
    fd: int | None  # None: the filesystem has no locks (logged); the commit check still runs
    created: bool  # lock() created the directory


def lock(path: str, if_locked: str) -> DirLock:
    """Create the directory ``path`` if needed and take its exclusive lock: at once, or, if
    another save holds it, after that save (``if_locked="wait"``, logged) or not at all
    (``"raise"``: CheckpointLockedError naming the holder's host and pid)."""
    check_if_locked(if_locked)
    created = make_dir(path)
    return DirLock(path, _acquire(path, if_locked), created)


def unlock(held: DirLock, *, failed: bool = False) -> None:
    """Let go of the lock (removing the lock file first, still holding it); after a failed save
    into a directory lock() created, remove the directory if nothing else is in it. Never
    raises: a failure here is logged (the save's own outcome is what the caller reports)."""
    if held.fd is not None:
        _let_go(held.path, held.fd)
        held.fd = None
    if failed and held.created:
        _remove_if_empty(held.path)


def in_flight(path: str) -> tuple[str | None, str | None, str | None]:
    """The save the lock file of ``path`` records, for a load that finds no manifest there:
    (who holds it, "host h, pid p, since s", None, None) for a process alive on this host;
    (None, why it is known to have ended: its holder provably gone, None); (None, None, that
    save named with when it took the lock and when its lock file was last written) for a holder
    on another host or boot (shared storage), alive or not: it cannot be told from here; or
    (None, None, None): no lock file or record. Only reads the file: the lock is never taken,
    so no save waits for a reader."""
    file = os.path.join(path, LOCK_NAME)
    try:
        with open(file, "rb") as f:
            record = json.loads(f.read(holders.RECORD_MAX_NBYTES))
            written = time.time() - os.fstat(f.fileno()).st_mtime
    except (OSError, ValueError):
        return None, None, None
    if not isinstance(record, dict):
        return None, None, None
    gone = holders.dead(record)
    if gone is not None:
        return None, f"its holder, {gone}", None
    here = holders.running_here(record)
    if here is not None:
        return here, None, None
    return None, None, _elsewhere(record, written)


def _elsewhere(record: dict[str, object], written_s: float) -> str | None:
    """A holder that is not a process of this host and boot, named for a reader on this host
    (None: the record names no other host, or no pid: nothing to check)."""
    host, pid = record.get("host"), record.get("pid")
    if not isinstance(host, str) or not host or not isinstance(pid, int):
        return None
    where = (f"host {host}" if host != socket.gethostname()
             else f"host {host} (a boot of it before this one, or another machine so named)")
    return (f"a save by {where}, pid {pid}, which took the lock {holders.ago(record)}, its lock "
            f"file last written {max(0.0, written_s):.0f} s ago (a save writes it once, when it "
            "starts)")


def _remove_if_empty(path: str) -> None:
    """rmdir ``path``, which stays if it holds other files. On NFS or FUSE the lock file,
    removed while open, lingers renamed (.nfsXXXX, .fuse_hiddenXXXX) until the file system
    sees it closed, a moment after close(): waited for briefly, else the directory would
    stay behind empty, listed as an incomplete step."""
    deadline = time.monotonic() + SILLY_WAIT_S
    while True:
        try:
            os.rmdir(path)
            return
        except OSError:
            with contextlib.suppress(OSError):
                left = os.listdir(path)  # empty: the lingering file went after the rmdir
                if all(n.startswith(SILLY_NAMES) for n in left) and time.monotonic() < deadline:
                    time.sleep(0.01)
                    continue
            return


def _acquire(path: str, if_locked: str) -> int | None:
    """The descriptor of the lock file now at ``path``/LOCK_NAME, locked; None: no locks."""
    file = os.path.join(path, LOCK_NAME)
    while True:
        fd = _open_lock_file(path, file)
        try:
            taken = _take(fd, path, if_locked)
            if taken and still_linked(fd, file):
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
    """flock ``fd`` exclusively; -> False where the filesystem has no locks. Held by another
    save: refused (``if_locked="raise"``) or waited for by tries, not a blocking flock, so
    that a save its caller abandoned stops waiting (storage/abandon.py)."""
    pause, holder = _FIRST_PAUSE_S, None
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            pass
        except OSError as exc:
            return _no_locks(fd, path, exc)
        if holder is None:
            holder = _holder(fd)
            if if_locked == "raise":
                raise CheckpointLockedError(
                    f"{path} is being saved by another save ({holder}); this save did not "
                    "start and the checkpoint there is untouched: wait for that save to "
                    "finish, save to another path, or use Options(if_locked='wait') to wait "
                    "for it")
            log.warning("ckptio: waiting for the lock of %s: another save is running there "
                        "(%s)", path, holder)
        if abandon.abandoned():
            raise CkptError(f"the save to {path} stopped waiting for its lock, held by another "
                            f"save ({holder}): its caller was interrupted; nothing of it was "
                            "written")
        time.sleep(pause)
        pause = min(_MOST_PAUSE_S, pause * 1.5)


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


def still_linked(fd: int, file: str) -> bool:
    """Whether ``file`` is still the file open as ``fd`` (its holder did not remove it)."""
    try:
        now = os.stat(file)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino) and mine.st_nlink > 0


def _record_holder(fd: int) -> None:
    """Who holds the lock, for the message of a save refused or waiting (best effort)."""
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(holders.me()).encode(), 0)
    except OSError as exc:  # only the message of a waiting save loses the holder's name
        log.debug("ckptio: could not record the lock holder: %s", exc)


def _holder(fd: int) -> str:
    """Who holds the lock of ``fd``'s file; a holder that has just taken it writes its name
    right after, so an empty file is read again for a moment."""
    for _ in range(_HOLDER_READS):
        try:
            who = json.loads(os.pread(fd, holders.RECORD_MAX_NBYTES, 0))
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
