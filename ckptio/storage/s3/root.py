"""A CheckpointManager's steps under an S3 prefix: S3Root (the ``s3://`` entry's step root).

Steps are the CommonPrefixes ``<root>/step-N/`` of a ListObjectsV2 (Delimiter "/"); a step is
committed when ``step-N/manifest.json`` exists (HEAD), incomplete when it holds other objects
only (an empty prefix, which some servers keep listing, is no step). S3 has no rename, so a
retention removes a step in an order that is safe at every point:

1. PUT the marker ``step-N/.deleting`` (only on a step a HEAD found committed): from then on
   the prefix is hidden from every listing, so a kill leaves no half-deleted step listed;
2. DELETE the manifest: the step is no longer committed, whatever reads it directly;
3. on the manager's removal thread: DELETE the manifest again (a kill between 1 and 2), every
   object under ``step-N/`` and the open multipart uploads there; check nothing but the
   marker is left; DELETE the marker last.

A marker left by a kill is found by the next scan, its removal finished by the next retention;
a save into step N first finishes a removal pending there. Only marked prefixes are emptied;
incomplete steps are never deleted.

Owns: S3Root (listing, the marker, the order of a removal, what a prefix holds instead of
steps, when the run's lease is taken). Does not own: which steps to keep (the manager), one
checkpoint's objects and its commit (store.py), the lease object (lock.py), URLs, the client
and retries (client.py).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from ckptio.errors import CkptError, StorageIOError
from ckptio.format.manifest import MANIFEST_NAME
from ckptio.storage.object_common import (FOREIGN, MARKER, MARKER_BODY, MarkedSteps, held_state,
                                          kept_name)
from ckptio.storage.s3 import lock as s3lock
from ckptio.storage.s3.client import call, client, code, failed, next_uploads_page, status
from ckptio.storage.s3.s3path import S3Path
from ckptio.storage.s3.settings import S3Settings
from ckptio.storage.steproot import (
    Listing,
    Nothing,
    Removal,
    Usage,
    nothing_message,
    step_name,
    step_of,
)

__all__ = ["MARKER", "S3Root"]

log = logging.getLogger("ckptio")
T = TypeVar("T")
_BATCH = 1000  # DeleteObjects' limit
_NAMES_PROBED = 20  # nothing_here(): prefixes checked for a manifest
_STEPS_PER_PAGE = 32  # scan(): steps a page of the listing of every key must tell apart
_PAGE_KEYS = 1000  # a step's first page of keys: what tells its state apart, in one request
_KINDS = {"committed": ("committed",), "incomplete": ("incomplete", FOREIGN)}


class S3Root:
    """A prefix of ``step-N/`` prefixes (see the module docstring). Not thread-safe, except
    that the removal it hands out may run on another thread."""

    def __init__(self, location: str, settings: S3Settings) -> None:
        self.where = S3Path.parse(location)
        self.location = self.where.url
        self.settings = settings
        self._marked = MarkedSteps(  # marked steps seen, not yet handed to a removal
            self.path, self._finish, lambda step: self._exists(self._base(step) + MARKER),
            lambda: f"the bucket at {self.settings.endpoint()} (DeleteObject, ListBucket, "
                    "AbortMultipartUpload)")
        self._foreign: set[int] = set()  # the last scan's steps holding torch_checkpointing's

    def __repr__(self) -> str:
        return f"S3Root({self.location!r})"

    def path(self, step: int) -> str:
        return self.where.child(step_name(step)).url

    def lease(self, take_over: bool, *, create: bool) -> s3lock.S3Lock | None:
        """LeasedRoot: the run's lease (lock.take_run), taken at the manager's first save
        (``create``; a reader of a live run writes nothing there); none on a store whose
        conditional writes are off (it could not tell two takers apart)."""
        if not create or self.settings.conditional != "require":
            return None
        return s3lock.take_run(self.where, self.settings, take_over)

    # -- listing ----------------------------------------------------------------------------

    def scan(self) -> Listing:
        """The step prefixes, committed and incomplete, ascending; marked ones left out (and
        remembered for the next removal()). Many steps are told apart by one listing of every
        key under the root (_listed_states), else each by its own look-ups (_state)."""
        steps = sorted({s for s in map(step_of, self._entries()[1]) if s is not None})
        states = self._listed_states(steps) if len(steps) > _STEPS_PER_PAGE else None
        if states is None:
            states = dict(zip(steps, self._each(self._state, steps)))
        self._marked.add(s for s, state in states.items() if state == "marked")
        self._foreign = {s for s, state in states.items() if state == FOREIGN}
        return {kind: [s for s in steps if states[s] in _KINDS[kind]]
                for kind in ("committed", "incomplete")}

    def foreign(self, incomplete: list[int]) -> list[int]:
        """ForeignRoot: those of ``incomplete`` the last scan() found holding a
        torch_checkpointing checkpoint, from the names it listed (no request here)."""
        return sorted(self._foreign.intersection(incomplete))

    def _state(self, step: int) -> str:
        """"marked", "committed", "incomplete", FOREIGN or "empty" (a prefix left listed, no
        step); the listing that tells the last three apart is one request (a page of keys)."""
        base = self._base(step)
        if self._exists(base + MARKER):
            return "marked"
        if self._exists(base + MANIFEST_NAME):
            return "committed"
        return held_state(kept_name(k[len(base):]) for k in self._keys(base, limit=_PAGE_KEYS))

    def _listed_states(self, steps: list[int]) -> dict[int, str] | None:
        """_state() of every one of ``steps`` from one listing of every key under the root,
        or None if that takes more than a page per _STEPS_PER_PAGE steps (steps of many
        objects: their look-ups cost less)."""
        seen: dict[int, set[str]] = {step: set() for step in steps}
        cut = len(self.where.dir_prefix)
        for number, page in enumerate(self._pages(self.where.dir_prefix), 1):
            for obj in page.get("Contents", []):
                name, inside, rest = obj["Key"][cut:].partition("/")
                step = step_of(name)
                if inside and step in seen:
                    seen[step].add(kept_name(rest))
            if page.get("IsTruncated") and number >= len(steps) // _STEPS_PER_PAGE:
                return None
        return {step: held_state(names) for step, names in seen.items()}

    def is_committed(self, step: int) -> bool:
        return self._exists(self._base(step) + MANIFEST_NAME)

    def marked(self) -> list[int]:
        """The steps scan() found marked for removal and not yet handed to a removal: being
        deleted (``ckptio ls`` shows them as such), ascending."""
        return self._marked.sorted()

    def being_deleted(self) -> list[tuple[int, str]]:
        """ListedRoot: the marked steps, each at its own prefix."""
        return [(step, self.path(step)) for step in self.marked()]

    def usage(self, where: str) -> Usage:
        """Bytes, objects and newest LastModified under the prefix ``where`` (ListObjectsV2)."""
        nbytes = files = 0
        newest: float | None = None
        for page in self._pages(S3Path.parse(where).dir_prefix):
            for obj in page.get("Contents", []):
                nbytes, files = nbytes + int(obj["Size"]), files + 1
                when = obj["LastModified"].timestamp()
                newest = when if newest is None else max(newest, when)
        return nbytes, files, newest

    # -- removal ----------------------------------------------------------------------------

    def hide(self, step: int) -> bool:
        """object_common.MarkedSteps.hide: the marker PUT beside the step's manifest."""
        base, url, c, bucket = self._base(step), self.path(step), self._client, self.where.bucket
        return self._marked.hide(
            step, lambda: self._exists(base + MANIFEST_NAME),
            lambda: self._call(f"marking {url} for removal", lambda: c.put_object(
                Bucket=bucket, Key=base + MARKER, Body=MARKER_BODY)),
            lambda: self._delete([base + MANIFEST_NAME], url))

    def removal(self, step: int | None = None) -> Removal | None:
        """object_common.MarkedSteps.removal: every marked step in the background, or step N's
        before a save into it."""
        return self._marked.removal(step)

    def _finish(self, step: int) -> list[str]:
        """Delete the manifest, then every object and open upload under the marked ``step``,
        then the marker -> the problems (the marker is kept if there are any)."""
        base, url = self._base(step), self.path(step)
        problems = self._delete([base + MANIFEST_NAME], url)
        if problems:
            return problems
        keys = [k for k in self._keys(base) if k != base + MARKER]
        for start in range(0, len(keys), _BATCH):
            problems += self._delete(keys[start:start + _BATCH], url)
        problems += self._abort_uploads(base, url)
        if problems:
            return problems
        left = [k for k in self._keys(base) if k != base + MARKER]
        if left:
            return [f"{len(left)} objects appeared under {url} while it was removed (another "
                    f"writer there?), e.g. {left[0]}"]
        return self._delete([base + MARKER], url)

    def _delete(self, keys: list[str], url: str) -> list[str]:
        c, bucket = self._client, self.where.bucket
        request = {"Objects": [{"Key": k} for k in keys], "Quiet": True}
        try:
            answer = self._call(f"deleting {len(keys)} objects under {url}",
                                lambda: c.delete_objects(Bucket=bucket, Delete=request))
        except CkptError as exc:
            return [str(exc)]
        return [f"s3://{bucket}/{e.get('Key')}: {e.get('Code')} {e.get('Message')}"
                for e in answer.get("Errors", [])]

    def _abort_uploads(self, base: str, url: str) -> list[str]:
        c, bucket = self._client, self.where.bucket
        marker: dict[str, str] = {}
        problems: list[str] = []
        while True:
            page = self._call(f"listing the open uploads under {url}", functools.partial(
                c.list_multipart_uploads, Bucket=bucket, Prefix=base, **marker))
            for upload in page.get("Uploads", []):
                key, upload_id = upload["Key"], upload["UploadId"]
                try:
                    self._call(f"aborting the upload of s3://{bucket}/{key}",
                               functools.partial(c.abort_multipart_upload, Bucket=bucket,
                                                 Key=key, UploadId=upload_id))
                except CkptError as exc:
                    problems.append(str(exc))
            following = next_uploads_page(page, marker, url)
            if following is None:
                return problems
            marker = following

    # -- what is here instead ---------------------------------------------------------------

    def nothing_here(self) -> str:
        """Why there is no step to restore, and what the prefix holds instead."""
        objects, prefixes = self._entries()
        prefixes = [p for p in prefixes if next(self._keys(self._base_of(p), limit=1), None)]
        if not objects and not prefixes:
            return Nothing(f"no checkpoint to restore: nothing is stored under {self.location} "
                           f"at {self.settings.endpoint()} (nothing saved there yet)", empty=True)
        probed = prefixes[:_NAMES_PROBED]
        found = self._each(lambda p: self._exists(self._base_of(p) + MANIFEST_NAME), probed)
        return nothing_message(
            self.location, sorted(objects + prefixes), itself=MANIFEST_NAME in objects,
            checkpoints=[p for p, yes in zip(probed, found) if yes], noun="prefix",
            move="copy them under step-<N>/")

    # -- requests ---------------------------------------------------------------------------

    @property
    def _client(self) -> Any:
        return client(self.settings)

    def _base(self, step: int) -> str:
        return self._base_of(step_name(step))

    def _base_of(self, name: str) -> str:
        return self.where.child(name).dir_prefix

    def _call(self, what: str, request: Callable[[], T]) -> T:
        try:
            return call(self.settings, what, request)
        except Exception as exc:  # noqa: BLE001 - mapped, with the cause chained
            raise self._failed(what, exc) from exc

    def _failed(self, what: str, exc: BaseException) -> CkptError:
        bucket, endpoint = self.where.bucket, self.settings.endpoint()
        if code(exc) == "NoSuchBucket":
            return StorageIOError(f"bucket {bucket!r} does not exist at {endpoint} (for "
                                  f"{self.location}): create it, or fix the bucket name or the "
                                  "endpoint")
        if status(exc) == 403:
            return StorageIOError(f"{what}: access to bucket {bucket!r} at {endpoint} was "
                                  "denied: check the credentials (AWS_ACCESS_KEY_ID, AWS_PROFILE) "
                                  "and their permissions")
        return failed(what, exc)

    def _exists(self, key: str) -> bool:
        c, bucket = self._client, self.where.bucket
        what = f"looking up s3://{bucket}/{key}"
        if key.endswith("/" + MARKER):  # our retention's marker: name the step, not the marker
            what = f"looking up s3://{bucket}/{key[:-len(MARKER) - 1]} (is it being removed?)"
        try:
            call(self.settings, what, lambda: c.head_object(Bucket=bucket, Key=key))
        except Exception as exc:  # noqa: BLE001 - 404: absent; the rest mapped
            if status(exc) == 404 and code(exc) != "NoSuchBucket":
                return False
            raise self._failed(what, exc) from exc
        return True

    def _pages(self, prefix: str, **extra: Any) -> Iterator[dict[str, Any]]:
        """Pages of ListObjectsV2 under ``prefix``."""
        c, bucket = self._client, self.where.bucket
        token: dict[str, str] = {}
        while True:
            page = self._call(f"listing s3://{bucket}/{prefix}", functools.partial(
                c.list_objects_v2, Bucket=bucket, Prefix=prefix, **extra, **token))
            yield page
            if not page.get("IsTruncated") or not page.get("NextContinuationToken"):
                return
            token = {"ContinuationToken": page["NextContinuationToken"]}

    def _entries(self) -> tuple[list[str], list[str]]:
        """(object names, prefix names) directly under the root."""
        cut = len(self.where.dir_prefix)
        objects: list[str] = []
        prefixes: list[str] = []
        for page in self._pages(self.where.dir_prefix, Delimiter="/"):
            objects += [o["Key"][cut:] for o in page.get("Contents", [])]
            prefixes += [p["Prefix"][cut:].rstrip("/") for p in page.get("CommonPrefixes", [])]
        return [n for n in objects if n], [n for n in prefixes if n]

    def _keys(self, prefix: str, limit: int | None = None) -> Iterator[str]:
        """Every object key under ``prefix`` (at most ``limit``: one request)."""
        extra = {} if limit is None else {"MaxKeys": limit}
        for page in self._pages(prefix, **extra):
            yield from (o["Key"] for o in page.get("Contents", []))
            if limit is not None:
                return

    def _each(self, probe: Callable[[Any], T], items: list[Any]) -> list[T]:
        """``probe`` over ``items``, up to s3_concurrency at a time (one HEAD each, say)."""
        if len(items) <= 1:
            return [probe(item) for item in items]
        workers = min(len(items), self.settings.concurrency)
        with ThreadPoolExecutor(workers, thread_name_prefix="ckptio-steps") as pool:
            return list(pool.map(probe, items))
