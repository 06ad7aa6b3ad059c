"""The arrival check before a collective that callers may make on some ranks only: each rank of
a torch group says it is here, under a name, and waits for the others, for a deadline.

    missing = arrive(group, "lightning-load", options.rank_timeout_s)  # () once all are here

A collective's own steps tell a rank that never joins from a slow one only after
Options.step_timeout_s (storegroup.py: a live rank may be busy); a caller that knows its
ranks reach the call together (Lightning's resume) checks their arrival first, so that a call
on some ranks only ends within the deadline, naming those missing. Every rank counts its
arrivals under each name: the n-th check of a name meets the others' n-th. One that fails
takes its arrival back, so the next check of that name on every rank is the same n-th.

Owns: the arrival keys (under ``ckptio/arrive/`` in the group's store) and the wait. Does not
own: the collective after it, the store (the job's: dist.store_of).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch

from ckptio.distributed.dist import store_of

__all__ = ["arrive"]

_arrived: dict[tuple[tuple[int, ...], str], int] = {}  # (members, name) -> checks passed


def arrive(group: Any, name: str, deadline_s: float) -> tuple[int, ...]:
    """Say this rank of ``group`` is here under ``name`` and wait up to ``deadline_s`` for the
    others -> the group ranks that did not come (empty: all did)."""
    dist = torch.distributed
    members = tuple(int(r) for r in dist.get_process_group_ranks(group))
    rank, size, store = dist.get_rank(group), len(members), store_of(group)
    count = _arrived.get((members, name), 0)
    key = f"ckptio/arrive/{name}/{count}"
    store.set(f"{key}/{rank}", b"1")
    if int(store.add(key, 1)) == size:  # the last to come tells the others
        store.set(f"{key}/all", b"1")
    try:
        store.wait([f"{key}/all"], timedelta(seconds=deadline_s))
    except RuntimeError:  # the deadline passed (torch's DistStoreError)
        store.add(key, -1)
        store.delete_key(f"{key}/{rank}")
        return tuple(r for r in range(size) if r != rank and not store.check([f"{key}/{r}"]))
    _arrived[(members, name)] = count + 1
    return ()
