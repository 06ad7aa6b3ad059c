"""A save's claim on an az:// prefix: a lease on the lock blob ``<prefix>/.ckptio.lock``.

Azure leases are the service's own mutual exclusion: the lock blob is created if missing (its
body: who holds it), then leased for ``AzureSettings.lock_lease_s``; a second save's lease is
refused (409), so it waits or raises CheckpointLockedError naming the holder. A thread renews
the lease at a third of its term while the save runs; a save that died stops renewing and its
lease lapses, so the next save takes the lock then (at once where the holder is provably dead:
a process of this host that is gone, storage/holder.py). release() deletes the lock blob under the
lease (nothing is left at a prefix that held nothing).

Kept for a manager's life it is a run's lease (``take_run``, storage/object_lease.py), its
record rewritten at each renewal so that a watcher sees a live job; lost to another's lease.

Owns: AzureLock, take(), take_run(), in_flight(). Does not own: the commit (az_store.py), the client (az_client.py).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from ckptio.errors import CkptError
from ckptio.storage import holder as holders
from ckptio.storage.azure.az_client import (
    CONNECT_S,
    AzPath,
    Timeouts,
    call,
    checked,
    container,
    describe,
    sdk_error,
    status,
)
from ckptio.storage.azure.az_settings import AzureSettings
from ckptio.storage.local.dirlock import LOCK_NAME
from ckptio.storage.object_common import LockWait
from ckptio.storage.object_lease import LEASE_NAME, RunWatch, lease_of, lease_state

__all__ = ["LEASE_NAME", "AzureLock", "in_flight", "take", "take_run"]

log = logging.getLogger("ckptio")


@dataclass
class AzureLock:
    """A held lease on the lock blob; ``release()`` lets it go (never raises)."""

    where: AzPath
    settings: AzureSettings
    lease: Any  # the SDK's BlobLeaseClient
    lost: str | None = None  # why a renewal failed
    body: dict[str, Any] | None = None  # a run lease: its record, rewritten at each renewal
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    @property
    def held(self) -> bool:
        """Lease (steproot.py): this process holds the blob's lease."""
        return True

    def start_renewing(self) -> None:
        self._thread = threading.Thread(target=self._renew_loop, name="ckptio-azure-lock",
                                        daemon=True)
        self._thread.start()

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.settings.lock_lease_s / 3):
            try:
                call(self.settings, f"renewing the lease of {self.where.url}",
                     lambda t: self.lease.renew(**t))
                if self.body is not None:  # a run lease: a watcher sees it renewed
                    self._rewrite()
            except (CkptError, sdk_error()) as exc:
                if self.body is not None and status(exc) not in (409, 412):
                    log.warning("ckptio: renewing the run lease %s failed (%s); trying again",
                                self.where.url, describe(exc))
                    continue
                self.lost = describe(exc)
                if not self._stop.is_set():  # after release(): the lock is let go anyway
                    log.warning("ckptio: renewing the %s %s failed (%s)%s", "run lease"
                                if self.body is not None else "lock", self.where.url, self.lost,
                                ": another job took it over, this job's manager saves nothing "
                                "there any more" if self.body is not None else "")
                return

    def _rewrite(self) -> None:
        assert self.body is not None  # internal: run leases only
        self.body["renewed"] = self.body.get("renewed", 0) + 1
        data = json.dumps(self.body).encode()
        blob = container(self.settings, self.where.container).get_blob_client(self.where.name)
        call(self.settings, f"renewing {self.where.url}", lambda t: blob.upload_blob(
            data, overwrite=True, lease=self.lease, **t))

    def release(self) -> None:
        """Stop renewing and delete the lock blob. A renewal still waiting for its answer (a
        network that swallows it) is waited for CONNECT_S at most, not its deadline: the save
        has ended, and the renewal's thread ends when its request does."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(CONNECT_S)
        if self.lost is not None:  # another job holds it now
            return
        blob = container(self.settings, self.where.container).get_blob_client(self.where.name)
        try:
            call(self.settings, f"releasing the lock {self.where.url}",
                 lambda t: blob.delete_blob(lease=self.lease, **t))
        except (CkptError, sdk_error()) as exc:
            log.warning("ckptio: releasing the lock %s failed (%s); the next save waits at most "
                        "%d s for its lease to lapse", self.where.url, describe(exc),
                        self.settings.lock_lease_s)


def take(location: AzPath, settings: AzureSettings, if_locked: str, save: str) -> AzureLock:
    """Take the lock of ``location`` ("wait" until free, or "raise")."""
    where = location.child(LOCK_NAME)
    blob = container(settings, where.container).get_blob_client(where.name)
    body = json.dumps({**holders.me(), "save": save, "lease_s": settings.lock_lease_s}).encode()
    wait = LockWait(location.url, if_locked, f"its lease lapses {settings.lock_lease_s} s "
                    "after its holder stops renewing it", most_s=2.0)
    while True:
        lease = _acquired(blob, where, settings, body)
        if lease is not None:
            lock = AzureLock(where, settings, lease)
            lock.start_renewing()
            return lock
        holder, etag = _holder(blob, where, settings)
        if _took_over(blob, where, settings, holder, etag):
            continue
        other = _holder_text(holder, where)
        wait.busy(other)


def take_run(root: AzPath, settings: AzureSettings, take_over: bool) -> AzureLock | None:
    """The run lease of ``root`` (``<run>/.ckptio-run.lease`` under a blob lease, its record
    rewritten at each renewal: storage/object_lease.py); None where this process holds it
    already, or CheckpointLockedError naming the live job."""
    where, watch = root.child(LEASE_NAME), RunWatch(root.url, take_over, settings.lock_lease_s)
    blob = container(settings, where.container).get_blob_client(where.name)
    record = {**holders.me(), "run": root.url, "lease_s": settings.lock_lease_s}
    other: dict[str, Any] | None = None
    while True:
        before: list[dict[str, Any] | None] = []
        lease = _acquired(blob, where, settings, json.dumps(record).encode(), before)
        if lease is not None:
            if before and before[0] is not None and not holders.is_me(before[0]):
                watch.taken(before[0], None if other is not None else "its lease had lapsed")
            lock = AzureLock(where, settings, lease, body=record)
            lock.start_renewing()
            return lock
        other, etag = _holder(blob, where, settings)
        if holders.is_me(other):
            return None
        verdict = "wait" if etag is None else watch.verdict(other, etag, None)
        if verdict == "refuse":
            raise watch.refused(other)
        if verdict == "take":
            _break(blob, where, settings, etag)
        else:
            time.sleep(watch.pause(other))


def in_flight(location: AzPath, settings: AzureSettings) -> tuple[str | None, str | None]:
    """The save whose lock blob is under ``location`` (a load found no manifest there), by its
    holder's record and the service's word on its lease: held (a save renewing it) or lapsed
    (object_lease.lease_state); (None, None) where there is no lock, or it cannot be read."""
    where = location.child(LOCK_NAME)
    blob = container(settings, where.container).get_blob_client(where.name)

    def request(t: Timeouts) -> tuple[bytes, str]:
        answer = blob.download_blob(**t)
        return answer.readall(), str(answer.properties.lease.state)

    try:
        got = checked(settings, f"reading the lock {where.url}", request, none_on=(404,))
    except CkptError:
        return None, None
    if got is None:
        return None, None
    try:
        record = json.loads(got[0])
    except ValueError:
        return None, None
    lapsed = got[1] in ("available", "expired", "broken")
    return lease_state(record, lease_of(record, settings.lock_lease_s), None, lapsed)


def _acquired(blob: Any, where: AzPath, settings: AzureSettings, body: bytes,
              before: list[dict[str, Any] | None] | None = None) -> Any:
    """The lease of ``where``'s blob (made if missing) with ``body`` written under it; None
    while another holds it. ``before`` gets the record a blob there already held."""
    made = checked(settings, f"creating {where.url}", lambda t: blob.upload_blob(
        body, overwrite=False, **t), none_on=(409, 412))  # there already: leased or not
    lease = checked(settings, f"taking {where.url}", lambda t: blob.acquire_lease(
        lease_duration=settings.lock_lease_s, **t), none_on=(404, 409))
    if lease is not None and made is None and before is not None:
        before.append(_holder(blob, where, settings)[0])
    if lease is not None:
        checked(settings, f"writing {where.url}", lambda t: blob.upload_blob(
            body, overwrite=True, lease=lease, **t))
    return lease


def _break(blob: Any, where: AzPath, settings: AzureSettings, etag: str | None) -> Any:
    """Break the blob's lease at once, if its version is still ``etag`` (None: gone, not
    leased, or rewritten meanwhile)."""
    from azure.core import MatchConditions
    from azure.storage.blob import BlobLeaseClient

    return checked(settings, f"breaking the lease of {where.url}", lambda t: BlobLeaseClient(
        blob).break_lease(lease_break_period=0, etag=etag,
                          match_condition=MatchConditions.IfNotModified, **t),
        none_on=(404, 409, 412))


def _holder(blob: Any, where: AzPath,
            settings: AzureSettings) -> tuple[dict[str, Any] | None, str | None]:
    """What the lock blob says of its holder, and that version's ETag (None, None if gone)."""
    def request(t: Timeouts) -> tuple[bytes, str]:
        answer = blob.download_blob(**t)
        return answer.readall(), str(answer.properties.etag)

    got = checked(settings, f"reading the lock {where.url}", request, none_on=(404,))
    if got is None:
        return None, None
    try:
        holder = json.loads(got[0])
    except ValueError:
        holder = None
    return (holder if isinstance(holder, dict) else None), got[1]


def _took_over(blob: Any, where: AzPath, settings: AzureSettings, holder: dict[str, Any] | None,
               etag: str | None) -> bool:
    """Break the lease of a holder that is provably dead (a process of this host and boot that
    is gone: it cannot renew) rather than wait for it to lapse; True if broken."""
    gone = holders.dead(holder)
    if gone is None or etag is None:
        return False
    broken = _break(blob, where, settings, etag)  # None: try again
    if broken is not None:
        log.warning("ckptio: took over the lock %s at once: its holder (save %s) %s, so it "
                    "cannot renew it; its lease of %s s was not waited out", where.url,
                    (holder or {}).get("save"), gone, (holder or {}).get("lease_s"))
    return True


def _holder_text(holder: dict[str, Any] | None, where: AzPath) -> str:
    if holder is None:
        return f"its lock is {where.url}"
    return (f"host {holder.get('host')}, pid {holder.get('pid')}, since {holder.get('since')}; "
            f"lock {where.url}")
