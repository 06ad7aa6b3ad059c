"""The engines of the interop benchmark: what each one times, on which input, and its check.

Owns: one function per engine, ``run(inputs, out) -> Done``, for the three comparisons of
docs/BENCH_INTEROP.md: Hugging Face export (ckptio.export_hf against DCP's
``dcp_to_torch_save`` and ``consolidate_safetensors_files``), the cold load of an existing DCP
checkpoint (ckptio.load and dcp.load through ckptio.DcpReader against dcp.load with
FileSystemReader) and ``dcp.save`` (through ckptio.DcpWriter against FileSystemWriter at
1-8 threads). "Durable" means fsynced inside the clock for every engine: the ones that do not
fsync get os.sync() inside it. The worker silences warnings (DCP warns when no
process group exists). Does not own: the protocol (interop.py), the state
(ckptio.tuning.state), the ceiling (benchmarks.save_load's ceiling worker).
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import xxhash

from ckptio.format.safetensors import FROM_SAFETENSORS
from ckptio.format.types import DTYPE_ITEMSIZE

__all__ = [
    "ENGINES",
    "EXPORT",
    "LOAD",
    "SAVE",
    "Engine",
    "Inputs",
    "tensor_digests",
    "unavailable_reason",
]

EXPORT, LOAD, SAVE = "export", "load", "save"
MAX_SHARD = 5 * 10**9  # HF's default shard size, for every export engine


@dataclass(frozen=True)
class Inputs:
    """What setup wrote once (untimed) under the scratch directory."""
    ckptio_full: Path  # ckptio.save of the whole training state
    dcp_full: Path  # dcp.save (FileSystemWriter, 1 thread) of the whole training state
    dcp_model: Path  # dcp.save of {"model": model weights}: dcp_to_torch_save's fair input
    hf_sharded: Path  # HuggingFaceStorageWriter(save_distributed=True) of the model weights


@dataclass(frozen=True)
class Engine:
    name: str
    part: str  # EXPORT, LOAD or SAVE
    note: str
    needs: tuple[str, ...] = ()  # attributes of ckptio, or modules, it cannot run without


def tensor_digests(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """xxh3 of dtype, shape and raw bytes per key: the bitwise check of an export."""
    out = {}
    for key, t in tensors.items():
        h = xxhash.xxh3_64(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(memoryview(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()))
        out[key] = h.hexdigest()
    return out


# ---------------------------------------------------------------- export


def export_ckptio(inputs: Inputs, out: Path) -> None:
    ckptio = importlib.import_module("ckptio")
    ckptio.export_hf(str(inputs.ckptio_full), str(out), keys="model.", max_shard_bytes=MAX_SHARD)


def export_dcp_to_torch_save(inputs: Inputs, out: Path) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out.mkdir(parents=True)
    dcp_to_torch_save(str(inputs.dcp_model), str(out / "model.pt"))
    os.sync()  # torch.save does not fsync


def export_consolidate(threads: int) -> Callable[[Inputs, Path], None]:
    def run(inputs: Inputs, out: Path) -> None:
        from safetensors import safe_open
        from torch.distributed.checkpoint._consolidate_hf_safetensors import (
            consolidate_safetensors_files,
        )

        mapping = _shards_by_size(inputs.hf_sharded, safe_open)
        out.mkdir(parents=True)
        consolidate_safetensors_files(str(inputs.hf_sharded), str(out), mapping, threads)
        os.sync()  # consolidation writes through the page cache and never fsyncs
    return run


def _shards_by_size(sharded: Path, safe_open: Any) -> dict[str, int]:
    """fqn -> output file index (1-based), greedy by MAX_SHARD, as HF's save_pretrained does."""
    mapping: dict[str, int] = {}
    index, used = 1, 0
    for file in sorted(sharded.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is no mapping)
                s = f.get_slice(key)
                nbytes = math.prod(s.get_shape()) * DTYPE_ITEMSIZE[FROM_SAFETENSORS[s.get_dtype()]]
                if used and used + nbytes > MAX_SHARD:
                    index, used = index + 1, 0
                mapping[key], used = index, used + nbytes
    return mapping


