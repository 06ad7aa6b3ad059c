"""What a location without a committed manifest holds instead, said as the error a load raises.

A directory given to load may be an interrupted ckptio save, another library's checkpoint (DCP,
torch.save files, safetensors, a Hugging Face model folder), a parent of ckptio checkpoints, or
nothing. Each is named as what it is, with how to load it. No message advises deleting anything:
it may be another library's good checkpoint.

Owns: those messages, from a listing of the location (any store's), and what counts as a
typo (``spelled_alike``: difflib's candidates within a letter or two, a distance of a few
lines written here, as difflib has none). Does not own: the listing (each store's), finding
the manifest (local/, memory/).
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable

from ckptio.errors import CheckpointNotFoundError, CkptError, IncompleteCheckpointError
from ckptio.format.manifest import MANIFEST_NAME
from ckptio.storage.local.dirlock import LOCK_NAME
from ckptio.storage.store_contract import is_ours

__all__ = ["file_hint", "nearby", "no_manifest", "spelled_alike"]

_DCP_FILE = re.compile(r"^__\d+_\d+\.distcp$")
_STEP = re.compile(r"^step-(\d+)$")
_TORCH_SUFFIXES = (".pt", ".pth", ".bin")


def file_hint(name: str) -> str:
    """How to load a single file named ``name`` that was given as a checkpoint ("" if unknown)."""
    if name.endswith(".safetensors"):
        return ": a safetensors file, load it with safetensors.torch.load_file"
    if name.endswith(_TORCH_SUFFIXES):
        return ": a torch.save file? ckptio.load reads it, or load it with torch.load"
    return ""


def nearby(name: str, siblings: list[str]) -> str:
    """A hint naming what a missing ``name`` may have meant among its parent's ``siblings``
    ("" if nothing is near): the closest steps for a ``step-N``, else names spelled alike."""
    found = _STEP.match(name)
    steps = sorted((int(m.group(1)), n) for n in siblings if (m := _STEP.match(n)))
    if found and steps:
        want = int(found.group(1))
        near = sorted(steps, key=lambda s: (abs(s[0] - want), s[0]))[:2]
        return (f"; its directory holds {len(steps)} step(s), {steps[0][1]} to {steps[-1][1]}; "
                f"nearest: {', '.join(n for _s, n in sorted(near))}")
    close = spelled_alike(name, siblings)
    return f"; did you mean {' or '.join(close)}?" if close else ""


def spelled_alike(name: str, siblings: list[str]) -> list[str]:
    """The (at most two) ``siblings`` spelled like ``name``, closest first: the names a "did
    you mean" hint offers. A typo is a letter or two wrong, missing, added or swapped (one in
    a name of at most 5 characters): names merely alike (two random temporary directories'
    names) are not offered."""
    typos = 1 if len(name) <= 5 else 2
    near = difflib.get_close_matches(name, siblings, n=max(1, len(siblings)), cutoff=0.6)
    return [n for n in near if _edits(name, n, typos) <= typos][:2]


def _edits(a: str, b: str, most: int) -> int:
    """The letters to change, remove, add or swap (two neighbours) to make ``b`` of ``a``,
    counted up to ``most`` + 1 (the optimal string alignment distance, cut short)."""
    if abs(len(a) - len(b)) > most:
        return most + 1
    before, row = None, list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        now = [i] + [0] * len(b)
        for j, y in enumerate(b, 1):
            now[j] = min(row[j] + 1, now[j - 1] + 1, row[j - 1] + (x != y))
            if before is not None and i > 1 and j > 1 and x == b[j - 2] and a[i - 2] == y:
                now[j] = min(now[j], before[j - 2] + 1)
        before, row = row, now
        if min(row) > most:
            return most + 1
    return row[-1]


def no_manifest(location: str, names: list[str],
                is_checkpoint: Callable[[str], bool] = lambda name: False,
                is_tc: Callable[[str], bool] = lambda name: False,
                saving: str | None = None, ended: str | None = None, *,
                elsewhere: str | None = None) -> CkptError:
    """The error for ``location`` holding ``names`` (every entry, sorted) and no committed
    manifest: IncompleteCheckpointError for a ckptio save's leftovers, else
    CheckpointNotFoundError saying what it is. ``is_checkpoint(name)``: whether the entry
    ``name`` is itself a committed ckptio checkpoint (a parent of checkpoints); ``is_tc(name)``:
    whether the step ``name`` holds a torch_checkpointing checkpoint (a run of its steps);
    ``saving``: who holds the location's save lock, a save still running; ``ended``: why its
    save is known to have ended without a commit (its holder gone, its lease expired);
    ``elsewhere``: the save its lock names, on another host (shared storage), where whether it
    still runs cannot be told from here."""
    partial = [n for n in names if is_ours(n) or n == LOCK_NAME]
    if partial and elsewhere is not None:
        return IncompleteCheckpointError(
            f"{location} holds no committed manifest ({MANIFEST_NAME}) yet, only "
            f"{len(partial)} file(s) of {elsewhere} ({_some(partial)}); whether that save still "
            "runs cannot be told from this host: check that job on that host. If it is still "
            "saving, wait for it to finish and load again; if it ended, its save was cut short "
            "before its commit and no committed checkpoint exists here: load an earlier "
            "checkpoint (a later save into this path replaces those files)")
    if partial and saving is not None:
        return IncompleteCheckpointError(
            f"{location} holds no committed checkpoint yet: a save into it ({saving}) is still "
            "running; wait for that save to finish (its SaveHandle.wait(), or the saving "
            "job's CheckpointManager.close()) and load again, or load an earlier checkpoint")
    if partial and ended is not None:
        return IncompleteCheckpointError(
            f"{location} holds no committed manifest ({MANIFEST_NAME}), only {len(partial)} "
            f"partial file(s) of a ckptio save that was interrupted before its commit ({ended}; "
            f"{_some(partial)}): no committed checkpoint exists here. Load an earlier "
            "checkpoint; saving into this path again replaces the leftovers")
    if partial:
        return IncompleteCheckpointError(
            f"{location} holds no committed manifest ({MANIFEST_NAME}), only {len(partial)} "
            f"partial file(s) of a ckptio save that was interrupted before its commit, or is "
            f"still running ({_some(partial)}): no committed checkpoint exists here. Load an "
            "earlier checkpoint; saving into this path again replaces the leftovers")
    return CheckpointNotFoundError(f"{location} {_what_it_holds(names, is_checkpoint, is_tc)}")


def _counted(checkpoints: list[str], kind: str) -> str:
    """"3 ckptio checkpoints (a, b, c)", "5 ... (a ... e)"."""
    shown = (", ".join(checkpoints) if len(checkpoints) <= 3
             else f"{checkpoints[0]} ... {checkpoints[-1]}")
    plural = "s" if len(checkpoints) > 1 else ""
    return f"{len(checkpoints)} {kind} checkpoint{plural} ({shown})"


def _some(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _what_it_holds(names: list[str], is_checkpoint: Callable[[str], bool],
                   is_tc: Callable[[str], bool]) -> str:
    other = _other_library(names)
    if other:
        return other
    checkpoints = _natural([n for n in names if is_checkpoint(n)])
    if checkpoints:
        return (f"holds {_counted(checkpoints, 'ckptio')} but is not one itself: pass one of "
                f"them (e.g. .../{checkpoints[-1]})"
                + (", or use ckptio.CheckpointManager" if any(n.startswith("step-")
                                                               for n in checkpoints) else ""))
    tc = _natural([n for n in names if _STEP.match(n) and is_tc(n)])
    if tc:
        return (f"holds {_counted(tc, 'torch_checkpointing')} (a run of its steps) but is not "
                f"one itself: pass one of them (e.g. .../{tc[-1]}; ckptio.load reads its "
                "files), or point a ckptio.CheckpointManager at this directory, whose restore() "
                "names the newest and how to resume from it")
    trainer = [n for n in names  # ckptio.hf_trainer's checkpoint-N/ckptio
               if n.startswith("checkpoint-") and is_checkpoint(f"{n}/ckptio")]
    if trainer:
        return (f"holds no ckptio checkpoint itself; {_natural(trainer)[-1]}/ckptio is one (a "
                "Hugging Face Trainer's checkpoint-N through ckptio.hf_trainer): pass that")
    found = f"; it holds {_some(names)}" if names else "; it is empty"
    return f"holds no ckptio checkpoint (no {MANIFEST_NAME}){found}"


def _other_library(names: list[str]) -> str:
    """What another library's checkpoint among ``names`` is and how to load it ("" if none)."""
    if ".metadata" in names:
        return ("is a torch.distributed.checkpoint (DCP) checkpoint, not a ckptio one: "
                "ckptio.load and ckptio.verify read it (or torch.distributed.checkpoint.load)")
    if any(_DCP_FILE.match(n) for n in names):
        return ("holds torch.distributed.checkpoint (DCP) data files but no .metadata: a "
                "dcp.save that did not finish, so no complete checkpoint exists here; load an "
                "earlier one")
    safetensors = [n for n in names if n.endswith(".safetensors")]
    if safetensors:
        return (f"holds safetensors files ({_some(safetensors)}) but no "
                "model.safetensors.index.json naming them: ckptio.load reads one of the files, "
                "or load them with safetensors.torch.load_file (a Hugging Face model folder: "
                "with from_pretrained)")
    torch_files = [n for n in names if n.endswith(_TORCH_SUFFIXES)]
    if torch_files:
        return (f"holds torch.save files ({_some(torch_files)}), not a ckptio checkpoint: pass "
                "one of the files to ckptio.load (or load it with torch.load)")
    return ""


def _natural(names: list[str]) -> list[str]:
    """step-9 before step-10."""
    return sorted(names, key=lambda n: [(0, int(p), "") if p.isdigit() else (1, 0, p)
                                        for p in re.split(r"(\d+)", n)])
