"""A checkpoint in another format, so nothing saved with ckptio is locked into it:

    from ckptio.convert import convert
    convert("ckpts/step-100", "out/step-100.dcp", to="dcp")   # plain dcp.load reads it
    convert("ckpts/step-100", "out/step-100.pt", to="torch.save")
    convert("ckpts/step-100", "out/hf", to="safetensors", drop_non_tensors=True)
    convert("ckpts/step-100", "out/step-100", to="torch_checkpointing")

SRC is anything ``ckptio.load`` reads (a ckptio checkpoint, a DCP directory, a torch.save file,
safetensors, a torch_checkpointing directory); a checkpoint saved by many ranks comes out whole
(DTensor shards joined; its per-rank values need ``per_rank_from``).

Call order: ``convert`` -> the destination check -> ``ckptio.load`` of SRC (safetensors:
``export_hf`` streams instead) -> the target's writer (a temporary name beside DST, renamed
into place when complete and fsynced) -> a ``Converted``. What each target keeps of what is
not a tensor, and how ``overwrite`` replaces a destination: on ``convert``.

Owns: the targets, the destination checks and the per-target rules. Does not own: loading and
saving (ckptio.load / save), writing the DCP, torch_checkpointing and torch.save files
(convert_writers.py), the export (ckptio/export.py), DCP's files (torch).
"""

from __future__ import annotations

import os
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ckptio.convert_writers import write_dcp, write_tc, write_torch_save
from ckptio.errors import CkptError
from ckptio.format import param_names, values
from ckptio.format.types import Manifest
from ckptio.loading.stored import RankPolicy
from ckptio.destination import RUN, held_at
from ckptio.loading.opening import committed
from ckptio.options import Options
from ckptio.storage import steps
from ckptio.storage.s3.s3path import is_s3
from ckptio.storage.select import checkpoint_path, local_path, store_for

__all__ = ["TARGETS", "Converted", "convert"]

TARGETS = ("ckptio", "dcp", "torch.save", "safetensors", "torch_checkpointing")
Progress = Callable[[int, int], None]  # (bytes written, bytes in all)
_PLAIN = (int, float, complex, bool, str, bytes, bytearray, type(None))  # weights_only reads
_CONTAINERS = (dict, OrderedDict, list, tuple)  # weights_only reads these, not a defaultdict
# the targets written into DST's directory (not a new directory renamed over it): what held_at
# says of the one each replaces; another checkpoint there would stay beside the new one
_WRITTEN_INTO = {"ckptio": "a ckptio checkpoint", "safetensors": "a Hugging Face folder"}


@dataclass(frozen=True)
class Converted:
    """What ``convert`` wrote: DST, the target, tensor bytes, its files, the keys left out
    (safetensors: tied aliases, and with ``drop_non_tensors`` what it cannot hold) and, for
    torch.save, the keys ``torch.load(weights_only=True)`` refuses."""

    path: str
    to: str
    nbytes: int
    files: tuple[str, ...]
    dropped: tuple[str, ...] = ()
    needs_pickle: tuple[str, ...] = ()


