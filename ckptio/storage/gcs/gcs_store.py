"""A Store in a Google Cloud Storage bucket: a checkpoint is the prefix ``gs://bucket/run/step-N``.

Data files are objects ``<prefix>/data-...bin`` (written by gcs_backend.py's GcsBackend: resumable
uploads, ranged reads); the commit is one upload of ``<prefix>/manifest.json``, made only after
every rank's uploads completed. What it relies on:

- data objects are never overwritten: their names are unique to one save;
- the manifest upload is conditional (``ifGenerationMatch`` on the manifest's generation seen
  when the save took its claim, 0 where there was none), atomic on the server: a save racing
  another, or one that outlived its lock, never replaces a newer checkpoint (412 ->
  CheckpointLockedError). Real GCS honours it; a store is probed once per process and bucket
  (``conditional="require"`` refuses one that ignores it, as the gcp-storage-emulator does;
  "off" commits without, last writer wins);
- GCS's strong read-after-write consistency of objects and listings;
- an object appears only whole: a killed save leaves at most an unfinished resumable upload,
  which GCS drops on its own (nothing to list or remove).

Owns: GcsStore (object_tree.ObjectTreeStore over GcsBucket, this module's requests on one
bucket), the probe. Does not own: the Store's rules (object_tree.py), the lock object
(gcs_lock.py), URLs, the client and retries (gcs_client.py), the data path (gcs_backend.py).
"""

from __future__ import annotations

import threading
from typing import Any

from ckptio.errors import CkptError, StorageIOError
from ckptio.options import Options
from ckptio.storage.files import Capabilities
from ckptio.storage.gcs import gcs_lock as gcslock
from ckptio.storage.gcs.gcs_backend import GcsBackend
from ckptio.storage.gcs.gcs_client import (
    GcsPath,
    call,
    client,
    errors,
    failed,
    mapped,
    missing,
    no_bucket,
    status,
)
from ckptio.storage.gcs.gcs_settings import GcsSettings
from ckptio.storage.object_tree import NO_CONDITION, Bucket, Conflict, Found, ObjectTreeStore
from ckptio.storage.store_contract import new_save_id

__all__ = ["GcsBucket", "GcsStore"]

_probed: set[tuple[GcsSettings, str]] = set()
_probed_lock = threading.Lock()


class GcsBucket:
    """One bucket's requests for an ObjectTreeStore (object_tree.Bucket); a tag is an
    object's generation (0: none)."""

    noun = "object"
    no_tag = 0

    def __init__(self, settings: GcsSettings, name: str) -> None:
        self.settings, self.name = settings, name

    @property
    def handle(self) -> Any:
        """The library's Bucket object."""
        return client(self.settings).bucket(self.name)

    def url(self, key: str) -> str:
        return GcsPath(self.name, key).url

    def check(self, location: str) -> None:
        found = mapped(self.settings, f"looking up bucket {self.name} (for {location})",
                       lambda t: client(self.settings).lookup_bucket(self.name, timeout=t,
                                                                     retry=None))
        if found is None:
            raise self._no_bucket(location)

    def _no_bucket(self, location: str) -> StorageIOError:
        return no_bucket(self.settings, self.name, location)

    def head(self, key: str) -> Found | None:
        blob = missing(self.settings, f"looking up {self.url(key)}",
                       lambda t: self.handle.get_blob(key, timeout=t, retry=None))
        return None if blob is None else Found(int(blob.size), int(blob.generation))

    def get(self, key: str, offset: int, nbytes: int | None) -> bytes | None:
        blob = self.handle.blob(key)
        end = None if nbytes is None else offset + nbytes - 1
        what = f"reading {self.url(key)} (bytes {offset}-{'' if end is None else end})"
        try:
            return bytes(call(self.settings, what, lambda t: blob.download_as_bytes(
                start=offset, end=end, raw_download=True, checksum=None, timeout=t,
                retry=None)))
        except errors() as exc:
            if status(exc) == 416:
                return b""
            if status(exc) == 404:
                return None
            raise failed(what, exc, self.settings) from exc

    def put(self, key: str, body: bytes, content_type: str, condition: Any) -> None:
        blob, what = self.handle.blob(key), f"writing {self.url(key)}"
        when = {} if condition is NO_CONDITION else {"if_generation_match": condition}
        try:
            call(self.settings, what, lambda t: blob.upload_from_string(
                body, content_type=content_type, timeout=t, retry=None, **when))
        except errors() as exc:
            if when and status(exc) == 412:
                raise Conflict(f"{what}: another writer's object is there") from exc
            raise failed(what, exc, self.settings) from exc

    def listing(self, prefix: str, shallow: bool) -> tuple[dict[str, Found], list[str]]:
        def request(t: Any) -> tuple[dict[str, Found], list[str]]:
            pages = client(self.settings).list_blobs(
                self.name, prefix=prefix or None, delimiter="/" if shallow else None,
                timeout=t, retry=None)
            found = {b.name: Found(int(b.size), int(b.generation)) for b in pages}
            return found, sorted(pages.prefixes)

        what = f"listing {self.url(prefix.rstrip('/'))}"
        try:
            return call(self.settings, what, request)
        except errors() as exc:  # 404: the bucket (a listing finds no object, not a 404)
            if status(exc) == 404:
                raise self._no_bucket(self.url(prefix.rstrip("/"))) from exc
            raise failed(what, exc, self.settings) from exc

    def delete(self, key: str) -> None:
        blob = self.handle.blob(key)
        missing(self.settings, f"deleting {self.url(key)}",
                lambda t: blob.delete(timeout=t, retry=None))

    def copy(self, key: str, to: Bucket, dest_key: str) -> None:
        if not isinstance(to, GcsBucket):
            raise CkptError(f"cannot copy {self.url(key)} to {to.url(dest_key)}: another store")
        source, into = self.handle, to.handle
        mapped(self.settings, f"copying {self.url(key)} to {to.url(dest_key)}",
               lambda t: source.copy_blob(source.blob(key), into, dest_key, timeout=t,
                                          retry=None))


