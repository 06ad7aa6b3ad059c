"""One checkpoint prefix in an object store as a TreeStore, over a scheme's ``Bucket``: the core
that s3:// (s3/store.py), gs:// (gcs/gcs_store.py) and az:// (azure/az_store.py) share.

A scheme gives a ``Bucket`` (a few requests on one bucket or container, each failure a CkptError
naming what failed) and a ``Place`` (its parsed URL); ``ObjectTreeStore`` makes every Store and
TreeStore method of them, so that the rules are written once: the commit is one upload of
``<prefix>/manifest.json``, conditional on what the store saw of it when the save took its
claim (``Conflict`` -> ours if the same bytes landed, else lost_commit); a listing of one or
two names is a look-up each; removal deletes manifests first, so a kill part way leaves no
committed checkpoint missing its data; move_to copies on the service, manifests last, then
removes the source. A scheme's store subclasses it for what is its own: its capabilities,
backend, lock and service checks.

Call order: as any Store (store_contract.py). Owns: those rules. Does not own: requests, retries
and URLs (each scheme's client), the data path (each scheme's backend), the lock object.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any, NamedTuple, Protocol, TypeVar

from ckptio.errors import CkptError, StorageIOError
from ckptio.format.manifest import MANIFEST_NAME
from ckptio.storage.files import Capabilities
from ckptio.storage.holder import RECORD_MAX_NBYTES, running_here
from ckptio.storage.local.dirlock import LOCK_NAME
from ckptio.storage.object_common import LockClaim, lost_commit, no_checkpoint
from ckptio.storage.store_contract import (
    Exclusive,
    TreeStore,
    check_if_locked,
    claim_of,
    exact,
    is_ours,
    new_save_id,
    plain_name,
)

__all__ = ["NO_CONDITION", "Bucket", "Conflict", "Found", "ObjectTreeStore", "Place"]

NO_CONDITION: Any = object()  # put() unconditionally
P = TypeVar("P", bound="Place")
S = TypeVar("S", bound="ObjectTreeStore")


class Found(NamedTuple):
    """An object's size and the tag a conditional put names (an ETag, a generation)."""

    size: int
    tag: Any


class Conflict(CkptError):
    """A conditional put whose condition did not hold (another writer's object is there)."""


class Place(Protocol):
    """A scheme's parsed location: its URL, its key (a prefix, no trailing '/')."""

    @property
    def url(self) -> str: ...

    @property
    def key(self) -> str: ...

    @property
    def dir_prefix(self) -> str: ...

    def child(self: P, name: str) -> P: ...


class Bucket(Protocol):
    """One bucket's requests; every failure but those named is a CkptError naming what failed."""

    noun: str  # what the service calls an object ("object", "blob")
    no_tag: Any  # the claim's tag where there is no manifest (a condition "must not exist")

    def url(self, key: str) -> str: ...

    def check(self, location: str) -> None:
        """StorageIOError naming the fix if the bucket does not exist."""

    def head(self, key: str) -> Found | None: ...

    def get(self, key: str, offset: int, nbytes: int | None) -> bytes | None:
        """Bytes [offset, offset + nbytes) (None: to the end); b"" past the end; None if no
        such object."""

    def put(self, key: str, body: bytes, content_type: str, condition: Any) -> None:
        """Upload; with a condition (not NO_CONDITION) Conflict where it does not hold."""

    def listing(self, prefix: str, shallow: bool) -> tuple[dict[str, Found], list[str]]:
        """(key -> Found, sub-prefixes) under ``prefix``; shallow: one level, with prefixes."""

    def delete(self, key: str) -> None:
        """Delete one object; a missing one is fine."""

    def copy(self, key: str, to: Bucket, dest_key: str) -> None: ...


