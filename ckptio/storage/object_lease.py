"""What the object-store schemes share of a run's lease: one live job per run prefix.

An object store has no kernel to let go of a dead job's lock, so a run's lease there is an
object ``<run>/.ckptio-run.lease`` its holder rewrites while it lives (s3/lock.py, gcs/gcs_lock.py;
Azure's native blob lease, azure/az_lock.py, watches the same way). A job that finds it held
cannot tell at once whether its holder lives, so it watches: ``RunWatch.verdict`` after each
look says "take" (``take_over``, the holder provably dead on this host, or not rewritten within
its lease: a job that died elsewhere), "refuse" (rewritten since the first look: a live job) or
"wait" (look again after ``pause()``). ``refused()`` is the error naming the live job,
``taken()`` the warning naming the one taken over from.

``lease_state`` words the same for a save's lock object, for a load that finds no manifest:
a save still running there (its lease renewed) or one that ended (its lease lapsed).

Call order: a scheme's take_run -> its create fails -> per look: ``verdict`` -> ``taken`` or
``refused`` or ``pause``. Owns: the decision and its wording, a lock's lease state in words.
Does not own: the requests, the
lease object's renewal or release (each scheme's lock module), which roots are leased
(steproot.LeasedRoot).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from ckptio.errors import CheckpointLockedError
from ckptio.storage import holder as holders
from ckptio.storage.holder import ago
from ckptio.storage.local.runlease import LEASE_NAME

__all__ = ["LEASE_NAME", "RunWatch", "lease_of", "lease_state", "who"]

log = logging.getLogger("ckptio")


def who(record: dict[str, Any] | None) -> str:
    """A lease's holder as its record names it."""
    if record is None:
        return "holder unknown"
    return f"host {record.get('host')}, pid {record.get('pid')}, since {record.get('since')}"


class RunWatch:
    """A run lease found held at ``run``, watched until it can be taken or is refused."""

    def __init__(self, run: str, take_over: bool, lease_s: float) -> None:
        self.run, self.take_over, self.lease_s = run, take_over, lease_s
        self._first: tuple[str, float] | None = None  # (version, when) of the first look
        self._why = ""

    def verdict(self, record: dict[str, Any] | None, version: str, age_s: float | None) -> str:
        """"take", "refuse" or "wait", from one look: the holder's record, which write of the
        lease it saw (``version``) and its age by the store's clock (None: unknown)."""
        lease = lease_of(record, self.lease_s)
        self._first = self._first or (version, time.monotonic())
        gone = holders.dead(record)
        if self.take_over or gone is not None:
            self._why = "take_over=True" if self.take_over else str(gone)
            return "take"
        if version != self._first[0]:
            return "refuse"
        if (age_s is not None and age_s > lease) or time.monotonic() - self._first[1] > lease:
            self._why = f"not renewed for over {lease:.0f} s: a job that died"
            return "take"
        return "wait"

    def pause(self, record: dict[str, Any] | None) -> float:
        """Seconds until the next look (a sixth of the holder's lease, within bounds)."""
        return min(5.0, max(0.2, lease_of(record, self.lease_s) / 6))

    def taken(self, record: dict[str, Any] | None, why: str | None = None) -> None:
        """Warn that the lease was taken over from ``record``'s job (``why``: else the
        verdict's reason)."""
        log.warning("ckptio: took over the run %s from %s (%s); if that job is still running, "
                    "it saves nothing there any more", self.run, who(record), why or self._why)

    def refused(self, record: dict[str, Any] | None) -> CheckpointLockedError:
        return CheckpointLockedError(
            f"the run {self.run} is in use by another job ({who(record)}; it renewed its lease "
            f"{self.run.rstrip('/')}/{LEASE_NAME} just now); two jobs on one run would drop "
            "each other's steps, so this save did not start and nothing there was touched: "
            "give this job its own prefix or stop the other one; if that job is this job's "
            "earlier run, pass CheckpointManager(..., take_over=True)")


def lease_of(record: dict[str, Any] | None, ours: float) -> float:
    """The lease a lock's or run lease's holder renews within (recorded in it), else ours."""
    lease = record.get("lease_s") if record else None
    return float(lease) if isinstance(lease, (int, float)) and lease > 0 else ours


def lease_state(record: Any, lease_s: float, renewed_s: float | None,
                lapsed: bool | None = None) -> tuple[str | None, str | None]:
    """A save's lock object found where a load sees no manifest, as (the save still running,
    None) or (None, why it is known to have ended), for missing_manifest.no_manifest:
    ``record`` is the holder's record (unreadable: (None, None)), ``lease_s`` its lease,
    ``renewed_s`` the seconds since it was last renewed by the store's or this host's clock
    (None: the store does not tell), ``lapsed`` the store's own word on the lease (None:
    judged from ``renewed_s``). A holder provably dead (holder.dead) has ended at once; any
    other is told by its lease, on this host or another."""
    if not isinstance(record, dict):
        return None, None
    gone = holders.dead(record)
    if gone is not None:
        return None, f"its holder, {gone}"
    holder = f"host {record.get('host')}, pid {record.get('pid')}"
    if lapsed is None:
        lapsed = renewed_s is not None and renewed_s > lease_s
    if lapsed:
        when = (f"{renewed_s:.0f} s ago, past its lease of {lease_s:.0f} s" if renewed_s is not
                None else f"for over its lease of {lease_s:.0f} s: its lease lapsed")
        return None, f"its holder, {holder}, stopped renewing its lock {when}"
    renewal = (f"its lock renewed {renewed_s:.0f} s ago" if renewed_s is not None
               else f"its lock's lease of {lease_s:.0f} s still held")
    return f"on {holder}, started {ago(record)}, {renewal}", None
