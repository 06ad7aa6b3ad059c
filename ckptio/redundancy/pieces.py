"""The pure part of a restart on another number of ranks from memory (redundancy/elastic.py does
the effects): which step and which copy of each old rank's piece, and which entries of those
pieces a rank of the new job needs.

- ``plan``: from every host's survey, the newest step saved by a job of another rank count of
  which every old rank's piece is held somewhere (its own first, then a partner's copy; items
  found bad before passed over), each from the first rank of a host holding it;
- ``merged``: the entries as a rank of the new job takes them: one per distinct chunk (a
  replica once), per-rank values (differing between the old ranks) from the old rank
  ``per_rank_from`` names (StateMismatchError without it), every object;
- ``needed``: of those, the ones that meet a region the rank's state holds, each with the
  byte range of it the rank reads (``byte_range``: the rows it needs; ``sub_entry``: them as
  an entry of their own).

Owns: those rules. Does not own: reading, sending or writing (elastic.py), the regions a state
holds (loading/resolve_regular.wanted_regions), the per-rank rule (loading/stored.source_rank).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ckptio.errors import StateMismatchError
from ckptio.format.flatten import flatten
from ckptio.format.types import Chunk, Manifest, ObjectEntry, TensorEntry
from ckptio.loading.stored import selector, source_rank
from ckptio.loading.resolve_regular import wanted_regions
from ckptio.planning.reshard import intersect

__all__ = ["Choice", "Found", "Held", "Regrowth", "Source", "item_id", "merged", "needed", "plan",
           "regrowths", "sub_entry", "byte_range"]

Source = tuple[str, int]  # ("own" | "copy", the rank that sends it)
Found = list[Any]  # [step, old rank, old rank count, "own" | "copy"]


@dataclass
class Choice:
    """The step found (the same on every rank)."""

    step: int
    world: int  # the rank count of the job that saved it
    sources: dict[int, Source]  # old rank -> where its piece comes from
    manifests: dict[int, Manifest]  # old rank -> its piece's manifest (decoded and validated)


def item_id(step: int, k: int, source: Source) -> str:
    return f"{source[0]}:r{k}:by{source[1]}:s{step}"


def _offers(reports: list[list[Found]], world: int, bad: set[str], only: int | None,
            above: int | None = None) -> dict[int, tuple[int, dict[int, Source]]]:
    """Per step of another rank count (newest first): (that count, the best source of each
    old rank's piece held; a piece held nowhere is left out). ``above``: steps of this rank
    count newer than it are offered too (the same-world recovery found none that new: the
    ranks restarted on other hosts, each piece in another host's memory)."""
    offers: dict[int, dict[int, list[Source]]] = {}
    worlds: dict[int, set[int]] = {}
    for holder, found in enumerate(reports):
        for step, k, w, kind in found:
            if item_id(step, k, (kind, holder)) not in bad:
                offers.setdefault(step, {}).setdefault(k, []).append((kind, holder))
            worlds.setdefault(step, set()).add(w)
    out = {}
    for step in sorted(worlds, reverse=True):
        same = world in worlds[step] and (above is None or step <= above)
        if (only is not None and step != only) or len(worlds[step]) != 1 or same:
            continue
        out[step] = (next(iter(worlds[step])), {
            k: min(usable, key=lambda s: (s[0] != "own", s[1]))
            for k, usable in offers.get(step, {}).items()})
    return out


def plan(reports: list[list[Found]], world: int, bad: set[str], only: int | None,
         above: int | None = None) -> tuple[int, int, dict[int, Source]] | None:
    """Step 2: (step, its rank count, a source per old rank), or None (``above``: _offers)."""
    for step, (old, sources) in _offers(reports, world, bad, only, above).items():
        if len(sources) == old:
            return step, old, sources
    return None


@dataclass
class Regrowth:
    """A lost old rank's piece rebuilt from its parity group (redundancy/regrow.py does it):
    positions are the group's (``members`` are old ranks), each other member's piece and block
    from a holder (a rank of this job), the result received by ``receiver``."""

    step: int
    rank: int  # the old rank whose piece is rebuilt
    group: int
    local: int
    members: list[int]
    m: int
    lost: list[int]  # positions whose piece or block is not held
    pieces: dict[int, Source]  # position -> its piece's source
    blocks: dict[int, int]  # position -> the rank holding its block
    receiver: int


Held = list[Any]  # [step, group, local, position, members (old ranks), m]: a parity block


def regrowths(reports: list[list[Found]], blocks: list[list[Held]], world: int, bad: set[str],
              only: int | None) -> tuple[int, list[Regrowth]] | None:
    """The newest step of another rank count that misses pieces every one of which its parity
    rebuilds (at most m lost positions in its group), with those rebuilds; None when the
    newest step whose pieces are all held comes first, or none can be rebuilt. Rebuilds found
    bad before (``regrow:r<rank>:s<step>``) are passed over."""
    held: dict[tuple[int, int, int], dict[int, int]] = {}
    groups: dict[tuple[int, int, int], tuple[list[int], int]] = {}
    for holder, found in enumerate(blocks):
        for step, group, local, position, members, m in found:
            held.setdefault((step, group, local), {}).setdefault(position, holder)
            groups[(step, group, local)] = (list(members), m)
    for step, (old, sources) in _offers(reports, world, bad, only).items():
        missing = [k for k in range(old) if k not in sources]
        if not missing:
            return None  # a newer step is whole: nothing to rebuild
        rebuilt = [r for k in missing if f"regrow:r{k}:s{step}" not in bad
                   if (r := _regrowth(step, k, sources, held, groups)) is not None]
        if len(rebuilt) == len(missing):
            return step, rebuilt
    return None


def _regrowth(step: int, k: int, sources: dict[int, Source],
              held: dict[tuple[int, int, int], dict[int, int]],
              groups: dict[tuple[int, int, int], tuple[list[int], int]]) -> Regrowth | None:
    for (s, group, local), (members, m) in groups.items():
        if s != step or k not in members:
            continue
        blocks = held[(s, group, local)]
        ok = [j for j, r in enumerate(members) if r in sources and j in blocks]
        lost = [j for j in range(len(members)) if j not in ok]
        if len(lost) > m or not ok:
            return None
        return Regrowth(step, k, group, local, members, m, lost,
                        {j: sources[members[j]] for j in ok}, {j: blocks[j] for j in ok},
                        blocks[ok[0]])
    return None


def merged(choice: Choice, rank: int, world: int, policy: Any) -> tuple[
        list[tuple[int, int]], list[ObjectEntry]]:
    """The job's entries as this rank takes them: (old rank, index in its manifest) per
    tensor entry (a chunk held alike by several pieces once), and the objects."""
    chunks: dict[tuple[Any, ...], list[tuple[int, int]]] = {}
    values: dict[str, list[tuple[int, ObjectEntry]]] = {}
    for k, record in sorted(choice.manifests.items()):
        for i, t in enumerate(record.tensors):
            chunks.setdefault((t.key, t.chunk.offsets, t.chunk.sizes), []).append((k, i))
        for o in record.objects:
            values.setdefault(o.key, []).append((k, o))
    kept, objects, per_rank = [], [], []
    for (key, offsets, sizes), held in chunks.items():
        first = choice.manifests[held[0][0]].tensors[held[0][1]]
        if len({choice.manifests[k].tensors[i].checksum for k, i in held}) == 1:
            kept.append(held[0])
        elif tuple(sizes) != first.shape:
            raise StateMismatchError(
                f"key {key!r}: the pieces of step {choice.step} hold its chunk at "
                f"{list(offsets)} with other bytes on ranks {[k for k, _ in held]} (replicas "
                "that differ): the state saved was not consistent across ranks")
        else:
            per_rank.append((key, held))
    for key, entries in values.items():
        if all(o.value == entries[0][1].value for _k, o in entries):
            objects.append(entries[0][1])
        else:
            per_rank.append((key, [(k, -1) for k, _o in entries]))
    if not per_rank:
        return kept, objects
    src = source_rank(policy, rank, world, choice.world)
    if src is None:
        raise StateMismatchError(
            f"keys {sorted(k for k, _ in per_rank)[:10]} hold each rank's own value, saved by "
            f"{choice.world} ranks; this job runs {world} ranks, so which rank's value to take is "
            "not known. Pass per_rank_from=0 (take rank 0's), a mapping or function new rank -> "
            "saved rank, or keys=... to leave them out")
    for key, held in per_rank:
        for k, i in held:
            if k == src and i >= 0:
                kept.append((k, i))
            elif k == src:
                objects.append(next(o for kk, o in values[key] if kk == k))
    return kept, objects


def needed(choice: Choice, kept: list[tuple[int, int]], state: Any,
           keys: Any) -> list[tuple[int, int, int, int]]:
    """The kept entries whose chunk meets a region this rank's state holds, each as (old rank,
    index, the byte range [lo, hi) of it the rank reads: ``byte_range``); a key the state
    lacks: whole, so the load reports it as it would."""
    select = selector(keys)
    stored = {choice.manifests[k].tensors[i].key for k, i in kept}
    aliases = dict(choice.manifests[min(choice.manifests)].aliases)
    wants = wanted_regions(stored, aliases, flatten(state), select)
    out = []
    for k, i in kept:
        t = choice.manifests[k].tensors[i]
        if not select(t.key):
            continue
        want = wants.get(t.key)
        try:
            box = None if want is None else intersect(t.chunk, want)
        except ValueError:  # another number of dimensions: the load names the mismatch
            want = box = None
        if want is None or box is not None:
            lo, hi = byte_range(t, box, choice.manifests[k].block_nbytes)
            out.append((k, i, lo, hi))
    return out


def byte_range(t: TensorEntry, box: Chunk | None, block_nbytes: int) -> tuple[int, int]:
    """The bytes of entry ``t`` a rank that reads ``box`` of its chunk (None: all) needs: the
    rows (dim 0) of the chunk that ``box`` meets, whole rows, so they are a chunk of their own
    (``sub_entry``); the whole entry where it is coded, permuted, a rank's own value, not a
    tensor, or more than one block with no block checksums to check part of it against."""
    whole = (0, t.extent_nbytes)
    rows = t.chunk.sizes[0] if t.chunk.sizes else 0
    if (box is None or t.kind != "tensor" or t.coded or t.order or t.rank is not None
            or t.chunk.flat or not rows or t.nbytes % rows
            or (t.nbytes > block_nbytes and not t.blocks)):
        return whole
    per, first = t.nbytes // rows, box.offsets[0] - t.chunk.offsets[0]
    return first * per, (first + box.sizes[0]) * per


def sub_entry(t: TensorEntry, lo: int, hi: int) -> TensorEntry:
    """Bytes [lo, hi) of ``t`` (a ``byte_range`` of it: whole rows) as an entry of their own:
    its chunk those rows; file, offset and checksums left to the caller."""
    if (lo, hi) == (0, t.extent_nbytes):
        return t
    per = t.nbytes // t.chunk.sizes[0]
    offsets = (t.chunk.offsets[0] + lo // per, *t.chunk.offsets[1:])
    sizes = ((hi - lo) // per, *t.chunk.sizes[1:])
    return dataclasses.replace(t, chunk=Chunk(offsets, sizes), nbytes=hi - lo)
