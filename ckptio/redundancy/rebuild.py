"""Restore with redundancy across hosts: agree on the newest step every rank can obtain, verified,
and bring the missing ranks' copies into their memory first.

Call order: ``recover(Context(...), own, anywhere)``, collective (its gathers: peers.Meeting;
its transfers: gloo), on every rank, before the load (the Guard, guard.py): an inventory, one
plan made the same on every rank (recovery_plan.py), the transfers, a verified install
(landing.py: the step loaded next is offered from memory and written in the background), a new
plan where an item fails (``recover`` spells the steps out).

Owns: the transfers of a restore and their verification. Does not own: the inventory and the
plan (recovery_plan.py), the install (landing.py), the load itself and the fallback to slower
tiers (managing/agreed.py), placement (topology.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ckptio.distributed.dist import silent_ranks
from ckptio.errors import CkptError, CorruptCheckpointError, RankFailedError
from ckptio.redundancy import copy_fetch, left, marks, peers, stripes
from ckptio.redundancy.landing import Landing, StreamCheck, now
from ckptio.redundancy.recovery_plan import (Source, base_rounds, copy_id, describe_item, inventory,
                                          parity_id, plan)
from ckptio.redundancy.topology import Topology
from ckptio.redundancy.redundancy import Parity, Partners
from ckptio.storage.store_contract import TreeStore

__all__ = ["Context", "Recovery", "recover"]

log = logging.getLogger("ckptio")
MAX_ROUNDS = 16
COPY_TAG = 1  # a partner copy's chunks (the parity chains' tags: stripes.TAG_BASE on)
WHAT = "restoring from the memory of other hosts"


@dataclass
class Recovery:
    """What the memory side of a restore decided (the same on every rank)."""

    step: int | None  # the step every rank now holds in memory, verified; None: none
    sources: dict[int, str] = field(default_factory=dict)  # rank -> own / partner / parity
    lost_hosts: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # each item passed over, and why
    anywhere: list[list[int]] = field(default_factory=list)  # per rank: steps in any tier
    received: int = 0  # bytes of steps this rank received from peers (copies, parity sums)
    received_from: dict[int, int] = field(default_factory=dict)  # its step's bytes, per sender
    landed: str | None = None  # where this rank's step lies in memory for the load (landing.py)
    pending: list[Landing] = field(default_factory=list)  # background writes: Guard settles
    extras: list[Any] = field(default_factory=list)  # per rank: ``extra`` of its inventory


# ------------------------------------------------------------------ the collective


@dataclass
class Context:
    """What recover() needs of the manager on this rank."""

    spec: Partners | Parity
    topology: Topology
    meeting: peers.Meeting  # its gathers (a rank outside a transfer waits there for all of it)
    transfers: Any  # the gloo group of its sends and receives (guard.py: peer_timeout_s)
    rank: int
    root: str  # the memory tier's local directory (marks.py's layout under it)
    own_dir: Callable[[int], str]  # step -> this rank's step directory
    verify: Callable[[str], Any]  # a committed checkpoint directory -> raises if damaged
    received: int = 0  # bytes this rank received in the restore's transfers (stat)
    senders: dict[int, int] = field(default_factory=dict)  # of its step's bytes: rank -> bytes
    landings: list[Landing] = field(default_factory=list)  # this rank's, newest last
    placed: TreeStore | None = None  # the scratch its step is received into, until installed


def recover(ctx: Context, own: list[int], anywhere: list[int], only: int | None = None,
            extra: Any = None, failed: str | None = None) -> Recovery:
    """Collective; -> the memory step every rank now holds (or None, with the lost hosts
    named). ``extra`` (JSON) rides on the inventory's gather: every rank's, in rank order, is
    ``Recovery.extras`` (the Guard's survey for a restart on another rank count, no gather of
    its own); so does ``failed``, this rank's error before it (any rank's: RankFailedError on
    every rank, naming it, before anything moves):

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
           against the digest it recorded; a partner copy comes from every holder of a good
           copy at once, each sending its share of its chunks (copy_fetch.py); a rank rebuilt
           from parity receives only its own pieces, each summed along its stripe's survivors
           (stripes.py). The receiver **checks every entry against the original's manifest**
           in memory as it lands (landing.StreamCheck; where its manifest needs more,
           Checkpointer.verify of the written step), writes it into ``r<rank>/.rebuild-step-N``
           (on tmpfs its chunks land in that directory's data file itself, peers.landing_buffer:
           the write is its manifest) and only then moves it to its ``step-N`` (one rename);
           the step the load takes next, where the in-memory check was all, is offered to the
           load from memory (not checked again) and written so in the background once loaded
           instead (landing.py: ``Recovery.landed``; the Guard starts ``Recovery.pending``'s
           writes after the load and settles them before the tier is used again). A delta
           step rebuilt so needs its base: the base is brought back first, the same way (the
           protection keeps a protected delta's base's: protect.py). A rank whose transfers
           fail says so in the gather after them: RankFailedError on every rank (left.py).
    4. Any failure (a copy or block that fails verification, a source that cannot read) is named,
           the item marked bad, and the plan made again: another partner, parity, an older step.
           When no step can be obtained in memory on every rank, the result says which hosts are
           lost (no step in memory at all) and the caller restores the newest step every rank holds
           in some tier (the disk tier, where more than m hosts of one parity group are lost).
    """
    mine = {**inventory(ctx.root, ctx.rank, own, anywhere), "extra": extra, "failed": failed}
    try:
        invs = ctx.meeting.all_gather_json(mine)  # every rank's restore meets here
        left.raise_said(ctx, {r: inv["failed"] for r, inv in enumerate(invs) if inv["failed"]},
                        WHAT)
        result = Recovery(None, anywhere=[inv["anywhere"] for inv in invs],
                          extras=[inv["extra"] for inv in invs])
        result.lost_hosts = [ctx.topology.describe(h)
                             for h, ranks in enumerate(ctx.topology.hosts)
                             if all(not invs[r]["own"] and not invs[r]["held"] for r in ranks)]
        _rounds(ctx, invs, result, only)
    except RuntimeError as exc:  # torch.distributed's errors (DistBackendError included)
        gone = silent_ranks(ctx.topology.others(ctx.rank), ctx.transfers)
        who = ctx.topology.name_ranks(gone) or "a rank of the job"
        error = RankFailedError(
            f"rank {ctx.rank}: restoring from the memory of other hosts failed: {who} (one it "
            "exchanges its inventory, copies, parity or pieces of a rebuild with) died, does "
            "not call restore() at this point, or gave no answer within peer_timeout_s "
            f"({type(exc).__name__}: {exc}); nothing was loaded and every step in memory is "
            "kept: restart the job (the restore is made again with the ranks alive then)",
            tuple(gone))
        ctx.meeting.leave(gone, str(error))  # the ranks not in a transfer with it wait there
        raise error from exc
    finally:
        _drop_placed(ctx)
    result.received, result.pending = ctx.received, ctx.landings
    result.received_from = dict(sorted(ctx.senders.items()))
    landed = [each for each in ctx.landings if each.step == result.step]
    result.landed = landed[-1].location if landed and result.step is not None else None
    return result


def _rounds(ctx: Context, invs: list[dict[str, Any]], result: Recovery, only: int | None) -> None:
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
    rounds = [*base_rounds(invs, ctx.topology, ctx.spec, bad, step, sources), (step, sources)]
    for each, each_sources in rounds:
        if all(src[0] == "own" for src in each_sources.values()):
            continue  # nothing to move: alike on every rank, so no gather either
        later = each == step  # the step loaded next: written while it loads (landing.py)
        merged = {item: why for part in ctx.meeting.all_gather_json(
            _transfer(ctx, each, each_sources, later)) for item, why in part.items()}
        left.raise_said(ctx, left.said_by(merged), WHAT, ctx.transfers)
        if merged:
            return merged
    return {}


def _transfer(ctx: Context, step: int, sources: dict[int, Source],
              later: bool = False) -> dict[str, str]:
    """Step 3 for ``step``; -> {bad item: why} as seen on this rank. Each holder reads its
    items and checks its blocks; the metadata are gathered (any item bad: nothing moves); a
    partner copy is sent to its rank by every holder at once (copy_fetch.py), a rank rebuilt
    from parity receives only its own pieces, summed along the survivors of its stripes
    (stripes.py); each receiver installs what it got."""
    sends: list[tuple[int, int, str]] = []  # (sender, receiver, item) in one order everywhere
    for r, src in sorted(sources.items()):
        if src[0] == "copy":  # every holder of a good copy: each sends its share
            sends += [(h, r, copy_id(h, r, step)) for h in src[2]]
        elif src[0] == "parity":
            local = ctx.topology.local_of(r)
            for m in src[2]:
                if m not in src[3]:
                    sends += [(m, r, parity_id(m, src[1], local, step)),
                              (m, r, f"own:r{m}:s{step}")]
    mine: dict[str, Any] = {}
    payload: dict[str, torch.Tensor] = {}
    for sender, _receiver, item in sends:
        if sender == ctx.rank and item not in mine:
            mine[item], data = _read_item(ctx, item, step)
            if data is not None:
                payload[item] = data
    metas = {item: meta for part in ctx.meeting.all_gather_json(mine)
             for item, meta in part.items()}
    failures = {item: meta["why"] for item, meta in metas.items() if not meta["ok"]}
    if failures:
        return failures  # alike on every rank: the plan is made again, nothing moved
    try:
        return _move(ctx, step, sources, metas, sends, payload, later)
    except Exception as exc:  # noqa: BLE001 - said in the next gather, where the others wait
        # for this rank (left.py); a peer gone: raised (recover names it)
        if left.peer_gone(ctx, exc):
            raise
        return left.said(ctx.rank, exc)


def _move(ctx: Context, step: int, sources: dict[int, Source], metas: dict[str, Any],
          sends: list[tuple[int, int, str]], payload: dict[str, torch.Tensor],
          later: bool) -> dict[str, str]:
    """_transfer's moves, every item's metadata good -> {bad item: why}."""
    failures: dict[str, str] = {}
    src = sources[ctx.rank]
    out = _landing(ctx, step, src, metas)
    copies = copy_fetch.plan(step, sources, metas)
    works = copy_fetch.send(ctx.transfers, ctx.rank, copies, payload, COPY_TAG)
    got = copy_fetch.post(ctx.transfers, ctx.rank, copies, COPY_TAG, out)
    chains = _chains(ctx, step, sources, metas)
    _count(ctx, chains, got)
    data = got.out if got is not None else out
    check, broken = None, None
    if src[0] != "own" and data is not None:
        try:  # hashed as it lands (landing.StreamCheck)
            check = StreamCheck(_meta(ctx, step, src, metas)["manifest"].encode(),
                                _files(ctx, step, src, metas), data,
                                marks.tree_of(ctx.own_dir(step)).location)
        except CkptError as exc:  # said as this item's failure once the transfers are done
            broken = exc
    outcome = stripes.run(ctx.transfers, ctx.rank, chains,
                          lambda kind: _part(ctx, step, kind, payload), out,
                          landed=None if check is None else check.landed)
    ctx.received += outcome.received
    if got is not None:
        got.land(check)
    for work in works:
        work.wait()
    if outcome.error is not None:
        summed = sources[next(c.receiver for c in chains
                              if ctx.rank in (t.rank for t in c.terms))]
        failures[parity_id(ctx.rank, summed[1], ctx.topology.local_of(ctx.rank), step)] = (
            f"rank {ctx.rank} summing its part of a lost piece: {outcome.error}")
    if src[0] != "own" and not failures:
        try:
            if broken is not None:
                raise broken
            assert data is not None and check is not None  # internal: a receiver has both
            _install(ctx, step, src, metas, data, later, check)
        except Exception as exc:  # noqa: BLE001 - every rank must hear of it (they wait in the
            # next gather, up to step_timeout_s); its type and text travel in the reason
            items = got.blame(check, step) if got is not None else [next(
                i for s, r, i in sends if r == ctx.rank and not i.startswith("own:"))]
            failures.update({item: f"{type(exc).__name__}: {exc}" for item in items})
    _drop_placed(ctx)  # not installed: its scratch directory goes
    return failures


def _landing(ctx: Context, step: int, src: Source, metas: dict[str, Any]) -> torch.Tensor | None:
    """This rank's step's bytes to receive into (None: it receives none): the data file of
    its scratch directory where the step can land in place (peers.landing_buffer: installing
    it is then its manifest and a rename), else fresh memory (also where an earlier round's
    landing of this step is still to be written from that directory)."""
    if src[0] == "own":
        return None
    nbytes = int(_meta(ctx, step, src, metas)["nbytes"])
    if any(each.step == step for each in ctx.landings):
        return torch.empty(nbytes, dtype=torch.uint8)
    scratch = _scratch(ctx, step)
    out, placed = peers.landing_buffer(scratch, _files(ctx, step, src, metas), nbytes)
    ctx.placed = scratch if placed else None
    return out


def _scratch(ctx: Context, step: int) -> TreeStore:
    """``r<rank>/.rebuild-step-N``: beside its step, so a delta step's bases (siblings)
    resolve when it is verified."""
    return marks.tree_of(ctx.root).child(marks.rank_name(ctx.rank)).child(
        marks.rebuild_name(step))


def _drop_placed(ctx: Context) -> None:
    """The scratch directory a step was received into and never installed, removed."""
    if ctx.placed is not None:
        ctx.placed.remove_tree()
        ctx.placed = None


def _count(ctx: Context, chains: list[stripes.Chain], got: copy_fetch.Receiving | None) -> None:
    """The bytes this rank receives of its step this round, per sending rank."""
    senders = got.received_from() if got is not None else {}
    for chain in chains:
        last = chain.terms[-1].rank
        if chain.receiver == ctx.rank and last != ctx.rank:
            senders[last] = senders.get(last, 0) + chain.length
    for rank, nbytes in senders.items():
        ctx.senders[rank] = ctx.senders.get(rank, 0) + nbytes
    ctx.received += got.fetch.nbytes if got is not None else 0


def _chains(ctx: Context, step: int, sources: dict[int, Source],
            metas: dict[str, Any]) -> list[stripes.Chain]:
    """Every rank's parity rebuild as chains (alike on every rank)."""
    chains: list[stripes.Chain] = []
    for r, src in sorted(sources.items()):
        if src[0] != "parity":
            continue
        info = _info(ctx, step, src, r, metas)
        chains += stripes.plan(src[2], src[3], r, int(info.get("m", 1)), int(info["piece"]),
                               _member(info, r)["nbytes"])
    return chains


