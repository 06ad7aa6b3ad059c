"""The names a memory tier with redundancy uses on each host, and reading its markers; torch-free
(the ``ckptio`` command reads them). Every byte goes through the root's TreeStore
(storage/store_contract.py); the layout (under the memory tier's local directory, shm://NAME):

- ``r<rank>/step-N``: each rank's own step (with redundancy every tier is rank-local);
  ``r<rank>/.rebuild-step-N`` a restore's copy being verified beside it (a delta's base resolves;
  one a kill left is removed at the next start: landing.drop_scratch, and those of ranks a job
  restarted on fewer ranks no longer has: landing.drop_scratch_beyond);
- ``.redundancy/step-N/``: what this host holds for others' step N: ``copy-r<rank>/`` (a
  partner's copy, a checkpoint), ``parity-g<group>-l<local>.bin`` and ``.json`` (this host's
  parity piece of its group and every member's manifest), ``held-r<rank>.json`` (what rank
  <rank> holds for N, written after its items), ``protected-r<rank>.json`` (the commit of the
  protection, ``{"step", "how"}``), ``elastic-r<rank>/`` (a restart on another rank count:
  rank <rank>'s piece, assembled).

Owns: those names and reading the markers. Does not own: writing them (protect.py), using them
(rebuild.py), the CLI's text (cli/).
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

from ckptio.errors import CkptError
from ckptio.storage.select import store_for
from ckptio.storage.store_contract import TreeStore

__all__ = ["REDUNDANCY_DIR", "Root", "copies", "copy_name", "held", "held_nbytes",
           "held_steps", "parity_name", "protected_steps", "protection", "rank_dirs", "rank_name",
           "parities", "rebuild_dirs", "rebuild_name", "step_dirs", "tree_of"]

log = logging.getLogger("ckptio")

REDUNDANCY_DIR = ".redundancy"
_RANK = re.compile(r"r(\d{5,})$", re.ASCII)
_STEP = re.compile(r"step-(\d+)$", re.ASCII)
_REBUILD = re.compile(r"\.rebuild-step-(0|[1-9]\d*)", re.ASCII)  # as rebuild_name, exactly
_COPY = re.compile(r"copy-r(\d{5,})$", re.ASCII)
_PARITY = re.compile(r"(parity-g\d+-l\d+)\.json$", re.ASCII)
_PROTECTED = re.compile(r"protected-r(\d{5,})\.json$", re.ASCII)
Root = str | TreeStore  # the memory tier's local directory, or its store


def tree_of(location: Root) -> TreeStore:
    """The TreeStore of ``location``; CkptError for a store that is only a Store."""
    store = store_for(location) if isinstance(location, str) else location
    if not isinstance(store, TreeStore):
        raise CkptError(f"{store.location}: redundancy keeps copies, parity pieces and markers "
                        f"beside the steps, which {type(store).__name__} cannot hold (it is a "
                        "Store, not a TreeStore, storage/store_contract.py): use a local directory or "
                        "shm:// for the tier with redundancy")
    return store


def rank_name(rank: int) -> str:
    return f"r{rank:05d}"


def held(root: Root, step: int) -> TreeStore:
    """The location of what this host holds for others' step ``step``."""
    return tree_of(root).child(REDUNDANCY_DIR).child(f"step-{step}")


def copy_name(rank: int) -> str:
    return f"copy-{rank_name(rank)}"


def parity_name(group: int, local: int) -> str:
    return f"parity-g{group}-l{local}"


def rebuild_name(step: int) -> str:
    return f".rebuild-step-{step}"


def step_dirs(where: TreeStore) -> dict[int, TreeStore]:
    """The ``step-N`` locations under ``where`` (a rank's directory), by step."""
    return {int(m.group(1)): where.child(n) for n in _entries(where) if (m := _STEP.match(n))}


def rebuild_dirs(where: TreeStore) -> dict[int, TreeStore]:
    """The ``.rebuild-step-N`` locations under ``where`` (a rank's directory), by step: only
    names ``rebuild_name`` makes, exactly."""
    return {int(m.group(1)): where.child(n) for n in _entries(where)
            if (m := _REBUILD.fullmatch(n))}


def copies(where: TreeStore) -> list[int]:
    """The ranks whose partner copy ``where`` (a ``.redundancy/step-N``) holds, ascending."""
    return sorted(int(m.group(1)) for n in _entries(where) if (m := _COPY.match(n)))


def parities(where: TreeStore) -> list[str]:
    """The parity blocks' names (``parity-g<group>-l<local>``, each a .bin and a .json) that
    ``where`` (a ``.redundancy/step-N``) holds."""
    return sorted(m.group(1) for n in _entries(where) if (m := _PARITY.match(n)))


def rank_dirs(root: Root) -> dict[int, str]:
    """The rank-local locations ``r<rank>`` under ``root`` (none: {})."""
    tree = tree_of(root)
    return {int(m.group(1)): tree.child(n).location for n in _entries(tree)
            if (m := _RANK.match(n))}


def held_steps(root: Root) -> dict[int, TreeStore]:
    """The steps with a ``.redundancy/step-N`` location here, ascending."""
    return dict(sorted(step_dirs(tree_of(root).child(REDUNDANCY_DIR)).items()))


def protection(root: Root) -> dict[int, dict[str, Any]]:
    """Per step with a protection marker here: ``{"how": "parity(k=3)", "ranks": [...]}`` (the
    ranks of this host that committed it)."""
    out: dict[int, dict[str, Any]] = {}
    for step, where in held_steps(root).items():
        markers = sorted((int(m.group(1)), n) for n in _entries(where)
                         if (m := _PROTECTED.match(n)))
        for rank, name in markers:
            try:
                how = str(json.loads(where.read_file(name)).get("how", "?"))
            except CkptError:
                continue  # removed while listed
            except (ValueError, AttributeError) as exc:  # damaged: as if never committed
                log.warning("ckptio: %s unreadable (%s): step %d's copies and parity held "
                            "here for rank %d are passed over", where.path_of(name), exc,
                            step, rank)
                continue
            entry = out.setdefault(step, {"how": how, "ranks": []})
            entry["ranks"].append(rank)
    return out


def held_nbytes(root: Root, ranks: set[int], local: int) -> int:
    """Bytes held here for others, every step: the partner copies of ``ranks`` and the parity
    pieces (and their JSON) of local rank ``local`` (one rank's share of what its host holds)."""
    total = 0
    for where in held_steps(root).values():
        for name in _entries(where):
            m = _COPY.match(name)
            try:
                if m is not None and int(m.group(1)) in ranks:
                    copy = where.child(name)
                    total += sum(copy.sizes(_entries(copy)).values())
                elif name.startswith("parity-") and name.split(".")[0].endswith(f"-l{local}"):
                    total += sum(where.sizes([name]).values())
            except CkptError:
                continue  # removed meanwhile
    return total


def protected_steps(root: Root, rank: int) -> list[int]:
    """Steps whose protection ``rank`` committed here, ascending."""
    return [s for s, p in protection(root).items() if rank in p["ranks"]]


def _entries(where: TreeStore) -> list[str]:
    try:
        return where.entries()
    except CkptError:  # unreadable, or removed while listed: nothing here to count
        return []
