"""The storage contract: where one checkpoint's files live and how it is committed.

A ``Store`` is one checkpoint location (a local directory: local/; host memory: memory/;
a prefix in an S3 bucket: s3/store.py; any other scheme a user registers: select.py). Data
bytes move through an ``IOBackend`` the store makes (``backend()``), one per ``backend_kind``,
and reach the store's files only by name, through files.StoreFiles (``path_of``); what a store
can do is its ``capabilities`` (Capabilities, below), never a type check. A ``TreeStore`` (every
built-in store) also holds sub-locations and whole named files (the redundancy's,
redundancy/marks.py); a user's store need only be a Store.

Call order of a save (the caller's: saving/save_session.py, steps.py): ``prepare()`` ->
``exclusive(...)`` -> data files written and made durable through the backend ->
``commit(manifest)`` (atomic; conditional where capabilities.conditional_commit) -> ``names()``
/ ``remove(names)`` for what the new manifest does not name. A load: ``read_manifest()`` ->
``sizes(names)`` -> reads through the backend. Each method's own promise is on the Protocol;
why this order is crash-safe, and the naming rules (``is_ours``, ``new_save_id``):
docs/BEHAVIOUR.md, "ckptio.storage.store_contract".

Owns: the Protocols, the naming rules every store lists and cleans by. Does not own: any
implementation (local/, memory/, s3/), the manifest's content (format/manifest.py), the
order of a save (saving/save_session.py, steps.py).
"""

from __future__ import annotations

import re
import secrets
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol, TypeVar, runtime_checkable

from ckptio.errors import CkptError, StorageIOError
from ckptio.io.backend_contract import IOBackend
from ckptio.options import Options

__all__ = [
    "IF_LOCKED",
    "Capabilities",
    "TMP_PREFIX",
    "Exclusive",
    "Store",
    "TellsInFlight",
    "TreeStore",
    "check_if_locked",
    "claim_of",
    "exact",
    "is_ours",
    "new_save_id",
    "plain_name",
]

T = TypeVar("T")
IF_LOCKED = ("wait", "raise")
TMP_PREFIX = ".manifest-"  # a manifest being committed (stores that commit by rename)
# exactly the names a ckptio save creates (layout.data_file_name, a rank's index file of its
# regular shards: regular_section.index_name, the manifest's temporary name): a cleanup never
# touches anything else, e.g. a dataset's "data-00000-of-00001.arrow"
_OURS = re.compile(r"(data-[0-9a-f]{19,}-r\d{5}-(\d{4}|index)\.bin|\.manifest-[0-9a-f]{19,}\.tmp)",
                   re.ASCII)
_PLAIN = re.compile(r"[^/\\\x00]{1,255}")


def is_ours(name: str) -> bool:
    """True for a file name a ckptio save creates."""
    return _OURS.fullmatch(name) is not None


def new_save_id() -> str:
    """Time-ordered and unique: milliseconds since the epoch, then random bits."""
    return f"{int(time.time() * 1000):011x}{secrets.token_hex(4)}"


def plain_name(name: str, location: str) -> str:
    """``name`` if it is a plain file name (no path separator, not "." or ".."); else
    CkptError: a store never reaches outside its location."""
    if not isinstance(name, str) or not _PLAIN.fullmatch(name) or name in (".", ".."):
        raise CkptError(f"{name!r} is not a plain file name, so it names no file of the "
                        f"checkpoint at {location}: pass a name from its manifest")
    return name


def exact(data: bytes, nbytes: int | None, where: str, offset: int) -> bytes:
    """``data`` if it is all ``nbytes`` asked for (read_file); else StorageIOError."""
    if nbytes is not None and len(data) != nbytes:
        raise StorageIOError(f"{where} ends before byte {offset + nbytes} (read {len(data)} of "
                             f"{nbytes} bytes from byte {offset}): the file is truncated")
    return data


def check_if_locked(if_locked: str) -> str:
    if if_locked not in IF_LOCKED:
        raise CkptError(f"if_locked={if_locked!r}: use 'wait' or 'raise'")
    return if_locked


def claim_of(held: Exclusive | None, kind: type[T], location: str) -> T | None:
    """``held`` as this store's own claim (None for none): CkptError for a claim of another
    kind or location (its ``location``), or one already released (its ``released``)."""
    if held is None:
        return None
    if (not isinstance(held, kind) or getattr(held, "location", None) != location
            or getattr(held, "released", False)):
        raise CkptError(f"commit of {location}: the claim passed ({held!r}) is not a held "
                        "claim of this location; pass the claim this store's exclusive() "
                        "returned, before releasing it")
    return held


@dataclass(frozen=True)
class Capabilities:
    """What a store can do (each store's ``capabilities`` property)."""

    direct_io: bool = False  # transfers may bypass the page cache (aligned, O_DIRECT)
    registered_buffers: bool = False  # its backend may pin the staging pool (io_uring)
    rename: bool = False  # commits by an atomic rename in one directory
    locking: bool = False  # serialises saves across processes (a lock file or a lease)
    conditional_commit: bool = False  # commit(held=...) refused if another save committed
    filesystem: str | None = None  # the local directory whose tuned I/O profile applies
    endpoint: str | None = None  # the object store's endpoint whose tuned profile applies
    remote: bool = False  # across a network (an object store): compression="auto" pays there


