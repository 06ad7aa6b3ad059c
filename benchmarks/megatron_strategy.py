"""Megatron-Core ``dist_checkpointing.save`` / ``load`` of one sharded state through ckptio's
strategies (ckptio/megatron_strategy.py) and through Megatron's ``torch_dist``, in the same
2 gloo processes, alternating, each timed from the call to its return (save: durable and
``metadata.json`` written; load: every tensor filled); the median of the repeats. Needs
megatron-core (the test extra: 0.16.1 on Python 3.11; ``BENCH=1 dev/megatron_tests.sh`` runs
it with 0.19.2 on Python 3.12).

    python benchmarks/megatron_strategy.py [--mib 256] [--repeats 3] [--dir /tmp/mcore-bench]

The state: ``layers`` stacked weights (Megatron's ``prepend_axis_num=1``) split by tensor
parallelism over the 2 ranks, plus a replicated one; loaded back in the same TP 2 layout and
as TP 1 (every rank all of it). The page cache is not dropped between save and load.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from megatron.core import dist_checkpointing as mdc
from megatron.core.dist_checkpointing.mapping import ShardedTensor

from ckptio.megatron_strategy import CkptioLoadShardedStrategy, CkptioSaveShardedStrategy
from ckptio.testing.rank_processes import run_ranks

LAYERS = 8


def _state(tp: int, rank: int, mib: int, fill: bool) -> dict[str, Any]:
    cols = 1024
    rows = max(tp, mib * (1 << 20) // 4 // LAYERS // cols // 2) // tp * tp  # half in the layers
    local = rows // tp
    g = torch.Generator().manual_seed(rank)
    make = (lambda *s: torch.randn(*s, generator=g)) if fill else torch.zeros
    out: dict[str, Any] = {f"l{i}": ShardedTensor.from_rank_offsets(
        "w", make(local, cols), (0, i, LAYERS), (1, rank % tp, tp), prepend_axis_num=1,
        replica_id=0) for i in range(LAYERS)}
    out["emb"] = ShardedTensor.from_rank_offsets("emb", make(rows * LAYERS // tp, cols),
                                                 (0, rank % tp, tp), replica_id=0)
    return out


def _cpu_for_torch_dist() -> None:
    import multiprocessing as mp

    if not torch.cuda.is_available():
        torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
        torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]
    mp.current_process().daemon = False


def _timed(fn: Any) -> float:
    torch.distributed.barrier()
    start = time.perf_counter()
    fn()
    torch.distributed.barrier()
    return time.perf_counter() - start


def _body(rank: int, world: int, root: str, mib: int, repeats: int) -> dict[str, list[float]]:
    _cpu_for_torch_dist()
    times: dict[str, list[float]] = {}
    for _ in range(repeats):
        for name in ("ckptio", "torch_dist"):
            where = Path(root, name)
            if rank == 0:
                shutil.rmtree(where, ignore_errors=True)
                where.mkdir(parents=True)
            save = CkptioSaveShardedStrategy() if name == "ckptio" else None
            state = _state(world, rank, mib, True)
            times.setdefault(f"{name} save", []).append(_timed(
                lambda: mdc.save(state, str(where), sharded_strategy=save)))
            for tp in (world, 1):
                load = CkptioLoadShardedStrategy() if name == "ckptio" else None
                into = _state(tp, rank, mib, False)
                times.setdefault(f"{name} load TP {tp}", []).append(_timed(
                    lambda: mdc.load(into, str(where), sharded_strategy=load,
                                     validate_access_integrity=tp == world)))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default="/tmp/ckptio-megatron-bench")
    args = parser.parse_args()
    results = run_ranks(2, _body, args.dir, args.mib, args.repeats, timeout_s=1800)
    rows = {k: statistics.median(max(r[k][i] for r in results) for i in range(args.repeats))
            for k in results[0]}
    print(json.dumps({"mib": args.mib, "ranks": 2, "repeats": args.repeats,
                      "median_s": {k: round(v, 3) for k, v in rows.items()}}, indent=1))
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