# ---------------------------------------------------------------- load of a DCP checkpoint


def load_ckptio(inputs: Inputs, dest: Any) -> object:
    ckptio = importlib.import_module("ckptio")
    return ckptio.load(str(inputs.dcp_full), dest)


def load_dcp(inputs: Inputs, dest: Any) -> object:
    import torch.distributed.checkpoint as dcp

    dcp.load(dest, storage_reader=dcp.FileSystemReader(str(inputs.dcp_full)), no_dist=True)
    return None


def load_dcp_ckptio_reader(inputs: Inputs, dest: Any) -> object:
    import torch.distributed.checkpoint as dcp

    ckptio = importlib.import_module("ckptio")
    dcp.load(dest, storage_reader=ckptio.DcpReader(str(inputs.dcp_full)), no_dist=True)
    return None


# ---------------------------------------------------------------- dcp.save


def save_filesystem(threads: int) -> Callable[[Any, Path], None]:
    def run(state: Any, path: Path) -> None:
        import torch.distributed.checkpoint as dcp

        writer = dcp.FileSystemWriter(str(path), thread_count=threads, sync_files=True)
        dcp.save(state, storage_writer=writer, no_dist=True)
        os.sync()  # .metadata's rename and the directory: sync_files fsyncs only the files
    return run


def save_ckptio_writer(state: Any, path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    ckptio = importlib.import_module("ckptio")
    dcp.save(state, storage_writer=ckptio.DcpWriter(str(path)), no_dist=True)


# ---------------------------------------------------------------- registry

RUNNERS: dict[str, Callable[..., Any]] = {
    "ckptio_export": export_ckptio,
    "dcp_to_torch_save": export_dcp_to_torch_save,
    **{f"consolidate_t{k}": export_consolidate(k) for k in (1, 2, 4)},
    "ckptio_load": load_ckptio,
    "dcp_load": load_dcp,
    "dcp_load_ckptio_reader": load_dcp_ckptio_reader,
    **{f"dcp_save_t{k}": save_filesystem(k) for k in (1, 2, 4, 8)},
    "dcp_save_ckptio_writer": save_ckptio_writer,
}

ENGINES: dict[str, Engine] = {e.name: e for e in (
    Engine("ckptio_export", EXPORT, "ckptio.export_hf(full training checkpoint, keys='model.'), "
           "fsynced; HF layout, 5 GB shards", ("export_hf",)),
    Engine("dcp_to_torch_save", EXPORT, "DCP's format_utils.dcp_to_torch_save of a model-only DCP "
           "dir (one torch.save file; DCP offers no filter) + os.sync()"),
    *[Engine(f"consolidate_t{k}", EXPORT, f"DCP's consolidate_safetensors_files(num_threads={k}) "
             "of HuggingFaceStorageWriter(save_distributed=True) output + os.sync()",
             ("safetensors",)) for k in (1, 2, 4)],
    Engine("ckptio_load", LOAD, "ckptio.load(DCP dir, state) in place"),
    Engine("dcp_load", LOAD, "dcp.load(state, FileSystemReader) in place, no process group"),
    Engine("dcp_load_ckptio_reader", LOAD, "dcp.load(state, ckptio.DcpReader) in place",
           ("DcpReader",)),
    *[Engine(f"dcp_save_t{k}", SAVE, f"dcp.save, FileSystemWriter(thread_count={k}, "
             "sync_files=True), then os.sync()") for k in (1, 2, 4, 8)],
    Engine("dcp_save_ckptio_writer", SAVE, "dcp.save(storage_writer=ckptio.DcpWriter): durable and "
           "committed when it returns", ("DcpWriter",)),
)}


def unavailable_reason(name: str) -> str | None:
    if name not in ENGINES:
        return f"unknown engine {name!r}; known: {', '.join(ENGINES)}"
    ckptio = importlib.import_module("ckptio")
    for need in ENGINES[name].needs:
        if need[0].isupper() or need == "export_hf":
            if getattr(ckptio, need, None) is None:
                return f"this ckptio has no {need}"
        elif importlib.util.find_spec(need) is None:
            return f"{need} is not installed (pip install 'ckptio[bench]')"
    return None
