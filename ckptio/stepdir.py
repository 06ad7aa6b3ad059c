"""The directory of a CheckpointManager: step-<N> checkpoints, listed, hidden and removed.

Owns: which names are steps (``step-N`` exactly, real directories), whether each is committed
(its Store says), the hidden names a retention renames steps to before removing them, the
removal itself, and what to say when a directory holds no step. Does not own: which steps to
keep or restore (manager.py) or one checkpoint's files (storage/).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import warnings

from ckptio.api import store_for
from ckptio.errors import StorageIOError
from ckptio.storage import steps as storage_steps

__all__ = ["HIDDEN_PREFIX", "fsync_dir", "hidden", "is_committed", "nothing_here", "remove",
           "scan", "step_of"]

log = logging.getLogger("ckptio")
_STEP = re.compile(r"step-(\d+)$", re.ASCII)
HIDDEN_PREFIX = ".deleting-step-"
_HIDDEN = re.compile(r"\.deleting-step-\d+-[0-9a-f]+$", re.ASCII)
_TORCH_FILES = (".pt", ".pth", ".ckpt", ".bin")


def _warn(message: str) -> None:
    log.warning("%s", message)
    warnings.warn(message, stacklevel=4)


def scan(directory: str) -> dict[str, list[int]]:
    """The step directories in ``directory``, committed and incomplete, ascending."""
    out: dict[str, list[int]] = {"committed": [], "incomplete": []}
    for entry in _entries(directory):
        step = step_of(entry.name)
        if step is not None and entry.is_dir(follow_symlinks=False):
            out["committed" if is_committed(entry.path) else "incomplete"].append(step)
    return {kind: sorted(steps) for kind, steps in out.items()}


def _entries(directory: str) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(directory) as it:
            return list(it)
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise StorageIOError(f"cannot list checkpoint directory {directory}: "
                             f"{exc.strerror or exc}") from None


def step_of(name: str) -> int | None:
    """N for a directory named ``step-N`` exactly (no leading zeros), else None."""
    match = _STEP.match(name)
    if match is None or name != f"step-{int(match.group(1))}":
        return None
    return int(match.group(1))


def is_committed(path: str) -> bool:
    """Whether the checkpoint at ``path`` has a committed manifest (its Store says)."""
    return storage_steps.is_committed(store_for(path))


def hidden(directory: str) -> list[str]:
    """Steps hidden by a retention and not yet removed (by a removal killed half-way, say)."""
    return [e.path for e in _entries(directory)
            if _HIDDEN.match(e.name) and e.is_dir(follow_symlinks=False)]


def remove(paths: list[str]) -> None:
    """The removal thread: failures are logged; the leftover is removed by the next retention."""
    for path in paths:
        try:
            shutil.rmtree(path)
        except OSError as exc:
            log.warning("ckptio: could not remove %s (an old step, already out of the listing): "
                        "%s; the next retention tries again", path, exc)


def fsync_dir(path: str) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        _warn(f"ckptio: could not fsync {path} ({exc.strerror or exc}): old steps already out of "
              "the listing are removed by the next retention")
        return False
    return True


def nothing_here(directory: str) -> str:
    """Why there is no step to restore, and what the directory holds instead."""
    if not os.path.isdir(directory):
        return f"no checkpoint to restore: {directory} does not exist (nothing saved there yet)"
    names = sorted(n for n in os.listdir(directory) if not _HIDDEN.match(n))
    torch_files = [n for n in names if n.endswith(_TORCH_FILES)]
    others = [n for n in names if is_committed(os.path.join(directory, n))]
    hints = [text for found, text in [
        (is_committed(directory), "it is itself a ckptio checkpoint, not a directory of "
                                   f"steps: load it with ckptio.load({directory!r}, state)"),
        (".metadata" in names, "it holds a torch.distributed.checkpoint (DCP) checkpoint "
                               "(.metadata): load it with torch.distributed.checkpoint.load"),
        (torch_files, f"it holds torch.save files ({', '.join(torch_files[:3])}): load them with "
                      "torch.load, then save through this manager"),
        (others, f"it holds ckptio checkpoints not named step-<N> ({', '.join(others[:3])}): "
                 "rename them step-<N>, or load them with ckptio.load")] if found]
    return (f"no checkpoint to restore in {directory}: "
            f"{'; '.join(hints) or 'it holds no step-<N> directory'}")
