"""The coordinator's half of a many-rank save: from every rank's local plan, decide who writes
what; from every rank's written entries, build the one manifest.

Replicas (ranks holding the same region of a sharded tensor, or the same bytes of a plain
tensor) are written once, by the replica with the fewest bytes to write so far, biggest groups
first, so writing is spread by bytes. Regular DTensor items are not decided here: their
writers follow from their grids (regular_items.py, whose checks plan_global runs). A plain tensor
or object whose value differs between
ranks (RNG state, data-loader position) is kept per rank, never merged. Trees are merged (keys
held by some ranks only, as under pipeline parallelism, are kept).

Owns: those decisions and every cross-rank consistency check (dtype/shape agreement, ties,
trees), with errors naming keys and ranks. Pure: dataclasses in, dataclasses out; no I/O, no
torch, no collectives (dist.py moves the bytes, wire.py encodes them).
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ckptio.errors import CkptError
from ckptio.format.types import FileInfo, Json, ObjectEntry, TensorEntry, WriteItem
from ckptio.planning.regular_items import Regular, check_regular, submesh_replicas

__all__ = ["Assignment", "GlobalPlan", "PlanConflict", "RankPlan", "across_meshes", "check_files",
           "manifest_entries", "merge_trees", "objects_of", "per_rank_keys", "plan_global"]


@dataclass(frozen=True)
class RankPlan:
    """What one rank holds. ``domains[i]``: the device mesh of DTensor item i (replicas share
    region and mesh). ``digests[i]``: checksum of item i's bytes, for every other item (plain
    tensors, TensorShard, FlatShard: replicas share region and bytes); none in a single-process
    save, where nothing is compared."""

    rank: int
    items: Mapping[int, WriteItem]  # by index in the rank's plan; regular items are in ``regular``
    sharded: frozenset[str]
    digests: Mapping[int, str]
    objects: tuple[ObjectEntry, ...]
    aliases: tuple[tuple[str, str], ...]
    tree: Json
    domains: Mapping[int, str] = field(default_factory=dict)
    regular: Regular | None = None  # its regular DTensor items (regular_items.py), shared by ranks


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
    item: WriteItem  # the first holder's
    holders: list[tuple[int, int]] = field(default_factory=list)  # (rank, item index)


class PlanConflict(CkptError):
    """Ranks disagree about the state (dtypes, shapes, ties, tree structure)."""


def plan_global(ranks: Sequence[RankPlan], own: frozenset[str] | None = None,
                piece: bool = False) -> GlobalPlan:
    """Decide every rank's writes; raise PlanConflict naming keys and ranks on disagreement.
    ``own``: per_rank_keys(ranks), when the caller has it already; ``piece``: one rank's piece
    of a job's state, whose shards need not cover their tensors (they must not overlap)."""
    _check_kinds(ranks)
    check_regular(ranks, PlanConflict)
    _check_tensor_or_value(ranks)
    aliases, skipped = _aliases(ranks)
    own = per_rank_keys(ranks) if own is None else own
    groups: dict[tuple[object, ...], _Group] = {}
    load = [0] * len(ranks)
    writes: list[list[int]] = [[] for _ in ranks]
    owned: list[set[int]] = [set() for _ in ranks]
    for plan in ranks:
        for index, item in plan.items.items():
            if (plan.rank, index) in skipped:
                continue
            if item.key in own:
                writes[plan.rank].append(index)
                owned[plan.rank].add(index)
                load[plan.rank] += item.nbytes
                continue
            if item.key in plan.sharded:
                replica_of = plan.domains.get(index) or plan.digests.get(index)
                group_key: tuple[object, ...] = (item.key, item.chunk, replica_of)
            else:
                group_key = (item.key,)
            group = groups.setdefault(group_key, _Group(item.nbytes, item))
            group.holders.append((plan.rank, index))
    _check_coverage(groups, piece)
    ordered = sorted(groups.items(), key=lambda kv: -kv[1].nbytes)  # stable: first-seen order
    for _key, group in ordered:
        if len(group.holders) == 1:
            rank, index = group.holders[0]
        else:
            rank, index = min(group.holders, key=lambda h: (load[h[0]], h[0]))
        writes[rank].append(index)
        load[rank] += group.nbytes
    assignments = tuple(Assignment(tuple(sorted(w)), frozenset(o)) for w, o in zip(writes, owned))
    return GlobalPlan(assignments, objects_of(ranks), aliases, merge_trees([p.tree for p in ranks]))


