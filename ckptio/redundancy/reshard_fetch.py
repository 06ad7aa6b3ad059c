"""The exchange of a restart on another number of ranks (elastic.py): each rank receives, from
the ranks holding the old job's pieces, only the bytes of their entries its state needs (the
rows of each chunk its shards meet: pieces.needed), into one buffer of this process's memory;
nothing is written to a store on the way.

1. layout: a receiver's buffer holds its ranges grouped by holder (one contiguous section per
   holder), each range at an aligned offset; holder and receiver compute it alike;
2. read: each holder reads its sections; a whole entry is checked against its checksum, a part
   of one against the checksums of the blocks it meets (their margins read beside it), and
   the part's own checksums are computed for the receiver's manifest;
3. exchange: every section sent, each received in place;
4. install: the buffer adopted as a file of this process's memory (``mem://``, no copy) under a
   manifest of the ranges received, each one an entry: the caller loads it (every byte checked
   against the holders' checksums) and removes it.

Owns: those steps. Does not own: the search and its plan (elastic.py, pieces.py), the load.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from ckptio.alignment import BLOCK, align_down, align_up
from ckptio.errors import CkptError
from ckptio.format import checksum
from ckptio.format.manifest import encode, version_for
from ckptio.format.types import FileInfo, ObjectEntry, TensorEntry
from ckptio.storage.memory.memory_store import MemoryStore
from ckptio.storage.store_contract import TreeStore, new_save_id
from ckptio.redundancy import marks, peers
from ckptio.redundancy.pieces import Choice, sub_entry

__all__ = ["Fetched", "Need", "Placed", "exchange", "install", "layout", "read", "section",
           "store_of", "zero_gaps"]

Need = tuple[int, int, int, int]  # (old rank, index in its manifest, lo, hi): an entry's bytes
Placed = tuple[int, int, int, int, int]  # a Need and its offset in the receiver's buffer
Sums = list[Any]  # [old rank, index, whole checksum, [block checksums]] of a part of an entry


@dataclass
class Fetched:
    """What a rank received for its piece: its ranges placed, the objects, the buffer, the
    checksums of the parts of entries, the bytes received from other ranks."""

    choice: Choice
    placed: list[Placed]
    objects: list[ObjectEntry]
    data: torch.Tensor
    sums: list[Sums]
    received: int
    error: CkptError | None = None  # its exchange failed: raised where it is installed


def store_of(root: str, step: int, k: int, kind: str) -> TreeStore:
    """Where old rank ``k``'s piece of ``step`` lies on this host ("own" or "copy"), or in
    this process's memory ("rebuilt": rebuilt from parity by this rank, regrow.py)."""
    if kind == "rebuilt":
        return MemoryStore(f"mem://ckptio-regrow/{root.strip('/')}/step-{step}/r{k}")
    tree = marks.tree_of(root)
    if kind == "own":
        return tree.child(marks.rank_name(k)).child(f"step-{step}")
    return marks.held(tree, step).child(marks.copy_name(k))


def _holder(choice: Choice, k: int) -> int:
    return choice.sources[k][1]


def layout(choice: Choice, needs: list[Need]) -> tuple[list[Placed], int]:
    """Step 1: a receiver's buffer -> (its ranges placed, its size)."""
    placed, at = [], 0
    for k, i, lo, hi in sorted(needs, key=lambda e: _holder(choice, e[0])):
        placed.append((k, i, lo, hi, at))
        at = align_up(at + hi - lo)
    return placed, max(at, BLOCK)


def section(choice: Choice, placed: list[Placed], holder: int) -> tuple[list[Placed], int, int]:
    """``holder``'s ranges of a layout and the bytes [lo, hi) of the buffer they span."""
    mine = [e for e in placed if _holder(choice, e[0]) == holder]
    if not mine:
        return [], 0, 0
    last = mine[-1]
    return mine, mine[0][4], last[4] + last[3] - last[2]


def zero_gaps(data: torch.Tensor, placed: list[Placed], lo: int) -> None:
    """Zero the bytes of ``data`` (the buffer's from ``lo`` on) that no range covers."""
    at = lo
    for _k, _i, a, b, offset in placed:
        data[at - lo:offset - lo].zero_()
        at = offset + b - a
    data[at - lo:].zero_()


def read(ctx: Any, choice: Choice, layouts: list[tuple[list[Placed], int]],
         out: torch.Tensor) -> tuple[dict[int, torch.Tensor], dict[int, list[Sums]],
                                     dict[int, str]]:
    """Step 2: this rank's sections of every rank's buffer (its own read in place into
    ``out``) -> ({receiver: section}, {receiver: the checksums of its parts of entries},
    {old rank: why} for a piece that fails its check: nothing else then)."""
    sections: dict[int, torch.Tensor] = {}
    sums: dict[int, list[Sums]] = {}
    block_nbytes = choice.manifests[min(choice.manifests)].block_nbytes
    for receiver, (placed, _size) in enumerate(layouts):
        mine, lo, hi = section(choice, placed, ctx.rank)
        if not mine:
            continue
        buffer = out[lo:hi] if receiver == ctx.rank else torch.empty(hi - lo, dtype=torch.uint8)
        if receiver != ctx.rank:
            zero_gaps(buffer, mine, lo)
        view = buffer.numpy().data.cast("B") if buffer.numel() else memoryview(bytearray())
        for k, i, a, b, offset in mine:
            into = view[offset - lo:offset - lo + b - a]
            why = _read_range(ctx, choice, k, i, a, into)
            if why is not None:
                return {}, {}, {k: why}
            if (a, b) != (0, choice.manifests[k].tensors[i].extent_nbytes):
                whole, blocks = _digests(choice, k, into, block_nbytes)
                sums.setdefault(receiver, []).append([k, i, whole, list(blocks)])
        sections[receiver] = buffer
    return sections, sums, {}


