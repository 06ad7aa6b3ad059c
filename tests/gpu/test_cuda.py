"""CUDA paths: device tensors saved and loaded back in place on the device. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

import ckptio

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _state(device: str) -> dict:
    g = torch.Generator(device="cpu").manual_seed(0)
    return {
        "w": torch.randn(1024, 513, generator=g).to(device),
        "wt": torch.randn(300, 700, generator=g).to(device).t(),  # non-contiguous on device
        "h": torch.randn(4096, generator=g).to(device, torch.bfloat16),
        "step": 3,
    }


def test_cuda_tensors_round_trip_fresh_and_in_place(tmp_path):
    options = ckptio.Options(buffer_bytes=1 << 20, pool_bytes=4 << 20)
    src = _state("cuda")
    ckptio.save(src, tmp_path / "c", options=options)
    fresh = ckptio.load(tmp_path / "c", options=options)
    for key in ("w", "wt", "h"):
        assert fresh[key].device.type == "cpu"
        assert torch.equal(fresh[key], src[key].cpu())
    dest = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0) for k, v in src.items()}
    ckptio.load(tmp_path / "c", dest, options=options)
    for key in ("w", "wt", "h"):
        assert dest[key].device.type == "cuda"
        assert torch.equal(dest[key], src[key])
    assert dest["step"] == 3
