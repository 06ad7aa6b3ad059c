"""A save's claim on an S3 prefix: a lock object with a lease, renewed while the save runs.

``<prefix>/.ckptio.lock`` is created with ``If-None-Match: *`` (one creator wins), its body
naming the holder. The holder renews it every lease/3 with ``If-Match: <its ETag>`` (each
renewal changes the body, hence the ETag), and deletes it with ``If-Match`` when the save ends.
A lock whose server-side age (the store's ``Date`` minus the object's ``Last-Modified``: the
server's clock only) exceeds the lease was left by a save that died; it is taken over with
``If-Match: <its ETag>`` (one taker wins). A lock whose holder is provably dead (the same host
and boot, its process gone: storage/holder.py) is taken over at once, without waiting out the
lease, with a warning naming the dead holder; a live holder, or one on another host, keeps
its lease.

The lock makes a second save wait (or raise) instead of uploading everything and failing at
the end; it is not what keeps a checkpoint safe. That is the commit's condition (store.py:
the manifest is written with If-Match on the ETag seen when the claim was taken), so a holder
that stalled past its lease and a taker cannot both commit.

Kept for a manager's life it is a run's lease (``take_run``, ``<run>/.ckptio-run.lease``: one
live job per run), renewed through network failures, lost (``lost``) only to a taker's write;
one found held is watched (storage/object_lease.py), one this process holds is not taken.

Owns: S3Lock (take, renew, release), the run lease's taking, the holder text. Does not own:
the manifest's condition and the store's other operations (store.py), the client and retries
(client.py), whether a holder is dead (holder.py).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, field
from email.utils import parsedate_to_datetime
from typing import Any

from ckptio.errors import CkptError
from ckptio.storage import holder as holders
from ckptio.storage.local.dirlock import LOCK_NAME
from ckptio.storage.object_common import LockWait
from ckptio.storage.object_lease import LEASE_NAME, RunWatch, lease_of, lease_state
from ckptio.storage.s3 import timeouts
from ckptio.storage.s3.client import call, client, describe, failed, status
from ckptio.storage.s3.s3path import S3Path
from ckptio.storage.s3.settings import S3Settings

__all__ = ["LEASE_NAME", "LOCK_NAME", "S3Lock", "in_flight", "take", "take_run"]

log = logging.getLogger("ckptio")


@dataclass
class S3Lock:
    """A held lock object; ``release()`` lets it go (never raises)."""

    where: S3Path
    settings: S3Settings
    etag: str
    holder: dict[str, Any]
    lost: str | None = None  # why a renewal failed (another save took the lock over)
    run: bool = False  # a run's lease (take_run): lost only to a taker's write
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def held(self) -> bool:
        """Lease (steproot.py): this process took the object."""
        return True

    def start_renewing(self) -> None:
        self._thread = threading.Thread(target=self._renew_loop, name="ckptio-s3-lock",
                                        daemon=True)
        self._thread.start()

    def _renew_loop(self) -> None:
        period = self.settings.lock_lease_s / 3
        while not self._stop.wait(period):
            try:
                self._renew()
            except Exception as exc:  # noqa: BLE001 - recorded; the commit's condition decides
                if self.run and status(exc) not in (404, 412):
                    log.warning("ckptio: renewing the run lease %s failed (%s); trying again "
                                "in %.0f s", self.where.url, describe(exc), period)
                    continue
                with self._lock:
                    self.lost = (f"{_holder_text(self.where, self.settings)}" if self.run
                                 else describe(exc))
                if self.run:
                    log.warning("ckptio: another job took over the run lease %s (%s): this "
                                "job's manager saves nothing there any more", self.where.url,
                                self.lost)
                    return
                log.warning("ckptio: renewing the lock of %s failed (%s); this save's commit "
                            "will still refuse to overwrite a newer checkpoint",
                            self.where.url, describe(exc))
                return

    def _renew(self) -> None:
        self.holder["renewed"] = self.holder.get("renewed", 0) + 1
        body = json.dumps(self.holder).encode()
        c, where = client(self.settings), self.where
        with self._lock:
            answer = call(self.settings, f"renewing the lock {where.url}", lambda: c.put_object(
                Bucket=where.bucket, Key=where.key, Body=body, IfMatch=self.etag))
            self.etag = answer["ETag"]

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:  # a renewal the network holds up is not waited out
            self._thread.join(timeouts.FLOOR_S)
        etag = self.etag
        if self._lock.acquire(timeout=timeouts.FLOOR_S):  # a renewal that landed: its etag
            etag = self.etag
            self._lock.release()
        c, where = client(self.settings), self.where
        try:
            call(self.settings, f"releasing the lock {where.url}", lambda: c.delete_object(
                Bucket=where.bucket, Key=where.key, IfMatch=etag))
        except Exception as exc:  # noqa: BLE001 - a lock left behind expires after its lease
            if status(exc) not in (404, 412):
                log.warning("ckptio: releasing the lock %s failed (%s); the next save waits "
                            "at most %.0f s for it to expire", where.url, describe(exc),
                            self.settings.lock_lease_s)


def take(location: S3Path, settings: S3Settings, if_locked: str, save: str) -> S3Lock:
    """Take the lock of ``location`` ("wait" until free or stale, or "raise")."""
    where = location.child(LOCK_NAME)
    holder = {**holders.me(), "save": save, "lease_s": settings.lock_lease_s}
    wait = LockWait(location.url, if_locked, "a lock is taken over once its holder stops "
                    f"renewing it for {settings.lock_lease_s:.0f} s")
    while True:
        etag = _create(where, settings, holder)
        if etag is None:
            etag = _take_stale(where, settings, holder)
        if etag is not None:
            lock = S3Lock(where, settings, etag, holder)
            lock.start_renewing()
            return lock
        other = _holder_text(where, settings)
        wait.busy(other)


def take_run(root: S3Path, settings: S3Settings, take_over: bool) -> S3Lock | None:
    """The run lease of ``root`` (module docstring); None where this process holds it
    already (a second manager of its own), or CheckpointLockedError naming the live job."""
    where, watch = root.child(LEASE_NAME), RunWatch(root.url, take_over, settings.lock_lease_s)
    holder = {**holders.me(), "run": root.url, "lease_s": settings.lock_lease_s}
    while True:
        etag = _create(where, settings, holder)
        if etag is None:
            other, head = _holder(where, settings)[0], _head(where, settings)
            if head is None:
                continue  # let go meanwhile: create it again
            if holders.is_me(other):
                return None
            verdict = watch.verdict(other, f"{head['ETag']} {head.get('LastModified')}",
                                    _age_s(head))
            if verdict == "refuse":
                raise watch.refused(other)
            if verdict == "take":
                etag = _replace(where, settings, holder, head["ETag"])
                if etag is not None:
                    watch.taken(other)
        if etag is not None:
            lease = S3Lock(where, settings, etag, holder, run=True)
            lease.start_renewing()
            return lease
        time.sleep(watch.pause(other))


def in_flight(location: S3Path, settings: S3Settings) -> tuple[str | None, str | None]:
    """The save whose lock object is under ``location`` (a load found no manifest there):
    (who holds it and since when, None) while its lease is fresh, or (None, why it is known to
    have ended: its holder provably dead, or its lease expired); (None, None) where there is
    no lock, or it cannot be read."""
    where = location.child(LOCK_NAME)
    try:
        head = _head(where, settings)
    except CkptError:
        return None, None
    other, _etag = _holder(where, settings) if head is not None else (None, None)
    if head is None:
        return None, None
    return lease_state(other, lease_of(other, settings.lock_lease_s), _age_s(head))


def _replace(where: S3Path, settings: S3Settings, holder: dict[str, Any], etag: str
             ) -> str | None:
    """Take a lock object over (If-Match ``etag``); None: another taker won."""
    c, body = client(settings), json.dumps(holder).encode()
    try:
        answer = call(settings, f"taking over {where.url}", lambda: c.put_object(
            Bucket=where.bucket, Key=where.key, Body=body, IfMatch=etag))
    except Exception as exc:  # noqa: BLE001 - 412/404: another taker won
        if status(exc) in (404, 412):
            return None
        raise failed(f"taking over {where.url}", exc) from exc
    return str(answer["ETag"])


def _head(where: S3Path, settings: S3Settings) -> dict[str, Any] | None:
    """HEAD of ``where`` (None: gone)."""
    c = client(settings)
    try:
        head: dict[str, Any] = call(settings, f"looking up {where.url}",
                                    lambda: c.head_object(Bucket=where.bucket, Key=where.key))
    except Exception as exc:  # noqa: BLE001 - 404: released meanwhile; the rest mapped
        if status(exc) == 404:
            return None
        raise failed(f"looking up {where.url}", exc) from exc
    return head


def _create(where: S3Path, settings: S3Settings, holder: dict[str, Any]) -> str | None:
    """The new lock's ETag, or None if a lock exists."""
    c, body = client(settings), json.dumps(holder).encode()
    try:
        answer = call(settings, f"taking the lock {where.url}", lambda: c.put_object(
            Bucket=where.bucket, Key=where.key, Body=body, IfNoneMatch="*"))
    except Exception as exc:  # noqa: BLE001 - 412: held; the rest mapped
        if status(exc) == 412:
            return None
        raise failed(f"taking the lock {where.url}", exc) from exc
    return str(answer["ETag"])


