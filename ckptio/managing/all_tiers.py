"""Every tier of a manager together: one TierSteps per tier made with its roots (make_levels),
and all their steps listed at once (list_tiers).

Call order: ManagerParts (managing/parts.py) calls make_levels once, at construction; rank 0
calls list_tiers before each restore or status, inside the agreement. The first tier's root
and lister are one, with the manager's options; a slower tier's saves never copy into mapped
files, and its lister gives up after PROBE_DEADLINE_S, so that a slower tier gone away is
passed over (with a warning naming it) rather than waited for.

Owns: which root and lister each tier gets, the listing of them all. Does not own: one tier at
run time (managing/level.py TierSteps), the roots themselves (storage/select.py root_for),
which tier a restore loads from (managing/restoring.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from ckptio.api import Checkpointer
from ckptio.errors import CkptError
from ckptio.managing import warn
from ckptio.managing.agreement import Ranks
from ckptio.managing.level import TierSteps
from ckptio.managing.tier import Tier
from ckptio.policies import RetentionPolicy
from ckptio.storage.local.local_root import LocalRoot
from ckptio.storage.select import capped, root_for

__all__ = ["PROBE_DEADLINE_S", "list_tiers", "make_levels"]

PROBE_DEADLINE_S = 10.0  # a slower tier unreachable this long: refused at start, passed over later


def list_tiers(levels: Sequence[TierSteps], stacklevel: int = 3) -> list[dict[str, list[Any]]]:
    """Rank 0: every tier's steps, fastest first. The first tier's listing error is raised; a
    slower tier that cannot be listed now (an object store gone away for the lister's
    deadline) counts as holding nothing, with a warning naming it and why."""
    out: list[dict[str, list[Any]]] = [dict(levels[0].listing())]
    for level in levels[1:]:
        try:
            out.append(dict(level.listing()))
        except CkptError as exc:
            warn(f"ckptio: tier {level.location} cannot be listed, so its steps are passed "
                 f"over: {type(exc).__name__}: {exc}", stacklevel=stacklevel)
            out.append({"committed": [], "incomplete": [], "unreachable": [str(exc)]})
    return out


def make_levels(tiers: Sequence[Tier], keeps: Sequence[RetentionPolicy], ck: Checkpointer,
                ranks: Ranks, process_group: Any) -> list[TierSteps]:
    """One TierSteps per tier; a slower tier's listing gives up after PROBE_DEADLINE_S (a
    restore then goes on without it)."""
    levels = []
    # only the first tier's saves copy into mapped files: a slower tier on tmpfs (/tmp, say)
    # keeping slots would hold pages no drain copy takes
    slower = dataclasses.replace(ck.options, memory_mapped="off")
    for k, (tier, keep) in enumerate(zip(tiers, keeps)):
        root = root_for(tier.location, ck.options if k == 0 else slower)
        lister = root if k == 0 else root_for(
            tier.location, capped(tier.location, slower, PROBE_DEADLINE_S))
        if k == 0 and tier.max_bytes is not None and isinstance(root, LocalRoot):
            root.bound_slots(tier.max_bytes)  # a memory tier's pages kept for later saves too
        levels.append(TierSteps(tier.location, tier.every, root, lister, keep, ck, ranks,
                                process_group, k))
    return levels
