"""The names a memory tier with redundancy uses on each host, and what its markers say; torch-free
(the ``ckptio`` command reads them).

Under the memory tier's local directory (shm://NAME):

- ``r<rank>/step-N``: each rank's own step (a one-rank checkpoint; with redundancy every tier
  is rank-local, ``<location>/r<rank>``);
- ``.redundancy/step-N/``: what this host holds for others' step N: ``copy-r<rank>/`` (a
  partner's copy, itself a checkpoint directory), ``parity-g<group>-l<local>.bin`` and
  ``.json`` (a parity block and its members' manifests), ``held-r<rank>.json`` (what rank
  <rank> holds for step N, written after its items), ``protected-r<rank>.json`` (written once
  every rank's copies of step N are written: the commit of the protection; ``{"step", "how"}``).

Owns: those names and reading the markers. Does not own: writing them (protect.py), using them
(rebuild.py), the CLI's text (cli/).
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

__all__ = ["REDUNDANCY_DIR", "copy_name", "held_dir", "parity_name", "protected_steps",
           "protection", "rank_dirs", "rank_name"]

REDUNDANCY_DIR = ".redundancy"
_RANK = re.compile(r"r(\d{5,})$", re.ASCII)
_STEP = re.compile(r"step-(\d+)$", re.ASCII)
_PROTECTED = re.compile(r"protected-r(\d{5,})\.json$", re.ASCII)


def rank_name(rank: int) -> str:
    return f"r{rank:05d}"


def held_dir(root: str, step: int) -> str:
    return os.path.join(root, REDUNDANCY_DIR, f"step-{step}")


def copy_name(rank: int) -> str:
    return f"copy-{rank_name(rank)}"


def parity_name(group: int, local: int) -> str:
    return f"parity-g{group}-l{local}"


def rank_dirs(root: str) -> dict[int, str]:
    """The rank-local directories ``r<rank>`` under local directory ``root`` (none: {})."""
    try:
        names = os.listdir(root)
    except OSError:
        return {}
    return {int(m.group(1)): os.path.join(root, n) for n in names if (m := _RANK.match(n))}


def protection(root: str) -> dict[int, dict[str, Any]]:
    """Per step with a protection marker here: ``{"how": "parity(k=3)", "ranks": [...]}`` (the
    ranks of this host that committed it)."""
    base = os.path.join(root, REDUNDANCY_DIR)
    out: dict[int, dict[str, Any]] = {}
    try:
        steps = [(int(m.group(1)), n) for n in os.listdir(base) if (m := _STEP.match(n))]
    except OSError:
        return {}
    for step, name in sorted(steps):
        try:
            markers = [(int(m.group(1)), os.path.join(base, name, n))
                       for n in os.listdir(os.path.join(base, name)) if (m := _PROTECTED.match(n))]
        except OSError:
            continue  # removed while listed
        for rank, path in sorted(markers):
            try:
                with open(path, "rb") as f:
                    how = str(json.loads(f.read()).get("how", "?"))
            except (OSError, ValueError):
                continue
            entry = out.setdefault(step, {"how": how, "ranks": []})
            entry["ranks"].append(rank)
    return out


def protected_steps(root: str, rank: int) -> list[int]:
    """Steps whose protection ``rank`` committed here, ascending."""
    return [s for s, p in protection(root).items() if rank in p["ranks"]]
