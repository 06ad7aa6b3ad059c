"""A CheckpointManager's arguments, checked, as a list of tiers: Declared.

``CheckpointManager("ckpts", keep_last=3, keep_every=K, save_every=N)`` declares one tier,
``Tier("ckpts", every=N, keep_last=3, keep_every=K)``; ``CheckpointManager(tiers=[...])``
declares its tiers. Either way ``save_every`` is the first tier's ``every``, and ``keep_best``
/ ``monitor`` / ``mode`` / ``keep_without_metric`` are the first tier's retention
(retention.py). What cannot combine is refused here, naming both options and why.

Called once, first, by the manager's constructor. Owns: those checks and defaults. Does not
own: the tiers' validation (tiering/tier.py), the retention's (retention.py).
"""

from __future__ import annotations

import dataclasses
import operator
import os
from dataclasses import dataclass
from typing import Any

from ckptio.api import Checkpointer
from ckptio.errors import CkptError
from ckptio.managing.delta import with_compression
from ckptio.managing.retention import Retention
from ckptio.options import Options
from ckptio.tiering.tier import Tier, check_tiers

__all__ = ["UNSET", "Declared", "check_step", "declare", "settings_of"]

UNSET: Any = object()  # an argument not given


def _check_directory(directory: Any) -> None:
    """The first argument is one directory (or URL); tiers go by name, ``tiers=[...]``."""
    if directory is None or isinstance(directory, (str, os.PathLike)):
        return
    if isinstance(directory, (list, tuple)):
        raise CkptError(f"CheckpointManager({type(directory).__name__} of "
                        f"{len(directory)}): give tiers by name, CheckpointManager(tiers=[...]) "
                        "(e.g. tiers=[ckptio.Tier('shm://run'), ckptio.Tier('ckpts', every=10)]); "
                        "the first argument is one directory or URL")
    raise CkptError(f"CheckpointManager({directory!r}): the first argument is the directory of "
                    "the steps, a path or URL (shm://NAME, s3://bucket/prefix); got a "
                    f"{type(directory).__name__}")


@dataclass(frozen=True)
class Declared:
    """The manager's tiers (fastest first), its save interval (None: by time or signal only)
    and each tier's retention."""

    tiers: list[Tier]
    save_every: int | None
    retentions: list[Retention]


def declare(directory: str | os.PathLike[str] | None, tiers: Any, *, keep_last: Any,
            keep_every: Any, save_every: Any, save_interval_s: float | None,
            best: dict[str, Any]) -> Declared:
    """The tiers the arguments declare (module docstring); ``best``: keep_best, monitor, mode,
    keep_without_metric as given."""
    _check_directory(directory)
    if tiers is None:
        if directory is None:
            raise CkptError("CheckpointManager(): give the directory of the steps, or "
                            "tiers=[ckptio.Tier(...), ...]")
        every = _save_every(save_every, save_interval_s, None)
        keep_last = 3 if keep_last is UNSET else keep_last
        keep_every = None if keep_every is UNSET else keep_every
        first = Retention.checked(keep_last=keep_last, keep_every=keep_every, **best)
        tier = Tier(os.fspath(directory), every=every or 1, keep_last=keep_last,
                    keep_every=keep_every)
        return Declared([tier], every, [first])
    if directory is not None:
        raise CkptError("CheckpointManager(directory, tiers=...): give a directory or "
                        "tiers, not both (a directory is one tier: ckptio.Tier(directory))")
    given = [name for name, value in (("keep_last", keep_last), ("keep_every", keep_every))
             if value is not UNSET]
    if given:
        raise CkptError(f"CheckpointManager(tiers=..., {given[0]}=...): with tiers, give "
                        "keep_last, keep_every and every per ckptio.Tier (each tier keeps its "
                        "own steps); keep_best / monitor / mode apply to the first tier")
    declared = check_tiers(tiers)
    every = _save_every(save_every, save_interval_s, declared[0])
    declared[0] = dataclasses.replace(declared[0], every=every or 1)
    declared = check_tiers(declared)  # the slower tiers' every against the first's
    first = Retention.checked(keep_last=declared[0].keep_last,
                              keep_every=declared[0].keep_every, **best)
    rest = [Retention.checked(keep_last=t.keep_last, keep_every=t.keep_every)
            for t in declared[1:]]
    return Declared(declared, every, [first, *rest])


def settings_of(options: Options | None, checkpointer: Checkpointer | None,
                compression: str | None, preemption: Any, drain_rate: float | None) -> Options:
    """The options of the manager's saves (a Checkpointer's own, or ``options``, or the
    environment's; ``compression`` in them), once the other arguments are checked."""
    if not isinstance(preemption, bool):
        raise CkptError(f"CheckpointManager(preemption={preemption!r}): True installs a "
                        "SIGTERM handler (see reached_preemption)")
    if drain_rate is not None and not drain_rate > 0:
        raise CkptError(f"CheckpointManager(drain_rate={drain_rate!r}): bytes per second > 0")
    if options is not None and checkpointer is not None:
        raise CkptError("CheckpointManager(options=..., checkpointer=...): give one of them; "
                        "a Checkpointer already has its options")
    settings = checkpointer.options if checkpointer else options or Options.from_env()
    return with_compression(settings, compression, checkpointer is not None)


def _save_every(save_every: Any, save_interval_s: float | None, first: Tier | None
                ) -> int | None:
    """The first tier's interval. Given: as given (None: by time only), and a first tier's
    ``every`` other than 1 (its default) must agree. Not given: the first tier's ``every``
    when it is not 1; else 1, or None (time only) with ``save_interval_s``."""
    tier_every = 1 if first is None else first.every
    if save_every is UNSET:
        if tier_every != 1:
            return tier_every
        return 1 if save_interval_s is None else None
    if save_every is None and save_interval_s is None:
        raise CkptError("CheckpointManager(save_every=None): nothing would be due; give "
                        "save_every=N, or save_interval_s=seconds for time only")
    if save_every is not None and (isinstance(save_every, bool) or not isinstance(save_every, int)
                                   or save_every < 1):
        raise CkptError(f"CheckpointManager(save_every={save_every!r}): must be an integer >= 1")
    if first is not None and tier_every not in (1, save_every):
        raise CkptError(f"CheckpointManager(save_every={save_every}, tiers=[Tier("
                        f"{first.location!r}, every={tier_every}), ...]): both set the first "
                        "tier's interval; give one of them")
    return save_every


def check_step(step: Any) -> int:
    """``step`` as an int >= 0, or CkptError."""
    try:
        value = operator.index(step)
    except TypeError:
        value = -1
    if isinstance(step, bool) or value < 0:
        raise CkptError(f"step must be an integer >= 0, got {step!r}")
    return value
