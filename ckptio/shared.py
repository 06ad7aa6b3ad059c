"""The process-wide default Checkpointer behind the module-level functions.

    ckptio.save(state, path) / ckptio.async_save(...) / ckptio.load(path, state) / ckptio.verify(path)

Owns: creating the shared Checkpointer on first use and replacing it when called with other
Options. Everything else is Checkpointer's (api.py).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ckptio.api import Checkpointer
from ckptio.loading.stored import KeyFilter, RankPolicy
from ckptio.options import Options
from ckptio.saving.handle import SaveHandle, SaveResult

__all__ = ["async_save", "checkpointer", "load", "save", "verify"]

_default: Checkpointer | None = None
_default_lock = threading.Lock()


def _checkpointer(options: Options | None) -> Checkpointer:
    """The shared Checkpointer; replaced (its pool freed) when called with other options than
    it has (no options: the defaults and CKPTIO_* environment, not a previous call's)."""
    global _default
    wanted = options if options is not None else Options.from_env()
    with _default_lock:
        if _default is None or wanted != _default.options:
            if _default is not None:
                _default.close()
            _default = Checkpointer(wanted)
        return _default


def checkpointer(options: Options | None = None) -> Checkpointer:
    """The process's shared Checkpointer for ``options`` (its staging pool and I/O backend): what
    ckptio.save/load use, and the drivers that read or write through it (ckptio.DcpReader,
    ckptio.DcpWriter)."""
    return _checkpointer(options)


def save(state: Any, path: str | os.PathLike[str], *, allow_pickle: bool = False,
         options: Options | None = None, process_group: Any = None,
         metrics: Mapping[str, Any] | None = None,
         metadata: Mapping[str, Any] | None = None) -> SaveResult:
    """Save ``state`` to the directory ``path``; returns when it is durable and committed.

    state: a dict, list or tuple of tensors (plain, DTensor, ckptio.TensorShard / FlatShard),
    numpy arrays, bytes and plain Python values (int, float, str, None, ...), nested freely,
    and objects with ``state_dict()``/``load_state_dict()`` (modules, optimizers, schedulers,
    GradScaler, your data loader, ``ckptio.RNGState()``), which are saved through their
    ``state_dict()``. Anything else is refused unless ``allow_pickle=True``.

    A crash at any moment leaves the previous checkpoint at ``path`` intact: data files are
    written and fsynced, then the manifest is committed atomically. A save onto a committed
    checkpoint replaces it once it commits, and logs a warning saying so (a CheckpointManager
    refuses to save a step it holds committed). With torch.distributed
    initialised, every rank calls it together; each rank writes its own part.

    ``metrics`` (str -> number) and ``metadata`` (str -> JSON) are stored in the manifest,
    read back without the tensors by ckptio.read_metadata(path).

    Returns a SaveResult (bytes, files, seconds). Raises CkptError (a subclass naming the key,
    file and fix) on any failure. For a series of steps use ckptio.CheckpointManager; to keep
    training while it writes, ckptio.async_save.

        ckptio.save({"model": model, "optim": opt, "step": step, "rng": ckptio.RNGState()},
                    f"ckpts/step-{step}")
    """
    return _checkpointer(options).save(state, path, allow_pickle=allow_pickle,
                                       process_group=process_group, metrics=metrics,
                                       metadata=metadata)


def async_save(state: Any, path: str | os.PathLike[str], *, lazy: bool = False,
               optimizers: Sequence[torch.optim.Optimizer] = (), if_busy: str = "wait",
               allow_pickle: bool = False, options: Options | None = None,
               process_group: Any = None, metrics: Mapping[str, Any] | None = None,
               metadata: Mapping[str, Any] | None = None) -> SaveHandle:
    """Save in the background: returns a SaveHandle once the state is copied (eager) or at
    once (``lazy=True, optimizers=[opt]``: the copy runs during forward/backward and the next
    ``opt.step()`` waits only if it has not finished). ``handle.wait()`` returns the SaveResult
    or raises the error. A second save waits for the first (``if_busy="skip"`` skips it).
    ``metrics`` and ``metadata``: as ckptio.save.
    See Checkpointer.async_save for the details and ckptio.save for what a state may hold."""
    return _checkpointer(options).async_save(state, path, lazy=lazy, optimizers=optimizers,
                                             if_busy=if_busy, allow_pickle=allow_pickle,
                                             process_group=process_group, metrics=metrics,
                                             metadata=metadata)


def verify(path: str | os.PathLike[str]) -> int:
    """Read a checkpoint back and check everything a load would (every checksum, the
    manifest); returns the bytes read, raises CorruptCheckpointError (or another CkptError)
    naming the file and what is wrong. Nothing is unpickled."""
    return _checkpointer(None).verify(path)


def load(path: str | os.PathLike[str], state: Any = None, *, strict: bool = True,
         keys: KeyFilter = None, cast: bool = False, verify: bool | None = None,
         allow_pickle: bool = False, per_rank_from: RankPolicy = None,
         options: Options | None = None, process_group: Any = None) -> Any:
    """Load the checkpoint at ``path`` into ``state`` in place (returns a LoadReport), or with
    no state return a new one (CPU tensors and Python values).

    In place, the way a resuming job wants it: tensors that exist are filled where they are
    (any layout, any number of ranks: each gets its region of the saved tensor); Python values
    and tuples (RNG states, ``betas``) are replaced in their containers; objects with
    ``load_state_dict`` (model, optimizer, scheduler, ``ckptio.RNGState()``, your data loader)
    are loaded through it, with entries they lack created (a freshly built optimizer has no
    per-parameter state until its first step). So build everything fresh, then:

        state = {"model": model, "optim": opt, "sched": sched, "rng": ckptio.RNGState()}
        ckptio.load("ckpts/step-100", state)

    If you hold ``opt.state_dict()`` (a plain dict) instead of ``opt``, load it fresh and hand
    it over: ``opt.load_state_dict(ckptio.load(path)["optim"])``. A fresh load runs on this
    rank alone, unless given ``process_group=``: then every rank of that group calls it with
    the same path, and each stored byte is read by one of them and sent to the others.

    strict (default True): missing or unexpected keys, dtype or shape differences raise
    StateMismatchError naming the keys (with many ranks a key is unexpected only if no rank asks
    for it); strict=False loads what both have and reports the rest in the LoadReport.
    keys: load only these keys or prefixes (or those a callable accepts). cast: convert dtypes.
    verify: check checksums (default on). allow_pickle: unpickle objects saved with
    allow_pickle=True (trusted files only). per_rank_from: which saved rank's per-rank values
    (RNG, data-loader position) each rank takes on another number of ranks.
    Raises CkptError subclasses naming the key, file and fix; nothing is unpickled unasked.
    """
    return _checkpointer(options).load(path, state, strict=strict, keys=keys, cast=cast,
                                       verify=verify, allow_pickle=allow_pickle,
                                       per_rank_from=per_rank_from, process_group=process_group)
