"""ckptio under torch.distributed.checkpoint: a StorageWriter and a StorageReader, so that
``dcp.save(state, storage_writer=ckptio.DcpWriter(path))`` and
``dcp.load(state, storage_reader=ckptio.DcpReader(path))`` run through ckptio's I/O while
DCP's planners do the resharding. This package is the only part of ckptio that imports
``torch.distributed.checkpoint``'s storage interface.

Owns: the translation between DCP's plans/metadata and ckptio's manifest, reads and writes.
The modules here are internal; the public surface is ``ckptio`` itself (``ckptio.DcpWriter``,
``ckptio.DcpReader``).

Does not own: I/O, checksums, commit (saving/, loading/, storage/ below it).
"""

from __future__ import annotations

from ckptio.dcp.reader import DcpReader
from ckptio.dcp.writer import DcpWriter

__all__ = ["DcpReader", "DcpWriter"]
