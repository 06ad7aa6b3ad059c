"""A CheckpointManager's policies as objects: when to save, which steps to keep, what a delta
is saved against.

    class KeepFirstOfEachEpoch:                       # a user's own, in the user's own file
        def kept(self, steps, now):
            return {s.step for s in steps if s.step % 1000 == 0}

    ckptio.Tier("ckpts", keep=ckptio.AnyOf(ckptio.KeepLatest(2), KeepFirstOfEachEpoch()))

Three one-verb protocols (records.py): a retention policy's ``kept(steps, now)`` (the StepInfo
of one tier's committed steps, oldest first, and the Unix time) returns the set of step numbers
to keep; a save policy's ``due(moment)`` (a SaveMoment) says whether a save is due; a
delta-base policy's ``base(step, steps)`` names the full step a save is a delta against, or
None. The built-ins (builtins.py, delta_base.py) cover the keyword spellings (keep_last,
keep_every, keep_best, save_every, save_interval_s, preemption build them) plus time-based
retention; AnyOf unions them.

What no policy can change: the manager keeps the newest committed step, the step restored or
verified last, the bases of every kept delta (managing/chains.py), what its followers pin and
the damaged steps newer than every undamaged one (a retention policy is asked without them);
a base is a full, undamaged, older step. Layer: a base helper (imports only ckptio.errors).
Its modules are internal: the public surface is ``ckptio`` itself (ckptio.KeepLatest, ...).
"""

from __future__ import annotations

from ckptio.policies.builtins import (
                                      AnyOf,
                                      KeepAll,
                                      KeepBest,
                                      KeepEvery,
                                      KeepLatest,
                                      KeepRecent,
                                      SaveEvery,
                                      SaveOnPreemption,
                                      check_base,
                                      check_keep,
                                      check_save,
                                      leaves,
)
from ckptio.policies.delta_base import DeltaPolicy
from ckptio.policies.records import (
                                      DeltaBasePolicy,
                                      RetentionPolicy,
                                      SaveMoment,
                                      SavePolicy,
                                      StepFacts,
                                      StepInfo,
                                      base_by,
                                      due_by,
                                      kept_by,
)

__all__ = ["AnyOf", "DeltaBasePolicy", "DeltaPolicy", "KeepAll", "KeepBest", "KeepEvery",
           "KeepLatest", "KeepRecent", "RetentionPolicy", "SaveEvery", "SaveMoment",
           "SaveOnPreemption", "SavePolicy", "StepFacts", "StepInfo", "base_by", "check_base",
           "check_keep", "check_save", "due_by", "kept_by", "leaves"]
