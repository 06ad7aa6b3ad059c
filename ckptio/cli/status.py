"""``ckptio status TIER [TIER ...]``: which steps each tier of a tiered CheckpointManager holds.

    $ ckptio status shm://run-7 /nvme/ckpt s3://bucket/run-7
    tier 0  shm://run-7        committed 40 41(base 40) 42(base 40)
    tier 1  /nvme/ckpt         committed 30 40   copying 42 (committed in tier 0)
    tier 2  s3://bucket/run-7  committed 0       copying 40 (committed in tier 1)

Tiers are given fastest first, as the manager's ``tiers=``. A step without a committed manifest
in a tier is "copying" when a faster tier holds it committed (a drain running, or cut short: the
next start copies it again; restore never picks it), else "incomplete" (an interrupted save).
With redundancy (``Tier(..., redundancy=...)``) every tier is rank-local: each rank found under
a location is a row, and the memory tier's rows say which steps are protected across hosts:

    tier 0  shm://run/r00002  committed 2 3   protected 3 (parity(k=3))
    tier 1  /nvme/ckpt/r00002 committed 2

A committed delta step (docs/FORMAT.md version 4) shows its base, ``41(base 40)``; the JSON
row's ``bases`` maps each delta step to its base steps.

A tier that cannot be read (an endpoint down, no credentials, a missing directory, with names
spelled alike) or holds no step but something else ("not a run": one checkpoint, other names)
gets a row saying why, the others are listed, exit status 2. Torch-free.

Owns: the listing across tiers and its text and JSON (schema ckptio.status/1). Does not own:
how a tier lists its steps (storage/steproot.py), draining (managing/drain.py).
"""

from __future__ import annotations

import json
import os
from typing import Any

from ckptio.errors import CheckpointNotFoundError, CkptError
from ckptio.format import manifest
from ckptio.managing.chains import link_of
from ckptio.options import Options
from ckptio.redundancy import marks
from ckptio.storage import missing_manifest
from ckptio.storage.local import dirlock
from ckptio.storage.select import checkpoint_path, root_for, scheme_of, store_for
from ckptio.storage.steproot import foreign_steps

__all__ = ["run", "tiers_status"]


def tiers_status(locations: list[str], options: Options) -> list[dict[str, Any]]:
    """Per tier: location, committed steps, and the incomplete ones split into copying (a
    faster tier holds them committed: tier index given) and incomplete. A tier of a manager
    with redundancy is rank-local (``<location>/r<rank>``: every rank found here gets its own
    row, with ``rank``); a memory tier's rows then say which steps are protected and how."""
    out: list[dict[str, Any]] = []
    for k, location in enumerate(locations):
        local = None if scheme_of(checkpoint_path(location)) else checkpoint_path(location)
        ranks = marks.rank_dirs(local) if local is not None and os.path.isdir(local) else {}
        guarded = marks.protection(local) if ranks and local is not None else {}
        rows = [(None, location)] if not ranks else [
            (r, f"{location.rstrip('/')}/{marks.rank_name(r)}") for r in sorted(ranks)]
        for rank, where in rows:
            try:
                if local is not None and not os.path.exists(local):
                    raise CheckpointNotFoundError(_missing(local))
                row = _listing(k, where, options, [t for t in out if t.get("rank") == rank])
            except CkptError as exc:  # one unreachable tier: said in its row, the rest shown
                row = {"tier": k, "location": where, "committed": [], "bases": {},
                       "copying": [], "incomplete": [], "error": str(exc)}
                if isinstance(exc, _NotARun):
                    row["not_a_run"] = True
            if rank is not None:
                row["rank"] = rank
                row["protected"] = [{"step": s, "how": p["how"]} for s, p in guarded.items()
                                    if rank in p["ranks"] and s in row["committed"]]
            out.append(row)
    return out


def _missing(path: str) -> str:
    """Why a local tier that does not exist shows nothing, and the names spelled alike."""
    if (broken := dirlock.broken_link(path)) is not None:
        return f"{broken}: fix the link or give the tier's real directory"
    parent, name = os.path.split(os.path.abspath(path))
    near = missing_manifest.nearby(name, os.listdir(parent)) if os.path.isdir(parent) else ""
    return f"no such directory: nothing was ever saved there{near}"


