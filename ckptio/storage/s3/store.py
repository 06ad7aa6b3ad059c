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

Owns: S3Store, the probe. Does not own: the lock object's protocol (lock.py), URLs,
the client and retries (client.py), the data path (backend.py), the order of a save.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Iterable, Iterator
from typing import Any

from ckptio.errors import CkptError, StorageIOError
from ckptio.format.manifest import MANIFEST_NAME
from ckptio.options import Options
from ckptio.storage.files import Capabilities
from ckptio.storage.object_common import LockClaim, lost_commit, no_checkpoint
from ckptio.storage.s3 import lock as s3lock
from ckptio.storage.s3 import objects as s3objects
from ckptio.storage.s3 import timeouts
from ckptio.storage.s3.backend import S3Backend
from ckptio.storage.s3.client import S3Path, call, client, describe, failed, not_s3, status
from ckptio.storage.s3.settings import S3Settings
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

__all__ = ["S3Store"]

log = logging.getLogger("ckptio")
_probed: dict[tuple[S3Settings, str], bool] = {}
_probed_lock = threading.Lock()


class S3Store:
    """One checkpoint prefix in a bucket. Cheap to make (no request until a method is called).
    A TreeStore (store_contract.py): a sub-location is the prefix ``<prefix>/<name>``; move_to() copies
    then deletes (S3 has no rename), manifests last."""

    def __init__(self, location: str, settings: S3Settings) -> None:
        self.where = S3Path.parse(location)
        self.location = self.where.url
        self.settings = settings

    def __repr__(self) -> str:
        return f"S3Store({self.location!r})"

    @property
    def _client(self) -> Any:
        return client(self.settings)

    def _call(self, what: str, request: Any) -> Any:
        try:
            return call(self.settings, what, request)
        except Exception as exc:  # noqa: BLE001 - mapped, with the cause chained
            raise failed(what, exc) from exc

    @property
    def backend_kind(self) -> str:
        """One backend per client settings (endpoint, retries, ...), shared by their prefixes."""
        return f"s3 {self.settings!r}"

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(locking=True, conditional_commit=self.settings.conditional == "require",
                            remote=True, endpoint=self.settings.endpoint())

    # -- the location ---------------------------------------------------------------------

    def _no_bucket(self, bucket: str) -> CkptError:
        """Why a HEAD of ``bucket`` found nothing. A HEAD answer has no body: one GET tells S3's
        NoSuchBucket from an endpoint that answers HTTP but is not S3 (a filer's port)."""
        from botocore.exceptions import BotoCoreError, ClientError
        endpoint = self.settings.endpoint()
        try:
            with timeouts.limited(self.settings.retry_deadline_s):  # one attempt
                self._client.list_objects_v2(Bucket=bucket, MaxKeys=1)
        except ClientError as exc:
            if not_s3(exc):
                return failed(f"looking up bucket {bucket!r} at {endpoint} (for "
                              f"{self.location})", exc)
        except BotoCoreError:
            pass
        return StorageIOError(f"bucket {bucket!r} does not exist at {endpoint} (for "
                              f"{self.location}): create it, or fix the bucket name or the "
                              "endpoint")

    def prepare(self) -> None:
        bucket, c = self.where.bucket, self._client
        what = f"looking up bucket {bucket} (for {self.location})"
        try:
            call(self.settings, what, lambda: c.head_bucket(Bucket=bucket))
        except Exception as exc:  # noqa: BLE001 - each status gets its own message
            http = status(exc)
            if http == 404:
                raise self._no_bucket(bucket) from None
            if http == 403:
                raise StorageIOError(f"access to bucket {bucket!r} at {self.settings.endpoint()} "
                                     "was denied: check the credentials (AWS_ACCESS_KEY_ID, "
                                     "AWS_PROFILE) and their permissions") from None
            raise failed(what, exc) from exc
        if self.where.key and self._head(self.where.key) is not None:
            raise StorageIOError(f"checkpoint location {self.location} is an object (a file); "
                                 "choose another location")
        if self.capabilities.conditional_commit:
            self._probe()

    def _probe(self) -> None:
        """Check once per process and bucket that the store honours If-None-Match."""
        key = (self.settings, self.where.bucket)
        with _probed_lock:
            if key in _probed:
                return
            probe = self.where.child(f".ckptio-probe-{new_save_id()}")
            c = self._client
            put = lambda: c.put_object(Bucket=probe.bucket, Key=probe.key, Body=b"probe",  # noqa: E731
                                       IfNoneMatch="*")
            self._call(f"probing conditional writes with {probe.url}", put)
            try:
                call(self.settings, f"probing conditional writes with {probe.url}", put)
                honoured = False
            except Exception as exc:  # noqa: BLE001 - 412 is the answer hoped for
                if status(exc) != 412:
                    raise failed(f"probing conditional writes with {probe.url}", exc) from exc
                honoured = True
            finally:
                self._call(f"removing {probe.url}",
                           lambda: c.delete_object(Bucket=probe.bucket, Key=probe.key))
            if not honoured:
                raise StorageIOError(
                    f"the store at {self.settings.endpoint()} ignores conditional writes "
                    "(If-None-Match), which ckptio's commit relies on to never replace a newer "
                    "checkpoint: use a store that supports them (AWS S3, MinIO, SeaweedFS >= "
                    "3.97), or S3Settings(conditional='off') (Options(s3_conditional='off')) if "
                    "only one save ever writes a location at a time")
            _probed[key] = True

    def exclusive(self, if_locked: str) -> LockClaim:
        self.prepare()
        lock = s3lock.take(self.where, self.settings, check_if_locked(if_locked),
                           save=new_save_id())
        try:
            head = self._head(self.where.child(MANIFEST_NAME).key)
            return LockClaim(self.location, lock, None if head is None else head[1])
        except BaseException:
            lock.release()
            raise

    def path_of(self, name: str) -> str:
        return self.where.child(plain_name(name, self.location)).url

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

    # -- the commit -----------------------------------------------------------------------

    def commit(self, manifest: bytes, save_id: str, held: Exclusive | None = None) -> None:
        """One PutObject of the manifest; with ``held``, conditional on the ETag seen then."""
        claim = claim_of(held, LockClaim, self.location)
        target, c = self.where.child(MANIFEST_NAME), self._client
        condition: dict[str, str] = {}
        if claim is not None and self.capabilities.conditional_commit:
            condition = {"IfMatch": claim.seen} if claim.seen else {"IfNoneMatch": "*"}
        what = f"committing the manifest {target.url}"
        try:
            call(self.settings, what, lambda: c.put_object(
                Bucket=target.bucket, Key=target.key, Body=manifest, **condition))
        except Exception as exc:  # noqa: BLE001 - 412: decided below; the rest mapped
            if status(exc) not in (404, 412) or not condition:
                raise StorageIOError(f"{what} failed: {describe(exc)}; the previous checkpoint "
                                     "there, if any, is untouched") from exc
            if self._manifest_or_none() == bytes(manifest):
                return  # a retried PUT whose first attempt landed: ours
            raise lost_commit(self.location) from None

    def read_manifest(self) -> bytes:
        manifest = self._manifest_or_none()
        if manifest is not None:
            return manifest
        entries = self._entries()
        raise no_checkpoint(self.location, entries, self.where.key,
                            lambda name: self._head(name) is not None,
                            lambda rel: self.where.child(rel).key, self.settings.endpoint(),
                            "object")

    def read_file(self, name: str, offset: int = 0, nbytes: int | None = None) -> bytes:
        target, c = self.where.child(plain_name(name, self.location)), self._client
        span = f"bytes={offset}-" + ("" if nbytes is None else str(offset + nbytes - 1))
        if nbytes == 0:
            return b""

        whole = {} if offset == 0 and nbytes is None else {"Range": span}  # an empty file: 416

        def request() -> bytes:
            return bytes(c.get_object(Bucket=target.bucket, Key=target.key, **whole)["Body"].read())

        return exact(self._call(f"reading {target.url} ({span})", request), nbytes, target.url,
                     offset)

    def _manifest_or_none(self) -> bytes | None:
        target, c = self.where.child(MANIFEST_NAME), self._client
        what = f"reading the manifest {target.url}"

        def request() -> bytes:
            return bytes(c.get_object(Bucket=target.bucket, Key=target.key)["Body"].read())

        try:
            return call(self.settings, what, request)
        except Exception as exc:  # noqa: BLE001 - 404: none; the rest mapped
            if status(exc) == 404:
                return None
            raise failed(what, exc) from exc

    def _head(self, key: str) -> tuple[int, str] | None:
        c, bucket = self._client, self.where.bucket
        what = f"looking up s3://{bucket}/{key}"
        try:
            answer = call(self.settings, what, lambda: c.head_object(Bucket=bucket, Key=key))
        except Exception as exc:  # noqa: BLE001 - 404: none; the rest mapped
            if status(exc) == 404:
                return None
            raise failed(what, exc) from exc
        return int(answer["ContentLength"]), str(answer["ETag"])

    # -- listing and removal --------------------------------------------------------------

    def _list(self, delimiter: bool) -> Iterator[dict[str, Any]]:
        """Pages of ListObjectsV2 under the prefix."""
        c, bucket, prefix = self._client, self.where.bucket, self.where.dir_prefix
        token: str | None = None
        while True:
            extra = {"ContinuationToken": token} if token else {}
            if delimiter:
                extra["Delimiter"] = "/"
            page = self._call(f"listing {self.location}", lambda: c.list_objects_v2(
                Bucket=bucket, Prefix=prefix, **extra))
            yield page
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return

    def _entries(self) -> list[str]:
        """Names directly under the prefix: objects, and first parts of deeper keys."""
        cut = len(self.where.dir_prefix)
        found: set[str] = set()
        for page in self._list(delimiter=True):
            found.update(o["Key"][cut:] for o in page.get("Contents", []))
            found.update(p["Prefix"][cut:].rstrip("/") for p in page.get("CommonPrefixes", []))
        return sorted(n for n in found if n)

    def _objects(self) -> dict[str, tuple[int, str]]:
        """Name -> (size, ETag) of the objects directly under the prefix."""
        cut = len(self.where.dir_prefix)
        return {o["Key"][cut:]: (int(o["Size"]), str(o.get("ETag") or ""))
                for page in self._list(delimiter=True)
                for o in page.get("Contents", []) if "/" not in o["Key"][cut:]}

    def _uploads(self, deep: bool = False) -> list[tuple[str, str]]:
        """(name, upload id) of every open multipart upload directly under the prefix (deep:
        at any depth, the name then a relative key)."""
        c, bucket, prefix = self._client, self.where.bucket, self.where.dir_prefix
        cut, out = len(prefix), []
        marker: dict[str, str] = {}
        while True:
            page = self._call(f"listing the uploads under {self.location}", lambda: c
                              .list_multipart_uploads(Bucket=bucket, Prefix=prefix, **marker))
            out += [(u["Key"][cut:], u["UploadId"]) for u in page.get("Uploads", [])
                    if deep or "/" not in u["Key"][cut:]]
            if not page.get("IsTruncated"):
                return out
            marker = {"KeyMarker": page.get("NextKeyMarker", ""),
                      "UploadIdMarker": page.get("NextUploadIdMarker", "")}

    def sizes(self, names: Iterable[str]) -> dict[str, int]:
        """A HEAD each for one or two names, else one listing. What is found of ckptio's own
        data files is handed to the backend (objects.py): a load looks them up here first
        (check_files), so opening them for reading sends no HEAD of its own. Only those: their
        names are unique to one save, so an object a look-up saw is never legitimately replaced
        (a manifest, or a foreign format's file, may be rewritten in place)."""
        wanted = [plain_name(n, self.location) for n in names]
        if len(wanted) <= 2:
            found = {n: self._head(self.where.child(n).key) for n in wanted}
        else:
            stored = self._objects()
            found = {n: stored.get(n) for n in wanted}
        endpoint = self.settings.endpoint()
        for name, head in found.items():  # no ETag listed: the open sends its HEAD
            if head is not None and head[1] and name.startswith("data-") and is_ours(name):
                s3objects.remember(endpoint, self.where.child(name).url, *head)
        return {n: head[0] for n, head in found.items() if head is not None}

    def names(self) -> list[str]:
        ours = {n for n in self._objects() if is_ours(n)}
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
        batch = list(keys)
        for start in range(0, len(batch), 1000):
            problems += self._delete(batch[start:start + 1000], keys)
        return problems

    def _delete(self, batch: list[str], names: dict[str, str]) -> list[str]:
        """DeleteObjects of ``batch``; where the store refuses the batch request as a whole
        (not every S3-compatible store has it), one DeleteObject per key. A store that did not
        answer is not asked once per key: the next save's cleanup removes them."""
        c, bucket = self._client, self.where.bucket
        request = {"Objects": [{"Key": k} for k in batch], "Quiet": True}
        what = f"deleting {len(batch)} objects under {self.location}"
        try:
            answer = call(self.settings, what,
                          lambda: c.delete_objects(Bucket=bucket, Delete=request))
        except Exception as exc:  # noqa: BLE001 - an answer: one by one; the rest: reported
            if status(exc) is None:
                return [f"{names[key]}: {failed(what, exc)}" for key in batch]
            return [problem for key in batch for problem in self._delete_one(key, names[key])]
        return [f"{names.get(e.get('Key', ''), e.get('Key'))}: {e.get('Code')} {e.get('Message')}"
                for e in answer.get("Errors", [])]

    def _delete_one(self, key: str, name: str) -> list[str]:
        c, bucket = self._client, self.where.bucket
        try:
            self._call(f"deleting {name} of {self.location}",
                       lambda: c.delete_object(Bucket=bucket, Key=key))
        except CkptError as exc:
            return [f"{name}: {exc}"]
        return []

    def _abort_uploads(self, keys: dict[str, str]) -> list[str]:
        c, bucket, prefix = self._client, self.where.bucket, self.where.dir_prefix
        try:
            uploads = self._uploads()
        except CkptError as exc:
            return [f"open uploads under {self.location}: {exc}"]
        problems = []
        for name, upload_id in uploads:
            if prefix + name not in keys:
                continue
            try:
                self._call(f"aborting the upload of {name}", lambda: c.abort_multipart_upload(
                    Bucket=bucket, Key=prefix + name, UploadId=upload_id))
            except CkptError as exc:
                problems.append(f"{name}: {exc}")
        return problems

    # -- the tree (store_contract.TreeStore) --------------------------------------------------------

    def child(self, name: str) -> S3Store:
        return S3Store(self.where.child(plain_name(name, self.location)).url, self.settings)

    def entries(self) -> list[str]:
        return self._entries()

    def write_file(self, name: str, data: bytes | memoryview) -> None:
        target, c = self.where.child(plain_name(name, self.location)), self._client
        body = bytes(data)
        self._call(f"writing {target.url}", lambda: c.put_object(
            Bucket=target.bucket, Key=target.key, Body=body))

    def read_into(self, name: str, into: memoryview, offset: int = 0) -> int:
        target, c = self.where.child(plain_name(name, self.location)), self._client
        if not len(into):
            return 0
        span, what = f"bytes={offset}-{offset + len(into) - 1}", f"reading {target.url}"

        def request() -> bytes:
            answer = c.get_object(Bucket=target.bucket, Key=target.key, Range=span)
            return bytes(answer["Body"].read())

        try:
            data = call(self.settings, what, request)
        except Exception as exc:  # noqa: BLE001 - 416: at or past the end; the rest mapped
            if status(exc) == 416:
                return 0
            raise failed(what, exc) from exc
        into[:len(data)] = data
        return len(data)

    def _keys(self) -> list[str]:
        """Every object's key under the prefix, at any depth, manifests last."""
        keys = [o["Key"] for page in self._list(delimiter=False) for o in page.get("Contents", [])]
        return sorted(keys, key=lambda k: (k.rsplit("/", 1)[-1] == MANIFEST_NAME, k))

    def remove_tree(self) -> list[str]:
        c, bucket, prefix = self._client, self.where.bucket, self.where.dir_prefix
        problems: list[str] = []
        try:
            uploads, keys = self._uploads(deep=True), self._keys()
        except CkptError as exc:
            return [f"{self.location}: {exc}"]
        for rel, upload_id in uploads:
            try:
                self._call(f"aborting the upload of {rel}", lambda: c.abort_multipart_upload(
                    Bucket=bucket, Key=prefix + rel, UploadId=upload_id))
            except CkptError as exc:
                problems.append(f"{rel}: {exc}")
        for start in range(0, len(keys), 1000):
            batch = keys[start:start + 1000]
            problems += self._delete(batch, {k: k[len(prefix):] for k in batch})
        # the folders a store may list once emptied (SeaweedFS does), deepest first; where
        # there are none (AWS S3) deleting these keys is a no-op
        folders = {k[:i + 1] for k in keys for i, ch in enumerate(k)
                   if ch == "/" and i >= len(prefix)}
        for folder in sorted(folders | ({prefix} if prefix else set()), key=len, reverse=True):
            problems += self._delete_one(folder, folder[len(prefix):] or self.location)
        return problems

    def move_to(self, target: TreeStore) -> None:
        """Each object copied (server side, manifests last), then this prefix removed."""
        if not isinstance(target, S3Store) or target.settings != self.settings:
            raise CkptError(f"cannot move {self.location} to {target.location}: another store "
                            "or endpoint (copy it instead)")
        problems = target.remove_tree()
        c, into, cut = self._client, target.where, len(self.where.dir_prefix)
        for key in self._keys():
            dest = into.child(key[cut:])
            self._call(f"copying s3://{self.where.bucket}/{key} to {dest.url}", lambda: c.copy(
                {"Bucket": self.where.bucket, "Key": key}, dest.bucket, dest.key))
        problems += self.remove_tree()
        if problems:
            raise StorageIOError(f"moving {self.location} to {target.location}: "
                                 f"{'; '.join(problems)}")
