"""Host staging: a fixed pool of aligned, pre-faulted buffers reused by every save and load, and
element-exact copies between tensors (any strides, host or CUDA) and those buffers.

Owns: staging memory (allocated once, pre-faulted because this kind of VM faults fresh pages
slowly, page-locked with cudaHostRegister when CUDA is present so device copies run
asynchronously), its admission (acquire blocks while every buffer is in use) and tensor<->bytes
copies (device->host copies are non_blocking on whatever stream is current: the caller owns
streams and events). Does not own: what is copied where (saving/persist.py, loading/read.py) or I/O (io/).
"""

from __future__ import annotations

import mmap
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from ckptio.errors import CkptError
from ckptio.format.types import DTYPE_ITEMSIZE

__all__ = ["Buffer", "BufferPool", "copy_in", "copy_out", "torch_dtype", "typed"]


@dataclass
class Buffer:
    """One page-aligned staging buffer; ``data`` is a uint8 tensor over the same memory."""

    index: int
    view: memoryview
    data: torch.Tensor
    _as: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)  # whole buffer per dtype

    @property
    def nbytes(self) -> int:
        return len(self.view)

    def as_dtype(self, dtype: torch.dtype) -> torch.Tensor:
        """The whole buffer as a 1-D tensor of ``dtype``, made once and kept."""
        whole = self._as.get(dtype)
        if whole is None:
            whole = self._as[dtype] = self.data.view(dtype)
        return whole


class BufferPool:
    """``nbuffers`` buffers of ``buffer_bytes`` in one anonymous mapping.

    Every page is faulted in when the pool is made (``prefault``) and stays resident: the mapping
    is never unmapped or advised away while the pool lives, so no save pays for page faults and
    the resident set does not grow save after save. Free buffers are handed out
    last-released-first. With CUDA present the mapping is page-locked (``pinned``), so
    non_blocking device->host copies into it are truly asynchronous.
    """

    def __init__(self, nbuffers: int, buffer_bytes: int, *, prefault: bool = True) -> None:
        self.buffer_bytes = buffer_bytes
        self.nbuffers = nbuffers
        self._mapping = mmap.mmap(-1, nbuffers * buffer_bytes)
        whole = torch.frombuffer(self._mapping, dtype=torch.uint8)
        if prefault:
            whole.zero_()  # fault every page now, once, rather than inside a timed save
        self.pinned = _pin(whole)
        self._all = [
            Buffer(i, memoryview(self._mapping)[i * buffer_bytes:(i + 1) * buffer_bytes],
                   whole[i * buffer_bytes:(i + 1) * buffer_bytes])
            for i in range(nbuffers)
        ]
        self._free = list(reversed(self._all))
        self._cond = threading.Condition()

    @property
    def nbytes(self) -> int:
        return self.nbuffers * self.buffer_bytes

    def whole_view(self) -> memoryview:
        """The whole mapping (for registering it with an I/O backend)."""
        return memoryview(self._mapping)

    def acquire(self) -> Buffer:
        with self._cond:
            while not self._free:
                self._cond.wait()
            return self._free.pop()

    def try_acquire(self) -> Buffer | None:
        """A free buffer, or None at once if every buffer is in use."""
        with self._cond:
            return self._free.pop() if self._free else None

    def release(self, buffer: Buffer) -> None:
        with self._cond:
            self._free.append(buffer)
            self._cond.notify()

    def idle(self) -> bool:
        with self._cond:
            return len(self._free) == self.nbuffers

    def close(self) -> None:
        """Drop the pool's references; the memory is freed once no view of it is alive (an
        exception's traceback may still hold one, so the mapping is never force-closed)."""
        if not self.idle():
            raise CkptError("BufferPool.close: buffers are still in use by a save or load")
        if self.pinned and self._all:
            torch.cuda.cudart().cudaHostUnregister(self._all[0].data.data_ptr())
            self.pinned = False
        self._all.clear()
        self._free.clear()
        del self._mapping


def _pin(whole: torch.Tensor) -> bool:
    """Page-lock the pool for CUDA (no-op without it). The mapping stays ours; CUDA only pins it."""
    if not torch.cuda.is_available() or whole.numel() == 0:
        return False
    err = torch.cuda.cudart().cudaHostRegister(whole.data_ptr(), whole.numel(), 0)
    if int(err) != 0:  # e.g. a memlock limit: copies still work, only synchronously
        return False
    return True


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype) or name not in DTYPE_ITEMSIZE:
        raise CkptError(f"dtype {name!r} is not available in this torch {torch.__version__}")
    return dtype


def typed(buffer: Buffer, start: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
    """Bytes [start, start+nbytes) of a buffer as a 1-D tensor of ``dtype``."""
    itemsize = dtype.itemsize
    if start % itemsize == 0 and nbytes % itemsize == 0:  # always, for ckptio's aligned entries
        return buffer.as_dtype(dtype)[start // itemsize:(start + nbytes) // itemsize]
    raw = buffer.data[start:start + nbytes]
    return raw.clone().view(dtype) if start % itemsize else raw.view(dtype)  # foreign entries


def element_blocks(t: torch.Tensor, start: int, count: int) -> Iterator[torch.Tensor]:
    """Views of ``t`` that together cover elements [start, start+count) in row-major order.

    Lets a strided tensor of any size stream through fixed-size buffers without a contiguous
    copy of the whole tensor: O(ndim) views per range.
    """
    if count <= 0:
        return
    if t.dim() <= 1 or t.is_contiguous():
        yield t.reshape(-1)[start:start + count]
        return
    row = t[0].numel()
    first, offset = divmod(start, row)
    end_row, end_offset = divmod(start + count, row)
    if first == end_row:
        yield from element_blocks(t[first], offset, count)
        return
    if offset:
        yield from element_blocks(t[first], offset, row - offset)
        first += 1
    if end_row > first:
        yield t[first:end_row]
    if end_offset:
        yield from element_blocks(t[end_row], 0, end_offset)


def copy_out(src: torch.Tensor, start: int, count: int, dst: torch.Tensor) -> None:
    """Elements [start, start+count) of ``src`` -> contiguous 1-D ``dst`` of ``count`` elements."""
    pos = 0
    for block in element_blocks(src, start, count):
        n = block.numel()
        # From a device: asynchronous into pinned memory on the current stream; the caller records
        # an event and synchronizes before the bytes are read (persist.py).
        dst[pos:pos + n].view(block.shape).copy_(block, non_blocking=block.is_cuda)
        pos += n


def copy_in(src: torch.Tensor, dst: torch.Tensor, start: int, count: int) -> None:
    """Contiguous 1-D ``src`` of ``count`` elements -> elements [start, start+count) of ``dst``."""
    pos = 0
    for block in element_blocks(dst, start, count):
        n = block.numel()
        block.copy_(src[pos:pos + n].view(block.shape))
        pos += n
