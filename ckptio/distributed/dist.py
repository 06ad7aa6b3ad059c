"""The ranks of a save or load, and the few byte messages they exchange.

A ``Group`` is this process's rank, the number of ranks and four collectives on byte strings
(gather to the coordinator, scatter from it, broadcast from it, all-gather), and a way to send
the coordinator bytes that many ranks hold alike once (publish / fetch). ``Solo`` is one
process with no torch.distributed; ``over_torch`` gives the ranks of a torch process group,
exchanging bytes through the job's rendezvous store with deadlines (storegroup.py): metadata
never goes through NCCL or gloo, no process group is made, and a save's background thread never
shares a communicator with the training loop.

A one-rank group marked a **piece** (``mark_piece``: the memory tier with redundancy,
managing/guard.py) saves this rank's piece of a job's state: the DTensor shards it holds, placed
in their global tensors, which the other ranks' pieces complete.

Owns: choosing the group, and which one-rank groups save pieces. Does not own: moving bytes
(storegroup.py) or what they say (wire.py).
"""

from __future__ import annotations

import json
import weakref
import zlib
from typing import Any, Protocol

import torch

from ckptio.distributed import liveness
from ckptio.distributed.storegroup import COORDINATOR, Deadlines, StoreGroup
from ckptio.options import Options

__all__ = ["ALONE", "COORDINATOR", "Group", "Solo", "current_group", "job_ranks", "mark_piece",
           "over_torch", "piece_of", "rank_alone_group", "silent_ranks", "store_of"]

# id(group) -> (the group, weakly: destroy_process_group frees it before exit, and the entry
# goes with it; job rank, job world size)
_pieces: dict[int, tuple[weakref.ref[Any], int, int]] = {}


def mark_piece(group: Any, rank: int, world_size: int) -> None:
    """Saves over the one-rank torch process group ``group`` write rank ``rank``'s piece of a
    ``world_size``-rank job's state (while ``group`` lives)."""
    key = id(group)

    def forget(ref: weakref.ref[Any]) -> None:
        if key in _pieces and _pieces[key][0] is ref:
            del _pieces[key]

    _pieces[key] = (weakref.ref(group, forget), rank, world_size)


def piece_of(group: Any) -> tuple[int, int] | None:
    """(job rank, job world size) where saves over ``group`` write a piece, else None."""
    found = _pieces.get(id(group)) if group is not None else None
    return None if found is None or found[0]() is not group else (found[1], found[2])


class Group(Protocol):
    rank: int
    size: int
    members: tuple[int, ...]  # the global rank of each rank

    def gather(self, data: bytes) -> list[bytes] | None:
        """Every rank's bytes on the coordinator (in rank order); None elsewhere."""
        ...

    def scatter(self, parts: list[bytes] | None) -> bytes:
        """The coordinator passes one part per rank; every rank gets its own."""
        ...

    def broadcast(self, data: bytes | None) -> bytes:
        """The coordinator's bytes on every rank."""
        ...

    def all_gather(self, data: bytes) -> list[bytes]:
        ...

    def publish(self, name: str, data: bytes) -> None:
        """Make ``data`` fetchable under ``name`` (a fingerprint of it: ranks publishing one
        name publish equal bytes, stored once). Before the gather that names it."""
        ...

    def fetch(self, names: list[str]) -> list[bytes]:
        """On the coordinator, after a gather whose senders published ``names``: their bytes."""
        ...


class Solo:
    """One process: every collective is the identity."""

    rank = 0
    size = 1
    members: tuple[int, ...] = (0,)

    def __init__(self) -> None:
        self._published: dict[str, bytes] = {}

    def gather(self, data: bytes) -> list[bytes] | None:
        return [data]

    def scatter(self, parts: list[bytes] | None) -> bytes:
        assert parts is not None and len(parts) == 1  # internal: the coordinator always passes them
        return parts[0]

    def broadcast(self, data: bytes | None) -> bytes:
        assert data is not None  # internal
        return data

    def all_gather(self, data: bytes) -> list[bytes]:
        return [data]

    def publish(self, name: str, data: bytes) -> None:
        self._published.setdefault(name, data)

    def fetch(self, names: list[str]) -> list[bytes]:
        return [self._published[name] for name in names]

    def published_nbytes(self) -> int:
        """Bytes published so far (each name once): what the ranks' layouts a coordinator
        fetches weigh, which benchmarks/plan_scale.py reports."""
        return sum(map(len, self._published.values()))


# groups made in this process per set of ranks, counted under one default group (a weak
# reference to it): a job that re-forms its default group in the same processes (a spare joins
# the survivors) counts anew on every rank, so the names agree with a fresh process's
_instances: dict[tuple[int, ...], int] = {}
_counted_under: list[weakref.ref[Any]] = []


