"""The collective steps of a save, around the per-rank capture and writes: agree on a plan
before any byte is copied, and commit after every rank's bytes are durable.

agree(): each rank sends its compact plan (or its error) to the coordinator, which decides who
writes what (globalplan.py) and answers each rank with its writes and the save id; a failure
on any rank is answered with an error on every rank. Keys held alike on disjoint device meshes
are answered with "plan them again with digests" (the caller does, once: Memory.across). An
unchanged layout sends only item digests, and the coordinator reuses its previous decisions.
Then, before any file is created, the coordinator takes the location's lock (savelock.py).
conclude(): each rank sends what it wrote (or its error); the coordinator commits the manifest
only if every rank succeeded, and tells every rank the outcome; it lets go of the lock once its
cleanup has chosen what to remove.
With one process (dist.Solo) the same steps run without peers.

Owns: the order of messages and the coordinator's cached plans. Does not own: planning rules
(globalplan.py), message bytes (wire.py), transport (dist.py), the location's lock
(savelock.py), the commit itself (storage/).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ckptio.distributed import wire
from ckptio.distributed.dist import Group
from ckptio.distributed.rankplan import valued_shards
from ckptio.distributed.step import coordinate, listed
from ckptio.errors import CkptError
from ckptio.format import entryform, manifest
from ckptio.format.gcpause import paused
from ckptio.format.types import Manifest, WriteItem, Written
from ckptio.format.splice import Templates
from ckptio.format.keyrules import KeysPassed
from ckptio.planning.globalplan import (
    Assignment,
    GlobalPlan,
    RankPlan,
    across_meshes,
    check_files,
    manifest_entries,
    objects_of,
    per_rank_keys,
    plan_global,
)
from ckptio.planning.regular_items import Regular, regular_section, regular_writes
from ckptio.storage.select import compared
from ckptio.storage.store_contract import Exclusive, Store, new_save_id

__all__ = ["Agreement", "Decision", "Memory", "RankPlan", "agree", "assigned_items",
           "conclude", "decide_plans", "manifest_of", "same_path"]

Guard = contextlib.AbstractContextManager[Any]  # what conclude()'s commit runs in

# what a rank wrote: its entries keyed by item index in its plan (but its regular items'), its
# files, and its index file of its regular items' chunks (format/regular_section.py), if it wrote any


@dataclass
class Memory:
    """Plans remembered between saves: this rank's last layout fingerprint and the parts it
    published, and on the coordinator the decoded parts of the last save by fingerprint, every
    rank's fingerprint in it, and the decisions made from them."""

    fingerprint: str | None = None
    published: frozenset[str] = frozenset()  # this rank's parts published in its last save
    parts: dict[tuple[str, str], Any] = field(default_factory=dict)  # (kind, fp) -> decoded
    fingerprints: tuple[str, ...] = ()
    last: tuple[frozenset[str], GlobalPlan] | None = None
    reused: int = 0  # saves whose decisions were reused (for tests and benchmarks)
    # this rank's last tree, items and regular items: a reused layout must have the same (the
    # plan cache is the Checkpointer's, shared by its groups; this memory is one group's)
    tree: Any = None
    items: Mapping[int, WriteItem] = field(default_factory=dict)
    regular: Regular | None = None
    # keys held alike on disjoint device meshes (globalplan.across_meshes): planned per chunk
    # with digests from the save that found them on, by every rank of the group
    across: frozenset[str] = frozenset()
    # the key rules' memory on the coordinator: a reused layout's manifest is not walked again
    keys: KeysPassed = field(default_factory=KeysPassed)
    # the manifest's templates by layout: a reused layout's body is spliced, not encoded in full
    templates: Templates = field(default_factory=Templates)


@dataclass(frozen=True)
class Agreement:
    save_id: str
    assignment: Assignment
    plans: tuple[RankPlan, ...] = ()  # on the coordinator
    global_plan: GlobalPlan | None = None  # on the coordinator
    regular: frozenset[int] = frozenset()  # this rank's regular writes (in ``assignment``)
    replan: frozenset[str] = frozenset()  # keys to plan again (Memory.across), nothing else
    # whose memory the commit's key rules use (Memory.keys; a fresh one: checked in full)
    keys: KeysPassed = field(default_factory=KeysPassed, compare=False, repr=False)
    templates: Templates = field(default_factory=Templates, compare=False, repr=False)


