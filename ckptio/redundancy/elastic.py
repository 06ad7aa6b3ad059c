"""A restart on another number of ranks, restored from the memory tier with redundancy: the
previous job's pieces (each rank's own one-rank step, its shards placed in their global
tensors: ``meta.piece``) gathered from the hosts' memory and resharded into this job's layout.

Call order (collective over the Guard's control group, every rank; managing/agreed.py):
``Restart(ctx, skipped, reports)`` -> ``next(only)`` -> ``fetch(choice, state, load_kwargs)``
(None: a piece failed, ``next`` again) -> ``install(fetched)`` -> the caller loads that piece
(this rank's of this job, in this process's memory) and removes it -> ``close()``.

1. survey: the first rank of each host lists the pieces its host's memory holds (``r<k>/step-N``
   and partner copies) with the rank count of the job that saved them (``reports``: gathered
   with the same-world recovery's inventory); a piece held nowhere is rebuilt from parity
   first where its group allows (regrow.py), into its receiver's memory, held there;
2. plan (pieces.py): the newest step of another rank count (or of this one, ranks on other
   hosts) whose every piece is held, each sent by a holder, which shares its manifest;
3. fetch: each rank works out the byte ranges of the entries its state needs (the rows its
   shards meet: pieces.py); each holder reads them, checks them against their checksums (a
   piece that fails is passed over, the plan made again) and sends every rank its section of
   that rank's buffer, received in place (reshard_fetch.py); a rank gone: RankFailedError;
4. install: the buffer, as this rank's piece of this job in this process's memory (mem://).
Steps the plan does not offer (more pieces lost than parity rebuilds, deltas): docs/BEHAVIOUR.md.

Owns: the survey and the search. Does not own: the plan and which bytes a rank needs
(pieces.py, pure), the exchange (reshard_fetch.py), the load (the caller's tier), the
same-world recovery (rebuild.py), the names on each host (marks.py).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ckptio.errors import CkptError, RankFailedError, StateMismatchError
from ckptio.format.manifest import MANIFEST_NAME, decode
from ckptio.format.types import ObjectEntry
from ckptio.storage.store_contract import TreeStore
from ckptio.redundancy import left, marks, peers
from ckptio.redundancy import reshard_fetch as exchange
from ckptio.redundancy.reshard_fetch import Fetched
from ckptio.redundancy.pieces import Choice, Found, Source, item_id, merged, needed, plan
from ckptio.redundancy.regrow import regrow
from ckptio.redundancy.topology import Topology

__all__ = ["Context", "Fetched", "Restart", "survey"]

log = logging.getLogger("ckptio")
MAX_ROUNDS = 16


@dataclass
class Context:
    """What the restart needs of the Guard on this rank."""

    meeting: peers.Meeting  # its gathers
    transfers: Any  # the gloo group of its sends and receives (guard.py: peer_timeout_s)
    rank: int
    world: int
    topology: Topology  # this job's hosts
    root: str  # the memory tier's local directory


def _piece(store: TreeStore, step: int, k: int, kind: str) -> list[Found]:
    try:
        record = decode(store.read_manifest(), store.path_of(MANIFEST_NAME))
    except CkptError:
        return []  # incomplete, removed meanwhile or unreadable: not a piece to offer
    piece = record.meta.get("piece")
    if not isinstance(piece, dict) or piece.get("rank") != k or record.bases:
        return []
    return [[step, k, int(piece["world_size"]), kind]]


def survey(ctx: Context) -> list[Found]:
    """Step 1: the pieces this host's memory holds (reported by its first rank only)."""
    topo = ctx.topology
    if topo.hosts[topo.host_of(ctx.rank)][0] != ctx.rank:
        return []
    tree, found = marks.tree_of(ctx.root), []
    for k in marks.rank_dirs(tree):
        for step, store in marks.step_dirs(tree.child(marks.rank_name(k))).items():
            found += _piece(store, step, k, "own")
    for step, held in marks.held_steps(tree).items():
        for k in marks.copies(held):
            found += _piece(held.child(marks.copy_name(k)), step, k, "copy")
    return found


def _manifest(ctx: Context, step: int, k: int, kind: str) -> dict[str, Any]:
    """A holder's manifest of one piece (decoded: CRC and fields checked), or why not."""
    store = exchange.store_of(ctx.root, step, k, kind)
    try:
        data = store.read_manifest()
        decode(data, store.path_of(MANIFEST_NAME))
        return {"ok": True, "manifest": data.decode()}
    except (CkptError, OSError, UnicodeDecodeError) as exc:
        return {"ok": False, "why": f"{store.location}: {type(exc).__name__}: {exc}"}


