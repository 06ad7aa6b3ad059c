"""io/buffers.copy_in: contiguous host blocks go by one memmove (no intra-op pool), everything else
by Tensor.copy_; both land the same bytes, and an in-place copy's version bump is kept."""

from __future__ import annotations

import torch

from ckptio.io.buffers import copy_in, typed
from ckptio.io.stage import StagingPool


def _staged(values: torch.Tensor) -> tuple[StagingPool, torch.Tensor]:
    pool = StagingPool(1, 1 << 20)
    buffer = pool.acquire()
    raw = values.reshape(-1).view(torch.uint8)
    buffer.data[:raw.numel()].copy_(raw)
    return pool, typed(buffer, 0, raw.numel(), values.dtype)


def test_contiguous_strided_and_parameter_destinations_get_exact_bytes():
    src = torch.randn(64, 32)
    pool, staged = _staged(src)
    whole = torch.zeros(64, 32)
    before = whole._version
    copy_in(staged, whole, 0, src.numel())
    assert torch.equal(whole, src) and whole._version > before  # the memmove path
    part = torch.zeros(64, 32)
    copy_in(staged[100:300], part, 100, 200)  # elements 100..299 of a contiguous tensor
    assert torch.equal(part.reshape(-1)[100:300], src.reshape(-1)[100:300])
    assert not part.reshape(-1)[:100].any() and not part.reshape(-1)[300:].any()
    strided = torch.zeros(32, 64).t()  # not contiguous: Tensor.copy_ block by block
    copy_in(staged, strided, 0, src.numel())
    assert torch.equal(strided, src)
    param = torch.nn.Parameter(torch.zeros(64, 32))
    with torch.no_grad():
        copy_in(staged, param, 0, src.numel())
    assert torch.equal(param.detach(), src) and param.requires_grad
    pool.release(pool._all[0])


def test_another_dtype_still_converts():
    src = torch.arange(1024, dtype=torch.float32)
    pool, staged = _staged(src)
    dest = torch.zeros(1024, dtype=torch.float64)
    copy_in(staged, dest, 0, 1024)
    assert torch.equal(dest, src.double())
    pool.release(pool._all[0])
