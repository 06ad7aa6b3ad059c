"""The wire group of a shared load: the gloo process group over which its ranks send each other
the stored bytes one of them read (readshare.py's exchange step, sendreads.py's messages).

    generation(members, timeout_s)  the name of the wire group of ``members`` this rank holds
                                    ('': none), which the load's plan step agrees on across its
                                    ranks (a new name where they differ: ``new_generation``)
    Wire(...).exchange(units, share) at the load's first exchange the group is made (by every
                                    member, its timeout Options.rank_timeout_s) or the one kept
                                    is reused; -> the peers whose messages failed
    Wire.close(failed)              after a failure the group is dropped: the next load makes
                                    a new one (a new generation)

The group is gloo's, made over the job's store under ``ckptio/wire/<generation>`` and kept
out of torch's registry: torch names the groups it registers by how many each process holds,
so a group registered on some ranks only (a load over a group of some ranks) would shift the
names of the groups made after it there, the program's own and a later load's wire group of
more ranks, which the other ranks name otherwise (each then waits the timeout). The groups
made go with the job's default group (destroy_process_group frees them).

Owns: the table of the groups made. Does not own: the messages (sendreads.py), when to
exchange or what to do when it fails (readshare.py).
"""

from __future__ import annotations

import secrets
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from ckptio.distributed import sendreads
from ckptio.distributed.step import rank_named
from ckptio.planning.shared_reads import Share

__all__ = ["Wire", "generation", "new_generation"]

# (group members, timeout) -> (generation, the wire group); the groups dropped after a failure
# (kept: a send of theirs may still be posted); the default group they go with, weakly
_wires: dict[tuple[tuple[int, ...], float], tuple[str, Any]] = {}
_dropped: list[Any] = []
_under: list[weakref.ref[Any]] = []


def generation(members: tuple[int, ...], timeout_s: float) -> str:
    """The generation of the wire group of ``members`` this rank holds; '': none."""
    known = _current().get((members, timeout_s))
    return known[0] if known is not None else ""


def new_generation() -> str:
    """The name of a new wire group (the plan step's coordinator draws it for every rank)."""
    return secrets.token_hex(8)


class Wire:
    """The wire group of one load (made at its first exchange, kept for its second), and how
    its messages are checked: ``algorithm`` (None: unchecked), ``block_nbytes`` and ``where``
    (the path a message names for a file)."""

    def __init__(self, members: tuple[int, ...], timeout_s: float, agreed: str,
                 algorithm: str | None, block_nbytes: int, where: Callable[[str], str]) -> None:
        self.key, self.generation = (members, timeout_s), agreed
        self.checks = (algorithm, block_nbytes, where)
        self.group: Any = None
        self.error: str | None = None

    def exchange(self, units: list[sendreads.Unit], share: Share) -> dict[int, str]:
        """sendreads.exchange over the wire group (made here by every member, at the load's
        first exchange) -> the peers whose messages failed."""
        if self.group is None and self.error is None:
            try:
                self.group = _wire(self.key, self.generation)
            except RuntimeError as exc:  # the wire group could not be made (a peer gone)
                self.error = f"{type(exc).__name__}: {exc}"
        if self.group is None:
            _drop(self.key)
            return {o: str(self.error) for o in share.owner if o != -1}
        try:
            return sendreads.exchange(self.group, units, share, *self.checks,
                                      lambda r: rank_named(r, self.key[0]))
        except BaseException:
            _drop(self.key)
            raise

    def close(self, failed: bool) -> None:
        """After a failed exchange its pairs may be closed: the next load makes a new one."""
        if failed:
            _drop(self.key)


def _wire(key: tuple[tuple[int, ...], float], agreed: str) -> Any:
    """The wire group of ``key``'s members: the one made before if every rank still holds it
    (the ``agreed`` generation), else a new one (every member makes it at this point)."""
    known = _current().get(key)
    if known is not None and known[0] == agreed:
        return known[1]
    from torch.distributed import distributed_c10d as c10d

    members, timeout_s = key
    store = c10d.PrefixStore(f"ckptio/wire/{agreed}/", c10d._get_default_store())
    group = c10d.ProcessGroupGloo(store, members.index(torch.distributed.get_rank()),
                                  len(members), timeout=timedelta(seconds=timeout_s))
    _drop(key)
    _wires[key] = (agreed, group)
    return group


def _drop(key: tuple[tuple[int, ...], float]) -> None:
    """The wire group of ``key`` no longer used (kept until the default group goes)."""
    known = _wires.pop(key, None)
    if known is not None:
        _dropped.append(known[1])


def _current() -> dict[tuple[tuple[int, ...], float], tuple[str, Any]]:
    """The groups made under the current default group (those of a freed one let go)."""
    world = torch.distributed.group.WORLD
    if not _under or _under[0]() is not world:
        _forget()
        _under[:] = [weakref.ref(world, lambda _ref: _forget())]
    return _wires


def _forget() -> None:
    _wires.clear()
    _dropped.clear()
