"""The ranks one Checkpointer's calls run over, and the plans of each one's last save.

Call order: a save or an in-place load asks ``group(process_group, options)`` for its ranks:
one process (Solo), or the ranks of the torch process group, exchanging through the job's
store with the caller's deadlines (made on the group's first use, then reused); a save asks
``memory(group)`` for the plans of the last save over those ranks (reused while the layout is
unchanged).

Owns: that table, keyed by torch group and holding each group weakly, so destroy_process_group
frees it (drains its workers) at once, not at interpreter exit; the entry and its plans go
with the group. Does not own: the groups' collectives (dist.py, step.py), what a plan memory
holds (collective.Memory), the calls themselves (api.py).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from ckptio.distributed import collective
from ckptio.distributed.dist import Group, Solo, current_group, over_torch
from ckptio.options import Options

__all__ = ["RankGroups"]


class RankGroups:
    """The ranks of a Checkpointer's calls and the plan memory of each (module docstring)."""

    __slots__ = ("_groups", "_memories")

    def __init__(self) -> None:
        self._memories: dict[int | None, collective.Memory] = {}  # per group: plans of the last save
        # per torch group: weakly, so destroy_process_group frees it (drains its workers) at
        # once, not at interpreter exit; the entry goes with the group
        self._groups: dict[int, tuple[weakref.ref[Any], Group]] = {}

    def group(self, process_group: Any, options: Options) -> Group:
        """The ranks of this call: one process, or the ranks of the torch process group
        (exchanging through the job's store, with ``options``' deadlines)."""
        torch_group = current_group(process_group)
        if torch_group is None:
            return Solo()
        known = self._groups.get(id(torch_group))
        if known is None or known[0]() is not torch_group:
            known = (weakref.ref(torch_group, _forget(self._groups, self._memories)),
                     over_torch(torch_group, options))
            self._groups[id(torch_group)] = known
        return known[1]

    def memory(self, group: Group) -> collective.Memory:
        """The plans of the last save over ``group`` (reused while the layout is unchanged)."""
        return self._memories.setdefault(None if isinstance(group, Solo) else id(group),
                                         collective.Memory())

    def memories(self) -> list[collective.Memory]:
        """The plan memories held now, one per group saved over (what a test counts reuse in)."""
        return list(self._memories.values())


def _forget(groups: dict[int, tuple[weakref.ref[Any], Group]],
            memories: dict[int | None, collective.Memory]) -> Callable[[weakref.ref[Any]], None]:
    """The callback that drops a freed torch group's entry and its plans from a table
    (holding neither the table nor the group)."""
    def forget(ref: weakref.ref[Any]) -> None:
        for key, (known, group) in list(groups.items()):
            if known is ref:
                del groups[key]
                memories.pop(id(group), None)
    return forget
