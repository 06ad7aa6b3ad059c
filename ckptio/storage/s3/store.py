"""A Store in an S3-compatible bucket: a checkpoint is the prefix ``s3://bucket/run/step-N``.

Data files are objects ``<prefix>/data-...bin`` (written by backend.py's S3Backend: multipart
uploads straight from the staging pool, ranged GETs); the commit is one PutObject of
``<prefix>/manifest.json``, made only after every rank's uploads completed. What it relies on:

- data objects are never overwritten: their names are unique to one save;
- the manifest PUT is conditional (``If-Match`` on the manifest's ETag seen when the save took
  its claim, ``If-None-Match: *`` where there was none), atomic on the server: a save racing
  another, or one that outlived its lock, can never replace a newer checkpoint (412 ->
  CheckpointLockedError, nothing committed). AWS S3, MinIO and SeaweedFS support both
  conditions; a store is probed once per process and bucket (``s3_conditional="require"``
  refuses one that ignores them; "off" commits without, last writer wins);
- read-after-write consistency of objects and listings (AWS S3 and a single-gateway
  SeaweedFS or MinIO; check yours);
- S3 makes an object visible only whole: a killed save leaves at most open multipart uploads,
  which names() lists and remove() aborts, so the next save's cleanup removes them.

Owns: S3Store (storage/object_tree.ObjectTreeStore over S3Bucket, this module's requests on
one bucket) and what S3 adds to the core: the probe, open multipart uploads listed and aborted,
deletes in batches, the folders some stores list. Does not own: the Store's rules
(object_tree.py), the lock object's protocol (lock.py), URLs, the client and retries
(client.py), the data path (backend.py), the order of a save.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Iterable
from typing import Any

from ckptio.errors import CkptError, StorageIOError
from ckptio.format.manifest import MANIFEST_NAME
from ckptio.options import Options
from ckptio.storage.files import Capabilities
from ckptio.storage.object_tree import NO_CONDITION, Bucket, Conflict, Found, ObjectTreeStore
from ckptio.storage.s3 import lock as s3lock
from ckptio.storage.s3 import objects as s3objects
from ckptio.storage.s3 import timeouts
from ckptio.storage.s3.backend import S3Backend
from ckptio.storage.s3.client import call, client, failed, next_uploads_page, not_s3, status
from ckptio.storage.s3.s3path import S3Path
from ckptio.storage.s3.settings import S3Settings
from ckptio.storage.store_contract import is_ours, new_save_id, plain_name

__all__ = ["S3Bucket", "S3Store"]

log = logging.getLogger("ckptio")
_probed: dict[tuple[S3Settings, str], bool] = {}
_probed_lock = threading.Lock()
_BATCH = 1000  # keys per DeleteObjects, S3's most


class S3Bucket:
    """One bucket's requests for an ObjectTreeStore (object_tree.Bucket); a tag is an ETag."""

    noun = "object"
    no_tag = None

    def __init__(self, settings: S3Settings, name: str) -> None:
        self.settings, self.name = settings, name

    @property
    def client(self) -> Any:
        return client(self.settings)

    def url(self, key: str) -> str:
        return S3Path(self.name, key).url

    def call(self, what: str, request: Any) -> Any:
        """call() with every failure as a CkptError naming ``what``."""
        try:
            return call(self.settings, what, request)
        except Exception as exc:  # noqa: BLE001 - mapped, with the cause chained
            raise failed(what, exc) from exc

    def check(self, location: str) -> None:
        c, what = self.client, f"looking up bucket {self.name} (for {location})"
        try:
            call(self.settings, what, lambda: c.head_bucket(Bucket=self.name))
        except Exception as exc:  # noqa: BLE001 - each status gets its own message
            http = status(exc)
            if http == 404:
                raise self._no_bucket(location) from None
            if http == 403:
                raise StorageIOError(f"access to bucket {self.name!r} at "
                                     f"{self.settings.endpoint()} was denied: check the "
                                     "credentials (AWS_ACCESS_KEY_ID, AWS_PROFILE) and their "
                                     "permissions") from None
            raise failed(what, exc) from exc

    def _no_bucket(self, location: str) -> CkptError:
        """Why a HEAD of the bucket found nothing. A HEAD answer has no body: one GET tells S3's
        NoSuchBucket from an endpoint that answers HTTP but is not S3 (a filer's port)."""
        from botocore.exceptions import BotoCoreError, ClientError
        endpoint = self.settings.endpoint()
        try:
            with timeouts.limited(self.settings.retry_deadline_s):  # one attempt
                self.client.list_objects_v2(Bucket=self.name, MaxKeys=1)
        except ClientError as exc:
            if not_s3(exc):
                return failed(f"looking up bucket {self.name!r} at {endpoint} (for "
                              f"{location})", exc)
        except BotoCoreError:
            pass
        return StorageIOError(f"bucket {self.name!r} does not exist at {endpoint} (for "
                              f"{location}): create it, or fix the bucket name or the endpoint")

    def head(self, key: str) -> Found | None:
        c, what = self.client, f"looking up {self.url(key)}"
        try:
            answer = call(self.settings, what, lambda: c.head_object(Bucket=self.name, Key=key))
        except Exception as exc:  # noqa: BLE001 - 404: none; the rest mapped
            if status(exc) == 404:
                return None
            raise failed(what, exc) from exc
        return Found(int(answer["ContentLength"]), str(answer["ETag"]))

    def get(self, key: str, offset: int, nbytes: int | None) -> bytes | None:
        c = self.client
        span = f"bytes={offset}-" + ("" if nbytes is None else str(offset + nbytes - 1))
        whole = {} if offset == 0 and nbytes is None else {"Range": span}  # an empty file: 416
        what = f"reading {self.url(key)} ({span})"
        try:
            return call(self.settings, what, lambda: bytes(
                c.get_object(Bucket=self.name, Key=key, **whole)["Body"].read()))
        except Exception as exc:  # noqa: BLE001 - 404: none; 416: past the end; the rest mapped
            if status(exc) == 416:
                return b""
            if status(exc) == 404:
                return None
            raise failed(what, exc) from exc

    def put(self, key: str, body: bytes, content_type: str, condition: Any) -> None:
        c, what = self.client, f"writing {self.url(key)}"
        when: dict[str, str] = {}
        if condition is not NO_CONDITION:
            when = {"IfMatch": condition} if condition else {"IfNoneMatch": "*"}
        try:
            call(self.settings, what, lambda: c.put_object(
                Bucket=self.name, Key=key, Body=body, ContentType=content_type, **when))
        except Exception as exc:  # noqa: BLE001 - 412 (or 404 for If-Match): Conflict
            if when and status(exc) in (404, 412):
                raise Conflict(f"{what}: another writer's object is there") from exc
            raise failed(what, exc) from exc

    def listing(self, prefix: str, shallow: bool) -> tuple[dict[str, Found], list[str]]:
        """Every page of ListObjectsV2 under ``prefix``."""
        c, found, prefixes = self.client, {}, []
        token: str | None = None
        while True:
            extra = {"ContinuationToken": token} if token else {}
            if shallow:
                extra["Delimiter"] = "/"
            page = self.call(f"listing {self.url(prefix.rstrip('/'))}",
                             lambda: c.list_objects_v2(Bucket=self.name, Prefix=prefix, **extra))
            found.update({o["Key"]: Found(int(o["Size"]), str(o.get("ETag") or ""))
                          for o in page.get("Contents", [])})
            prefixes += [p["Prefix"] for p in page.get("CommonPrefixes", [])]
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return found, sorted(prefixes)

    def uploads(self, prefix: str) -> list[tuple[str, str]]:
        """(key, upload id) of every open multipart upload under ``prefix``."""
        c, out, marker = self.client, [], dict[str, str]()
        while True:
            page = self.call(f"listing the uploads under {self.url(prefix.rstrip('/'))}",
                             lambda: c.list_multipart_uploads(Bucket=self.name, Prefix=prefix,
                                                              **marker))
            out += [(u["Key"], u["UploadId"]) for u in page.get("Uploads", [])]
            following = next_uploads_page(page, marker, self.url(prefix.rstrip("/")))
            if following is None:
                return out
            marker = following

    def abort(self, key: str, upload_id: str) -> None:
        c = self.client
        self.call(f"aborting the upload of {self.url(key)}", lambda: c.abort_multipart_upload(
            Bucket=self.name, Key=key, UploadId=upload_id))

    def delete(self, key: str) -> None:
        c = self.client
        self.call(f"deleting {self.url(key)}", lambda: c.delete_object(Bucket=self.name, Key=key))

    def delete_many(self, keys: list[str]) -> dict[str, str]:
        """DeleteObjects of ``keys`` -> key: why, for each one not deleted; where the store
        refuses the batch request as a whole (not every S3-compatible store has it), one
        DeleteObject per key. A store that did not answer is not asked once per key."""
        c, why = self.client, {}
        request = {"Objects": [{"Key": k} for k in keys], "Quiet": True}
        what = f"deleting {len(keys)} objects in s3://{self.name}"
        try:
            answer = call(self.settings, what,
                          lambda: c.delete_objects(Bucket=self.name, Delete=request))
        except Exception as exc:  # noqa: BLE001 - an answer: one by one; the rest: reported
            if status(exc) is None:
                return {key: str(failed(what, exc)) for key in keys}
            for key in keys:
                try:
                    self.delete(key)
                except CkptError as one:
                    why[key] = str(one)
            return why
        return {str(e.get("Key", "")): f"{e.get('Code')} {e.get('Message')}"
                for e in answer.get("Errors", [])}

    def copy(self, key: str, to: Bucket, dest_key: str) -> None:
        if not isinstance(to, S3Bucket):
            raise CkptError(f"cannot copy {self.url(key)} to {to.url(dest_key)}: another store")
        c = self.client
        self.call(f"copying {self.url(key)} to {to.url(dest_key)}", lambda: c.copy(
            {"Bucket": self.name, "Key": key}, to.name, dest_key))


