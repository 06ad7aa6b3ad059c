"""The steps the ranks of one load share: LoadRanks, made for each Checkpointer.load call.

Call order: Checkpointer.load (api.py) makes one (LoadRanks.of) before anything is read. With
many ranks and a state filled in place: the manifest read once and shared
(distributed/loadsteps.py SharedManifest), the unexpected keys agreed riding on the read step
(UnexpectedKeys) and the reads shared among the ranks (distributed/readshare.py); otherwise the
key step alone (this rank's keys agreed at once). The load takes them through its LoadRequest
(loading/load_session.py); then every rank ends them, with done() or, on an error, failed(exc),
which releases each step's waiters and agrees the outcome (loadsteps.agree_loaded): a failure
on any rank raises on every rank.

Owns: which steps a load shares and how they end. Does not own: the steps themselves
(distributed/loadsteps.py, distributed/readshare.py), the load (loading/load_session.py), the
ranks of a call (distributed/rankgroups.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ckptio.distributed import loadsteps, readshare
from ckptio.distributed.dist import Group
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
    def of(cls, group: Group, torch_group: Any, path: str, options: Options, keys: KeyFilter,
           *, in_place: bool) -> LoadRanks:
        """The steps of a load of ``path`` by ``group`` (``torch_group``: its torch process
        group, or None), filling a state in place or not."""
        rank, world_size = (0, 1) if torch_group is None else (
            torch.distributed.get_rank(torch_group), torch.distributed.get_world_size(torch_group))
        many = in_place and torch_group is not None and group.size > 1
        manifest = (loadsteps.SharedManifest(group, path, options.broadcast_replicated, keys)
                    if many else None)
        key_step = loadsteps.UnexpectedKeys(group, path, rides=many)  # on the read step
        reads = None if not many else (
            readshare.SharedReads(group, torch_group, options.broadcast_replicated,
                                  options.rank_timeout_s, path, key_step))
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
