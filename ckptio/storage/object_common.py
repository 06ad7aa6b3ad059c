"""What the object-store schemes (s3://, gs://, az://) share: their backends' table of open
handles, the errors of a commit another writer won, of a prefix without a manifest, of an
object deleted while it was read and of an endpoint that never answered, and their step roots'
pending removals of hidden steps and the rule telling a step's state from its names.

Each scheme's folder (storage/s3/, gcs/, azure/) talks to its own service; these are the parts
whose rules are the same whatever the service, kept once so that a fix reaches all three (and
the claim a store's exclusive() returns: ``LockClaim``; a save's wait for a lock another save
holds: ``LockWait``, which gives up once the save is abandoned: storage/abandon.py).

Call order: a backend's open_* -> ``OpenHandles.add``, its writes -> ``get``, its reads ->
``reading``, its close -> ``pop``. A store's conditional commit that loses -> ``lost_commit``; its
read_manifest with no manifest -> ``no_checkpoint``. A root's scan() -> ``MarkedSteps.add``,
its hide() -> ``MarkedSteps.hide``, its removal() -> ``MarkedSteps.removal``; a step's state from
the names its listing gave -> ``held_state`` (of names ``kept_name`` reduced).

Owns: the handle numbering, those messages (which proxy the environment names for an
endpoint: ``proxy_for``), the removal's two modes (quiet in the background,
raising before a save into the step). Does not own: any request to a service (the schemes'
folders), the marker's name or the order of deletions (each root's ``finish``).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from ckptio.errors import (
    CheckpointLockedError,
    CheckpointNotFoundError,
    CkptError,
    StorageIOError,
)
from ckptio.format.manifest import MANIFEST_NAME
from ckptio.io.backend_contract import FileHandle
from ckptio.storage import abandon, missing_manifest
from ckptio.storage.steproot import Removal, is_tc_file, warn

__all__ = ["FOREIGN", "MARKER", "MARKER_BODY", "LockClaim", "LockWait", "MarkedSteps",
           "OpenHandles", "deleted_while_read", "held_state", "kept_name", "lost_commit",
           "no_checkpoint", "proxy_for", "unreached"]

log = logging.getLogger("ckptio")
T = TypeVar("T")


class _Sized(Protocol):
    @property
    def size(self) -> int: ...  # an object open for reading: its bytes


R = TypeVar("R", bound=_Sized)
MARKER = ".deleting"  # a step being removed: out of the listing, its removal pending
MARKER_BODY = b"ckptio: this step is being removed by a CheckpointManager retention\n"
FOREIGN = "foreign"  # a step's state: incomplete, holding a torch_checkpointing checkpoint


def kept_name(name: str) -> str:
    """What of a name under a step tells its state (held_state): the marker, the manifest, a
    torch_checkpointing file (FOREIGN), else "" (any other object)."""
    if name in (MARKER, MANIFEST_NAME):
        return name
    return FOREIGN if is_tc_file(name) else ""


def held_state(kept: Iterable[str]) -> str:
    """A step's state from the names under it, each reduced by kept_name: "marked",
    "committed", FOREIGN (incomplete, holding a torch_checkpointing checkpoint:
    steproot.ForeignRoot), "incomplete" (other objects only) or "empty" (none)."""
    found = set(kept)
    if MARKER in found:
        return "marked"
    if MANIFEST_NAME in found:
        return "committed"
    return FOREIGN if FOREIGN in found else "incomplete" if found else "empty"


class _Lock(Protocol):
    def release(self) -> None: ...


@dataclass
class LockClaim:
    """An object store's exclusive() claim on ``location``: its lock (released once), and what
    the store saw of the committed manifest under it (``seen``: S3's and Azure's ETag or None,
    GCS's generation or 0), which the commit makes its condition."""

    location: str
    lock: _Lock
    seen: Any
    released: bool = field(default=False)

    def release(self, *, failed: bool = False) -> None:
        if not self.released:
            self.released = True
            self.lock.release()


class LockWait:
    """A save's wait for the lock of ``url`` while another save holds it: ``busy(other)`` after
    each failed try refuses at once (``if_locked="raise"``), else warns once (``lapse`` says when
    a dead holder's lock is taken over) and sleeps, a little longer each time, up to ``most_s``."""

    def __init__(self, url: str, if_locked: str, lapse: str, most_s: float = 5.0) -> None:
        self.url, self.if_locked, self.lapse, self.most_s = url, if_locked, lapse, most_s
        self.waited, self.pause = False, 0.2

    def busy(self, other: str) -> None:
        if self.if_locked == "raise":
            raise CheckpointLockedError(
                f"{self.url} is being saved by another save ({other}); this save did not "
                "start and the checkpoint there is untouched: wait for that save to finish, "
                "save to another location, or use Options(if_locked='wait') to wait for it")
        if abandon.abandoned():
            raise CkptError(f"the save to {self.url} stopped waiting for its lock, held by "
                            f"another save ({other}): its caller was interrupted; nothing of it "
                            "was written")
        if not self.waited:
            log.warning("ckptio: waiting for the lock of %s: another save is running there "
                        "(%s); %s", self.url, other, self.lapse)
            self.waited = True
        time.sleep(self.pause)
        self.pause = min(self.most_s, self.pause * 1.5)


class OpenHandles(Generic[T]):
    """A backend's open files: a FileHandle per opened object, numbered from 1."""

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self._open: dict[int, T] = {}
        self._next = 0
        self._lock = threading.Lock()

    def add(self, path: str, opened: T) -> FileHandle:
        with self._lock:
            self._next += 1
            self._open[self._next] = opened
            return FileHandle(path, self._next, direct=False)

    def get(self, fh: FileHandle) -> T:
        with self._lock:
            opened = self._open.get(fh.token)
        if opened is None:
            raise StorageIOError(f"{fh.path} is not open in this {self.backend} backend (closed "
                                 "already?)")
        return opened

    def pop(self, fh: FileHandle) -> T | None:
        with self._lock:
            return self._open.pop(fh.token, None)

    def reading(self, fh: FileHandle, kind: type[R], offset: int, into: memoryview
                ) -> tuple[R, memoryview]:
        """A read's object (``fh`` opened for reading: a ``kind``) and the part of ``into``
        that lies within it from ``offset`` (empty at or past its end); StorageIOError when
        ``fh`` is not open, or is open for writing."""
        opened = self.get(fh)
        if not isinstance(opened, kind):
            raise StorageIOError(f"reading {fh.path} failed: it is open for writing")
        return opened, into[:max(0, min(len(into), opened.size - offset))]


def lost_commit(location: str) -> CheckpointLockedError:
    """A conditional commit refused because another save committed ``location`` meanwhile."""
    return CheckpointLockedError(
        f"another save committed {location} while this one was writing, so its claim was not "
        "honoured there (a writer that does not take ckptio's lock, or this save outlived its "
        "lock's lease); this save was not committed and the checkpoint there is kept: make the "
        "saves take the claim, or give each its own location")


def deleted_while_read(what: str, url: str) -> StorageIOError:
    """A read of ``url`` answered 404 though the object was there when opened."""
    return StorageIOError(
        f"{what} failed: {url} no longer exists (404: it was deleted since it was opened; "
        "another save replaced this checkpoint, or a retention removed it, while it was "
        "read): load it again, or load an earlier checkpoint")


def proxy_for(endpoint: str) -> str | None:
    """The proxy HTTPS_PROXY / HTTP_PROXY name for ``endpoint`` (NO_PROXY honoured), or None."""
    parts = urllib.parse.urlsplit(endpoint)
    proxies = urllib.request.getproxies_environment()
    if not parts.hostname or urllib.request.proxy_bypass(parts.hostname):
        return None
    return proxies.get(parts.scheme) or None


def unreached(what: str, endpoint: str, tried: str, *, cloud: str | None,
              fix: str) -> StorageIOError:
    """An endpoint that never answered this process (``tried``: the cause and the attempts):
    the proxy the environment names for it, else ``cloud`` (a provider's own endpoint, by its
    name: this machine's network), else the endpoint as configured; ``fix`` says where the
    endpoint is set."""
    proxy = proxy_for(endpoint)
    if proxy is not None:
        return StorageIOError(
            f"{what} failed: the proxy to {endpoint} ({proxy}) does not answer ({tried}): check "
            "HTTPS_PROXY / HTTP_PROXY (or unset them, or list the endpoint's host in NO_PROXY) "
            "and that the proxy is running")
    if cloud is not None:
        return StorageIOError(
            f"{what} failed: {cloud} cannot be reached from here ({tried}): check this "
            f"machine's network, DNS and proxy (HTTPS_PROXY); {fix}")
    return StorageIOError(f"{what} failed: nothing answers at {endpoint} ({tried}): {fix}, its "
                          "port, and that the server is running")


def no_checkpoint(location: str, entries: list[str], name: str, exists: Callable[[str], bool],
                  child: Callable[[str], str], endpoint: str, noun: str,
                  saving: str | None = None, ended: str | None = None) -> CkptError:
    """Why ``location`` (object name ``name`` under its bucket or container) holds no manifest:
    an ``noun`` (object, blob) rather than a prefix, nothing under it, or ``entries`` (the
    names directly under it) that look like a run's steps or something else. ``exists(name)``
    asks the service; ``child(rel)`` is the object name of ``rel`` under the prefix;
    ``saving``, ``ended``: a save still running, or known to have ended without a commit
    (missing_manifest.no_manifest)."""
    if not entries:
        if name and exists(name):
            return CheckpointNotFoundError(
                f"{location} is an {noun} (a file), not a ckptio checkpoint prefix"
                f"{missing_manifest.file_hint(name.rsplit('/', 1)[-1])}")
        return CheckpointNotFoundError(f"no checkpoint at {location}: nothing is stored under "
                                       f"that prefix at {endpoint}")
    return missing_manifest.no_manifest(location, entries,
                                        lambda step: exists(child(f"{step}/{MANIFEST_NAME}")),
                                        saving=saving, ended=ended)


class MarkedSteps:
    """A root's steps hidden by a marker and not yet removed (seen by scan() or hide()), and the
    removal of each: ``finish(step)`` deletes what is left of it and returns the problems."""

    def __init__(self, path: Callable[[int], str], finish: Callable[[int], list[str]],
                 has_marker: Callable[[int], bool], access: Callable[[], str]) -> None:
        self._path, self._finish, self._has_marker = path, finish, has_marker
        self._access = access  # what a failed removal asks the user to check
        self._steps: set[int] = set()

    def add(self, steps: Iterable[int]) -> None:
        self._steps.update(steps)

    def sorted(self) -> list[int]:
        return sorted(self._steps)

    def hide(self, step: int, committed: Callable[[], bool], mark: Callable[[], None],
             drop_manifest: Callable[[], list[str]]) -> bool:
        """Mark ``step`` (``mark``: write its MARKER; hidden from listings from then on), then
        delete its manifest; False (and a warning) if it holds no committed manifest or the
        marker could not be written: the step is then kept whole."""
        url = self._path(step)
        try:
            if not committed():
                warn(f"ckptio: retention could not remove {url}: it holds no committed "
                     "checkpoint (removed already?)", stacklevel=3)
                return False
            mark()
        except CkptError as exc:
            warn(f"ckptio: retention could not remove {url} ({exc}); it is kept and tried "
                 "again after the next save", stacklevel=3)
            return False
        self._steps.add(step)
        problems = drop_manifest()
        if problems:  # hidden all the same: the removal deletes the manifest first
            log.warning("ckptio: could not delete the manifest of %s yet (%s); the step is out "
                        "of the listing and its removal tries again", url, "; ".join(problems))
        return True

    def removal(self, step: int | None = None) -> Removal | None:
        """``step=None``: finishing every marked step seen so far (failures logged; the next
        retention tries again). ``step=N``: finishing N's removal if one is pending (its
        marker is there), raising if it cannot; None if there is nothing to do."""
        if step is None:
            todo, self._steps = sorted(self._steps), set()
            return functools.partial(self._finish_quietly, todo) if todo else None
        self._steps.discard(step)
        if not self._has_marker(step):
            return None
        return functools.partial(self._finish_now, step)

    def _finish_quietly(self, steps: list[int]) -> None:
        for step in steps:
            try:
                problems = self._finish(step)
            except CkptError as exc:
                problems = [str(exc)]
            if problems:
                log.warning("ckptio: could not finish removing %s (an old step, already out of "
                            "the listing): %s; the next retention tries again", self._path(step),
                            "; ".join(problems[:5]))

    def _finish_now(self, step: int) -> None:
        problems = self._finish(step)
        if problems:
            url = self._path(step)
            raise StorageIOError(
                f"cannot save into {url}: the removal of the old step there (marked by "
                f"{url}/{MARKER}, out of the listing) could not be finished: "
                f"{'; '.join(problems[:5])}. Nothing was saved; check the access to "
                f"{self._access()} and save again")