def _instance(members: tuple[int, ...]) -> int:
    """The number of ``members``' groups made before under the current default group."""
    world = torch.distributed.group.WORLD
    if not _counted_under or _counted_under[0]() is not world:
        _instances.clear()
        _counted_under[:] = [weakref.ref(world)]
    instance = _instances.get(members, 0)
    _instances[members] = instance + 1
    return instance


def over_torch(group: Any, options: Options | None = None) -> StoreGroup:
    """The ranks of torch process group ``group``, exchanging bytes through the job's store
    (storegroup.py) with the deadlines of ``options``. Not a collective: every rank makes its
    groups in the same order (as torch.distributed.new_group requires), which names them alike."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    options = options or Options.from_env()
    deadlines = Deadlines(options.rank_timeout_s, options.step_timeout_s)
    members = tuple(int(r) for r in dist.get_process_group_ranks(group))
    instance = _instance(members)
    ranks = ",".join(map(str, members)) if len(members) <= 8 else (
        f"{len(members)}-{zlib.crc32(repr(members).encode()):08x}")
    alive_store = c10d._get_default_store()
    liveness.beat(alive_store, dist.get_rank(), deadlines.beat_s)
    return StoreGroup(store_of(group), alive_store, members, dist.get_rank(group),
                      f"ckptio/{ranks}/{instance}", deadlines)


# [the default group, weakly (destroy_process_group frees it); its ranks as job_ranks made them]
_job: list[Any] = []


def job_ranks(options: Options | None = None) -> StoreGroup | None:
    """The ranks of the job's default group for the plugins' steps of every rank (a run
    lease, a tag check), made at the first call and kept while the group lives (one made per
    call left its counters in the job's store each time), with the deadlines of the latest
    call's ``options`` (a plugin made later with other Options is held to its own); None in
    one process."""
    group = current_group()
    if group is None:
        return None
    if not (_job and _job[0]() is group):
        _job[:] = [weakref.ref(group), over_torch(group, options)]
    ranks: StoreGroup = _job[1]
    if options is not None:
        ranks.deadlines = Deadlines(options.rank_timeout_s, options.step_timeout_s)
        liveness.beat(ranks.alive_store, torch.distributed.get_rank(), ranks.deadlines.beat_s)
    return ranks


def store_of(group: Any) -> Any:
    """The store of a torch process group (its own prefix of the job's store)."""
    from torch.distributed import distributed_c10d as c10d

    if hasattr(c10d, "_get_process_group_store"):
        return c10d._get_process_group_store(group)
    return c10d._world.pg_map[group][1]  # older torch: what that function reads


def current_group(process_group: Any = None) -> Any | None:
    """The torch process group a save or load runs over: the one given, else the default one
    when torch.distributed is initialised with more than one rank; None: a single process (or
    ``rank_alone_group()``'s mark)."""
    if process_group is ALONE:
        return None
    if process_group is not None:
        return process_group
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return None
    group = torch.distributed.group.WORLD
    return group if torch.distributed.get_world_size(group) > 1 else None


class _Alone:
    """The mark of a save or load that this rank makes by itself (``rank_alone_group``)."""

    def __repr__(self) -> str:
        return "ckptio.distributed.dist.ALONE"


ALONE = _Alone()


def rank_alone_group() -> Any | None:
    """The ``process_group=`` of a save or load that one rank makes by itself (a framework that
    writes per-rank files, or saves on rank 0 only), while a ckptio call over the default group
    is a collective of every rank: ``ALONE``, which ckptio's calls take as one process; None in
    one process. Not a torch process group: one made on some ranks only (as a group of one is)
    would shift the names torch gives the groups made after it on those ranks, and a later
    group of several ranks (the program's own) would then be named unlike on the others."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    return ALONE


def silent_ranks(global_ranks: list[int], group: Any) -> list[int]:
    """Those of ``global_ranks`` that stopped beating in the job's store (liveness.silent:
    died or frozen; waits a few beats) once a transfer over torch process group ``group``
    failed. The first rank to find them records them in the store under the group's name, and
    a rank whose transfer failed later (the ones first found have exited since) takes that
    record. [] without torch.distributed."""
    from torch.distributed import distributed_c10d as c10d

    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return []
    store = c10d._get_default_store()
    key = f"ckptio/silent/{group.group_name}"
    try:
        if not store.check([key]):
            store.compare_set(key, "", json.dumps(liveness.silent(store, global_ranks)))
        return [int(r) for r in json.loads(store.get(key))]
    except RuntimeError:  # the store is gone (its host exited): nothing can tell
        return []