def _check_coverage(groups: dict[tuple[object, ...], _Group], piece: bool) -> None:
    """The distinct regions of each global tensor add up to exactly its elements (fewer: a
    rank's shard is missing or misplaced, allowed in a ``piece``; more: regions overlap),
    checked before anything is written rather than found by a load after the previous
    checkpoint is gone."""
    covered: dict[str, int] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for group in groups.values():
        item = group.item
        covered[item.key] = covered.get(item.key, 0) + item.chunk.numel
        shapes[item.key] = item.shape
    for key, count in covered.items():
        total = 1
        for d in shapes[key]:
            total *= d
        if count != total and not (piece and count < total):
            what = "a shard is missing or misplaced" if count < total else "shards overlap"
            raise PlanConflict(
                f"key {key!r}: the ranks' distinct shards hold {count} elements of a tensor of "
                f"{total} (shape {shapes[key]}); {what}: check the offsets of every rank's "
                "TensorShard / FlatShard / CheckpointableTensor, or that every rank passes this "
                "key")


def _check_tensor_or_value(ranks: Sequence[RankPlan]) -> None:
    """A key is a tensor on every rank holding it, or a Python value on every one."""
    tensors = {item.key: plan.rank for plan in ranks for item in plan.items.values()}
    lists = {id(p.regular): (p.rank, p.regular) for p in reversed(ranks) if p.regular is not None}
    for rank, regular in lists.values():  # each distinct list once, with its lowest rank
        tensors.update(dict.fromkeys(regular.keys, rank))
    for plan in ranks:
        for entry in plan.objects:
            if entry.key in tensors:
                raise PlanConflict(
                    f"key {entry.key!r} is a tensor on rank {tensors[entry.key]} but a "
                    f"{entry.value[0] if isinstance(entry.value, list) else 'value'} on rank "
                    f"{plan.rank}; hold the same kind of value on every rank")


def _check_kinds(ranks: Sequence[RankPlan]) -> None:
    """Every rank's chunks of a key agree on kind, dtype and global shape; a key is sharded on
    every rank holding it or on none, on one device mesh; replicas of a hand-made shard hold
    equal bytes; with peers, every item has what makes its replicas known."""
    seen: dict[str, tuple[int, WriteItem, bool, str | None]] = {}
    regions: dict[tuple[str, object], tuple[int, str | None]] = {}
    for plan in ranks:
        for index, item in plan.items.items():
            sharded = item.key in plan.sharded
            domain = plan.domains.get(index)
            if len(ranks) > 1 and domain is None and index not in plan.digests:
                raise PlanConflict(f"rank {plan.rank} sent no checksum of its tensor "
                                   f"{item.key!r}; do all ranks run the same ckptio version?")
            rank, head, head_sharded, head_domain = seen.setdefault(
                item.key, (plan.rank, item, sharded, domain))
            if sharded != head_sharded:
                raise PlanConflict(
                    f"key {item.key!r} is a sharded tensor on rank {rank if head_sharded else plan.rank}"
                    f" but a plain tensor on rank {plan.rank if head_sharded else rank}; every rank "
                    "must hold it the same way (all DTensor/TensorShard, or all plain)")
            if sharded and (item.kind, item.dtype, item.shape) != (head.kind, head.dtype, head.shape):
                raise PlanConflict(
                    f"key {item.key!r}: rank {rank} holds a shard of a {head.dtype} tensor of shape "
                    f"{head.shape}, rank {plan.rank} of a {item.dtype} tensor of shape {item.shape}")
            if domain != head_domain:
                raise PlanConflict(
                    f"key {item.key!r} is held on different device meshes by rank {rank} and rank "
                    f"{plan.rank}: two different tensors under one key (pipeline stages?); give "
                    "each stage's keys a prefix of their own")
            if sharded and domain is None:
                first = regions.setdefault((item.key, item.chunk), (plan.rank, plan.digests.get(index)))
                if first[1] != plan.digests.get(index):
                    raise PlanConflict(
                        f"key {item.key!r}: rank {first[0]} and rank {plan.rank} hold the same "
                        f"region {item.chunk.offsets}+{item.chunk.sizes} with different values; "
                        "replicas must be equal. Two tensors under one name (pipeline stages on "
                        "their own device meshes?): give each stage's keys a prefix of their own")


def across_meshes(ranks: Sequence[RankPlan]) -> frozenset[str]:
    """Sharded keys held on more than one device mesh: laid out alike on disjoint meshes
    (submesh_replicas) or, per chunk, under different meshes. Replicas or different tensors:
    only their bytes tell, so the ranks plan them again with digests (collective.py)."""
    keys = set(submesh_replicas(ranks))
    meshes: dict[str, str] = {}
    for plan in ranks:
        for index, domain in plan.domains.items():
            key = plan.items[index].key
            if meshes.setdefault(key, domain) != domain:
                keys.add(key)
    return frozenset(keys)


def per_rank_keys(ranks: Sequence[RankPlan]) -> frozenset[str]:
    """Plain keys whose bytes (or kind, dtype, shape) differ between the ranks holding them.
    Visits plain items only (a handful per rank), so a reused plan costs O(ranks)."""
    first: dict[str, tuple[str, str, tuple[int, ...], str]] = {}
    own: set[str] = set()
    for plan in ranks:
        for index, digest in plan.digests.items():
            item = plan.items[index]
            if item.key in plan.sharded:
                continue  # a hand-made shard: its digest names its replicas (plan_global)
            value = (item.kind, item.dtype, item.shape, digest)
            if first.setdefault(item.key, value) != value:
                own.add(item.key)
    return frozenset(own)


