"""A CheckpointManager's steps in this process's host memory: MemoryRoot.

Steps are the locations ``mem://<root>/step-N`` of storage/memory/host_memory.py's HOST: files under them,
or a location a save prepared and has not written to yet; whether each is committed its
MemoryStore says. A retention hides a dropped step by moving every file of it to
``<root>/.deleting-step-<N>-<hex>`` at once, under the host's lock (as a rename: a reader sees
the step whole or not at all), and removes that location later (MemoryStore.forget, on the
manager's thread). Nothing survives the process: there is nothing to make durable, and a kill
leaves nothing behind.

A step a save holds a claim on (MemoryStore.exclusive) is not hidden: that save would commit
into a location no longer listed.

Owns: MemoryRoot (listing, the move, the removal, what a memory location holds instead of
steps). Does not own: the memory files, locations and claims (storage/memory/host_memory.py),
the hidden names and which steps hold a torch_checkpointing checkpoint (steproot.py), which
steps to keep or restore (managing/manager.py).
"""

from __future__ import annotations

import functools

from ckptio.storage import steps as storage_steps
from ckptio.storage.memory.host_memory import HOST, SCHEME
from ckptio.storage.memory.memory_store import MemoryStore
from ckptio.storage.steproot import (
    Listing,
    Nothing,
    Removal,
    hidden_name,
    is_hidden,
    nothing_message,
    step_name,
    step_of,
    warn,
)

__all__ = ["MemoryRoot"]


class MemoryRoot:
    """A memory location of ``step-N`` locations (see the module docstring). Keeps no state
    of its own: every handle of one location sees the same steps."""

    def __init__(self, location: str) -> None:
        head, tail = location[:len(SCHEME)], location[len(SCHEME):]
        self.location = MemoryStore(head + tail.rstrip("/")).location  # refuses a bad one

    def __repr__(self) -> str:
        return f"MemoryRoot({self.location!r})"

    def path(self, step: int) -> str:
        return f"{self.location}/{step_name(step)}"

    def scan(self) -> Listing:
        """The step locations, committed and incomplete, ascending (one consistent view: a
        hide or a commit happens wholly before or after it)."""
        out: Listing = {"committed": [], "incomplete": []}
        with HOST.lock:
            for step in self._steps():
                out["committed" if self.is_committed(step) else "incomplete"].append(step)
        return {kind: sorted(steps) for kind, steps in out.items()}

    def _steps(self) -> list[int]:
        """Names ``step-N`` under the root that are locations (not a plain file so named)."""
        prefix = self.location + "/"
        prepared = {loc[len(prefix):].split("/", 1)[0] for loc in HOST.locations
                    if loc.startswith(prefix)}
        steps = {step_of(name) for name in prepared.union(HOST.entries(self.location))}
        return [s for s in steps if s is not None and HOST.exists(self.path(s))]

    def is_committed(self, step: int) -> bool:
        return _committed(self.path(step))

    def hide(self, step: int) -> bool:
        """Move the step out of the listing (at once); False (and a warning) if there is no
        such step or a save holds it."""
        path = self.path(step)
        with HOST.lock:
            refusal = _refusal(path)
            if refusal is None:
                _move(path, f"{self.location}/{hidden_name(step)}")
        if refusal is not None:
            _warn(refusal)
            return False
        return True

    def removal(self, step: int | None = None) -> Removal | None:
        """Removing every hidden leftover. A hidden step has another name, so a save into
        ``step`` never waits for it: None."""
        if step is not None:
            return None
        leftovers = [f"{self.location}/{name}" for name in HOST.entries(self.location)
                     if is_hidden(name)]
        leftovers = [loc for loc in leftovers if HOST.exists(loc)]
        return functools.partial(_forget, leftovers) if leftovers else None

    def nothing_here(self) -> str:
        """Why there is no step to restore, and what the location holds instead."""
        location = self.location
        if HOST.read(location) is not None:
            return (f"no checkpoint to restore: {location} is a file in this process's memory, "
                    "not a location of steps")
        if not HOST.exists(location):
            return Nothing(f"no checkpoint to restore: nothing is stored at {location} in this "
                           "process's memory (nothing saved there yet: memory checkpoints do not "
                           "outlive the process that saved them)", empty=True)
        names = [name for name in HOST.entries(location) if not is_hidden(name)]
        return nothing_message(
            location, names, itself=_committed(location), noun="location",
            checkpoints=[name for name in names if _committed(f"{location}/{name}")])


def _committed(location: str) -> bool:
    return storage_steps.is_committed(MemoryStore(location))


def _refusal(path: str) -> str | None:
    """Why the step at ``path`` cannot be hidden now (HOST.lock held), or None."""
    claim = HOST.claims.get(path)
    if claim is not None:
        return (f"ckptio: retention could not remove {path}: a save holds it ({claim.holder}); "
                "it is kept and tried again after the next save")
    if not HOST.exists(path):
        return (f"ckptio: retention could not remove {path}: there is no such step (removed "
                "already?)")
    return None


def _move(path: str, target: str) -> None:
    """Every file under ``path`` to the same name under ``target`` (HOST.lock held)."""
    prefix = path + "/"
    for old in [p for p in HOST.files if p.startswith(prefix)]:
        HOST.files[target + old[len(path):]] = HOST.files.pop(old)
    HOST.locations.discard(path)


def _forget(locations: list[str]) -> None:
    """The removal thread: in memory a removal cannot fail."""
    for location in locations:
        MemoryStore(location).forget()


def _warn(message: str) -> None:
    warn(message, stacklevel=3)  # once, through warnings (steproot.warn)
