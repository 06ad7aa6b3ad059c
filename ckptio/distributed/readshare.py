"""The read step of an in-place load with peers: each stored entry that several ranks want whole
(a replicated tensor: plain DDP, HSDP's replicas, TP-replicated norms), and each checksum block
that several ranks' resharded pieces want part of (a cut between their regions inside it), is
read from storage by one of them and sent to the others (Options.broadcast_replicated).

    plan       every rank names the entries it reads whole, the blocks it wants part of
               (planning/shared_reads.py) and its unexpected keys (loadsteps.py); the
               coordinator picks owners and the keys no rank asks for: one step, then keys checked
    blocks     (where blocks are shared) owners read their shared blocks; one step: all read,
               or all fail; then the blocks are exchanged and checked (sendreads.py) on a
               thread of their own, while the read below begins
    read       each rank reads from storage what it owns, what it alone wants and every other
               region (resharded ones, the shared blocks it holds taken from memory: ``Known``),
               as without peers, those that need a block from another rank once it is here;
               then one step: all read, or all fail
    exchange   owners send, the others receive and check (sendreads.py), over a gloo group of
               the load's own, its timeout Options.rank_timeout_s (made once, kept for later loads)

A peer whose messages fail (it died, or did not answer within the timeout) is read around: its
units are read from storage, with a warning naming it and why (the load's final agreement then
fails on every rank if it is gone). Every rank runs the step once: with its reads
(``__call__``), or with the error it met before (``fail``).

Owns: the steps, the fallback. Does not own: the messages' bytes (sendreads.py), the
decisions (planning/shared_reads.py), the reads (loading/), the wire group (wiregroup.py).
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ckptio.distributed import sendreads
from ckptio.distributed.dist import Group
from ckptio.distributed.loadsteps import UnexpectedKeys, nobody_asks
from ckptio.distributed.step import coordinate, listed, rank_named
from ckptio.distributed.wiregroup import Wire, generation, new_generation
from ckptio.errors import CorruptCheckpointError, RankFailedError
from ckptio.format.checksum import ALGORITHMS, TREE
from ckptio.format.types import DTYPE_ITEMSIZE, Read, TensorEntry
from ckptio.io.buffers import torch_dtype
from ckptio.planning.shared_reads import Share, Want, assign, shared_blocks, unit_name
from ckptio.storage.holder import host_id

__all__ = ["Known", "ReadPlace", "ReadWith", "SharedReads"]

Known = dict[str, list[tuple[int, torch.Tensor]]]  # file -> (offset, the bytes there, uint8)


class ReadWith(Protocol):
    """A load's read: fills ``reads`` from storage, taking the stored bytes in ``known`` from
    memory instead. -> bytes read from storage."""

    def __call__(self, reads: list[Read], known: Known | None = None) -> int: ...

_DAMAGE = CorruptCheckpointError.__name__  # a rank's failure's kind as the others learn it
_OWN_FORMAT = (TREE, "xxh3_64")  # ckptio's own checkpoints' checksums (blocks' too)


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


class SharedReads:
    """The read step (module docstring) over ``group`` (ckptio's store group) and
    ``torch_group`` (whose members the wire group joins)."""

    def __init__(self, group: Group, torch_group: Any, on: bool, timeout_s: float,
                 path: str, keys: UnexpectedKeys | None = None) -> None:
        self.group, self.torch_group, self.on, self.keys = group, torch_group, on, keys
        self.timeout_s, self.path = timeout_s, path
        self.members = tuple(int(r) for r in
                             torch.distributed.get_process_group_ranks(torch_group))
        self.pending: str | None = "plan"  # the step this rank still owes the others

    def __call__(self, reads: list[Read], read: ReadWith, place: ReadPlace) -> int:
        units, rest, by_unit = _units(reads, place)
        blocks = _block_units(rest, place)
        decision = self._plan(units + blocks, len(units), rest, place)
        if self.keys is not None:  # the key step, carried: checked before any read
            shared = decision.get("shared")
            self.pending = ("blocks" if decision.get("blocks") else "read") if shared else None
            self.keys.agreed(decision.get("unexpected"))
            self.pending = None
        if not decision.get("shared"):
            return read(reads)
        share = Share(tuple(decision["owner"]), {int(i): tuple(to)
                                                 for i, to in decision["to"].items()})
        whole, parts = _split(share, len(units))
        wire = Wire(self.members, self.timeout_s, decision["wire"],
                    place.algorithm if place.verify else None, place.block_nbytes, place.path_of)
        main = rest + [r for i in range(len(units)) if share.owner[i] == -1 for r in by_unit[i]]
        nbytes, known, failed = 0, Known(), dict[int, str]()
        self.pending = "read"
        try:
            if decision.get("blocks"):  # every rank takes the blocks step, or none
                nbytes, known, failed = self._blocks(units + blocks, parts, main, read, place,
                                                     wire)
            else:
                nbytes = read(main)
        except BaseException as exc:
            self.fail(exc)
            raise
        self._read_done(None, again=lambda: _sent_by(share, by_unit, lambda o: o != -1),
                        read=read)
        failed_units = wire.exchange(units + blocks, whole)
        wire.close(bool(failed or failed_units))
        again = _sent_by(share, by_unit, failed_units.__contains__)
        failed.update(failed_units)
        if not failed:
            return nbytes
        warnings.warn(
            f"{self.path}: {rank_named(self.group.rank, self.members)} could not exchange "
            "replicated tensors or shared checksum blocks with "
            + "; ".join(f"{rank_named(r, self.members)} ({why})"
                        for r, why in sorted(failed.items()))
            + f"; it read the {len(again)} tensor(s) and the blocks those ranks were to send it "
            "from storage instead", stacklevel=4)
        return nbytes + read(again)

    def _blocks(self, units: list[sendreads.Unit], parts: Share, main: list[Read],
                read: ReadWith, place: ReadPlace,
                wire: Wire) -> tuple[int, Known, dict[int, str]]:
        """The blocks step and this rank's reads: read the shared blocks this rank owns, agree
        all did; then, while the blocks are exchanged (a thread of its own), read the ``main``
        reads that need no block from another rank, and the others once the blocks are here.
        -> bytes read, the blocks held (owned and received), the peers whose blocks failed."""
        self.pending = "blocks"
        owned = [i for i in parts.to]
        nbytes = read([Read.of(units[i].entry, units[i].dests[0]) for i in owned])
        self._read_done(None, loaded=False)  # blocks only: into tensors of their own
        self.pending = "read"
        known = _held(units, owned)
        coming = [units[i].entry for i, owner in enumerate(parts.owner) if owner != -1]
        early, late = _waiting_for(main, coming)
        with ThreadPoolExecutor(1, thread_name_prefix="ckptio-block-exchange") as pool:
            exchange = pool.submit(wire.exchange, units, parts)
            try:
                nbytes += read(early, known)
            finally:
                failed = exchange.result()  # its error, raised once here
        known = _held(units, [i for i, owner in enumerate(parts.owner)
                              if i in parts.to or (owner != -1 and owner not in failed)])
        return nbytes + read(late, known), known, failed

    def _plan(self, units: list[sendreads.Unit], nwhole: int, rest: list[Read],
              place: ReadPlace) -> dict[str, Any]:
        """The plan step: this rank's units out, its part of the decision back."""
        on = self.on and not place.in_memory and self.members == tuple(sorted(self.members))
        files = _alone_by_file(rest)
        for unit in units:
            files.setdefault(unit.entry.file, 0)
        index = {file: i for i, file in enumerate(files)}
        mine = {"on": on, "wire": generation(self.members, self.timeout_s),
                "files": [*files.items()],
                "units": [[u.name, u.entry.nbytes, index[u.entry.file]] for u in units],
                "nwhole": nwhole, "host": host_id(),
                "unexpected": self.keys.message() if self.keys else [],
                "alone": sum(files.values())}
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
        elif self.pending in ("blocks", "read"):
            self._read_done(error)

    def _read_done(self, error: BaseException | None, loaded: bool = True,
                   again: Callable[[], list[Read]] | None = None,
                   read: ReadWith | None = None) -> None:
        """The step after a read; ``loaded``: that read filled the state's tensors. Where
        another rank's read failed (damage), this rank reads ``again()`` (what it was to
        receive) with ``read`` first: its own error (that damage) is what it raises, else the
        other's."""
        self.pending = None
        try:
            coordinate(self.group, None if error is not None else b"", error,
                       lambda messages: [b""] * len(messages),
                       self._failed_loaded if loaded else self._failed)
        except RankFailedError as exc:  # damage another rank found is read here too (raised
            # alike); any other failure at once (reading kept this rank past the others' exit)
            if exc.ranks or again is None or read is None or _DAMAGE not in exc.kinds:
                raise
            read(again())
            raise

    def _failed(self, failures: list[str]) -> str:
        return f"load of {self.path} failed on {listed(failures)}"

    def _failed_loaded(self, failures: list[str]) -> str:
        return (self._failed(failures) + "; this rank's state may be partly loaded: load again "
                "once the cause is fixed")

def _sent_by(share: Share, by_unit: list[list[Read]],
             which: Callable[[int], bool]) -> list[Read]:
    """The reads of the whole entries this rank receives from an owner ``which`` accepts."""
    return [r for i, reads in enumerate(by_unit) if share.owner[i] != -1
            and which(share.owner[i]) for r in reads]


def _held(units: list[sendreads.Unit], which: list[int]) -> Known:
    """The bytes of ``units``' blocks ``which``, by file, as a read takes them from memory."""
    known: Known = {}
    for i in which:
        entry = units[i].entry
        known.setdefault(entry.file, []).append(
            (entry.offset, units[i].dests[0].reshape(-1).view(torch.uint8)))
    return known


def _waiting_for(reads: list[Read], coming: list[TensorEntry]) -> tuple[list[Read], list[Read]]:
    """``reads`` as those that touch none of the stored bytes of ``coming`` (blocks another rank
    sends: read now) and those that do (read once they are here)."""
    spans: dict[str, list[tuple[int, int]]] = {}
    for entry in coming:
        spans.setdefault(entry.file, []).append((entry.offset, entry.offset + entry.nbytes))

    def waits(read: Read) -> bool:
        return any(lo < e.offset + e.nbytes and e.offset < hi for e in read.entries
                   for lo, hi in spans.get(e.file, ()))

    early = [r for r in reads if not waits(r)]
    return early, [r for r in reads if waits(r)]


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
    keys = {"unexpected": nobody_asks([m["unexpected"] for m in mine])}  # the key step's answer
    if not all(m["on"] for m in mine):
        return [json.dumps({"shared": False, **keys}).encode()] * len(mine)
    shares = assign(_wants(mine), [m["alone"] for m in mine],
                    [dict(m["files"]) for m in mine])
    if not any(s.sends_or_receives for s in shares):
        return [json.dumps({"shared": False, **keys}).encode()] * len(mine)
    generations = {m["wire"] for m in mine}
    generation = generations.pop() if len(generations) == 1 and "" not in generations else (
        new_generation())
    blocks = any(o != -1 for s, m in zip(shares, mine) for o in s.owner[m["nwhole"]:])
    return [json.dumps({"shared": True, "wire": generation, "owner": s.owner, "to": s.to,
                        "blocks": blocks, **keys}).encode() for s in shares]


def _block_units(rest: list[Read], place: ReadPlace) -> list[sendreads.Unit]:
    """The checksum blocks the resharded ``rest`` want part of, as units read into tensors of
    their own (only where the load checks blocks: unchecked, a read is not widened to them)."""
    if not place.verify or place.algorithm not in _OWN_FORMAT:
        return []
    return [sendreads.Unit(unit_name(place.location, entry), entry,
                           [torch.empty(entry.shape, dtype=torch_dtype(entry.dtype))])
            for entry in shared_blocks(rest, place.block_nbytes)]


def _split(share: Share, nwhole: int) -> tuple[Share, Share]:
    """``share`` as two over the same units: the whole entries' (the first ``nwhole``), the
    blocks' (the others), each with the other's units neither sent nor received."""
    def part(keep: Callable[[int], bool]) -> Share:
        return Share(tuple(o if keep(i) else -1 for i, o in enumerate(share.owner)),
                     {i: to for i, to in share.to.items() if keep(i)})

    return part(lambda i: i < nwhole), part(lambda i: i >= nwhole)


def _wants(mine: list[dict[str, Any]]) -> list[list[Want]]:
    """Every rank's units as wants; a block that only ranks of one host want is each one's
    own (its name made the rank's): they read it through that host's page cache, which fetches
    it from storage once (loading/shared_blocks.py), and a send would cost them more. Blocks
    carry no file: each is cut by the pieces of two ranks, read around it by both, so the bytes
    decide (assign)."""
    hosts: dict[str, set[str]] = {}
    for m in mine:
        for name, _nbytes, _file in m["units"][m["nwhole"]:]:
            hosts.setdefault(name, set()).add(m["host"])
    return [[Want(n, b, m["files"][f][0]) if i < m["nwhole"] else
             Want(n if len(hosts[n]) > 1 else f"{n}@{rank}", b)
             for i, (n, b, f) in enumerate(m["units"])] for rank, m in enumerate(mine)]


def _alone_by_file(rest: list[Read]) -> dict[str, int]:
    """The bytes of the reads that are no unit, by the data file of their first entry."""
    files: dict[str, int] = {}
    for read in rest:
        file = read.entries[0].file
        files[file] = files.get(file, 0) + read.region.numel * DTYPE_ITEMSIZE[
            read.entries[0].dtype]
    return files
