"""The arrival check before a collective that callers may make on some ranks only: each rank of
a torch group says it is here, under a name, and waits for the others, for a deadline.

    missing = arrive(group, "lightning-load", options.rank_timeout_s)  # None: all are here

A collective's own steps tell a rank that never joins from a slow one only after
Options.step_timeout_s (storegroup.py: a live rank may be busy); a caller that knows its
ranks reach the call together (Lightning's resume) checks their arrival first, so that a call
on some ranks only ends within the deadline, naming those missing.

Each check of a name is one round, numbered in the store (``<name>/round``), so that ranks
that missed a round (it ended without them) meet the others at the next. A round ends once:
its last rank to come marks it whole, or a rank whose deadline passed marks it failed
(compare-and-set: the first mark stands, and every rank of the round sees it), and the first
mark moves the round number on.

Owns: the arrival keys (under ``ckptio/arrive/`` in the group's store) and the wait. Does not
own: the collective after it, the store (the job's: dist.store_of).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch

from ckptio.distributed.dist import store_of

__all__ = ["arrive"]

_WHOLE, _FAILED = b"1", b"0"


def arrive(group: Any, name: str, deadline_s: float) -> tuple[int, ...] | None:
    """Say this rank of ``group`` is here under ``name`` and wait up to ``deadline_s`` for the
    others -> None once all came, else the group ranks that did not come in time (empty where
    they all came, the last once the round had failed)."""
    dist = torch.distributed
    rank, size, store = dist.get_rank(group), dist.get_world_size(group), store_of(group)
    counter = f"ckptio/arrive/{name}/round"
    number = int(store.add(counter, 0))
    key = f"ckptio/arrive/{name}/{number}"
    store.set(f"{key}/{rank}", b"1")
    if int(store.add(key, 1)) == size:  # the last to come: the round is whole, unless failed
        outcome = _end(store, counter, number, key, _WHOLE)
    else:
        try:
            store.wait([f"{key}/end"], timedelta(seconds=deadline_s))
            outcome = bytes(store.get(f"{key}/end"))
        except RuntimeError:  # the deadline passed (torch's DistStoreError)
            outcome = _end(store, counter, number, key, _FAILED)
    if outcome == _WHOLE:
        return None
    return tuple(r for r in range(size) if not store.check([f"{key}/{r}"]))


def _end(store: Any, counter: str, number: int, key: str, mark: bytes) -> bytes:
    """End round ``number`` with ``mark``, unless it has ended -> the mark that stands. The
    round number moves on first (once), so that no rank that saw the end joins it again."""
    store.compare_set(counter, str(number), str(number + 1))  # a no-op where done before
    return bytes(store.compare_set(f"{key}/end", "", mark))
