"""Restore with redundancy across hosts: agree on the newest step every rank can obtain, verified,
and bring the missing ranks' copies into their memory first.

Call order: ``recover(Context(...), own, anywhere)``, collective over the redundancy's gloo
group, on every rank, before the load (the Guard, guard.py): an inventory of every rank, one
plan made the same on every rank, the transfers, a verified install, a new plan where an item
fails (``recover`` spells the steps out). Every byte goes through the memory tier's TreeStore
(marks.py's layout).

Owns: the inventory, the plan, the transfers of a restore and their verification. Does not own:
the load itself and the fallback to slower tiers (managing/manager.py), placement (topology.py).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ckptio.errors import CkptError, CorruptCheckpointError, RankFailedError
from ckptio.redundancy import marks, peers, stripes
from ckptio.redundancy.marks import protected_steps
from ckptio.redundancy.redundancy import Parity, Partners
from ckptio.redundancy.topology import Topology

__all__ = ["Context", "Recovery", "describe_item", "inventory", "plan", "recover"]

log = logging.getLogger("ckptio")
MAX_ROUNDS = 16
Source = tuple[Any, ...]  # ("own",) | ("copy", holder) | ("parity", group, members, missing)
COPY_TAG = 1  # a partner copy's chunks (the parity chains' tags: stripes.TAG_BASE on)


@dataclass
class Recovery:
    """What the memory side of a restore decided (the same on every rank)."""

    step: int | None  # the step every rank now holds in memory, verified; None: none
    sources: dict[int, str] = field(default_factory=dict)  # rank -> own / partner / parity
    lost_hosts: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # each item passed over, and why
    anywhere: list[list[int]] = field(default_factory=list)  # per rank: steps in any tier
    received: int = 0  # bytes of steps this rank received from peers (copies, parity sums)


def inventory(root: marks.Root, rank: int, own: list[int],
              anywhere: list[int]) -> dict[str, Any]:
    """This rank's report (step 1)."""
    held: dict[str, list[dict[str, Any]]] = {}
    tree = marks.tree_of(root)
    for step in protected_steps(tree, rank):
        where, name = marks.held(tree, step), f"held-{marks.rank_name(rank)}.json"
        try:
            held[str(step)] = json.loads(where.read_file(name))["items"]
        except (CkptError, ValueError, KeyError, TypeError) as exc:
            log.warning("ckptio: %s unreadable (%s): its copies are passed over",
                        where.path_of(name), exc)
    return {"own": sorted(own), "anywhere": sorted(anywhere), "held": held}


def plan(invs: list[dict[str, Any]], topo: Topology, spec: Partners | Parity, bad: set[str],
         only: int | None = None) -> tuple[int, dict[int, Source]] | None:
    """Step 2: (step, source per rank), or None. ``only``: that step or none."""
    steps = sorted({s for inv in invs for s in inv["own"]}, reverse=True)
    steps = [s for s in steps if only is None or s == only]
    for step in steps:
        sources = {r: _source(invs, topo, spec, bad, r, step) for r in range(len(invs))}
        if all(s is not None and all(_source(invs, topo, spec, bad, r, b) is not None
                                     for b in _bases(invs, r, step, s))
               for r, s in sources.items()):
            return step, sources  # type: ignore[return-value]
    return None


def _bases(invs: list[dict[str, Any]], rank: int, step: int, src: Source) -> list[int]:
    """The bases of ``rank``'s ``step`` where it comes from a copy or parity (a delta step:
    its base comes back first, rebuilt the same way); [] for its own memory."""
    if src[0] == "own":
        return []
    holders = [src[1]] if src[0] == "copy" else [m for m in src[2] if m not in src[3]]
    for holder in holders:
        for item in invs[holder]["held"].get(str(step), []):
            if item["kind"] == "copy" and item["rank"] == rank:
                return list(item.get("bases", []))
            if item["kind"] == "parity" and str(rank) in item.get("bases", {}):
                return list(item["bases"][str(rank)])
    return []


