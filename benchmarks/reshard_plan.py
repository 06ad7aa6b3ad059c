"""A resharded load's planning at scale: one loading rank of a (dp', tp) job planning its reads of
a checkpoint saved by a (dp, tp) job (plan_scale.py's simulated Llama-like layout, FSDP2 Shard(0)
over dp and Shard(0) / Shard(1) / Replicate over tp), beside DCP's load planner on the same
layout. No processes, no data I/O: the planning a rank does before its first data read.

Phases timed (median of --reps): ``decode_s``, the saved manifest's decode (once per loading
rank), and ``rank<N>_plan_s``, what each of --ranks of the loading layout plans after it:
  ckptio   manifest.decode of the saved manifest; resolve_regular.expand of the rank's wanted
           regions (the chunks they overlap, from the grids; the writers' index files decoded
           and checked, from memory), and span_plan.plan_spans of one Read per tensor (the pieces
           each wanted region takes from each chunk, widened to checksum blocks: the plan the
           load's reads follow). Key matching (loading/fill.py) is not included.
  dcp      pickle.loads of DCP's .metadata (the same save as plan_scale_dcp.py builds);
           create_read_items_for_chunk_list for each tensor's local chunk: what
           DefaultLoadPlanner.create_local_plan does per DTensor (pytorch/pytorch#169113: it
           scans every stored chunk of the tensor for each local chunk); plus, once, its
           create_global_plan over every loading rank's plan.

    python -m benchmarks.reshard_plan --save-world 1024 --load-world 768 --tensors 120 --reps 3 \
        --json docs/results/reshard_plan.json
Owns nothing the package uses; the layout is plan_scale.py's.
"""

from __future__ import annotations

import argparse
import json
import pickle
import sys
from pathlib import Path
from typing import Any

from benchmarks.plan_scale import (
    ITEMSIZE,
    BLOCK_NBYTES,
    Tensor,
    rank_report,
    median_time,
    messages_of,
    model_tensors,
    peak_rss_mib,
    regular_of,
    region,
    tree_of,
)
from ckptio.distributed import collective, wire
from ckptio.distributed.dist import Solo
from ckptio.format import manifest
from ckptio.format.types import Chunk, Manifest, Read, RegularTensor
from ckptio.loading.span_plan import plan_spans
from ckptio.loading.resolve_regular import expand, overlapping
from ckptio.planning.regular_items import Regular

BUFFER_BYTES = 64 << 20  # Options().buffer_bytes's order: the spans' size limit


def wants_of(tensors: list[Tensor], dp: int, tp: int, rank: int) -> dict[str, Chunk]:
    """The region of every tensor that rank ``rank`` of a (dp, tp) job holds."""
    dp_rank, tp_rank = divmod(rank, tp)
    return {t.key: region(t, dp, tp, dp_rank, tp_rank) for t in tensors}


def saved(world: int, tp: int, tensors: list[Tensor], dtype: str,
          wants: list[dict[str, Chunk]]) -> tuple[bytes, dict[str, bytes], Regular]:
    """The manifest of a (world / tp, tp) save and the index files of every writer whose chunks
    one of ``wants`` overlaps (plan_scale's simulated save)."""
    dp = world // tp
    regular = regular_of(dp, tp, tensors, dtype)
    group = Solo()
    messages = messages_of(world, dp, tp, tensors, dtype, tree_of(tensors), regular, group)
    decision = collective.decide_plans(messages, collective.Memory(), group)
    save_id, _, _ = wire.decode_answer(decision.answers[0])
    agreement = collective.Agreement(save_id, decision.global_plan.assignments[0],
                                     decision.plans, decision.global_plan)
    assigned = [collective.assigned_items(agreement, p.rank) for p in decision.plans]
    need = {rank for want in wants for t in regular.items
            for grid in [regular.grids[t.grid]]
            for rank, _ in overlapping(grid, RegularTensor(t.key, t.dtype, t.shape, t.grid),
                                       want[t.key])}
    stored: dict[str, bytes] = {}
    results = [wire.encode_result(rank_report(p, assigned[p.rank], regular, save_id, stored,
                                          p.rank in need)[0]) for p in decision.plans]
    decoded = [wire.decode_result(data, rank, assigned[rank]) for rank, data in enumerate(results)]
    record = collective.manifest_of(decoded, assigned, agreement,
                                    {"ckptio_version": "bench", "torch_version": "-",
                                     "created_unix": 0.0}, "xxh3_64", BLOCK_NBYTES)
    return manifest.encode(record), stored, regular


