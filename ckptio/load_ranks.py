"""The steps the ranks of one load share: LoadRanks, made for each Checkpointer.load call.

Call order: Checkpointer.load (api.py) makes one (LoadRanks.of) before anything is read. The
ranks of a load: an in-place one's, those of its process group (given, else the default one);
a fresh one's (no state), those of a ``process_group=`` given explicitly, else this process
alone (rank 0 inspecting a checkpoint by itself never waits for the others). With many ranks:
the manifest read once and shared (distributed/loadsteps.py SharedManifest), the reads shared
among the ranks (distributed/readshare.py) and, in place, the unexpected keys agreed riding on
the read step (UnexpectedKeys); otherwise the key step alone (this rank's keys agreed at
once). The load takes them through its LoadRequest (loading/load_session.py); then every rank
ends them, with done() or, on an error, failed(exc), which releases each step's waiters and
agrees the outcome (loadsteps.agree_loaded): a failure on any rank raises on every rank.

Owns: which steps a load shares and how they end. Does not own: the steps themselves
(distributed/loadsteps.py, distributed/readshare.py), the load (loading/load_session.py), the
ranks of a call (distributed/rankgroups.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ckptio.distributed import loadsteps, readshare
from ckptio.distributed.dist import Group, Solo, current_group
from ckptio.distributed.rankgroups import RankGroups
from ckptio.loading.stored import KeyFilter
from ckptio.options import Options

__all__ = ["LoadRanks"]


@dataclass(frozen=True)
class LoadRanks:
    """The ranks of one load and the steps they share (module docstring). ``rank`` and
    ``world_size``: this process's place in the torch group (0 of 1 without one)."""

    group: Group
    path: str
    in_place: bool
    rank: int
    world_size: int
    manifest: loadsteps.SharedManifest | None
    keys: loadsteps.UnexpectedKeys
    reads: readshare.SharedReads | None

    @classmethod
    def of(cls, groups: RankGroups, process_group: Any, path: str, options: Options,
           keys: KeyFilter, *, in_place: bool) -> LoadRanks:
        """The steps of a load of ``path`` over ``process_group`` (as the caller gave it: None
        or a torch process group; ``groups``: the Checkpointer's), filling a state in place or
        not (module docstring: whose ranks a fresh load's are)."""
        torch_group = current_group(process_group)
        rank, world_size = (0, 1) if torch_group is None else (
            torch.distributed.get_rank(torch_group), torch.distributed.get_world_size(torch_group))
        shared = in_place or (process_group is not None and world_size > 1)
        group = groups.group(process_group, options) if shared else Solo()
        many = torch_group is not None and group.size > 1
        manifest = (loadsteps.SharedManifest(group, path, options.broadcast_replicated, keys)
                    if many else None)
        key_step = loadsteps.UnexpectedKeys(group, path, rides=many)  # on the read step
        reads = None if not many else (
            readshare.SharedReads(group, torch_group, options.broadcast_replicated,
                                  options.rank_timeout_s, path, key_step if in_place else None))
        return cls(group, path, in_place, rank, world_size, manifest, key_step, reads)

    def failed(self, exc: BaseException) -> None:
        """This rank's load failed with ``exc`` (the caller raises it): every step's waiters
        released, and the ranks told."""
        if self.manifest is not None:
            self.manifest.fail(exc)
        if self.in_place:
            self.keys.fail(exc)
        if self.reads is not None:
            self.reads.fail(exc)
        loadsteps.agree_loaded(self.group, exc, self.path)

    def done(self) -> None:
        """This rank's load succeeded: agreed with the ranks (raises if another failed)."""
        loadsteps.agree_loaded(self.group, None, self.path)
