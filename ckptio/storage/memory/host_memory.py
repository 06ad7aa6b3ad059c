"""This process's memory files: ``HOST``, the one place every ``mem://`` location lives.

All of one process's memory files live in one HostMemory, so every MemoryStore and
MemoryBackend of the process sees the same files, as every LocalStore and PosixBackend sees
one filesystem. Nothing survives the process. Its lock guards the files, the locations made,
the commit counter of each location and the claims on them; a claim waits on it.

Call order: memory_store.py's MemoryStore claims a location (``MemoryClaim``, released by
``release``), commits and reads through HOST; its MemoryBackend writes and reads the data
files; memory_root.py lists the steps of a root; tests and tools read and write files
directly (``read``, ``write``).

Owns: HOST, the memory files and locations, their commit counters and claims, and which
paths are memory paths (``check_scheme``). Does not own: the Store and IOBackend over them
(memory_store.py), a manager's steps (memory_root.py).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from ckptio.errors import StorageIOError

__all__ = ["HOST", "SCHEME", "HostMemory", "MemoryClaim", "check_scheme"]

SCHEME = "mem://"


class HostMemory:
    """One process's memory files (path -> bytes), locations, commit counters and claims."""

    def __init__(self) -> None:
        self.lock = threading.Condition()  # guards everything below; claims wait on it
        self.files: dict[str, bytearray | bytes | memoryview] = {}
        self.locations: set[str] = set()  # prepared (or claimed) locations, even empty ones
        self.commits: dict[str, int] = {}  # location -> manifests committed there so far
        self.claims: dict[str, MemoryClaim] = {}

    def read(self, path: str) -> bytes | None:
        """A file's bytes (a copy), or None (for tests and tools)."""
        with self.lock:
            data = self.files.get(path)
            return None if data is None else bytes(data)

    def write(self, path: str, data: bytes) -> None:
        """Create or replace a file (for tests and tools)."""
        check_scheme(path)
        with self.lock:
            self.files[path] = bytearray(data)

    def entries(self, location: str) -> list[str]:
        """The names directly under ``location``: its files, and the first part of deeper
        paths (as a directory's subdirectories), sorted."""
        prefix = location + "/"
        with self.lock:
            return sorted({path[len(prefix):].split("/", 1)[0] for path in self.files
                           if path.startswith(prefix)})

    def exists(self, location: str) -> bool:
        with self.lock:
            return location in self.locations or any(
                path.startswith(location + "/") for path in self.files)


HOST = HostMemory()


def check_scheme(path: str) -> str:
    if not isinstance(path, str) or not path.startswith(SCHEME):
        raise StorageIOError(f"{path!r} is not a memory path: the memory backend and store reach "
                             f"only {SCHEME}... paths; use a LocalStore for a directory")
    return path


@dataclass
class MemoryClaim:
    """MemoryStore.exclusive()'s claim on one location."""

    location: str
    seen: int  # commits at the location when claimed
    created: bool  # the claim made the location
    holder: str
    released: bool = field(default=False)

    def release(self, *, failed: bool = False) -> None:
        with HOST.lock:
            if self.released:
                return
            self.released = True
            if HOST.claims.get(self.location) is self:
                del HOST.claims[self.location]
            if failed and self.created and not HOST.entries(self.location):
                HOST.locations.discard(self.location)
            HOST.lock.notify_all()
