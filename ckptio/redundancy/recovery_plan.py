"""The plan of a same-world recovery from memory (rebuild.py does the transfers): each rank's
inventory (its own steps, the copies and parity it holds for others), and the newest step every
rank can obtain: from its own memory, a partner's copy or its parity group, items found bad
before passed over, a delta step's bases first.

Owns: the inventory's reading, the plan, the items' names (``copy:r1:of3:s4``) and their words
for messages (``split:r2:s4``: a copy fetched from several holders at once failed, so fetch
it from one at a time). Does not own: the transfers, their checks and the install (rebuild.py,
landing.py), placement (topology.py).
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

from ckptio.errors import CkptError
from ckptio.redundancy import marks
from ckptio.redundancy.marks import protected_steps
from ckptio.redundancy.redundancy import Parity, Partners
from ckptio.redundancy.topology import Topology

__all__ = ["Source", "base_rounds", "copy_id", "describe_item", "inventory", "parity_id", "plan",
           "split_id"]

log = logging.getLogger("ckptio")
# ("own",) | ("copy", first holder, every holder of a good copy) | ("parity", group, members,
# missing)
Source = tuple[Any, ...]


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


def base_rounds(invs: list[dict[str, Any]], topo: Topology, spec: Partners | Parity,
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
        holders = tuple(h for h in topo.partners(rank, spec.n)
                        if any(i["kind"] == "copy" and i["rank"] == rank for i in items(h))
                        and copy_id(h, rank, step) not in bad)
        if split_id(rank, step) in bad:  # a split fetch failed: one holder at a time
            holders = holders[:1]
        return ("copy", holders[0], holders) if holders else None
    host, local = topo.host_of(rank), topo.local_of(rank)
    group = topo.group_of(host, spec.k, spec.m)
    members = [topo.rank_at(h, local) for h in topo.groups(spec.k, spec.m)[group]]
    missing = [m for m in members if not (  # its own step and its parity piece, both good
        _has_own(invs, bad, m, step) and parity_id(m, group, local, step) not in bad
        and any(i["kind"] == "parity" and i["group"] == group and i["local"] == local
                for i in items(m)))]
    if len(missing) > spec.m:
        return None
    return ("parity", group, members, missing)


def _has_own(invs: list[dict[str, Any]], bad: set[str], rank: int, step: int) -> bool:
    return step in invs[rank]["own"] and f"own:r{rank}:s{step}" not in bad


def copy_id(holder: int, rank: int, step: int) -> str:
    return f"copy:r{holder}:of{rank}:s{step}"


def parity_id(holder: int, group: int, local: int, step: int) -> str:
    return f"parity:r{holder}:g{group}:l{local}:s{step}"


def split_id(rank: int, step: int) -> str:
    """``rank``'s copy of ``step`` fetched from several holders at once (copy_fetch.py)."""
    return f"split:r{rank}:s{step}"


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
    if kind == "split":
        return (f"the partner copies of rank {parts['r']}, step {parts['s']}, fetched from "
                "several holders at once (fetched again from one holder at a time)")
    return f"rank {parts['r']}'s own memory copy of step {parts['s']}"
