"""A DeepSpeed tag folder whose files ckptio wrote: where training stood at each file's save,
whether the folder's files are of one save and of every rank, and ``to_torch_save``, which
copies a DeepSpeed checkpoint directory with each ckptio file made a torch.save file again.

Owns: the metadata keys a file's save records (``STANDS``, ``OVER``) and the checks of a tag
folder as one whole save, which both a load (CkptioCheckpointEngine) and ``to_torch_save``
make. Does not own: the checkpoint engine (ckptio.deepspeed_engine), the checks before
DeepSpeed's load (ckptio.deepspeed_guard), the conversion (ckptio.convert). Needs no DeepSpeed.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable

from ckptio.convert import convert
from ckptio.errors import CheckpointNotFoundError, CkptError, IncompleteCheckpointError
from ckptio.shared import load
from ckptio.format.types import Manifest
from ckptio.stepmeta import read_metadata
from ckptio.storage.local.local_root import is_committed

__all__ = ["OVER", "STANDS", "OneSave", "absent_file", "missing_rank_file", "other_save",
           "recorded", "saves", "to_torch_save"]

_RANK_FILE = re.compile(r"zero_pp_rank_(\d+)_(mp_rank_\d+_\w+\.pt)$")  # per rank, per kind
STANDS = "deepspeed_training"  # the metadata key: global_steps and global_samples at the save
OVER = "deepspeed_over_tag"  # the metadata key: the save's tag folder existed before it


def recorded(path: str, record: Manifest | None = None) -> tuple[str | None, bool]:
    """Where training stood when the ckptio file ``path`` (its manifest ``record``, where the
    caller read it) was saved (None: not recorded), and whether that save was over an
    existing tag."""
    if record is not None:
        meta = record.meta.get("metadata")
        meta = meta if isinstance(meta, dict) else {}
    elif not is_committed(path):
        return None, False  # a torch.save file DeepSpeed's own engine wrote
    else:
        meta = read_metadata(path).get("metadata", {})
    value = meta.get(STANDS)
    return (value if isinstance(value, str) else None), meta.get(OVER) is True


def other_save(folder: str, stands: str) -> tuple[str, str] | None:
    """A file of ``folder`` saved where training stood elsewhere than ``stands``, and where."""
    for name in sorted(os.listdir(folder)):
        other = recorded(os.path.join(folder, name))[0]
        if other is not None and other != stands:
            return os.path.join(folder, name), other
    return None


def saves(folder: str, read: Callable[[str], Manifest | None] | None = None
          ) -> list[tuple[str, list[str]]]:
    """The ckptio files of tag ``folder`` by the save that wrote them (where training stood
    then), the save with the most files first: one entry for a tag of one save. ``read``
    gives a file's manifest (the load's own reader, so that each is read once); files whose
    save recorded nothing (DeepSpeed's own torch.save files) are left out."""
    names = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
    by: dict[str, list[str]] = {}
    for name in names:
        path = os.path.join(folder, name)
        record = read(path) if read is not None and is_committed(path) else None
        stands = recorded(path, record)[0]
        if stands is not None:
            by.setdefault(stands, []).append(path)
    return sorted(by.items(), key=lambda item: (-len(item[1]), item[0]))


def to_torch_save(save_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str]) -> str:
    """A copy of DeepSpeed checkpoint directory ``save_dir`` (its tags, ``latest``, scripts)
    in which every ckptio checkpoint is a torch.save file again, for DeepSpeed's offline tools
    that call torch.load themselves (zero_to_fp32.py, ds_to_universal.py). -> out_dir."""
    src, dst = os.fspath(save_dir), os.fspath(out_dir)
    if os.path.exists(dst):
        raise CkptError(f"{dst} exists: to_torch_save writes a new directory (name another)")
    for here, dirs, _ in os.walk(src):  # checked whole before anything is written
        dirs[:] = [d for d in dirs if not _whole_file(os.path.join(here, d))]
        _one_save(here)
    for here, dirs, files in os.walk(src):
        rel = os.path.relpath(here, src)
        os.makedirs(os.path.join(dst, rel), exist_ok=True)
        for name in files:
            shutil.copy2(os.path.join(here, name), os.path.join(dst, rel, name))
        for name in list(dirs):
            if is_committed(os.path.join(here, name)):
                dirs.remove(name)
                convert(os.path.join(here, name), os.path.join(dst, rel, name), to="torch.save",
                        allow_pickle=True)
    return dst


def _whole_file(path: str) -> bool:
    """Whether ``path`` (a directory) is a committed ckptio file of a tag; refused where it is
    a file of a save cut short (a ``.pt`` directory never committed): its bytes are not a
    checkpoint, which a load refuses too."""
    if is_committed(path):
        return True
    if path.endswith(".pt"):
        raise IncompleteCheckpointError(
            f"{path} was never committed (a save_checkpoint of its tag cut short), so the tag "
            f"{os.path.dirname(path)} is not whole: a load refuses it, and to_torch_save does "
            "not copy it; remove that tag folder (its 'latest' names the tag before it, which "
            "a resume loads) and convert again")
    return False


def _one_save(folder: str) -> None:
    """Refuse ``folder`` if its ckptio files are of two saves (as a load does: see
    CkptioCheckpointEngine._check_one_save)."""
    names = sorted(n for n in os.listdir(folder) if n.endswith(".pt"))
    _every_rank(folder, names)
    stands = next((s for n in names if (s := recorded(os.path.join(folder, n))[0])), None)
    other = None if stands is None else other_save(folder, stands)
    if other is not None:
        first = next(os.path.join(folder, n) for n in names
                     if recorded(os.path.join(folder, n))[0] == stands)
        raise IncompleteCheckpointError(
            f"DeepSpeed tag {folder} holds files of two saves: {first} from the one at "
            f"{stands}, {other[0]} from the one at {other[1]} (a save_checkpoint of this tag "
            "cut short left the rest of the earlier save), so they are not one training state: "
            "a load refuses it, and to_torch_save does not copy it; remove that tag folder and "
            "convert again")


