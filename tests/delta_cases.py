"""Per-rank bodies of the many-rank compressed and delta tests (tests/test_delta_ranks.py;
module-level: ranks are spawned and import them)."""

from __future__ import annotations

import json
import os
from typing import Any

import torch

import ckptio
from special_values import bits_equal, specials

OPTIONS = ckptio.Options(buffer_bytes=1 << 20, pool_bytes=4 << 20, compression="bytegroup+zstd")
ROWS, COLS = 600, 512  # bf16: 600 KiB, 3 frames of 256 KiB


def full(step: int) -> torch.Tensor:
    """The global weight at ``step``: every special pattern, then a few bytes changed per step."""
    t = specials(torch.bfloat16, (ROWS, COLS), seed=11)
    flat = t.reshape(-1).view(torch.uint8)
    flat[step::89] ^= 1 if step else 0
    return t


def own(rank: int, step: int) -> torch.Tensor:
    """A value of each rank's own (saved per rank), changed at step 2 on rank 1 only."""
    return specials(torch.float32, (5000,), seed=100 + rank + (step if rank == 1 else 0))


def state(rank: int, world: int, step: int) -> dict[str, Any]:
    cut = [0, 250, ROWS][: world + 1] if world == 2 else [0, ROWS]
    rows = slice(cut[rank], cut[rank + 1])
    return {"w": ckptio.TensorShard(full(step)[rows].clone(), (ROWS, COLS), (cut[rank], 0)),
            "frozen": specials(torch.float16, (700, 300), seed=5),  # the same on every rank
            "rng": own(rank, step), "step": step}


def save_steps(rank: int, world: int, root: str) -> dict[str, Any]:
    """step-1 self-contained and compressed, step-2 a delta of it; -> step-2's manifest body."""
    ck = ckptio.Checkpointer(OPTIONS)
    ck.save(state(rank, world, 1), os.path.join(root, "step-1"))
    ck.save(state(rank, world, 2), os.path.join(root, "step-2"), base=os.path.join(root, "step-1"))
    fresh = state(rank, world, 0)
    fresh["w"].local.zero_()
    fresh["rng"].zero_()
    fresh["frozen"].zero_()
    ck.load(os.path.join(root, "step-2"), fresh)
    want = state(rank, world, 2)
    for key in ("frozen", "rng"):
        assert bits_equal(fresh[key], want[key]), key
    assert bits_equal(fresh["w"].local, want["w"].local)
    with open(os.path.join(root, "step-2", "manifest.json")) as f:
        f.readline()
        return json.loads(f.readline())
