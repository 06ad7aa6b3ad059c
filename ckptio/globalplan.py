"""The coordinator's half of a many-rank save: from every rank's local plan, decide who writes
what; from every rank's written entries, build the one manifest.

Replicas (ranks holding the same region of a sharded tensor, or the same bytes of a plain
tensor) are written once, by the replica with the fewest bytes to write so far, biggest groups
first, so writing is spread by bytes. A plain tensor or object whose value differs between
ranks (RNG state, data-loader position) is kept per rank, never merged. Trees are merged (keys
held by some ranks only, as under pipeline parallelism, are kept).

Owns: those decisions and every cross-rank consistency check (dtype/shape agreement, ties,
trees), with errors naming keys and ranks. Pure: dataclasses in, dataclasses out; no I/O, no
torch, no collectives (dist.py moves the bytes, wire.py encodes them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from .errors import CkptError
from .types import FileInfo, Json, ObjectEntry, TensorEntry, WriteItem


@dataclass(frozen=True)
class RankPlan:
    """What one rank holds. ``digests[i]``: checksum of plain item i's bytes (None for sharded
    items, and in single-rank saves, where nothing is compared)."""

    rank: int
    items: tuple[WriteItem, ...]
    sharded: frozenset[str]
    digests: tuple[str | None, ...]
    objects: tuple[ObjectEntry, ...]
    aliases: tuple[tuple[str, str], ...]
    tree: Json


@dataclass(frozen=True)
class Assignment:
    """One rank's part: indices of its items it writes, and which of those are its own value."""

    writes: tuple[int, ...]
    own: frozenset[int] = frozenset()


@dataclass(frozen=True)
class GlobalPlan:
    assignments: tuple[Assignment, ...]
    objects: tuple[ObjectEntry, ...]
    aliases: tuple[tuple[str, str], ...]
    tree: Json


@dataclass
class _Group:
    """Ranks holding one region (or one plain key): the write goes to one of them."""

    nbytes: int
    holders: list[tuple[int, int]] = field(default_factory=list)  # (rank, item index)


class PlanConflict(CkptError):
    """Ranks disagree about the state (dtypes, shapes, ties, tree structure)."""


def plan_global(ranks: Sequence[RankPlan]) -> GlobalPlan:
    """Decide every rank's writes; raise PlanConflict naming keys and ranks on disagreement."""
    _check_kinds(ranks)
    own = per_rank_keys(ranks)
    groups: dict[tuple[object, ...], _Group] = {}
    load = [0] * len(ranks)
    writes: list[list[int]] = [[] for _ in ranks]
    owned: list[set[int]] = [set() for _ in ranks]
    for plan in ranks:
        for index, item in enumerate(plan.items):
            if item.key in own:
                writes[plan.rank].append(index)
                owned[plan.rank].add(index)
                load[plan.rank] += item.nbytes
                continue
            group_key = (item.key, item.chunk) if item.key in plan.sharded else (item.key,)
            group = groups.setdefault(group_key, _Group(item.nbytes))
            group.holders.append((plan.rank, index))
    ordered = sorted(groups.items(), key=lambda kv: -kv[1].nbytes)  # stable: first-seen order
    for _key, group in ordered:
        if len(group.holders) == 1:
            rank, index = group.holders[0]
        else:
            rank, index = min(group.holders, key=lambda h: (load[h[0]], h[0]))
        writes[rank].append(index)
        load[rank] += group.nbytes
    assignments = tuple(Assignment(tuple(sorted(w)), frozenset(o)) for w, o in zip(writes, owned))
    return GlobalPlan(assignments, objects_of(ranks), _aliases(ranks), merge_trees([p.tree for p in ranks]))


def _check_kinds(ranks: Sequence[RankPlan]) -> None:
    """Every rank's chunks of a key agree on kind, dtype and global shape; a key is sharded on
    every rank holding it or on none."""
    seen: dict[str, tuple[int, WriteItem, bool]] = {}
    for plan in ranks:
        for item in plan.items:
            sharded = item.key in plan.sharded
            first = seen.setdefault(item.key, (plan.rank, item, sharded))
            rank, head, head_sharded = first
            if sharded != head_sharded:
                raise PlanConflict(
                    f"key {item.key!r} is a sharded tensor on rank {rank if head_sharded else plan.rank}"
                    f" but a plain tensor on rank {plan.rank if head_sharded else rank}; every rank "
                    "must hold it the same way (all DTensor/TensorShard, or all plain)")
            if sharded and (item.kind, item.dtype, item.shape) != (head.kind, head.dtype, head.shape):
                raise PlanConflict(
                    f"key {item.key!r}: rank {rank} holds a shard of a {head.dtype} tensor of shape "
                    f"{head.shape}, rank {plan.rank} of a {item.dtype} tensor of shape {item.shape}")