def _every_rank(folder: str, names: list[str]) -> None:
    """Refuse ``folder`` if a kind of per-rank file is missing for a rank of the save (the
    data-parallel ranks its model states file records, or a rank another kind has): a save cut
    short before that rank wrote it, which a load on that rank refuses (the file is not there)."""
    missing = missing_rank_file(folder, names, _dp_ranks(folder, names))
    if missing is not None:
        raise IncompleteCheckpointError(
            f"DeepSpeed tag {folder} is not whole: {missing[0]} is missing (rank(s) "
            f"{missing[1]} wrote no such file; a save_checkpoint cut short), so a load on that "
            "rank refuses it and to_torch_save does not copy it; remove that tag folder and "
            "convert again")


def absent_file(path: str) -> CheckpointNotFoundError | None:
    """The error for a file DeepSpeed's load asks for that its tag folder does not hold (None
    where the file exists, or the folder does not: the load's own error says that), naming
    what the folder holds instead of a file spelled alike (another kind of file)."""
    folder, name = os.path.split(path)
    if os.path.exists(path) or not os.path.isdir(folder):
        return None
    names = sorted(n for n in os.listdir(folder) if not n.startswith("."))
    shown = ", ".join(names[:6]) + (f" (and {len(names) - 6} more)" if len(names) > 6 else "")
    how = ("load_checkpoint(..., load_optimizer_states=False) loads its weights alone, or load "
           "another tag" if name.endswith("_optim_states.pt") else "load another tag")
    return CheckpointNotFoundError(
        f"DeepSpeed's load asked for {path}, which its tag folder does not hold (it holds: "
        f"{shown or 'nothing'}): a save cut short, or a tag copied in part; {how}")


def missing_rank_file(folder: str, names: list[str], ranks: int = 0
                      ) -> tuple[str, list[int]] | None:
    """A kind of per-rank file (ZeRO's ``zero_pp_rank_<r>_...``) of tag ``folder`` (holding
    ``names``) missing for a rank: (the first such file's path, the ranks without one); the
    ranks are those of the save where known (``ranks``), and those any kind has a file of."""
    kinds: dict[str, set[int]] = {}
    for name in names:
        match = _RANK_FILE.match(name)
        if match is not None:
            kinds.setdefault(match.group(2), set()).add(int(match.group(1)))
    every = set().union(*kinds.values()) | set(range(ranks))
    for kind, have in sorted(kinds.items()):
        missing = sorted(every - have)
        if missing:
            return os.path.join(folder, f"zero_pp_rank_{missing[0]}_{kind}"), missing
    return None


def _dp_ranks(folder: str, names: list[str]) -> int:
    """The data-parallel ranks the save's ``mp_rank_00_model_states.pt`` records (0: none
    recorded, or no such committed ckptio file)."""
    path = os.path.join(folder, "mp_rank_00_model_states.pt")
    if "mp_rank_00_model_states.pt" not in names or not is_committed(path):
        return 0
    try:
        size = load(path, keys=lambda k: k == "dp_world_size").get("dp_world_size")  # may be absent
    except CkptError:  # unreadable here: its conversion below names the damage
        return 0
    return size if isinstance(size, int) else 0


class OneSave:
    """The tag folders one engine's loads read, each checked as one save: a save_checkpoint of
    an existing tag cut short replaces some of its files and leaves the others as the earlier
    save wrote them, and DeepSpeed's ``latest`` names that tag all along. The files this rank
    reads are compared; a file of a save over an existing tag has every file of the tag
    compared (once per folder), as a rank may read only files of one of the two saves."""

    def __init__(self) -> None:
        self._seen: dict[str, tuple[str, str]] = {}  # tag folder -> (a file loaded, its stand)
        self._scanned: set[str] = set()  # tag folders whose files were all compared

    def forget(self, folder: str) -> None:
        """``folder`` is being saved again: what loads of it saw is no longer there."""
        self._seen.pop(folder, None)
        self._scanned.discard(folder)

    def check(self, path: str, record: Manifest | None) -> None:
        """IncompleteCheckpointError naming a file of each save where ``path`` (its manifest
        ``record``) and the tag's other files were written by two saves."""
        stands, over = recorded(path, record)
        if stands is None:
            return
        folder = os.path.dirname(os.path.abspath(path))
        first, before = self._seen.get(folder, (path, stands))
        if first == path:
            before = stands  # read again: what it holds now
        elif before != stands:
            before = recorded(first)[0] or stands  # saved again since it was read: the new one
        self._seen[folder] = (first, before) if before != stands else (path, stands)
        if before == stands and over and folder not in self._scanned:
            self._scanned.add(folder)
            first, before = other_save(folder, stands) or (first, before)
        if before != stands:
            raise IncompleteCheckpointError(
                f"DeepSpeed tag {folder} holds files of two saves: {first} from the one at "
                f"{before}, {path} from the one at {stands} (a save_checkpoint of this tag cut "
                "short left the rest of the earlier save), so they are not one training state; "
                "load another tag (load_checkpoint(load_dir, tag=...)) and give each save a tag "
                "of its own (DeepSpeed's default, global_step<N>)")