class Restart:
    """One restore's search (collective: construct, then ``next`` / ``fetch`` on every rank).
    Each piece passed over is appended to ``skipped`` (and logged)."""

    def __init__(self, ctx: Context, skipped: list[str],
                 reports: list[list[Found]] | None = None) -> None:
        self.ctx, self.skipped = ctx, skipped
        with _named(ctx, "surveying the pieces left"):
            # ``reports``: every rank's survey, gathered already (with the same-world
            # recovery's inventory: managing/guard.py), else gathered here
            self.reports = [list(r) for r in (
                ctx.meeting.all_gather_json(survey(ctx)) if reports is None else reports)]
            self.regrown = regrow(ctx, self.reports, skipped)
            self.received = self.regrown.received
            for rank, found in self.regrown.found.items():  # rebuilt: held in its memory
                self.reports[rank] += found
        self.bad: set[str] = set()
        self.rounds = 0

    def next(self, only: int | None, above: int | None = None) -> Choice | None:
        """Step 2: the newest step every piece of which is held (its manifests read), or None.
        ``above``: a step of this job's rank count newer than it is searched too (pieces.plan)."""
        with _named(self.ctx, "reading the pieces' manifests"):
            return self._next(only, above)

    def _next(self, only: int | None, above: int | None) -> Choice | None:
        while self.rounds < MAX_ROUNDS:
            self.rounds += 1
            chosen = plan(self.reports, self.ctx.world, self.bad, only, above)
            if chosen is None:
                return None
            step, old, sources = chosen
            mine = {str(k): _manifest(self.ctx, step, k, kind)
                    for k, (kind, holder) in sources.items() if holder == self.ctx.rank}
            read: dict[str, Any] = {}
            for part in self.ctx.meeting.all_gather_json(mine):
                read.update(part)
            failed = {int(k): r["why"] for k, r in read.items() if not r["ok"]}
            if not failed:
                return Choice(step, old, sources, {
                    int(k): decode(r["manifest"].encode(), f"rank {k}'s piece of step {step}")
                    for k, r in read.items()})
            self._pass_over(step, sources, failed)
        return None

    def _pass_over(self, step: int, sources: dict[int, Source], failed: dict[int, str]) -> None:
        for k, why in sorted(failed.items()):
            text = f"rank {k}'s piece of step {step} ({sources[k][0]}): {why}"
            self.skipped.append(text)
            log.warning("ckptio: a restart on %d ranks passes over %s", self.ctx.world, text)
            self.bad.add(item_id(step, k, sources[k]))

    def fetch(self, choice: Choice, state: Any, load_kwargs: dict[str, Any]) -> Fetched | None:
        """Steps 3-4: the byte ranges of ``choice`` this rank's state needs, received (each
        checked by its holder) -> Fetched (``install`` it, load it, remove it); None when a
        piece failed (passed over: call ``next`` again). A state the step cannot be
        resharded into: StateMismatchError, on every rank; a rank gone during the exchange:
        RankFailedError, nothing installed (its sends' or receives' failure: raised by
        ``install``, in the load whose outcome every rank exchanges: no rank left waiting)."""
        with _named(self.ctx, f"fetching step {choice.step}"):
            return self._fetch(choice, state, load_kwargs)

    def _fetch(self, choice: Choice, state: Any, load_kwargs: dict[str, Any]) -> Fetched | None:
        ctx, error, needs = self.ctx, None, []
        objects: list[ObjectEntry] = []
        try:
            kept, objects = merged(choice, ctx.rank, ctx.world, load_kwargs.get("per_rank_from"))
            needs = needed(choice, kept, state, load_kwargs.get("keys"))
        except CkptError as exc:  # said to every rank below: none is left waiting
            error = str(exc) if isinstance(exc, StateMismatchError) else (
                f"{type(exc).__name__}: {exc}")
        every = ctx.meeting.all_gather_json({"needs": needs, "error": error})
        errors = [f"rank {r}: {e['error']}" for r, e in enumerate(every) if e["error"]]
        if errors:
            raise StateMismatchError(f"step {choice.step} cannot be resharded from memory into "
                                     f"this state: {errors[0]}")
        layouts = [exchange.layout(choice, [(int(k), int(i), int(lo), int(hi))
                                            for k, i, lo, hi in e["needs"]]) for e in every]
        placed, size = layouts[ctx.rank]
        out = torch.empty(size, dtype=torch.uint8)
        exchange.zero_gaps(out, placed, 0)
        payloads, sums, failed = exchange.read(ctx, choice, layouts, out)
        bad: dict[str, str] = {}
        mine: list[Any] = []
        for part in ctx.meeting.all_gather_json({"failed": failed, "sums": sums}):
            bad.update(part["failed"])
            mine += part["sums"].get(str(ctx.rank), [])
        if bad:
            self._pass_over(choice.step, choice.sources, {int(k): w for k, w in bad.items()})
            return None
        try:
            received = exchange.exchange(ctx, choice, payloads, placed, out)
        except RuntimeError as exc:  # torch.distributed's: raised by install(), in the load
            # whose outcomes every rank exchanges (managing/agreed.py), so the ranks that
            # finished their exchange do not wait for this one there until step_timeout_s; a
            # peer that died or froze would keep that exchange waiting: raised here
            if left.peer_gone(ctx, exc):
                raise
            return Fetched(choice, placed, objects, out, mine, self.received,
                           _failed(ctx, f"fetching step {choice.step}", exc))
        return Fetched(choice, placed, objects, out, mine, self.received + received)

    def install(self, fetched: Fetched) -> TreeStore:
        """What this rank received as a checkpoint in this process's memory -> its store
        (remove it after the load). The RankFailedError of its exchange, if it failed."""
        if fetched.error is not None:
            raise fetched.error
        return exchange.install(self.ctx, fetched)

    def close(self) -> None:
        """Drop the pieces this rank rebuilt from parity (once the restart is over)."""
        self.regrown.close()


@contextlib.contextmanager
def _named(ctx: Context, what: str) -> Iterator[None]:
    """torch.distributed's errors (a rank gone) as RankFailedError naming ``what``."""
    try:
        yield
    except RuntimeError as exc:  # torch.distributed's errors (DistBackendError included)
        error = _failed(ctx, what, exc)
        ctx.meeting.leave([], str(error))  # the ranks not in a transfer with it wait there
        raise error from exc


def _failed(ctx: Context, what: str, exc: RuntimeError) -> RankFailedError:
    return RankFailedError(
        f"rank {ctx.rank}: a restart on {ctx.world} ranks failed {what} from the memory of "
        f"other hosts: a rank holding pieces of it or receiving its part died or gave no "
        f"answer within peer_timeout_s ({type(exc).__name__}: {exc}); nothing was loaded "
        "and every piece in memory is kept: restart the job (the restore is made again "
        "with the ranks alive then)")