def convert(src: str | os.PathLike[str], dst: str | os.PathLike[str], *, to: str = "ckptio",
            overwrite: bool = False, allow_pickle: bool = False, per_rank_from: RankPolicy = None,
            drop_non_tensors: bool = False, options: Options | None = None,
            progress: Progress | None = None) -> Converted:
    """Write checkpoint ``src`` at ``dst`` as ``to`` (one of TARGETS). A ``dst`` holding a
    checkpoint is refused unless ``overwrite``. allow_pickle / per_rank_from: as for
    ``ckptio.load`` of ``src``. progress: called with (bytes written, bytes in all) while a
    ckptio or safetensors target is written (DCP's and torch.save's writers report nothing).

    Targets, and what happens to what is not a tensor:

    * ``"ckptio"``: ``ckptio.save``; values inline, objects pickled only with ``allow_pickle``.
    * ``"dcp"``: DCP's own ``FileSystemWriter`` (``dcp.save`` in this one process), so that
      ``dcp.load(state, storage_reader=FileSystemReader(DST))`` reads it with no ckptio
      installed. Tensors keep every bit; every other value (ints, strings, bytes, numpy
      arrays, objects) is stored by DCP's own pickle (``torch.save``), which DCP's loader
      unpickles. DCP's flattening shows through: a dict key that is not a str comes back from
      ``dcp.load`` as a str, an empty dict is left out, a tensor held under two keys is stored
      twice. An optimizer's state is keyed by parameter name, as DCP's ``get_state_dict(model,
      opt)`` gives it (``set_state_dict`` then loads it), where SRC recorded the names
      (``ckptio.save`` of a state holding the model and the optimizer); otherwise it stays
      keyed by index, with a warning.
    * ``"torch.save"``: one file holding the state as ``ckptio.load`` returns it (values, tied
      tensors and tuples kept); ``torch.load(weights_only=True)`` reads it unless it holds
      numpy values or pickled objects (``Converted.needs_pickle`` names those keys).
    * ``"safetensors"``: a Hugging Face folder by ``export_hf`` (every key, names as the dotted
      keys; a tied alias is left out, as Hugging Face ties weights itself). Safetensors holds
      tensors only: Python values, numpy/bytes/pickled entries and per-rank values are
      refused, naming every key, unless ``drop_non_tensors`` leaves them out, each with the
      rest of its top-level entry (``Converted.dropped``): of a training state
      ``{"model", "optim", "rng", "step"}`` the model's tensors are kept, as ``model.*``
      (``export_hf(src, dst, keys="model.")`` writes them without the prefix, for
      ``from_pretrained``).
    * ``"torch_checkpointing"``: a directory that torch_checkpointing's
      ``CheckpointManager.load(DST, into={...})`` reads in one process: each top-level key is
      an item, written as its default layout does (``<item>_0.pt``, ``torch.save`` of the
      item), tensors whole; the state's top-level keys must be strings that name files.

    The DCP and torch_checkpointing directories and the torch.save file are written under a temporary name beside DST
    and renamed into place when complete and fsynced; ``overwrite`` replaces an existing one
    (a directory is moved aside first, then removed: a crash between the two renames leaves
    the old one as ``.NAME.ckptio-*.old``). Memory: the whole state in host memory (a load,
    then a save), except for safetensors, which ``export_hf`` streams."""
    src_text, dst_text = os.fsdecode(os.fspath(src)), os.fsdecode(os.fspath(dst))
    if to not in TARGETS:
        raise CkptError(f"convert(to={to!r}): choose one of {', '.join(TARGETS)}")
    _check_destination(src_text, dst_text, to, overwrite)
    if to == "safetensors":
        return _to_safetensors(src_text, dst_text, overwrite, drop_non_tensors, options,
                               progress)
    from ckptio.shared import load

    state = load(src_text, allow_pickle=allow_pickle, per_rank_from=per_rank_from,
                 options=options)
    if to == "ckptio":
        return _to_ckptio(state, dst_text, allow_pickle, options, progress)
    out = os.path.abspath(local_path(dst_text))
    if to == "dcp":
        _name_optimizers(state, src_text, options)
    if to in ("dcp", "torch_checkpointing"):
        (write_dcp if to == "dcp" else write_tc)(state, out)
        return Converted(out, to, _tensor_bytes(state), tuple(sorted(os.listdir(out))))
    write_torch_save(state, out)
    refused = tuple(_refused(state))
    return Converted(out, to, _tensor_bytes(state), (os.path.basename(out),),
                     needs_pickle=refused)


# ------------------------------------------------------------------------------ destinations


