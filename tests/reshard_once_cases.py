"""Per-rank bodies of tests/test_reshard_read_once.py (module-level: run_ranks forks ranks that
import them). A state saved by one process is loaded onto more ranks as DTensor ``Shard(0)``
pieces whose cuts fall inside checksum blocks; each rank counts the bytes it asks its store's
files for (StoreFiles, the one way a load's reads reach storage; the same bytes read again
through the page cache by the same process count once: that host's cache serves them, wherever
the storage is) and checks its pieces bitwise."""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Any

import torch

import ckptio
from ckptio.storage.files import StoreFiles

# rows cut by 2, 3 and 4 ranks inside 1 MiB checksum blocks; several dtypes; one small tensor
SHAPES = {"w": ((1000, 1024), torch.float32), "m": ((1537, 700), torch.bfloat16),
          "ids": ((3001, 41), torch.int64), "flags": ((700, 3001), torch.bool),
          "tiny": ((9, 7), torch.float32)}


def options(**changes: Any) -> ckptio.Options:
    """A small pool (each rank would otherwise pre-fault 256 MiB) and short deadlines."""
    return dataclasses.replace(ckptio.Options(buffer_bytes=1 << 20, pool_bytes=4 << 20),
                               rank_timeout_s=10.0, **changes)


_counted = [0]


