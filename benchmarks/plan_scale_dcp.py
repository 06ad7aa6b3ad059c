"""DCP's planner on plan_scale's simulated layout: the same phases as ckptio's, run with DCP's own
functions (plain Python; no processes, no I/O), for the side-by-side curve.

Owns: the SavePlans DCP's ranks would make for that layout (one WriteItem per chunk, with its
ChunkStorageMetadata, as create_default_local_save_plan makes them from DTensors; each rank's
RNG state under a key of its own, since DCP has no per-rank values) and the timing of:
  local     one rank's WriteItems (DCP builds them from the DTensors; here from the regions)
  decide    DefaultSavePlanner.create_global_plan on every rank's plan (dedup_save_plans,
            create_default_global_save_plan, the overlap/coverage validation) + finish_plan
  result    one rank's WriteResults (index, size, _StorageInfo of file, offset, length)
  manifest  the coordinator's FileSystemWriter.finish without the file: every rank's results
            merged into Metadata.storage_data, then pickled (the .metadata file's bytes)
  load      pickle.loads of those bytes: what every loading rank does before planning its reads
Does not own: the layout (plan_model.py) or the report.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult

from benchmarks.plan_model import ITEMSIZE, Tensor, median_time, region

__all__ = ["measure_dcp", "saved_metadata"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def rank_items(rank: int, dp: int, tp: int, tensors: list[Tensor], dtype: str) -> list[WriteItem]:
    dp_rank, tp_rank = divmod(rank, tp)
    props = TensorProperties(dtype=_DTYPES[dtype])
    items = []
    for t in tensors:
        c = region(t, dp, tp, dp_rank, tp_rank)
        items.append(WriteItem(
            index=MetadataIndex(t.key, torch.Size(c.offsets)), type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(offsets=torch.Size(c.offsets), sizes=torch.Size(c.sizes)),
                properties=props, size=torch.Size(t.shape))))
    rng = (5056,)
    items.append(WriteItem(
        index=MetadataIndex(f"rng.{rank}", torch.Size((0,))), type=WriteItemType.TENSOR,
        tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(torch.Size((0,)), torch.Size(rng)),
                                    properties=TensorProperties(dtype=torch.uint8),
                                    size=torch.Size(rng))))
    return items


def results_of(rank: int, plan: SavePlan, dtype: str) -> list[WriteResult]:
    """What FileSystemWriter.write_data reports: each item's place in this rank's one file."""
    out, offset = [], 0
    for item in plan.items:
        data = item.tensor_data
        assert data is not None
        nbytes = data.chunk.sizes.numel() * (1 if data.properties.dtype == torch.uint8
                                             else ITEMSIZE[dtype])
        out.append(WriteResult(index=item.index, size_in_bytes=nbytes,
                               storage_data=_StorageInfo(f"__{rank}_0.distcp", offset, nbytes)))
        offset += nbytes
    return out


def saved_metadata(world: int, tp: int, tensors: list[Tensor], dtype: str) -> bytes:
    """The pickled .metadata of a (world / tp, tp) save of ``tensors`` (untimed: for a load)."""
    dp = world // tp
    plans = [SavePlan(rank_items(r, dp, tp, tensors, dtype)) for r in range(world)]
    global_plans, metadata = DefaultSavePlanner(flatten_state_dict=False).create_global_plan(plans)
    metadata.storage_data = {wr.index: wr.storage_data for r, plan in enumerate(global_plans)
                             for wr in results_of(r, plan, dtype)}
    return pickle.dumps(metadata, protocol=pickle.DEFAULT_PROTOCOL)


def measure_dcp(world: int, tp: int, tensors: list[Tensor], dtype: str, reps: int) -> dict[str, Any]:
    dp = world // tp
    plans = [SavePlan(rank_items(r, dp, tp, tensors, dtype)) for r in range(world)]
    local_s, _ = median_time(lambda: rank_items(0, dp, tp, tensors, dtype), reps)

    def decide() -> tuple[list[SavePlan], Any]:
        planner = DefaultSavePlanner(flatten_state_dict=False)
        global_plans, metadata = planner.create_global_plan(list(plans))
        planner.finish_plan(global_plans[0])
        return global_plans, metadata

    decide_s, (global_plans, metadata) = median_time(decide, reps)
    results = [results_of(r, p, dtype) for r, p in enumerate(global_plans)]
    result_s, _ = median_time(lambda: results_of(0, global_plans[0], dtype), reps)

    def finish() -> bytes:
        storage_md = {}
        for wr_list in results:
            storage_md.update({wr.index: wr.storage_data for wr in wr_list})
        metadata.storage_data = storage_md
        return pickle.dumps(metadata, protocol=pickle.DEFAULT_PROTOCOL)

    manifest_s, blob = median_time(finish, reps)
    load_s, loaded = median_time(lambda: pickle.loads(blob), reps)
    chunks = len(loaded.storage_data)
    return {"world": world, "dp": dp, "tp": tp, "tensors": len(tensors), "chunks": chunks,
            "manifest_bytes": len(blob), "bytes_per_chunk": len(blob) / chunks,
            "local_s": local_s, "decide_s": decide_s, "result_s": result_s,
            "manifest_s": manifest_s, "load_s": load_s,
            "save_total_s": local_s + decide_s + result_s + manifest_s}
