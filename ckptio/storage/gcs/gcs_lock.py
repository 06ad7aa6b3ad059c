"""A save's claim on a GCS prefix: a lock object with a lease, renewed while the save runs.

``<prefix>/.ckptio.lock`` is created with ``ifGenerationMatch=0`` (one creator wins), its body
naming the holder. The holder rewrites it every lease/3 with ``ifGenerationMatch`` on its own
generation, and deletes it the same way when the save ends. A lock not rewritten for longer
than its lease (its ``updated`` time against this host's clock) was left by a save that died,
and is taken over with ``ifGenerationMatch`` on its generation (one taker wins); one whose
holder is provably dead (same host and boot, process gone: storage/holder.py) at once.

With ``GcsSettings.conditional="off"`` (a store without generation preconditions, such as the
gcp-storage-emulator) the create is a look-up then a write: two processes racing can both
believe they hold it; within one process claims are still exclusive (``_held``).

The lock makes a second save wait (or raise); what keeps a checkpoint safe is the commit's
precondition (gcs_store.py). Kept for a manager's life it is a run's lease (``take_run``:
storage/object_lease.py), renewed through failures, lost when its record is another job's.

Owns: GcsLock (take, renew, release), the holder text. Does not own: the manifest's condition
(gcs_store.py), the client and retries (gcs_client.py), whether a holder is dead (holder.py).
"""

from __future__ import annotations

import datetime
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from ckptio.errors import CkptError
from ckptio.storage import holder as holders
from ckptio.storage.gcs.gcs_client import (
    GcsPath,
    call,
    client,
    errors,
    failed,
    missing,
    no_bucket,
    status,
)
from ckptio.storage.gcs.gcs_settings import GcsSettings
from ckptio.storage.local.dirlock import LOCK_NAME
from ckptio.storage.object_common import LockWait
from ckptio.storage.object_lease import LEASE_NAME, RunWatch, lease_of, lease_state, who

__all__ = ["LEASE_NAME", "LOCK_NAME", "GcsLock", "in_flight", "take", "take_run"]

log = logging.getLogger("ckptio")
_held: set[str] = set()  # lock URLs this process holds
_held_lock = threading.Lock()


@dataclass
class GcsLock:
    """A held lock object; ``release()`` lets it go (never raises)."""

    where: GcsPath
    settings: GcsSettings
    generation: int
    holder: dict[str, Any]
    lost: str | None = None  # a run lease: who took it over
    run: bool = False  # a run's lease (take_run): renewed through failures, lost to a taker
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def held(self) -> bool:
        """Lease (steproot.py): this process took the object."""
        return True

    def start_renewing(self) -> None:
        self._thread = threading.Thread(target=self._renew_loop, name="ckptio-gcs-lock",
                                        daemon=True)
        self._thread.start()

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.settings.lock_lease_s / 3):
            try:
                with self._lock:
                    self.lost = self._taker() if self.run else None
                    if self.lost is None:
                        self.holder["renewed"] = self.holder.get("renewed", 0) + 1
                        self.generation = _write(self.where, self.settings, self.holder,
                                                 self.generation, "renewing")
                    if self.generation < 0:  # another's write won
                        self.lost = (self._taker() if self.run else None) or "it was rewritten"
            except CkptError as exc:
                log.warning("ckptio: renewing the lock %s failed (%s)%s", self.where.url, exc,
                            "; trying again" if self.run else "; this save's commit will still "
                            "refuse to overwrite a newer checkpoint")
                if self.run:
                    continue
                return
            if self.lost is not None:
                log.warning("ckptio: %s %s was taken over (%s)%s", "the run lease" if self.run
                            else "the lock", self.where.url, self.lost, ": this job's manager "
                            "saves nothing there any more" if self.run else "")
                return

    def _another_holds(self) -> bool:
        """A run lease at release: whether another job holds it now (its object is then left;
        without preconditions a delete could not tell)."""
        try:
            self.lost = self.lost or self._taker()
        except CkptError as exc:
            log.warning("ckptio: could not look up the run lease %s at release (%s); it is left "
                        "to lapse", self.where.url, exc)
            return True
        return self.lost is not None

    def _taker(self) -> str | None:
        """A run lease: who holds it now if not this process (None: still ours)."""
        bucket = _bucket(self.settings, self.where)
        found = missing(self.settings, f"looking up the run lease {self.where.url}",
                        lambda t: bucket.get_blob(self.where.key, timeout=t, retry=None))
        record = None if found is None else _read(found)
        if found is None:
            return "its lease object was deleted"
        return None if holders.is_me(record) else who(record)

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.settings.connect_timeout_s)
        with self._lock:
            generation = self.generation
        with _held_lock:
            _held.discard(self.where.url)
        if self.run and self._another_holds():
            return
        blob = _bucket(self.settings, self.where).blob(self.where.key)
        condition = _condition(self.settings, generation)
        try:
            call(self.settings, f"releasing the lock {self.where.url}",
                 lambda t: blob.delete(timeout=t, retry=None, **condition))
        except errors() as exc:  # a lock left behind expires after its lease
            if status(exc) not in (404, 412):
                log.warning("ckptio: releasing the lock %s failed (%s); the next save waits "
                            "at most %.0f s for it to expire", self.where.url,
                            failed("releasing", exc, self.settings), self.settings.lock_lease_s)


