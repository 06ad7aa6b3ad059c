"""A state in memory written as DCP, torch_checkpointing or torch.save files, put into place
whole: written under a temporary name beside DST, fsynced, then renamed over it.

``write_dcp`` runs DCP's own FileSystemWriter (``dcp.save`` in this one process);
``write_tc`` torch.saves each top-level item as torch_checkpointing's default layout names
it; ``write_torch_save`` is one torch.save file. A directory that DST already holds is moved
aside first and removed once the new one is in place; a failure leaves DST as it was and
removes every temporary. A full disk or a Ctrl-C is raised as itself (an OSError, named with
DST as a StorageIOError, or KeyboardInterrupt), not as the RuntimeError torch's zip writer
raises instead.

Call order: convert.py's ``convert`` loads SRC, checks DST, then calls the target's writer.

Owns: those writers and putting their output into place. Does not own: which target, the
checks on DST and what each target keeps of a state (convert.py), the formats themselves
(torch, torch_checkpointing).
"""

from __future__ import annotations

import os
import shutil
import uuid
import warnings
from collections.abc import Callable
from typing import Any, BinaryIO

from ckptio.errors import CkptError, StorageIOError
from ckptio.storage.local.durable import fsync_path

__all__ = ["write_dcp", "write_tc", "write_torch_save"]


def _beside(out: str, token: str, what: str) -> str:
    head, name = os.path.split(out)
    return os.path.join(head, f".{name}.ckptio-{token}.{what}")


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.unlink(path)


def _dir_into_place(out: str, to: str, fill: Callable[[str], None]) -> None:
    """``fill`` a temporary directory beside ``out``, fsync it, then rename it into place."""
    token = uuid.uuid4().hex[:12]
    tmp, old = _beside(out, token, "tmp"), _beside(out, token, "old")
    try:
        fill(tmp)
        fsync_path(tmp)
        if os.path.lexists(out):
            os.rename(out, old)
        os.rename(tmp, out)
        fsync_path(os.path.dirname(out))
    except OSError as exc:
        raise StorageIOError(f"convert to {to} at {out}: {exc}") from None
    finally:
        _remove(tmp)
        _remove(old)


def _hidden(exc: BaseException) -> BaseException | None:
    """What cut a write short when it was a failed write (a full disk) or a Ctrl-C: ``exc``
    itself, or what torch hides: its zip writer, closing after one, raises a RuntimeError
    ("unexpected pos ...") whose context is the real cause. None otherwise."""
    cause = exc.__context__ if isinstance(exc, RuntimeError) else exc
    return cause if isinstance(cause, (OSError, KeyboardInterrupt)) else None


def _torch_save(value: Any, f: BinaryIO) -> None:
    """``torch.save(value, f)`` raising the OSError or KeyboardInterrupt torch hides."""
    import torch

    try:
        torch.save(value, f)
    except RuntimeError as exc:
        cause = _hidden(exc)
        if cause is None:
            raise
        raise cause from None


def write_dcp(state: Any, out: str) -> None:
    """DCP's FileSystemWriter into a temporary directory beside ``out``, then renamed."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    def fill(tmp: str) -> None:
        try:
            with warnings.catch_warnings():  # one process, on purpose
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp, sync_files=True),
                         no_dist=True)
        except CheckpointException as exc:  # this process's failure, as DCP wraps it
            for failed, _trace in exc.failures.values():
                cause = _hidden(failed)
                if cause is not None:
                    raise cause from None  # a Ctrl-C, or an OSError: _dir_into_place names it
            raise CkptError(f"convert to dcp at {out}: dcp.save failed: {_last_line(exc)}; "
                            "nothing was written at DST") from None
        except (ValueError, TypeError) as exc:
            raise CkptError(f"convert to dcp at {out}: dcp.save failed: {_last_line(exc)}; "
                            "nothing was written at DST") from None

    _dir_into_place(out, "dcp", fill)


def write_tc(state: Any, out: str) -> None:
    """Each top-level item torch.saved as ``<item>_0.pt`` (fsynced) into a temporary directory
    beside ``out``, then renamed."""
    import pickle

    if not isinstance(state, dict) or not all(
            isinstance(k, str) and k and "/" not in k and k not in (".", "..") for k in state):
        shown = list(state)[:8] if isinstance(state, dict) else type(state).__name__
        raise CkptError(f"convert to torch_checkpointing at {out}: its items are the state's "
                        f"top-level keys, which must be strings that name files; not {shown}")

    def fill(tmp: str) -> None:
        os.makedirs(tmp)
        try:
            for item, value in state.items():
                with open(os.path.join(tmp, f"{item}_0.pt"), "wb") as f:
                    _torch_save(value, f)
                    f.flush()
                    os.fsync(f.fileno())
        except (pickle.PicklingError, TypeError, AttributeError) as exc:
            raise CkptError(f"convert to torch_checkpointing at {out}: the state cannot be "
                            f"pickled: {exc}; nothing was written at DST") from None

    _dir_into_place(out, "torch_checkpointing", fill)


def _last_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__


def write_torch_save(state: Any, out: str) -> None:
    """torch.save into a temporary file beside ``out``, fsynced, then renamed over it."""
    import pickle

    tmp = _beside(out, uuid.uuid4().hex[:12], "tmp")
    try:
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with open(tmp, "wb") as f:
            _torch_save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
        fsync_path(os.path.dirname(out))
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        raise CkptError(f"convert to torch.save at {out}: the state cannot be pickled: "
                        f"{exc}") from None
    except OSError as exc:
        raise StorageIOError(f"convert to torch.save at {out}: {exc}") from None
    finally:
        _remove(tmp)
