"""A staging buffer's bytes as tensors, and element-exact copies between tensors (any strides,
host or CUDA) and those bytes.

``Buffer`` is one page-aligned buffer of bytes with its dtype views (made once and kept);
``typed`` views a range of it as a dtype; ``copy_out`` / ``move_out`` put a tensor's elements
into bytes, ``copy_in`` / ``move_in`` take them back out (``move_*``: one memmove for a plain,
contiguous host tensor, no torch kernel); ``element_blocks`` walks a strided tensor as views;
``move_many`` is move_out over a run of tensors, checked and copied by ``map`` (no Python per
tensor); ``torch_dtype`` names a dtype. Device->host copies are non_blocking on whatever stream is
current: the caller owns streams and events.

Owns: the copies and the dtype names. Does not own: the memory a Buffer lies in, its pool and
its admission (io/stage.py), what is copied where (saving/persist.py, loading/read.py).
"""

from __future__ import annotations

import ctypes
import operator
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from itertools import repeat

import torch

from ckptio.errors import CkptError
from ckptio.format.types import DTYPE_ITEMSIZE

MAX_KEPT_VIEWS = 4096  # views kept per buffer (Buffer.view_at); beyond, they are made afresh

__all__ = ["MAX_KEPT_VIEWS", "Buffer", "copy_in", "copy_out", "element_blocks", "move_in",
           "move_many", "move_out", "torch_dtype", "torch_dtypes", "typed"]


