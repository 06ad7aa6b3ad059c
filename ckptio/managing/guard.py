"""What a tiered manager with ``Tier(..., redundancy=...)`` adds: the rank-local layout, the
job's host topology, the protection thread, and the restore's agreement across ranks.

With redundancy, every tier holds each rank's own one-rank checkpoint (``<location>/r<rank>``),
saved and drained by that rank alone (a one-rank process group; each rank runs its own drain);
the redundancy's transfers run over a gloo group of their own, made here once for the job
(collective: every rank constructs the manager at the same point, after
``torch.distributed.init_process_group``). A restore is agreed by all ranks (rebuild.py for the
memory; then the newest step every rank holds in some tier, with the lost hosts named; a job
restarted on another number of ranks reshards the old job's pieces from memory: elastic.py).

A Guard is the manager's follower of the memory tier (managing/follower.py: submit, pinned,
wait, close, status). Owns: that setup and the agreement of a restore's step. Does not own: the
tiers' own saving, draining and loading (manager.py), protection (protect.py), memory
recovery (rebuild.py).
"""

from __future__ import annotations

import dataclasses
import logging
import re
import weakref
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ckptio.distributed.dist import mark_piece, over_torch, silent_ranks
from ckptio.errors import CkptError, RankFailedError
from ckptio.storage.select import checkpoint_path
from ckptio.redundancy import elastic, marks, peers
from ckptio.redundancy.topology import Topology, domain_id, host_id
from ckptio.redundancy.landing import Landing, drop_scratch, drop_scratch_beyond
from ckptio.redundancy.protect import Protector
from ckptio.redundancy.rebuild import Context, Recovery, recover
from ckptio.redundancy.redundancy import Partners
from ckptio.managing.tier import Tier
from ckptio.options import Options

__all__ = ["Guard", "fallback_step", "rank_tiers"]

log = logging.getLogger("ckptio")


def rank_tiers(tiers: Sequence[Tier], rank: int) -> list[Tier]:
    """Each tier's location for ``rank`` alone: ``<location>/r<rank>``."""
    return [dataclasses.replace(t, location=f"{t.location.rstrip('/')}/r{rank:05d}")
            for t in tiers]


