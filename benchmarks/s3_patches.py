"""Prototypes of changes to ckptio's data path, applied by monkeypatching in a benchmark
worker (``python -m benchmarks.s3 --engines ckptio+memmove``), never in ckptio itself: the
evidence for or against changes docs/BENCH_S3.md discusses.

(``readinto``, GET bodies read from the socket straight into the staging buffer, was measured
here first and is now ckptio's own read: storage/s3/body.py ``read_body``.)

- ``memmove``: the staging copies (buffers.copy_in / copy_out) as ctypes.memmove of contiguous
  CPU blocks (GIL released, one thread) instead of Tensor.copy_, whose OpenMP intra-op pool
  spins when the other core is busy (here: the server and the request threads).
- ``threads1``: torch.set_num_threads(1) in the whole process (what memmove avoids needing).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def _patch_memmove() -> None:
    """ckptio's staging copies (buffers.copy_in / copy_out) as one ctypes.memmove per contiguous
    CPU block of the same dtype (GIL released, one thread) instead of Tensor.copy_, which runs
    on torch's intra-op OpenMP pool and spins when the other core is busy."""
    import ctypes

    from ckptio.io import buffers
    from ckptio.loading import read
    from ckptio.saving import persist

    def plain(a: torch.Tensor, b: torch.Tensor) -> bool:
        return (a.device.type == b.device.type == "cpu" and a.dtype == b.dtype
                and a.is_contiguous() and b.is_contiguous())

    def copy_out(src: torch.Tensor, start: int, count: int, dst: torch.Tensor) -> None:
        pos = 0
        for block in buffers.element_blocks(src, start, count):
            n = block.numel()
            piece = dst[pos:pos + n]
            if plain(block, piece):
                ctypes.memmove(piece.data_ptr(), block.data_ptr(), n * block.element_size())
            else:
                piece.view(block.shape).copy_(block, non_blocking=block.is_cuda)
            pos += n

    def copy_in(src: torch.Tensor, dst: torch.Tensor, start: int, count: int) -> None:
        pos = 0
        for block in buffers.element_blocks(dst, start, count):
            n = block.numel()
            piece = src[pos:pos + n]
            if plain(block, piece):
                ctypes.memmove(block.data_ptr(), piece.data_ptr(), n * block.element_size())
            else:
                block.copy_(piece.view(block.shape))
            pos += n

    buffers.copy_out, buffers.copy_in = copy_out, copy_in
    persist.copy_out, read.copy_in = copy_out, copy_in


PATCHES: dict[str, tuple[Callable[[], None], str]] = {
    "memmove": (_patch_memmove, ("staging copies by ctypes.memmove instead of Tensor.copy_ "
                                 "(no OpenMP pool)")),
    "threads1": (lambda: torch.set_num_threads(1), "torch.set_num_threads(1) in the process"),
}
