"""The guard ckptio.deepspeed_engine.use() puts around a DeepSpeed engine's
``load_checkpoint``: what DeepSpeed 0.19 fails on with an empty AssertionError, a tensor size
error from inside ZeRO, or a torch.load of its own, refused first as a CkptError naming the
file, the keys or ranks, and the fix (docs/guides/deepspeed.md).

Owns: those checks, made before DeepSpeed reads anything: the tag folder a load reads (named,
or from ``latest``) and that its files are of one save (alike on every rank), the saved ZeRO
parameter shapes against the model's, the number of ZeRO-3 ranks, ZeRO 1/2's model-parallel
size, and ZeRO-3 weights without optimizer states; where a load finds no ``latest`` (a fresh
start), the warning naming a run spelled alike beside it (a mistyped directory); and that a
save's or load's directory is a local path (``local_only``: DeepSpeed reaches ``latest`` and
its tag folders with local file calls, so a URL would land in a local folder named ``s3:``);
``exporting``: ``save_16bit_model`` marked an export, whose folder takes no run lease.
Does not own: the checkpoint engine and ``use`` (ckptio.deepspeed_engine), DeepSpeed's load.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import re
import warnings
from typing import Any

from ckptio.api import Checkpointer
from ckptio.deepspeed_reads import zero_to_fp32_reading
from ckptio.deepspeed_tags import missing_rank_file, saves
from ckptio.distributed.arrival import arrive
from ckptio.distributed.dist import current_group, job_ranks, rank_alone_group
from ckptio.errors import (
    CheckpointNotFoundError,
    IncompleteCheckpointError,
    PickleRefusedError,
    StateMismatchError,
    UnsupportedPathError,
    UnsupportedStateError,
)
from ckptio.options import Options
from ckptio.storage.local.local_root import is_committed
from ckptio.storage.missing_manifest import spelled_alike
from ckptio.storage.select import checkpoint_path, scheme_of

__all__ = ["exporting", "guarded_load", "local_only"]


def local_only(directory: str, doing: str) -> None:
    """Refuse a URL as DeepSpeed's save_dir or load_dir (UnsupportedPathError naming what to
    give): DeepSpeed writes and reads ``latest``, its tag folders and its zero_to_fp32.py with
    local file calls, so ``s3://b/run`` left them in a local folder ``s3:/b/run`` (its tensors
    in the bucket) and a restart elsewhere found no ``latest``."""
    scheme = scheme_of(directory)
    if scheme is None:
        return
    local = checkpoint_path(directory)
    instead = (f"give the folder it names, {local}" if scheme_of(local) is None else
               "give a local directory, or a shared file system mounted on every node (NFS, "
               "Lustre)")
    raise UnsupportedPathError(
        f"{doing} {directory}: DeepSpeed writes and reads its 'latest' file and tag folders "
        f"with local file calls, so a {scheme}:// URL would leave them in a local folder named "
        f"'{scheme}:' and a restart would not find them; {instead}")


def guarded_load(load_checkpoint: Any, engine: Any) -> Any:
    """``engine.load_checkpoint`` refusing, as CkptErrors naming the file and the fix, what
    DeepSpeed fails on with an empty AssertionError or a tensor size error, or routes past the
    checkpoint engine: a tag with no files (named, or read from an empty or stale ``latest``);
    under ZeRO, a model whose parameters differ from the saved ones; under ZeRO-3,
    ``load_module_only`` with the optimizer states, which loads no weights. ZeRO-3 weights without
    optimizer states, which DeepSpeed reads through its zero_to_fp32's own torch.load, are
    read through the engine's ``load_alone`` (``zero_to_fp32_reading``). The whole call is
    one ``loading()`` of ckptio's engine: each file's manifest read once in it."""
    signature = inspect.signature(load_checkpoint)

    @functools.wraps(load_checkpoint)
    def load(*args: Any, **kwargs: Any) -> Any:
        scope = getattr(getattr(engine, "checkpoint_engine", None), "loading", None)
        with scope() if callable(scope) else contextlib.nullcontext():  # once per file
            return checked(*args, **kwargs)

    def checked(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        given = bound.arguments
        local_only(os.fspath(given["load_dir"]), "load_checkpoint")
        universal = getattr(engine, "load_universal_checkpoint", lambda: False)()
        folder = None if universal else _tag_folder(os.fspath(given["load_dir"]), given.get("tag"))
        if folder is None:
            return load_checkpoint(*args, **kwargs)
        _whole_tag(engine, folder)
        _check_zero3_layout(engine, folder)
        optimizer = given.get("load_optimizer_states", True)
        reads: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
        if engine.zero_optimization_partition_weights():
            moe = getattr(engine, "has_moe_layers", False)
            if optimizer and given.get("load_module_only", False) and not moe:
                raise _module_only_loads_nothing(folder)
            weights = not optimizer and not moe
            _check_zero3_ranks(engine, folder, weights)
            alone = getattr(engine.checkpoint_engine, "load_alone", None)
            if weights and alone:
                reads = zero_to_fp32_reading(alone, os.path.basename(folder))  # the weights
        if optimizer and not given.get("load_module_only", False) and engine.zero_optimization():
            _check_model_parallel_size(engine, folder)
            _check_parameters(engine, folder)
        with reads:
            return load_checkpoint(*args, **kwargs)

    return load


def _module_only_loads_nothing(folder: str) -> UnsupportedStateError:
    """ZeRO-3's ``load_module_only=True`` with the optimizer states (the default) loads no
    weights in DeepSpeed 0.19.8, with any engine: its model files hold each parameter as an
    empty placeholder and the partitions are read only with the optimizer states, or by
    zero_to_fp32 when ``load_optimizer_states=False``; the model kept its own, silently."""
    return UnsupportedStateError(
        f"load_checkpoint(load_module_only=True) of {folder} under ZeRO-3 would load no weights: "
        "DeepSpeed's ZeRO-3 model files hold each parameter as an empty placeholder, and it "
        "reads the partitions only with the optimizer states (skipped by load_module_only) or "
        "rebuilds them when load_optimizer_states=False, so the model would keep its own "
        "weights silently; pass load_optimizer_states=False too (the weights alone, bit for "
        "bit), or drop load_module_only to resume everything")


def _tag_folder(load_dir: str, tag: Any) -> str | None:
    """The folder of the tag a load reads (``tag``, else the one ``latest`` names; None when
    there is no ``latest``: DeepSpeed loads nothing and says so), refused when it holds no
    model states file (DeepSpeed's own check is an empty AssertionError)."""
    latest = os.path.join(load_dir, "latest")
    said = f" (named by {latest})" if tag is None else ""
    if tag is None:
        if not os.path.isfile(latest):
            _warn_spelled_alike(load_dir)
            return None
        with open(latest, encoding="utf-8") as f:
            tag = f.read().strip()
        if not tag:
            raise CheckpointNotFoundError(
                f"{latest} is empty (a job killed while DeepSpeed wrote it); load a tag by name, "
                f"load_checkpoint({load_dir!r}, tag=...): the tags there are {_tags(load_dir)}")
    folder = os.path.join(load_dir, str(tag))
    if not _model_files(folder):
        raise CheckpointNotFoundError(
            f"DeepSpeed tag {str(tag)!r}{said}: {folder} holds no model states file "
            f"({'no such folder' if not os.path.isdir(folder) else 'none saved'}); the tags "
            f"in {load_dir} are {_tags(load_dir)}: pass one as load_checkpoint(load_dir, tag=...)")
    return folder


def _warn_spelled_alike(load_dir: str) -> None:
    """No ``latest`` in ``load_dir``: DeepSpeed starts from scratch, saying only that it found
    none; a directory beside it spelled alike that has one (a mistyped path; not another run
    of a numbered series, run2 beside run1 or run) is named, with the tag it would resume."""
    parent, name = os.path.split(os.path.normpath(os.path.abspath(load_dir)))
    try:
        siblings = [n for n in os.listdir(parent) if n != name and _digitless(n) != _digitless(name)
                    and os.path.isfile(os.path.join(parent, n, "latest"))]
    except OSError:
        return
    for sibling in spelled_alike(name, siblings):
        path = os.path.join(parent, sibling)
        with open(os.path.join(path, "latest"), encoding="utf-8") as f:
            tag = f.read().strip()
        warnings.warn(f"ckptio: {load_dir} holds no DeepSpeed 'latest', so load_checkpoint "
                      f"loads nothing and training starts from scratch; did you mean {path}? "
                      f"Its 'latest' names {tag!r}", UserWarning, stacklevel=4)


def _digitless(name: str) -> str:
    return re.sub(r"\d+", "", name)


def _model_files(folder: str) -> list[str]:
    names = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
    return [os.path.join(folder, n) for n in names if n.endswith("model_states.pt")]


def _tags(load_dir: str) -> str:
    """The tags in ``load_dir`` for a message: in step order (global_step9 before
    global_step10), the newest few of a long run, which may hold thousands."""
    names = os.listdir(load_dir) if os.path.isdir(load_dir) else []
    tags = sorted((n for n in names if _model_files(os.path.join(load_dir, n))),
                  key=lambda n: [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", n)])
    return str(tags) if len(tags) <= 6 else f"{tags[-6:]} (and {len(tags) - 6} earlier)"


def _whole_tag(engine: Any, folder: str) -> None:
    """``_check_one_save`` and ``_check_every_rank``, made by rank 0 alone and its refusal
    raised on every rank: they read the manifest of every file of the tag, which on every rank
    made each read all ranks' files. Where not every rank came to this load_checkpoint within
    Options.rank_timeout_s (a ZeRO 1/2 load on some ranks only), each rank here checks alone."""
    ours = getattr(engine, "checkpoint_engine", None)
    options = getattr(ours, "options", None) or Options.from_env()
    group = current_group()
    late = None if group is None else arrive(group, "deepspeed-tag-check",
                                             options.rank_timeout_s)
    together = group is not None and late is None
    if late:  # the files this rank shares with them: loaded alone, not waited for again
        missed = getattr(ours, "missed", None)
        if callable(missed):
            missed(late)
    ranks = job_ranks(options) if together else None
    error: IncompleteCheckpointError | None = None
    if ranks is None or ranks.rank == 0:
        try:
            _check_one_save(engine, folder)
            _check_every_rank(folder)
        except IncompleteCheckpointError as exc:
            error = exc
    if ranks is not None:
        said = ranks.broadcast((str(error) if error else "").encode() if ranks.rank == 0
                               else None)
        if error is None and said:
            error = IncompleteCheckpointError(said.decode(errors="replace"))
    if error is not None:
        raise error


def _check_one_save(engine: Any, folder: str) -> None:
    """A tag whose files two saves wrote (a save_checkpoint of the tag cut short, a file
    copied in from another tag) is refused on every rank alike, before DeepSpeed reads
    anything: a rank whose own files are of one save went on into ZeRO's collectives while
    the rank that read the other save's file failed, and ended on gloo's 'connection closed'
    (or waited for its timeout, the failed rank still alive)."""
    reader = getattr(getattr(engine, "checkpoint_engine", None), "manifest", None)
    found = saves(folder, reader if callable(reader) else None)
    if len(found) < 2:
        return
    (stands, files), others = found[0], found[1:]
    other = "; ".join(f"{_listed(paths)} from the one at {at}" for at, paths in others)
    raise IncompleteCheckpointError(
        f"DeepSpeed tag {os.path.basename(folder)!r} ({folder}) holds files of "
        f"{'two' if len(found) == 2 else len(found)} saves: "
        f"{_listed(files)} from the save at {stands}, and {other}, so they are not one "
        "training state and no rank loads it (every rank refuses it alike). Load another tag, "
        f"load_checkpoint(load_dir, tag=...) (the tags in {os.path.dirname(folder)} are "
        f"{_tags(os.path.dirname(folder))}), or put back that tag's own files in place of the "
        "other save's (a save_checkpoint of a tag cut short, or a file copied in from another "
        "tag, mixes them); give each save a tag of its own (DeepSpeed's default, "
        "global_step<N>)")


def _check_every_rank(folder: str) -> None:
    """A tag where a kind of ZeRO's per-rank files is missing for some rank (a save cut short
    before that rank wrote it, the tag loaded by name) is refused on every rank alike: the
    rank without its file failed while the others went on into ZeRO's collectives; so is a
    ckptio file of the tag never committed (its write cut short)."""
    names = sorted(os.listdir(folder))
    missing = missing_rank_file(folder, names)
    cut = [os.path.join(folder, n) for n in names if n.endswith(".pt")
           and os.path.isdir(os.path.join(folder, n)) and not is_committed(os.path.join(folder, n))]
    if missing is None and not cut:
        return
    load_dir = os.path.dirname(folder)
    what = (f"{missing[0]} is missing (rank(s) {missing[1]} wrote no such file" if missing
            else f"{cut[0]} was never committed (its write was cut short")
    raise IncompleteCheckpointError(
        f"DeepSpeed tag {os.path.basename(folder)!r} ({folder}) is not whole: {what}: a "
        "save_checkpoint cut short), so no rank loads it (every rank refuses it alike); load "
        f"another tag, load_checkpoint(load_dir, tag=...) (the tags in {load_dir} are "
        f"{_tags(load_dir)})")


def _listed(paths: list[str]) -> str:
    names = [os.path.basename(p) for p in paths]
    return f"{names[:6]}{f' and {len(names) - 6} more' if len(names) > 6 else ''}"


def _check_parameters(engine: Any, folder: str) -> None:
    """ZeRO's optimizer state is flat partitions of exactly the parameters saved: a model
    changed since (a layer added, removed or resized) is refused naming them."""
    ours = getattr(engine, "checkpoint_engine", None)
    checkpointer = getattr(ours, "checkpointer", None)
    saved_in = next((f for f in _model_files(folder) if is_committed(f)), None)
    if not isinstance(checkpointer, Checkpointer) or saved_in is None:
        return  # not ckptio's engine (use() was undone), or DeepSpeed's own files
    opened = getattr(ours, "manifest", None)  # read once in the load_checkpoint
    try:
        saved = checkpointer.load(saved_in, keys=["param_shapes"],
                                  allow_pickle=bool(getattr(ours, "allow_pickle", False)),
                                  process_group=rank_alone_group(),
                                  record=opened(saved_in) if callable(opened) else None
                                  )["param_shapes"]
    except (StateMismatchError, PickleRefusedError):
        return  # not saved under ZeRO, or no opt-in: DeepSpeed's load says what it says
    differ = _differences(_shapes(saved), _shapes(engine._get_zero_param_shapes()))
    if differ:
        raise StateMismatchError(
            f"load_checkpoint: this model's parameters differ from those saved in {saved_in}: "
            f"{'; '.join(differ[:8])}{' ...' if len(differ) > 8 else ''}. ZeRO's optimizer state "
            "holds flat partitions of exactly the saved parameters: build the model as it was "
            "saved (under ZeRO 1 and 2, a layer added or removed, the weights alone load with "
            "load_module_only=True, load_optimizer_states=False, load_lr_scheduler_states="
            "False, load_module_strict=False)")


def _check_model_parallel_size(engine: Any, folder: str) -> None:
    """ZeRO 1/2 keep a model file and optimizer files per model-parallel rank: on another
    model-parallel size DeepSpeed merges or splits the model files as Megatron's (an
    AssertionError naming a Megatron key for any other model) and finds no optimizer file of
    its own; refused naming both sizes and the ways on."""
    if engine.zero_optimization_partition_weights():
        return
    saved = len([f for f in _model_files(folder)
                 if re.fullmatch(r"mp_rank_\d+_model_states\.pt", os.path.basename(f))])
    now = int(getattr(engine, "mp_world_size", 1) or 1)
    if saved and saved != now:
        raise UnsupportedStateError(
            f"{folder} was saved at model-parallel size {saved} (a model file per model-parallel "
            f"rank, mp_rank_XX_model_states.pt) and this job's is {now}: DeepSpeed loads ZeRO's "
            f"optimizer state only at the model-parallel size that saved it; run with a "
            f"model-parallel unit of size {saved} (deepspeed.initialize(mpu=...)), load the "
            "weights alone (load_module_only=True, load_optimizer_states=False, "
            "load_lr_scheduler_states=False: DeepSpeed merges or splits Megatron models' "
            "files only), or convert it with DeepSpeed's ds_to_universal.py (on a "
            "ckptio.deepspeed_engine.to_torch_save copy) and load that as a universal checkpoint")


def _shapes(groups: Any) -> list[tuple[str, tuple[int, ...]]]:
    """DeepSpeed's param_shapes (a list of name -> shape per parameter group), in order."""
    groups = groups if isinstance(groups, (list, tuple)) else [groups]
    return [(str(k), tuple(int(d) for d in v)) for g in groups for k, v in dict(g).items()]


def _differences(saved: list[tuple[str, tuple[int, ...]]],
                 now: list[tuple[str, tuple[int, ...]]]) -> list[str]:
    was, new = dict(saved), dict(now)
    out = [f"{k}: shape {list(new[k])} in the model, {list(v)} saved" for k, v in saved
           if k in new and new[k] != v]
    out += [f"{k}: saved, not in the model" for k in was if k not in new]
    out += [f"{k}: in the model, not saved" for k in new if k not in was]
    if not out and [k for k, _ in saved] != [k for k, _ in now]:
        out.append("the same parameters in another order (another optimizer parameter grouping)")
    return out


def _check_zero3_layout(engine: Any, folder: str) -> None:
    """ZeRO-3 writes a model file per data-parallel rank (zero_pp_rank_N_mp_rank_XX_...), ZeRO
    0-2 one per model-parallel rank (mp_rank_XX_...): an engine of the other kind finds none of
    its own and DeepSpeed fails with an empty AssertionError (with any engine); refused naming
    the stages and the ways on."""
    names = [os.path.basename(f) for f in _model_files(folder)]
    saved3 = any(re.fullmatch(r"zero_pp_rank_\d+_mp_rank_\d+_model_states\.pt", n) for n in names)
    saved = any(re.fullmatch(r"mp_rank_\d+_model_states\.pt", n) for n in names)
    now3 = bool(engine.zero_optimization_partition_weights())
    if now3 == saved3 or (saved3 and saved):
        return
    was = "under ZeRO-3 (a model file per data-parallel rank)" if saved3 else (
        "under ZeRO stage 0, 1 or 2 (a whole model file, mp_rank_XX_model_states.pt)")
    weights = ("consolidate them with DeepSpeed's zero_to_fp32 on a "
               "ckptio.deepspeed_engine.to_torch_save copy" if saved3 else
               "ckptio.load(the model file, allow_pickle=True)['module']")
    raise UnsupportedStateError(
        f"{folder} was saved {was} and this engine runs ZeRO stage "
        f"{engine.zero_optimization_stage()}: DeepSpeed finds no model file of its own there "
        f"(its empty AssertionError); build the engine at the stage it was saved at "
        f"(\"zero_optimization\": {{\"stage\": ...}}), or, for the weights alone, {weights} "
        "and load them into the model before deepspeed.initialize")


def _check_zero3_ranks(engine: Any, folder: str, weights: bool) -> None:
    """ZeRO-3 keeps a model file per data-parallel rank: on another number of ranks DeepSpeed
    fails on some ranks with an empty AssertionError (no file of theirs), on the others with
    its own refusal; here every rank says the same. The weights alone (``weights``: no
    optimizer states, which DeepSpeed rebuilds from every rank's files with its zero_to_fp32)
    load on fewer ranks, as with DeepSpeed's own engine."""
    saved = len([f for f in _model_files(folder)
                 if os.path.basename(f).startswith("zero_pp_rank_")
                 and os.path.basename(f).endswith("_mp_rank_00_model_states.pt")])
    now = getattr(engine, "dp_world_size", saved)
    if not saved or now == saved or (weights and now < saved):
        return
    alone = ("" if now > saved else "; or load the weights alone on these ranks, "
             "load_checkpoint(load_dir, load_optimizer_states=False)")
    raise UnsupportedStateError(
        f"{folder} was saved by {saved} data-parallel ranks under ZeRO-3 (a model file "
        f"each) and this job has {now}: DeepSpeed loads ZeRO's partitioned state only on "
        f"the data-parallel size that saved it (its weights alone on at most that many); "
        f"run on {saved} ranks, or convert it with DeepSpeed's ds_to_universal.py (on a "
        f"ckptio.deepspeed_engine.to_torch_save copy) and load that as a universal "
        f"checkpoint{alone}")


def exporting(save_16bit_model: Any, engine: Any) -> Any:
    """``engine.save_16bit_model`` marking its save an export (``exporting``: the checkpoint
    engine takes no run lease of that folder: one file renamed into place, not a run)."""

    def export(*args: Any, **kwargs: Any) -> Any:
        ours = engine.checkpoint_engine
        ours.exporting = True  # its create() then takes no run lease of the export's folder
        try:
            return save_16bit_model(*args, **kwargs)
        finally:
            ours.exporting = False

    return export
