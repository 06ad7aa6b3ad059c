"""``ckptio ls RUN_DIR``: the steps a CheckpointManager keeps in a directory or under a prefix
(s3://, gs://, az://: any root that lists, storage/steproot.ListedRoot).

    $ ckptio ls ckpts/run-7
    ckpts/run-7: 4 step(s): 3 committed, 1 incomplete; 1 being deleted; 12.9 MiB in all
      STEP  STATE                  SIZE       LOGICAL  FILES  TIME                 BASE
      20    committed           4.1 MiB       4.1 MiB      2  2026-11-24 13:17:05  full
      21    committed         512.0 KiB       4.1 MiB      2  2026-11-24 13:17:06  step-20

What each column and state means, and the JSON schema: docs/CLI.md, "ls". Sizes and times
come from the root's listing of each step (``usage``: local stat, S3's ListObjectsV2; gs:// and
az:// give no times); torch is never imported. A rank's directory of a memory tier with
redundancy (``shm://NAME/r<rank>``) ends with the steps whose protection across hosts is
committed.

Call order (cli/commands.py): ``list_run(location)`` (None: not a run directory) -> ``run``
(text by ``text_lines``, or JSON with ``protected``).

Owns: telling a run directory from a checkpoint (a location with no committed manifest of its
own whose root lists steps), the text and JSON (schema
``ckptio.run/1``). Does not own: which names are steps or hidden (storage/steproot.py), how a root
scans and sizes its steps (storage/*_root.py, storage/s3/root.py), the checkpoint listing
(cli/ls.py).
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

from ckptio.cli.chain import logical_nbytes
from ckptio.cli.ls import human_size
from ckptio.errors import CkptError
from ckptio.format import manifest
from ckptio.options import Options
from ckptio.redundancy import marks
from ckptio.storage import steps as storage_steps
from ckptio.storage.select import checkpoint_path, root_for, scheme_for, scheme_of, store_for
from ckptio.storage.steproot import ListedRoot, foreign_steps

__all__ = ["RANKS_SCHEMA", "SCHEMA", "Step", "list_ranks", "list_run", "protected", "run",
           "run_ranks"]

SCHEMA = "ckptio.run/1"
RANKS_SCHEMA = "ckptio.ranks/1"
STATES = ("committed", "incomplete", "being deleted", "torch_checkpointing")


@dataclass(frozen=True)
class Step:
    """One step of a run: its state, where it is, its bytes and files, its newest file's time."""

    step: int
    state: str  # one of STATES
    path: str
    nbytes: int
    files: int
    mtime: float | None  # seconds since the epoch; None: no file (an empty prefix)
    logical_nbytes: int | None = None  # committed: the tensors' bytes its manifest describes
    bases: tuple[str, ...] = ()  # committed delta: the steps it references (FORMAT.md v4)


def list_run(location: str) -> list[Step] | None:
    """The steps under ``location``, ascending (a step being deleted before a new save of the
    same number); None when ``location`` is not a run: a checkpoint itself, a file, a scheme
    whose root does not list (storage/steproot.ListedRoot), or a place with no step at all."""
    text = checkpoint_path(location)
    if scheme_of(text) is None and not os.path.isdir(text):
        return None
    if scheme_for(text).step_root is None or storage_steps.is_committed(store_for(text)):
        return None  # a checkpoint (ls lists what it holds) or a scheme without steps
    root = root_for(text, Options.from_env())
    if not isinstance(root, ListedRoot):
        return None
    listing = root.scan()
    found = [(s, "committed", root.path(s)) for s in listing["committed"]]
    foreign = set(foreign_steps(root, listing["incomplete"], store_for))
    found += [(s, "torch_checkpointing" if s in foreign else "incomplete", root.path(s))
              for s in listing["incomplete"]]
    found += [(s, "being deleted", where) for s, where in root.being_deleted()]
    if not found:
        return None
    found.sort(key=lambda item: (item[0], STATES.index(item[1]) != 2))
    return [Step(s, state, path, *root.usage(path),
                 *(_chain(path) if state == "committed" else (None, ())))
            for s, state, path in found]


def _chain(path: str) -> tuple[int | None, tuple[str, ...]]:
    """A committed step's logical bytes and bases, from its manifest (unreadable: unknown)."""
    store = store_for(path)
    try:
        record = manifest.decode(store.read_manifest(), store.path_of(manifest.MANIFEST_NAME))
    except CkptError:
        return None, ()
    return logical_nbytes(record), manifest.bases_of(record)


def _when(mtime: float | None) -> str:
    return "-" if mtime is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(mtime))


