"""Tensors of every bit pattern, and bit-exact comparison (shared by the single-process round
trips and the many-rank cases, whose ranks import this module by name).

``rand`` fills a tensor with random bytes: NaNs, infinities, subnormals appear as often as the
dtype's bit patterns make them (all 256 of a float8, say). ``specials`` adds, first in row-major
order, the patterns a conversion or an arithmetic copy would lose: NaN payloads (quiet,
signalling, negative), -0.0, both infinities, the smallest and largest subnormal.
"""

from __future__ import annotations

import math

import torch

__all__ = ["SPECIAL_BITS", "assert_same_bits", "bits_equal", "rand", "raw", "specials"]

# per floating dtype: (its width in bytes, patterns); complex dtypes use their parts' float's
SPECIAL_BITS: dict[torch.dtype, tuple[int, list[int]]] = {
    torch.float64: (8, [0x7FF8000000000001, 0xFFF8000000000000, 0x7FF0000000000001,
                        0x8000000000000000, 0x7FF0000000000000, 0xFFF0000000000000,
                        0x0000000000000001, 0x000FFFFFFFFFFFFF]),
    torch.float32: (4, [0x7FC00001, 0xFFC00000, 0x7F800001, 0x80000000, 0x7F800000,
                        0xFF800000, 0x00000001, 0x007FFFFF]),
    torch.float16: (2, [0x7E01, 0xFE00, 0x7C01, 0x8000, 0x7C00, 0xFC00, 0x0001, 0x03FF]),
    torch.bfloat16: (2, [0x7FC1, 0xFFC0, 0x7F81, 0x8000, 0x7F80, 0xFF80, 0x0001, 0x007F]),
    torch.float8_e4m3fn: (1, [0x7F, 0xFF, 0x80, 0x01, 0x07]),  # no infinities in e4m3fn
    torch.float8_e5m2: (1, [0x7F, 0xFD, 0x7D, 0x80, 0x7C, 0xFC, 0x01, 0x03]),
}
_PARTS = {torch.complex64: torch.float32, torch.complex128: torch.float64}


def rand(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Random bit patterns of ``dtype`` (NaNs, infinities, -0.0 and subnormals included)."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).view(dtype).reshape(shape)


def specials(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """``rand``, with SPECIAL_BITS written over its first elements (as many as fit)."""
    out = rand(dtype, shape, seed)
    width, patterns = SPECIAL_BITS.get(_PARTS.get(dtype, dtype), (0, []))
    if not patterns:
        return out
    pattern_bytes = b"".join(p.to_bytes(width, "little") for p in patterns)
    flat = out.reshape(-1).view(torch.uint8)
    n = min(len(pattern_bytes), flat.numel())
    flat[:n] = torch.frombuffer(bytearray(pattern_bytes[:n]), dtype=torch.uint8)
    return out


def raw(t: torch.Tensor) -> torch.Tensor:
    """Row-major element bytes (a dense copy: .contiguous() may keep odd size-1 strides)."""
    return torch.empty(tuple(t.shape), dtype=t.dtype).copy_(t.detach()).reshape(-1).view(torch.uint8)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(raw(a), raw(b))


def assert_same_bits(got: object, want: object, where: str = "") -> None:
    """Equal values of equal types: tensors and numpy arrays bit for bit, floats by their hex,
    containers element by element (for the reader scripts that run without ckptio)."""
    import numpy

    assert type(got) is type(want), (where, type(got), type(want))
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and bits_equal(got, want), where
    elif isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want), (where, list(got), list(want))
        for k in want:
            assert_same_bits(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, (list, tuple)):
        assert isinstance(got, (list, tuple)) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same_bits(g, w, f"{where}.{i}")
    elif isinstance(want, numpy.ndarray):
        assert isinstance(got, numpy.ndarray), where
        assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), where
    elif isinstance(want, float):
        assert isinstance(got, float) and got.hex() == want.hex() and str(got) == str(want), \
            (where, got, want)
    else:
        assert got == want, (where, got, want)
