"""How a CheckpointManager's ranks agree: Ranks.

- ``agreed(decide)``: rank 0 runs ``decide()`` (a JSON-able answer) and broadcasts it, through
  the job's store in keys of the manager's own (not the Checkpointer's, which a background save
  may be using), with the Checkpointer's deadlines. If it raises, rank 0 raises that and the
  others a RankFailedError quoting it.
- ``verdict(error)``: after a load that failed on every rank, all-gather why, and fall back
  together only if some rank found damage and none failed otherwise (``unreadable=True``: a
  storage error, an unreadable copy, counts as damage: another copy of the step is at hand);
  no gather when the load named a rank dead or stuck (every live rank raises that at once).

Owns: those two exchanges. Does not own: what is decided (managing/manager.py, managing/level.py).
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Callable
from typing import Any

from ckptio.api import PARTLY_FILLED
from ckptio.distributed.dist import COORDINATOR, Group, Solo, current_group, over_torch
from ckptio.errors import (CheckpointNotFoundError, CorruptCheckpointError,
                           IncompleteCheckpointError, RankFailedError, StorageIOError)
from ckptio.options import Options

__all__ = ["DAMAGE", "Ranks"]

# a load failing with one of these found the checkpoint damaged (or gone): try the previous step
DAMAGE = (CorruptCheckpointError, IncompleteCheckpointError, CheckpointNotFoundError)


class Ranks:
    """The ranks of one manager: its process group (or the default one, or one process)."""

    def __init__(self, process_group: Any, options: Options, where: str) -> None:
        self._process_group = process_group
        self._options = options
        self._where = where  # the manager's location, for messages
        self._group: Group | None = None  # made at the first collective call
        self._under: weakref.ref[Any] | None = None  # the default group it was made under

    def group(self) -> Group:
        if self._group is None:
            torch_group = current_group(self._process_group)
            self._group = Solo() if torch_group is None else over_torch(torch_group,
                                                                          self._options)
            if torch_group is not None:
                self._under = weakref.ref(_default_group())
        return self._group

    def gone(self) -> bool:
        """Whether the default process group these ranks agree under was destroyed (or
        replaced) since their first collective: a job that lost a rank tore it down, and no
        rank is left to agree with."""
        return self._under is not None and self._under() is not _default_group()

    def agreed(self, decide: Callable[[], Any]) -> Any:
        """Collective: ``decide()`` runs on rank 0 and every rank gets its answer (module doc)."""
        group = self.group()
        if group.size == 1:
            return decide()
        what = _decision(decide)
        if group.rank != COORDINATOR:
            answer = json.loads(group.broadcast(None))
            if answer.get("what") != what:  # rank 0 answered another call of the manager
                raise RankFailedError(
                    f"checkpoint manager of {self._where}: the ranks are out of step: rank "
                    f"{group.rank} waited for {what}, rank 0 answered "
                    f"{answer.get('what')}. Every rank calls the manager's methods in the same "
                    "order with the same arguments (restore(state, step=...) alike on every "
                    "rank); restart the job's ranks together")
            if "error" in answer:
                raise RankFailedError(f"checkpoint manager of {self._where}: rank 0 failed: "
                                      f"{answer['error']}")
            return answer["value"]
        try:
            value = decide()
        except Exception as exc:
            group.broadcast(json.dumps({"what": what,
                                        "error": f"{type(exc).__name__}: {exc}"}).encode())
            raise
        data = json.dumps({"what": what, "value": value}).encode()
        group.broadcast(data)
        return json.loads(data)["value"]  # exactly what the other ranks got

    def verdict(self, error: Exception, *, unreadable: bool = False) -> tuple[bool, str]:
        """Collective after a failed load (which raised on every rank): -> (fall back, every
        damaged rank's reason). ``unreadable``: a StorageIOError counts as damage."""
        kind = ("damaged" if isinstance(error, DAMAGE)
                or (unreadable and isinstance(error, StorageIOError)) else
                "peer" if isinstance(error, RankFailedError) else "other")
        # (a load's word on the state it filled left out: the caller falls back or says its own)
        mine = [kind, f"{type(error).__name__}: {str(error).removeprefix(PARTLY_FILLED)}"]
        group = self.group()
        if group.size == 1:
            return kind == "damaged", mine[1]
        if isinstance(error, RankFailedError) and error.ranks:  # a rank dead or stuck, named
            # by the load's deadline on every live rank: it would not come here either, and no
            # other step loads without it
            return False, mine[1]
        try:
            reports = [json.loads(b) for b in group.all_gather(json.dumps(mine).encode())]
        except RankFailedError as lost:  # a rank lost: the load's own error says which, where
            if isinstance(error, RankFailedError):
                raise error from None
            raise RankFailedError(f"{lost}; this rank's load had failed: {mine[1]}",
                                  lost.ranks) from error
        kinds = {k for k, _ in reports}
        why = "; ".join(f"rank {r}: {m}" for r, (k, m) in enumerate(reports) if k == "damaged")
        return "damaged" in kinds and "other" not in kinds, why


def _decision(decide: Callable[[], Any]) -> str:
    """The name of what ``decide`` decides (a function, or a partial of one), alike on every rank
    that calls the same method of the manager."""
    func = getattr(decide, "func", decide)
    return str(getattr(func, "__qualname__", type(func).__qualname__))


def _default_group() -> Any:
    import torch.distributed as dist

    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