def text_lines(location: str, steps: list[Step], exact: bool) -> list[str]:
    """The header line, then a line per step (``exact``: sizes in bytes)."""
    count = {state: sum(s.state == state for s in steps) for state in STATES}
    listed = count["committed"] + count["incomplete"] + count["torch_checkpointing"]
    total = sum(s.nbytes for s in steps)
    size = (lambda n: str(n)) if exact else human_size
    head = (f"{location}: {listed} step(s): {count['committed']} committed, "
            f"{count['incomplete']} incomplete"
            + (f"; {count['being deleted']} being deleted" if count["being deleted"] else "")
            + (f"; {count['torch_checkpointing']} holding a torch_checkpointing checkpoint"
               if count["torch_checkpointing"] else "")
            + f"; {size(total)} in all")
    width = max([len(str(s.step)) for s in steps] + [4])
    wide = max([len(s.state) for s in steps] + [13])
    lines = [head, (f"  {'STEP':<{width}s}  {'STATE':{wide}s}  {'SIZE':>12s}  {'LOGICAL':>12s}  "
                    f"{'FILES':>5s}  {'TIME':19s}  BASE")]
    lines += [f"  {s.step:<{width}d}  {s.state:{wide}s}  {size(s.nbytes):>12s}  "
              f"{'-' if s.logical_nbytes is None else size(s.logical_nbytes):>12s}  "
              f"{s.files:>5d}  {_when(s.mtime):19s}  "
              f"{', '.join(s.bases) if s.bases else ('full' if s.state == 'committed' else '')}"
              .rstrip() for s in steps]
    return lines


def protected(location: str, steps: list[Step]) -> list[dict[str, Any]]:
    """The committed steps of a rank-local memory run (``shm://NAME/r<rank>``, a tier with
    redundancy) whose protection across hosts that rank committed: ``{"step", "how"}``."""
    text = checkpoint_path(location)
    if scheme_of(text) is not None:
        return []
    parent, name = os.path.split(text.rstrip("/"))
    rank = next((r for r, d in marks.rank_dirs(parent).items() if os.path.basename(d) == name),
                None)
    if rank is None:
        return []
    committed = {s.step for s in steps if s.state == "committed"}
    return [{"step": s, "how": p["how"]} for s, p in marks.protection(parent).items()
            if rank in p["ranks"] and s in committed]


def run(location: str, steps: list[Step], *, as_json: bool, exact: bool) -> int:
    guarded = protected(location, steps)
    if as_json:
        doc: dict[str, Any] = {"schema": SCHEMA, "location": checkpoint_path(location),
                               "steps": [asdict(s) for s in steps]}
        if guarded:
            doc["protected"] = guarded
        json.dump(doc, sys.stdout, indent=1)
        sys.stdout.write("\n")
        return 0
    for line in text_lines(location, steps, exact):
        sys.stdout.write(line + "\n")
    if guarded:
        sys.stdout.write("  protected across hosts: " + ", ".join(
            f"step {p['step']} ({p['how']})" for p in guarded) + "\n")
    return 0


def list_ranks(location: str) -> dict[str, list[Step]] | None:
    """A location holding each rank's own directory (``r<rank>``: every tier of a manager with
    redundancy, e.g. ``shm://NAME`` on one host) -> each rank directory's location and steps;
    None when it holds none."""
    text = checkpoint_path(location)
    if scheme_of(text) is not None or not os.path.isdir(text):
        return None
    base = location.rstrip("/")
    found = {f"{base}/{marks.rank_name(r)}" for r in marks.rank_dirs(text)}
    return {where: list_run(where) or [] for where in sorted(found)} or None


def run_ranks(location: str, ranks: dict[str, list[Step]], *, as_json: bool, exact: bool) -> int:
    """Print each rank directory's steps in one line (text) or whole (JSON, RANKS_SCHEMA)."""
    if as_json:
        doc = {"schema": RANKS_SCHEMA, "location": checkpoint_path(location), "ranks": [
            {"location": where, "steps": [asdict(s) for s in steps],
             "protected": protected(where, steps)} for where, steps in ranks.items()]}
        json.dump(doc, sys.stdout, indent=1)
        sys.stdout.write("\n")
        return 0
    size = (lambda n: str(n)) if exact else human_size
    out = [f"{location}: {len(ranks)} rank directory(ies), each rank's own steps (the layout "
           "of a manager with redundancy)",
           f"  {'RANK':8s}  {'COMMITTED':20s}  {'INCOMPLETE':10s}  {'SIZE':>12s}  PROTECTED"]
    for where, steps in ranks.items():
        done = [s.step for s in steps if s.state == "committed"]
        guarded = protected(where, steps)
        out.append(f"  {where.rsplit('/', 1)[-1]:8s}  {_steps(done):20s}  "
                   f"{sum(s.state == 'incomplete' for s in steps):<10d}  "
                   f"{size(sum(s.nbytes for s in steps)):>12s}  "
                   f"{', '.join(str(p['step']) for p in guarded) or '-'}")
    out.append(f"one rank's steps: ckptio ls {next(iter(ranks))}")
    sys.stdout.write("\n".join(out) + "\n")
    return 0


def _steps(steps: list[int]) -> str:
    if not steps:
        return "none"
    if len(steps) <= 4:
        return ", ".join(map(str, steps))
    return f"{steps[0]}..{steps[-1]} ({len(steps)})"

