"""The read step of an in-place load with peers: each stored entry that several ranks want whole
(a replicated tensor: plain DDP, HSDP's replicas, TP-replicated norms) is read from storage by
one of them and sent to the others (Options.broadcast_replicated).

    plan       every rank names the entries it reads whole (planning/shared_reads.py); the
               coordinator picks each shared one's owner and answers every rank (one step)
    read       each rank reads from storage what it owns, what it alone wants and every other
               region (resharded ones), as without peers; then one step: all read, or all fail
    exchange   owners send, the others receive and check (sendreads.py), over a gloo group of
               the load's own, its timeout Options.rank_timeout_s (made once, kept for later loads)

A peer whose messages fail (it died, or did not answer within the timeout) is read around: its
units are read from storage, with a warning naming it and why (the load's final agreement then
fails on every rank if it is gone). Every rank runs the step once: with its reads
(``__call__``), or with the error it met before (``fail``).

Owns: the two steps, the wire group, the fallback. Does not own: the messages' bytes
(sendreads.py), the decisions (planning/shared_reads.py), the reads themselves (loading/).
"""

from __future__ import annotations

import json
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from ckptio.distributed import sendreads
from ckptio.distributed.dist import Group
from ckptio.distributed.step import coordinate, listed
from ckptio.errors import RankFailedError
from ckptio.format.checksum import ALGORITHMS
from ckptio.format.types import DTYPE_ITEMSIZE, Read, TensorEntry
from ckptio.io.stage import torch_dtype
from ckptio.planning.shared_reads import Share, Want, assign, unit_name

__all__ = ["ReadPlace", "SharedReads"]

ReadFn = Callable[[list[Read]], int]


@dataclass(frozen=True)
class ReadPlace:
    """Where a load's reads come from: the checkpoint's location, its manifest's checksum
    algorithm and block size, whether the load checks checksums, whether its store is host
    memory (then every rank reads its own: a copy from memory beats a send), and the path
    messages name for a file."""

    location: str
    algorithm: str
    block_nbytes: int
    verify: bool
    in_memory: bool
    path_of: Callable[[str], str]


# (group members, timeout) -> (generation, the wire group, weakly: torch's registry holds it
# until destroy_process_group, and holding it here would keep its threads alive past that)
_wires: dict[tuple[tuple[int, ...], float], tuple[int, weakref.ref[Any]]] = {}


class SharedReads:
    """The read step (module docstring) over ``group`` (ckptio's store group) and
    ``torch_group`` (whose members the wire group joins)."""

    def __init__(self, group: Group, torch_group: Any, on: bool, timeout_s: float,
                 path: str) -> None:
        self.group, self.torch_group, self.on = group, torch_group, on
        self.timeout_s, self.path = timeout_s, path
        self.members = tuple(int(r) for r in
                             torch.distributed.get_process_group_ranks(torch_group))
        self.pending: str | None = "plan"  # the step this rank still owes the others

    def __call__(self, reads: list[Read], read: ReadFn, place: ReadPlace) -> int:
        units, rest, by_unit = _units(reads, place)
        decision = self._plan(units, rest, place)
        if not decision.get("shared"):
            return read(reads)
        share = Share(tuple(decision["owner"]), {int(i): tuple(to)
                                                 for i, to in decision["to"].items()})
        self.pending = "read"
        try:
            nbytes = read(rest + [r for i in range(len(units)) if share.owner[i] == -1
                                  for r in by_unit[i]])
        except BaseException as exc:
            self.fail(exc)
            raise
        self._read_done(None)
        failed = self._exchange(units, share, decision["wire"], place)
        if not failed:
            return nbytes
        again = [r for i in range(len(units)) if share.owner[i] in failed for r in by_unit[i]]
        warnings.warn(
            f"{self.path}: rank {self.group.rank} could not exchange replicated tensors with "
            + "; ".join(f"rank {r} ({why})" for r, why in sorted(failed.items()))
            + f"; it read the {len(again)} tensor(s) those ranks were to send it from storage "
            "instead", stacklevel=4)
        return nbytes + read(again)

    def _plan(self, units: list[sendreads.Unit], rest: list[Read],
              place: ReadPlace) -> dict[str, Any]:
        """The plan step: this rank's units out, its part of the decision back."""
        on = self.on and not place.in_memory and self.members == tuple(sorted(self.members))
        mine = {"on": on, "wire": self._generation(),
                "units": [[u.name, u.entry.nbytes] for u in units],
                "alone": sum(r.region.numel * DTYPE_ITEMSIZE[r.entries[0].dtype] for r in rest)}
        self.pending = None
        try:
            answer = coordinate(self.group, json.dumps(mine).encode(), None, _decide,
                                self._failed)
        except RankFailedError as exc:
            if exc.ranks:  # a rank died or hung: nothing more to agree on
                raise
            # another rank met an error of its own before reading (a state that does not
            # match): this rank reads all it wants, as without peers, so that an error of its
            # own (damage) is what it raises; the load's last step then names the other
            return {}
        decision: dict[str, Any] = json.loads(answer or b"{}")
        return decision

    def fail(self, error: BaseException) -> None:
        """This rank failed before its part of the step (or within it): the others learn it."""
        if self.pending == "plan":
            self.pending = None
            coordinate(self.group, None, error, _decide, self._failed)
        elif self.pending == "read":
            self._read_done(error)

    def _read_done(self, error: BaseException | None) -> None:
        self.pending = None
        coordinate(self.group, None if error is not None else b"", error,
                   lambda messages: [b""] * len(messages), self._failed)

    def _failed(self, failures: list[str]) -> str:
        return f"load of {self.path} failed on {listed(failures)}"

    def _exchange(self, units: list[sendreads.Unit], share: Share, generation: int,
                  place: ReadPlace) -> dict[int, str]:
        key = (self.members, self.timeout_s)
        try:
            wire = _wire(key, generation)
        except RuntimeError as exc:  # the wire group could not be made (a peer gone)
            _wires.pop(key, None)
            return {o: f"{type(exc).__name__}: {exc}" for o in share.owner if o != -1}
        try:
            failed = sendreads.exchange(wire, units, share,
                                        place.algorithm if place.verify else None,
                                        place.block_nbytes, place.path_of)
        except BaseException:
            _wires.pop(key, None)
            raise
        if failed:  # its pairs may be closed: the next load makes a new one
            _wires.pop(key, None)
        return failed

    def _generation(self) -> int:
        known = _wires.get((self.members, self.timeout_s))
        return known[0] if known is not None and known[1]() is not None else 0


