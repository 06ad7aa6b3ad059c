"""The compact messages ranks exchange during a save: each rank's plan to the coordinator, the
coordinator's answer, each rank's written entries. JSON bytes (never pickle): positional lists,
no field names, so a 1000-tensor rank sends tens of kB.

Owns: encoding and decoding those messages, with a check on every field a peer sent. Does not
own: what they mean (globalplan.py) or moving them (dist.py).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import xxhash

from ckptio.errors import CkptError
from ckptio.format import entryform
from ckptio.format.grid import Grid
from ckptio.format.types import (
    DTYPE_ITEMSIZE,
    Chunk,
    Delta,
    FileInfo,
    IndexFile,
    ObjectEntry,
    Stored,
    TensorEntry,
    WriteItem,
    Written,
)
from ckptio.planning.globalplan import Assignment, RankPlan
from ckptio.planning.regular_items import Regular, RegularItem

__all__ = ["Layout", "Values", "WireError", "decode_answer", "decode_layout", "decode_plan",
           "decode_regular", "decode_result", "decode_tree", "encode_answer", "encode_plan",
           "encode_replan", "encode_result", "fingerprint", "layout_parts", "split_location",
           "with_location"]


class WireError(CkptError):
    """A peer sent a message this rank cannot read (mixed ckptio versions?)."""


def with_location(location: str, body: bytes) -> bytes:
    """``body`` led by the location it is about (a save's, a load's, an export's), so that the
    receiver can check every rank named the same one (split_location)."""
    named = location.encode()
    return len(named).to_bytes(4, "big") + named + body


def split_location(message: bytes) -> tuple[str, bytes]:
    """with_location's (location, body)."""
    size = int.from_bytes(message[:4], "big")
    return message[4:4 + size].decode(errors="replace"), message[4 + size:]


def _dumps(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), allow_nan=False).encode()


def _loads(data: bytes, what: str) -> Any:
    try:
        return json.loads(data)
    except ValueError as exc:
        raise WireError(f"{what}: not a ckptio message ({exc}); do all ranks run the same "
                        "ckptio version?") from None


def _item(item: WriteItem) -> list[Any]:
    return [item.key, item.kind, item.dtype, list(item.shape), list(item.chunk.offsets),
            list(item.chunk.sizes), int(item.chunk.flat), item.nbytes]


def _unitem(raw: list[Any]) -> WriteItem:
    key, kind, dtype, shape, offsets, sizes, flat, nbytes = raw
    return WriteItem(key, kind, dtype, tuple(shape), Chunk(tuple(offsets), tuple(sizes), bool(flat)),
                     nbytes)


def layout_parts(plan: RankPlan) -> dict[str, bytes]:
    """The parts of a rank's plan that stay the same while its layout does, by fingerprint,
    published apart (collective.py): its tree, its regular DTensor items (if any) and the rest
    (its per-chunk items, naming the other two by fingerprint), whose fingerprint is last.
    Nothing rank-specific enters the first two, so ranks of one model send equal bytes, stored
    once; a rank's per-chunk items (its RNG state, irregular shards) are small."""
    tree = _dumps(plan.tree)
    parts = {fingerprint(tree): tree}
    regular_fp = None
    if plan.regular is not None:
        regular = _dumps([[[list(g.shape), list(g.ranks), list(g.dims)] for g in plan.regular.grids],
                          [[i.index, i.key, i.dtype, list(i.shape), i.grid]
                           for i in plan.regular.items]])
        regular_fp = fingerprint(regular)
        parts[regular_fp] = regular
    rest = _dumps([[[index, *_item(i)] for index, i in plan.items.items()], sorted(plan.sharded),
                   [list(a) for a in plan.aliases], [[i, d] for i, d in plan.domains.items()],
                   fingerprint(tree), regular_fp])
    parts[fingerprint(rest)] = rest
    return parts


def fingerprint(data: bytes) -> str:
    return xxhash.xxh3_128_hexdigest(data)


