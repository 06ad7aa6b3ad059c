"""One window of an export's output file, filled: its part of the header, then its tensors.

export.py streams each safetensors file it writes as windows (planning/export_plan.py cuts
them, saving/stream.py writes them). ``fill_window`` puts a window's bytes in its staging
buffer: the part of the header it covers, then each of its parts' element ranges, read from
the source through the ``read`` handed in; a part whose dtype changes is read as saved into
``Scratch`` first and cast into the buffer.

Call order: export.py's write step makes one Scratch per export, then calls ``fill_window`` from
the write loop's fill, once per window, before that window is written.

Owns: a window's bytes and the scratch a cast reads into (allocated once, grown to the largest
window's need). Does not own: which windows and parts there are (planning/export_plan.py),
reading and checking the source (export.py's reads, loading/read.py), writing (saving/stream.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ckptio.alignment import align_up
from ckptio.format.types import DTYPE_ITEMSIZE, Chunk, Read
from ckptio.io.buffers import Buffer, torch_dtype, typed
from ckptio.planning.export_plan import Part, Window

__all__ = ["Scratch", "fill_window"]

ReadFn = Callable[[list[Read]], int]
_SCRATCH_ALIGN = 64  # each part's scratch starts aligned for any dtype


class Scratch:
    """Where a window's tensors are read as saved before their dtype changes: allocated once
    for the export and grown to the largest window's need (up to 4x a window, float64 to
    bfloat16), not allocated per tensor and window."""

    def __init__(self) -> None:
        self.data = torch.empty(0, dtype=torch.uint8)

    def views(self, parts: tuple[Part, ...]) -> list[torch.Tensor | None]:
        """Per part: a 1-D tensor of its saved dtype and element count, or None (no cast)."""
        sizes = [0 if p.tensor.source.out_dtype == p.tensor.source.dtype
                 else p.count * DTYPE_ITEMSIZE[p.tensor.source.dtype] for p in parts]
        need = sum(align_up(n, _SCRATCH_ALIGN) for n in sizes)
        if need > self.data.numel():
            self.data = torch.empty(need, dtype=torch.uint8)
        views: list[torch.Tensor | None] = []
        at = 0
        for part, nbytes in zip(parts, sizes):
            views.append(self.data[at:at + nbytes].view(torch_dtype(part.tensor.source.dtype))
                         if nbytes else None)
            at += align_up(nbytes, _SCRATCH_ALIGN)
        return views


def fill_window(window: Window, buffer: Buffer, header: bytes, read: ReadFn,
                scratch: Scratch) -> None:
    """A window's bytes: its part of the header, then its tensors' element ranges, read from
    the source (into ``scratch`` first when the dtype changes)."""
    if window.offset < len(header):
        head = header[window.offset:window.offset + window.nbytes]
        buffer.view[:len(head)] = head
    reads: list[Read] = []
    casts: list[tuple[torch.Tensor, torch.Tensor]] = []
    for part, staged in zip(window.parts, scratch.views(window.parts)):
        source = part.tensor.source
        dest = typed(buffer, part.at, part.count * torch_dtype(source.out_dtype).itemsize,
                     torch_dtype(source.out_dtype))
        into = dest if staged is None else staged
        if staged is not None:
            casts.append((dest, staged))
        if part.start == 0 and part.count == source.numel:  # whole: the stored chunk's layout
            reads.append(Read(source.key, source.entries, Chunk.whole(source.shape),
                              into.view(source.shape)))
        else:
            reads.append(Read(source.key, source.entries,
                              Chunk((part.start,), (part.count,), flat=True), into))
    if reads:
        read(reads)
    for dest, staged in casts:
        dest.copy_(staged)