def _wire(key: tuple[tuple[int, ...], float], generation: int) -> Any:
    """The wire group of ``key``'s members: the one made before if every rank still holds it
    (the same generation), else a new one (every member makes it at this point)."""
    known = _wires.get(key)
    group = known[1]() if known is not None and known[0] == generation else None
    if group is None:
        group = torch.distributed.new_group(list(key[0]), backend="gloo",
                                            timeout=timedelta(seconds=key[1]),
                                            use_local_synchronization=True)
        _wires[key] = (generation, weakref.ref(group))
    return group


def _units(reads: list[Read],
           place: ReadPlace) -> tuple[list[sendreads.Unit], list[Read], list[list[Read]]]:
    """The whole-entry reads that could come from another rank, as units (each entry once,
    with its reads), and the other reads."""
    units: list[sendreads.Unit] = []
    by_unit: list[list[Read]] = []
    index: dict[int, int] = {}
    rest: list[Read] = []
    for read in reads:
        entry = read.whole
        if entry is None or not _checkable(entry, place) or not _fits(read):
            rest.append(read)
            continue
        i = index.setdefault(id(entry), len(units))
        if i == len(units):
            units.append(sendreads.Unit(unit_name(place.location, entry), entry))
            by_unit.append([])
        units[i].dests.append(read.dest)
        by_unit[i].append(read)
    return units, rest, by_unit


def _checkable(entry: TensorEntry, place: ReadPlace) -> bool:
    """Whether a receiver can check ``entry``'s bytes as the load would have: against its
    checksum (ckptio's own, or the CRC-32 of a DCP item or torch.save record), or not at all
    when the load does not verify."""
    return not place.verify or (place.algorithm in ALGORITHMS and bool(entry.checksum))


def _fits(read: Read) -> bool:
    """Whether ``read`` takes a plain stored entry whole into a tensor of its bytes."""
    entry, dest = read.entries[0], read.dest
    return (isinstance(dest, torch.Tensor) and not entry.coded and not entry.order
            and dest.dtype == torch_dtype(entry.dtype)
            and dest.numel() * dest.element_size() == entry.nbytes)


def _decide(messages: list[bytes]) -> list[bytes]:
    """On the coordinator: each rank's owners and receivers, or no sharing at all."""
    mine = [json.loads(m) for m in messages]
    if not all(m["on"] for m in mine):
        return [b'{"shared": false}'] * len(mine)
    shares = assign([[Want(n, b) for n, b in m["units"]] for m in mine],
                    [m["alone"] for m in mine])
    if not any(s.sends_or_receives for s in shares):
        return [b'{"shared": false}'] * len(mine)
    generations = {m["wire"] for m in mine}
    generation = generations.pop() if len(generations) == 1 and 0 not in generations else (
        max(m["wire"] for m in mine) + 1)
    return [json.dumps({"shared": True, "wire": generation, "owner": s.owner,
                        "to": s.to}).encode() for s in shares]
