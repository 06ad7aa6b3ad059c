"""A lost rank's piece rebuilt from parity for a restart on another number of ranks: before the
restart's plan (elastic.py), a piece of the old job held nowhere is rebuilt from its parity
group's blocks and the other members' pieces into the memory of the rank that receives it
(``mem://``, never written into the memory tier), so the restart then finds every piece.

Call order (collective over the Guard's control group, every rank): ``regrow(ctx, reports,
skipped)`` from elastic.Restart, with the restart's survey of pieces; ``Regrown.close`` once
the restart has loaded:

1. survey: the first rank of each host lists the parity blocks its host holds;
2. plan (pieces.regrowths, pure): the newest step of another rank count that misses pieces,
   each rebuildable (at most m positions of its group lost), newer than any whole step;
3. per rebuild: each holder of a member's piece maps it, each holder of a block checks it
   against the digest recorded when it was encoded; the lost piece is summed along its
   stripes' survivors (stripes.py's chains, planned over the group's positions), so the
   receiver gets the piece's length only, and keeps it as a checkpoint of its process's
   memory (reshard_fetch.store_of, kind "rebuilt"): ``Regrown.found`` offers it to the
   restart's plan as held by the receiver, with no survey again (the restart checks every
   range it reads against its checksums, the load the rest);
4. a rebuild that fails is named in ``skipped`` and passed over (an older step, or none); a
   rank whose transfers fail says so in the gather after them (left.py).

Owns: the parity survey, the rebuild's exchange and the rebuilt pieces until ``close``. Does
not own: the plan (pieces.py), the chains and the code (stripes.py, erasure.py), the restart
(elastic.py), the names (marks.py, reshard_fetch.store_of).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from ckptio.errors import CkptError, CorruptCheckpointError
from ckptio.redundancy import left, marks, peers, stripes
from ckptio.redundancy.pieces import Found, Held, Regrowth, regrowths
from ckptio.redundancy.reshard_fetch import store_of
from ckptio.storage.memory.memory_store import MemoryStore
from ckptio.storage.store_contract import TreeStore, new_save_id

__all__ = ["Regrown", "regrow"]

log = logging.getLogger("ckptio")
MAX_ROUNDS = 8


def survey_blocks(root: str, first: bool) -> list[Held]:
    """Step 1: the parity blocks this host holds (its first rank reports them)."""
    if not first:
        return []
    found = []
    for step, held in marks.held_steps(root).items():
        for name in marks.parities(held):
            try:
                info = json.loads(held.read_file(f"{name}.json"))
                found.append([step, int(info["group"]), int(info["local"]),
                              int(info["position"]), [int(m["rank"]) for m in info["members"]],
                              int(info.get("m", 1))])
            except (CkptError, ValueError, KeyError, TypeError) as exc:
                log.warning("ckptio: %s unreadable (%s): passed over", held.path_of(name), exc)
    return found


@dataclass
class Regrown:
    """What ``regrow`` did (alike on every rank but ``received`` and ``stores``)."""

    found: dict[int, list[Found]] = field(default_factory=dict)  # receiver -> pieces it holds
    received: int = 0  # bytes this rank received
    stores: list[TreeStore] = field(default_factory=list)  # this rank's rebuilt pieces

    def close(self) -> None:
        """Drop this rank's rebuilt pieces (after the restart's load)."""
        for store in self.stores:
            store.remove_tree()
        self.stores.clear()


def regrow(ctx: Any, reports: list[list[Found]], skipped: list[str]) -> Regrown:
    """Steps 1-4 (collective; ``ctx``: elastic.Context) -> the pieces rebuilt, each offered as
    held by its receiver (``Regrown.found``: add them to the survey), in its memory."""
    out = Regrown()
    if not any(found[2] != ctx.world for report in reports for found in report):
        return out  # no piece of another rank count: nothing to rebuild (alike everywhere)
    topo = ctx.topology
    first = topo.hosts[topo.host_of(ctx.rank)][0] == ctx.rank
    blocks = ctx.meeting.all_gather_json(survey_blocks(ctx.root, first))
    bad: set[str] = set()
    for _ in range(MAX_ROUNDS):
        chosen = regrowths(reports, blocks, ctx.world, bad, None)
        if chosen is None:
            return out
        step, todo = chosen
        kept: list[TreeStore] = []
        for task in todo:
            try:
                mine, got, store = _rebuild(ctx, task)
                out.received += got
                kept += [store] if store is not None else []
                failures: dict[str, str] = {}
                for part in ctx.meeting.all_gather_json(mine):
                    failures.update(part)
                left.raise_said(ctx, left.said_by(failures), f"rebuilding rank {task.rank}'s "
                                f"piece of step {task.step} from parity", ctx.transfers)
            except BaseException:  # a rank gone (elastic.py names it): no piece kept
                out.stores += kept
                out.close()
                raise
            if failures:
                why = "; ".join(f"{k}: {v}" for k, v in sorted(failures.items()))
                text = f"rank {task.rank}'s piece of step {step}, rebuilt from parity: {why}"
                skipped.append(text)
                log.warning("ckptio: a restart on %d ranks passes over %s", ctx.world, text)
                bad.add(f"regrow:r{task.rank}:s{step}")
                for each in kept:
                    each.remove_tree()
                break
        else:
            out.stores += kept
            for task in todo:
                out.found.setdefault(task.receiver, []).append(
                    [step, task.rank, _world(reports, step), "rebuilt"])
            return out
    return out


def _world(reports: list[list[Found]], step: int) -> int:
    """The rank count of the job that saved ``step`` (one, where pieces.regrowths chose it)."""
    return next(int(found[2]) for report in reports for found in report if found[0] == step)


def _rebuild(ctx: Any, task: Regrowth) -> tuple[dict[str, str], int, TreeStore | None]:
    """Step 3 for one lost piece -> ({item: why} as this rank saw it, the bytes it received,
    the receiver's piece in its memory).
    Each holder maps its member's piece and reads its block; the lost piece is summed along
    its stripes' survivors (stripes.py: the chains of the same-world rebuild), the receiver
    getting the piece's length only."""
    mine: dict[str, Any] = {}
    payload: dict[str, torch.Tensor] = {}
    for j in sorted(task.pieces):
        if task.pieces[j][1] == ctx.rank:
            mine[f"piece {j}"], payload[f"data:{j}"] = _read_piece(ctx, task, j)
        if task.blocks[j] == ctx.rank:
            mine[f"block {j}"], payload[f"block:{j}"] = _read_block(ctx, task, j)
    metas: dict[str, Any] = {}
    for part in ctx.meeting.all_gather_json(mine):
        metas.update(part)
    failures = {item: meta["why"] for item, meta in metas.items() if not meta["ok"]}
    if failures:
        return failures, 0, None
    info = next(meta for item, meta in metas.items() if item.startswith("block"))
    lost = info["lost"]
    out = torch.empty(lost["nbytes"], dtype=torch.uint8) if ctx.rank == task.receiver else None
    try:
        outcome = stripes.run(ctx.transfers, ctx.rank, _chains(task, info), payload.__getitem__,
                              out)
    except RuntimeError as exc:  # torch.distributed's: said in the gather after it, where the
        # others wait for this rank (left.py); a peer gone: raised (elastic.py names it)
        if left.peer_gone(ctx, exc):
            raise
        return left.said(ctx.rank, exc), 0, None
    if outcome.error is not None:
        return {f"rank {ctx.rank}'s sums": outcome.error}, outcome.received, None
    if out is None:
        return {}, outcome.received, None
    return {}, outcome.received, _install(ctx, task, lost, out)


def _chains(task: Regrowth, info: dict[str, Any]) -> list[stripes.Chain]:
    """The chains that rebuild the lost piece (alike on every rank): planned over the group's
    positions, each term then taken by the rank holding that position's piece ("data:<j>") or
    block ("block:<j>"), the result sent to the receiver."""
    n = len(task.members)
    me = task.members.index(task.rank)
    chains = stripes.plan(list(range(n)), task.lost, me, task.m, info["piece"] or info["nbytes"],
                          info["lost"]["nbytes"])
    return [dataclasses.replace(chain, receiver=task.receiver, terms=tuple(
        dataclasses.replace(t, kind=f"{t.kind}:{t.rank}", rank=(
            task.pieces[t.rank][1] if t.kind == "data" else task.blocks[t.rank]))
        for t in chain.terms)) for chain in chains]


def _read_piece(ctx: Any, task: Regrowth, j: int) -> tuple[dict[str, Any], torch.Tensor]:
    kind, _holder = task.pieces[j]
    old = task.members[j]
    tree = marks.tree_of(ctx.root)
    store = (tree.child(marks.rank_name(old)).child(f"step-{task.step}") if kind == "own" else
             marks.held(tree, task.step).child(marks.copy_name(old)))
    try:
        stream = peers.map_stream(store)
    except CkptError as exc:
        return {"ok": False, "why": f"{type(exc).__name__}: {exc}"}, torch.empty(0)
    return {"ok": True, "nbytes": int(stream.data.numel())}, stream.data


def _read_block(ctx: Any, task: Regrowth, j: int) -> tuple[dict[str, Any], torch.Tensor]:
    held = marks.held(ctx.root, task.step)
    try:
        info, block = peers.read_block(held, marks.parity_name(task.group, task.local))
    except CorruptCheckpointError as exc:
        return {"ok": False, "why": str(exc)}, torch.empty(0)
    except (CkptError, ValueError, KeyError, TypeError) as exc:
        return {"ok": False, "why": f"{type(exc).__name__}: {exc}"}, torch.empty(0)
    lost = next(m for m in info["members"] if m["rank"] == task.rank)
    return {"ok": True, "nbytes": int(block.numel()), "piece": int(info.get("piece", 0)),
            "lost": lost}, block


def _install(ctx: Any, task: Regrowth, lost: dict[str, Any], data: torch.Tensor) -> TreeStore:
    """The rebuilt piece as a checkpoint of this process's memory (``data`` adopted, no copy;
    the restart checks every entry it reads against its checksum)."""
    store = store_of(ctx.root, task.step, task.rank, "rebuilt")
    if not isinstance(store, MemoryStore):  # store_of's "rebuilt" kind is this process's memory
        raise CkptError(f"step {task.step}: the rebuilt piece's store {store.location} is not "
                        "in this process's memory; a bug in ckptio, please report it")
    store.remove_tree()
    store.prepare()
    view = data.numpy().data.cast("B") if data.numel() else memoryview(bytearray())
    at = 0
    for name, nbytes in lost["files"]:
        store.adopt_file(str(name), view[at:at + int(nbytes)])
        at += int(nbytes)
    store.commit(lost["manifest"].encode(), new_save_id())
    return store