def _base_rounds(invs: list[dict[str, Any]], topo: Topology, spec: Partners | Parity,
                 bad: set[str], step: int,
                 sources: dict[int, Source]) -> list[tuple[int, dict[int, Source]]]:
    """(base step, sources) for each base the ranks rebuilt at ``step`` need, oldest first."""
    needs: dict[int, list[int]] = {}
    for r, src in sources.items():
        for b in _bases(invs, r, step, src):
            needs.setdefault(b, []).append(r)
    rounds = []
    for b, ranks in sorted(needs.items()):
        found: dict[int, Source] = {r: ("own",) for r in range(len(invs))}
        found.update({r: _source(invs, topo, spec, bad, r, b) for r in ranks})  # type: ignore
        if any(src[0] != "own" for src in found.values()):
            rounds.append((b, found))
    return rounds


def _source(invs: list[dict[str, Any]], topo: Topology, spec: Partners | Parity, bad: set[str],
            rank: int, step: int) -> Source | None:
    if _has_own(invs, bad, rank, step):
        return ("own",)
    def items(holder: int) -> list[dict[str, Any]]:
        return invs[holder]["held"].get(str(step), [])

    if isinstance(spec, Partners):
        for holder in topo.partners(rank, spec.n):
            if (any(i["kind"] == "copy" and i["rank"] == rank for i in items(holder))
                    and _copy_id(holder, rank, step) not in bad):
                return ("copy", holder)
        return None
    host, local = topo.host_of(rank), topo.local_of(rank)
    group = topo.group_of(host, spec.k, spec.m)
    members = [topo.rank_at(h, local) for h in topo.groups(spec.k, spec.m)[group]]
    missing = [m for m in members if not (  # its own step and its parity piece, both good
        _has_own(invs, bad, m, step) and _parity_id(m, group, local, step) not in bad
        and any(i["kind"] == "parity" and i["group"] == group and i["local"] == local
                for i in items(m)))]
    if len(missing) > spec.m:
        return None
    return ("parity", group, members, missing)


def _has_own(invs: list[dict[str, Any]], bad: set[str], rank: int, step: int) -> bool:
    return step in invs[rank]["own"] and f"own:r{rank}:s{step}" not in bad


def _copy_id(holder: int, rank: int, step: int) -> str:
    return f"copy:r{holder}:of{rank}:s{step}"


def _parity_id(holder: int, group: int, local: int, step: int) -> str:
    return f"parity:r{holder}:g{group}:l{local}:s{step}"


def describe_item(item: str, topo: Topology) -> str:
    """``copy:r1:of3:s4`` -> readable words for messages."""
    kind, *fields = item.split(":")
    parts = {m.group(1): m.group(2) for f in fields if (m := re.match(r"([a-z]+)(\d+)$", f))}
    if kind == "copy":
        holder = int(parts["r"])
        return (f"the partner copy of rank {parts['of']}, step {parts['s']}, held by rank "
                f"{holder} on {topo.describe(topo.host_of(holder))}")
    if kind == "parity":
        holder = int(parts["r"])
        return (f"the parity piece of group {parts['g']} (local rank {parts['l']}), step "
                f"{parts['s']}, held by rank {holder} on {topo.describe(topo.host_of(holder))}")
    return f"rank {parts['r']}'s own memory copy of step {parts['s']}"


# ------------------------------------------------------------------ the collective


@dataclass
class Context:
    """What recover() needs of the manager on this rank."""

    spec: Partners | Parity
    topology: Topology
    group: Any  # the gloo group
    rank: int
    root: str  # the memory tier's local directory (marks.py's layout under it)
    own_dir: Callable[[int], str]  # step -> this rank's step directory
    verify: Callable[[str], Any]  # a committed checkpoint directory -> raises if damaged
    received: int = 0  # bytes this rank received in the restore's transfers (stat)