def agree(group: Group, mine: RankPlan | None, error: BaseException | None, memory: Memory,
          path: str, reuse: bool, piece: bool = False) -> Agreement:
    """Collective step. ``reuse``: this rank's layout is unchanged since its last save (plan
    cache hit), so only digests and objects are sent. ``piece``: one rank's piece of a job's
    state (its shards need not cover their tensors). Raises on every rank if any rank failed."""
    # The plan cache matched the tensors; values of other kinds (numpy, bytes, pickled) may
    # have changed size or kind, and the tree its shape: all must match the last plan.
    reuse = (reuse and mine is not None and memory.tree == mine.tree
             and memory.items == mine.items and memory.regular == mine.regular
             and not valued_shards(mine))
    memory.tree = mine.tree if mine is not None else None
    memory.items = mine.items if mine is not None else {}
    memory.regular = mine.regular if mine is not None else None
    if group.size == 1:
        return _agree_alone(mine, error, memory, reuse, piece)
    message = None
    if mine is not None:
        try:
            message = wire.with_location(compared(path), _plan_message(group, mine, memory,
                                                                       reuse))
        except BaseException as exc:  # noqa: BLE001 - sent to the peers, then raised below
            mine, error = None, exc
    decided: list[Decision] = []  # the coordinator's decision (it answers the others)

    def decide(messages: list[bytes]) -> list[bytes]:
        plans = same_path(messages, "save")
        with paused():
            decided.append(decide_plans(plans, memory, group))
        return decided[0].answers

    try:
        answer = coordinate(group, message, error, decide, lambda failures: _refusal(path, failures))
    except BaseException:
        _forget(memory)
        raise
    if answer is None:
        _forget(memory)
        raise error  # type: ignore[misc]  # answer is None only when this rank brought one
    save_id, assignment, replan = wire.decode_answer(answer)
    if replan:
        return Agreement(save_id, assignment, replan=replan)
    regular: frozenset[int] = frozenset()
    if mine is not None and mine.regular is not None:  # this rank's regular writes: its own
        regular = frozenset(regular_writes(mine.regular, group.rank))
        assignment = Assignment(tuple(sorted({*assignment.writes, *regular})), assignment.own)
    if not decided:
        return Agreement(save_id, assignment, regular=regular, keys=memory.keys,
                         templates=memory.templates)
    return Agreement(save_id, assignment, decided[0].plans, decided[0].global_plan, regular,
                     keys=memory.keys, templates=memory.templates)


def same_path(messages: list[bytes], what: str) -> list[bytes]:
    """On the coordinator: the messages without their locations (wire.with_location); CkptError
    naming the ranks and their locations when the ranks do not all name one checkpoint (each
    would write or read its own, and the one committed would name files that are elsewhere)."""
    split = [wire.split_location(message) for message in messages]
    paths, bodies = [where for where, _ in split], [body for _, body in split]
    if len(set(paths)) > 1:
        said = "; ".join(f"rank {rank}: {where}" for rank, where in enumerate(paths)
                         if where != paths[0])
        raise CkptError(f"ranks disagree on the checkpoint: rank 0 passed {paths[0]}, {said}. "
                        f"A collective {what} is of one checkpoint: pass the same "
                        "path on every rank (with CheckpointManager, the same step), or a "
                        "process_group= of the ranks that share each path")
    return bodies


def _plan_message(group: Group, mine: RankPlan, memory: Memory, reuse: bool) -> bytes:
    """This rank's plan: its values and its layout's fingerprint. New layout parts are
    published first (group.publish: once for all ranks whose parts are equal)."""
    if not (reuse and memory.fingerprint is not None):
        parts = wire.layout_parts(mine)
        memory.fingerprint = None  # until published
        for fingerprint, data in parts.items():
            if fingerprint not in memory.published:
                group.publish(fingerprint, data)
        memory.published = frozenset(parts)
        memory.fingerprint = list(parts)[-1]
    return wire.encode_plan(mine, fp=memory.fingerprint)


def _forget(memory: Memory) -> None:
    """After a failed agreement: the next save decides everything afresh, and publishes its
    parts again (a part claimed but never stored is then stored)."""
    memory.fingerprints = ()
    memory.last = None
    memory.fingerprint = None
    memory.published = frozenset()


