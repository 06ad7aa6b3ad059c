"""The root a CheckpointManager keeps its steps in, as a small protocol: StepRoot.

A scheme's registry entry (select.py) names its root's factory: a local directory, host memory,
an S3 prefix, or a user's (``register_store(..., step_root=...)``). The manager goes only
through these methods:

- ``path(step)``: the step's checkpoint location (what select.store_for serves);
- ``scan()``: the steps there, committed and incomplete (steps being removed are not listed);
- ``is_committed(step)``: whether that step holds a committed manifest;
- ``hide(step)``: take a committed step out of the listing at once, crash-safely; False, with
  a warning (``warn``), if it failed or there is no such step;
- ``removal(step=None)``: the work that finishes removing the hidden steps (all, or only
  ``step``'s, before a save into it), to run on a thread or at once; None if none is due;
- ``nothing_here()``: why the root holds no step (a Nothing whose ``empty`` says it holds
  nothing a restore could mean: restore() then returns None instead of raising).

Optional: ``lease(take_over, create=)`` (LeasedRoot), ``being_deleted()`` and ``usage(where)``
for ``ckptio ls RUN`` (ListedRoot), ``foreign(incomplete)`` (ForeignRoot: which incomplete
steps hold a torch_checkpointing checkpoint, from scan()'s names). Every root is asked that
through ``foreign_steps`` (a user's root without ``foreign`` too: through its Stores).

Owns: the protocol, which names are steps (``step-N`` exactly) or a torch_checkpointing
checkpoint's, the hidden names a rename-based root gives a dropped step, the wording of
nothing_here() and the roots' warning channel. Does not own: which steps to keep or restore
(the manager), one checkpoint's files (the Stores).
"""

from __future__ import annotations

import re
import secrets
import warnings
from collections.abc import Callable
from typing import Protocol, runtime_checkable

from ckptio.errors import CkptError
from ckptio.storage.store_contract import Store, TreeStore

__all__ = [
    "HIDDEN_PREFIX",
    "TORCH_FILES",
    "foreign_steps",
    "Claimable",
    "Lease",
    "LeasedRoot",
    "ForeignRoot",
    "ListedRoot",
    "Listing",
    "Nothing",
    "Removal",
    "StepRoot",
    "Usage",
    "hidden_name",
    "is_empty",
    "is_hidden",
    "is_tc_file",
    "nothing_message",
    "step_name",
    "step_of",
    "warn",
]

Listing = dict[str, list[int]]  # "committed" and "incomplete": steps, ascending
Removal = Callable[[], None]  # finishes removing hidden steps; its failures are logged
Usage = tuple[int, int, float | None]  # bytes, files, newest modification time (None: unknown)
TORCH_FILES = (".pt", ".pth", ".ckpt", ".bin")
# step-N exactly, N without leading zeros: what step_name(N) makes, and nothing else
_STEP = re.compile(r"step-(0|[1-9][0-9]*)\Z", re.ASCII)
HIDDEN_PREFIX = ".deleting-step-"
_HIDDEN = re.compile(r"\.deleting-step-\d+-[0-9a-f]+$", re.ASCII)
TC_METADATA = "metadata.pkl"  # torch_checkpointing's, beside its <item>_<rank>.pt files
_TC_RANK0 = re.compile(r"[^/]+_0\.pt\Z", re.DOTALL)  # its rank 0 file of an item


@runtime_checkable
class StepRoot(Protocol):
    """Where a CheckpointManager's steps live (see the module docstring)."""

    location: str  # the directory or the s3:// URL, as messages name it

    def path(self, step: int) -> str: ...

    def scan(self) -> Listing: ...

    def is_committed(self, step: int) -> bool: ...

    def hide(self, step: int) -> bool: ...

    def removal(self, step: int | None = None) -> Removal | None: ...

    def nothing_here(self) -> str: ...


@runtime_checkable
class ListedRoot(Protocol):
    """What ``ckptio ls`` lists beyond a StepRoot: ``being_deleted()`` -> (step, where) of the
    steps hidden and not yet removed; ``usage(where)`` -> the bytes, files and newest
    modification time under a step's location (``path(step)`` or a being_deleted place)."""

    def being_deleted(self) -> list[tuple[int, str]]: ...

    def usage(self, where: str) -> Usage: ...


@runtime_checkable
class ForeignRoot(Protocol):
    """What a manager asks a root beyond a StepRoot: ``foreign(incomplete)`` -> those of
    ``incomplete`` (steps its last scan() listed as incomplete) that hold a torch_checkpointing
    checkpoint (is_tc_file), ascending: a save there would leave its files beside ckptio's and
    a retention would remove both; no request per step where listing costs requests."""

    def foreign(self, incomplete: list[int]) -> list[int]: ...


class Lease(Protocol):
    """A run's lease as a manager holds it: ``held`` (this process excludes other jobs there),
    ``lost`` (why another job took it over since: None while kept), ``release()`` (never
    raises)."""

    @property
    def lost(self) -> str | None: ...

    @property
    def held(self) -> bool: ...

    def release(self) -> None: ...