_RANK = operator.attrgetter("rank")


def objects_of(ranks: Sequence[RankPlan]) -> tuple[ObjectEntry, ...]:
    """An object equal on every rank holding it is stored once; otherwise once per rank. A
    rank's entry is kept as it is where it fits (no new object per leaf and save)."""
    if len(ranks) == 1:
        objects = ranks[0].objects
        if list(map(_RANK, objects)).count(None) == len(objects):  # as they are: one map
            return tuple(objects)
        return tuple(e if e.rank is None else ObjectEntry(e.key, e.value) for e in objects)
    by_key: dict[str, list[tuple[int, ObjectEntry]]] = {}
    for plan in ranks:
        for entry in plan.objects:
            by_key.setdefault(entry.key, []).append((plan.rank, entry))
    out: list[ObjectEntry] = []
    for key, entries in by_key.items():
        first = entries[0][1]
        if all(e.value == first.value for _rank, e in entries):
            out.append(first if first.rank is None else ObjectEntry(key, first.value))
        else:
            out.extend(ObjectEntry(key, e.value, rank) for rank, e in entries)
    return tuple(out)


def _aliases(ranks: Sequence[RankPlan]) -> tuple[tuple[tuple[str, str], ...], set[tuple[int, int]]]:
    """Tied tensors, the same on every rank holding the key (a pipeline stage that holds
    neither key has no say); -> (aliases, (rank, item index) pairs not written).

    A rank whose shard of a tied tensor is empty cannot see the tie (an empty tensor has no
    storage): its empty item of the alias key is dropped instead of failing the save."""
    union: dict[tuple[str, str], None] = {}
    for plan in ranks:
        union.update(dict.fromkeys(plan.aliases))
    skipped: set[tuple[int, int]] = set()
    for plan in ranks:
        mine = set(plan.aliases)
        if len(mine) == len(union):
            continue
        index_of = {item.key: i for i, item in plan.items.items()}
        held = {k for k, _target in mine} | {o.key for o in plan.objects}
        for key, target in union:
            if (key, target) in mine:
                continue
            index = index_of.get(key)
            if index is None and key not in held and (
                    plan.regular is None or key not in plan.regular.keys):
                continue  # the rank does not hold the key (another pipeline stage)
            if index is None and plan.regular is not None and plan.regular.chunk_is_empty(
                    key, plan.rank):
                continue  # a regular item's empty chunk: never written
            if index is None or plan.items[index].nbytes:
                holder = next(p.rank for p in ranks if (key, target) in set(p.aliases))
                raise PlanConflict(
                    f"key {key!r} is tied to {target!r} (shares its storage) on rank {holder} "
                    f"but not on rank {plan.rank}; tie (or untie) them on every rank")
            skipped.add((plan.rank, index))
    return tuple(union), skipped


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
    if tag_a == tag_b == "c" and body_a[0] == body_b[0]:  # the same namedtuple or defaultdict
        return {"c": [body_a[0], _merge(body_a[1], body_b[1], where)]}
    if a != b:
        raise PlanConflict(f"the state's structure at {where or 'the root'!r} differs between "
                           "ranks (only dicts may hold different keys on different ranks)"
                           + _hint(where))
    return a


def _hint(where: str) -> str:
    """The fix for the commonest cause: optimizers of pipeline stages, keyed by index."""
    if "param_groups" not in where.split("."):
        return ""
    return ("; an optimizer's param_groups list its parameters by index, which differ between "
            "pipeline stages: save ckptio.OptimizerState(model, optimizer) in its place (keyed "
            "by parameter name)")


def _dict_key(key: str | int) -> tuple[str, str | int]:
    return (type(key).__name__, key)


def manifest_entries(plans: Sequence[RankPlan], assignments: Sequence[Assignment],
                     written: Sequence[Mapping[int, TensorEntry]]) -> list[TensorEntry]:
    """Each rank's written entries, keyed by item index (in its ``writes`` order), marked with
    the rank where they are that rank's own value."""
    out: list[TensorEntry] = []
    for plan, assignment, entries in zip(plans, assignments, written):
        if set(entries) != set(assignment.writes):
            raise CkptError(f"rank {plan.rank} reported written items {sorted(entries)[:5]}... "
                            f"for assigned items {list(assignment.writes)[:5]}...")
        if not assignment.own:  # no rank's own values: the entries as they are, by one map
            out.extend(map(entries.__getitem__, assignment.writes))
            continue
        for index in assignment.writes:
            entry = entries[index]
            if index in assignment.own:
                entry = dataclasses.replace(entry, rank=plan.rank)
            out.append(entry)
    return out


def check_files(files: Sequence[FileInfo]) -> None:
    names = [f.name for f in files]
    if len(set(names)) != len(names):
        raise CkptError("two ranks wrote data files of the same name; is the rank of every "
                        "process distinct?")

