"""A Store in host memory (``mem://`` locations), with the IOBackend that reaches its files.

For tests, and as the seed of a host-memory tier (a checkpoint kept in RAM, drained to a slower
store later). It is the second implementation of store_contract.Store and shows the contract is not
directory-shaped: there are no directories, no rename, no fsync and no flock. A location
``mem://<anything>`` holds files ``<location>/<name>``; all of one process's memory files
live in one HostMemory (``HOST``), so every MemoryStore and MemoryBackend of the process sees
the same files, as every LocalStore and PosixBackend sees one filesystem. Nothing survives the
process.

- commit: the manifest's bytes replace the previous ones in one step under the host's lock
  (readers see the old or the new, never a mix); conditional on the commit counter seen by
  exclusive().
- exclusive: a claim per location, held by a thread of this process ("wait" waits on a
  condition, "raise" names the holder); released by release().
- data files: MemoryBackend writes into and reads from bytearrays (positioned, synchronous:
  its futures are already done).

Owns: MemoryStore, MemoryBackend. Does not own: HOST, its files and claims (host_memory.py),
the contract (store_contract.py), the messages about what a location holds instead
(missing_manifest.py), the order of a save (steps.py).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from ckptio.errors import (
    CheckpointLockedError,
    CheckpointNotFoundError,
    CkptError,
    StorageIOError,
)
from ckptio.format.manifest import MANIFEST_NAME
from ckptio.io.backend_contract import FileHandle, completed
from ckptio.options import Options
from ckptio.storage import missing_manifest
from ckptio.storage.files import Capabilities
from ckptio.storage.memory.host_memory import HOST, SCHEME, MemoryClaim, check_scheme
from ckptio.storage.store_contract import (
    Exclusive,
    TreeStore,
    check_if_locked,
    claim_of,
    exact,
    is_ours,
    plain_name,
)

__all__ = ["MemoryBackend", "MemoryStore"]

log = logging.getLogger("ckptio")
class MemoryStore:
    """A checkpoint location ``mem://...`` in this process's memory. A TreeStore (store_contract.py): a
    sub-location is ``<location>/<name>``."""

    backend_kind = "memory"
    capabilities = Capabilities(locking=True, conditional_commit=True)

    def __init__(self, location: str) -> None:
        check_scheme(location)
        if location.endswith("/") or location == SCHEME:
            raise CkptError(f"memory location {location!r} must name something after {SCHEME} "
                            "and not end with '/', e.g. mem://job/step-100")
        self.location = location

    def __repr__(self) -> str:
        return f"MemoryStore({self.location!r})"

    def prepare(self) -> None:
        if HOST.read(self.location) is not None:
            raise StorageIOError(f"checkpoint location {self.location} is a file; choose "
                                 "another location")
        with HOST.lock:
            HOST.locations.add(self.location)

    def forget(self) -> None:
        """Drop every file at this location and the location itself (tests' cleanup)."""
        prefix = self.location + "/"
        with HOST.lock:
            for path in [p for p in HOST.files if p.startswith(prefix)]:
                del HOST.files[path]
            HOST.locations.discard(self.location)
            HOST.commits.pop(self.location, None)

    def exclusive(self, if_locked: str) -> MemoryClaim:
        check_if_locked(if_locked)
        with HOST.lock:
            waited = False
            while self.location in HOST.claims:
                holder = HOST.claims[self.location].holder
                if if_locked == "raise":
                    raise CheckpointLockedError(
                        f"{self.location} is being saved by another save ({holder}); this save "
                        "did not start and the checkpoint there is untouched: wait for that "
                        "save to finish, save to another location, or use "
                        "Options(if_locked='wait') to wait for it")
                if not waited:
                    log.warning("ckptio: waiting for the claim of %s: another save is running "
                                "there (%s)", self.location, holder)
                    waited = True
                HOST.lock.wait()
            created = not HOST.exists(self.location)
            HOST.locations.add(self.location)
            claim = MemoryClaim(self.location, HOST.commits.get(self.location, 0), created,
                                _holder())
            HOST.claims[self.location] = claim
            return claim

    def path_of(self, name: str) -> str:
        return f"{self.location}/{plain_name(name, self.location)}"

    def backend(self, options: Options) -> MemoryBackend:
        return MemoryBackend(depth=options.io_depth)

    def commit(self, manifest: bytes, save_id: str, held: Exclusive | None = None) -> None:
        claim = claim_of(held, MemoryClaim, self.location)
        with HOST.lock:
            if self.location not in HOST.locations:
                raise StorageIOError(f"committing the manifest of {self.location} failed: the "
                                     "location was never prepared; call prepare() first")
            if claim is not None and HOST.commits.get(self.location, 0) != claim.seen:
                raise CheckpointLockedError(
                    f"another save committed {self.location} while this one was writing, so "
                    "its claim is not honoured there (a writer that did not call exclusive()); "
                    "this save was not committed and the checkpoint there is kept: make the "
                    "saves take the claim, or give each its own location")
            HOST.files[self.path_of(MANIFEST_NAME)] = bytes(manifest)
            HOST.commits[self.location] = HOST.commits.get(self.location, 0) + 1

    def read_manifest(self) -> bytes:
        manifest = HOST.read(self.path_of(MANIFEST_NAME))
        if manifest is not None:
            return manifest
        if HOST.read(self.location) is not None:
            raise CheckpointNotFoundError(
                f"{self.location} is a file, not a ckptio checkpoint location"
                f"{missing_manifest.file_hint(self.location.rsplit('/', 1)[-1])}")
        if not HOST.exists(self.location):
            raise CheckpointNotFoundError(f"no checkpoint at {self.location}: nothing is stored "
                                          "there in this process's memory")
        raise missing_manifest.no_manifest(
            self.location, HOST.entries(self.location),
            lambda name: HOST.read(f"{self.location}/{name}/{MANIFEST_NAME}") is not None)

    def read_file(self, name: str, offset: int = 0, nbytes: int | None = None) -> bytes:
        path = self.path_of(name)
        data = HOST.read(path)
        if data is None:
            raise StorageIOError(f"reading {path} failed: no such file in this process's memory")
        end = len(data) if nbytes is None else offset + nbytes
        return exact(bytes(data[offset:end]), nbytes, path, offset)

    def sizes(self, names: Iterable[str]) -> dict[str, int]:
        out: dict[str, int] = {}
        with HOST.lock:
            for name in names:
                data = HOST.files.get(self.path_of(name))
                if data is not None:
                    out[name] = len(data)
        return out

    def names(self) -> list[str]:
        prefix = self.location + "/"
        with HOST.lock:
            return sorted(path[len(prefix):] for path in HOST.files
                          if path.startswith(prefix) and is_ours(path[len(prefix):]))

    def remove(self, names: Iterable[str]) -> list[str]:
        failed: list[str] = []
        for name in names:
            try:
                path = self.path_of(name)
            except CkptError as exc:
                failed.append(f"{name}: {exc}")
                continue
            with HOST.lock:
                HOST.files.pop(path, None)
        return failed


    # -- the tree (store_contract.TreeStore) --------------------------------------------------------

    def child(self, name: str) -> MemoryStore:
        return MemoryStore(self.path_of(name))

    def entries(self) -> list[str]:
        return HOST.entries(self.location)

    def write_file(self, name: str, data: bytes | memoryview) -> None:
        path = self.path_of(name)
        with HOST.lock:
            HOST.locations.add(self.location)
            HOST.files[path] = bytes(data)

    def adopt_file(self, name: str, data: memoryview) -> None:
        """Create file ``name`` as ``data`` itself, not a copy (bytes received in place: the
        caller leaves them unchanged while the file exists)."""
        path = self.path_of(name)
        with HOST.lock:
            HOST.locations.add(self.location)
            HOST.files[path] = data

    def read_into(self, name: str, into: memoryview, offset: int = 0) -> int:
        path = self.path_of(name)
        with HOST.lock:
            data = HOST.files.get(path)
            if data is None:
                raise StorageIOError(f"reading {path} failed: no such file in this process's "
                                     "memory")
            n = max(0, min(len(into), len(data) - offset))
            into[:n] = memoryview(data)[offset:offset + n]
        return n

    def remove_tree(self) -> list[str]:
        prefix = self.location + "/"
        with HOST.lock:
            for path in [p for p in HOST.files if p.startswith(prefix)]:
                del HOST.files[path]
            for location in [x for x in HOST.locations
                             if x == self.location or x.startswith(prefix)]:
                HOST.locations.discard(location)
                HOST.commits.pop(location, None)
        return []

    def move_to(self, target: TreeStore) -> None:
        """One step under the host's lock (what ``target`` held dropped first)."""
        if not isinstance(target, MemoryStore):
            raise CkptError(f"cannot move {self.location} to {target.location}: another kind "
                            "of store (copy it instead)")
        prefix, into = self.location + "/", target.location + "/"
        with HOST.lock:
            moved = {into + p[len(prefix):]: d for p, d in HOST.files.items()
                     if p.startswith(prefix)}
            commits = HOST.commits.get(self.location)
            self.remove_tree()
            target.remove_tree()
            HOST.files.update(moved)
            HOST.locations.add(target.location)
            if commits is not None:
                HOST.commits[target.location] = commits


def _holder() -> str:
    return (f"held by thread {threading.current_thread().name} of pid {os.getpid()} (this "
            f"process), since {time.strftime('%Y-%m-%dT%H:%M:%S%z')}")


# -- the backend ----------------------------------------------------------------------------------

@dataclass
class _Open:
    data: bytearray | bytes | memoryview
    writable: bool


class MemoryBackend:
    """An IOBackend over HOST: positioned writes into and reads from memory files. Requests
    complete in submit (the futures it returns are done); there is nothing to shut down."""

    name = "memory"

    def __init__(self, depth: int = 1, direct_io: str = "off") -> None:
        self.depth = depth  # accepted like every backend's; nothing is queued
        self._handles: dict[int, _Open] = {}
        self._next = 0
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {"depth": self.depth}  # open handles are not carried across

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(depth=state["depth"])  # type: ignore[misc]

    def open_write(self, path: str, nbytes: int) -> FileHandle:
        with HOST.lock:
            if check_scheme(path) in HOST.files:
                raise StorageIOError(f"cannot create {path}: it exists (a data file is never "
                                     "overwritten); save into a new location")
            data = HOST.files[path] = bytearray(nbytes)
        return self._handle(path, _Open(data, writable=True))

    def open_read(self, path: str, *, cached: bool = False) -> FileHandle:  # memory already
        with HOST.lock:
            data = HOST.files.get(check_scheme(path))
        if data is None:
            raise StorageIOError(f"cannot open {path} for reading: no such file in memory")
        return self._handle(path, _Open(data, writable=False))

    def _handle(self, path: str, opened: _Open) -> FileHandle:
        with self._lock:
            self._next += 1
            self._handles[self._next] = opened
            return FileHandle(path, self._next, direct=False)

    def submit_write(self, fh: FileHandle, offset: int, data: memoryview) -> Future[int]:
        opened = self._opened(fh, "writing", offset, writable=True)
        if isinstance(opened, BaseException):
            return completed(error=opened)
        target = opened.data
        assert isinstance(target, bytearray)  # internal: writable handles hold bytearrays
        end = offset + len(data)
        with HOST.lock:
            if len(target) < end:
                target.extend(bytes(end - len(target)))
            target[offset:end] = data
        return completed(len(data))

    def submit_read(self, fh: FileHandle, offset: int, into: memoryview) -> Future[int]:
        opened = self._opened(fh, "reading", offset, writable=False)
        if isinstance(opened, BaseException):
            return completed(error=opened)
        with HOST.lock:
            n = max(0, min(len(into), len(opened.data) - offset))
            into[:n] = opened.data[offset:offset + n]
        return completed(n)

    def _opened(self, fh: FileHandle, what: str, offset: int,
                writable: bool) -> _Open | StorageIOError:
        with self._lock:
            opened = self._handles.get(fh.token)
        if opened is None:
            return StorageIOError(f"{what} {fh.path} at byte {offset} failed: the file is not "
                                  "open in this backend (closed already?)")
        if opened.writable != writable:
            mode = "writing" if opened.writable else "reading"
            return StorageIOError(f"{what} {fh.path} at byte {offset} failed: it is open for "
                                  f"{mode} only")
        return opened

    def close(self, fh: FileHandle, *, sync: bool) -> None:
        with self._lock:
            self._handles.pop(fh.token, None)

    def register_buffers(self, view: memoryview, *, part_bytes: int = 0) -> bool:
        """No fixed buffers here: every request maps its own."""
        return False

    def shutdown(self) -> None:
        """Nothing runs in the background; open handles stay usable."""