def recover(ctx: Context, own: list[int], anywhere: list[int], only: int | None = None) -> Recovery:
    """Collective; -> the memory step every rank now holds (or None, with the lost hosts
    named):

    1. **inventory**: each rank reports the steps committed in its own memory, the steps in its
           slower tiers, and the items it holds for others (partner copies, parity pieces) of steps
           whose protection it committed (protect.py's markers). A rank whose memory holds nothing
           (a replacement host, its tmpfs empty) reports nothing.
    2. **plan** (the same on every rank, from the gathered inventories): newest step first, each
           rank's source is its own memory, else a partner's copy (first partner first), else a
           rebuild from its group's parity with the other members' own steps; a step is chosen when
           every rank has a source. Items found bad before are passed over. Parity: at most m
           members of the rank's group miss their own step or parity block (or hold a bad one).
    3. **transfer**: each holder maps its items (peers.map_stream) and checks its block
           against the digest it recorded; a partner copy is sent whole, a rank rebuilt from
           parity receives only its own pieces, each summed along its stripe's survivors
           (stripes.py). The receiver **checks every entry against the original's manifest**
           in memory (peers.check_stream; where its manifest needs more, Checkpointer.verify
           of the written step), writes it into ``r<rank>/.rebuild-step-N`` and only then moves
           it to its ``step-N`` (Store.move_to: one rename). A delta step rebuilt so needs its
           base: the base is brought back first, the same way (the protection keeps a
           protected delta's base's: protect.py). A rank gone during the transfers:
           RankFailedError on the others (torch.distributed's error, named).
    4. Any failure (a copy or block that fails verification, a source that cannot read) is named,
           the item marked bad, and the plan made again: another partner, parity, an older step.
           When no step can be obtained in memory on every rank, the result says which hosts are
           lost (no step in memory at all) and the caller restores the newest step every rank holds
           in some tier (the disk tier, where more than m hosts of one parity group are lost).
    """
    invs = peers.all_gather_json(ctx.group, inventory(ctx.root, ctx.rank, own, anywhere))
    result = Recovery(None, anywhere=[inv["anywhere"] for inv in invs])
    result.lost_hosts = [ctx.topology.describe(h) for h, ranks in enumerate(ctx.topology.hosts)
                         if all(not invs[r]["own"] and not invs[r]["held"] for r in ranks)]
    try:
        _rounds(ctx, invs, result, only)
    except RuntimeError as exc:  # torch.distributed's errors (DistBackendError included)
        raise RankFailedError(
            f"rank {ctx.rank}: restoring from the memory of other hosts failed: a rank it "
            f"exchanges copies, parity or its pieces of a rebuild with died or gave no answer "
            f"within step_timeout_s ({type(exc).__name__}: {exc}); nothing was loaded and "
            "every step in memory is kept: restart the job (the restore is made again with "
            "the ranks alive then)") from exc
    result.received = ctx.received
    return result


def _rounds(ctx: Context, invs: list[dict[str, Any]], result: Recovery,
            only: int | None) -> None:
    """Steps 2-4 into ``result``: plan, transfer, and plan again past each bad item."""
    bad: set[str] = set()
    for _ in range(MAX_ROUNDS):
        chosen = plan(invs, ctx.topology, ctx.spec, bad, only)
        if chosen is None:
            return
        step, sources = chosen
        merged = _attempt(ctx, invs, bad, step, sources)
        if not merged:
            result.step = step
            result.sources = {r: {"own": "own", "copy": "partner", "parity": "parity"}[s[0]]
                              for r, s in sources.items()}
            return
        for item, why in sorted(merged.items()):
            text = f"{describe_item(item, ctx.topology)}: {why}"
            result.skipped.append(text)
            log.warning("ckptio: restore passes over %s", text)
        bad |= set(merged)


def _attempt(ctx: Context, invs: list[dict[str, Any]], bad: set[str], step: int,
             sources: dict[int, Source]) -> dict[str, str]:
    """Steps 3 for ``step``, its bases first where a rank rebuilds a delta step -> {bad item:
    why}, as every rank saw them (the same on every rank)."""
    rounds = [*_base_rounds(invs, ctx.topology, ctx.spec, bad, step, sources), (step, sources)]
    for each, each_sources in rounds:
        merged: dict[str, str] = {}
        for part in peers.all_gather_json(ctx.group, _transfer(ctx, each, each_sources)):
            merged.update(part)
        if merged:
            return merged
    return {}