class ObjectTreeStore:
    """A TreeStore of the prefix ``where`` in ``bucket`` (the module docstring). Subclasses
    give ``capabilities``, ``backend_kind``, ``backend``, ``_lock`` and ``_remake``."""

    def __init__(self, where: Place, bucket: Bucket, settings: Any) -> None:
        self.where, self.bucket, self.settings = where, bucket, settings
        self.location = where.url

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.location!r})"

    @property
    def capabilities(self) -> Capabilities:
        raise NotImplementedError

    def _remake(self: S, where: Place) -> S:
        """A store of this scheme and settings at ``where``."""
        raise NotImplementedError

    def _lock(self, if_locked: str, save: str) -> Any:
        """The scheme's lock on this prefix (released once by the claim)."""
        raise NotImplementedError

    def _same_service(self, target: ObjectTreeStore) -> bool:
        return type(target) is type(self) and target.settings == self.settings

    def _key(self, name: str) -> str:
        return self.where.child(plain_name(name, self.location)).key

    # -- the location ---------------------------------------------------------------------

    def prepare(self) -> None:
        self.bucket.check(self.location)
        if self.where.key and self.bucket.head(self.where.key) is not None:
            raise StorageIOError(f"checkpoint location {self.location} is {_a(self.bucket.noun)} "
                                 "(a file); choose another location")

    def exclusive(self, if_locked: str) -> LockClaim:
        self.prepare()
        lock = self._lock(check_if_locked(if_locked), new_save_id())
        try:
            found = self.bucket.head(self.where.child(MANIFEST_NAME).key)
            return LockClaim(self.location, lock, self.bucket.no_tag if found is None else found.tag)
        except BaseException:
            lock.release()
            raise

    def path_of(self, name: str) -> str:
        return self.where.child(plain_name(name, self.location)).url

    # -- the commit -----------------------------------------------------------------------

    def commit(self, manifest: bytes, save_id: str, held: Exclusive | None = None) -> None:
        """One upload of the manifest; with ``held``, conditional on what was seen then."""
        claim = claim_of(held, LockClaim, self.location)
        conditional = claim is not None and self.capabilities.conditional_commit
        condition = claim.seen if conditional and claim is not None else NO_CONDITION
        body = bytes(manifest)
        try:
            self.bucket.put(self.where.child(MANIFEST_NAME).key, body, "application/json",
                            condition)
        except Conflict:
            if self._manifest_or_none() == body:
                return  # a retried upload whose first attempt landed: ours
            raise lost_commit(self.location) from None
        except CkptError as exc:
            raise StorageIOError(f"{exc}; the previous checkpoint there, if any, is "
                                 "untouched") from exc

    def read_manifest(self) -> bytes:
        manifest = self._manifest_or_none()
        if manifest is not None:
            return manifest
        entries = self.entries()
        saving, ended = self._in_flight() if LOCK_NAME in entries else (None, None)
        raise no_checkpoint(self.location, entries, self.where.key,
                            lambda key: self.bucket.head(key) is not None,
                            lambda rel: self.where.child(rel).key, self._endpoint(),
                            self.bucket.noun, saving, ended)

    def in_flight(self) -> tuple[str | None, str | None, str | None]:
        """The save its lock object names (store_contract.TellsInFlight): a scheme's lock
        tells whether it runs from its lease, on any host, so never "elsewhere"."""
        saving, ended = self._in_flight()
        return saving, ended, None

    def _in_flight(self) -> tuple[str | None, str | None]:
        """The save its lock object names: (its holder, while it runs; None) or (None, why it
        is known to have ended); this default knows only a process alive on this host
        (holder.running_here); (None, None) when it cannot tell or read it."""
        try:
            body = self.bucket.get(self.where.child(LOCK_NAME).key, 0, RECORD_MAX_NBYTES)
            return running_here(json.loads(body or b"null")), None
        except (CkptError, ValueError):
            return None, None

    def _endpoint(self) -> str:
        return str(self.settings.endpoint())

    def _manifest_or_none(self) -> bytes | None:
        return self.bucket.get(self.where.child(MANIFEST_NAME).key, 0, None)

    def read_file(self, name: str, offset: int = 0, nbytes: int | None = None) -> bytes:
        if nbytes == 0:
            return b""
        data = self.bucket.get(self._key(name), offset, nbytes)
        if data is None:
            raise StorageIOError(f"reading {self.path_of(name)} failed: no such "
                                 f"{self.bucket.noun}")
        return exact(data, nbytes, self.path_of(name), offset)

    def read_into(self, name: str, into: memoryview, offset: int = 0) -> int:
        if not len(into):
            return 0
        data = self.bucket.get(self._key(name), offset, len(into))
        if data is None:
            raise StorageIOError(f"reading {self.path_of(name)} failed: no such "
                                 f"{self.bucket.noun}")
        into[:len(data)] = data
        return len(data)

    def write_file(self, name: str, data: bytes | memoryview) -> None:
        self.bucket.put(self._key(name), bytes(data), "application/octet-stream", NO_CONDITION)

    # -- listing and removal --------------------------------------------------------------

    def objects(self) -> dict[str, int]:
        """Name -> size of the objects directly under the prefix."""
        cut = len(self.where.dir_prefix)
        found, _ = self.bucket.listing(self.where.dir_prefix, True)
        return {key[cut:]: got.size for key, got in found.items()
                if key[cut:] and "/" not in key[cut:]}

    def sizes(self, names: Iterable[str]) -> dict[str, int]:
        """A look-up each for one or two names, else one listing."""
        wanted = [plain_name(n, self.location) for n in names]
        if len(wanted) <= 2:
            heads = {n: self.bucket.head(self.where.child(n).key) for n in wanted}
            return {n: got.size for n, got in heads.items() if got is not None}
        stored = self.objects()
        return {n: stored[n] for n in wanted if n in stored}

    def names(self) -> list[str]:
        return sorted(n for n in self.objects() if is_ours(n))

    def remove(self, names: Iterable[str]) -> list[str]:
        problems: list[str] = []
        for name in names:
            try:
                self.bucket.delete(self._key(name))
            except CkptError as exc:
                problems.append(f"{name}: {exc}")
        return problems

    # -- the tree (store_contract.TreeStore) ----------------------------------------------

    def child(self: S, name: str) -> S:
        return self._remake(self.where.child(plain_name(name, self.location)))

    def entries(self) -> list[str]:
        """Names directly under the prefix: objects, and first parts of deeper names."""
        cut = len(self.where.dir_prefix)
        found, prefixes = self.bucket.listing(self.where.dir_prefix, True)
        names = {key[cut:] for key in found} | {p[cut:].rstrip("/") for p in prefixes}
        return sorted(n for n in names if n)

    def keys(self) -> list[str]:
        """Every object's key under the prefix, at any depth: markers (names beginning with
        ".") first, manifests last, so a copy in this order cut short is marked or uncommitted."""
        found, _ = self.bucket.listing(self.where.dir_prefix, False)
        return sorted(found, key=_copy_order)

    def names_below(self) -> list[str]:
        """Every object's name under the prefix, at any depth, relative to it (one listing,
        paged by the service)."""
        cut = len(self.where.dir_prefix)
        found, _ = self.bucket.listing(self.where.dir_prefix, False)
        return sorted(key[cut:] for key in found if key[cut:])

    def remove_tree(self) -> list[str]:
        """Every object under the prefix deleted, manifests first (a kill part way leaves no
        committed checkpoint missing its data)."""
        try:
            keys = self.keys()
        except CkptError as exc:
            return [f"{self.location}: {exc}"]
        cut, problems = len(self.where.dir_prefix), []
        for key in sorted(keys, key=lambda k: k.rsplit("/", 1)[-1] != MANIFEST_NAME):
            try:
                self.bucket.delete(key)
            except CkptError as exc:
                problems.append(f"{key[cut:]}: {exc}")
        return problems

    def move_to(self, target: TreeStore) -> None:
        """Each object copied on the service (manifests last), then this prefix removed."""
        if not isinstance(target, ObjectTreeStore) or not self._same_service(target):
            raise CkptError(f"cannot move {self.location} to {target.location}: another store "
                            "or endpoint (copy it instead)")
        problems = target.remove_tree()
        cut = len(self.where.dir_prefix)
        for key in self.keys():
            self.bucket.copy(key, target.bucket, target.where.child(key[cut:]).key)
        problems += self.remove_tree()
        if problems:
            raise StorageIOError(f"moving {self.location} to {target.location}: "
                                 f"{'; '.join(problems)}")


def _copy_order(key: str) -> tuple[bool, bool, str]:
    name = key.rsplit("/", 1)[-1]
    return name == MANIFEST_NAME, not name.startswith("."), key


def _a(noun: str) -> str:
    return f"an {noun}" if noun[:1] in "aeiou" else f"a {noun}"
