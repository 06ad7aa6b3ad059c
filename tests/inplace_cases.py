"""Rank bodies for tests/test_inplace.py (importable by name for the forkserver launcher)."""

from __future__ import annotations

from typing import Any

import torch

import ckptio


def distinct_keys(rank: int, world: int, path: str) -> dict[str, Any]:
    """Ranks hold different keys (per-rank names, pipeline-stage layers): a strict in-place load
    on each rank must not call the other ranks' keys unexpected."""
    torch.manual_seed(rank)
    state = {"shared": torch.arange(4.0), f"extra.rank{rank}.value": torch.randn(3),
             f"stage{rank}": {"w": torch.full((2,), float(rank))}}
    ckptio.save(state, path)
    target = {"shared": torch.zeros(4), f"extra.rank{rank}.value": torch.zeros(3),
              f"stage{rank}": {"w": torch.zeros(2)}}
    report = ckptio.load(path, target)
    same = all(torch.equal(target[k], state[k]) for k in ("shared", f"extra.rank{rank}.value"))
    return {"same": same and torch.equal(target[f"stage{rank}"]["w"], state[f"stage{rank}"]["w"]),
            "unexpected": list(report.unexpected)}


def nobody_asks(rank: int, world: int, path: str) -> str:
    """A key no rank asks for is still unexpected, on every rank."""
    ckptio.save({"a": torch.ones(2), "orphan": torch.ones(1)}, path)
    try:
        ckptio.load(path, {"a": torch.zeros(2)})
    except ckptio.StateMismatchError as exc:
        return "orphan" in str(exc) and "StateMismatchError" or str(exc)
    return "no error"
