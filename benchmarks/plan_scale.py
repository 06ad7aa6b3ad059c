"""Plan-only scale benchmark: ckptio's coordinator logic for a simulated FSDP x TP job, no processes.

Owns: a synthetic layout (a Llama-like model of ~1000 tensors, every tensor a DTensor sharded
Shard(0) over dp ranks and Shard(0) / Shard(1) / Replicate over tp ranks, plus per-rank RNG
state and a step counter), the RankPlans that ranks would build for it, and the timing of each
planning phase of a many-rank save and of the manifest decode of a load, with the manifest's
size, as a curve over world sizes. Does not own: any planning rule (globalplan.py, collective.py,
wire.py, manifest.py are called as they are, never copied).

Phases timed (median of --reps):
  local      one rank's message to the coordinator: layout_parts + encode_plan (every rank
             does this in parallel, so it counts once)
  decide     the coordinator: collective.decide_plans on every rank's message (decode_plan of all,
             each distinct layout part fetched and decoded once, check_regular, per_rank_keys +
             plan_global of the per-chunk items, encode_answer of all) + one decode_answer
  again      the same for a later save of the same layout (parts remembered, decisions reused)
  result     one rank's index file (format/regular_section.encode_index of its regular chunks) and its
             wire.encode_result (its per-chunk entries and the index file's name, size and
             checksum; parallel: counts once)
  manifest   the coordinator: decode_result of every rank + collective.manifest_of + check_keys
             + manifest.encode (collective._commit without the file writes); skipped with
             --plan-only
  load       what one loading rank (rank 0, same layout) does before reading data:
             manifest.decode, the chunks its regions overlap (from the grids), the index files
             of their writers (content checked, from memory: no I/O timed), their rows

    python -m benchmarks.plan_scale --world 8,64,512,4096 --tp 8 --reps 3
    python -m benchmarks.plan_scale --world 64,256 --engines ckptio,dcp   # DCP's planner beside
    python -m benchmarks.plan_scale --world 512 --profile prof.txt   # cProfile of one run
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import itertools
import json
import os
import pstats
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from benchmarks import harness
from benchmarks.plan_model import (  # noqa: F401 - the layout, also reached as plan_scale.X
    ITEMSIZE,
    Tensor,
    median_time,
    model_tensors,
    region,
    split,
)
from ckptio.distributed import collective, wire
from ckptio.distributed.dist import Solo
from ckptio.format import manifest
from ckptio.format.flatten import flatten
from ckptio.format.grid import REPLICATE, Grid
from ckptio.format.regular_section import IndexRow, encode_index, index_name
from ckptio.format.types import (
    Chunk,
    FileInfo,
    IndexFile,
    Manifest,
    ObjectEntry,
    Read,
    RegularTensor,
    TensorEntry,
    WriteItem,
    Written,
)
from ckptio.loading.resolve_regular import expand, overlapping
from ckptio.planning.globalplan import RankPlan
from ckptio.planning.layout import plan_files
from ckptio.planning.regular_items import Regular, RegularItem, regular_writes

BLOCK_NBYTES = 1 << 20  # api.BLOCK_CHECKSUM_NBYTES (not imported: api pulls in the I/O stack)
MAX_FILE_BYTES = 1 << 40  # one data file per rank, as the default options give


# ---------------------------------------------------------------- the synthetic layout


def tree_of(tensors: list[Tensor]) -> Any:
    """The manifest tree of the nested state these dotted keys come from (flatten's own)."""
    root: dict[str, Any] = {}
    for key in [t.key for t in tensors] + ["rng", "step"]:
        node = root
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(int(part) if part.isdigit() else part, {})
        node[int(leaf) if leaf.isdigit() else leaf] = 0
    return flatten(root).tree


def grid_of(t: Tensor, dp: int, tp: int) -> Grid:
    """The tensor's layout over the (dp, tp) mesh of every rank, as sharding.py describes it."""
    return Grid((dp, tp), tuple(range(dp * tp)), (0, REPLICATE if t.tp == "r" else int(t.tp)))


def regular_of(dp: int, tp: int, tensors: list[Tensor], dtype: str) -> Regular:
    """The regular items every rank holds (all alike): every tensor (all have elements; a
    nested split may leave some ranks an empty piece, which is not written)."""
    grids: dict[Grid, int] = {}
    items = [RegularItem(index, t.key, dtype, t.shape, grids.setdefault(g, len(grids)))
             for index, t in enumerate(tensors) for g in [grid_of(t, dp, tp)]]
    return Regular(tuple(grids), tuple(items))


def rank_plan(rank: int, dp: int, tp: int, tensors: list[Tensor], dtype: str, tree: Any,
              regular: Regular) -> RankPlan:
    """What ckptio's build_plan + local_plan give rank ``rank`` (rank = dp_rank * tp + tp_rank):
    its regular DTensors (``regular``, shared by all ranks), any others one item each, a
    per-rank RNG state (plain, digest differs by rank) and a step."""
    dp_rank, tp_rank = divmod(rank, tp)
    size = ITEMSIZE[dtype]
    regular_keys = regular.keys
    items = {index: WriteItem(t.key, "tensor", dtype, t.shape, c, c.numel * size)
             for index, t in enumerate(tensors) if t.key not in regular_keys
             for c in [region(t, dp, tp, dp_rank, tp_rank)]}
    items[len(tensors)] = WriteItem("rng", "tensor", "uint8", (5056,), Chunk.whole((5056,)), 5056)
    digests = {len(tensors): f"{rank:016x}"}  # only the RNG state is plain
    domains = dict.fromkeys((i for i in items if i < len(tensors)), "mesh-0123456789abcdef")
    return RankPlan(rank, items, frozenset(items[i].key for i in domains), digests,
                    (ObjectEntry("step", 1000),), (), tree, domains, regular)


def check_grids(dp: int, tp: int, tensors: list[Tensor], regular: Regular) -> None:
    """The regular items' chunks are this file's own region() arithmetic (torch's), on a few
    ranks: the simulated layout is the one the real code plans."""
    for rank in {0, tp - 1, dp * tp // 2, dp * tp - 1}:
        coordinate = divmod(rank, tp)
        for item in regular.items:
            t = tensors[item.index]
            want = region(t, dp, tp, *coordinate)
            got = regular.grids[item.grid].chunk(t.shape, coordinate)
            if got != want and not got.numel == want.numel == 0:  # empty: placed anywhere
                raise RuntimeError(f"{t.key}: the grid's chunk differs from region() on rank {rank}")


def written(plan: RankPlan, assigned: dict[int, WriteItem], save_id: str) -> tuple[
        dict[int, TensorEntry], list[Any]]:
    """What a rank reports after writing its items (``assigned``): layout.plan_files offsets,
    a checksum per entry and per 1 MiB block (as persist computes them; values made up)."""
    files = plan_files(list(assigned.values()), save_id=save_id, rank=plan.rank,
                       max_file_bytes=MAX_FILE_BYTES)
    index_of = {item.key: i for i, item in assigned.items()}
    entries: dict[int, TensorEntry] = {}
    infos: list[Any] = []
    n = 0
    for f in files:
        infos.append(FileInfo(f.name, f.nbytes, plan.rank))
        for p in f.placements:
            it = p.item
            n += 1
            blocks = tuple(f"{(plan.rank << 40) + (n << 20) + b:016x}"
                           for b in range(-(-it.nbytes // BLOCK_NBYTES))) if it.nbytes > BLOCK_NBYTES else ()
            entries[index_of[it.key]] = TensorEntry(
                it.key, it.kind, it.dtype, it.shape, it.chunk, f.name, p.offset, it.nbytes,
                f"{(plan.rank << 32) + n:016x}", None, blocks)
    return entries, infos


# ---------------------------------------------------------------- one world size


def messages_of(world: int, dp: int, tp: int, tensors: list[Tensor], dtype: str, tree: Any,
                regular: Regular, group: Solo) -> list[bytes]:
    """Every rank's plan message, each rank's layout parts published as collective.agree does
    (equal parts stored once). RankPlans are dropped once encoded: only the coordinator's
    decode should hold them all, as in a real job."""
    messages = []
    for rank in range(world):
        plan = rank_plan(rank, dp, tp, tensors, dtype, tree, regular)
        parts = wire.layout_parts(plan)
        for fingerprint, data in parts.items():
            group.publish(fingerprint, data)
        messages.append(wire.encode_plan(plan, fp=list(parts)[-1]))
    return messages


def measure(world: int, tp: int, tensors: list[Tensor], dtype: str, reps: int,
            profiler: cProfile.Profile | None = None, plan_only: bool = False) -> dict[str, Any]:
    """Every phase at one world size; the profiler, when given, runs around the timed calls.
    ``plan_only``: the planning phases (local, decide, decide again) only."""
    if world % tp:
        raise SystemExit(f"world size {world} is not a multiple of tp {tp}")
    dp = world // tp
    tree = tree_of(tensors)
    regular = regular_of(dp, tp, tensors, dtype)
    check_grids(dp, tp, tensors, regular)
    group = Solo()
    t0 = time.perf_counter()
    messages = messages_of(world, dp, tp, tensors, dtype, tree, regular, group)
    setup_s = time.perf_counter() - t0
    plan0 = rank_plan(0, dp, tp, tensors, dtype, tree, regular)
    on = profiler.enable if profiler else (lambda: None)
    off = profiler.disable if profiler else (lambda: None)

    def local() -> bytes:
        parts = wire.layout_parts(plan0)
        return wire.encode_plan(plan0, fp=list(parts)[-1])

    def decide() -> tuple[collective.Decision, collective.Memory]:
        memory = collective.Memory()  # a first save: nothing cached
        decision = collective.decide_plans(messages, memory, group)
        wire.decode_answer(decision.answers[0])
        return decision, memory

    on()
    local_s, _ = median_time(local, reps)
    decide_s, (decision, memory) = median_time(decide, reps)
    # a later save of the same layout: the same messages (values and the fingerprint)
    reused_s, _ = median_time(lambda: collective.decide_plans(messages, memory, group), reps)
    off()
    if memory.reused < 1:
        raise RuntimeError("the repeated save did not reuse the plan")
    row = {"world": world, "dp": dp, "tp": tp, "tensors": len(tensors),
           "regular": len(regular.items), "plan_msg_bytes": len(messages[0]),
           "plan_msgs_bytes": sum(len(m) for m in messages),
           "published_bytes": group.published_nbytes(),
           "local_s": local_s, "decide_s": decide_s, "decide_reused_s": reused_s,
           "setup_s": setup_s, "reused": memory.reused}
    if not plan_only:
        row.update(measure_commit(decision, regular, reps, on, off))
        row["save_total_s"] = local_s + decide_s + row["result_s"] + row["manifest_s"]
    return row


@dataclass
class Commit:
    """A simulated save after ``decision``: every rank's result message, the index files'
    content where rank 0's load reads them (``need``: those ranks), rank 0's parts."""

    agreement: collective.Agreement
    assigned: list[dict[int, WriteItem]]
    results: list[bytes]
    stored: dict[str, bytes]  # index file name -> content
    need: set[int]
    parts0: Written  # rank 0's entries, files and index file
    rows0: list[IndexRow]

    def build_manifest(self) -> bytes:
        """The coordinator's work: decode every result, manifest_of, check_keys, encode."""
        decoded = [wire.decode_result(data, rank, self.assigned[rank])
                   for rank, data in enumerate(self.results)]
        record = collective.manifest_of(decoded, self.assigned, self.agreement, META,
                                        "xxh3_64", BLOCK_NBYTES)
        manifest.check_keys(record, "simulated/manifest.json")
        return manifest.encode(record)


def simulate_commit(decision: collective.Decision, regular: Regular) -> Commit:
    save_id, _, _ = wire.decode_answer(decision.answers[0])
    plans, global_plan = decision.plans, decision.global_plan
    agreement = collective.Agreement(save_id, global_plan.assignments[0], plans, global_plan)
    assigned = [collective.assigned_items(agreement, p.rank) for p in plans]
    stored: dict[str, bytes] = {}
    need = {rank for t in regular.items for grid in [regular.grids[t.grid]]
            for rank, _chunk in overlapping(grid, RegularTensor(t.key, t.dtype, t.shape, t.grid),
                                            grid.chunk(t.shape, grid.coordinate(0)))}
    reports = [rank_report(p, assigned[p.rank], regular, save_id, stored, p.rank in need)
               for p in plans]
    results = [wire.encode_result(parts) for parts, _rows in reports]
    return Commit(agreement, assigned, results, stored, need, *reports[0])


def measure_commit(decision: collective.Decision, regular: Regular, reps: int,
                   on: Callable[[], None], off: Callable[[], None]) -> dict[str, Any]:
    """The result, manifest and load phases after ``decision``: every rank reports its
    per-chunk entries and its index file (name, size, checksum); the index files' content is
    made for the ranks whose chunks rank 0's load needs (the others are never read)."""
    t0 = time.perf_counter()
    commit = simulate_commit(decision, regular)
    setup_s = time.perf_counter() - t0
    save_id = commit.agreement.save_id
    on()
    index_s, _ = median_time(lambda: encode_index(save_id, 0, commit.rows0), reps)
    result_s, _ = median_time(lambda: wire.encode_result(commit.parts0), reps)
    manifest_s, blob = median_time(commit.build_manifest, reps)
    load_s, record = median_time(lambda: load_metadata(blob, commit.stored, rank=0), reps)
    off()
    ranks_read = len({e.file.split("-r")[1][:5] for e in record.tensors if e.key in regular.keys})
    if ranks_read != len(commit.need):
        raise RuntimeError(f"rank 0's load read {ranks_read} ranks' chunks, not {len(commit.need)}")
    chunks = chunk_count(record)
    return {"chunks": chunks, "manifest_bytes": len(blob), "bytes_per_chunk": len(blob) / chunks,
            "result_msg_bytes": len(commit.results[0]),
            "index_bytes": len(commit.stored[index_name(save_id, 0)]),
            "index_s": index_s, "result_s": result_s + index_s, "manifest_s": manifest_s,
            "load_s": load_s, "load_index_files": ranks_read, "commit_setup_s": setup_s}


def rank_report(plan: RankPlan, assigned: dict[int, WriteItem], regular: Regular, save_id: str,
            stored: dict[str, bytes], needed: bool) -> tuple[Written, list[IndexRow]]:
    """Rank ``plan.rank``'s result (entries, files, index file) and index rows; the rows and
    the index file's content (in ``stored``) only where rank 0's load reads them (``needed``:
    its own, and the writers of the replicated tensors in its dp group)."""
    writes = regular_writes(regular, plan.rank) if needed else {}
    entries, infos = written(plan, {**assigned, **writes}, save_id)
    name = index_name(save_id, plan.rank)
    rows = [IndexRow(e.key, e.file, e.offset, e.checksum, e.blocks)
            for index, e in entries.items() if index in writes]
    if writes:
        data = encode_index(save_id, plan.rank, rows)
        stored[name] = data
        index = IndexFile(plan.rank, name, len(data), xxhash.xxh3_64_hexdigest(data))
    else:
        index = IndexFile(plan.rank, name, 4096, f"{plan.rank:016x}")
    infos = [*infos, FileInfo(name, 4096 if not writes else len(stored[name]), plan.rank)]
    if not writes:  # the data file holds the rank's chunks: its size as if they were written
        infos[0] = FileInfo(infos[0].name, 1 << 40, plan.rank)
    return Written({i: e for i, e in entries.items() if i not in writes}, tuple(infos), index), rows


def load_metadata(blob: bytes, stored: dict[str, bytes], rank: int) -> Manifest:
    """What one loading rank does before reading data: decode the manifest, find the chunks
    its own regions (its DTensors' pieces: the same layout) overlap, read and check those
    writers' index files, make their rows."""
    record = manifest.decode(blob, "simulated/manifest.json")
    wants = {}
    for t in record.regular:
        grid = record.grids[t.grid]
        wants[t.key] = grid.chunk(t.shape, grid.coordinate(rank))

    def read(reads: list[Read]) -> int:
        for r in reads:
            r.dest.numpy()[:] = memoryview(stored[r.entries[0].file])
        return sum(r.entries[0].nbytes for r in reads)

    return expand(record, wants, read)


def chunk_count(record: Manifest) -> int:
    """Chunks the manifest describes: its per-chunk rows and every non-empty chunk of its
    regular tensors (from their grids, as loading/resolve_regular.py finds them)."""
    rows = sum(1 for t in record.tensors if t.key not in {r.key for r in record.regular})
    return rows + sum(1 for t in record.regular for _ in overlapping(record.grids[t.grid], t, None))


META = {"ckptio_version": "bench", "torch_version": "-", "created_unix": 0.0}


# ---------------------------------------------------------------- report

PHASES = ("local_s", "decide_s", "result_s", "manifest_s")


def markdown(rows: list[dict[str, Any]], args: argparse.Namespace, argv: list[str]) -> str:
    command = shlex.join(["python", "-m", "benchmarks.plan_scale", *argv])
    rows, dcp_rows = [r for r in rows if r.get("engine", "ckptio") == "ckptio"], [
        r for r in rows if r.get("engine") == "dcp"]
    n_params = rows[0]["tensors"] if rows else 0
    lines = [
        "## Plan-only scale (simulated FSDP x TP)", "", f"`{command}`  ",
        (f"{time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPUs, one process, median of "
        f"{args.reps}; {n_params} tensors ({'params + AdamW exp_avg, exp_avg_sq' if args.optim else 'params'}"
        f", {args.dtype}), Llama-70B-like shapes, mesh (dp, tp) with placements [Shard(0), "
        "Shard(0)|Shard(1)|Replicate], + per-rank RNG and a step  "),
        ("local: one rank's layout_parts + encode_plan; decide: coordinator decide_plans (decode every "
        "message, fetch and decode each distinct layout part once, check the regular items, "
        "plan_global of the per-chunk ones, answers; a first save); decide again: the same for a "
        "later save of the same layout (parts remembered, decisions reused); result: one rank's "
        "index file + encode_result; manifest: coordinator decode_result of all + manifest_of + "
        "check_keys + manifest.encode; load: one loading rank's manifest.decode + the index "
        "files of the writers of the chunks it needs (checked) + their rows; chunks: every "
        "non-empty chunk the checkpoint holds (regular ones counted from their grids); "
        "peak RSS: of the fresh process measuring that world size (all ranks' plans in one "
        "process: the coordinator's share plus the simulation's)"), "",
        ("| world | dp x tp | chunks | manifest MB | index kB | plan msg kB | local s | decide s "
        "| decide again s | result s | manifest s | save total s | load s | index files read "
        "| peak RSS MiB |"),
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['world']} | {r['dp']} x {r['tp']} | {_n(r, 'chunks', ',')} "
            f"| {_n(r, 'manifest_bytes', '.2f', 1e-6)} | {_n(r, 'index_bytes', '.0f', 1e-3)} "
            f"| {r['plan_msg_bytes'] / 1e3:.1f} | {r['local_s']:.4f} | {r['decide_s']:.3f} "
            f"| {r['decide_reused_s']:.3f} | {_n(r, 'result_s', '.4f')} "
            f"| {_n(r, 'manifest_s', '.3f')} | {_n(r, 'save_total_s', '.3f')} "
            f"| {_n(r, 'load_s', '.3f')} | {_n(r, 'load_index_files', 'd')} "
            f"| {r.get('peak_rss_mib', float('nan')):.0f} |")
    if dcp_rows:
        lines += _dcp_table(dcp_rows)
    for a, b in itertools.pairwise([r for r in rows if "chunks" in r]):
        slope = (b["manifest_bytes"] - a["manifest_bytes"]) / max(1, b["world"] - a["world"])
        lines.append(f"- {a['world']} -> {b['world']} ranks: {slope:.0f} manifest bytes per added "
                     "rank (its files, index file, RNG state and grid entry; the tensors are "
                     "described once whatever the world size)")
    lines.append("")
    return "\n".join(lines)


def _n(row: dict[str, Any], name: str, form: str, scale: float = 1.0) -> str:
    """A number of the row, or "-" for a phase not measured (--plan-only)."""
    return "-" if name not in row else format(row[name] * scale if scale != 1.0 else row[name], form)


def _dcp_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["", ("DCP's planner on the same layout (benchmarks/plan_scale_dcp.py): local: one rank's "
                  "WriteItems; decide: DefaultSavePlanner.create_global_plan + finish_plan; result: "
                  "one rank's WriteResults; manifest: FileSystemWriter.finish's merge + pickle of "
                  ".metadata; load: its unpickling (every loading rank)"), "",
             ("| world | chunks | .metadata MB | local s | decide s | result s | manifest s "
              "| save total s | load s | peak RSS MiB |"),
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['world']} | {r['chunks']:,} | {r['manifest_bytes'] / 1e6:.2f} "
                     f"| {r['local_s']:.4f} | {r['decide_s']:.3f} | {r['result_s']:.4f} "
                     f"| {r['manifest_s']:.3f} | {r['save_total_s']:.3f} | {r['load_s']:.3f} "
                     f"| {r.get('peak_rss_mib', float('nan')):.0f} |")
    return lines


def cap_memory(gb: float) -> None:
    """RLIMIT_AS = the current address space + ``gb`` GB (no cap when ``gb`` <= 0)."""
    import resource

    if gb <= 0:
        return
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    limit = vm + int(gb * 1e9)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def peak_rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def spawn(argv: list[str], world: int, timeout: float, engine: str) -> dict[str, Any] | None:
    """One world size in a fresh interpreter (its own peak RSS); None if it failed."""
    drop_next = {"--world", "--json", "--markdown", "--timeout", "--engines"}
    rest: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in drop_next:
            skip = True
            continue
        if a.split("=")[0] in drop_next:
            continue
        rest.append(a)
    cmd = [sys.executable, "-m", "benchmarks.plan_scale", "--worker", "--world", str(world),
           "--engines", engine, *rest]
    run = harness.spawn(cmd, timeout=timeout, strict=False)
    if "error" in run:
        print(f"world {world}: {run['error']} (MemoryError: over --mem-limit-gb; signal 9: "
              "killed for memory); stopping", file=sys.stderr)
        return None
    return run


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.plan_scale", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", default="8,64,512,4096", help="comma list of world sizes")
    p.add_argument("--tp", type=int, default=8, help="tensor-parallel ranks (default 8)")
    p.add_argument("--tensors", type=int, default=1000, help="parameter tensors (default 1000)")
    p.add_argument("--optim", action="store_true", help="add AdamW exp_avg and exp_avg_sq (x3)")
    p.add_argument("--dtype", choices=sorted(ITEMSIZE), default="float32")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json", type=Path)
    p.add_argument("--markdown", type=Path)
    p.add_argument("--profile", type=Path, help="cProfile the timed phases; write the top "
                   "functions (cumulative and internal time) here (runs in this process)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per world size")
    p.add_argument("--mem-limit-gb", type=float, default=12.0, help="address-space cap for each "
                   "world size's process beyond what it holds at start (default 12): a world too "
                   "big for this machine fails with MemoryError instead of waking the OOM killer; "
                   "0 = no cap")
    p.add_argument("--engines", default="ckptio", help="comma list: ckptio, dcp (DCP's planner "
                   "on the same layout)")
    p.add_argument("--plan-only", action="store_true", help="the planning phases only (local, "
                   "decide, decide again): for world sizes whose per-chunk manifest does not fit")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.engine_list = [e for e in args.engines.split(",") if e]
    if not set(args.engine_list) <= {"ckptio", "dcp"}:
        p.error("--engines: ckptio and/or dcp")
    args.worlds = [int(w) for w in args.world.split(",") if w.strip()]
    if args.reps < 1 or not args.worlds:
        p.error("--reps >= 1 and at least one --world")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    tensors = model_tensors(args.tensors, args.optim)
    profiler = cProfile.Profile() if args.profile else None
    if args.worker:
        cap_memory(args.mem_limit_gb)
        if args.engine_list == ["dcp"]:
            from benchmarks.plan_scale_dcp import measure_dcp

            row = measure_dcp(args.worlds[0], args.tp, tensors, args.dtype, args.reps)
        else:
            row = measure(args.worlds[0], args.tp, tensors, args.dtype, args.reps,
                          plan_only=args.plan_only)
        row["engine"] = args.engine_list[0]
        row["peak_rss_mib"] = peak_rss_mib()
        return harness.emit(row)
    rows = []
    stopped: set[str] = set()
    for world in args.worlds:
        for engine in args.engine_list:
            if engine in stopped:
                continue
            if profiler is not None and engine == "ckptio":
                row = measure(world, args.tp, tensors, args.dtype, args.reps, profiler,
                              args.plan_only)
                row["peak_rss_mib"], row["engine"] = peak_rss_mib(), engine
            else:
                row = spawn(argv, world, args.timeout, engine)
                if row is None:
                    stopped.add(engine)  # too big: the curve of this engine stops here
                    continue
            rows.append(row)
            print(f"{engine}, world {world}: decide {row['decide_s']:.3f} s, again "
                  f"{row.get('decide_reused_s', float('nan')):.3f} s, manifest "
                  f"{_n(row, 'manifest_s', '.3f')} s, load decode {_n(row, 'load_s', '.3f')} s, "
                  f"peak RSS {row['peak_rss_mib']:.0f} MiB", file=sys.stderr, flush=True)
            gc.collect()
    text = markdown(rows, args, argv)
    print(text)
    if args.markdown:
        args.markdown.write_text(text)
    if args.json:
        args.json.write_text(json.dumps({"argv": argv, "rows": rows}, indent=1))
    if profiler is not None:
        out = io.StringIO()
        stats = pstats.Stats(profiler, stream=out)
        stats.sort_stats("cumulative").print_stats(40)
        stats.sort_stats("tottime").print_stats(30)
        args.profile.write_text(out.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
