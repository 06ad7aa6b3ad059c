"""A save's claim on its location, taken once by the coordinator for every rank.

Only the coordinator commits, so only it holds the claim (Store.exclusive: one save at a time
per location, across processes); the other ranks create their files after this step, so
inside its hold. The coordinator tells every rank whether it has the claim; where it has not,
every rank raises alike (CheckpointLockedError where another save holds the location).

Call order: saving/save_session.py, in each rank's save thread after collective.agree and
before any file is created: ``exclusive`` around the writes and the commit (the claim is let
go when its body ends); a rank that failed before its save thread ran takes part through
``skip_exclusive``, so that its peers are not left waiting.

Owns: the claim's step and its outcome on every rank. Does not own: the lock itself
(Store.exclusive, storage/), the plan and the commit (collective.py), transport (dist.py).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator

from ckptio.distributed.dist import COORDINATOR, Group
from ckptio.distributed.step import describe
from ckptio.errors import CheckpointLockedError, RankFailedError
from ckptio.storage.store_contract import Exclusive, Store

__all__ = ["exclusive", "skip_exclusive"]


@contextlib.contextmanager
def exclusive(group: Group, store: Store, if_locked: str) -> Iterator[Exclusive | None]:
    """Collective, in the save's thread before any rank creates a file in ``store``: the
    coordinator claims the location (Store.exclusive: waits or raises per ``if_locked``) and
    tells every rank whether it has it; if not, raises on every rank (CheckpointLockedError
    where another save holds it). Only the coordinator commits, so only it holds the claim; the
    other ranks create their files after this step, so inside its hold. The body runs holding
    it; the claim is released when the body ends. Yields the claim on the coordinator, else None.

    In the save's thread rather than in agree(): a save that waits for the claim or is refused
    reports it where every background error is reported (wait()), on every rank alike. While
    the coordinator waits (if_locked="wait"), the other ranks wait in the broadcast, up to twice
    Options.step_timeout_s (the coordinator's heartbeat shows it is alive)."""
    held: Exclusive | None = None
    failure: BaseException | None = None
    if group.rank == COORDINATOR:
        try:
            held = store.exclusive(if_locked)
        except BaseException as exc:  # noqa: BLE001 - raised below, once the peers know
            failure = exc
    try:
        _lock_outcome(group, store.location, failure, raise_it=True)
        if failure is not None:
            raise failure
        yield held
    except BaseException:
        if held is not None:
            held.release(failed=True)
        raise
    if held is not None:
        held.release()


def skip_exclusive(group: Group, path: str, error: BaseException) -> None:
    """Take part in exclusive() for a rank that failed before its save thread ran (the peers'
    threads wait in it); the coordinator then takes no lock and tells the peers why."""
    _lock_outcome(group, path, error if group.rank == COORDINATOR else None, raise_it=False)


def _lock_outcome(group: Group, path: str, failure: BaseException | None, *,
                  raise_it: bool) -> None:
    """The coordinator's lock outcome on every rank; a failure is raised on the other ranks
    (``raise_it``): CheckpointLockedError if the path was locked, else RankFailedError."""
    if group.size == 1:
        return
    mine = None
    if group.rank == COORDINATOR:
        mine = json.dumps({"error": None if failure is None else describe(failure),
                           "locked": isinstance(failure, CheckpointLockedError)}).encode()
    outcome = json.loads(group.broadcast(mine))
    if group.rank == COORDINATOR or outcome["error"] is None or not raise_it:
        return
    if outcome["locked"]:  # the message says what to do
        raise CheckpointLockedError(f"save to {path} refused on the coordinator (rank 0): "
                                    f"{outcome['error']}")
    raise RankFailedError(f"save to {path} failed before writing, on the coordinator (rank 0): "
                          f"{outcome['error']}. Nothing was written; the previous checkpoint "
                          "there is untouched")
