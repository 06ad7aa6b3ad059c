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


def load_opens(rank: int, world: int, path: str, share: bool = True) -> dict[str, Any]:
    """Load in place (Options.broadcast_replicated=``share``) -> this rank's reads of the
    manifest, its checks of the data files' sizes, the index files it opened, and "equal"."""
    from ckptio.storage.local.local_store import LocalStore

    counted: dict[str, Any] = {"manifest": 0, "sizes": 0, "index": []}
    read_manifest, sizes, open_read = LocalStore.read_manifest, LocalStore.sizes, StoreFiles.open_read

    def counted_manifest(self: LocalStore) -> bytes:
        counted["manifest"] += 1
        return read_manifest(self)

    def counted_sizes(self: LocalStore, names: Any) -> dict[str, int]:
        counted["sizes"] += 1
        return sizes(self, names)

    def counted_open(self: StoreFiles, name: str, **kw: Any) -> Any:
        if name.endswith("-index.bin"):
            counted["index"].append(name)
        return open_read(self, name, **kw)

    LocalStore.read_manifest = counted_manifest  # type: ignore[method-assign]
    LocalStore.sizes = counted_sizes  # type: ignore[method-assign]
    StoreFiles.open_read = counted_open  # type: ignore[method-assign]
    into = _state(world, zeros=True)
    ckptio.Checkpointer(ckptio.Options(broadcast_replicated=share)).load(path, into)
    expected = _state(world)
    equal = all(torch.equal(_local(into[k]).view(torch.uint8), _local(v).view(torch.uint8))
                for k, v in expected.items())
    return {**counted, "equal": equal}


def load_missing(rank: int, world: int, path: str) -> str | None:
    """Load in place from a location with no checkpoint -> the error's type on this rank."""
    try:
        ckptio.load(path, _state(world, zeros=True))
    except ckptio.CkptError as exc:
        return type(exc).__name__
    return None


def load_one_other_path(rank: int, world: int, path: str, other: str) -> str | None:
    """Rank 0 loads the checkpoint at ``path``, rank 1 ``other``, a file that is no checkpoint
    (its load opens a file: no manifest step of its own, then fails), both with a group
    timeout longer than the run's -> the error's type on this rank."""
    options = ckptio.Options(rank_timeout_s=600)
    try:
        ckptio.Checkpointer(options).load(path if rank == 0 else other, _state(world, zeros=True))
    except ckptio.CkptError as exc:
        return type(exc).__name__
    return None