def _listing(k: int, location: str, options: Options,
             faster: list[dict[str, Any]]) -> dict[str, Any]:
    root = root_for(location, options)
    listing = root.scan()
    if not listing["committed"] and not listing["incomplete"]:
        _check_a_run(root.nothing_here(), location)
    copying = {}
    for step in listing["incomplete"]:
        source = next((t["tier"] for t in faster if step in t["committed"]), None)
        if source is not None:
            copying[step] = source
    bases = {str(s): list(b) for s in listing["committed"]
             if (b := _bases(root.path(s), options))}
    foreign = foreign_steps(root, listing["incomplete"], lambda where: store_for(where, options))
    row = {"tier": k, "location": location, "committed": listing["committed"], "bases": bases,
           "copying": [{"step": s, "from_tier": t} for s, t in sorted(copying.items())],
           "incomplete": [s for s in listing["incomplete"]
                          if s not in copying and s not in foreign]}
    if foreign:  # a run moving from torch_checkpointing: its steps, not interrupted saves
        row["torch_checkpointing"] = foreign
    return row


class _NotARun(CkptError):
    """A location that holds something other than a run's steps (its row says what)."""


def _check_a_run(why: str, location: str) -> None:
    """Raise _NotARun when ``location``, holding no step, holds something else: ``why`` is its
    root's nothing_here() (a checkpoint itself, DCP, torch.save files), or local entries that
    are not steps. An empty or absent location is a tier nothing was saved in yet."""
    if not getattr(why, "empty", True):
        what = why.split(": ", 1)[1] if why.startswith("no checkpoint to restore in ") else why
        raise _NotARun(f"{what} (`ckptio ls {location}` lists it); status takes a run's "
                       "directory, the one a CheckpointManager saves step-<N> into")
    local = None if scheme_of(checkpoint_path(location)) else checkpoint_path(location)
    names = sorted(n for n in os.listdir(local) if not n.startswith(".")) \
        if local is not None and os.path.isdir(local) else []
    if names:
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        raise _NotARun(f"it holds no step-<N> checkpoint, only {shown}: give a run's "
                       "directory, the one a CheckpointManager saves step-<N> into")


def _bases(path: str, options: Options) -> tuple[int, ...]:
    """The base steps of the committed step at ``path`` (() for a full step, or unreadable)."""
    store = store_for(path, options)
    try:
        record = manifest.decode(store.read_manifest(), store.path_of(manifest.MANIFEST_NAME))
    except CkptError:
        return ()
    return link_of(record).bases


def run(locations: list[str], *, as_json: bool) -> int:
    """Print the tiers; exit status 2 when a tier could not be read (its row says why)."""
    tiers = tiers_status(locations, Options.from_env())
    failed = 2 if any("error" in t for t in tiers) else 0
    if as_json:
        print(json.dumps({"schema": "ckptio.status/1", "tiers": tiers}, indent=1))
        return failed
    width = max(len(t["location"]) for t in tiers)
    for t in tiers:
        if "error" in t:
            what = "not a run" if t.get("not_a_run") else "unreadable"
            print(f"tier {t['tier']}  {t['location']:<{width}}  {what}: {t['error']}")
            continue
        shown = [f"{s}(base {','.join(map(str, t['bases'][str(s)]))})" if str(s) in t["bases"]
                 else str(s) for s in t["committed"]]
        parts = [f"committed {' '.join(shown) or '-'}"]
        parts += [f"copying {c['step']} (committed in tier {c['from_tier']})" for c in t["copying"]]
        if t["incomplete"]:
            parts.append(f"incomplete {' '.join(map(str, t['incomplete']))}")
        if t.get("torch_checkpointing"):
            parts.append(f"torch_checkpointing {' '.join(map(str, t['torch_checkpointing']))}")
        if "protected" in t and t["tier"] == 0:
            parts.append("protected " + (" ".join(f"{p['step']} ({p['how']})"
                                                  for p in t["protected"]) or "-"))
        print(f"tier {t['tier']}  {t['location']:<{width}}  {'   '.join(parts)}")
    return failed
