"""What follows a commit in a manager's first tier: the Follower protocol.

After a save of ours committed in the first tier (and that tier's retention ran), the manager
calls ``submit(step)`` on each follower in turn: the protection across hosts (managing/guard.py)
first, then the drain to the slower tiers (managing/drain.py). The first tier's retention keeps
the union of their ``pinned()`` steps. ``drained()`` / ``protected()`` call ``wait(timeout)``;
close() calls ``close()`` on each (the first error a follower's background work met is raised
once, by wait() or close()). ``status()`` is merged into the manager's per-tier status.

Owns: that contract. Does not own: the followers (managing/drain.py, managing/guard.py), when
they are called (managing/manager.py).
"""

from __future__ import annotations

from typing import Any, Protocol

__all__ = ["Follower"]


class Follower(Protocol):
    """Background work that reacts to a commit in the first tier (module docstring)."""

    def submit(self, step: int) -> None:
        """``step`` committed in the first tier: handle it in the background."""
        ...

    def pinned(self) -> set[int]:
        """Steps the first tier must keep while this follower needs them."""
        ...

    def wait(self, timeout: float | None = None) -> bool:
        """Until nothing is pending (-> True) or ``timeout`` (-> False); the first error not
        raised yet is raised here, once."""
        ...

    def close(self) -> None:
        """wait(), then stop; the error is raised after."""
        ...

    def status(self) -> dict[int, dict[str, Any]]:
        """Per tier index: what this follower reports about it."""
        ...
