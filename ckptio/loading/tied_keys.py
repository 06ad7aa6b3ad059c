"""Tied keys in an in-place load: two keys of the state that are one tensor (tied weights).

Two rules of matching.py's ``match``, on the keys of the state whose destination is the very
tensor of another: ``tied`` (a key absent from the checkpoint that the load of its twin fills
is not missing: a Hugging Face export leaves out lm_head.weight, which the model ties to the
embedding) and ``held_apart`` (a pair the checkpoint holds as two tensors of different values,
saved untied: neither is loaded, since loading both would leave the first holding the second's
values). What makes two tensors one (``view``): their elements at the same place, and for a
DTensor its local shard's with its placements (FSDP2 and tensor parallel tie one parameter
under two keys).

Owns: telling tied keys apart from the others. Does not own: the match record and the rest of
the key rules (matching.py), the stored tensors' entries (stored.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch

from ckptio.format.flatten import FlatState
from ckptio.format.types import ObjectEntry
from ckptio.loading.stored import TensorSource
from ckptio.planning.sharding import is_dtensor, local_tensor

__all__ = ["held_apart", "tied", "view"]


def tied(flat: FlatState, absent: list[str], common: list[str]) -> tuple[str, ...]:
    """Keys absent from the checkpoint whose destination is the very tensor of a key that is
    loaded (tied weights: a Hugging Face export leaves out lm_head.weight, which the model ties
    to the embedding): the load fills them, so they are not missing."""
    loaded = {v for k in common if (v := view(flat.leaves[k])) is not None}
    return tuple(k for k in absent if (v := view(flat.leaves[k])) is not None and v in loaded)


def held_apart(flat: FlatState, leaves: Sequence[tuple[str, TensorSource | ObjectEntry]]
               ) -> tuple[set[str], dict[str, str]]:
    """Of the keys to load (``leaves``: key and stored source, in the load's order), those the
    state ties (one tensor under two keys) that the checkpoint holds as two tensors of
    different values (saved untied): loading both would leave the first key holding the
    second's values, so neither is loaded -> (both keys of each such pair, the later key of
    each -> why)."""
    first: dict[tuple[object, ...], tuple[str, TensorSource | ObjectEntry]] = {}
    apart: set[str] = set()
    why: dict[str, str] = {}
    for key, source in leaves:
        v = view(flat.leaves[key]) if isinstance(source, TensorSource) else None
        if v is None:
            continue
        other_key, other_source = first.setdefault(v, (key, source))
        if other_key == key or _same_values(other_source, source):
            continue
        apart |= {key, other_key}
        why[key] = (
            f"{key}: the state ties it to {other_key} (one tensor), while the checkpoint "
            "holds different values for them (saved untied): loading both would leave one "
            "holding the other's values; untie them in the state (or load one with keys=...)")
    return apart, why


def _same_values(a: TensorSource | ObjectEntry, b: TensorSource | ObjectEntry) -> bool:
    """Whether two stored tensors hold the same values (the same entry, or equal checksums)."""
    if a is b or not isinstance(a, TensorSource) or not isinstance(b, TensorSource):
        return a is b
    def sums(s: TensorSource) -> list[tuple[str, ...]]:
        return sorted((repr(e.chunk), e.dtype, e.checksum, repr(e.order)) for e in s.entries)
    return sums(a) == sums(b)


def view(leaf: object) -> tuple[object, ...] | None:
    """What makes two tensors one (their elements at the same place), or None; a DTensor's:
    its local shard's, with its placements (FSDP2 and tensor parallel tie one parameter under
    two keys; a rank's empty shard still has its storage)."""
    dt = is_dtensor(leaf)
    t = local_tensor(leaf) if dt else leaf
    if not (dt or type(t) in (torch.Tensor, torch.nn.Parameter)):
        return None
    t = cast(torch.Tensor, t)
    if t.is_meta or not (t.untyped_storage().data_ptr() if dt else t.numel()):
        return None  # every meta tensor's data_ptr is 0
    place = (t.untyped_storage().data_ptr(), t.storage_offset(), t.shape, t.stride(), t.dtype)
    if not dt:
        return place
    return (*place, tuple(leaf.shape), tuple(leaf.placements))  # type: ignore[attr-defined]