@dataclass(frozen=True)
class Layout:
    """A rank's decoded per-chunk part: every field of a RankPlan but the rank, its values,
    and its tree and regular items (parts of their own, named by fingerprint)."""

    items: dict[int, WriteItem]
    sharded: frozenset[str]
    aliases: tuple[tuple[str, str], ...]
    domains: dict[int, str]
    tree_fp: str
    regular_fp: str | None

    def plan(self, rank: int, values: Values, tree: Any, regular: Regular | None) -> RankPlan:
        """Rank ``rank``'s plan: this layout with its values (digests, inline objects)."""
        if any(i not in self.items for i in values.digests):
            raise WireError(f"rank {rank}'s plan has a digest of an item its layout lacks; do "
                            "all ranks run the same ckptio version?")
        return RankPlan(rank, self.items, self.sharded, values.digests, values.objects,
                        self.aliases, tree, self.domains, regular)

    def check_regular(self, regular: Regular, fp: str) -> None:
        """Its per-chunk and regular items are different items (once per distinct layout)."""
        if any(i.index in self.items for i in regular.items):
            raise WireError(f"plan part {fp} lists an item both per chunk and per tensor; do all "
                            "ranks run the same ckptio version?")


@dataclass(frozen=True)
class Values:
    """What a rank's plan message carries besides its layout's fingerprint."""

    fingerprint: str
    digests: dict[int, str]
    objects: tuple[ObjectEntry, ...]


def _part(data: bytes, fp: str) -> Any:
    if fingerprint(data) != fp:
        raise WireError(f"the plan part published as {fp} does not match its fingerprint; "
                        "do all ranks run the same ckptio version?")
    return _loads(data, f"plan part {fp}")


def _malformed(fp: str, exc: Exception) -> WireError:
    return WireError(f"plan part {fp} is malformed ({exc!r}); do all ranks run the same ckptio "
                     "version?")


def decode_layout(data: bytes, fp: str) -> Layout:
    """The per-chunk part published under ``fp``; refused unless its bytes hash to it."""
    try:
        items, sharded, aliases, domains, tree_fp, regular_fp = _part(data, fp)
        return Layout({int(i[0]): _unitem(i[1:]) for i in items}, frozenset(sharded),
                      tuple((a, b) for a, b in aliases), {int(i): str(d) for i, d in domains},
                      str(tree_fp), None if regular_fp is None else str(regular_fp))
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise _malformed(fp, exc) from None


def decode_tree(data: bytes, fp: str) -> Any:
    """The tree published under ``fp`` (checked with the rest of the state by the commit)."""
    return _part(data, fp)


def decode_regular(data: bytes, fp: str) -> Regular:
    """The regular DTensor items published under ``fp``."""
    try:
        grids, items = _part(data, fp)
        regular = Regular(tuple(Grid(tuple(map(int, s)), tuple(map(int, r)), tuple(map(int, d)))
                                for s, r, d in grids),
                          tuple(RegularItem(int(i), str(k), str(t), tuple(map(int, shape)), int(g))
                                for i, k, t, shape, g in items))
        for grid in regular.grids:
            if (len(grid.dims) != len(grid.shape) or min(grid.shape, default=0) < 1
                    or len(grid.ranks) != math.prod(grid.shape)
                    or len(set(grid.ranks)) != len(grid.ranks) or min(grid.ranks) < 0):
                raise ValueError(f"a mesh of shape {grid.shape} with {len(grid.ranks)} ranks")
        for item in regular.items:
            if not 0 <= item.grid < len(regular.grids) or item.dtype not in DTYPE_ITEMSIZE or any(
                    not -1 <= d < len(item.shape) for d in regular.grids[item.grid].dims) or any(
                    d < 0 for d in item.shape):
                raise ValueError(f"item {item.key!r} names no grid, dtype or dim it can have")
        if len(regular.by_key) != len(regular.items) or len(
                {i.index for i in regular.items}) != len(regular.items):
            raise ValueError("a key or item index listed twice")
        return regular
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise _malformed(fp, exc) from None


def encode_plan(plan: RankPlan | None, error: str | None = None, fp: str | None = None) -> bytes:
    """A rank's plan: the fingerprint ``fp`` of its layout (published apart, once for all ranks
    of the same layout) and its values (digests of plain tensors, inline objects), which go
    every time; or its error."""
    if plan is None or fp is None:
        return _dumps({"error": error})
    return _dumps({"rank": plan.rank, "fp": fp,
                   "digests": [[i, d] for i, d in plan.digests.items()],
                   "objects": [[o.key, o.value] for o in plan.objects]})


def decode_plan(data: bytes, rank: int) -> Values | str:
    """-> the rank's values and its layout's fingerprint, or the error it sent."""
    raw = _loads(data, f"rank {rank}'s plan")
    try:
        if raw.get("error") is not None:
            return str(raw["error"])
        return Values(str(raw["fp"]), {int(i): str(d) for i, d in raw["digests"]},
                      tuple(ObjectEntry(k, v) for k, v in raw["objects"]))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise WireError(f"rank {rank}'s plan is malformed ({exc!r}); do all ranks run the same "
                        "ckptio version?") from None


