"""A Store in an Azure Blob Storage container: a checkpoint is the prefix
``az://container/run/step-N``.

Data files are block blobs ``<prefix>/data-...bin`` (written by az_backend.py's AzureBackend:
blocks staged from the staging pool, committed whole); the commit is one Put Blob of
``<prefix>/manifest.json``, made only after every data blob was committed, and conditional on
the service: ``If-Match`` the manifest's ETag seen when the save took its claim, or
``If-None-Match: *`` where there was none, so a save racing another, or one that outlived its
lease, never replaces a newer checkpoint (409/412 -> CheckpointLockedError, nothing committed).
Blob storage is strongly consistent: a listing after a write sees it. A killed save leaves at
most uncommitted blocks, which no listing shows and the service drops after a week.

Owns: AzureStore. Does not own: the lock's lease (az_lock.py), URLs, the client and
retries (az_client.py), the data path (az_backend.py), the order of a save.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from ckptio.errors import CkptError, StorageIOError
from ckptio.format.manifest import MANIFEST_NAME
from ckptio.options import Options
from ckptio.storage.object_common import LockClaim, lost_commit, no_checkpoint
from ckptio.storage.azure import az_lock
from ckptio.storage.azure.az_backend import AzureBackend, head
from ckptio.storage.azure.az_client import (
    AzPath,
    Timeouts,
    call,
    checked,
    container,
    describe,
    failed,
    sdk_error,
    status,
)
from ckptio.storage.azure.az_settings import AzureSettings
from ckptio.storage.files import Capabilities
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

__all__ = ["AzureStore"]

_COPY_POLL_S = 0.05


class AzureStore:
    """One checkpoint prefix in a container. Cheap to make (no request until a method is
    called). A TreeStore: a sub-location is ``<prefix>/<name>``; move_to() copies on the service
    then deletes (blob storage has no rename), manifests last."""

    def __init__(self, location: str, settings: AzureSettings) -> None:
        self.where = AzPath.parse(location)
        self.location = self.where.url
        self.settings = settings

    def __repr__(self) -> str:
        return f"AzureStore({self.location!r})"

    @property
    def _box(self) -> Any:
        return container(self.settings, self.where.container)

    def _url(self, name: str) -> str:
        """The az:// URL of blob ``name`` of this container (what messages name)."""
        return AzPath(self.where.container, name).url

    def _blob(self, name: str) -> Any:
        return self._box.get_blob_client(name)

    @property
    def backend_kind(self) -> str:
        """One backend per settings (account, deadline, ...), shared by their prefixes; the
        key names the endpoint, never the account's key."""
        return f"azure {self.settings.endpoint()} {hash(self.settings):x}"

    @property
    def capabilities(self) -> Capabilities:
        # no endpoint: the tuned profiles (tuning/profile.py) are S3's and the filesystems'
        return Capabilities(locking=True, conditional_commit=True, remote=True)

    # -- the location ---------------------------------------------------------------------

    def prepare(self) -> None:
        box, endpoint = self._box, self.settings.endpoint()
        found = checked(self.settings, f"looking up container {self.where.container} (for "
                        f"{self.location})", lambda t: box.get_container_properties(**t),
                        none_on=(404,))
        if found is None:
            raise StorageIOError(f"container {self.where.container!r} does not exist at "
                                 f"{endpoint} (for {self.location}): create it (az storage "
                                 "container create), or fix the container name or the account")
        if self.where.name and self._head(self.where.name) is not None:
            raise StorageIOError(f"checkpoint location {self.location} is a blob (a file); "
                                 "choose another location")

    def exclusive(self, if_locked: str) -> LockClaim:
        self.prepare()
        lock = az_lock.take(self.where, self.settings, check_if_locked(if_locked),
                            save=new_save_id())
        try:
            manifest = self._head(self.where.child(MANIFEST_NAME).name)
            return LockClaim(self.location, lock, None if manifest is None else manifest[1])
        except BaseException:
            lock.release()
            raise

    def path_of(self, name: str) -> str:
        return self.where.child(plain_name(name, self.location)).url

    def backend(self, options: Options) -> AzureBackend:
        """Blocks of ``options.buffer_bytes`` (one per write), the settings' concurrency."""
        return AzureBackend(self.settings, options.buffer_bytes)

    # -- the commit -----------------------------------------------------------------------

    def commit(self, manifest: bytes, save_id: str, held: Exclusive | None = None) -> None:
        """One Put Blob of the manifest; with ``held``, conditional on the ETag seen then."""
        from azure.core import MatchConditions

        claim = claim_of(held, LockClaim, self.location)
        target = self.where.child(MANIFEST_NAME)
        blob, body = self._blob(target.name), bytes(manifest)
        condition: dict[str, Any] = {}
        if claim is not None:
            condition = ({"etag": claim.seen, "match_condition": MatchConditions.IfNotModified}
                         if claim.seen else
                         {"match_condition": MatchConditions.IfMissing})
        what = f"committing the manifest {target.url}"
        try:
            call(self.settings, what, lambda t: blob.upload_blob(body, overwrite=True,
                                                                 **condition, **t))
        except (CkptError, sdk_error()) as exc:
            if status(exc) not in (409, 412) or not condition:
                raise StorageIOError(f"{what} failed: {describe(exc)}; the previous checkpoint "
                                     "there, if any, is untouched") from exc
            if self._manifest_or_none() == body:
                return  # a retried Put Blob whose first attempt landed: ours
            raise lost_commit(self.location) from None

    def read_manifest(self) -> bytes:
        manifest = self._manifest_or_none()
        if manifest is not None:
            return manifest
        entries = self._entries()
        raise no_checkpoint(self.location, entries, self.where.name,
                            lambda name: self._head(name) is not None,
                            lambda rel: self.where.child(rel).name, self.settings.endpoint(),
                            "blob")

    def _download(self, name: str, offset: int = 0, nbytes: int | None = None,
                  none_on: tuple[int, ...] = ()) -> bytes | None:
        """Bytes of blob ``name`` (a range of them); None for an answer in ``none_on``."""
        blob = self._blob(name)
        span = f"bytes {offset}-" + ("" if nbytes is None else str(offset + nbytes - 1))

        def request(t: Timeouts) -> bytes:
            whole = offset == 0 and nbytes is None  # an empty blob has no range
            return bytes(blob.download_blob(offset=None if whole else offset, length=nbytes,
                                            **t).readall())

        return checked(self.settings, f"reading {self._url(name)} ({span})",
                       request, none_on=none_on)

    def read_file(self, name: str, offset: int = 0, nbytes: int | None = None) -> bytes:
        target = self.where.child(plain_name(name, self.location))
        if nbytes == 0:
            return b""
        data = self._download(target.name, offset, nbytes)
        return exact(data or b"", nbytes, target.url, offset)

    def _manifest_or_none(self) -> bytes | None:
        return self._download(self.where.child(MANIFEST_NAME).name, none_on=(404,))

    def _head(self, name: str) -> tuple[int, str] | None:
        return head(self.settings, AzPath(self.where.container, name))

    # -- listing and removal --------------------------------------------------------------

    def _listing(self, deep: bool) -> list[Any]:
        """Blobs (and, unless ``deep``, the prefixes one level down) under the prefix."""
        box, prefix = self._box, self.where.dir_prefix
        if deep:
            return call(self.settings, f"listing {self.location}",
                        lambda t: list(box.list_blobs(name_starts_with=prefix or None, **t)))
        return checked(self.settings, f"listing {self.location}", lambda t: list(
            box.walk_blobs(name_starts_with=prefix or None, delimiter="/", **t))) or []

    def _entries(self) -> list[str]:
        """Names directly under the prefix: blobs, and first parts of deeper names."""
        cut = len(self.where.dir_prefix)
        return sorted({item.name[cut:].rstrip("/") for item in self._listing(False)} - {""})

    def _objects(self) -> dict[str, tuple[int, str]]:
        """Name -> (size, ETag) of the blobs directly under the prefix."""
        cut = len(self.where.dir_prefix)
        return {item.name[cut:]: (int(item.size), str(item.etag))
                for item in self._listing(False) if not item.name.endswith("/")}

    def sizes(self, names: Iterable[str]) -> dict[str, int]:
        """A HEAD each for one or two names, else one listing."""
        wanted = [plain_name(n, self.location) for n in names]
        if len(wanted) <= 2:
            found = {n: self._head(self.where.child(n).name) for n in wanted}
        else:
            stored = self._objects()
            found = {n: stored.get(n) for n in wanted}
        return {n: got[0] for n, got in found.items() if got is not None}

    def names(self) -> list[str]:
        return sorted(n for n in self._objects() if is_ours(n))

    def remove(self, names: Iterable[str]) -> list[str]:
        problems: list[str] = []
        for name in names:
            try:
                self._delete(self.where.child(plain_name(name, self.location)).name)
            except CkptError as exc:
                problems.append(f"{name}: {exc}")
        return problems

    def _delete(self, name: str) -> None:
        """Delete blob ``name`` (a missing one is fine); CkptError if it cannot."""
        blob = self._blob(name)
        checked(self.settings, f"deleting {self._url(name)}",
                lambda t: blob.delete_blob(**t), none_on=(404,))

    # -- the tree (store_contract.TreeStore) ----------------------------------------------

    def child(self, name: str) -> AzureStore:
        return AzureStore(self.where.child(plain_name(name, self.location)).url, self.settings)

    def entries(self) -> list[str]:
        return self._entries()

    def write_file(self, name: str, data: bytes | memoryview) -> None:
        target, body = self.where.child(plain_name(name, self.location)), bytes(data)
        blob = self._blob(target.name)
        checked(self.settings, f"writing {target.url}",
                lambda t: blob.upload_blob(body, overwrite=True, **t))

    def read_into(self, name: str, into: memoryview, offset: int = 0) -> int:
        target = self.where.child(plain_name(name, self.location))
        if not len(into):
            return 0
        stored = self._head(target.name)
        if stored is None:
            raise StorageIOError(f"reading {target.url} failed: no such blob")
        n = max(0, min(len(into), stored[0] - offset))
        if n == 0:
            return 0
        data = self._download(target.name, offset, n) or b""
        into[:len(data)] = data
        return len(data)

    def _keys(self) -> list[str]:
        """Every blob's name under the prefix, at any depth, manifests last."""
        keys = [item.name for item in self._listing(True)]
        return sorted(keys, key=lambda k: (k.rsplit("/", 1)[-1] == MANIFEST_NAME, k))

    def remove_tree(self) -> list[str]:
        try:
            keys = self._keys()
        except CkptError as exc:
            return [f"{self.location}: {exc}"]
        except sdk_error() as exc:
            return [f"{self.location}: {failed(f'listing {self.location}', exc)}"]
        problems = []
        for key in keys:
            try:
                self._delete(key)
            except CkptError as exc:
                problems.append(f"{key}: {exc}")
        return problems

    def move_to(self, target: TreeStore) -> None:
        """Each blob copied on the service (manifests last), then this prefix removed."""
        if not isinstance(target, AzureStore) or target.settings != self.settings:
            raise CkptError(f"cannot move {self.location} to {target.location}: another store "
                            "or account (copy it instead)")
        problems = target.remove_tree()
        cut = len(self.where.dir_prefix)
        for key in self._keys():
            self._copy(key, target.where.child(key[cut:]))
        problems += self.remove_tree()
        if problems:
            raise StorageIOError(f"moving {self.location} to {target.location}: "
                                 f"{'; '.join(problems)}")

    def _copy(self, key: str, dest: AzPath) -> None:
        """Copy blob ``key`` to ``dest`` on the service, waiting for the copy to finish."""
        source = self._blob(key).url
        blob = container(self.settings, dest.container).get_blob_client(dest.name)
        what = f"copying {self._url(key)} to {dest.url}"
        checked(self.settings, what, lambda t: blob.start_copy_from_url(source, **t))
        while True:
            props = checked(self.settings, what, lambda t: blob.get_blob_properties(**t))
            state = getattr(getattr(props, "copy", None), "status", None)
            if state in (None, "success"):
                return
            if state != "pending":
                raise StorageIOError(f"{what} failed: the copy ended {state}")
            time.sleep(_COPY_POLL_S)