def _agree_alone(mine: RankPlan | None, error: BaseException | None, memory: Memory,
                 reuse: bool, piece: bool) -> Agreement:
    """One process: the same decisions, without messages."""
    if mine is None:
        memory.last = None
        raise error if error is not None else CkptError("planning failed")
    if reuse and memory.last is not None:
        memory.reused += 1
        global_plan = dataclasses.replace(memory.last[1], objects=objects_of([mine]))
    else:
        global_plan = plan_global([mine], piece=piece)
        memory.last = (frozenset(), global_plan)
    return Agreement(new_save_id(), global_plan.assignments[0], (mine,), global_plan,
                     keys=memory.keys, templates=memory.templates)


@dataclass(frozen=True)
class Decision:
    """The coordinator's decision for one save: every rank's answer, and what it decided from."""

    answers: list[bytes]
    plans: tuple[RankPlan, ...]
    global_plan: GlobalPlan | None  # None when the ranks must plan again (across_meshes)


def decide_plans(gathered: list[bytes], memory: Memory, group: Group) -> Decision:
    """On the coordinator: every rank's plan -> every rank's answer; raises CkptError when the
    ranks' plans cannot be combined (every rank then fails). Each distinct layout is fetched
    and decoded once, and kept while ranks still send it. Public so that a simulation of many
    ranks in one process (benchmarks/plan_scale.py, over a ``Solo`` group) runs the same step."""
    values: list[wire.Values] = []
    for rank, data in enumerate(gathered):
        decoded = wire.decode_plan(data, rank)
        if isinstance(decoded, str):
            raise CkptError(f"rank {rank}: {decoded}")
        values.append(decoded)
    fingerprints = tuple(v.fingerprint for v in values)
    layouts = _fetch(group, memory, "layout", set(fingerprints), wire.decode_layout)
    trees = _fetch(group, memory, "tree", {layout.tree_fp for layout in layouts.values()},
                   wire.decode_tree)
    regulars = _fetch(group, memory, "regular", {layout.regular_fp for layout in layouts.values()
                                                 if layout.regular_fp is not None},
                      wire.decode_regular)
    for fp, layout in layouts.items():
        if layout.regular_fp is not None:
            layout.check_regular(regulars[layout.regular_fp], fp)
    memory.parts = {("layout", fp): part for fp, part in layouts.items()}  # for the next save
    memory.parts.update({("tree", fp): part for fp, part in trees.items()})
    memory.parts.update({("regular", fp): part for fp, part in regulars.items()})
    all_same = fingerprints == memory.fingerprints
    memory.fingerprints = fingerprints
    plans = []
    for rank, v in enumerate(values):
        layout = layouts[v.fingerprint]
        regular = None if layout.regular_fp is None else regulars[layout.regular_fp]
        plans.append(layout.plan(rank, v, trees[layout.tree_fp], regular))
    across = across_meshes(plans)
    if across:
        return Decision([wire.encode_replan(across)] * len(plans), tuple(plans), None)
    try:
        own = per_rank_keys(plans)  # decisions reused unless replicas are known by their bytes
        if all_same and memory.last is not None and memory.last[0] == own \
                and not any(valued_shards(plan) for plan in plans):
            memory.reused += 1
            global_plan = dataclasses.replace(memory.last[1], objects=objects_of(plans))
        else:
            global_plan = plan_global(plans, own)
            memory.last = (own, global_plan)
    except CkptError as exc:
        raise CkptError(f"ranks disagree: {exc}") from None
    save_id = new_save_id()
    answers = [wire.encode_answer(save_id, a, None) for a in global_plan.assignments]
    return Decision(answers, tuple(plans), global_plan)


def _fetch(group: Group, memory: Memory, kind: str, wanted: set[str],
           decode: Callable[[bytes, str], Any]) -> dict[str, Any]:
    """The decoded parts ``wanted`` of one kind: remembered from the last save, else fetched
    (each once)."""
    out = {fp: memory.parts[kind, fp] for fp in wanted if (kind, fp) in memory.parts}
    unknown = sorted(wanted - out.keys())
    for fingerprint, data in zip(unknown, group.fetch(unknown) if unknown else []):
        out[fingerprint] = decode(data, fingerprint)
    return out


def _refusal(path: str, failures: list[str]) -> str:
    return (f"save to {path} failed before writing, on {listed(failures)}. Nothing was written; "
            "the previous checkpoint there is untouched")