def encode_answer(save_id: str, assignment: Assignment | None, error: str | None) -> bytes:
    if assignment is None:
        return _dumps({"error": error})
    return _dumps({"save_id": save_id, "writes": list(assignment.writes),
                   "own": sorted(assignment.own)})


def encode_replan(keys: frozenset[str]) -> bytes:
    """The coordinator's answer when ``keys`` must be planned again with digests
    (globalplan.across_meshes)."""
    return _dumps({"replan": sorted(keys)})


def decode_answer(data: bytes) -> tuple[str, Assignment, frozenset[str]]:
    """-> (save_id, this rank's assignment, keys to plan again: then nothing else); raises the
    coordinator's error, if any."""
    raw = _loads(data, "the coordinator's answer")
    if raw.get("error") is not None:
        raise CkptError(raw["error"])
    if raw.get("replan"):
        return "", Assignment(()), frozenset(map(str, raw["replan"]))
    return raw["save_id"], Assignment(tuple(raw["writes"]), frozenset(raw["own"])), frozenset()


def encode_result(written: Written) -> bytes:
    """What a rank wrote, keyed by the index of each item in its plan (positions and checksums;
    the coordinator knows the rest), and its index file (its regular items' chunks). A rank's
    failure travels apart (distributed/step.py). Nothing depends on the order of entries."""
    names = {f.name: i for i, f in enumerate(written.files)}
    index = written.index
    return _dumps({"files": [[f.name, f.nbytes] for f in written.files],
                   "entries": [[i, names.get(e.file, -1), e.offset, e.checksum, list(e.blocks),
                                _coded(e)] for i, e in written.entries.items()],
                   "index": None if index is None else [index.name, index.nbytes,
                                                        index.checksum]})


def _coded(e: TensorEntry) -> dict[str, Any] | None:
    """An entry's version 4 fields (format/entryform.py), and the file of a reference (in its
    base checkpoint, not among the rank's files); None for a plain entry."""
    if not e.coded:
        return None
    return {**entryform.entry_json(e), "file": e.file}


def _uncoded(coded: dict[str, Any] | None, file: str | None) -> tuple[Stored | None,
                                                                      Delta | None, str]:
    """The inverse of _coded (a rank's own report: its shape is trusted, the manifest's
    validation checks its values)."""
    if coded is None:
        if file is None:
            raise ValueError("a plain entry names no file of the rank")
        return None, None, file
    raw = coded.get("stored")
    stored = None if raw is None else Stored(str(raw["codec"]), int(raw["nbytes"]),
                                             tuple(int(f) for f in raw["frames"]))
    kind = next((k for k in entryform.DELTA_KINDS if k in coded), None)
    delta = None if kind is None else Delta(kind, str(coded[kind]["checkpoint"]))
    return stored, delta, file if file is not None else str(coded["file"])


def decode_result(data: bytes, rank: int, assigned: Mapping[int, WriteItem]) -> Written:
    """An entry for every item index in ``assigned``, the rank's files and its index file. An
    index not assigned, reported twice or missing is refused, and an index file that is not
    one of the rank's files."""
    raw = _loads(data, f"rank {rank}'s result")
    try:
        files = tuple(FileInfo(name, nbytes, rank) for name, nbytes in raw["files"])
        entries: dict[int, TensorEntry] = {}
        for index, f, offset, checksum, blocks, coded in raw["entries"]:
            item = assigned[index]
            if index in entries:
                raise ValueError(f"item {index} ({item.key}) reported twice")
            stored, delta, file = _uncoded(coded, files[f].name if f >= 0 else None)
            entries[index] = TensorEntry(item.key, item.kind, item.dtype, item.shape, item.chunk,
                                         file, offset, item.nbytes, checksum, None,
                                         tuple(blocks), stored=stored, delta=delta)
        if len(entries) != len(assigned):
            missing = sorted(set(assigned) - set(entries))[:5]
            raise ValueError(f"no entry for assigned items {missing}")
        index_file = None
        if raw.get("index") is not None:
            name, nbytes, checksum = raw["index"]
            if name not in {f.name for f in files}:
                raise ValueError(f"index file {name!r} is not among its files")
            index_file = IndexFile(rank, str(name), int(nbytes), str(checksum))
        return Written(entries, files, index_file)
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise WireError(f"rank {rank}'s result is malformed ({exc!r})") from None