@dataclass
class Buffer:
    """One page-aligned staging buffer; ``data`` is a uint8 tensor over the same memory."""

    index: int
    view: memoryview
    data: torch.Tensor
    _as: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)  # whole buffer per dtype
    _views: dict[tuple[int, torch.dtype, torch.Size], torch.Tensor] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return len(self.view)

    @property
    def address(self) -> int:
        """Where the buffer's first byte lies in memory."""
        return self.data.data_ptr()

    def as_dtype(self, dtype: torch.dtype) -> torch.Tensor:
        """The whole buffer as a 1-D tensor of ``dtype``, made once and kept."""
        whole = self._as.get(dtype)
        if whole is None:
            whole = self._as[dtype] = self.data.view(dtype)
        return whole

    def view_at(self, start: int, dtype: torch.dtype, shape: torch.Size) -> torch.Tensor:
        """Bytes from ``start`` (a multiple of the itemsize) as a contiguous tensor of ``dtype``
        and ``shape``. Kept: a save of an unchanged layout finds the same views in the same
        buffers (the pool hands buffers out lowest first), and making thousands of views was
        a third of what a save's caller waited for beyond the copy itself."""
        key = (start, dtype, shape)
        view = self._views.get(key)
        if view is None:
            if len(self._views) >= MAX_KEPT_VIEWS:
                self._views.clear()
            itemsize = dtype.itemsize
            view = self.as_dtype(dtype)[start // itemsize:start // itemsize + shape.numel()].view(shape)
            self._views[key] = view
        return view


def torch_dtype(name: str) -> torch.dtype:
    dtype = _DTYPES.get(name)
    if dtype is None:
        dtype = getattr(torch, name, None)
        if not isinstance(dtype, torch.dtype) or name not in DTYPE_ITEMSIZE:
            raise CkptError(f"dtype {name!r} is not available in this torch {torch.__version__}")
        _DTYPES[name] = dtype
    return dtype


_DTYPES: dict[str, torch.dtype] = {}  # torch_dtype's answers


def torch_dtypes(names: Sequence[str]) -> list[torch.dtype]:
    """torch_dtype of each name (the known ones looked up by one ``map``)."""
    known = list(map(_DTYPES.get, names))
    if None in known:
        known = [torch_dtype(name) for name in names]
    return known  # type: ignore[return-value]  # no None left


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


def move_in(buffer: Buffer, start: int, nbytes: int, dst: torch.Tensor, dtype: torch.dtype,
            at: int) -> bool:
    """Bytes [start, start + nbytes) of ``buffer`` into bytes [at, at + nbytes) of ``dst`` by
    one memmove (GIL released), when ``dst`` is a plain, contiguous host tensor of ``dtype``
    holding those bytes (no subclass, conjugate or negative bit, not an inference tensor); its
    version counter is bumped as copy_ bumps it. -> False, nothing copied, otherwise (copy_in).
    No torch kernel runs: in a fresh process with a cold page cache torch's copy code was paged
    in from disk inside the first copy, behind every read in flight (docs/BENCH_LIMIT.md, "the
    cold small load"), and its two-thread copy stalled whenever the other core was busy; for the
    many small entries of a state the per-call cost is a fraction of copy_'s."""
    if (not _plain_host(dst, dtype)
            or not 0 <= at <= dst.numel() * dst.element_size() - nbytes
            or not 0 <= start <= buffer.nbytes - nbytes):
        return False
    ctypes.memmove(dst.data_ptr() + at, buffer.address + start, nbytes)
    torch.autograd.graph.increment_version(dst)
    return True


def move_out(src: torch.Tensor, dtype: torch.dtype, buffer: Buffer, start: int,
             nbytes: int) -> bool:
    """``src``'s ``nbytes`` bytes into bytes [start, start + nbytes) of ``buffer`` by one
    memmove (GIL released, no torch kernel), when ``src`` is a plain, contiguous host tensor
    of ``dtype`` of exactly those bytes (move_in's rule); -> False, nothing copied, otherwise."""
    if (not _plain_host(src, dtype) or src.nbytes != nbytes
            or not 0 <= start <= len(buffer.view) - nbytes):
        return False
    ctypes.memmove(buffer.data.data_ptr() + start, src.data_ptr(), nbytes)
    return True


def move_many(srcs: Sequence[torch.Tensor], dtypes: Sequence[torch.dtype], buffer: Buffer,
              starts: Sequence[int], sizes: Sequence[int], max_nbytes: int) -> int:
    """move_out of each of ``srcs`` in order (its ``sizes[i]`` bytes into bytes from
    ``starts[i]`` of ``buffer``, within it), for the leading ones move_out takes that are of 1 to
    ``max_nbytes`` bytes; -> how many were moved (the first that is not: not copied). The same
    rule as move_out's (_plain_host), read from every tensor by one ``map`` per field, and one
    memmove each, also by ``map``: no Python runs per tensor (a save's capture of thousands of
    small tensors held the GIL in that Python)."""
    plain = list(map(_PLAIN_TYPES.__contains__, map(type, srcs)))
    count = plain.index(False) if False in plain else len(plain)
    ts = srcs[:count]  # the others' fields are not read (a subclass may compute them)
    ok = list(map(operator.le, sizes[:count], repeat(max_nbytes)))
    for flags in (map(bool, sizes[:count]), map(_IS_CPU, ts),
                  map(operator.is_, map(_DTYPE, ts), dtypes),
                  map(operator.is_, map(_LAYOUT, ts), repeat(torch.strided)),
                  map(_CONTIGUOUS, ts), map(operator.not_, map(_CONJ, ts)),
                  map(operator.not_, map(_NEG, ts)), map(operator.not_, map(_INFERENCE, ts)),
                  map(operator.eq, map(_NBYTES, ts), sizes)):
        ok = list(map(operator.and_, ok, flags))
    count = ok.index(False) if False in ok else count
    if not count:
        return 0
    if min(starts[:count]) < 0 or max(map(operator.add, starts[:count], sizes)) > len(buffer.view):
        raise CkptError("move_many: a copy reaches outside its buffer (internal)")
    list(map(ctypes.memmove, map(buffer.address.__add__, starts[:count]),
             map(_DATA_PTR, srcs[:count]), sizes[:count]))
    return count


_PLAIN_TYPES = frozenset({torch.Tensor, torch.nn.Parameter})
_IS_CPU = operator.attrgetter("is_cpu")
_DTYPE = operator.attrgetter("dtype")
_LAYOUT = operator.attrgetter("layout")
_NBYTES = operator.attrgetter("nbytes")
_CONTIGUOUS = operator.methodcaller("is_contiguous")
_CONJ = operator.methodcaller("is_conj")
_NEG = operator.methodcaller("is_neg")
_INFERENCE = operator.methodcaller("is_inference")
_DATA_PTR = operator.methodcaller("data_ptr")


def copy_in(src: torch.Tensor, dst: torch.Tensor, start: int, count: int) -> None:
    """Contiguous 1-D ``src`` of ``count`` elements -> elements [start, start+count) of ``dst``.

    A contiguous host block of ``src``'s dtype is one memmove (one thread, GIL released; its
    version counter bumped as an in-place copy would): Tensor.copy_ hands it to torch's intra-op
    pool, whose threads wait for a core the I/O threads (and a local S3 server) hold; a load's
    copies then cost more CPU and ran slower than memmove (docs/BENCH_S3.md, "where a load's CPU
    went"). Anything else (strided, another dtype or device) goes through copy_."""
    pos = 0
    for block in element_blocks(dst, start, count):
        n = block.numel()
        piece = src[pos:pos + n]
        if _plain_host(block, piece.dtype) and _plain_host(piece, piece.dtype):
            ctypes.memmove(block.data_ptr(), piece.data_ptr(), n * block.element_size())
            torch.autograd.graph.increment_version(block)
        else:
            block.copy_(piece.view(block.shape))
        pos += n


def _plain_host(t: torch.Tensor, dtype: torch.dtype) -> bool:
    """``t`` is a plain, contiguous host tensor of ``dtype`` whose bytes copy as they are (no
    subclass, conjugate or negative bit, not an inference tensor): memmove may fill or read it."""
    return (type(t) in _PLAIN_TYPES and t.is_cpu and t.dtype is dtype
            and t.layout is torch.strided and t.is_contiguous() and not t.is_conj()
            and not t.is_neg() and not t.is_inference())