def conclude(group: Group, agreement: Agreement, written: Written | None,
             error: BaseException | None, store: Store, meta: dict[str, Any], algorithm: str,
             block_nbytes: int, committed: Callable[[Manifest, bytes], None],
             held: Exclusive | None = None,
             watched: Callable[[], Guard] = contextlib.nullcontext) -> None:
    """Collective step, after this rank's writes (``written``) or its failure (``error``): the
    coordinator commits the manifest if every rank succeeded; every rank learns the outcome.
    ``committed(record, data)``: on the coordinator after the commit, with the manifest and its bytes.
    ``held``: the coordinator's claim on the store (the commit is conditional on it).
    ``watched()``: the context the store's commit runs in (the save's stall watch).
    Raises this rank's own error, else RankFailedError naming the failed ranks (with one
    process, or on the coordinator, the commit's own error)."""
    if group.size == 1:  # one process: its own result, as written, no encoding
        if error is not None:
            raise error
        assert written is not None  # internal: a rank without an error wrote
        _commit([written], [assigned_items(agreement, 0)], agreement, store, meta, algorithm,
                block_nbytes, committed, held, watched)
        return
    mine = None if written is None or error is not None else wire.encode_result(written)

    def decide(messages: list[bytes]) -> list[bytes]:
        with paused():
            assigned = [assigned_items(agreement, rank) for rank in range(len(messages))]
            results = [wire.decode_result(data, rank, assigned[rank])
                       for rank, data in enumerate(messages)]
        _commit(results, assigned, agreement, store, meta, algorithm, block_nbytes, committed,
                held, watched)
        return [b""] * len(messages)

    def failed(failures: list[str]) -> str:
        return (f"save to {store.location} failed on {listed(failures)}. Nothing was committed; the "
                "previous checkpoint there is untouched")

    if coordinate(group, mine, error, decide, failed) is None:
        raise error  # type: ignore[misc]  # None only when this rank brought one


def assigned_items(agreement: Agreement, rank: int) -> dict[int, WriteItem]:
    """Rank ``rank``'s items the coordinator assigned, by their index in its plan (what its
    result is keyed by). Its regular items' chunks are in its index file, not its result.
    Public for the same simulations as ``decide_plans``."""
    assert agreement.global_plan is not None  # internal: set on the coordinator
    plan = agreement.plans[rank]
    return {i: plan.items[i] for i in agreement.global_plan.assignments[rank].writes}


def _commit(results: list[Written],
            assigned: list[dict[int, WriteItem]], agreement: Agreement, store: Store,
            meta: dict[str, Any], algorithm: str, block_nbytes: int,
            committed: Callable[[Manifest, bytes], None], held: Exclusive | None,
            watched: Callable[[], Guard]) -> None:
    """On the coordinator, once every rank has written: build, check and commit the manifest."""
    record = manifest_of(results, assigned, agreement, meta, algorithm, block_nbytes)
    # The reader's key rules, before the commit: a manifest that would not load must not
    # replace one that does (its files are deleted once the new one is committed).
    agreement.keys.check(record, store.path_of(manifest.MANIFEST_NAME))
    data = manifest.encode(record, agreement.templates)
    with watched():
        store.commit(data, agreement.save_id, held)
    committed(record, data)


def manifest_of(results: list[Written], assigned: list[dict[int, WriteItem]],
                agreement: Agreement, meta: dict[str, Any], algorithm: str,
                block_nbytes: int) -> Manifest:
    """The manifest of every rank's results (``assigned``: each rank's written items): a row
    per chunk of the per-chunk items, a row per regular tensor and one per index file."""
    plan = agreement.global_plan
    assert plan is not None  # internal: agree() set it on the coordinator
    written = [result.entries for result in results]
    files = [info for result in results for info in result.files]
    check_files(files)
    writes = [Assignment(tuple(sorted(a)), given.own)
              for a, given in zip(assigned, plan.assignments)]
    grids, regular = regular_section(agreement.plans, plan.aliases)
    with paused():
        tensors = tuple(manifest_entries(agreement.plans, writes, written))
        return Manifest(
            version=manifest.version_for(tensors), save_id=agreement.save_id,
            checksum_algorithm=algorithm, world_size=len(results), files=tuple(files),
            tensors=tensors, bases=entryform.bases_in(tensors),
            objects=plan.objects, aliases=plan.aliases, tree=plan.tree, meta=meta,
            block_nbytes=block_nbytes, grids=grids, regular=regular,
            indexes=tuple(r.index for r in results if r.index is not None))
