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

Owns: AzureStore (object_tree.ObjectTreeStore over AzureBucket, this module's requests on one
container). Does not own: the Store's rules (object_tree.py), the lock's lease (az_lock.py),
URLs, the client and retries (az_client.py), the data path (az_backend.py).
"""

from __future__ import annotations

import time
from typing import Any

from ckptio.errors import CkptError, StorageIOError
from ckptio.options import Options
from ckptio.storage.azure import az_lock
from ckptio.storage.azure.az_backend import AzureBackend, head
from ckptio.storage.azure.az_client import (
    AzPath,
    Timeouts,
    call,
    checked,
    container,
    failed,
    sdk_error,
    status,
)
from ckptio.storage.azure.az_settings import AzureSettings
from ckptio.storage.files import Capabilities
from ckptio.storage.object_tree import NO_CONDITION, Bucket, Conflict, Found, ObjectTreeStore

__all__ = ["AzureBucket", "AzureStore"]

_COPY_POLL_S = 0.05


class AzureBucket:
    """One container's requests for an ObjectTreeStore (object_tree.Bucket); a tag is a blob's
    ETag (None: none)."""

    noun = "blob"
    no_tag = None

    def __init__(self, settings: AzureSettings, name: str) -> None:
        self.settings, self.name = settings, name

    def url(self, key: str) -> str:
        return AzPath(self.name, key).url

    def blob_client(self, key: str) -> Any:
        return container(self.settings, self.name).get_blob_client(key)

    def check(self, location: str) -> None:
        box = container(self.settings, self.name)
        found = checked(self.settings, f"looking up container {self.name} (for {location})",
                        lambda t: box.get_container_properties(**t), none_on=(404,))
        if found is None:
            raise StorageIOError(f"container {self.name!r} does not exist at "
                                 f"{self.settings.endpoint()} (for {location}): create it (az "
                                 "storage container create), or fix the container name or the "
                                 "account")

    def head(self, key: str) -> Found | None:
        got = head(self.settings, AzPath(self.name, key))
        return None if got is None else Found(*got)

    def get(self, key: str, offset: int, nbytes: int | None) -> bytes | None:
        blob = self.blob_client(key)
        span = f"bytes {offset}-" + ("" if nbytes is None else str(offset + nbytes - 1))
        what = f"reading {self.url(key)} ({span})"

        def request(t: Timeouts) -> bytes:
            whole = offset == 0 and nbytes is None  # an empty blob has no range
            return bytes(blob.download_blob(offset=None if whole else offset, length=nbytes,
                                            **t).readall())

        try:
            return call(self.settings, what, request)
        except sdk_error() as exc:
            if status(exc) == 416:
                return b""
            if status(exc) == 404:
                return None
            raise failed(what, exc) from exc

    def put(self, key: str, body: bytes, content_type: str, condition: Any) -> None:
        from azure.core import MatchConditions

        blob, what = self.blob_client(key), f"writing {self.url(key)}"
        when: dict[str, Any] = {}
        if condition is not NO_CONDITION:
            when = ({"etag": condition, "match_condition": MatchConditions.IfNotModified}
                    if condition else {"match_condition": MatchConditions.IfMissing})
        try:
            call(self.settings, what, lambda t: blob.upload_blob(body, overwrite=True, **when,
                                                                 **t))
        except sdk_error() as exc:
            if when and status(exc) in (409, 412):
                raise Conflict(f"{what}: another writer's blob is there") from exc
            raise failed(what, exc) from exc

    def listing(self, prefix: str, shallow: bool) -> tuple[dict[str, Found], list[str]]:
        box, what = container(self.settings, self.name), f"listing {self.url(prefix.rstrip('/'))}"
        if shallow:
            items = checked(self.settings, what, lambda t: list(box.walk_blobs(
                name_starts_with=prefix or None, delimiter="/", **t))) or []
        else:
            items = checked(self.settings, what, lambda t: list(box.list_blobs(
                name_starts_with=prefix or None, **t))) or []
        found = {i.name: Found(int(i.size), str(i.etag)) for i in items
                 if not i.name.endswith("/")}
        return found, sorted(i.name for i in items if i.name.endswith("/"))

    def delete(self, key: str) -> None:
        blob = self.blob_client(key)
        checked(self.settings, f"deleting {self.url(key)}", lambda t: blob.delete_blob(**t),
                none_on=(404,))

    def copy(self, key: str, to: Bucket, dest_key: str) -> None:
        """Copy on the service, waiting for the copy to finish."""
        if not isinstance(to, AzureBucket):
            raise CkptError(f"cannot copy {self.url(key)} to {to.url(dest_key)}: another store")
        source, blob = self.blob_client(key).url, to.blob_client(dest_key)
        what = f"copying {self.url(key)} to {to.url(dest_key)}"
        checked(self.settings, what, lambda t: blob.start_copy_from_url(source, **t))
        while True:
            props = checked(self.settings, what, lambda t: blob.get_blob_properties(**t))
            state = getattr(getattr(props, "copy", None), "status", None)
            if state in (None, "success"):
                return
            if state != "pending":
                raise StorageIOError(f"{what} failed: the copy ended {state}")
            time.sleep(_COPY_POLL_S)


class AzureStore(ObjectTreeStore):
    """One checkpoint prefix in a container. Cheap to make (no request until a method is
    called). A TreeStore: a sub-location is ``<prefix>/<name>``; move_to() copies on the service
    then deletes (blob storage has no rename), manifests last."""

    settings: AzureSettings
    where: AzPath

    def __init__(self, location: str, settings: AzureSettings) -> None:
        where = AzPath.parse(location)
        super().__init__(where, AzureBucket(settings, where.container), settings)

    def _remake(self, where: Any) -> AzureStore:
        return AzureStore(where.url, self.settings)

    @property
    def backend_kind(self) -> str:
        """One backend per settings (account, deadline, ...), shared by their prefixes; the
        key names the endpoint, never the account's key."""
        return f"azure {self.settings.endpoint()} {hash(self.settings):x}"

    @property
    def capabilities(self) -> Capabilities:
        # no endpoint: the tuned profiles (tuning/profile.py) are S3's and the filesystems'
        return Capabilities(locking=True, conditional_commit=True, remote=True)

    def backend(self, options: Options) -> AzureBackend:
        """Blocks of ``options.buffer_bytes`` (one per write), the settings' concurrency."""
        return AzureBackend(self.settings, options.buffer_bytes)

    def _in_flight(self) -> tuple[str | None, str | None]:
        """Told by its lock blob's lease (az_lock.in_flight)."""
        return az_lock.in_flight(self.where, self.settings)

    def _lock(self, if_locked: str, save: str) -> Any:
        return az_lock.take(self.where, self.settings, if_locked, save=save)
