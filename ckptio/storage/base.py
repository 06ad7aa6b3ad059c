"""The storage contract: where one checkpoint's files live and how it is committed.

A ``Store`` is one checkpoint location (a local directory; later a prefix in an S3 bucket, a
host-memory tier). Data bytes move through an ``IOBackend`` made for that kind of store
(positioned reads and writes from the staging pool: O_DIRECT/io_uring for a directory,
multipart uploads and ranged GETs for an object store) on the paths ``path_of(name)`` gives;
the store itself does the few whole-checkpoint operations:

    prepare()           make the location; refuse one that cannot hold a checkpoint
    exclusive(...)      serialise saves into this location across processes and machines
    commit(manifest)    make the manifest visible atomically, after every data file is durable
                        (conditional: refused if another save committed meanwhile)
    read_manifest()     the committed manifest's bytes, or an error saying what is there instead
    sizes(names)        the stored size of each named file (bounds checks before reading)
    names()             every file a ckptio save created there (for cleanup and leftovers)
    remove(names)       delete files, never raising: the failures are returned

The order that makes a checkpoint crash-safe is the caller's (the save session): data files
with names unique to the save, durable; then commit; then remove what the new manifest does not
name. A store only promises each step's own atomicity and durability.

Owns: the Protocol. Does not own: any implementation (local.py), the manifest's content
(format/manifest.py) or the order of a save (saving/session.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, runtime_checkable

__all__ = ["Store", "Exclusive"]


class Exclusive(Protocol):
    """A held claim on a location: no other save commits there until released."""

    def release(self, *, failed: bool = False) -> None: ...


@runtime_checkable
class Store(Protocol):
    location: str  # what error messages name: a directory path, an s3:// URL

    def prepare(self) -> None:
        """Create the location if needed; StorageIOError if it cannot hold a checkpoint."""
        ...

    def exclusive(self, if_locked: str) -> Exclusive:
        """Claim the location for one save ("wait" for another save, or "raise"
        CheckpointLockedError naming its holder)."""
        ...

    def path_of(self, name: str) -> str:
        """The backend's path for a data file ``name`` of this checkpoint."""
        ...

    def commit(self, manifest: bytes, save_id: str, held: Exclusive | None = None) -> None:
        """Make ``manifest`` the committed one, atomically and durably."""
        ...

    def read_manifest(self) -> bytes:
        """The committed manifest; CheckpointNotFoundError / IncompleteCheckpointError saying
        what the location holds instead."""
        ...

    def sizes(self, names: Iterable[str]) -> dict[str, int]:
        """Stored size of each named file; a missing one is absent from the result."""
        ...

    def names(self) -> list[str]:
        """Every file a ckptio save created at this location (committed or not)."""
        ...

    def remove(self, names: Iterable[str]) -> list[str]:
        """Delete files (a missing one is fine); -> "name: why" for each that failed."""
        ...
