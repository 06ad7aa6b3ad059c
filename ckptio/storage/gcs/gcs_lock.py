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
precondition (gcs_store.py).

Owns: GcsLock (take, renew, release), the holder text. Does not own: the manifest's condition
(gcs_store.py), the client and retries (gcs_client.py), whether a holder is dead (holder.py).
"""

from __future__ import annotations

import datetime
import json
import logging
import threading
from dataclasses import dataclass, field
from typing import Any

from ckptio.errors import CkptError
from ckptio.storage import holder as holders
from ckptio.storage.gcs.gcs_client import GcsPath, call, client, errors, failed, missing, status
from ckptio.storage.gcs.gcs_settings import GcsSettings
from ckptio.storage.local.dirlock import LOCK_NAME
from ckptio.storage.object_common import LockWait

__all__ = ["LOCK_NAME", "GcsLock", "take"]

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
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start_renewing(self) -> None:
        self._thread = threading.Thread(target=self._renew_loop, name="ckptio-gcs-lock",
                                        daemon=True)
        self._thread.start()

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.settings.lock_lease_s / 3):
            try:
                with self._lock:
                    self.holder["renewed"] = self.holder.get("renewed", 0) + 1
                    self.generation = _write(self.where, self.settings, self.holder,
                                             self.generation, "renewing")
            except CkptError as exc:
                log.warning("ckptio: renewing the lock %s failed (%s); this save's commit will "
                            "still refuse to overwrite a newer checkpoint", self.where.url, exc)
                return

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.settings.connect_timeout_s)
        with self._lock:
            generation = self.generation
        with _held_lock:
            _held.discard(self.where.url)
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
        raise failed(f"{doing} the lock {where.url}", exc, settings) from exc
    return int(blob.generation)


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
    seen, age = int(found.generation), _age_s(found)  # before _read: a download resets them
    other = _read(found)  # from its headers, which a store may not send (the emulator)
    gone = holders.dead(other)
    lease = _lease_s(other, settings)
    if gone is None and age <= lease:
        return None
    made = _write(where, settings, holder, seen, "taking over")
    if made < 0:
        return None
    log.warning("ckptio: took over the lock %s: its holder (save %s) %s", where.url,
                (other or {}).get("save"), gone or f"stopped renewing it over {lease:.0f} s ago")
    return made


def _read(blob: Any) -> dict[str, Any] | None:
    """What the lock object says of its holder (None if unreadable: advisory only)."""
    unreadable: tuple[type[BaseException], ...] = (ValueError, *errors())
    try:
        holder = json.loads(blob.download_as_bytes(timeout=5.0, retry=None))
    except unreadable:
        return None
    return holder if isinstance(holder, dict) else None


def _lease_s(other: dict[str, Any] | None, settings: GcsSettings) -> float:
    lease = other.get("lease_s") if other else None
    return float(lease) if isinstance(lease, (int, float)) and lease > 0 else settings.lock_lease_s


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
