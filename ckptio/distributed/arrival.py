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
mark moves the round number on. Once a round is whole every rank has left the round before it,
whose keys its ranks then delete (each its own mark; rank 0 the count and the end): a job's
store holds one round's keys per name, however many checks it makes.

Owns: the arrival keys (under ``ckptio/arrive/`` in the group's store) and the wait. Does not
own: the collective after it, the store (the job's: dist.store_of).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch

from ckptio.distributed.dist import store_of
from ckptio.errors import RankFailedError

__all__ = ["arrive"]

_WHOLE, _FAILED = b"1", b"0"


def arrive(group: Any, name: str, deadline_s: float) -> tuple[int, ...] | None:
    """Say this rank of ``group`` is here under ``name`` and wait up to ``deadline_s`` for the
    others -> None once all came, else the group ranks that did not come in time (empty where
    they all came, the last once the round had failed). RankFailedError naming rank 0 where
    the store stops answering (the process holding it exited)."""
    dist = torch.distributed
    rank, size, store = dist.get_rank(group), dist.get_world_size(group), store_of(group)
    try:
        return _round(store, rank, size, f"ckptio/arrive/{name}", deadline_s)
    except RuntimeError as exc:  # torch's DistError family: the store's host is gone
        raise RankFailedError(
            f"rank 0: the job's rendezvous store stopped answering rank {rank} as it checked "
            f"the ranks' arrival ({name}; {type(exc).__name__}: {exc}): the process that holds "
            "it (rank 0's, unless torchrun's agent holds it) exited or is unreachable",
            ranks=(0,)) from None


def _round(store: Any, rank: int, size: int, prefix: str,
           deadline_s: float) -> tuple[int, ...] | None:
    """arrive's round under ``prefix``, in ``store``."""
    counter = f"{prefix}/round"
    number = int(store.add(counter, 0))
    key = f"{prefix}/{number}"
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
        _forget(store, f"{prefix}/{number - 1}", rank)
        return None
    return tuple(r for r in range(size) if not store.check([f"{key}/{r}"]))


def _end(store: Any, counter: str, number: int, key: str, mark: bytes) -> bytes:
    """End round ``number`` with ``mark``, unless it has ended -> the mark that stands. The
    round number moves on first (once), so that no rank that saw the end joins it again."""
    store.compare_set(counter, str(number), str(number + 1))  # a no-op where done before
    return bytes(store.compare_set(f"{key}/end", "", mark))


def _forget(store: Any, key: str, rank: int) -> None:
    """Delete round ``key``'s keys this rank owns: its mark; on rank 0 also the count and the
    end (no rank is in that round any more: every rank came to the round after it)."""
    store.delete_key(f"{key}/{rank}")
    if rank == 0:
        store.delete_key(key)
        store.delete_key(f"{key}/end")