class GcsStore(ObjectTreeStore):
    """One checkpoint prefix in a bucket. Cheap to make (no request until a method is called).
    A TreeStore: a sub-location is the prefix ``<prefix>/<name>``; move_to() copies on the
    server then deletes (GCS has no rename), manifests last."""

    settings: GcsSettings
    where: GcsPath

    def __init__(self, location: str, settings: GcsSettings) -> None:
        where = GcsPath.parse(location)
        super().__init__(where, GcsBucket(settings, where.bucket), settings)

    def _remake(self, where: Any) -> GcsStore:
        return GcsStore(where.url, self.settings)

    @property
    def backend_kind(self) -> str:
        """One backend per client settings, shared by their prefixes."""
        return f"gs {self.settings!r}"

    @property
    def capabilities(self) -> Capabilities:
        """No ``endpoint``: that names an S3 endpoint's tuned profile (``ckptio tune``), which
        GCS has none of."""
        return Capabilities(locking=True, remote=True,
                            conditional_commit=self.settings.conditional == "require")

    def backend(self, options: Options) -> GcsBackend:
        return GcsBackend(self.settings)

    def prepare(self) -> None:
        super().prepare()
        if self.capabilities.conditional_commit:
            self._probe()

    def _in_flight(self) -> tuple[str | None, str | None]:
        """Told by its lock's lease (gcs_lock.in_flight)."""
        return gcslock.in_flight(self.where, self.settings)

    def _lock(self, if_locked: str, save: str) -> Any:
        return gcslock.take(self.where, self.settings, if_locked, save=save)

    def _probe(self) -> None:
        """Check once per process and bucket that the store honours ifGenerationMatch=0."""
        key = (self.settings, self.where.bucket)
        with _probed_lock:
            if key in _probed:
                return
            probe = client(self.settings).bucket(self.where.bucket).blob(
                f".ckptio-probe-{new_save_id()}")
            what = f"probing conditional writes with gs://{self.where.bucket}/{probe.name}"

            def put(t: Any) -> None:
                probe.upload_from_string(b"probe", if_generation_match=0, timeout=t, retry=None)

            mapped(self.settings, what, put)
            try:
                call(self.settings, what, put)
                honoured = False
            except errors() as exc:
                if status(exc) != 412:
                    raise failed(what, exc, self.settings) from exc
                honoured = True
            finally:
                missing(self.settings, what, lambda t: probe.delete(timeout=t, retry=None))
            if not honoured:
                raise StorageIOError(
                    f"the store at {self.settings.endpoint()} ignores generation preconditions "
                    "(ifGenerationMatch), which ckptio's commit relies on to never replace a "
                    "newer checkpoint: use a store that honours them (Google Cloud Storage), "
                    "or GcsSettings(conditional='off') if only one save ever writes a location "
                    "at a time (an emulator)")
            _probed.add(key)
