"""The process-wide default Checkpointer behind the module-level functions.

    ckptio.save(state, path) / ckptio.async_save(...) / ckptio.load(path, state) / ckptio.verify(path)

Owns: creating the shared Checkpointer on first use and replacing it when called with other
Options. Everything else is Checkpointer's (api.py).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import Any

import torch

from .api import Checkpointer
from .background import SaveHandle, SaveResult
from .fill import KeyFilter, RankPolicy
from .options import Options

_default: Checkpointer | None = None
_default_lock = threading.Lock()


def _checkpointer(options: Options | None) -> Checkpointer:
    """The shared Checkpointer; replaced (its pool freed) when called with different options."""
    global _default
    with _default_lock:
        if _default is None or (options is not None and options != _default.options):
            if _default is not None:
                _default.close()
            _default = Checkpointer(options)
        return _default


def save(state: Any, path: str | os.PathLike[str], *, allow_pickle: bool = False,
         options: Options | None = None, process_group: Any = None) -> SaveResult:
    """Save with the shared Checkpointer (or a one-off one when ``options`` is given)."""
    return _checkpointer(options).save(state, path, allow_pickle=allow_pickle,
                                       process_group=process_group)


def async_save(state: Any, path: str | os.PathLike[str], *, lazy: bool = False,
               optimizers: Sequence[torch.optim.Optimizer] = (), if_busy: str = "wait",
               allow_pickle: bool = False, options: Options | None = None,
               process_group: Any = None) -> SaveHandle:
    """Start a background save with the shared Checkpointer; see Checkpointer.async_save."""
    return _checkpointer(options).async_save(state, path, lazy=lazy, optimizers=optimizers,
                                             if_busy=if_busy, allow_pickle=allow_pickle,
                                             process_group=process_group)


def verify(path: str | os.PathLike[str]) -> int:
    """Check every stored byte of a checkpoint against its checksum; see Checkpointer.verify."""
    return _checkpointer(None).verify(path)


def load(path: str | os.PathLike[str], state: Any = None, *, strict: bool = True,
         keys: KeyFilter = None, cast: bool = False, verify: bool | None = None,
         allow_pickle: bool = False, per_rank_from: RankPolicy = None,
         options: Options | None = None, process_group: Any = None) -> Any:
    """Load with the shared Checkpointer; see Checkpointer.load."""
    return _checkpointer(options).load(path, state, strict=strict, keys=keys, cast=cast,
                                       verify=verify, allow_pickle=allow_pickle,
                                       per_rank_from=per_rank_from, process_group=process_group)