def _check_destination(src: str, dst: str, to: str, overwrite: bool) -> None:
    if not dst:
        raise CkptError("convert: DST is empty (an unset variable?); give the directory or file "
                        "to write")
    if checkpoint_path(src).rstrip("/") == checkpoint_path(dst).rstrip("/"):
        raise CkptError(f"convert: SRC and DST are both {dst}; choose another DST")
    # DCP's FileSystemWriter, torch.save and export_hf write local files: checked where they
    # write (a file:// URL's path), not at DST's spelling
    local = local_path(dst) if to != "ckptio" else checkpoint_path(dst)
    if os.path.exists(local) and not (os.path.isfile(local) or os.path.isdir(local)):
        raise CkptError(f"convert to {to}: {dst} is neither a file nor a directory (a device, "
                        "pipe or socket), which a conversion must not replace, even with "
                        "--overwrite; choose another DST")
    held = held_at(dst)
    if to == "torch.save":
        if os.path.isdir(local) or dst.endswith(("/", os.sep)):
            raise CkptError(f"convert to torch.save: {dst} is a directory, and torch.save "
                            "writes one file; choose a file name such as model.pt")
        held = "a file" if held is not None else None
    elif held == "a file":
        raise CkptError(f"convert to {to}: {dst} is a file, and {to} writes a directory; "
                        "choose another DST")
    elif to == "safetensors" and dst.rstrip("/").endswith(".safetensors"):
        raise CkptError(f"convert to safetensors: {dst} names a file; DST is the Hugging Face "
                        "folder (model.safetensors is written inside it)")
    elif held is None and to in ("dcp", "torch_checkpointing") and os.path.isdir(local) \
            and os.listdir(local):
        raise CkptError(f"convert to {to}: {dst} holds files that are not a checkpoint, and "
                        "--overwrite would replace the directory whole; choose an empty or "
                        "new DST")
    if held == "a Hugging Face folder" and to in ("dcp", "torch_checkpointing"):
        raise CkptError(f"convert to {to}: {dst} holds {held}, and {to} would replace the "
                        "directory whole, its config, tokenizer and other files too, even with "
                        "--overwrite: remove it first or choose another DST")
    if held == RUN:
        raise CkptError(f"convert to {to}: {dst} holds {held}; a conversion never writes over "
                        "them, even with --overwrite: give a new DST (or one step's directory "
                        "of the run, to replace that step)")
    if held is not None and overwrite and held != _WRITTEN_INTO.get(to, held):
        raise CkptError(f"convert to {to}: {dst} holds {held}, and {to} writes its files into "
                        "the directory beside that one's, so --overwrite would not replace it: "
                        "the directory would hold both; remove it first or choose another DST")
    if held is not None and not overwrite:
        raise CkptError(f"convert: {dst} already holds {held}; pass overwrite=True (ckptio "
                        "convert --overwrite) to replace it (it stays intact until the new one "
                        "is complete) or choose another DST")


# ------------------------------------------------------------------------------------ targets


def _to_ckptio(state: Any, dst: str, allow_pickle: bool, options: Options | None,
               progress: Progress | None) -> Converted:
    from ckptio.shared import async_save

    handle = async_save(state, dst, allow_pickle=allow_pickle, options=options)
    total = 0
    while progress is not None:  # at least once: the total, then every 0.1 s until done
        now = handle.progress()
        total = now.nbytes_total
        progress(now.nbytes_written, total)
        if handle.done():
            break
        time.sleep(0.1)
    result = handle.wait()
    if progress is not None:  # committed: all of it
        progress(total, total)
    return Converted(result.path, "ckptio", result.nbytes, result.files)


def _name_optimizers(state: Any, src: str, options: Options | None) -> None:
    """Key each optimizer state_dict by the parameter names SRC recorded, as DCP's
    ``get_state_dict(model, opt)`` gives it (what ``dcp.load`` of that form looks for); warn
    about one that stays keyed by index."""
    text = checkpoint_path(src)
    store = None if not is_s3(text) and os.path.isfile(text) else store_for(text, options)
    objects = committed(store).objects if store is not None and steps.is_committed(store) else ()
    names = param_names.recorded({o.key: values.decode(o.value) for o in objects
                                  if param_names.is_marker(o.key)})
    for key in param_names.rekey(state, names):
        warnings.warn(f"convert to dcp: the optimizer state at {key!r} stays keyed by parameter "
                      f"index: {src} recorded no parameter names for it (ckptio.save records them "
                      "when the model is in the same state), so DCP's get_state_dict(model, opt) "
                      "form, keyed by name, will not load it; load it with ckptio.load(DST, "
                      "{..., 'optim': opt}) or dcp.load into opt.state_dict() after a step",
                      stacklevel=3)