def _transfer(ctx: Context, step: int, sources: dict[int, Source]) -> dict[str, str]:
    """Step 3 for ``step``; -> {bad item: why} as seen on this rank. Each holder reads its
    items and checks its blocks; the metadata are gathered (any item bad: nothing moves); a
    partner copy is sent whole to its rank, a rank rebuilt from parity receives only its own
    pieces, summed along the survivors of its stripes (stripes.py); each receiver installs
    what it got."""
    sends: list[tuple[int, int, str]] = []  # (sender, receiver, item) in one order everywhere
    for r, src in sorted(sources.items()):
        if src[0] == "copy":
            sends.append((src[1], r, _copy_id(src[1], r, step)))
        elif src[0] == "parity":
            local = ctx.topology.local_of(r)
            for m in src[2]:
                if m not in src[3]:
                    sends += [(m, r, _parity_id(m, src[1], local, step)),
                              (m, r, f"own:r{m}:s{step}")]
    mine: dict[str, Any] = {}
    payload: dict[str, torch.Tensor] = {}
    for sender, _receiver, item in sends:
        if sender == ctx.rank and item not in mine:
            mine[item], data = _read_item(ctx, item, step)
            if data is not None:
                payload[item] = data
    metas: dict[str, Any] = {}
    for part in peers.all_gather_json(ctx.group, mine):
        metas.update(part)
    failures = {item: meta["why"] for item, meta in metas.items() if not meta["ok"]}
    if failures:
        return failures  # alike on every rank: the plan is made again, nothing moved
    copies = [(s, r, i) for s, r, i in sends if i.startswith("copy:")]
    works = [peers.send(ctx.group, payload[i], r, COPY_TAG) for s, r, i in copies
             if s == ctx.rank]
    got = {i: _post_recv(ctx, metas[i]["nbytes"], s) for s, r, i in copies if r == ctx.rank}
    ctx.received += sum(metas[i]["nbytes"] for i in got)
    chains, out = _chains(ctx, step, sources, metas)
    outcome = stripes.run(ctx.group, ctx.rank, chains, lambda kind: _part(ctx, step, kind, payload),
                          out)
    ctx.received += outcome.received
    for work in [w for _data, ws in got.values() for w in ws] + works:
        if work is not None:
            work.wait()
    if outcome.error is not None:
        src = sources[next(c.receiver for c in chains if ctx.rank in (t.rank for t in c.terms))]
        failures[_parity_id(ctx.rank, src[1], ctx.topology.local_of(ctx.rank), step)] = (
            f"rank {ctx.rank} summing its part of a lost piece: {outcome.error}")
    src = sources[ctx.rank]
    if src[0] != "own" and not failures:
        item = next(i for s, r, i in sends if r == ctx.rank and not i.startswith("own:"))
        try:
            data = next(iter(got.values()))[0] if src[0] == "copy" else out
            assert data is not None  # internal: a receiver of parity has its out
            _install(ctx, step, src, metas, data)
        except Exception as exc:  # noqa: BLE001 - every rank must hear of it (they wait in the
            # next gather, up to step_timeout_s); its type and text travel in the reason
            failures[item] = f"{type(exc).__name__}: {exc}"
    return failures


def _post_recv(ctx: Context, nbytes: int, src: int) -> tuple[torch.Tensor, list[Any]]:
    """A partner copy's receive, posted (sent whole by peers.send)."""
    out = torch.empty(nbytes, dtype=torch.uint8)
    return out, [dist.irecv(out, src, group=ctx.group, tag=COPY_TAG)] if nbytes else []


