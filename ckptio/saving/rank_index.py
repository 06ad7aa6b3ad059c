"""A rank's index file: the rows of its regular chunks (format/regular_section.py), written
durably beside its data files.

Call order: save_session.py's write step, once this rank's data files are written and their
checksums known (persist.SaveJob.finish), hands the rows of its regular items here; the index
file goes through the same staging pool, I/O backend and checksums as the data (one small
SaveJob of its own), and its IndexFile and FileInfo go into what the rank reports to the
coordinator, which names it in the manifest.

Owns: the index file's layout and its write. Does not own: its encoding
(format/regular_section.py), which items are regular (planning/regular_items.py), the data
files (persist.py), the order of a save (save_session.py).
"""

from __future__ import annotations

import torch

from ckptio.alignment import align_up
from ckptio.format import regular_section
from ckptio.format.types import (Chunk, FileInfo, FileLayout, IndexFile, Placement, TensorEntry,
                                 WriteItem)
from ckptio.io import stall
from ckptio.saving import persist
from ckptio.saving.save_context import SaveContext

__all__ = ["write_index"]


def write_index(ctx: SaveContext, name: str, save_id: str, rows: list[TensorEntry],
                activity: stall.Activity) -> tuple[IndexFile, FileInfo]:
    """Write this rank's index file of its regular chunks ``rows`` (format/regular_section.py) through
    the same pool, backend and checksums as its data, durably."""
    data = regular_section.encode_index(save_id, ctx.group.rank, [
        regular_section.IndexRow(e.key, e.file, e.offset, e.checksum, e.blocks) for e in rows])
    item = WriteItem("index", "bytes", "uint8", (len(data),), Chunk.whole((len(data),)), len(data))
    layout = FileLayout(name, align_up(len(data)), (Placement(item, 0),))
    pool, target = ctx.resources.files(ctx.store, len(data))  # a small pool will do
    job = persist.SaveJob(target, [layout],
                          {"index": torch.frombuffer(bytearray(data), dtype=torch.uint8)},
                          pool=pool, algorithm=ctx.options.checksum, rank=ctx.group.rank,
                          block_nbytes=ctx.block_nbytes, activity=activity,
                          hashing=ctx.workers.calls("ckptio-hash"))
    try:
        job.capture()
        (entry,), (info,) = job.finish()
    except BaseException:
        job.abandon()
        raise
    return IndexFile(ctx.group.rank, name, len(data), entry.checksum), info