def _digests(choice: Choice, k: int, data: memoryview, block_nbytes: int) -> tuple[
        str, tuple[str, ...]]:
    hasher = checksum.BlockHasher(choice.manifests[k].checksum_algorithm, block_nbytes)
    hasher.update(data)
    return hasher.digests()


def _read_range(ctx: Any, choice: Choice, k: int, i: int, a: int,
                into: memoryview) -> str | None:
    """Read bytes [a, a + len(into)) of entry ``i`` of old rank ``k``'s piece into ``into``,
    checked: -> None, or why it fails."""
    record = choice.manifests[k]
    t = record.tensors[i]
    store = store_of(ctx.root, choice.step, k, choice.sources[k][0])
    whole = (a, len(into)) == (0, t.extent_nbytes)
    step = record.block_nbytes if t.blocks and not whole else max(t.extent_nbytes, 1)
    first, end = align_down(a, step), min(align_up(a + len(into), step), t.extent_nbytes)
    parts = [(first, memoryview(bytearray(a - first))), (a, into),
             (a + len(into), memoryview(bytearray(end - a - len(into))))]
    for at, view in parts:
        why = _read_part(store, t, at, view)
        if why is not None:
            return why
    if t.coded:  # a coded entry is checked where it is decoded, by the load
        return None
    stored = t.blocks if t.blocks and not whole else (t.checksum,)
    for n, (lo, hi) in enumerate(_blocks(first, end, step), start=first // step):
        got = (checksum.entry_checksum(record.checksum_algorithm, record.block_nbytes, into)
               if whole else _hash(record.checksum_algorithm, parts, lo, hi))
        if got != stored[n]:
            return (f"{store.path_of(t.file)}: key {t.key!r}, bytes [{t.offset + lo}, "
                    f"{t.offset + hi}) do not match their checksum (corrupted)")
    return None


def _read_part(store: TreeStore, t: TensorEntry, at: int, into: memoryview) -> str | None:
    if not len(into):
        return None
    try:
        got = store.read_into(t.file, into, t.offset + at)
    except (CkptError, OSError) as exc:
        return f"{store.path_of(t.file)}: {type(exc).__name__}: {exc}"
    if got != len(into):
        return (f"{store.path_of(t.file)}: {got} bytes at {t.offset + at}, key {t.key!r} has "
                f"{len(into)} there")
    return None


def _blocks(lo: int, hi: int, step: int) -> list[tuple[int, int]]:
    return [(at, min(at + step, hi)) for at in range(lo, hi, step)] or [(lo, hi)]


def _hash(algorithm: str, parts: list[tuple[int, memoryview]], lo: int, hi: int) -> str:
    """The primitive hash of bytes [lo, hi) of an entry, held across ``parts`` (start, view)."""
    hasher = checksum.new_hasher(algorithm)
    for at, view in parts:
        a, b = max(lo, at), min(hi, at + len(view))
        if b > a:
            hasher.update(view[a - at:b - at])
    return hasher.hexdigest()


def exchange(ctx: Any, choice: Choice, sections: dict[int, torch.Tensor],
             placed: list[Placed], out: torch.Tensor) -> int:
    """Step 3: send every rank its sections; receive each other holder's into ``out`` in
    place -> the bytes received."""
    works = [peers.send(ctx.transfers, data, r) for r, data in sections.items() if r != ctx.rank]
    received = 0
    for holder in sorted({_holder(choice, e[0]) for e in placed} - {ctx.rank}):
        _mine, lo, hi = section(choice, placed, holder)
        peers.recv_into(ctx.transfers, out[lo:hi], holder)
        received += hi - lo
    for work in works:
        if work is not None:
            work.wait()
    return received


def install(ctx: Any, fetched: Fetched) -> MemoryStore:
    """Step 4: what this rank received as a checkpoint in this process's memory -> its store
    (remove it after the load)."""
    choice, save_id = fetched.choice, new_save_id()
    name, size = f"data-{save_id}-r00000-0000.bin", fetched.data.numel()
    sums = {(int(k), int(i)): (str(w), tuple(b)) for k, i, w, b in fetched.sums}
    tensors = []
    for k, i, a, b, offset in fetched.placed:
        t = sub_entry(choice.manifests[k].tensors[i], a, b)
        if (k, i) in sums:
            t = dataclasses.replace(t, checksum=sums[(k, i)][0], blocks=sums[(k, i)][1])
        tensors.append(dataclasses.replace(t, file=name, offset=offset))
    base = choice.manifests[min(choice.manifests)]
    record = dataclasses.replace(
        base, version=version_for(tuple(tensors)), save_id=save_id, world_size=1,
        files=(FileInfo(name, size, 0),), tensors=tuple(tensors),
        objects=tuple(fetched.objects),
        meta={**base.meta, "piece": {"rank": ctx.rank, "world_size": ctx.world}})
    store = MemoryStore(f"mem://ckptio-restart/step-{choice.step}-{save_id}-r{ctx.rank}")
    store.prepare()
    data = fetched.data.numpy().data.cast("B") if size else memoryview(bytearray())
    store.adopt_file(name, data)
    store.commit(encode(record), save_id)
    return store