def _to_safetensors(src: str, dst: str, overwrite: bool, drop: bool,
                    options: Options | None, progress: Progress | None) -> Converted:
    from ckptio.api import Checkpointer
    from ckptio.export import export_hf

    checkpointer = Checkpointer(options or Options.from_env())
    try:
        record = checkpointer.manifest(src)
    finally:
        checkpointer.close()
    cannot = _not_safetensors(record)
    if cannot and not drop:
        named = "; ".join(f"{k} ({why})" for k, why in list(cannot.items())[:20])
        more = f" and {len(cannot) - 20} more" if len(cannot) > 20 else ""
        raise CkptError(f"convert to safetensors: {src} holds {len(cannot)} key(s) safetensors "
                        f"cannot hold: {named}{more}; pass drop_non_tensors=True (ckptio "
                        "convert --drop-non-tensors) to leave them out, or convert to dcp or "
                        "torch.save, which keep them")
    cannot = _whole_entries(record, cannot)
    done = export_hf(src, dst, keys=None, overwrite=overwrite, options=options,
                     rename=(lambda key: None if key in cannot else key) if cannot else None,
                     progress=progress)
    return Converted(done.path, "safetensors", done.total_size, done.files,
                     dropped=tuple(cannot) + done.dropped)


def _not_safetensors(record: Manifest) -> dict[str, str]:
    """Keys safetensors cannot hold, each with why, in manifest order."""
    cannot: dict[str, str] = {}
    for obj in record.objects:
        cannot.setdefault(obj.key, "a Python value")
    for entry in record.tensors:
        if entry.rank is not None:
            cannot.setdefault(entry.key, "each rank's own value")
        elif entry.kind != "tensor":
            cannot.setdefault(entry.key, f"saved as {entry.kind}")
    return cannot


def _whole_entries(record: Manifest, cannot: dict[str, str]) -> dict[str, str]:
    """``cannot`` plus every tensor of a top-level entry that holds one of its keys: a part of
    an entry does not load (an optimizer's moments without its param groups, an RNG state's
    arrays without its version), and model.safetensors should hold the model's weights."""
    broken = {key.split(".", 1)[0] for key in cannot}
    out = dict(cannot)
    for entry in record.tensors:
        top = entry.key.split(".", 1)[0]
        if top in broken and top != entry.key:
            out.setdefault(entry.key, f"part of {top!r}, which safetensors cannot hold whole")
    return out


# ------------------------------------------------------------------------------------- values


def _leaves(state: Any, key: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted key, leaf) of a nested dict/list/tuple state."""
    if isinstance(state, dict):
        items: Any = state.items()
    elif isinstance(state, (list, tuple)):
        items = enumerate(state)
    else:
        yield key, state
        return
    for name, value in items:
        yield from _leaves(value, f"{key}.{name}" if key else str(name))


def _tensor_bytes(state: Any) -> int:
    import torch

    seen: set[int] = set()
    total = 0
    for _, value in _leaves(state):
        if isinstance(value, torch.Tensor) and id(value) not in seen:
            seen.add(id(value))
            total += value.numel() * value.element_size()
    return total


def _refused(state: Any, key: str = "") -> Iterator[str]:
    """The dotted keys of what ``torch.load(weights_only=True)`` refuses in ``state``: a leaf
    it does not read, a container of a type it does not rebuild (a defaultdict, a namedtuple;
    ``""`` for the state itself)."""
    if type(state) in _CONTAINERS:
        items = state.items() if isinstance(state, dict) else enumerate(state)
        for name, value in items:
            yield from _refused(value, f"{key}.{name}" if key else str(name))
    elif isinstance(state, (dict, list, tuple)) or not _weights_only(state):
        yield key


def _weights_only(value: Any) -> bool:
    """Whether ``torch.load(weights_only=True)`` reads this leaf back."""
    import torch

    return isinstance(value, (torch.Tensor, torch.dtype, torch.device, torch.Size, *_PLAIN))
