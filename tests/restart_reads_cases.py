"""Per-rank bodies of tests/test_restart_reads.py (module-level: run_ranks forks ranks that
import them). Two ranks save a model-like state, each layer a large weight (Shard(0) DTensor)
beside a small replicated bias and norm, and load it back in place in fresh processes with the
defaults; each rank counts the read requests it submits to its store's files and their bytes."""

from __future__ import annotations

from typing import Any

import torch

import ckptio
from ckptio.storage.files import StoreFiles

LAYERS = 12
ROWS, COLS = 1024, 512  # a 2 MiB weight: each rank's half is larger than a read's gap (512 KiB)


def _full() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(67)
    out = {}
    for i in range(LAYERS):
        out[f"l{i}.w"] = torch.randn(ROWS, COLS, generator=g)
        out[f"l{i}.b"] = torch.randn(COLS, generator=g)
        out[f"l{i}.norm"] = torch.randn(COLS, generator=g)
    return out


def _state(world: int, zeros: bool = False) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    out: dict[str, Any] = {}
    for key, value in _full().items():
        value = torch.zeros_like(value) if zeros else value
        out[key] = distribute_tensor(value, mesh, [Shard(0)]) if value.dim() > 1 else value
    return out


def save(rank: int, world: int, path: str) -> None:
    ckptio.save(_state(world), path)


def load(rank: int, world: int, path: str) -> dict[str, Any]:
    """Load in place -> {"requests", "read": bytes, "equal"}: this rank's reads of data files."""
    counted = {"requests": 0, "read": 0}
    submit = StoreFiles.submit_read

    def submit_read(self: StoreFiles, fh: Any, offset: int, into: memoryview) -> Any:
        if "data-" in str(fh.path):
            counted["requests"] += 1
            counted["read"] += len(into)
        return submit(self, fh, offset, into)

    StoreFiles.submit_read = submit_read  # type: ignore[method-assign]
    into = _state(world, zeros=True)
    ckptio.load(path, into)
    expected = _state(world)
    equal = all(torch.equal(_local(into[k]).view(torch.uint8), _local(v).view(torch.uint8))
                for k, v in expected.items())
    return {**counted, "equal": equal}


def _local(t: Any) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def load_error(rank: int, world: int, path: str) -> tuple[str, str] | None:
    """Load in place -> the error the load raised on this rank: (type, message) or None."""
    try:
        ckptio.load(path, _state(world, zeros=True))
    except ckptio.CkptError as exc:
        return type(exc).__name__, str(exc)
    return None
