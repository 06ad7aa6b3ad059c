"""A lost rank's piece rebuilt from parity for a restart on another number of ranks: before the
restart's plan (elastic.py), a piece of the old job held nowhere is rebuilt from its parity
group's blocks and the other members' pieces, left in this job's hosts' memory, and kept as a
partner copy would be, so the restart then finds every piece.

Call order (collective over the Guard's control group, every rank): ``regrow(ctx, reports,
skipped)`` from elastic.Restart, with the restart's survey of pieces:

1. survey: the first rank of each host lists the parity blocks its host holds;
2. plan (pieces.regrowths, pure): the newest step of another rank count that misses pieces,
   each rebuildable (at most m positions of its group lost), newer than any whole step;
3. per rebuild: each holder of a member's piece sends it, each holder of a block checks it
   against the digest recorded when it was encoded and sends it; the receiver decodes the lost
   piece (erasure.member) and commits it as ``.redundancy/step-N/copy-r<old rank>`` (the
   restart checks every entry it reads against its checksum, and the load checks the rest);
4. a rebuild that fails is named in ``skipped`` and passed over (an older step, or none).

Owns: the parity survey and the rebuild's exchange. Does not own: the plan (pieces.py), the
code (erasure.py), the restart (elastic.py), the names on each host (marks.py).
"""

from __future__ import annotations

import json
import logging
from typing import Any

import torch

from ckptio.errors import CkptError, CorruptCheckpointError
from ckptio.redundancy import erasure, marks, peers
from ckptio.redundancy.pieces import Found, Held, Regrowth, regrowths

__all__ = ["regrow"]

log = logging.getLogger("ckptio")
MAX_ROUNDS = 8
BLOCK_TAG = 1


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


def regrow(ctx: Any, reports: list[list[Found]], skipped: list[str]) -> bool:
    """Steps 1-4 (collective; ``ctx``: elastic.Context) -> whether a piece was rebuilt (the
    caller surveys again)."""
    topo = ctx.topology
    first = topo.hosts[topo.host_of(ctx.rank)][0] == ctx.rank
    blocks = peers.all_gather_json(ctx.group, survey_blocks(ctx.root, first))
    bad: set[str] = set()
    for _ in range(MAX_ROUNDS):
        chosen = regrowths(reports, blocks, ctx.world, bad, None)
        if chosen is None:
            return False
        step, todo = chosen
        for task in todo:
            failures: dict[str, str] = {}
            for part in peers.all_gather_json(ctx.group, _rebuild(ctx, task)):
                failures.update(part)
            if failures:
                why = "; ".join(f"{k}: {v}" for k, v in sorted(failures.items()))
                text = f"rank {task.rank}'s piece of step {step}, rebuilt from parity: {why}"
                skipped.append(text)
                log.warning("ckptio: a restart on %d ranks passes over %s", ctx.world, text)
                bad.add(f"regrow:r{task.rank}:s{step}")
                break
        else:
            return True
    return False


def _rebuild(ctx: Any, task: Regrowth) -> dict[str, str]:
    """Step 3 for one lost piece -> {item: why} as this rank saw it."""
    mine: dict[str, Any] = {}
    payload: dict[str, torch.Tensor] = {}
    for j in sorted(task.pieces):
        if task.pieces[j][1] == ctx.rank:
            mine[f"piece {j}"], payload[f"piece {j}"] = _read_piece(ctx, task, j)
        if task.blocks[j] == ctx.rank:
            mine[f"block {j}"], payload[f"block {j}"] = _read_block(ctx, task, j)
    metas: dict[str, Any] = {}
    for part in peers.all_gather_json(ctx.group, mine):
        metas.update(part)
    failures = {item: meta["why"] for item, meta in metas.items() if not meta["ok"]}
    if failures:
        return failures
    works = [peers.send(ctx.group, data, task.receiver, BLOCK_TAG if item[0] == "b" else 0)
             for item, data in sorted(payload.items()) if ctx.rank != task.receiver]
    received = {}
    if ctx.rank == task.receiver:
        received = {item: payload[item] if _sender(task, item) == ctx.rank else
                    peers.recv(ctx.group, metas[item]["nbytes"], _sender(task, item),
                               BLOCK_TAG if item[0] == "b" else 0) for item in sorted(metas)}
    for work in works:
        if work is not None:
            work.wait()
    if ctx.rank != task.receiver:
        return {}
    try:
        _install(ctx, task, metas, received)
    except (CkptError, OSError) as exc:
        return {"the rebuilt piece": f"{type(exc).__name__}: {exc}"}
    return {}


def _sender(task: Regrowth, item: str) -> int:
    kind, j = item.split()
    return task.pieces[int(j)][1] if kind == "piece" else task.blocks[int(j)]


def _read_piece(ctx: Any, task: Regrowth, j: int) -> tuple[dict[str, Any], torch.Tensor]:
    kind, _holder = task.pieces[j]
    old = task.members[j]
    tree = marks.tree_of(ctx.root)
    store = (tree.child(marks.rank_name(old)).child(f"step-{task.step}") if kind == "own" else
             marks.held(tree, task.step).child(marks.copy_name(old)))
    try:
        stream = peers.read_stream(store)
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


def _install(ctx: Any, task: Regrowth, metas: dict[str, Any],
             received: dict[str, torch.Tensor]) -> None:
    """Decode the lost piece and commit it as its partner copy would be."""
    info = next(meta for item, meta in metas.items() if item.startswith("block"))
    p, lost = info["piece"] or info["nbytes"], info["lost"]
    blocks = {int(i.split()[1]): t for i, t in received.items() if i.startswith("block")}
    shards = {int(i.split()[1]): t for i, t in received.items() if i.startswith("piece")}
    data = erasure.member(len(task.members), task.m, p, task.members.index(task.rank),
                          task.lost, blocks, shards)[:lost["nbytes"]]
    held = marks.held(ctx.root, task.step)
    scratch = held.child(f".regrow-{marks.copy_name(task.rank)}")
    try:
        peers.write_checkpoint(scratch, lost["manifest"].encode(),
                               [tuple(f) for f in lost["files"]], data)
        scratch.move_to(held.child(marks.copy_name(task.rank)))
    finally:
        scratch.remove_tree()
