"""The collective steps of a save, around the per-rank capture and writes: agree on a plan
before any byte is copied, and commit after every rank's bytes are durable.

agree(): each rank sends its compact plan (or its error) to the coordinator, which decides who
writes what (globalplan.py) and answers each rank with its writes and the save id; a failure
on any rank is answered with an error on every rank. An unchanged layout sends only item
digests, and the coordinator reuses its previous decisions. exclusive(): in each rank's save
thread, before any file is created, the coordinator takes the lock of the checkpoint directory
(commit.lock: one save at a time per path, across processes) and tells every rank whether it
has it. conclude(): each rank sends what it wrote (or its error); the coordinator commits the
manifest only if every rank succeeded, and tells every rank the outcome; it lets go of the lock
once its cleanup has chosen what to remove. With one process (dist.Solo) the same steps run
without peers.

Owns: the order of messages and the coordinator's cached plans. Does not own: planning rules
(globalplan.py), message bytes (wire.py), transport (dist.py), the commit itself (commit.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash

from ckptio.storage import commit
from ckptio.format import manifest
from ckptio.distributed import wire
from ckptio.distributed.dist import COORDINATOR, Group
from ckptio.errors import CheckpointLockedError, CkptError, RankFailedError
from ckptio.format.flatten import FlatState
from ckptio.format.gcpause import paused
from ckptio.planning.globalplan import (Assignment, GlobalPlan, RankPlan, check_files, manifest_entries, objects_of, per_rank_keys, plan_global)
from ckptio.planning.plan import SavePlan
from ckptio.format.types import FileInfo, Manifest, TensorEntry, WriteItem


@dataclass
class Memory:
    """Plans remembered between saves: this rank's last fingerprint, and on the coordinator
    every rank's last plan and the decisions made from them."""

    fingerprint: str | None = None
    plans: dict[int, tuple[str, RankPlan]] = field(default_factory=dict)
    last: tuple[frozenset[str], GlobalPlan] | None = None
    pending: tuple[tuple[RankPlan, ...], GlobalPlan] | None = None  # this save's, until agreed
    reused: int = 0  # saves whose decisions were reused (for tests and benchmarks)
    tree: Any = None  # this rank's last tree and items (a reused layout must have the same)
    items: tuple[WriteItem, ...] = ()


@dataclass(frozen=True)
class Agreement:
    save_id: str
    assignment: Assignment
    plans: tuple[RankPlan, ...] = ()  # on the coordinator
    global_plan: GlobalPlan | None = None  # on the coordinator


def local_plan(group: Group, plan: SavePlan, sources: dict[str, torch.Tensor],
               flat: FlatState) -> RankPlan:
    """This rank's RankPlan; plain items carry a digest of their bytes when there are peers."""
    domains = {index: plan.domains[i.key] for index, i in enumerate(plan.items)
               if i.key in plan.domains}
    digests: dict[int, str] = {}
    if group.size > 1:
        digests = {index: _digest(sources[i.key]) for index, i in enumerate(plan.items)
                   if index not in domains}
    return RankPlan(group.rank, plan.items, plan.sharded, digests, plan.objects, plan.aliases,
                    flat.tree, domains)


def _valued_shards(plan: RankPlan) -> bool:
    """Whether replicas of some sharded item are known only by its bytes (TensorShard,
    FlatShard): then who writes what can change with the values, and is decided afresh."""
    return any(plan.items[i].key in plan.sharded for i in plan.digests)


