"""The exit-time line for a CheckpointManager that saved and was never closed.

Call order: a manager's first save adds it here (track); its close() takes it off (forget); at
interpreter exit, each one still here is told (its at_exit(), managing/parts.py: the warning
naming it, the memory tier's slots removed, the run leases let go). Its saves in flight are
finished by the saves' own exit hook (saving/at_exit.py), not here; close()'s last retention
pass and its followers' work do not run.

Owns: the set of those managers (weak: a manager dropped unclosed is forgotten) and the exit
hook that tells them. Does not own: what a manager does at exit (managing/parts.py), the saves'
exit hook (saving/at_exit.py).
"""

from __future__ import annotations

import atexit
import weakref
from typing import Protocol

__all__ = ["SaidAtExit", "forget", "track"]


class SaidAtExit(Protocol):
    """A manager that says, at interpreter exit, that it was not closed (module docstring)."""

    def at_exit(self) -> None:
        """Say so and let go of what the process would otherwise leave held."""
        ...


_unclosed: weakref.WeakSet[SaidAtExit] = weakref.WeakSet()


def track(manager: SaidAtExit) -> None:
    """``manager`` saved: until forget(), an exit says it was not closed."""
    _unclosed.add(manager)


def forget(manager: SaidAtExit) -> None:
    """``manager`` is closed: an exit says nothing of it."""
    _unclosed.discard(manager)


def _say_unclosed() -> None:
    """At interpreter exit: each manager that saved and was never closed, named (its saves in
    flight finish, by api.py's own exit hook, but close()'s last retention pass and its
    followers' do not), and its run leases let go (an object store's would otherwise hold the
    run for a lease after the exit)."""
    for manager in list(_unclosed):
        manager.at_exit()


atexit.register(_say_unclosed)
