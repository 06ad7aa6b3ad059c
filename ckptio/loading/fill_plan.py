"""Stage two of a load: which stored bytes go into which destination, as one list of Reads.

A fresh load reads each stored tensor whole into a new tensor; an in-place load (``plan``, from
matching.Match) reads each leaf's region straight into the state's tensor, or in the stored
dtype into a staged tensor converted afterwards (cast=True), and the values replaced in their
containers whole into new tensors, turned back into values (``Plan.values``) once read. One
``Read`` per destination: read.py plans the bytes of all of them together (planning/reshard.py
finds the stored pieces of a region, whatever layout saved it).

Owns: destinations and the dtype conversions after the reads. Does not own: the key rules
(matching.py), reading (read.py), putting values back (merge.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from ckptio.format.types import Chunk, ObjectEntry, Read, TensorEntry
from ckptio.io.buffers import torch_dtype
from ckptio.loading.matching import Leaf, Match
from ckptio.loading.stored import TensorSource, decode_object, stored_value
from ckptio.planning.sharding import Held

__all__ = ["Plan", "ReadFn", "Reads", "plan", "whole"]

ReadFn = Callable[[list[Read]], int]


def _empty(entry: TensorEntry, sizes: tuple[int, ...]) -> torch.Tensor:
    return torch.empty(sizes, dtype=torch_dtype(entry.dtype))


def whole(source: TensorSource) -> torch.Tensor:
    """A new tensor for the source's whole value."""
    return _empty(source.head, source.head.shape)


@dataclass
class Reads:
    """What a load reads: one Read per destination (a whole entry in the same layout, or a
    region assembled from several chunks or parts of them: one read plan for all, see read.py);
    plus dtype conversions done afterwards."""

    reads: list[Read] = field(default_factory=list)
    casts: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (dest, staged)

    def add(self, source: TensorSource, want: Chunk, dest: torch.Tensor) -> None:
        """Fill ``dest`` (the stored dtype; the region's shape) with region ``want``."""
        self.reads.append(Read(source.key, source.entries, want, dest))

    def entries(self) -> Iterable[TensorEntry]:
        """Every stored entry the reads touch, once each."""
        seen: set[int] = set()
        for read in self.reads:
            for entry in read.entries:
                if id(entry) not in seen:
                    seen.add(id(entry))
                    yield entry

    def run(self, read: ReadFn) -> int:
        """Read, then convert the staged dtypes -> bytes read."""
        with torch.no_grad():
            nbytes = read(self.reads)
            for dest, staged in self.casts:
                dest.copy_(staged)
        return nbytes


@dataclass
class Plan(Reads):
    """An in-place load's reads, and the values made from them once read: key -> a function
    making the stored value (replaced in its container, not copied into)."""

    assign: dict[str, Callable[[], Any]] = field(default_factory=dict)

    def values(self, leaves: Iterable[Leaf]) -> dict[str, Any]:
        """The stored values of ``leaves`` (replaced ones), made once the reads ran."""
        return {leaf.key: self.assign[leaf.key]() for leaf in leaves if leaf.key in self.assign}


def plan(m: Match) -> Plan:
    """The reads of an in-place load: its leaves in place (or replaced), then the created and
    the by-name keys replaced."""
    out = Plan()
    for leaf in m.leaves:
        if leaf.region is not None and isinstance(leaf.source, TensorSource):
            _into(out, leaf.source, leaf.region, leaf.cast)
        else:
            _replace(out, leaf.key, leaf.source)
    for leaf in (*m.created, *m.by_name):
        _replace(out, leaf.key, leaf.source)
    return out


def _into(out: Plan, source: TensorSource, region: Held, cast: bool) -> None:
    """Read the region into the state's tensor (staged in the stored dtype to ``cast``)."""
    dest = region.local
    if cast:
        staged = _empty(source.head, tuple(dest.shape))
        out.add(source, region.chunk, staged)
        out.casts.append((dest, staged))
    else:
        out.add(source, region.chunk, dest)


def _replace(out: Plan, key: str, source: TensorSource | ObjectEntry) -> None:
    """Read a stored value whole, to replace the state's leaf in its container."""
    if isinstance(source, TensorSource):
        staged = whole(source)
        out.add(source, Chunk.whole(source.head.shape), staged)
        out.assign[key] = functools.partial(stored_value, source.head, staged)
    else:
        out.assign[key] = functools.partial(decode_object, source)
