"""One live job per run directory: the lease a CheckpointManager takes on a local root (and
a CkptioTrainer on its output_dir for ``train()``, ckptio/hf_trainer.py).

Two jobs started on one run directory would interleave their steps. The manager's coordinator
takes ``<run>/.ckptio-run.lease`` when it is made (each tier's directory that exists then) or at
its first save (the first tier's, which that save creates): an exclusive flock(2) held on an open
file for the manager's life (the kernel lets go when the process dies, however it dies), with
the holder's record (storage/holder.py: host, boot, pid, start time) written into it for the
message the next job sees. A second manager on that directory is refused at once naming the
holder, unless ``take_over=True`` (a restarted job whose old processes may linger): then it
warns and goes on without the lock; at its first save (``create``, or ``claim()``) it writes
its own record into the file. The holder compares the file with the record it wrote at each
of its manager's saves (``lost``): rewritten by another job, its lease was taken over. A child
the holder forks (a DataLoader worker) closes its copy of the open file at once, so the lock
ends with the holder, not its last lingering child. A manager made with ``take_over=True``
that never saves (a reader of a live run) takes nothing from the job that trains there.

Call order: ``take(directory, take_over)`` -> the manager runs -> ``release()`` (close():
the file is removed).
On a filesystem without locks (NFS without lockd) the lease cannot be enforced: a warning says
so, and saves still never replace a committed step.

Owns: the lease file, its lock and the refusal's wording. Does not own: the per-save lock of
one checkpoint (dirlock.py), which roots are leased (managing/level.py).
"""

from __future__ import annotations

import errno
import fcntl
import json
import contextlib
import logging
import os
import weakref

from ckptio.errors import CheckpointLockedError, StorageIOError
from ckptio.storage import holder as holders
from ckptio.storage.local.dirlock import still_linked
from ckptio.storage.local.local_urls import shm_url

__all__ = ["FIRST_SAVE_REFUSAL", "LEASE_NAME", "MANAGER_REFUSAL", "RunLease", "not_a_run_directory",
           "take"]

log = logging.getLogger("ckptio")
LEASE_NAME = ".ckptio-run.lease"
MANAGER_REFUSAL = ("this CheckpointManager was not made",
                   "pass CheckpointManager(..., take_over=True)")  # take(refusal=)
FIRST_SAVE_REFUSAL = ("the first save of this CheckpointManager was not made",
                      MANAGER_REFUSAL[1])  # a run directory made after the manager was
_NO_LOCKS = frozenset({errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS})
_READ_ONLY = frozenset({errno.EROFS, errno.EACCES, errno.EPERM})
_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})


class RunLease:
    """A run directory's lease as this process holds it (``fd`` None: not enforced)."""

    def __init__(self, directory: str, fd: int | None, mine: bytes = b"",
                 taken: bool = False) -> None:
        self.directory, self.fd = directory, fd
        if fd is not None:
            _HELD.add(self)  # closed in a forked child (_not_in_children)
        self._mine = mine  # the record written
        self._lost: str | None = None  # the taker, once seen
        self._taken = taken  # taken over, not claimed yet (claim())

    def claim(self) -> None:
        """A lease taken over, at this manager's first save: this process's record written
        into the holder's file, so that its manager stops saving (never raises)."""
        taken, self._taken = self._taken, False
        if not taken:
            return
        try:
            fd = os.open(os.path.join(self.directory, LEASE_NAME), os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:  # the holder let go meanwhile: nothing to claim
            log.debug("ckptio: no run lease to claim in %s: %s", self.directory, exc)
            return
        try:
            _claim(fd, self.directory)
        finally:
            os.close(fd)

    @property
    def lost(self) -> str | None:
        """Who took the run over (host and pid, as the file records it), once a job started
        with ``take_over=True`` rewrote the file this process locked; None while kept."""
        if self._lost is None and self.fd is not None and self._mine:
            try:
                now = os.pread(self.fd, len(self._mine) + 1, 0)
            except OSError:  # unreadable: nothing says another job wrote it
                return None
            if now != self._mine:
                self._lost = _taker(self.fd)
        return self._lost

    @property
    def held(self) -> bool:
        """Whether this process locked the run (not: taken over, a second manager of this
        process, no locks there): only then is no other job writing there."""
        return self.fd is not None

    def release(self) -> None:
        """Let go: the file is removed while still locked (a job waiting to lock it sees it
        gone and locks the next one), then unlocked; never raises."""
        fd, self.fd = self.fd, None
        if fd is None:
            return
        try:
            os.unlink(os.path.join(self.directory, LEASE_NAME))
        except OSError as exc:  # the next job locks the same file: it is only a name
            log.debug("ckptio: could not remove the run lease in %s: %s", self.directory, exc)
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)  # explicitly: a forked child shares this file
        except OSError as exc:
            log.warning("ckptio: letting go of the run lease in %s failed: %s", self.directory,
                        exc.strerror or exc)
        try:
            os.close(fd)  # freed even when it fails: never closed twice
        except OSError as exc:  # the file system gone (a dead NFS server or FUSE mount)
            log.warning("ckptio: closing the run lease in %s failed: %s", self.directory,
                        exc.strerror or exc)