def _count_reads() -> None:
    """Count the bytes of every read this process submits to a store's files (bytes read
    through the page cache before, by this process, count once)."""
    single = StoreFiles.submit_read
    cached: dict[str, set[int]] = {}  # file -> the 4 KiB pages read through the cache

    def submit_read(self: StoreFiles, fh: Any, offset: int, into: memoryview) -> Any:
        if fh.direct:
            _counted[0] += len(into)
        else:
            pages = cached.setdefault(fh.path, set())
            for page in range(offset // 4096, -(-(offset + len(into)) // 4096)):
                if page not in pages:
                    pages.add(page)
                    _counted[0] += min(offset + len(into), (page + 1) * 4096) - max(
                        offset, page * 4096)
        return single(self, fh, offset, into)

    StoreFiles.submit_read = submit_read  # type: ignore[method-assign]


def full_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(67)
    out = {}
    for name, (shape, dtype) in SHAPES.items():
        if dtype == torch.bool:
            out[name] = torch.randint(0, 2, shape, generator=g).bool()
        elif dtype.is_floating_point:
            out[name] = torch.randn(shape, generator=g).to(dtype)
        else:
            out[name] = torch.randint(-1 << 40, 1 << 40, shape, generator=g, dtype=dtype)
    out["norm"] = torch.randn(333, generator=g)  # replicated: read once, sent (whole entry)
    return out


def save_one(path: str) -> None:
    """The state saved by one process (no process group)."""
    ckptio.save(full_state(), path, options=options())


def load_sharded(rank: int, world: int, path: str, broadcast: bool = True,
                 hosts: bool = True) -> dict[str, Any]:
    """Load onto ``world`` ranks (2+-dim tensors Shard(0), the 1-D one Replicate), each playing
    a host of its own (``hosts``; else all on this one) -> the bytes this rank read, its
    warnings, and whether every local piece is the saved one's."""
    if hosts:
        os.environ["CKPTIO_HOST_ID"] = f"host{rank}"
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    _count_reads()
    mesh = init_device_mesh("cpu", (world,))
    full = full_state()
    into = {k: distribute_tensor(torch.zeros_like(v), mesh,
                                 [Shard(0) if v.dim() > 1 else Replicate()])
            for k, v in full.items()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ckptio.load(path, into, options=options(broadcast_replicated=broadcast))
    equal = all(torch.equal(into[k].to_local().view(torch.uint8),
                            distribute_tensor(v, mesh, [Shard(0) if v.dim() > 1 else Replicate()])
                            .to_local().view(torch.uint8))
                for k, v in full.items())
    return {"read": _counted[0], "equal": equal, "warnings": [str(w.message) for w in caught]}


def load_reading_during_exchange(rank: int, world: int, path: str) -> dict[str, Any]:
    """load_sharded (each rank a host of its own), with this rank's first exchange (the shared
    checksum blocks') held until this rank submits a read from storage, for up to 3 s -> also
    whether one came: a read submitted after this rank's own blocks were read and before that
    exchange returned (reads go on while the blocks are exchanged; before, they followed it)."""
    import threading

    from ckptio.distributed import readshare, sendreads

    blocks_read, exchanged, read = threading.Event(), threading.Event(), threading.Event()
    calls: list[bool] = []
    exchange, submit = sendreads.exchange, StoreFiles.submit_read
    read_done = readshare.SharedReads._read_done

    def submit_read(self: StoreFiles, fh: Any, offset: int, into: memoryview) -> Any:
        if blocks_read.is_set() and not exchanged.is_set():
            read.set()
        return submit(self, fh, offset, into)

    def done(self: Any, *args: Any, **kwargs: Any) -> Any:
        blocks_read.set()  # the first: this rank's own shared blocks are read
        return read_done(self, *args, **kwargs)

    def held(*args: Any, **kwargs: Any) -> Any:
        if calls:
            return exchange(*args, **kwargs)
        calls.append(read.wait(3.0))
        try:
            return exchange(*args, **kwargs)
        finally:
            exchanged.set()

    StoreFiles.submit_read = submit_read  # type: ignore[method-assign]
    readshare.SharedReads._read_done = done  # type: ignore[method-assign]
    sendreads.exchange = held  # type: ignore[assignment]
    return {**load_sharded(rank, world, path), "read_during_exchange": calls[:1] == [True]}


def load_flipped(rank: int, world: int, path: str) -> dict[str, Any]:
    """load_sharded with every message rank 1 sends damaged (its first byte flipped) -> also
    the error this rank's load raised: (type, message) or None."""
    if rank == 1:
        damage_every_send()
    try:
        return {**load_sharded(rank, world, path), "error": None}
    except ckptio.CkptError as exc:
        return {"error": (type(exc).__name__, str(exc))}


def count_boxes(rank: int, world: int, path: str, n: int) -> dict[str, Any]:
    """Load ``n`` same-shaped tensors (saved by save_alike) onto ``world`` ranks as Shard(0)
    DTensors -> how often torch's DTensor box arithmetic ran during the load, and whether every
    local piece is the saved one's."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor import _utils

    mesh = init_device_mesh("cpu", (world,))
    full = alike(n)
    into = {k: distribute_tensor(torch.zeros_like(v), mesh, [Shard(0)]) for k, v in full.items()}
    calls = [0]
    compute = _utils.compute_local_shape_and_global_offset

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return compute(*args, **kwargs)

    _utils.compute_local_shape_and_global_offset = counted  # type: ignore[assignment]
    ckptio.load(path, into, options=options())
    _utils.compute_local_shape_and_global_offset = compute  # type: ignore[assignment]
    equal = all(torch.equal(into[k].to_local(), distribute_tensor(v, mesh, [Shard(0)]).to_local())
                for k, v in full.items())
    return {"calls": calls[0], "equal": equal}


def alike(n: int) -> dict[str, torch.Tensor]:
    """``n`` tensors of one shape (a model's repeated layers)."""
    g = torch.Generator().manual_seed(7)
    return {f"layer{i}.w": torch.randn((64, 48), generator=g) for i in range(n)}


def save_alike(path: str, n: int) -> None:
    ckptio.save(alike(n), path, options=options())


def damage_every_send() -> None:
    """From now on, every read-share message this process sends has its first byte flipped."""
    from ckptio.distributed import sendreads

    build = sendreads._send_buffer

    def flipped(sources: Any, pieces: Any) -> torch.Tensor:
        out = build(sources, pieces).clone()
        out[0] ^= 0xFF
        return out

    sendreads._send_buffer = flipped  # type: ignore[assignment]