def _bucket(settings: GcsSettings, where: GcsPath) -> Any:
    return client(settings).bucket(where.bucket)


def _condition(settings: GcsSettings, generation: int) -> dict[str, int]:
    return {"if_generation_match": generation} if settings.conditional == "require" else {}


def _write(where: GcsPath, settings: GcsSettings, holder: dict[str, Any], generation: int,
           doing: str) -> int:
    """Write the lock's body on ``generation`` (0: create) -> its new generation; -1 if
    another process's write won (412)."""
    blob = _bucket(settings, where).blob(where.key)
    body = json.dumps(holder)
    condition = _condition(settings, generation)
    try:
        call(settings, f"{doing} the lock {where.url}", lambda t: blob.upload_from_string(
            body, content_type="application/json", timeout=t, retry=None, **condition))
    except errors() as exc:
        if status(exc) == 412:
            return -1
        if status(exc) == 404:  # a write's 404: no such bucket
            raise no_bucket(settings, where.bucket, where.url) from exc
        raise failed(f"{doing} the lock {where.url}", exc, settings) from exc
    return _generation(blob)


def _generation(blob: Any) -> int:
    """A blob's generation (0 where the store gives none: an emulator without preconditions)."""
    return int(blob.generation or 0)


def take(location: GcsPath, settings: GcsSettings, if_locked: str, save: str) -> GcsLock:
    """Take the lock of ``location`` ("wait" until free or stale, or "raise")."""
    where = location.child(LOCK_NAME)
    holder = {**holders.me(), "save": save, "lease_s": settings.lock_lease_s}
    wait = LockWait(location.url, if_locked, "a lock is taken over once its holder stops "
                    f"renewing it for {settings.lock_lease_s:.0f} s")
    while True:
        generation = _try(where, settings, holder)
        if generation is not None:
            lock = GcsLock(where, settings, generation, holder)
            lock.start_renewing()
            return lock
        other = _holder_text(where, settings)
        wait.busy(other)