class S3Store(ObjectTreeStore):
    """One checkpoint prefix in a bucket. Cheap to make (no request until a method is called).
    A TreeStore (store_contract.py): a sub-location is the prefix ``<prefix>/<name>``; move_to() copies
    then deletes (S3 has no rename), manifests last."""

    settings: S3Settings
    where: S3Path
    bucket: S3Bucket

    def __init__(self, location: str, settings: S3Settings) -> None:
        where = S3Path.parse(location)
        super().__init__(where, S3Bucket(settings, where.bucket), settings)

    def _remake(self, where: Any) -> S3Store:
        return S3Store(where.url, self.settings)

    @property
    def backend_kind(self) -> str:
        """One backend per client settings (endpoint, retries, ...), shared by their prefixes."""
        return f"s3 {self.settings!r}"

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(locking=True, conditional_commit=self.settings.conditional == "require",
                            remote=True, endpoint=self.settings.endpoint())

    def backend(self, options: Options) -> S3Backend:
        """Parts of ``options.buffer_bytes``, the concurrency of ``options``' S3 settings in
        flight, as many ranged GETs as a load keeps reads in flight (2 x ``options.io_depth``,
        loading/read.py), each of their read_bytes at most (the endpoint's tuned profile may
        have set all four, tuning/profile.py)."""
        tuned = S3Settings.of(options)
        settings = dataclasses.replace(self.settings, concurrency=tuned.concurrency,
                                       read_concurrency=tuned.read_concurrency,
                                       read_bytes=tuned.read_bytes)
        return S3Backend(settings, options.buffer_bytes)

    def _lock(self, if_locked: str, save: str) -> Any:
        return s3lock.take(self.where, self.settings, if_locked, save=save)

    def _in_flight(self) -> tuple[str | None, str | None]:
        """Told by its lock's lease (s3/lock.py in_flight)."""
        return s3lock.in_flight(self.where, self.settings)

    def prepare(self) -> None:
        super().prepare()
        if self.capabilities.conditional_commit:
            self._probe()

    def _probe(self) -> None:
        """Check once per process and bucket that the store honours If-None-Match."""
        key = (self.settings, self.where.bucket)
        with _probed_lock:
            if key in _probed:
                return
            probe = self.where.child(f".ckptio-probe-{new_save_id()}")
            c, what = self.bucket.client, f"probing conditional writes with {probe.url}"
            put = lambda: c.put_object(Bucket=probe.bucket, Key=probe.key, Body=b"probe",  # noqa: E731
                                       IfNoneMatch="*")
            self.bucket.call(what, put)
            try:
                call(self.settings, what, put)
                honoured = False
            except Exception as exc:  # noqa: BLE001 - 412 is the answer hoped for
                if status(exc) != 412:
                    raise failed(what, exc) from exc
                honoured = True
            finally:
                self.bucket.delete(probe.key)
            if not honoured:
                raise StorageIOError(
                    f"the store at {self.settings.endpoint()} ignores conditional writes "
                    "(If-None-Match), which ckptio's commit relies on to never replace a newer "
                    "checkpoint: use a store that supports them (AWS S3, MinIO, SeaweedFS >= "
                    "3.97), or S3Settings(conditional='off') (Options(s3_conditional='off')) if "
                    "only one save ever writes a location at a time")
            _probed[key] = True

    # -- what S3 adds: open uploads, batched deletes, cached look-ups -------------------------

    def sizes(self, names: Iterable[str]) -> dict[str, int]:
        """As the core's; what is found of ckptio's own data files is handed to the backend
        (objects.py): a load looks them up here first (check_files), so opening them for
        reading sends no HEAD of its own. Only those: their names are unique to one save, so an
        object a look-up saw is never legitimately replaced (a manifest, or a foreign format's
        file, may be rewritten in place)."""
        wanted = [plain_name(n, self.location) for n in names]
        if len(wanted) <= 2:
            found = {n: self.bucket.head(self.where.child(n).key) for n in wanted}
        else:
            cut = len(self.where.dir_prefix)
            listed, _ = self.bucket.listing(self.where.dir_prefix, True)
            stored = {key[cut:]: got for key, got in listed.items()}
            found = {n: stored.get(n) for n in wanted}
        endpoint = self.settings.endpoint()
        for name, got in found.items():  # no ETag listed: the open sends its HEAD
            if got is not None and got.tag and name.startswith("data-") and is_ours(name):
                s3objects.remember(endpoint, self.where.child(name).url, got.size, got.tag)
        return {n: got.size for n, got in found.items() if got is not None}

    def _uploads(self) -> list[tuple[str, str]]:
        """(name, upload id) of every open multipart upload directly under the prefix."""
        cut = len(self.where.dir_prefix)
        return [(key[cut:], upload) for key, upload in self.bucket.uploads(self.where.dir_prefix)
                if "/" not in key[cut:]]

    def names(self) -> list[str]:
        ours = {n for n in self.objects() if is_ours(n)}
        ours.update(n for n, _ in self._uploads() if is_ours(n))
        return sorted(ours)

    def remove(self, names: Iterable[str]) -> list[str]:
        problems: list[str] = []
        keys: dict[str, str] = {}
        for name in names:
            try:
                keys[self.where.child(plain_name(name, self.location)).key] = name
            except CkptError as exc:
                problems.append(f"{name}: {exc}")
        if not keys:
            return problems
        problems += self._abort_uploads(keys)
        endpoint = self.settings.endpoint()
        if timeouts.hopeless(endpoint):  # left for the next save
            return problems + [f"{name}: not deleted: the store at {endpoint} is not answering"
                               for name in keys.values()]
        return problems + self._delete(list(keys), keys)

    def _delete(self, keys: list[str], names: dict[str, str]) -> list[str]:
        """Delete ``keys`` in batches -> ["name: why"] for each one not deleted."""
        problems = []
        for start in range(0, len(keys), _BATCH):
            failed_keys = self.bucket.delete_many(keys[start:start + _BATCH])
            problems += [f"{names.get(k, k)}: {why}" for k, why in failed_keys.items()]
        return problems

    def _abort_uploads(self, keys: dict[str, str]) -> list[str]:
        try:
            uploads = self._uploads()
        except CkptError as exc:
            return [f"open uploads under {self.location}: {exc}"]
        problems, prefix = [], self.where.dir_prefix
        for name, upload_id in uploads:
            if prefix + name in keys:
                try:
                    self.bucket.abort(prefix + name, upload_id)
                except CkptError as exc:
                    problems.append(f"{name}: {exc}")
        return problems

    def remove_tree(self) -> list[str]:
        """Open uploads aborted, then every object deleted, manifests first (a kill part way
        leaves no committed checkpoint missing its data), then the folders a store may list."""
        prefix, problems = self.where.dir_prefix, []
        try:
            uploads, keys = self.bucket.uploads(prefix), self.keys()
        except CkptError as exc:
            return [f"{self.location}: {exc}"]
        for key, upload_id in uploads:
            try:
                self.bucket.abort(key, upload_id)
            except CkptError as exc:
                problems.append(f"{key[len(prefix):]}: {exc}")
        names = {k: k[len(prefix):] for k in keys}
        manifests = [k for k in keys if k.rsplit("/", 1)[-1] == MANIFEST_NAME]
        problems += self._delete(manifests, names)
        problems += self._delete([k for k in keys if k not in set(manifests)], names)
        # the folders a store may list once emptied (SeaweedFS does), deepest first; where
        # there are none (AWS S3) deleting these keys is a no-op
        folders = {k[:i + 1] for k in keys for i, ch in enumerate(k)
                   if ch == "/" and i >= len(prefix)}
        for folder in sorted(folders | ({prefix} if prefix else set()), key=len, reverse=True):
            try:
                self.bucket.delete(folder)
            except CkptError as exc:
                problems.append(f"{folder[len(prefix):] or self.location}: {exc}")
        return problems
