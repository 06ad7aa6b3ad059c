"""The sharded state of the many-rank benchmark (ranks.py): state.py's GPT+AdamW state with
every tensor of 2+ dims a DTensor Shard(0) over a 1-D CPU mesh, 1-D tensors Replicate, 0-dim
tensors and Python values plain; destinations of any world size; digests of a rank's part.

Owns: cutting the state per rank as torch cuts Shard(0), the skeleton a load destination is
built from, and the digest of a rank's local tensors. Does not own: timing or processes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


def map_containers(value: Any, fn: Callable[[Any], Any]) -> Any:
    """``fn`` applied to each child of a dict, list or plain tuple; any other value as is."""
    if isinstance(value, dict):
        return type(value)({k: fn(v) for k, v in value.items()})
    if isinstance(value, list):
        return [fn(v) for v in value]
    if isinstance(value, tuple) and type(value) is tuple:
        return tuple(fn(v) for v in value)
    return value


def split(size: int, parts: int, index: int) -> tuple[int, int]:
    """(start, length) of piece ``index`` of dim ``size`` cut in ``parts`` as Shard(0) does
    (torch.chunk: pieces of ceil(size / parts); trailing ones smaller or empty)."""
    full = -(-size // parts)
    start = min(full * index, size)
    return start, min(size, full * (index + 1)) - start


def placement_of(t: Any) -> str:
    """'shard' (2+ dims: weights, embeddings, their AdamW moments), 'replicate' (1-D: norms,
    biases), 'plain' (0-dim step counters, and any non-float leaf such as the RNG state)."""
    if t.dim() >= 2:
        return "shard"
    if t.dim() == 1 and t.is_floating_point():
        return "replicate"
    return "plain"


def local_view(value: Any, rank: int, world: int, memo: dict[int, Any] | None = None) -> Any:
    """The same nesting with each tensor replaced by the plain tensor rank ``rank`` of ``world``
    holds (a view: no copy). Tied tensors stay tied."""
    import torch

    memo = {} if memo is None else memo
    if isinstance(value, torch.Tensor):
        # state_dict() detaches every entry: tied weights are distinct objects over one storage
        ident = (value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape),
                 value.stride(), value.dtype)
        if ident not in memo:
            if placement_of(value) == "shard" and world > 1:
                start, length = split(value.shape[0], world, rank)
                memo[ident] = value.narrow(0, start, length)
            else:
                memo[ident] = value
        return memo[ident]
    if isinstance(value, dict):
        return type(value)({k: local_view(v, rank, world, memo) for k, v in value.items()})
    if isinstance(value, list):
        return [local_view(v, rank, world, memo) for v in value]
    if isinstance(value, tuple) and type(value) is tuple:
        return tuple(local_view(v, rank, world, memo) for v in value)
    return value


def to_dtensors(full: Any, local: Any, mesh: Any, memo: dict[int, Any] | None = None) -> Any:
    """Wrap each local tensor of ``local`` (from local_view of ``full``) as a DTensor with the
    placement of its full twin; plain leaves stay as they are."""
    import torch
    from torch.distributed.tensor import DTensor, Replicate, Shard

    memo = {} if memo is None else memo
    if isinstance(full, torch.Tensor):
        if id(local) not in memo:
            kind = placement_of(full)
            if kind == "plain":
                memo[id(local)] = local
            else:
                memo[id(local)] = DTensor.from_local(
                    local, mesh, [Shard(0) if kind == "shard" else Replicate()], run_check=False,
                    shape=full.shape, stride=full.stride())
        return memo[id(local)]
    if isinstance(full, dict):
        return type(full)({k: to_dtensors(v, local[k], mesh, memo) for k, v in full.items()})
    if isinstance(full, list):
        return [to_dtensors(f, part, mesh, memo) for f, part in zip(full, local)]
    if isinstance(full, tuple) and type(full) is tuple:
        return tuple(to_dtensors(f, part, mesh, memo) for f, part in zip(full, local))
    return local


def sharded_state(full: Any, rank: int, world: int, mesh: Any) -> Any:
    """This rank's DTensor state, its local shards copied out of ``full`` (which may be freed)."""
    memo: dict[int, Any] = {}
    local = local_view(full, rank, world)
    copies = _copy_tensors(local, memo)
    return to_dtensors(full, copies, mesh)


def _copy_tensors(value: Any, memo: dict[int, Any]) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        if id(value) not in memo:
            memo[id(value)] = value.clone()
        return memo[id(value)]
    if isinstance(value, dict):
        return type(value)({k: _copy_tensors(v, memo) for k, v in value.items()})
    if isinstance(value, list):
        return [_copy_tensors(v, memo) for v in value]
    if isinstance(value, tuple) and type(value) is tuple:
        return tuple(_copy_tensors(v, memo) for v in value)
    return value


@dataclass(frozen=True)
class Spec:
    """A tensor leaf of the destination skeleton: shape, stride and dtype, and which of the
    source's tensors it is (tied tensors share ``ident``)."""

    ident: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: Any
    kind: str  # placement_of


def skeleton(full: Any) -> Any:
    """state.empty_destination(full) (scalars poisoned) with tensors replaced by Specs."""
    import torch

    from ckptio.tuning import state

    empty = state.empty_destination(full)
    ids: dict[int, int] = {}

    def walk(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            n = ids.setdefault(id(value), len(ids))
            return Spec(n, tuple(value.shape), tuple(value.stride()), value.dtype, placement_of(value))
        return map_containers(value, walk)

    return walk(empty)


def destination(skel: Any, rank: int, world: int, mesh: Any) -> Any:
    """A touched (zeroed) destination for rank ``rank`` of ``world``: DTensors on ``mesh``, or
    plain full tensors when ``mesh`` is None."""
    import torch
    from torch.distributed.tensor import DTensor, Replicate, Shard

    made: dict[int, Any] = {}

    def walk(value: Any) -> Any:
        if isinstance(value, Spec):
            if value.ident not in made:
                if value.kind == "shard" and mesh is not None:
                    shape = (split(value.shape[0], world, rank)[1], *value.shape[1:])
                    local = torch.zeros(shape, dtype=value.dtype)
                else:
                    local = torch.empty_strided(value.shape, value.stride, dtype=value.dtype).zero_()
                if mesh is not None and value.kind != "plain":
                    placement = Shard(0) if value.kind == "shard" else Replicate()
                    local = DTensor.from_local(local, mesh, [placement], run_check=False,
                                               shape=torch.Size(value.shape), stride=value.stride)
                made[value.ident] = local
            return made[value.ident]
        return map_containers(value, walk)

    return walk(skel)


def local_digest(value: Any) -> str:
    """state.digest of the state with every DTensor replaced by its local tensor."""
    from ckptio.planning.sharding import is_dtensor
    from ckptio.tuning import state

    def walk(v: Any) -> Any:
        if is_dtensor(v):
            return v.to_local()
        if isinstance(v, dict):
            return {k: walk(x) for k, x in v.items()}
        if isinstance(v, list):
            return [walk(x) for x in v]
        if isinstance(v, tuple) and type(v) is tuple:
            return tuple(walk(x) for x in v)
        return v

    return state.digest(walk(value))
