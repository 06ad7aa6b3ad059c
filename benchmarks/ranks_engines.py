"""The save and load engines benchmarks/ranks.py times on each rank: ckptio's, DCP's
(FileSystemWriter with k threads and sync_files, then os.sync()), the N-writer O_DIRECT
ceiling, and Meta's torch_checkpointing (its sync CheckpointManager, buffered writes, its
DefaultResharder on 2+ ranks, then os.sync()). Each is a function of (state, path) run inside the rank's clock.

Owns: how each engine is called and made durable. Does not own: the clock, the ranks or the
report (ranks.py, ranks_report.py).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

from benchmarks.ranks_state import map_containers

__all__ = ["ckptio_loader", "ckptio_save", "dcp_load", "dcp_save", "raw_writer_save",
           "tcp_load", "tcp_save"]


def ckptio_save(state: Any, path: Path) -> None:
    from benchmarks import engines

    engines.ENGINES["ckptio"].save(state, path)  # durable + committed when it returns


def raw_writer_save(share: int, rank: int) -> Any:
    """The N-writer ceiling: this rank writes ``share`` bytes to its own file with O_DIRECT
    (threads and buffers made here, before the clock), then fsyncs the file and directory."""
    from ckptio.tuning import ceiling

    writer = ceiling.Writer()

    def save(state: Any, path: Path) -> None:
        path.mkdir(parents=True, exist_ok=True)
        writer.write(path / f"raw-r{rank}.bin", share)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return save


def dcp_save(threads: int) -> Any:
    def save(state: Any, path: Path) -> None:
        import torch.distributed.checkpoint as dcp

        writer = dcp.FileSystemWriter(str(path), thread_count=threads, sync_files=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(state, storage_writer=writer)
        os.sync()  # .metadata and the directory entries: sync_files fsyncs only the data files
    return save


def ckptio_loader(path: Path, warm_pool: bool) -> Any:
    """ckptio.load with the engines' options (POSIX backend, no tuned profile) through its own
    Checkpointer; with ``warm_pool`` its staging pool and I/O threads are made before the clock
    (as in save_load.py, where the process saved before it loads)."""
    import ckptio

    from benchmarks import engines

    checkpointer = ckptio.Checkpointer(engines.ckptio_options("posix"))
    if warm_pool:
        checkpointer.prepare(path)
    return lambda path, dest: checkpointer.load(str(path), dest)


def tcp_save(state: Any, path: Path) -> None:
    """torch_checkpointing's save, then os.sync() (it has no fsync), as DCP's is timed. On
    2+ ranks with its DefaultResharder (its metadata gather made to run on CPU:
    ckptio/testing/tc_peer.py). One rank saves plain tensors (its 1-rank DTensors' local parts):
    a 1-rank load's destination is plain, and it loads only into the type it saved."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from ckptio.testing.tc_peer import manager

    def plain(value: Any) -> Any:
        return value.to_local() if isinstance(value, DTensor) else map_containers(value, plain)

    one = not dist.is_initialized() or dist.get_world_size() == 1
    manager(() if one else ("state",)).save(str(path), {"state": plain(state) if one else state})
    os.sync()


def tcp_load(path: Path, dest: Any) -> object:
    """Its load, with its DefaultResharder when the checkpoint has its metadata (2+ ranks)."""
    from ckptio.testing.tc_peer import manager

    resharded = ("state",) if (path / "metadata.pkl").exists() else ()
    manager(resharded).load(str(path), into={"state": dest})
    return None


def dcp_load(path: Path, dest: Any) -> object:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(dest, storage_reader=dcp.FileSystemReader(str(path)))
    return None