def _digest(t: torch.Tensor) -> str:
    """xxh3 of a plain tensor's bytes (copied to host if needed): equal on two ranks means the
    same value, so it is stored once."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.numel() == 0:
        return xxhash.xxh3_64_hexdigest(b"")
    return xxhash.xxh3_64_hexdigest(memoryview(t.view(-1).view(torch.uint8).numpy()))


def agree(group: Group, mine: RankPlan | None, error: BaseException | None, memory: Memory,
          path: str, reuse: bool) -> Agreement:
    """Collective. ``reuse``: this rank's layout is unchanged since its last save (plan cache
    hit), so only digests and objects are sent. Raises on every rank if any rank failed."""
    # The plan cache matched the tensors; values of other kinds (numpy, bytes, pickled) may
    # have changed size or kind, and the tree its shape: all must match the last plan.
    reuse = (reuse and mine is not None and memory.tree == mine.tree
             and memory.items == mine.items and not _valued_shards(mine))
    memory.tree = mine.tree if mine is not None else None
    memory.items = mine.items if mine is not None else ()
    if group.size == 1:
        return _agree_alone(mine, error, memory, reuse)
    if mine is None:
        message = wire.encode_plan(None, error=_describe(error))
    else:
        if reuse and memory.fingerprint is not None:
            message = wire.encode_plan(mine, same_as=memory.fingerprint)
        else:
            layout = wire.layout_bytes(mine)
            fingerprint = wire.fingerprint(layout)
            same = fingerprint == memory.fingerprint
            memory.fingerprint = fingerprint
            message = (wire.encode_plan(mine, same_as=fingerprint) if same
                       else wire.encode_plan(mine, layout=layout))
    gathered = group.gather(message)
    answers = None
    if gathered is not None:
        try:
            with paused():
                answers = _decide(gathered, memory, path)
        except BaseException as exc:  # the peers wait for an answer: give them this one
            group.scatter([_refusal(path, [f"the coordinator (rank 0): {_describe(exc)}"])]
                          * len(gathered))
            raise
    answer = group.scatter(answers)
    if error is not None:
        memory.fingerprint = None
        raise error
    try:
        save_id, assignment = wire.decode_answer(answer)
    except CkptError as exc:
        memory.fingerprint = None
        raise RankFailedError(str(exc)) from None
    if group.rank != COORDINATOR:
        return Agreement(save_id, assignment)
    assert memory.pending is not None  # internal: _decide set it before answering
    plans, global_plan = memory.pending
    memory.pending = None
    return Agreement(save_id, assignment, plans, global_plan)


def _agree_alone(mine: RankPlan | None, error: BaseException | None, memory: Memory,
                 reuse: bool) -> Agreement:
    """One process: the same decisions, without messages."""
    if mine is None:
        memory.last = None
        raise error if error is not None else CkptError("planning failed")
    if reuse and memory.last is not None:
        memory.reused += 1
        global_plan = dataclasses.replace(memory.last[1], objects=objects_of([mine]))
    else:
        global_plan = plan_global([mine])
        memory.last = (frozenset(), global_plan)
    return Agreement(commit.new_save_id(), global_plan.assignments[0], (mine,), global_plan)


def _decide(gathered: list[bytes], memory: Memory, path: str) -> list[bytes]:
    """On the coordinator: every rank's plan -> every rank's answer (or everyone's error)."""
    plans: list[RankPlan] = []
    failures: list[str] = []
    all_same = True
    for rank, data in enumerate(gathered):
        cached = memory.plans.get(rank)
        plan, error, fingerprint, same = wire.decode_plan(data, rank, cached[1] if cached else None,
                                                    cached[0] if cached else None)
        if plan is None:
            failures.append(f"rank {rank}: {error}")
            continue
        all_same = all_same and same
        plans.append(plan)
        if not same and fingerprint is not None:
            memory.plans[rank] = (fingerprint, plan)
    if failures:
        memory.plans.clear()
        memory.last = None
        return [_refusal(path, failures)] * len(gathered)
    try:
        own = per_rank_keys(plans)
        if all_same and memory.last is not None and memory.last[0] == own:
            memory.reused += 1
            global_plan = dataclasses.replace(memory.last[1], objects=objects_of(plans))
        else:
            global_plan = plan_global(plans, own)
            memory.last = (own, global_plan)
    except CkptError as exc:
        memory.plans.clear()
        memory.last = None
        return [_refusal(path, [f"ranks disagree: {exc}"])] * len(gathered)
    save_id = commit.new_save_id()
    memory.pending = (tuple(plans), global_plan)
    return [wire.encode_answer(save_id, a, None) for a in global_plan.assignments]


def _refusal(path: str, failures: list[str]) -> bytes:
    return wire.encode_answer("", None, f"save to {path} failed before writing, on "
                              f"{'; '.join(failures[:8])}{' ...' if len(failures) > 8 else ''}. "
                              "Nothing was written; the previous checkpoint there is untouched")


def _describe(error: BaseException | None) -> str:
    return f"{type(error).__name__}: {error}" if error is not None else "unknown error"


@contextlib.contextmanager
def exclusive(group: Group, path: str, if_locked: str) -> Iterator[commit.DirLock | None]:
    """Collective, in the save's thread before any rank creates a file in ``path``: the
    coordinator takes the directory lock (commit.lock; waits or raises per ``if_locked``) and
    tells every rank whether it has it; if not, raises on every rank (CheckpointLockedError
    where another save holds it). Only the coordinator commits, so only it holds the lock; the
    other ranks create their files after this step, so inside its hold. The body runs holding
    it; the lock is let go when the body ends. Yields the lock on the coordinator, else None.

    In the save's thread rather than in agree(): a save that waits for the lock or is refused
    reports it where every background error is reported (wait()), on every rank alike. While
    the coordinator waits (if_locked="wait"), the other ranks wait in the broadcast, up to the
    process group's timeout."""
    held: commit.DirLock | None = None
    failure: BaseException | None = None
    if group.rank == COORDINATOR:
        try:
            held = commit.lock(path, if_locked)
        except BaseException as exc:  # noqa: BLE001 - raised below, once the peers know
            failure = exc
    try:
        _lock_outcome(group, path, failure, raise_it=True)
        if failure is not None:
            raise failure
        yield held
    except BaseException:
        if held is not None:
            commit.unlock(held, failed=True)
        raise
    if held is not None:
        commit.unlock(held)


def skip_exclusive(group: Group, path: str, error: BaseException) -> None:
    """Take part in exclusive() for a rank that failed before its save thread ran (the peers'
    threads wait in it); the coordinator then takes no lock and tells the peers why."""
    _lock_outcome(group, path, error if group.rank == COORDINATOR else None, raise_it=False)


def _lock_outcome(group: Group, path: str, failure: BaseException | None, *,
                  raise_it: bool) -> None:
    """The coordinator's lock outcome on every rank; a failure is raised on the other ranks
    (``raise_it``): CheckpointLockedError if the path was locked, else RankFailedError."""
    if group.size == 1:
        return
    mine = None
    if group.rank == COORDINATOR:
        mine = json.dumps({"error": None if failure is None else _describe(failure),
                           "locked": isinstance(failure, CheckpointLockedError)}).encode()
    outcome = json.loads(group.broadcast(mine))
    if group.rank == COORDINATOR or outcome["error"] is None or not raise_it:
        return
    if outcome["locked"]:  # the message says what to do
        raise CheckpointLockedError(f"save to {path} refused on the coordinator (rank 0): "
                                    f"{outcome['error']}")
    raise RankFailedError(f"save to {path} failed before writing, on the coordinator (rank 0): "
                          f"{outcome['error']}. Nothing was written; the previous checkpoint "
                          "there is untouched")


def conclude(group: Group, agreement: Agreement, written: tuple[list[TensorEntry], list[FileInfo]] | None,
             error: BaseException | None, path: str, meta: dict[str, Any], algorithm: str,
             block_nbytes: int, committed: Callable[[list[str]], None],
             held: commit.DirLock | None = None) -> None:
    """Collective, after this rank's writes (``written``) or its failure (``error``): the
    coordinator commits the manifest if every rank succeeded; every rank learns the outcome.
    ``committed(names)``: on the coordinator after the commit, with every data file's name.
    ``held``: the coordinator's directory lock (the commit is conditional on it).
    Raises this rank's own error, else RankFailedError naming the failed ranks; with one
    process, the commit's own error."""
    entries, files = written if written is not None else (None, None)
    if group.size == 1:
        if error is not None:
            raise error
        assert entries is not None and files is not None  # internal: written when no error
        failure = _commit([(entries, files, None)], agreement, path, meta, algorithm,
                          block_nbytes, committed, held)
        if failure is not None:
            raise CkptError(failure)
        return
    gathered = group.gather(wire.encode_result(entries, files, _describe(error)))
    outcome = None
    if gathered is not None:
        try:
            with paused():
                results = [wire.decode_result(data, rank, _assigned(agreement, rank))
                           for rank, data in enumerate(gathered)]
            verdict = _commit(results, agreement, path, meta, algorithm, block_nbytes, committed,
                              held)
        except BaseException as exc:  # the peers wait for an outcome: tell them, then raise
            group.broadcast(wire.encode_outcome(f"the coordinator (rank 0) failed: {_describe(exc)}"))
            raise
        outcome = wire.encode_outcome(verdict)
    failure = wire.decode_outcome(group.broadcast(outcome))
    if error is not None:
        raise error
    if failure is not None:
        raise RankFailedError(failure)


def _assigned(agreement: Agreement, rank: int) -> list[WriteItem]:
    assert agreement.global_plan is not None  # internal: set on the coordinator
    return [agreement.plans[rank].items[i] for i in agreement.global_plan.assignments[rank].writes]


def _commit(results: list[tuple[list[TensorEntry], list[FileInfo], str | None]],
            agreement: Agreement, path: str, meta: dict[str, Any], algorithm: str,
            block_nbytes: int, committed: Callable[[list[str]], None],
            held: commit.DirLock | None) -> str | None:
    """On the coordinator: the manifest, committed; -> None, or why nothing was committed.
    With one rank, a commit error is raised as it is (no coordinator to speak of)."""
    plan = agreement.global_plan
    assert plan is not None  # internal: agree() set it on the coordinator
    written: list[list[TensorEntry]] = []
    files: list[FileInfo] = []
    failures: list[str] = []
    for rank, (entries, infos, error) in enumerate(results):
        if error is not None:
            failures.append(f"rank {rank}: {error}")
        written.append(entries)
        files.extend(infos)
    if failures:
        return (f"save to {path} failed on {'; '.join(failures[:8])}"
                f"{' ...' if len(failures) > 8 else ''}. Nothing was committed; the previous "
                "checkpoint there is untouched")
    try:
        check_files(files)
        with paused():
            record = Manifest(
                version=manifest.VERSION, save_id=agreement.save_id,
                checksum_algorithm=algorithm, world_size=len(results), files=tuple(files),
                tensors=tuple(manifest_entries(agreement.plans, plan.assignments, written)),
                objects=plan.objects, aliases=plan.aliases, tree=plan.tree, meta=meta,
                block_nbytes=block_nbytes)
        # The reader's key rules, before the commit: a manifest that would not load must not
        # replace one that does (its files are deleted once the new one is committed).
        manifest.check_keys(record, os.path.join(path, manifest.MANIFEST_NAME))
        commit.commit(path, manifest.encode(record), agreement.save_id, held)
    except CkptError as exc:
        if len(results) == 1:
            raise
        return f"save to {path} failed at the commit on the coordinator (rank 0): {exc}"
    committed([f.name for f in files])
    return None



def agree_loaded(group: Group, error: BaseException | None, path: str) -> None:
    """Collective, at the end of a load: if any other rank failed, raise here too (this rank's
    own error is raised by the caller)."""
    if group.size == 1:
        return
    reports = group.all_gather(b"" if error is None else _describe(error).encode())
    failures = [f"rank {r}: {m.decode(errors='replace')}" for r, m in enumerate(reports) if m]
    if failures and error is None:
        raise RankFailedError(f"load of {path} failed on {'; '.join(failures[:8])}"
                              f"{' ...' if len(failures) > 8 else ''}; this rank's state may be "
                              "partly loaded: load again once the cause is fixed")


class UnexpectedKeys:
    """The key step of an in-place load with peers: a checkpoint key that this rank's state
    lacks is unexpected only if no rank asks for it (ranks may hold different keys: per-rank
    values under distinct names, pipeline stages). Every rank runs it exactly once: with its
    own unexpected keys (``__call__``), or with its error if it failed before (``fail``)."""

    def __init__(self, group: Group, path: str) -> None:
        self.group, self.path, self.done = group, path, False

    def __call__(self, mine: tuple[str, ...]) -> tuple[str, ...]:
        replies = self._exchange({"unexpected": list(mine)})
        failures = [f"rank {r}: {m['error']}" for r, m in enumerate(replies) if "error" in m]
        if failures:
            raise RankFailedError(f"load of {self.path} failed on {'; '.join(failures[:8])}"
                                  f"{' ...' if len(failures) > 8 else ''}")
        nobody = set(mine)
        for reply in replies:
            nobody &= set(reply["unexpected"])
        return tuple(k for k in mine if k in nobody)

    def fail(self, error: BaseException) -> None:
        if not self.done:
            self._exchange({"error": _describe(error)})

    def _exchange(self, message: dict[str, Any]) -> list[dict[str, Any]]:
        self.done = True
        if self.group.size == 1:
            return [message]
        return [json.loads(b) for b in self.group.all_gather(json.dumps(message).encode())]
