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

Owns: GcsStore, the probe. Does not own: the lock object (gcs_lock.py), URLs, the client
and retries (gcs_client.py), the data path (gcs_backend.py), the order of a save.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

from ckptio.errors import CkptError, StorageIOError
from ckptio.format.manifest import MANIFEST_NAME
from ckptio.options import Options
from ckptio.storage.object_common import LockClaim, lost_commit, no_checkpoint
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
    status,
)
from ckptio.storage.gcs.gcs_settings import GcsSettings
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

__all__ = ["GcsStore"]

_probed: set[tuple[GcsSettings, str]] = set()
_probed_lock = threading.Lock()


class GcsStore:
    """One checkpoint prefix in a bucket. Cheap to make (no request until a method is called).
    A TreeStore: a sub-location is the prefix ``<prefix>/<name>``; move_to() copies on the
    server then deletes (GCS has no rename), manifests last."""

    def __init__(self, location: str, settings: GcsSettings) -> None:
        self.where = GcsPath.parse(location)
        self.location = self.where.url
        self.settings = settings

    def __repr__(self) -> str:
        return f"GcsStore({self.location!r})"

    @property
    def _bucket(self) -> Any:
        return client(self.settings).bucket(self.where.bucket)

    def _blob(self, name: str) -> Any:
        return self._bucket.blob(self.where.child(name).key)

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

    # -- the location ---------------------------------------------------------------------

    def prepare(self) -> None:
        name, endpoint = self.where.bucket, self.settings.endpoint()
        found = mapped(self.settings, f"looking up bucket {name} (for {self.location})",
                       lambda t: client(self.settings).lookup_bucket(name, timeout=t,
                                                                     retry=None))
        if found is None:
            raise StorageIOError(f"bucket {name!r} does not exist at {endpoint} (for "
                                 f"{self.location}): create it, or fix the bucket name or the "
                                 "endpoint (GcsSettings.endpoint_url)")
        if self.where.key and self._size(self.where.key) is not None:
            raise StorageIOError(f"checkpoint location {self.location} is an object (a file); "
                                 "choose another location")
        if self.capabilities.conditional_commit:
            self._probe()

    def _probe(self) -> None:
        """Check once per process and bucket that the store honours ifGenerationMatch=0."""
        key = (self.settings, self.where.bucket)
        with _probed_lock:
            if key in _probed:
                return
            probe = self._bucket.blob(f".ckptio-probe-{new_save_id()}")
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

    def exclusive(self, if_locked: str) -> LockClaim:
        self.prepare()
        lock = gcslock.take(self.where, self.settings, check_if_locked(if_locked),
                            save=new_save_id())
        try:
            blob = self._get(self.where.child(MANIFEST_NAME).key)
            return LockClaim(self.location, lock, 0 if blob is None else int(blob.generation))
        except BaseException:
            lock.release()
            raise

    def path_of(self, name: str) -> str:
        return self.where.child(plain_name(name, self.location)).url

    def backend(self, options: Options) -> GcsBackend:
        return GcsBackend(self.settings)

    # -- the commit -----------------------------------------------------------------------

    def commit(self, manifest: bytes, save_id: str, held: Exclusive | None = None) -> None:
        """One upload of the manifest; with ``held``, conditional on the generation seen then."""
        claim = claim_of(held, LockClaim, self.location)
        blob, body = self._blob(MANIFEST_NAME), bytes(manifest)
        condition = {}
        if claim is not None and self.capabilities.conditional_commit:
            condition = {"if_generation_match": claim.seen}
        what = f"committing the manifest {self.path_of(MANIFEST_NAME)}"
        try:
            call(self.settings, what, lambda t: blob.upload_from_string(
                body, content_type="application/json", timeout=t, retry=None, **condition))
        except errors() as exc:
            if status(exc) != 412 or not condition:
                raise StorageIOError(f"{failed(what, exc, self.settings)}; the previous "
                                     "checkpoint there, if any, is untouched") from exc
            if self._manifest_or_none() == body:
                return  # a retried upload whose first attempt landed: ours
            raise lost_commit(self.location) from None

    def read_manifest(self) -> bytes:
        manifest = self._manifest_or_none()
        if manifest is not None:
            return manifest
        entries = self.entries()
        raise no_checkpoint(self.location, entries, self.where.key,
                            lambda name: self._size(name) is not None,
                            lambda rel: self.where.child(rel).key, self.settings.endpoint(),
                            "object")

    def _manifest_or_none(self) -> bytes | None:
        blob = self._blob(MANIFEST_NAME)
        return missing(self.settings, f"reading the manifest {self.path_of(MANIFEST_NAME)}",
                       lambda t: blob.download_as_bytes(timeout=t, retry=None))

    def _range(self, name: str, offset: int, nbytes: int | None) -> bytes | None:
        """Bytes [offset, offset + nbytes) of ``name`` (None: to its end); b"" at or past its
        end; None if there is no such object."""
        blob, url = self._blob(plain_name(name, self.location)), self.path_of(name)
        end = None if nbytes is None else offset + nbytes - 1
        what = f"reading {url} (bytes {offset}-{'' if end is None else end})"
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

    def read_file(self, name: str, offset: int = 0, nbytes: int | None = None) -> bytes:
        if nbytes == 0:
            return b""
        data = self._range(name, offset, nbytes)
        if data is None:
            raise StorageIOError(f"reading {self.path_of(name)} failed: no such object")
        return exact(data, nbytes, self.path_of(name), offset)

    def _get(self, key: str) -> Any:
        return missing(self.settings, f"looking up gs://{self.where.bucket}/{key}",
                       lambda t: self._bucket.get_blob(key, timeout=t, retry=None))

    def _size(self, key: str) -> int | None:
        blob = self._get(key)
        return None if blob is None else int(blob.size)

    # -- listing and removal --------------------------------------------------------------

    def _listing(self, delimiter: bool) -> tuple[list[Any], list[str]]:
        """(blobs, sub-prefixes) under the prefix; every page."""
        prefix, bucket = self.where.dir_prefix, self.where.bucket

        def request(t: Any) -> tuple[list[Any], list[str]]:
            pages = client(self.settings).list_blobs(
                bucket, prefix=prefix or None, delimiter="/" if delimiter else None, timeout=t,
                retry=None)
            blobs = list(pages)
            return blobs, sorted(pages.prefixes)

        return mapped(self.settings, f"listing {self.location}", request)

    def objects(self) -> dict[str, int]:
        """Name -> size of the objects directly under the prefix."""
        cut = len(self.where.dir_prefix)
        return {b.name[cut:]: int(b.size) for b in self._listing(True)[0]
                if b.name[cut:] and "/" not in b.name[cut:]}

    def sizes(self, names: Iterable[str]) -> dict[str, int]:
        """A look-up each for one or two names, else one listing."""
        wanted = [plain_name(n, self.location) for n in names]
        if len(wanted) <= 2:
            found = {n: self._size(self.where.child(n).key) for n in wanted}
        else:
            stored = self.objects()
            found = {n: stored.get(n) for n in wanted}
        return {n: size for n, size in found.items() if size is not None}

    def names(self) -> list[str]:
        return sorted(n for n in self.objects() if is_ours(n))

    def delete_key(self, key: str, label: str) -> list[str]:
        """Delete one object (a missing one is fine) -> ["label: why"] on failure."""
        blob = self._bucket.blob(key)
        try:
            missing(self.settings, f"deleting gs://{self.where.bucket}/{key}",
                    lambda t: blob.delete(timeout=t, retry=None))
        except CkptError as exc:
            return [f"{label}: {exc}"]
        return []

    def remove(self, names: Iterable[str]) -> list[str]:
        problems: list[str] = []
        for name in names:
            try:
                key = self.where.child(plain_name(name, self.location)).key
            except CkptError as exc:
                problems.append(f"{name}: {exc}")
                continue
            problems += self.delete_key(key, name)
        return problems

    # -- the tree (store_contract.TreeStore) ------------------------------------------------

    def child(self, name: str) -> GcsStore:
        return GcsStore(self.where.child(plain_name(name, self.location)).url, self.settings)

    def entries(self) -> list[str]:
        cut = len(self.where.dir_prefix)
        blobs, prefixes = self._listing(True)
        found = {b.name[cut:] for b in blobs} | {p[cut:].rstrip("/") for p in prefixes}
        return sorted(n for n in found if n)

    def write_file(self, name: str, data: bytes | memoryview) -> None:
        blob, body = self._blob(plain_name(name, self.location)), bytes(data)
        mapped(self.settings, f"writing {self.path_of(name)}", lambda t: blob.upload_from_string(
            body, content_type="application/octet-stream", timeout=t, retry=None))

    def read_into(self, name: str, into: memoryview, offset: int = 0) -> int:
        if not len(into):
            return 0
        data = self._range(name, offset, len(into))
        if data is None:
            raise StorageIOError(f"reading {self.path_of(name)} failed: no such object")
        into[:len(data)] = data
        return len(data)

    def keys(self) -> list[str]:
        """Every object's key under the prefix, at any depth, manifests last."""
        keys = [b.name for b in self._listing(False)[0]]
        return sorted(keys, key=lambda k: (k.rsplit("/", 1)[-1] == MANIFEST_NAME, k))

    def remove_tree(self) -> list[str]:
        """Every object under the prefix deleted, manifests first (a kill part way leaves no
        committed checkpoint missing its data)."""
        try:
            keys = self.keys()
        except CkptError as exc:
            return [f"{self.location}: {exc}"]
        cut, problems = len(self.where.dir_prefix), []
        for key in sorted(keys, key=lambda k: k.rsplit("/", 1)[-1] != MANIFEST_NAME):
            problems += self.delete_key(key, key[cut:])
        return problems

    def move_to(self, target: TreeStore) -> None:
        """Each object copied on the server (manifests last), then this prefix removed."""
        if not isinstance(target, GcsStore) or target.settings != self.settings:
            raise CkptError(f"cannot move {self.location} to {target.location}: another store "
                            "or endpoint (copy it instead)")
        problems = target.remove_tree()
        bucket, cut = self._bucket, len(self.where.dir_prefix)
        into = client(self.settings).bucket(target.where.bucket)
        for key in self.keys():
            dest = target.where.child(key[cut:])
            mapped(self.settings, f"copying gs://{self.where.bucket}/{key} to {dest.url}",
                   lambda t: bucket.copy_blob(bucket.blob(key), into, dest.key, timeout=t,
                                              retry=None))
        problems += self.remove_tree()
        if problems:
            raise StorageIOError(f"moving {self.location} to {target.location}: "
                                 f"{'; '.join(problems)}")