def take_run(root: GcsPath, settings: GcsSettings, take_over: bool) -> GcsLock | None:
    """The run lease of ``root`` (``<run>/.ckptio-run.lease``, storage/object_lease.py); None
    where this process holds it already, or CheckpointLockedError naming the live job."""
    where, watch = root.child(LEASE_NAME), RunWatch(root.url, take_over, settings.lock_lease_s)
    holder = {**holders.me(), "run": root.url, "lease_s": settings.lock_lease_s}
    bucket = _bucket(settings, where)
    while True:
        found = missing(settings, f"looking up the run lease {where.url}",
                        lambda t: bucket.get_blob(where.key, timeout=t, retry=None))
        other = None if found is None else _read(found)
        if found is None:
            made = _write(where, settings, holder, 0, "taking")
        elif holders.is_me(other):
            return None
        else:
            verdict = watch.verdict(other, f"{found.generation} {found.updated}", _age_s(found))
            if verdict == "refuse":
                raise watch.refused(other)
            made = -1
            if verdict == "take":
                made = _write(where, settings, holder, _generation(found), "taking over")
                if made >= 0:
                    watch.taken(other)
        if made >= 0:
            lease = GcsLock(where, settings, made, holder, run=True)
            lease.start_renewing()
            return lease
        time.sleep(watch.pause(other))


def _try(where: GcsPath, settings: GcsSettings, holder: dict[str, Any]) -> int | None:
    """The lock's generation once taken (created, or a stale one taken over); None if held."""
    with _held_lock:
        if where.url in _held:
            return None
        _held.add(where.url)
    generation = None
    try:
        generation = _take(where, settings, holder)
    finally:
        if generation is None:
            with _held_lock:
                _held.discard(where.url)
    return generation


def _take(where: GcsPath, settings: GcsSettings, holder: dict[str, Any]) -> int | None:
    bucket = _bucket(settings, where)
    found = missing(settings, f"looking up the lock {where.url}",
                    lambda t: bucket.get_blob(where.key, timeout=t, retry=None))
    if found is None:
        made = _write(where, settings, holder, 0, "taking")
        return None if made < 0 else made
    seen, age = _generation(found), _age_s(found)  # before _read: a download resets them
    other = _read(found)  # from its headers, which a store may not send (the emulator)
    gone = holders.dead(other)
    lease = lease_of(other, settings.lock_lease_s)
    if gone is None and age <= lease:
        return None
    made = _write(where, settings, holder, seen, "taking over")
    if made < 0:
        return None
    log.warning("ckptio: took over the lock %s: its holder (save %s) %s", where.url,
                (other or {}).get("save"), gone or f"stopped renewing it over {lease:.0f} s ago")
    return made


def in_flight(location: GcsPath, settings: GcsSettings) -> tuple[str | None, str | None]:
    """The save whose lock object is under ``location`` (a load found no manifest there), by
    its holder's record and when it was last rewritten (object_lease.lease_state); (None, None)
    where there is no lock, or it cannot be read."""
    where = location.child(LOCK_NAME)
    bucket = _bucket(settings, where)
    try:
        found = missing(settings, f"looking up the lock {where.url}",
                        lambda t: bucket.get_blob(where.key, timeout=t, retry=None))
    except CkptError:
        return None, None
    if found is None:
        return None, None
    age = _age_s(found) if getattr(found, "updated", None) is not None else None
    other = _read(found)
    return lease_state(other, lease_of(other, settings.lock_lease_s), age)


def _read(blob: Any) -> dict[str, Any] | None:
    """What the lock object says of its holder (None if unreadable: advisory only)."""
    unreadable: tuple[type[BaseException], ...] = (ValueError, *errors())
    try:
        holder = json.loads(blob.download_as_bytes(timeout=5.0, retry=None))
    except unreadable:
        return None
    return holder if isinstance(holder, dict) else None


def _age_s(blob: Any) -> float:
    """Seconds since the lock was last written (its ``updated`` against this host's clock)."""
    updated = getattr(blob, "updated", None)
    if updated is None:
        return 0.0
    return (datetime.datetime.now(datetime.timezone.utc) - updated).total_seconds()


def _holder_text(where: GcsPath, settings: GcsSettings) -> str:
    bucket = _bucket(settings, where)
    try:
        found = bucket.get_blob(where.key, timeout=5.0, retry=None)
    except errors():
        found = None
    holder = None if found is None else _read(found)
    if holder is None:
        return f"its lock is {where.url}"
    return (f"host {holder.get('host')}, pid {holder.get('pid')}, since {holder.get('since')}; "
            f"lock {where.url}")