class Guard:
    """The redundancy of one manager on this rank (module docstring). Construct on every rank."""

    def __init__(self, tiers: Sequence[Tier], process_group: Any, options: Options) -> None:
        spec = tiers[0].redundancy
        assert spec is not None  # internal: made only for a tier with redundancy
        if not dist.is_available() or not dist.is_initialized():
            raise CkptError(f"Tier({tiers[0].location!r}, redundancy=...): protects the memory "
                            "of several hosts; call torch.distributed.init_process_group first "
                            "(a single process has nothing to copy to)")
        if process_group is not None and process_group is not dist.group.WORLD:
            raise CkptError("CheckpointManager(tiers=[Tier(..., redundancy=...)], process_group="
                            "...): redundancy spans the whole job; leave process_group out")
        self.root = _unclaimed(checkpoint_path(tiers[0].location), tiers[0].location)
        self.spec = spec
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        if self.world < spec.least_hosts:  # every rank alike, before any group is made
            raise CkptError(f"Tier({tiers[0].location!r}, redundancy={spec.describe()}): this "
                            f"job has {self.world} rank(s), so at most {self.world} host(s), "
                            f"and it needs at least {spec.least_hosts}: use a redundancy for "
                            f"at most {self.world} hosts (Parity(k) with k <= "
                            f"{self.world - 1}, Partners(n) with n <= {self.world - 1}), or "
                            "run on more hosts")
        # gloo groups of their own, never the training's. ``group``: the protection thread's,
        # a peer gone noticed after peer_timeout_s; ``control``: this (the caller's) thread's
        # gathers (a restore's: ``meeting``), so the two threads never interleave on one group
        self.peer_timeout_s = peer_timeout_s = options.peer_timeout_s
        self.group = _job_group(peer_timeout_s, peer_timeout_s)
        self.control = _job_group(peer_timeout_s, peer_timeout_s)
        # ``prompt``: the caller's thread's exchanges that every rank makes at once, the
        # listing of steps()/latest() and a restore's sends and receives (rebuild.py, regrow.py,
        # reshard_fetch.py): a peer frozen, or gone elsewhere after an error of its own (its
        # receives never posted), fails them after peer_timeout_s, not step_timeout_s
        self.prompt = _job_group(peer_timeout_s, peer_timeout_s)
        try:
            placed = peers.all_gather_json(self.control, [host_id(), domain_id()])
        except RuntimeError as exc:  # torch.distributed's errors: a rank gone meanwhile
            raise RankFailedError(
                f"CheckpointManager with redundancy on rank {self.rank}: a rank died while the "
                f"managers were being made ({type(exc).__name__}: {exc}); restart the job") \
                from exc
        self.topology = Topology.from_ids([p[0] for p in placed], [p[1] for p in placed])
        # a restore's ranks meet over the job's store first (peers.Meeting): a rank dead or
        # frozen is named after rank_timeout_s, one alive but busy waited for up to
        # step_timeout_s (a rank may load from a slow tier while the others wait)
        self.meeting = peers.Meeting(over_torch(dist.group.WORLD, options), self.control,
                                     self.rank, self.topology.name_ranks)
        # this rank's saves: a group of this rank alone, made by it alone (no collective, one
        # group whatever the number of ranks; new_subgroups made one per rank on every rank)
        self.single = dist.new_group([self.rank], backend="gloo", use_local_synchronization=True)
        mark_piece(self.single, self.rank, dist.get_world_size())  # its shards of DTensors
        self.tiers = rank_tiers(tiers, self.rank)
        self.protector: Protector | None = None
        self._landings: list[Landing] = []  # a restore's steps still being written (settle)
        _OPEN[self.root] = self  # made: this memory tier is this Guard's until close()

    def start(self, own_dir: Callable[[int], str]) -> None:
        """Make the protection thread (own_dir: step -> this rank's memory step directory),
        once this rank's scratch directories that a killed restore left are removed
        (landing.drop_scratch: here, with the tier leased and before any restore), and, by the
        first rank of each host (as protect.py drops old protection), those of ranks this job
        does not have (landing.drop_scratch_beyond: a restart on fewer ranks)."""
        self._own_dir = own_dir
        drop_scratch(self.root, self.rank)
        if self.topology.local_of(self.rank) == 0:
            drop_scratch_beyond(self.root, self.world)
        self.protector = Protector(self.spec, self.topology, self.group, self.rank, self.root,
                                   own_dir, self.peer_timeout_s)

    def pinned(self) -> set[int]:
        """Steps the memory tier keeps: the newest protected one (a lost host then costs no step)
        and those being protected."""
        assert self.protector is not None  # internal
        status = self.protector.status()
        return {s for s in (status["protected"], status["protecting"], *status["queued"])
                if s is not None}

    def recover(self, own: list[int], anywhere: list[int], verify: Callable[[str], Any],
                only: int | None, others: list[int], failed: str | None = None) -> Recovery:
        """Collective (rebuild.recover): the memory step every rank now holds, or None.
        Rides on its inventory's gather (``Recovery.extras``, per rank): ``others`` (this
        rank's steps of another rank count) and the pieces its host's memory holds (elastic.
        survey: what ``restart`` then searches, with no gather of its own). ``failed``: this
        rank's error before it (with the protection's or a landing's error raised here): said
        there, RankFailedError on every rank."""
        assert self.protector is not None  # internal
        pieces: list[Any] = []
        try:
            self.protector.wait()
            self.settle()
            pieces = elastic.survey(self._restart_context())
        except Exception as exc:  # noqa: BLE001 - said at the inventory's gather, raised on
            # every rank there: no rank waits for this one (step_timeout_s)
            failed = failed or f"{type(exc).__name__}: {exc}"
        context = Context(self.spec, self.topology, self.meeting, self.prompt, self.rank,
                          self.root, self._own_dir, verify)
        recovery = recover(context, own, anywhere, only, {"others": others, "pieces": pieces},
                           failed)
        self._landings = list(recovery.pending)
        return recovery

    def start_writes(self) -> None:
        """Start the writes of the steps a restore loaded from memory (its load is done)."""
        for landing in self._landings:
            landing.start()

    def settle(self) -> None:
        """Wait for the writes of steps a restore loaded from memory (rebuild.Recovery.pending)
        into this rank's memory tier; raise the first one's error (once)."""
        landings, self._landings = self._landings, []
        errors = []
        for landing in landings:
            try:
                landing.settle()
            except CkptError as exc:
                errors.append(exc)
        if errors:
            raise errors[0]

    def restart(self, skipped: list[str], recovery: Recovery) -> elastic.Restart:
        """Collective (elastic.Restart): the search of a restart on another number of ranks
        for the pieces the old job left in memory, surveyed by ``recover`` (its extras)."""
        return elastic.Restart(self._restart_context(), skipped,
                               [extra["pieces"] for extra in recovery.extras])

    def _restart_context(self) -> elastic.Context:
        return elastic.Context(self.meeting, self.prompt, self.rank, self.world, self.topology,
                               self.root)

    def union(self, steps: list[int]) -> list[int]:
        """Collective: the steps any rank holds, ascending; RankFailedError when the ranks do
        not all answer within peer_timeout_s (the listing group is unusable afterwards)."""
        try:
            parts = peers.all_gather_json(self.prompt, steps)
        except RuntimeError as exc:  # torch.distributed's errors (DistBackendError included)
            gone = silent_ranks(self.topology.others(self.rank), self.prompt)
            raise RankFailedError(
                f"rank {self.rank}: listing the steps every rank holds (steps(), latest()) got "
                f"no answer from every rank within peer_timeout_s={self.peer_timeout_s:g} s: "
                f"{self.topology.name_ranks(gone) or 'a rank'} died, is frozen, or does not "
                "call steps()/latest() at this point of the program "
                f"({type(exc).__name__}: {exc}); restart the job", tuple(gone)) from exc
        return sorted({s for part in parts for s in part})

    def outcomes(self, mine: dict[str, Any]) -> list[dict[str, Any]]:
        """Collective: every rank's outcome (JSON), in rank order; RankFailedError when a rank
        died or gave no answer."""
        own = f"; this rank's own failed: {mine['error']}" if mine.get("error") else ""
        try:
            return self.meeting.all_gather_json(mine)
        except RankFailedError as exc:  # a rank dead, frozen or late where the ranks meet
            raise RankFailedError(f"{exc}{own}", exc.ranks) from exc
        except RuntimeError as exc:  # torch.distributed's errors (DistBackendError included)
            raise RankFailedError(
                f"rank {self.rank}: exchanging the ranks' outcomes of a restore got no answer "
                f"from every rank: a rank died or gave no answer within peer_timeout_s "
                f"({type(exc).__name__}: {exc}){own}; restart the job") from exc

    def for_others(self, step_nbytes: int) -> tuple[int, int]:
        """(bytes this rank holds now for other hosts' ranks, bytes a step of ``step_nbytes``
        adds: n copies with Partners(n), m ceil(step / k') of parity with Parity) for the memory
        tier's budget; the protection of a new step is written before the older one is
        removed."""
        topo, local = self.topology, self.topology.local_of(self.rank)
        if isinstance(self.spec, Partners):
            ranks = set(topo.partnered(self.rank, self.spec.n))
            per_step = self.spec.n * step_nbytes
        else:
            ranks = set()
            k, m = self.spec.k, self.spec.m
            group = topo.groups(k, m)[topo.group_of(topo.host_of(self.rank), k, m)]
            per_step = self.spec.block_nbytes(step_nbytes, len(group))
        return marks.held_nbytes(self.root, ranks, local), per_step

    # ------------------------------------------------------------ managing.follower.Follower

    def submit(self, step: int) -> None:
        """``step`` committed in this rank's memory tier: protect it in other hosts' memory."""
        assert self.protector is not None  # internal: started by the manager
        self.settle()
        self.protector.submit(step)

    def wait(self, timeout: float | None = None) -> bool:
        """Until every step submitted is protected (or given up) -> True, or ``timeout``."""
        self.settle()
        return True if self.protector is None else self.protector.wait(timeout)

    def close(self) -> None:
        if _OPEN.get(self.root) is self:
            del _OPEN[self.root]  # closed: another manager may protect this memory tier
        try:
            self.settle()
        finally:
            if self.protector is not None:
                self.protector.close()

    def release(self) -> None:
        """The gloo groups made here destroyed (each one's sockets, pipes and threads), on this
        rank alone: once the manager is closed nothing runs over them. Groups the job tore down
        already (destroy_process_group) are passed over."""
        for group in (self.group, self.control, self.prompt, self.single):
            _destroy(group)

    def status(self) -> dict[int, dict[str, Any]]:
        """{0: how the memory tier's steps are protected across hosts}."""
        assert self.protector is not None  # internal
        return {0: {**self.protector.status(), "hosts": self.topology.size,
                    "host": self.topology.host_of(self.rank)}}


