"""A mapped save's data files as the capture sees them: regions of their shared mappings.

In a mapped save (persist.SaveJob(mapped=True), chosen by save_session.py for a store on tmpfs)
a capture window's "buffer" (capture_window.py) is the region [start, start + region_nbytes)
of its file's mapping (storage/local/mapped.py), a buffers.Buffer over those pages: the capture's copies are the
checkpoint's bytes, the hasher reads them there, nothing is written. A region is made once per
mapping and kept with it (with the views the capture makes in it), so a save into a reused slot finds them.
Where CUDA is present and the save has device sources, each mapping is page-locked once
(cudaHostRegister, undone before it is unmapped): the device->host copies land in the file.

Call order: ``region(file, start)`` while capturing (opens the file on first use), ``opened``
for every file at the end (a file of only empty items is created still), ``close(keep=)``.

Owns: the regions, the page-locking. Does not own: the files and their cache
(storage/local/mapped.py), what is copied and hashed (persist.py).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from ckptio.format.types import FileLayout
from ckptio.io.buffers import Buffer
from ckptio.storage.files import StoreFiles
from ckptio.storage.local.mapped import MappedFile

__all__ = ["MappedTarget", "pin"]


class MappedTarget:
    """The data files of one save, each mapped whole once it is first needed."""

    def __init__(self, target: StoreFiles, files: Sequence[FileLayout], region_nbytes: int,
                 *, cuda: bool) -> None:
        self.target, self.files, self.region_nbytes = target, files, region_nbytes
        self.cuda = cuda and torch.cuda.is_available()
        self.pinned = self.cuda  # every mapping page-locked so far (copies may be non_blocking)
        self._open: dict[int, MappedFile] = {}

    def opened(self, file: int) -> MappedFile:
        """File ``file``'s mapping, made on first use."""
        mapping = self._open.get(file)
        if mapping is None:
            layout = self.files[file]
            mapping = self._open[file] = self.target.open_mapped(layout.name, layout.nbytes)
            if self.cuda:
                self.pinned = pin(mapping) and self.pinned
        return mapping

    def region(self, file: int, start: int) -> Buffer:
        """The region of file ``file`` from ``start`` (a multiple of region_nbytes)."""
        mapping = self.opened(file)
        key = ("region", start, self.region_nbytes)
        buffer = mapping.kept.get(key)
        if not isinstance(buffer, Buffer):
            nbytes = min(self.region_nbytes, mapping.nbytes - start)
            if nbytes <= 0:  # an empty file: nothing is copied into it
                return Buffer(0, memoryview(bytearray()), torch.empty(0, dtype=torch.uint8))
            pages = (ctypes.c_uint8 * nbytes).from_address(mapping.address + start)
            buffer = Buffer(start // self.region_nbytes, memoryview(pages).cast("B"),
                            torch.frombuffer(pages, dtype=torch.uint8))
            mapping.kept[key] = buffer
        return buffer

    def close(self, *, keep: bool) -> None:
        """Done with every mapping: kept for a later save into the same file (``keep``), else
        unmapped (a failed save, whose files are removed). Idempotent."""
        while self._open:
            self.target.release_mapped(self._open.popitem()[1], keep=keep)


def pin(mapping: MappedFile) -> bool:
    """Page-lock ``mapping`` for device->host copies, once per mapping -> whether it is (also
    ahead of a save: a slot made at a manager's prepare, managing/level.py)."""
    if mapping.kept.get("pinned") or not mapping.nbytes:
        return True
    cudart = torch.cuda.cudart()
    if int(cudart.cudaHostRegister(mapping.address, mapping.nbytes, 0)) != 0:
        return False  # e.g. a memlock limit: the copies still work, synchronously
    address = mapping.address
    mapping.kept["pinned"] = True
    mapping.on_unmap.append(lambda: cudart.cudaHostUnregister(address))
    return True
