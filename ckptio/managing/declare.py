"""A CheckpointManager's arguments, checked, as a list of tiers: Declared.

``CheckpointManager("ckpts", keep_last=3, keep_every=K, save_every=N)`` declares one tier,
``Tier("ckpts", every=N, keep_last=3, keep_every=K)``; ``CheckpointManager(tiers=[...])``
declares its tiers. Either way ``save_every`` is the first tier's ``every``, and ``keep_best``
/ ``monitor`` / ``mode`` / ``keep_without_metric`` are the first tier's retention
(retention.py). The policies (ckptio/policies/) come out of it: each tier's retention
(``keep=`` as given, else built from the keywords) and the save policy (``save=`` as given, else
SaveEvery(steps=save_every) and SaveEvery(seconds=save_interval_s), unioned). What cannot
combine is refused here, naming both options and why.

Called once, first, by the manager's constructor. Owns: those checks and defaults. Does not
own: the tiers' validation (managing/tier.py), the retention's (retention.py).
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
from ckptio.managing.tier import Tier, check_tiers
from ckptio.options import Options
from ckptio.policies import AnyOf, KeepBest, RetentionPolicy, SaveEvery, SavePolicy, check_keep, check_save

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
    """The manager's tiers (fastest first), its save interval (None: by time, signal or a
    save policy only), each tier's retention as keywords (None where ``keep=`` was given) and
    as a policy, and the save policy."""

    tiers: list[Tier]
    save_every: int | None
    retentions: list[Retention | None]
    keeps: list[RetentionPolicy]
    save: SavePolicy


def declare(directory: str | os.PathLike[str] | None, tiers: Any, *, keep_last: Any,
            keep_every: Any, save_every: Any, save_interval_s: float | None,
            best: dict[str, Any], keep: Any = None, save: Any = None) -> Declared:
    """The tiers the arguments declare (module docstring); ``best``: keep_best, monitor, mode,
    keep_without_metric as given."""
    _check_directory(directory)
    save = _check_save(save, save_every, save_interval_s, tiers)
    if tiers is None:
        if directory is None:
            raise CkptError("CheckpointManager(): give the directory of the steps, or "
                            "tiers=[ckptio.Tier(...), ...]")
        every = _save_every(save_every, save_interval_s, None, save)
        if keep is not None:
            given = [n for n, v in (("keep_last", keep_last), ("keep_every", keep_every))
                     if v is not UNSET]
            if given:
                raise CkptError(f"CheckpointManager(keep=..., {given[0]}=...): give one of "
                                "them (keep_last=n is ckptio.KeepLatest(n), keep_every=N "
                                "ckptio.KeepEvery(steps=N); join rules with ckptio.AnyOf)")
            one = Tier(os.fspath(directory), every=every or 1,
                       keep=check_keep(keep, "CheckpointManager(keep"))
        else:
            keep_last = 3 if keep_last is UNSET else keep_last
            keep_every = None if keep_every is UNSET else keep_every
            Retention.checked(keep_last=keep_last, keep_every=keep_every, **best)  # first
            one = Tier(os.fspath(directory), every=every or 1, keep_last=keep_last,
                       keep_every=keep_every)
        return _declared([one], every, best, save, save_interval_s)
    if directory is not None:
        raise CkptError("CheckpointManager(directory, tiers=...): give a directory or "
                        "tiers, not both (a directory is one tier: ckptio.Tier(directory))")
    given = [name for name, value in (("keep_last", keep_last), ("keep_every", keep_every),
                                      ("keep", keep)) if value not in (UNSET, None)]
    if given:
        raise CkptError(f"CheckpointManager(tiers=..., {given[0]}=...): with tiers, give "
                        "keep (or keep_last, keep_every) and every per ckptio.Tier (each tier "
                        "keeps its own steps); keep_best / monitor / mode apply to the first tier")
    declared = check_tiers(tiers)
    every = _save_every(save_every, save_interval_s, declared[0], save)
    declared[0] = dataclasses.replace(declared[0], every=every or 1)
    declared = check_tiers(declared)  # the slower tiers' every against the first's
    return _declared(declared, every, best, save, save_interval_s)


def _check_save(save: Any, save_every: Any, save_interval_s: Any, tiers: Any) -> Any:
    """``save=``, checked, or the first tier's ``save=`` (one place at most)."""
    first = tiers[0] if isinstance(tiers, (list, tuple)) and tiers else None
    if isinstance(first, Tier) and first.save is not None:
        if save is not None:
            raise CkptError(f"CheckpointManager(save=..., tiers=[Tier({first.location!r}, "
                            "save=...), ...]): give the save policy once")
        save = first.save
    if save is None:
        return None
    given = [n for n, v in (("save_every", save_every), ("save_interval_s", save_interval_s))
             if v not in (UNSET, None)]
    if given:
        raise CkptError(f"CheckpointManager(save=..., {given[0]}=...): give one of them "
                        "(save_every=N is ckptio.SaveEvery(steps=N), save_interval_s=S "
                        "ckptio.SaveEvery(seconds=S); join them with ckptio.AnyOf)")
    return check_save(save, "CheckpointManager(save")


def _declared(tiers: list[Tier], every: int | None, best: dict[str, Any], save: Any,
              save_interval_s: float | None) -> Declared:
    """Each tier's retention (keywords and policy) and the save policy."""
    retentions: list[Retention | None] = []
    keeps: list[RetentionPolicy] = []
    for k, tier in enumerate(tiers):
        options = best if k == 0 else {}
        if tier.keep is None:
            retention = Retention.checked(keep_last=tier.keep_last, keep_every=tier.keep_every,
                                          **options)
            retentions.append(retention)
            keeps.append(retention.policy())
            continue
        retentions.append(None)
        if options.get("keep_best") is None and options.get("monitor") is None:
            keeps.append(tier.keep)
            continue
        checked = Retention.checked(keep_last=1, **options)  # keep_best's checks
        assert checked.keep_best is not None and checked.monitor is not None  # checked()
        keeps.append(AnyOf(tier.keep, KeepBest(checked.keep_best, checked.monitor,
                                               checked.mode, checked.keep_without_metric)))
    if save is None:
        rules: list[SavePolicy] = [] if every is None else [SaveEvery(steps=every)]
        if save_interval_s is not None:
            rules.append(SaveEvery(seconds=_interval(save_interval_s)))
        save = rules[0] if len(rules) == 1 else AnyOf(*rules)
    return Declared(tiers, every, retentions, keeps, save)


def _interval(seconds: Any) -> float:
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not (
            0 < seconds < float("inf")):
        raise CkptError(f"CheckpointManager(save_interval_s={seconds!r}): seconds > 0")
    return float(seconds)


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
    return with_compression(settings, compression, checkpointer is not None,
                            options_given=options is not None)


def _save_every(save_every: Any, save_interval_s: float | None, first: Tier | None,
                save: Any = None) -> int | None:
    """The first tier's interval. Given: as given (None: by time only), and a first tier's
    ``every`` other than 1 (its default) must agree. Not given: the first tier's ``every``
    when it is not 1; else 1, or None (time only) with ``save_interval_s``, or a save policy
    (``save``: then the policy alone decides)."""
    tier_every = 1 if first is None else first.every
    if save is not None:
        if tier_every != 1:
            raise CkptError(f"CheckpointManager(save=..., tiers=[Tier({first and first.location!r}"
                            f", every={tier_every}), ...]): both say when to save; give one")
        return None
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