def _chains(ctx: Context, step: int, sources: dict[int, Source],
            metas: dict[str, Any]) -> tuple[list[stripes.Chain], torch.Tensor | None]:
    """Every rank's parity rebuild as chains (alike on every rank), and this rank's step's
    bytes to receive into where it is rebuilt."""
    chains: list[stripes.Chain] = []
    out = None
    for r, src in sorted(sources.items()):
        if src[0] != "parity":
            continue
        info = _info(ctx, step, src, r, metas)
        nbytes = _member(info, r)["nbytes"]
        chains += stripes.plan(src[2], src[3], r, int(info.get("m", 1)), int(info["piece"]),
                               nbytes)
        if r == ctx.rank:
            out = torch.empty(nbytes, dtype=torch.uint8)
    return chains, out


def _info(ctx: Context, step: int, src: Source, rank: int, metas: dict[str, Any]) -> Any:
    """The JSON of a surviving block of ``rank``'s parity group (its members' manifests)."""
    local = ctx.topology.local_of(rank)
    holder = next(m for m in src[2] if m not in src[3])
    return metas[_parity_id(holder, src[1], local, step)]["info"]


def _member(info: Any, rank: int) -> Any:
    return next(m for m in info["members"] if m["rank"] == rank)


def _part(ctx: Context, step: int, kind: str, payload: dict[str, torch.Tensor]) -> torch.Tensor:
    """This rank's own step's bytes ("data") or its parity block's ("block")."""
    if kind == "data":
        return payload[f"own:r{ctx.rank}:s{step}"]
    return next(t for i, t in payload.items() if i.startswith(f"parity:r{ctx.rank}:"))


def _read_item(ctx: Context, item: str, step: int) -> tuple[dict[str, Any], torch.Tensor | None]:
    """The meta and bytes this rank sends for ``item``."""
    try:
        held = marks.held(ctx.root, step)
        kind = item.split(":")[0]
        if kind == "own":
            stream = peers.map_stream(marks.tree_of(ctx.own_dir(step)))
            return {"ok": True, "nbytes": int(stream.data.numel())}, stream.data
        if kind == "copy":
            of = int(item.split(":")[2][2:])
            stream = peers.map_stream(held.child(marks.copy_name(of)))
            return {"ok": True, **stream.meta()}, stream.data
        group, local = (int(p[1:]) for p in item.split(":")[2:4])
        info, block = peers.read_block(held, marks.parity_name(group, local))
        return {"ok": True, "nbytes": info["nbytes"], "info": info}, block
    except CorruptCheckpointError as exc:
        return {"ok": False, "why": str(exc)}, None
    except Exception as exc:  # noqa: BLE001 - the peers wait for this rank's answer: any error
        # of reading its own item is this item's failure, said to every rank
        return {"ok": False, "why": f"{type(exc).__name__}: {exc}"}, None


def _install(ctx: Context, step: int, src: Source, metas: dict[str, Any],
             data: torch.Tensor) -> None:
    """Write this rank's step (a copy's bytes, or rebuilt from parity) as ``step-N``, verified
    first: its entries' checksums checked in memory (peers.check_stream), or, where its manifest
    needs more, the written step verified (Checkpointer.verify) before it is moved in place."""
    if src[0] == "copy":
        meta = metas[_copy_id(src[1], ctx.rank, step)]
    else:
        meta = _member(_info(ctx, step, src, ctx.rank, metas), ctx.rank)
    manifest, files = meta["manifest"].encode(), meta["files"]
    final = marks.tree_of(ctx.own_dir(step))  # r<rank>/step-N under the root
    # beside its step: a delta step's bases (siblings) resolve when it is verified
    scratch = marks.tree_of(ctx.root).child(marks.rank_name(ctx.rank)).child(
        marks.rebuild_name(step))
    try:
        checked = peers.check_stream(manifest, [tuple(f) for f in files], data, final.location)
        peers.write_checkpoint(scratch, manifest, [tuple(f) for f in files], data)
        if not checked:
            ctx.verify(scratch.location)
        scratch.move_to(final)
    finally:
        scratch.remove_tree()
