"""The compact messages ranks exchange during a save: each rank's plan to the coordinator, the
coordinator's answer, each rank's written entries. JSON bytes (never pickle): positional lists,
no field names, so a 1000-tensor rank sends tens of kB.

Owns: encoding and decoding those messages, with a check on every field a peer sent. Does not
own: what they mean (globalplan.py) or moving them (dist.py).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import xxhash

from ckptio.errors import CkptError
from ckptio.planning.globalplan import Assignment, RankPlan
from ckptio.format.types import Chunk, FileInfo, ObjectEntry, TensorEntry, WriteItem

__all__ = ["WireError", "decode_answer", "decode_plan", "decode_result", "encode_answer",
           "encode_plan", "encode_result", "fingerprint", "layout_bytes"]


class WireError(CkptError):
    """A peer sent a message this rank cannot read (mixed ckptio versions?)."""


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


def layout_bytes(plan: RankPlan) -> bytes:
    """The part of a rank's plan that stays the same while its layout does."""
    return _dumps([[_item(i) for i in plan.items], sorted(plan.sharded),
                   [list(a) for a in plan.aliases], plan.tree,
                   [[i, d] for i, d in plan.domains.items()]])


def fingerprint(layout: bytes) -> str:
    return xxhash.xxh3_64_hexdigest(layout)


def encode_plan(plan: RankPlan | None, error: str | None = None, layout: bytes | None = None,
                same_as: str | None = None) -> bytes:
    """A rank's plan with its ``layout`` (layout_bytes), or with ``same_as`` (the fingerprint of
    the layout it sent last) instead; or its error. Values (digests of plain tensors, inline
    objects) go every time."""
    if plan is None:
        return _dumps({"error": error})
    values = _dumps({"rank": plan.rank, "digests": [[i, d] for i, d in plan.digests.items()],
                     "objects": [[o.key, o.value] for o in plan.objects]})
    if same_as is not None:
        return values[:-1] + b',"same_as":' + _dumps(same_as) + b"}"
    layout = layout_bytes(plan) if layout is None else layout
    return values[:-1] + b',"fp":' + _dumps(fingerprint(layout)) + b',"layout":' + layout + b"}"


def decode_plan(data: bytes, rank: int, cached: RankPlan | None,
                cached_fp: str | None) -> tuple[RankPlan | None, str | None, str | None, bool]:
    """-> (plan, None, its layout's fingerprint, whether the layout was the cached one) or
    (None, the rank's error, None, False). A ``same_as`` message is resolved against ``cached``
    (the coordinator's copy of that rank's last plan, whose fingerprint is ``cached_fp``)."""
    raw = _loads(data, f"rank {rank}'s plan")
    try:
        if raw.get("error") is not None:
            return None, str(raw["error"]), None, False
        digests = {int(i): str(d) for i, d in raw["digests"]}
        objects = tuple(ObjectEntry(k, v) for k, v in raw["objects"])
        if "same_as" in raw:
            if cached is None or raw["same_as"] != cached_fp:
                return None, "its cached plan does not match the coordinator's (internal)", None, False
            if any(not 0 <= i < len(cached.items) for i in digests):
                raise ValueError(f"a digest for an item beyond its {len(cached.items)} items")
            return RankPlan(rank, cached.items, cached.sharded, digests, objects,
                            cached.aliases, cached.tree, cached.domains), None, cached_fp, True
        items, sharded, aliases, tree, domains = raw["layout"]
        return RankPlan(
            rank, tuple(_unitem(i) for i in items), frozenset(sharded), digests, objects,
            tuple((a, b) for a, b in aliases), tree, {int(i): str(d) for i, d in domains}), \
            None, str(raw["fp"]), False
    except (KeyError, TypeError, ValueError) as exc:
        raise WireError(f"rank {rank}'s plan is malformed ({exc!r}); do all ranks run the same "
                        "ckptio version?") from None


def encode_answer(save_id: str, assignment: Assignment | None, error: str | None) -> bytes:
    if assignment is None:
        return _dumps({"error": error})
    return _dumps({"save_id": save_id, "writes": list(assignment.writes),
                   "own": sorted(assignment.own)})


def decode_answer(data: bytes) -> tuple[str, Assignment]:
    """-> (save_id, this rank's assignment); raises the coordinator's error, if any."""
    raw = _loads(data, "the coordinator's answer")
    if raw.get("error") is not None:
        raise CkptError(raw["error"])
    return raw["save_id"], Assignment(tuple(raw["writes"]), frozenset(raw["own"]))


def encode_result(entries: Mapping[int, TensorEntry] | None, files: list[FileInfo] | None,
                  error: str | None) -> bytes:
    """What a rank wrote, keyed by the index of each item in its plan (positions and checksums;
    the coordinator knows the rest), or its error. Nothing depends on the order of entries."""
    if entries is None or files is None:
        return _dumps({"error": error})
    names = {f.name: i for i, f in enumerate(files)}
    return _dumps({"files": [[f.name, f.nbytes] for f in files],
                   "entries": [[index, names[e.file], e.offset, e.checksum, list(e.blocks)]
                               for index, e in entries.items()]})


def decode_result(data: bytes, rank: int, assigned: Mapping[int, WriteItem]) -> tuple[
        dict[int, TensorEntry], list[FileInfo], str | None]:
    """-> (an entry for every item index in ``assigned``, the rank's files, None) or
    ({}, [], the rank's error). An index not assigned, reported twice or missing is refused."""
    raw = _loads(data, f"rank {rank}'s result")
    try:
        if raw.get("error") is not None:
            return {}, [], str(raw["error"])
        files = [FileInfo(name, nbytes, rank) for name, nbytes in raw["files"]]
        entries: dict[int, TensorEntry] = {}
        for index, f, offset, checksum, blocks in raw["entries"]:
            item = assigned[index]
            if index in entries:
                raise ValueError(f"item {index} ({item.key}) reported twice")
            entries[index] = TensorEntry(item.key, item.kind, item.dtype, item.shape, item.chunk,
                                         files[f].name, offset, item.nbytes, checksum, None,
                                         tuple(blocks))
        if len(entries) != len(assigned):
            missing = sorted(set(assigned) - set(entries))[:5]
            raise ValueError(f"no entry for assigned items {missing}")
        return entries, files, None
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise WireError(f"rank {rank}'s result is malformed ({exc!r})") from None


def encode_outcome(error: str | None) -> bytes:
    return _dumps({"error": error})


def decode_outcome(data: bytes) -> str | None:
    return _loads(data, "the commit outcome").get("error")