def ckptio_plan(record: Manifest, stored: dict[str, bytes], want: dict[str, Chunk]) -> int:
    """One loading rank's plan after the decode: expand its wanted regions, its reads' spans."""
    def read(reads: list[Read]) -> int:
        for r in reads:
            r.dest.numpy()[:] = memoryview(stored[r.entries[0].file])
        return sum(r.entries[0].nbytes for r in reads)

    record = expand(record, dict(want), read)
    return len(plan_spans(_reads(record, want), BLOCK_NBYTES, BUFFER_BYTES))


def _reads(record: Manifest, want: dict[str, Chunk]) -> list[Read]:
    by_key: dict[str, list[Any]] = {}
    for entry in record.tensors:
        if entry.key in want:
            by_key.setdefault(entry.key, []).append(entry)
    return [Read(key, tuple(entries), want[key]) for key, entries in by_key.items()]


def measure_ckptio(args: argparse.Namespace, tensors: list[Tensor]) -> dict[str, Any]:
    dp_load = args.load_world // args.tp
    wants = [wants_of(tensors, dp_load, args.tp, r) for r in args.rank_list]
    blob, stored, regular = saved(args.save_world, args.tp, tensors, args.dtype, wants)
    row: dict[str, Any] = {"engine": "ckptio", "manifest_bytes": len(blob),
                           "chunks": sum(1 for t in regular.items
                                         for _ in overlapping(regular.grids[t.grid], RegularTensor(
                                             t.key, t.dtype, t.shape, t.grid), None))}
    row["decode_s"], record = median_time(
        lambda: manifest.decode(blob, "simulated/manifest.json"), args.reps)
    for rank, want in zip(args.rank_list, wants):
        seconds, spans = median_time(lambda w=want: ckptio_plan(record, stored, w), args.reps)
        row[f"rank{rank}_plan_s"], row[f"rank{rank}_reads"] = seconds, spans
    return row


def measure_dcp(args: argparse.Namespace, tensors: list[Tensor]) -> dict[str, Any]:
    import torch
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.checkpoint.planner import LoadPlan
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    from benchmarks.plan_scale_dcp import saved_metadata

    blob = saved_metadata(args.save_world, args.tp, tensors, args.dtype)
    dp_load = args.load_world // args.tp
    row: dict[str, Any] = {"engine": "dcp", "manifest_bytes": len(blob)}

    row["decode_s"], metadata = median_time(lambda: pickle.loads(blob), args.reps)

    def plan(rank: int) -> LoadPlan:
        items = []
        for key, c in wants_of(tensors, dp_load, args.tp, rank).items():
            local = ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.sizes))
            items += create_read_items_for_chunk_list(key, metadata.state_dict_metadata[key],
                                                      [local])
        return LoadPlan(items)

    for rank in args.rank_list:
        seconds, lp = median_time(lambda r=rank: plan(r), args.reps)
        row[f"rank{rank}_plan_s"], row[f"rank{rank}_reads"] = seconds, len(lp.items)
    plans = [plan(r) for r in range(args.load_world)] if args.dcp_global else []
    if plans:
        row["global_s"], _ = median_time(
            lambda: DefaultLoadPlanner().create_global_plan(list(plans)), args.reps)
    row["chunks"] = len(metadata.storage_data)
    return row


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.reshard_plan", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--save-world", type=int, default=1024)
    p.add_argument("--load-world", type=int, default=768)
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--tensors", type=int, default=120, help="parameter tensors (whole layers)")
    p.add_argument("--dtype", choices=sorted(ITEMSIZE), default="bfloat16")
    p.add_argument("--ranks", default="0,383,767", help="loading ranks timed (comma list)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--engines", default="ckptio,dcp")
    p.add_argument("--dcp-global", action="store_true",
                   help="also time DCP's create_global_plan over every loading rank's plan")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    args.rank_list = [int(r) for r in args.ranks.split(",")]
    for world in (args.save_world, args.load_world):
        if world % args.tp:
            p.error(f"world size {world} is not a multiple of tp {args.tp}")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    tensors = model_tensors(args.tensors, optim=False)
    rows = []
    for engine in args.engines.split(","):
        row = (measure_ckptio if engine == "ckptio" else measure_dcp)(args, tensors)
        row.update(save_world=args.save_world, load_world=args.load_world, tp=args.tp,
                   tensors=len(tensors), peak_rss_mib=peak_rss_mib())
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"argv": argv, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