def _info(ctx: Context, step: int, src: Source, rank: int, metas: dict[str, Any]) -> Any:
    """The JSON of a surviving block of ``rank``'s parity group (its members' manifests)."""
    local = ctx.topology.local_of(rank)
    holder = next(m for m in src[2] if m not in src[3])
    return metas[parity_id(holder, src[1], local, step)]["info"]


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


def _meta(ctx: Context, step: int, src: Source, metas: dict[str, Any]) -> Any:
    """What this rank's received step is (its manifest, files, bytes)."""
    if src[0] == "copy":
        return metas[copy_id(src[1], ctx.rank, step)]
    return _member(_info(ctx, step, src, ctx.rank, metas), ctx.rank)


def _files(ctx: Context, step: int, src: Source, metas: dict[str, Any]) -> list[tuple[str, int]]:
    return [(str(n), int(b)) for n, b in _meta(ctx, step, src, metas)["files"]]


def _install(ctx: Context, step: int, src: Source, metas: dict[str, Any],
             data: torch.Tensor, later: bool, check: StreamCheck) -> None:
    """Install this rank's step (a copy's bytes, or rebuilt from parity), its entries'
    checksums checked in memory as they landed (``check``): ``later`` and nothing more to
    verify, offered to the load from memory while it is written (landing.Landing); else
    written, verified where its manifest needs more (Checkpointer.verify), moved in place."""
    manifest, files = _meta(ctx, step, src, metas)["manifest"].encode(), _files(
        ctx, step, src, metas)
    final = marks.tree_of(ctx.own_dir(step))  # r<rank>/step-N under the root
    scratch = _scratch(ctx, step)
    checked = check.checked()
    for earlier in ctx.landings:  # a round passed over: its write ends before another starts
        earlier.settle()
    ctx.landings.clear()
    placed, ctx.placed = ctx.placed is not None, None  # the scratch is now the install's
    if later and checked:
        ctx.landings.append(Landing(step, final, scratch, manifest, files, data, placed))
    else:
        now(final, scratch, manifest, files, data, checked, ctx.verify, placed)