def _take_stale(where: S3Path, settings: S3Settings, holder: dict[str, Any]) -> str | None:
    """Take over a lock whose holder stopped renewing it, or is provably dead; None if it is
    live (or just went: the caller tries to create it again)."""
    head = _head(where, settings)
    if head is None:
        return None
    other, etag = _holder(where, settings)
    gone = holders.dead(other)
    if gone is None:
        etag = head["ETag"]
        if _age_s(head) <= lease_of(other, settings.lock_lease_s):
            return None
    taken = None if etag is None else _replace(where, settings, holder, etag)
    if taken is not None and gone is not None:
        log.warning("ckptio: took over the lock %s at once: its holder (save %s) %s, so it "
                    "cannot renew it; its lease of %.0f s was not waited out", where.url,
                    (other or {}).get("save"), gone, lease_of(other, settings.lock_lease_s))
    elif taken is not None:
        log.warning("ckptio: took over the lock %s: its holder stopped renewing it over %.0f s "
                    "ago (a save that died)", where.url, settings.lock_lease_s)
    return taken


def _age_s(head: dict[str, Any]) -> float:
    """Seconds since the object was last written, by the server's clock."""
    date = head.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
    modified = head.get("LastModified")
    if not date or modified is None:
        return 0.0
    return (parsedate_to_datetime(date) - modified).total_seconds()


def _holder(where: S3Path, settings: S3Settings) -> tuple[dict[str, Any] | None, str | None]:
    """What the lock object says of its holder, and the ETag of that version (None, None if
    gone or unreadable)."""
    c = client(settings)
    try:
        with timeouts.limited(settings.retry_deadline_s):  # one attempt, not call()'s retries
            answer = c.get_object(Bucket=where.bucket, Key=where.key)
            holder = json.loads(answer["Body"].read())
    except Exception:  # noqa: BLE001 - advisory: the caller falls back to its own settings
        return None, None
    return (holder, str(answer["ETag"])) if isinstance(holder, dict) else (None, None)


def _holder_text(where: S3Path, settings: S3Settings) -> str:
    holder, _etag = _holder(where, settings)
    if holder is None:
        return f"its lock is {where.url}"
    return (f"host {holder.get('host')}, pid {holder.get('pid')}, since {holder.get('since')}; "
            f"lock {where.url}")
