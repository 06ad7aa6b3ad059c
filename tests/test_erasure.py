"""The two-parity code of Parity(k, m=2) (redundancy/erasure.py): its field arithmetic against a
bit-by-bit reference, Q by Horner's scheme against the direct sum, and every one or two lost
pieces of a stripe solved back to their bytes, with pieces of uneven lengths."""

from __future__ import annotations

import itertools

import pytest
import torch

from ckptio.errors import CkptError
from ckptio.redundancy import erasure


def _slow_mul(a: int, b: int) -> int:
    out = 0
    while b:
        if b & 1:
            out ^= a
        a = (a << 1) ^ 0x11D if a & 0x80 else a << 1
        b >>= 1
    return out


def test_the_field_arithmetic_matches_a_bit_by_bit_reference():
    every = torch.arange(256, dtype=torch.uint8).repeat(2)  # 512 bytes: 64 words
    for c in (0, 1, 2, 3, 4, 0x80, 0x53, 0x1D, 0xFF):
        assert [erasure.mul(a, c) for a in range(256)] == [_slow_mul(a, c) for a in range(256)]
        scaled = every.clone()
        erasure.scale(scaled, c)
        assert scaled.tolist() == [_slow_mul(a, c) for a in every.tolist()], c
    assert len({erasure.power(h) for h in range(255)}) == 255  # g generates the field


def _stripe(n: int, size: int, seed: int) -> dict[int, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    lengths = [size, size - 3, 17, 0, size - 8]
    return {h: torch.randint(0, 256, (lengths[(h + seed) % len(lengths)],), dtype=torch.uint8,
                             generator=gen) for h in range(n)}


def _padded(data: torch.Tensor, size: int) -> torch.Tensor:
    out = torch.zeros(size, dtype=torch.uint8)
    out[:data.numel()] = data
    return out


@pytest.mark.parametrize("n", [2, 3, 5, 9])
def test_any_one_or_two_lost_pieces_of_a_stripe_are_solved(n):
    size = 64
    pieces = _stripe(n, size, n)
    p, q = torch.zeros(size, dtype=torch.uint8), torch.zeros(size, dtype=torch.uint8)
    horner = erasure.Horner(q)
    for h in reversed(range(n)):  # Q by Horner's scheme ...
        erasure.mul_into(p, pieces[h], 1)
        horner.add(h, pieces[h])
    horner.finish()
    direct = torch.zeros(size, dtype=torch.uint8)
    for h, data in pieces.items():  # ... equals the direct sum of g^h d_h
        erasure.mul_into(direct, data, erasure.power(h))
    assert torch.equal(q, direct)
    for lost in [*itertools.combinations(range(n), 1), *itertools.combinations(range(n), 2)]:
        present = {h: d for h, d in pieces.items() if h not in lost}
        for want in lost:
            expected = _padded(pieces[want], size)
            assert torch.equal(erasure.solve(size, p, q, present, list(lost), want), expected)
            if len(lost) == 1:  # P lost too (its holder gone): from Q; Q lost: from P
                assert torch.equal(erasure.solve(size, None, q, present, [want], want), expected)
                assert torch.equal(erasure.solve(size, p, None, present, [want], want), expected)


def test_a_stripe_beyond_its_parity_is_refused():
    size, pieces = 16, _stripe(4, 16, 1)
    p = torch.zeros(size, dtype=torch.uint8)
    with pytest.raises(CkptError, match=r"lost members \[0, 1\] and P kept, Q lost"):
        erasure.solve(size, p, None, {2: pieces[2], 3: pieces[3]}, [0, 1], 0)
    with pytest.raises(CkptError, match="cannot be rebuilt"):
        erasure.solve(size, p, p, {3: pieces[3]}, [0, 1, 2], 0)
