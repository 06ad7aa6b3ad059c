"""The wire group of a shared load: the gloo process group over which its ranks send each other
the stored bytes one of them read (readshare.py's exchange step, sendreads.py's messages).

    generation(members, timeout_s)  this rank's generation of the group it holds (0: none),
                                    which the load's plan step agrees on across its ranks
    Wire(...).exchange(units, share) at the load's first exchange the group is made (by every
                                    member, with local synchronization, its timeout
                                    Options.rank_timeout_s) or the one kept is reused;
                                    -> the peers whose messages failed
    Wire.close(failed)              after a failure the group is dropped: the next load makes
                                    a new one (a new generation)

torch names a group made with local synchronization by a hash of its ranks and of how many
groups the process holds, so its members must hold as many: ckptio makes no group on some
ranks only (dist.rank_alone_group is a mark, not a group). Where a program did, the members
name it differently, each waits the timeout and the load reads around it (readshare.py).

Owns: the table of the groups made, held weakly. Does not own: the messages (sendreads.py),
when to exchange or what to do when it fails (readshare.py).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from ckptio.distributed import sendreads
from ckptio.planning.shared_reads import Share

__all__ = ["Wire", "generation"]

# (group members, timeout) -> (generation, the wire group, weakly: torch's registry holds it
# until destroy_process_group, and holding it here would keep its threads alive past that)
_wires: dict[tuple[tuple[int, ...], float], tuple[int, weakref.ref[Any]]] = {}


def generation(members: tuple[int, ...], timeout_s: float) -> int:
    """The generation of the wire group of ``members`` this rank holds; 0: none."""
    known = _wires.get((members, timeout_s))
    return known[0] if known is not None and known[1]() is not None else 0


class Wire:
    """The wire group of one load (made at its first exchange, kept for its second), and how
    its messages are checked: ``algorithm`` (None: unchecked), ``block_nbytes`` and ``where``
    (the path a message names for a file)."""

    def __init__(self, members: tuple[int, ...], timeout_s: float, agreed: int,
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
            _wires.pop(self.key, None)
            return {o: str(self.error) for o in share.owner if o != -1}
        try:
            return sendreads.exchange(self.group, units, share, *self.checks)
        except BaseException:
            _wires.pop(self.key, None)
            raise

    def close(self, failed: bool) -> None:
        """After a failed exchange its pairs may be closed: the next load makes a new one."""
        if failed:
            _wires.pop(self.key, None)


def _wire(key: tuple[tuple[int, ...], float], agreed: int) -> Any:
    """The wire group of ``key``'s members: the one made before if every rank still holds it
    (the ``agreed`` generation), else a new one (every member makes it at this point)."""
    known = _wires.get(key)
    group = known[1]() if known is not None and known[0] == agreed else None
    if group is None:
        group = torch.distributed.new_group(list(key[0]), backend="gloo",
                                            timeout=timedelta(seconds=key[1]),
                                            use_local_synchronization=True)
        _wires[key] = (agreed, weakref.ref(group))
    return group