def per_rank_keys(ranks: Sequence[RankPlan]) -> frozenset[str]:
    """Plain keys whose bytes (or dtype, shape) differ between the ranks holding them."""
    first: dict[str, tuple[str, str, tuple[int, ...], str | None]] = {}
    own: set[str] = set()
    for plan in ranks:
        for item, digest in zip(plan.items, plan.digests):
            if item.key in plan.sharded:
                continue
            value = (item.kind, item.dtype, item.shape, digest)
            if first.setdefault(item.key, value) != value or (digest is None and len(ranks) > 1):
                own.add(item.key)
    return frozenset(own)


def objects_of(ranks: Sequence[RankPlan]) -> tuple[ObjectEntry, ...]:
    """An object equal on every rank holding it is stored once; otherwise once per rank."""
    by_key: dict[str, list[ObjectEntry]] = {}
    for plan in ranks:
        for entry in plan.objects:
            by_key.setdefault(entry.key, []).append(ObjectEntry(entry.key, entry.value, plan.rank))
    out: list[ObjectEntry] = []
    for key, entries in by_key.items():
        if len(ranks) == 1 or all(e.value == entries[0].value for e in entries):
            out.append(ObjectEntry(key, entries[0].value))
        else:
            out.extend(entries)
    return tuple(out)


def _aliases(ranks: Sequence[RankPlan]) -> tuple[tuple[str, str], ...]:
    first = ranks[0].aliases
    for plan in ranks[1:]:
        if set(plan.aliases) != set(first):
            differ = sorted(set(plan.aliases) ^ set(first))[:3]
            raise PlanConflict(
                f"tied tensors differ between rank {ranks[0].rank} and rank {plan.rank}: {differ} "
                "share storage on one and not the other; tie (or untie) them on every rank")
    return first


def merge_trees(trees: Sequence[Json]) -> Json:
    """One tree holding every rank's keys: dicts are merged key by key (pipeline stages hold
    different layers); any other node must be the same on every rank that has it."""
    merged = trees[0]
    for tree in trees[1:]:
        if tree != merged:
            merged = _merge(merged, tree, "")
    return merged


def _merge(a: Json, b: Json, where: str) -> Json:
    (tag_a, body_a), = a.items()
    (tag_b, body_b), = b.items()
    if tag_a == tag_b == "d":
        out = [list(pair) for pair in body_a]
        index = {_dict_key(k): i for i, (k, _v) in enumerate(body_a)}
        for k, child in body_b:
            if _dict_key(k) in index:
                i = index[_dict_key(k)]
                out[i][1] = _merge(out[i][1], child, f"{where}.{k}" if where else str(k))
            else:
                out.append([k, child])
        return {"d": out}
    if tag_a == tag_b == "s":
        return {"s": _merge(body_a, body_b, where)}
    if a != b:
        raise PlanConflict(f"the state's structure at {where or 'the root'!r} differs between "
                           "ranks (only dicts may hold different keys on different ranks)")
    return a


def _dict_key(key: str | int) -> tuple[str, str | int]:
    return (type(key).__name__, key)


def manifest_entries(plans: Sequence[RankPlan], assignments: Sequence[Assignment],
                     written: Sequence[Sequence[TensorEntry]]) -> list[TensorEntry]:
    """Each rank's written entries (in its ``writes`` order), marked with the rank where they
    are that rank's own value."""
    out: list[TensorEntry] = []
    for plan, assignment, entries in zip(plans, assignments, written):
        if len(entries) != len(assignment.writes):
            raise CkptError(f"rank {plan.rank} reported {len(entries)} written entries for "
                            f"{len(assignment.writes)} assigned writes")
        for index, entry in zip(assignment.writes, entries):
            if index in assignment.own:
                entry = TensorEntry(entry.key, entry.kind, entry.dtype, entry.shape, entry.chunk,
                                    entry.file, entry.offset, entry.nbytes, entry.checksum,
                                    plan.rank, entry.blocks)
            out.append(entry)
    return out


def check_files(files: Sequence[FileInfo]) -> None:
    names = [f.name for f in files]
    if len(set(names)) != len(names):
        raise CkptError("two ranks wrote data files of the same name; is the rank of every "
                        "process distinct?")

