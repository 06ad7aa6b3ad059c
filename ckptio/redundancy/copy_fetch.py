"""A partner copy fetched from every holder of it at once, in a same-world recovery (rebuild.py):
its chunks (peers.chunk_spans) dealt round-robin among the holders whose copies agree (the
same manifest and length), each holder sending its share, the receiver posting every receive
first and checking each entry as its bytes land (landing.StreamCheck), in chunk order.

An entry that fails its check within one holder's chunks names that holder's copy (passed over,
the plan made again); one that spans several holders' chunks (or a failure no range explains)
names the split (recovery_plan.split_id): the copy is fetched again from one holder at a time,
so a damaged copy is then named alone. A copy the in-memory check cannot cover (compressed
or delta entries, verified once written) comes from its first holder alone, so that such a
failure names one copy.

Call order (every rank, after the items' metadata are gathered): ``plan`` (alike on every rank)
-> ``send`` and ``post`` -> the receiver's ``Receiving.land`` -> ``Receiving.blame`` on a
failure. Owns: which holder sends which chunk, and whom a failure names. Does not own: the
plan of sources (recovery_plan.py), the check (landing.py), the install (rebuild.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ckptio.errors import CkptError
from ckptio.redundancy import peers
from ckptio.redundancy.landing import StreamCheck
from ckptio.redundancy.recovery_plan import Source, copy_id, split_id

__all__ = ["Fetch", "Receiving", "plan", "post", "send"]


@dataclass(frozen=True)
class Fetch:
    """``receiver``'s copy of ``nbytes``: chunk q sent by ``holders[q % len(holders)]``."""

    receiver: int
    holders: tuple[int, ...]
    items: tuple[str, ...]  # each holder's copy's item id, in ``holders``' order
    nbytes: int

    def spans(self, holder: int) -> list[tuple[int, int]]:
        """The chunks [lo, hi) ``holder`` sends."""
        every, at = peers.chunk_spans(self.nbytes), self.holders.index(holder)
        return every[at::len(self.holders)]

    def sender(self, q: int) -> int:
        return self.holders[q % len(self.holders)]


def plan(step: int, sources: dict[int, Source], metas: dict[str, Any]) -> list[Fetch]:
    """Every copy of the round and who sends which chunk of it (alike on every rank)."""
    fetches = []
    for rank, src in sorted(sources.items()):
        if src[0] != "copy":
            continue
        first = metas[copy_id(src[1], rank, step)]
        holders = tuple(h for h in src[2] if _agrees(metas[copy_id(h, rank, step)], first))
        if not _checked_in_memory(first):
            holders = holders[:1]
        fetches.append(Fetch(rank, holders, tuple(copy_id(h, rank, step) for h in holders),
                             int(first["nbytes"])))
    return fetches


def _agrees(meta: dict[str, Any], first: dict[str, Any]) -> bool:
    return meta["digest"] == first["digest"] and meta["nbytes"] == first["nbytes"]


def _checked_in_memory(meta: dict[str, Any]) -> bool:
    """Whether the copy's every entry is checked as it lands (peers.stream_entries)."""
    try:
        files = [(str(n), int(b)) for n, b in meta["files"]]
        return peers.stream_entries(meta["manifest"].encode(), files, "a partner copy") is not None
    except CkptError:
        return False  # its first holder alone: the receiver's check names what is wrong


def send(group: Any, rank: int, fetches: list[Fetch], payload: dict[str, torch.Tensor],
         tag: int) -> list[Any]:
    """This rank's chunks of every copy it sends -> the works to wait on."""
    works = []
    for fetch in fetches:
        if rank in fetch.holders:
            data = payload[fetch.items[fetch.holders.index(rank)]]
            works += [dist.isend(data[lo:hi], fetch.receiver, group=group, tag=tag)
                      for lo, hi in fetch.spans(rank)]
    return works


@dataclass
class Receiving:
    """This rank's copy being received: its buffer and each chunk's work, in chunk order."""

    fetch: Fetch
    out: torch.Tensor
    works: list[tuple[int, int, Any]]

    def received_from(self) -> dict[int, int]:
        """Bytes per sending rank."""
        got: dict[int, int] = {}
        for q, (lo, hi, _work) in enumerate(self.works):
            got[self.fetch.sender(q)] = got.get(self.fetch.sender(q), 0) + hi - lo
        return got

    def land(self, check: StreamCheck | None) -> None:
        """Wait for every chunk, in order, each checked as it lands."""
        for lo, hi, work in self.works:
            work.wait()
            if check is not None:
                check.landed(lo, hi)

    def blame(self, check: StreamCheck | None, step: int) -> list[str]:
        """What a failed install names: the one copy used, or whose chunks alone the damaged
        entry spans; else the split (recovery_plan.split_id: then one holder at a time)."""
        bad = None if check is None else check.bad
        named = list(self.fetch.items) if bad is None else [
            item for holder, item in zip(self.fetch.holders, self.fetch.items)
            if any(lo < bad[1] and bad[0] < hi for lo, hi in self.fetch.spans(holder))]
        return named if len(named) == 1 else [split_id(self.fetch.receiver, step)]


def post(group: Any, rank: int, fetches: list[Fetch], tag: int,
         into: torch.Tensor | None = None) -> Receiving | None:
    """Every receive of this rank's copy posted, into ``into`` (where given: its step's
    length) or a fresh tensor (None: it receives none)."""
    mine = next((f for f in fetches if f.receiver == rank), None)
    if mine is None:
        return None
    assert into is None or into.numel() == mine.nbytes  # internal: both from its meta
    out = torch.empty(mine.nbytes, dtype=torch.uint8) if into is None else into
    return Receiving(mine, out, [
        (lo, hi, dist.irecv(out[lo:hi], mine.sender(q), group=group, tag=tag))
        for q, (lo, hi) in enumerate(peers.chunk_spans(mine.nbytes))])