@runtime_checkable
class Claimable(Protocol):
    """A Lease taken over that tells its holder only once this manager saves: ``claim()``
    (never raises)."""

    def claim(self) -> None: ...


@runtime_checkable
class LeasedRoot(Protocol):
    """A root that keeps one live job per run: ``lease(take_over, create=)`` -> its Lease, or
    None where none is taken (``create`` False: only a run that exists already), or
    CheckpointLockedError naming the live job that holds it."""

    def lease(self, take_over: bool, *, create: bool) -> Lease | None: ...


class Nothing(str):
    """nothing_here()'s message, with ``empty``: whether the root holds nothing that looks like
    a checkpoint (nothing saved there yet), rather than something else to point the user to."""

    empty: bool

    def __new__(cls, message: str, *, empty: bool) -> Nothing:
        made = super().__new__(cls, message)
        made.empty = empty
        return made


def warn(message: str, stacklevel: int = 2) -> None:
    """A root's warning (a step retention could not hide), emitted once, through ``warnings``
    only (as the manager's own warnings: filters silence or escalate it, and
    ``logging.captureWarnings(True)`` routes it to logs). ``stacklevel`` counts from the caller
    of warn()."""
    warnings.warn(message, stacklevel=stacklevel + 1)


def is_empty(message: str) -> bool:
    """Whether a nothing_here() message says the root holds nothing at all (Nothing.empty)."""
    return bool(getattr(message, "empty", False))


def step_name(step: int) -> str:
    return f"step-{step}"


def step_of(name: str) -> int | None:
    """N for a name ``step-N`` exactly (no leading zeros), else None."""
    match = _STEP.match(name)
    return None if match is None else int(match.group(1))


def is_tc_file(name: str) -> bool:
    """Whether ``name``, directly in a step, says the step holds a torch_checkpointing
    checkpoint: its ``metadata.pkl`` or an item's rank 0 file ``<item>_0.pt`` (every
    checkpoint of it has one; no ckptio save writes either)."""
    return name == TC_METADATA or _TC_RANK0.match(name) is not None


def foreign_steps(root: StepRoot, incomplete: list[int],
                  store_at: Callable[[str], Store]) -> list[int]:
    """Those of ``incomplete`` (steps ``root`` listed as incomplete) holding a torch_checkpointing
    checkpoint, ascending: a ForeignRoot's answer (from its listing, no request per step), else
    each step's Store (``store_at(root.path(step))``) looked at; a step that cannot be looked at
    is not one (the load of it says why)."""
    if isinstance(root, ForeignRoot):
        return root.foreign(incomplete)
    return [step for step in sorted(incomplete) if _holds_tc(store_at(root.path(step)))]


def _holds_tc(store: Store) -> bool:
    """Whether ``store`` holds a torch_checkpointing checkpoint's files (is_tc_file)."""
    try:
        if store.sizes([TC_METADATA]):
            return True
        return isinstance(store, TreeStore) and any(map(is_tc_file, store.entries()))
    except CkptError:
        return False


def hidden_name(step: int) -> str:
    """A fresh name for ``step`` hidden by a retention: never a step, never listed."""
    return f"{HIDDEN_PREFIX}{step}-{secrets.token_hex(4)}"


def is_hidden(name: str) -> bool:
    """Whether ``name`` is one hidden_name() made (a step out of the listing, to remove)."""
    return _HIDDEN.match(name) is not None


def nothing_message(location: str, names: list[str], *, itself: bool, checkpoints: list[str],
                    noun: str, move: str = "rename them step-<N>") -> Nothing:
    """Why ``location`` (holding ``names``) has no step to restore: ``itself`` says it is a
    ckptio checkpoint, ``checkpoints`` are the names that are; ``noun`` is "directory" or
    "prefix"; ``move`` says how to make them steps. Nothing here advises deleting anything: it
    may be another library's checkpoint."""
    torch_files = [] if itself else [  # a checkpoint's own data files are not torch.save files
        n for n in names if n.endswith(TORCH_FILES) and n not in checkpoints]
    hints = [text for found, text in [
        (itself, "it is itself a ckptio checkpoint, not a directory of "
                 f"steps: load it with ckptio.load({location!r}, state)"),
        (".metadata" in names, "it holds a torch.distributed.checkpoint (DCP) checkpoint "
                               "(.metadata): load it with torch.distributed.checkpoint.load"),
        (torch_files, f"it holds torch.save files ({', '.join(torch_files[:3])}): load them with "
                      "torch.load, then save through this manager"),
        (checkpoints, f"it holds ckptio checkpoints not named step-<N> "
                      f"({', '.join(checkpoints[:3])}): {move}, or load them with ckptio.load"),
    ] if found]
    return Nothing(f"no checkpoint to restore in {location}: "
                   f"{'; '.join(hints) or f'it holds no step-<N> {noun}'}", empty=not hints)
