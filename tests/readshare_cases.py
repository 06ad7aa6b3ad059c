"""Per-rank bodies of tests/test_read_once.py (module-level: run_ranks forks ranks that import
them). Each rank counts the data bytes it reads through its store's files (StoreFiles, the one
way a load's reads reach storage), loads a replicated state in place, and returns what it
read, what it raised, the warnings it got and whether its tensors are the saved ones."""

from __future__ import annotations

import dataclasses
import os
import time
import warnings
from typing import Any

import torch

import ckptio
from ckptio.distributed import sendreads
from ckptio.testing.readcount import count_store_reads

WORLD = 3
DEADLINE_S = 3.0  # Options.rank_timeout_s of the fault cases


def options(**changes: Any) -> ckptio.Options:
    """A small pool (each rank would otherwise pre-fault 256 MiB) and short deadlines."""
    return dataclasses.replace(ckptio.Options(buffer_bytes=1 << 20, pool_bytes=4 << 20),
                               rank_timeout_s=DEADLINE_S, step_timeout_s=120.0, **changes)


def state(rank: int, zeros: bool = False) -> dict[str, Any]:
    """The same tensors on every rank (a few large, many small, several dtypes), and one
    tensor of this rank's own."""
    g = torch.Generator().manual_seed(7)
    out: dict[str, Any] = {
        "big": torch.randn(512, 1024, generator=g),  # 2 MiB
        "mid": torch.randn(1000, 300, generator=g).to(torch.bfloat16),
        "ids": torch.randint(0, 1 << 40, (70000,), generator=g),
        "norm": {f"n{i}": torch.randn(33 + i, generator=g) for i in range(12)},
        "flag": torch.tensor([True, False, True]),
        f"own{rank}": torch.full((5000,), float(rank)),
    }
    if zeros:
        out = _zeroed(out)
    return out


def _zeroed(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _zeroed(v) for k, v in value.items()}
    return torch.zeros_like(value)


def _equal(a: Any, b: Any) -> bool:
    """Bitwise equal, tree and dtypes too."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def save(rank: int, world: int, path: str) -> None:
    ckptio.save(state(rank), path, options=options())


def save_dcp(rank: int, world: int, path: str) -> None:
    """The replicated part of the state, written by torch.distributed.checkpoint (DCP)."""
    import torch.distributed.checkpoint as dcp

    dcp.save(replicated(rank), checkpoint_id=path)


def replicated(rank: int, zeros: bool = False) -> dict[str, Any]:
    """state() without the rank's own tensor: what every rank holds alike."""
    return {k: v for k, v in state(rank, zeros).items() if not k.startswith("own")}


def _flip_sent_bytes() -> None:
    """This rank sends every message with its first byte flipped (its own tensors intact)."""
    build = sendreads._send_buffer

    def flipped(sources: Any, pieces: Any) -> torch.Tensor:
        out = build(sources, pieces).clone()
        out[0] ^= 0xFF
        return out

    sendreads._send_buffer = flipped


def _die_sending(mark: str) -> None:
    """This rank exits as it is about to send its first message (its peers already wait)."""
    def die(sources: Any, pieces: Any) -> torch.Tensor:
        with open(mark, "w") as f:
            f.write(repr(time.time()))
        os._exit(1)

    sendreads._send_buffer = die


def load(rank: int, world: int, path: str, fault: str = "", victim: int = 1,
         mark: str = "", broadcast: bool = True, shared_only: bool = False) -> dict[str, Any]:
    """Load the saved state in place (``broadcast``: Options.broadcast_replicated) ->
    {"read": bytes read from storage, "error": (type, message) or None, "warnings": [...],
    "equal": the state equals the saved one, "ended": when}. ``shared_only``: only the
    replicated tensors (a DCP directory's state, save_dcp)."""
    store_reads = count_store_reads()
    if rank == victim and fault == "flip":
        _flip_sent_bytes()
    if rank == victim and fault == "die":
        _die_sending(mark)
    made = replicated if shared_only else state
    into = made(rank, zeros=True)
    error = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            ckptio.load(path, into, options=options(broadcast_replicated=broadcast))
        except ckptio.CkptError as exc:
            error = (type(exc).__name__, str(exc))
    return {"read": store_reads(), "error": error, "warnings": [str(w.message) for w in caught],
            "equal": _equal(into, made(rank)), "ended": time.time()}