class Exclusive(Protocol):
    """A held claim on a location: no other save commits there until released."""

    def release(self, *, failed: bool = False) -> None:
        """Let go (never raises). ``failed``: the save did not commit; a location that
        exclusive() created and that holds nothing is removed again."""
        ...


@runtime_checkable
class Store(Protocol):
    location: str  # what error messages name: a directory path, an s3:// URL

    @property
    def capabilities(self) -> Capabilities:
        """What this store can do (conditional_commit: commit(held=...) is refused,
        CheckpointLockedError, when another save committed since exclusive() was taken; else
        the claim alone protects the commit)."""
        ...

    @property
    def backend_kind(self) -> str:
        """Stores of one kind share a backend (backend() of any of them reaches all of their
        files): the key a driver keeps its backends by."""
        ...

    def prepare(self) -> None:
        """Create the location if needed; StorageIOError if it cannot hold a checkpoint."""
        ...

    def exclusive(self, if_locked: str) -> Exclusive:
        """Prepare the location and claim it for one save, across processes and machines
        ("wait" for another save, or "raise" CheckpointLockedError naming its holder)."""
        ...

    def path_of(self, name: str) -> str:
        """What the backend opens for file ``name`` of this checkpoint, and what messages name
        (CkptError for a name that is not plain). Used by files.StoreFiles and in messages:
        nothing above storage/ joins paths itself."""
        ...

    def backend(self, options: Options) -> IOBackend:
        """A new IOBackend that reaches path_of()'s paths (those of every store of this type),
        made for ``options``' I/O fields; the caller owns it and shuts it down. Positioned
        reads and writes from the staging pool: O_DIRECT/io_uring for a directory, a dict for
        host memory, multipart uploads and ranged GETs for an object store."""
        ...

    def commit(self, manifest: bytes, save_id: str, held: Exclusive | None = None) -> None:
        """Make ``manifest`` the committed one, atomically and durably, after every data file
        is durable; ``held`` (this store's claim) makes it conditional. On failure the
        previous manifest stays."""
        ...

    def read_file(self, name: str, offset: int = 0, nbytes: int | None = None) -> bytes:
        """Bytes [offset, offset + nbytes) of file ``name`` (to its end when None), without
        the staging pool: small metadata reads (index files) for manifest-only commands, which
        stay torch-free. StorageIOError if it is missing or shorter."""
        ...

    def read_manifest(self) -> bytes:
        """The committed manifest; CheckpointNotFoundError / IncompleteCheckpointError saying
        what the location holds instead."""
        ...

    def sizes(self, names: Iterable[str]) -> dict[str, int]:
        """Stored size of each named file; a missing one is absent from the result (bounds
        checks before reading; ``MANIFEST_NAME in sizes([MANIFEST_NAME])``: is a manifest
        committed)."""
        ...

    def names(self) -> list[str]:
        """Every file a ckptio save created at this location (committed or not), sorted: for
        cleanup and leftovers."""
        ...

    def remove(self, names: Iterable[str]) -> list[str]:
        """Delete files (a missing one is fine); -> "name: why" for each that failed."""
        ...


@runtime_checkable
class TellsInFlight(Protocol):
    """A store that can say what save its lock names (LocalStore, the object stores): for a
    location found without a committed manifest."""

    def in_flight(self) -> tuple[str | None, str | None, str | None]:
        """(that save, still running, None, None), (None, why it is known to have ended, None),
        (None, None, that save on another host, whose state cannot be told from here), or
        (None, None, None): no lock, or none that can be read. Only reads: never waits."""
        ...


@runtime_checkable
class TreeStore(Store, Protocol):
    """A Store whose location also holds sub-locations (each a store of the same kind) and
    whole named files written at once; every method takes plain names (``plain_name``).
    LocalStore, MemoryStore and S3Store are TreeStores; a user's registered store need only be
    a Store: the feature that needs a TreeStore (redundancy) refuses it, naming it
    (redundancy/marks.tree_of). ckptio/testing/tree_conformance.py holds the checks."""

    def child(self, name: str) -> TreeStore:
        """The store of sub-location ``name`` of this location (same kind and settings);
        nothing is created until something is written there."""
        ...

    def entries(self) -> list[str]:
        """Every name directly under this location, files and sub-locations, whatever wrote
        them, sorted; [] when nothing is there."""
        ...

    def write_file(self, name: str, data: bytes | memoryview) -> None:
        """Create or replace file ``name`` with ``data`` as a whole (a reader sees the old
        bytes or the new, never a part), durable on return; the location is made if needed."""
        ...

    def read_into(self, name: str, into: memoryview, offset: int = 0) -> int:
        """Read file ``name`` from byte ``offset`` into ``into`` -> bytes read (fewer than
        len(into) only at the file's end). StorageIOError if the file is missing."""
        ...

    def remove_tree(self) -> list[str]:
        """Delete this location and everything beneath it (a missing one is fine); -> "what:
        why" for each failure, never raising."""
        ...

    def move_to(self, target: TreeStore) -> None:
        """Move everything at this location to ``target`` (a store of this kind), replacing
        what it held; this location is empty after. One rename where capabilities.rename;
        elsewhere copied then removed, names beginning with "." (markers) first and target's
        manifests last (a checkpoint there is committed only once whole). StorageIOError if it
        cannot."""
        ...
