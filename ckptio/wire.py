"""The compact messages ranks exchange during a save: each rank's plan to the coordinator, the
coordinator's answer, each rank's written entries. JSON bytes (never pickle): positional lists,
no field names, so a 1000-tensor rank sends tens of kB.

Owns: encoding and decoding those messages, with a check on every field a peer sent. Does not
own: what they mean (globalplan.py) or moving them (dist.py).
"""

from __future__ import annotations

import json
from typing import Any

from .errors import CkptError
from .globalplan import Assignment, RankPlan
from .types import Chunk, FileInfo, ObjectEntry, TensorEntry, WriteItem


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


def encode_plan(plan: RankPlan | None, error: str | None = None, same_as: str | None = None) -> bytes:
    """A rank's plan; or its error; or (``same_as``) only the digests of items unchanged since
    the plan whose fingerprint is ``same_as``."""
    if plan is None:
        return _dumps({"error": error})
    # Values (digests of plain tensors, inline objects) go every time; only the layout may be
    # replaced by a reference to the last one.
    body: dict[str, Any] = {"rank": plan.rank, "digests": list(plan.digests),
                            "objects": [[o.key, o.value] for o in plan.objects]}
    if same_as is not None:
        body["same_as"] = same_as
    else:
        body.update(items=[_item(i) for i in plan.items], sharded=sorted(plan.sharded),
                    aliases=[list(a) for a in plan.aliases], tree=plan.tree)
    return _dumps(body)


def decode_plan(data: bytes, rank: int, cached: RankPlan | None,
                fingerprint: str | None) -> tuple[RankPlan | None, str | None]:
    """-> (plan, None) or (None, the rank's error). A ``same_as`` message is resolved against
    ``cached`` (the coordinator's copy of that rank's last plan, of ``fingerprint``)."""
    raw = _loads(data, f"rank {rank}'s plan")
    try:
        if raw.get("error") is not None:
            return None, str(raw["error"])
        digests = tuple(raw["digests"])
        objects = tuple(ObjectEntry(k, v) for k, v in raw["objects"])
        if "same_as" in raw:
            if cached is None or raw["same_as"] != fingerprint:
                return None, "its cached plan does not match the coordinator's (internal)"
            if len(digests) != len(cached.items):
                raise ValueError(f"{len(digests)} digests for {len(cached.items)} items")
            return RankPlan(rank, cached.items, cached.sharded, digests, objects,
                            cached.aliases, cached.tree), None
        return RankPlan(
            rank, tuple(_unitem(i) for i in raw["items"]), frozenset(raw["sharded"]), digests,
            objects, tuple((a, b) for a, b in raw["aliases"]), raw["tree"]), None
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


def encode_result(entries: list[TensorEntry] | None, files: list[FileInfo] | None,
                  error: str | None) -> bytes:
    """What a rank wrote (positions and checksums; the coordinator knows the rest) or its error."""
    if entries is None or files is None:
        return _dumps({"error": error})
    names = {f.name: i for i, f in enumerate(files)}
    return _dumps({"files": [[f.name, f.nbytes] for f in files],
                   "entries": [[names[e.file], e.offset, e.checksum, list(e.blocks)] for e in entries]})


def decode_result(data: bytes, rank: int, items: list[WriteItem]) -> tuple[
        list[TensorEntry], list[FileInfo], str | None]:
    """-> (entries for ``items``, the rank's files, None) or ([], [], the rank's error)."""
    raw = _loads(data, f"rank {rank}'s result")
    try:
        if raw.get("error") is not None:
            return [], [], str(raw["error"])
        files = [FileInfo(name, nbytes, rank) for name, nbytes in raw["files"]]
        if len(raw["entries"]) != len(items):
            raise ValueError(f"{len(raw['entries'])} entries for {len(items)} items")
        entries = [TensorEntry(i.key, i.kind, i.dtype, i.shape, i.chunk, files[f].name, offset,
                               i.nbytes, checksum, None, tuple(blocks))
                   for i, (f, offset, checksum, blocks) in zip(items, raw["entries"])]
        return entries, files, None
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise WireError(f"rank {rank}'s result is malformed ({exc!r})") from None


def encode_outcome(error: str | None) -> bytes:
    return _dumps({"error": error})


def decode_outcome(data: bytes) -> str | None:
    return _loads(data, "the commit outcome").get("error")