_HELD: weakref.WeakSet[RunLease] = weakref.WeakSet()  # the leases this process holds


def _not_in_children() -> None:
    """After a fork, in the child: its copies of the leases' open files closed (the lock is on
    the open file, which the child shares: the parent's lock would outlive the parent in a
    lingering DataLoader worker); the child holds no lease (``held`` False, nothing released)."""
    for lease in list(_HELD):
        fd, lease.fd = lease.fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)
    _HELD.clear()


os.register_at_fork(after_in_child=_not_in_children)


def take(directory: str, take_over: bool, *, create: bool,
         refusal: tuple[str, str] = MANAGER_REFUSAL) -> RunLease | None:
    """The lease of ``directory``, or CheckpointLockedError naming the live job that holds it
    (module docstring); None if the directory does not exist and ``create`` is False.
    ``refusal``: what was not done and the way past a lingering holder, in the taker's terms
    (a CheckpointManager's by default; ckptio.hf_trainer's for a Trainer's output_dir)."""
    path = os.path.join(directory, LEASE_NAME)
    if not create and not os.path.isdir(directory):
        return None
    while True:
        fd = _open(directory, path)
        if fd is None:
            return RunLease(directory, None)
        locked = _lock(fd, directory, path)
        if locked is None:
            return RunLease(directory, None)
        if not locked:  # by another job: refused (or taken over)
            return _held(fd, directory, path, take_over, create, refusal)
        if still_linked(fd, path):
            return RunLease(directory, fd, _record(fd))
        os.close(fd)  # its holder let go and removed it meanwhile: lock the one there now


