"""What a CheckpointManager decides beyond one checkpoint: which steps to keep (retention.py),
when a save is due by time or by a preemption signal (triggers.py), how its ranks agree on
rank 0's decisions (ranks.py), and the one channel its warnings take (warn() below).

Layer: the drivers' (with manager.py, its user). Internal: nothing here is public API. The
public surface is ``ckptio`` itself (ckptio/__init__.py's ``__all__``: CheckpointManager).

Owns: those policies and exchanges. Does not own: listing or deleting steps (manager.py,
storage/steproot.py), one checkpoint's metadata (stepmeta.py).
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
