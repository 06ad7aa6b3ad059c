"""What one save needs, fixed when it starts, and this rank's part of it once agreed.

Call order: api.Checkpointer builds a ``SaveContext`` (with a ``Packing`` for a packed save,
packed.py) and hands it to save_session.begin, which lays out this rank's ``RankPart`` after the
agreement and passes both to every later step of the save.

Owns: these records and the name of a packed save's capture layout. Does not own: the steps
that fill or use them (save_session.py), the bytes (persist.py), the agreement itself
(distributed/collective.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ckptio.distributed import collective
from ckptio.distributed.dist import Group
from ckptio.format.types import FileLayout
from ckptio.options import Options
from ckptio.planning.plan import PlanCache
from ckptio.saving.cleanup import Cleanup
from ckptio.saving.commits import Commits
from ckptio.saving.packing import Compression
from ckptio.saving.workers import SaveWorkers
from ckptio.storage.entry_reader import Base
from ckptio.storage.files import IOResources
from ckptio.storage.store_contract import Store

__all__ = ["PACKED_FILE", "Packing", "RankPart", "SaveContext"]

PACKED_FILE = "packed"  # the capture order of a packed save: a layout, never a file


@dataclass(frozen=True)
class Packing:
    """A packed save (format version 4, saving/packing.py): how it compresses, and the base
    checkpoint it is a delta of (None: self-contained)."""

    compression: Compression
    base: Base | None



@dataclass(frozen=True)
class SaveContext:
    """What one save needs, fixed when it starts."""

    group: Group
    store: Store  # where the checkpoint goes (its location names it in messages)
    options: Options
    resources: IOResources
    cleanup: Cleanup
    workers: SaveWorkers  # the threads the save runs on after its call (and hashes on)
    memory: collective.Memory  # this group's plans of the last save
    plan_cache: PlanCache
    meta: dict[str, Any]
    block_nbytes: int
    allow_pickle: bool
    lazy: bool
    optimizers: tuple[torch.optim.Optimizer, ...]
    started: float
    after_step: tuple[torch.Tensor, ...] = ()  # lazy: changed only in or after a step too
    previous_error: BaseException | None = None  # the last save's, unseen: this one fails
    grow_staging: bool = False  # an async save: afterwards, grow the pool to hold this state
    packing: Packing | None = None  # compressed and/or a delta: every item packed
    piece: bool = False  # this rank's piece of a job's state (dist.mark_piece): shards alone
    # a checkpoint committed there once the lock is held: None replaces it with a warning,
    # True as asked (INFO), False refuses
    overwrite: bool | None = None
    commits: Commits | None = None  # the Checkpointer's memo of its commits (a drain's copy reads it)


@dataclass(frozen=True)
class RankPart:
    """This rank's part of the save, as agreed."""

    agreement: collective.Agreement
    files: tuple[FileLayout, ...]
    sources: dict[str, torch.Tensor]
    index_of: dict[str, int]  # key -> index of its item in this rank's plan (results keyed by it)
    index_file: str | None  # of this rank's regular items' chunks (format/regular_section.py), if any
    regular: frozenset[str]  # keys of those items
    per_rank: frozenset[str]  # keys of the items saved as this rank's own value
    eager_items: int  # items copied before a lazy save returns
    nbytes: int  # bytes of the items this rank writes
    ready: list[Any]  # CUDA events the copies wait for
    versions: dict[str, int] = field(default_factory=dict)  # lazy: handle.lazy_versions

    @property
    def names(self) -> list[str]:
        """Every file this rank's part creates (a packed save's are named as it writes them,
        and removed by its packer on failure)."""
        if self.files and self.files[0].name == PACKED_FILE:
            return []
        return [f.name for f in self.files] + ([self.index_file] if self.index_file else [])