def _lock(fd: int, directory: str, path: str) -> bool | None:
    """flock ``fd`` without waiting: True (this process holds it), False (another does), None
    (the file system has no locks: warned of, ``fd`` closed)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as exc:
        os.close(fd)
        if exc.errno not in _NO_LOCKS:
            raise StorageIOError(f"cannot lock the run lease {path}: {exc.strerror or exc}"
                                 ) from None
        log.warning("ckptio: the filesystem of %s has no file locks (%s): a second job "
                    "started on this run directory is not detected there", directory,
                    exc.strerror or exc)
        return None
    return True


def _open(directory: str, path: str) -> int | None:
    """The lease file, opened (created if needed); None where the run is read-only."""
    try:
        os.makedirs(directory, exist_ok=True)
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        if exc.errno in _READ_ONLY:  # a run only restored from: no job can save there either
            log.info("ckptio: no run lease in %s (%s)", directory, exc.strerror or exc)
            return None
        if exc.errno in _FULL:  # a restore must still work on a full disk
            log.warning("ckptio: no run lease in %s (%s): a second job started on this run is "
                        "not detected", directory, exc.strerror or exc)
            return None
        if os.path.lexists(directory) and not os.path.isdir(directory):
            raise not_a_run_directory(directory) from None
        raise StorageIOError(f"cannot open the run lease {path}: {exc.strerror or exc}; it is "
                             "a plain file ckptio makes: if no job runs on this directory, "
                             "remove what is at that path") from None


def not_a_run_directory(directory: str) -> StorageIOError:
    """The error for a run directory that exists as something else (a file), or below one."""
    blocker = directory
    while not os.path.lexists(blocker) and os.path.dirname(blocker) not in ("", blocker):
        blocker = os.path.dirname(blocker)  # the nearest part of the path that is there
    if blocker != directory and os.path.lexists(blocker) and not os.path.isdir(blocker):
        return StorageIOError(f"the run directory {directory} cannot be made: {blocker} is a "
                              "file, not a directory: give the manager another directory, or "
                              "move that file away")
    return StorageIOError(f"the run directory {directory} exists and is not a directory: give "
                          "the manager a directory (it saves its steps in it as step-<N>), or "
                          "move that file away")


def _held(fd: int, directory: str, path: str, take_over: bool, create: bool,
          refusal: tuple[str, str]) -> RunLease:
    try:
        return _refuse(fd, directory, path, take_over, create, refusal)
    finally:
        os.close(fd)


def _refuse(fd: int, directory: str, path: str, take_over: bool, create: bool,
            refusal: tuple[str, str]) -> RunLease:
    """The lease ``fd`` another process locked: refused, or taken over (module docstring;
    claimed at once at a first save: ``create``)."""
    record = _record_of(fd)
    if holders.is_me(record):  # a second manager of this process (its own code decides)
        return RunLease(directory, None)
    who, named = _describe(record), shm_url(directory)  # a memory tier: as the user wrote it
    if take_over:
        log.warning("ckptio: taking over the run directory %s from %s (take_over=True); if that "
                    "job is still running, its next save after this manager's first save is "
                    "refused", named, who)
        if create:
            _claim(fd, directory)
        return RunLease(directory, None, taken=not create)
    undone, past = refusal
    raise CheckpointLockedError(
        f"the run directory {named} is in use by another job ({who}); two jobs on one run "
        f"would mix their steps, so {undone} and nothing there was touched: give this job its "
        "own directory or stop the other one; if it is this job's earlier run whose processes "
        f"linger (e.g. DataLoader workers), wait for them to exit or {past} (the lease file is "
        f"{shm_url(path)})")


def _record(fd: int) -> bytes:
    """Write this process's record into the lease -> the bytes written (empty: not written,
    then a take-over goes unseen)."""
    data = json.dumps(holders.me()).encode()
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
    except OSError as exc:  # only the next job's message loses the holder's name
        log.debug("ckptio: could not record the run lease's holder: %s", exc)
        return b""
    return data


def _claim(fd: int, directory: str) -> None:
    """A take-over: this process's record written over the holder's, in one write padded to
    its length (the holder reads a whole record), so that the holder's manager sees it."""
    data = json.dumps({**holders.me(), "took_over": True}).encode()
    try:
        os.pwrite(fd, data.ljust(os.fstat(fd).st_size), 0)
    except OSError as exc:  # the holder's manager goes on unaware
        log.warning("ckptio: could not record the take-over of %s: %s", directory,
                    exc.strerror or exc)


def _taker(fd: int) -> str:
    """The job that rewrote the lease, as its record names it."""
    record = _record_of(fd)
    if record is None:
        return "holder unknown"
    return f"host {record.get('host')}, pid {record.get('pid')}, started {record.get('since')}"


def _record_of(fd: int) -> dict[str, object] | None:
    try:
        record = json.loads(os.pread(fd, holders.RECORD_MAX_NBYTES, 0) or b"null")
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _describe(record: dict[str, object] | None) -> str:
    """Who holds the lease, as its record says; a holder that has exited while the file is
    still locked left it to processes that inherited the open file."""
    if record is None:
        return "holder unknown"
    who = (f"host {record.get('host')}, pid {record.get('pid')}, started "
           f"{record.get('since')}")
    gone = holders.dead(record)
    if gone is not None:
        return (f"{who}; {gone}, yet the lease is still held: by processes that inherited it, "
                "such as its DataLoader workers")
    return who
