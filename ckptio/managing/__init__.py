"""The one CheckpointManager (managing/manager.py: its verbs, on parts.py's ManagerParts: its
construction, the save in flight to its commit, close()) and the parts it composes, in call order:
declare.py (its arguments -> tiers and their retention), tier.py (``ckptio.Tier``, the declaration,
the memory budget), level.py (TierSteps: one tier at run time; all_tiers.py makes and lists them,
tier_thread.py runs their background work), follower.py (the Follower protocol of what follows a
commit in the first tier), route.py and drain.py (the drain's route through the tiers and its
background thread, copy.py a verified copy of one step between stores), guard.py (with redundancy:
the rank-local setup, its follower), inflight.py (the save in flight), headroom.py (what gives way
to it in a memory first tier), unclosed.py (the exit-time line of a manager never closed),
restoring.py (the one restore loop), agreed.py (with redundancy: the step every rank agrees on
first). The policies are objects (ckptio/policies/, public); here they run: triggers.py (Saving:
the save policy, agreed across ranks), level.py (the retention and delta-base policies, asked with
each step's StepInfo), with retention.py and delta.py (the keyword sugar), chains.py (each step's
bases) and agreement.py (rank 0's decisions agreed). warn() below is the one channel a manager's
warnings take.

Layer: the drivers' (above redundancy/ and api.py; managing/manager.py on top of its parts, which never
import it). Internal: nothing here is public API. The public surface is ``ckptio`` itself
(CheckpointManager, Tier, the policies). Owns: those parts. Does not own: one checkpoint
(api.py), listing or hiding steps (storage/steproot.py), copies across hosts (redundancy/).
"""

from __future__ import annotations

import warnings

__all__ = ["warn"]


def warn(message: str, stacklevel: int = 2) -> None:
    """A manager's warning (a restore that fell back past a step, a step retention could not
    read), emitted once, through ``warnings`` only: ``logging.captureWarnings(True)`` routes
    it to the ``py.warnings`` logger for jobs that collect logs; ``warnings`` filters silence or
    escalate it. ``stacklevel`` counts from the caller of warn()."""
    warnings.warn(message, stacklevel=stacklevel + 1)