# each memory tier's directory -> the Guard protecting it in this process, until closed
_OPEN: weakref.WeakValueDictionary[str, Guard] = weakref.WeakValueDictionary()


def _unclaimed(root: str, location: str) -> str:
    """-> ``root``; CkptError while an open Guard of this process protects it (its retention
    and protection would remove another manager's steps there)."""
    if _OPEN.get(root) is not None:
        raise CkptError(
            f"Tier({location!r}, redundancy=...): another CheckpointManager of this process "
            f"protects that memory tier ({root}) and is not closed; two managers on one memory "
            "tier remove each other's steps and their protection. Give each manager its own "
            "tier (shm://NAME), or close() the other manager first")
    return root


def _job_group(timeout_s: float, peer_timeout_s: float) -> Any:
    """A gloo group of every rank (collective) -> it. RankFailedError, naming the rank the
    others waited for where torch's message says it, when a rank does not come within
    peer_timeout_s (it never constructs its manager, or died before)."""
    try:
        return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    except RuntimeError as exc:  # torch's DistStoreError / DistNetworkError: a rank never came
        found = re.search(r"keys: \S*/(\d+)\s*$", str(exc))
        who = f"rank {found.group(1)}" if found else "a rank"
        raise RankFailedError(
            f"CheckpointManager with redundancy on rank {dist.get_rank()}: {who} did not "
            f"construct its manager (it died, or did not come within Options.peer_timeout_s="
            f"{peer_timeout_s:g} s: {type(exc).__name__}: {exc}). Every rank constructs the "
            "manager, with the same tiers, at the same point of the script (a collective): "
            "check that rank for an error or a branch that skips it, or raise peer_timeout_s",
            (int(found.group(1)),) if found else ()) from exc


def _destroy(group: Any) -> None:
    """``group`` destroyed here if torch still holds it (not torn down with the job's)."""
    if not dist.is_initialized():  # the job's group torn down, ours with it
        return
    try:
        dist.destroy_process_group(group)
    except ValueError:  # torch holds it no more (destroyed already)
        pass
    except RuntimeError as exc:  # torch.distributed's errors: a broken group, its peer gone
        log.debug("ckptio: destroying a redundancy group failed: %s", exc)


def fallback_step(recovery: Recovery, requested: int | None) -> int | None:
    """The newest step every rank holds in some tier (its own memory or a slower tier), or
    ``requested`` if every rank holds it; None if none."""
    common: set[int] | None = None
    for steps in recovery.anywhere:
        common = set(steps) if common is None else common & set(steps)
    common = common or set()
    if requested is not None:
        return requested if requested in common else None
    return max(common) if common else None
