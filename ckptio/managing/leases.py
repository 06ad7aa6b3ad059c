"""A manager's run leases: one per tier whose root keeps one live job per run (rank 0's).

Call order (managing/parts.py, on rank 0 through the agreement): ``take(tiers, create=False)``
when the manager is made, ``take(..., create=True)`` at its first save (a lease taken over is
claimed then: Claimable), ``lost()`` before each save and retention, ``lost_untold()`` for
wait() and close() (said once), ``held()`` for the drain's resume, ``release()`` at close or
exit. Owns: which leases this manager holds and the message naming a lease another job took.
Does not own: the lease itself, its file or object and its rules (storage/local/runlease.py,
the object stores' roots), the agreement across ranks (managing/agreement.py).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from ckptio.errors import StorageIOError
from ckptio.managing.level import TierSteps
from ckptio.storage.steproot import Claimable, Lease

__all__ = ["RunLeases"]

log = logging.getLogger("ckptio")


class RunLeases:
    """Rank 0's run leases over ``levels`` (``take_over``: a job restarted on purpose)."""

    def __init__(self, levels: Sequence[TierSteps], take_over: bool) -> None:
        self._levels, self._take_over = levels, take_over
        self._leases: dict[int, Lease] = {}  # tier -> its lease
        self._told = False  # a lease taken over was said (lost_untold)

    def take(self, tiers: Sequence[int], *, create: bool) -> None:
        """These local tiers' run leases (those not held yet; at the first save, one taken
        over is claimed: Claimable), or the refusal naming the job holding one
        (storage/local/runlease.py). A slower tier that cannot be made or locked at the first
        save (``create``) is logged and passed over: the first tier keeps saving, and the
        drain's copies there raise why."""
        for k in tiers:
            taken = self._leases.get(k)
            if create and isinstance(taken, Claimable):  # this manager saves: tell the holder
                taken.claim()
            if taken is None:
                try:
                    lease = self._levels[k].lease(self._take_over, create=create)
                except StorageIOError as exc:
                    if k == 0 or not create:
                        raise
                    log.warning("ckptio: no run lease taken in tier %s: %s",
                                self._levels[k].location, exc)
                    continue
                if lease is not None:
                    self._leases[k] = lease

    @property
    def taking_over(self) -> bool:
        """Whether this job was made with take_over=True."""
        return self._take_over

    def held(self) -> set[int]:
        """The tiers whose lease this process holds (excluding other jobs there)."""
        return {k for k, lease in self._leases.items() if lease.held}

    def lost(self) -> str | None:
        """Why a run lease taken here is another job's now (None: all kept)."""
        for k, lease in self._leases.items():
            if lease.lost is not None:
                return (f"this job's lease on the run {self._levels[k].location} was taken "
                        f"over by another job ({lease.lost}); the steps this job saved there "
                        "are not kept (that job's retention drops them), so this manager saves "
                        "and drops nothing there any more: stop one of the jobs (a job "
                        "restarted with take_over=True took it on purpose), or save to another "
                        "location")
        return None

    def said(self) -> None:
        """A refused save said lost(): wait() and close() do not say it again."""
        self._told = True

    def lost_untold(self) -> str | None:
        """As lost(), but "" once said (a refused save, wait(), close())."""
        lost = self.lost()
        if lost is None or self._told:
            return lost and ""
        self._told = True
        return lost

    def release(self) -> None:
        """Let every lease go (never raises)."""
        for lease in self._leases.values():
            lease.release()
        self._leases.clear()
