"""The synthetic layout the planning benchmarks share (plan_scale.py, plan_scale_dcp.py,
reshard_plan.py): a Llama-like model's tensors, each a DTensor sharded Shard(0) over dp ranks and
Shard(0) / Shard(1) / Replicate over tp ranks, the region a rank holds, and a median timer.

Owns: the dimensions, Tensor, model_tensors, split, region, median_time. Does not own: any
planning rule (ckptio's or DCP's), the phases timed (plan_scale.py, plan_scale_dcp.py).
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ckptio.format.types import Chunk

__all__ = ["ITEMSIZE", "LAYER", "OUTER", "Tensor", "median_time", "model_tensors", "region",
           "split"]

ITEMSIZE = {"float32": 4, "bfloat16": 2}

# Llama-3-70B-like dimensions; the layer count is set by --tensors.
D_MODEL, KV_DIM, FFN, VOCAB = 8192, 1024, 28672, 128256

# (name, shape(d), tp placement): "0" Shard(0) column-parallel, "1" Shard(1) row-parallel,
# "r" Replicate on tp. The dp mesh dim is always Shard(0) (FSDP2).
LAYER = (("attn_norm.weight", (D_MODEL,), "r"), ("attn.wq.weight", (D_MODEL, D_MODEL), "0"),
         ("attn.wk.weight", (KV_DIM, D_MODEL), "0"), ("attn.wv.weight", (KV_DIM, D_MODEL), "0"),
         ("attn.wo.weight", (D_MODEL, D_MODEL), "1"), ("ffn_norm.weight", (D_MODEL,), "r"),
         ("ffn.w1.weight", (FFN, D_MODEL), "0"), ("ffn.w3.weight", (FFN, D_MODEL), "0"),
         ("ffn.w2.weight", (D_MODEL, FFN), "1"))
OUTER = (("tok_embeddings.weight", (VOCAB, D_MODEL), "0"), ("norm.weight", (D_MODEL,), "r"),
         ("output.weight", (VOCAB, D_MODEL), "0"))


@dataclass(frozen=True)
class Tensor:
    key: str
    shape: tuple[int, ...]
    tp: str  # "0", "1" or "r"


def model_tensors(n_tensors: int, optim: bool) -> list[Tensor]:
    """At least ``n_tensors`` parameter tensors (whole layers), with AdamW's exp_avg and
    exp_avg_sq of each (same shape and sharding) when ``optim``."""
    layers = max(1, -(-(n_tensors - len(OUTER)) // len(LAYER)))
    params = [Tensor(f"model.{OUTER[0][0]}", OUTER[0][1], OUTER[0][2])]
    for i in range(layers):
        params += [Tensor(f"model.layers.{i}.{n}", s, p) for n, s, p in LAYER]
    params += [Tensor(f"model.{n}", s, p) for n, s, p in OUTER[1:]]
    if not optim:
        return params
    out = list(params)
    for slot in ("exp_avg", "exp_avg_sq"):
        out += [Tensor(f"optim.{slot}.{t.key[len('model.'):]}", t.shape, t.tp) for t in params]
    return out


def split(size: int, parts: int, index: int) -> tuple[int, int]:
    """(offset, length) of piece ``index`` of ``size`` in ``parts``, as torch's Shard does
    (torch.chunk: pieces of ceil(size / parts), trailing ones smaller or empty)."""
    full = -(-size // parts)
    start = min(full * index, size)
    return start, min(size, full * (index + 1)) - start


def region(t: Tensor, dp: int, tp: int, dp_rank: int, tp_rank: int) -> Chunk:
    """The chunk a rank at (dp_rank, tp_rank) of a (dp, tp) mesh holds: placements
    [Shard(0), tp placement], applied mesh dim by mesh dim as torch computes them."""
    offsets, sizes = [0] * len(t.shape), list(t.shape)
    for dim, parts, index in ((0, dp, dp_rank), (None if t.tp == "r" else int(t.tp), tp, tp_rank)):
        if dim is None or parts == 1:
            continue
        start, length = split(sizes[dim], parts, index)
        offsets[dim] += start
        sizes[dim] = length
    return Chunk(tuple(offsets), tuple(sizes))


def median_time(fn: Callable[[], Any], reps: int) -> tuple[float, Any]:
    times, out = [], None
    for _ in range(reps):
        gc.collect()
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out
