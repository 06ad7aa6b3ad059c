"""Meta's torch_checkpointing as its users call it, for the tests of its checkpoints in ckptio
and out of it (tests/test_tc_checkpoints.py) and the benchmarks that run it beside ckptio.

``manager``: its CheckpointManager, synchronous, buffered writes (its O_DIRECT writes fail on
ext4 here: BENCH_TORCH_CHECKPOINTING.md), with DefaultResharder on the items named.
``cpu_metadata_gather``: its metadata gather (needed by a save or load with a resharder) puts
its bytes on CUDA (torch_checkpointing 0.1.1, metadata_manager.py line 416:
``torch.tensor(..., device="cuda")``), so on gloo ranks without a GPU it fails; this swaps in
``dist.all_gather_object`` for the same exchange (the tests and pages say so where they use
it). Owns: those two. Does not own: torch_checkpointing (an extra: ``ckptio[torch-checkpointing]``).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

__all__ = ["cpu_metadata_gather", "manager"]


def cpu_metadata_gather() -> None:
    from torch_checkpointing import metadata_manager

    def gather(self: Any, data: Any, process_group: Any = None) -> dict[int, Any]:
        out: list[Any] = [None] * dist.get_world_size(process_group)
        dist.all_gather_object(out, data, group=process_group)
        return dict(enumerate(out))

    metadata_manager.DefaultMetadataManager._all_gather_pickled_data = gather  # type: ignore[method-assign]


def manager(resharded: tuple[str, ...] = (), asynchronous: bool = False) -> Any:
    from torch_checkpointing.checkpoint_manager import CheckpointManager
    from torch_checkpointing.config import AsyncCheckpointSaverConfig, SyncCheckpointSaverConfig
    from torch_checkpointing.default_resharder import DefaultResharder
    from torch_checkpointing.schema import ItemSpec
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

    if resharded:
        cpu_metadata_gather()
    save = AsyncCheckpointSaverConfig() if asynchronous else SyncCheckpointSaverConfig()
    return CheckpointManager(CheckpointManager.Config(
        items={k: ItemSpec(resharder=DefaultResharder()) for k in resharded}, save=save,
        storage_config=LocalFileSystemStorageConfig(use_direct_io=False)))
