"""How ckptio's DeepSpeed engine (ckptio.deepspeed_engine) reads a file within one
``load_checkpoint``: which ranks load it together (``load_group``: a ZeRO 0-2 model file is
read once for all the ranks that share it, a fresh load over their group), whether they all
came (``arrived``: DeepSpeed may call load_checkpoint on some ranks only), whether its values
are kept for a second load of it (``kept``), where its tensors go (``placed``: DeepSpeed's
``map_location``), how a torch.save file DeepSpeed's own engine wrote is read where ckptio's
reader cannot lay it out (``own_file``), and how DeepSpeed's zero_to_fp32 reads ckptio's files
(``zero_to_fp32_reading``: ZeRO-3's weights without optimizer states).

Call order: ``use`` sets the engine's ``load_group`` from ``load_group(engine)``; each load
takes ``arrived(load_group(path), path, timeout, missing)`` as its process group, then ``placed``.

Owns: those decisions. Does not own: the engine, the load (the Checkpointer), DeepSpeed's
order of loads (read from DeepSpeed 0.19.8's SDLoader, below).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import pickle
import re
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ckptio.devices import moved
from ckptio.distributed.arrival import arrive
from ckptio.distributed.dist import current_group, rank_alone_group
from ckptio.errors import CkptError, PickleRefusedError
from ckptio.storage.local.local_root import is_committed

__all__ = ["arrived", "kept", "load_group", "own_file", "placed", "zero_to_fp32_reading"]


def arrived(group: Any, path: str, timeout_s: float, missing: set[int] | None = None) -> Any:
    """``group`` once all its ranks have come to this load of ``path`` (within ``timeout_s``:
    DeepSpeed's load_checkpoint may be called on some ranks only, a ZeRO 1/2 one has no
    collective of its own), else this rank alone, warned of, naming the missing ranks by their
    global rank. ``missing``: the global ranks found missing earlier in this load_checkpoint
    (added to here): a group holding one of them is not waited for again, this rank loads alone
    (DeepSpeed loads two model files on a model-parallel rank, each waited for otherwise)."""
    if group is None or group is rank_alone_group():
        return group
    members = [int(r) for r in torch.distributed.get_process_group_ranks(group)]
    gone = sorted(set(members) & missing) if missing is not None else []
    if not gone:
        late = arrive(group, "deepspeed-load", timeout_s)
        if late is None:
            return group
        gone = [members[r] for r in late]
        if missing is not None:
            missing.update(gone)
    warnings.warn(f"ckptio: {path} is loaded by this rank alone: rank(s) {gone} of the ranks "
                  f"that load it ({members}) did not come to this load_checkpoint within "
                  "Options.rank_timeout_s (load_checkpoint called on some ranks only? Call it "
                  "on every rank)", UserWarning, stacklevel=4)
    return rank_alone_group()


_MODEL_FILE = re.compile(r"mp_rank_\d+_model_states\.pt")  # ZeRO 0-2's; ZeRO-3's are per rank


def load_group(engine: Any) -> Callable[[str], Any]:
    """The process group a load of a DeepSpeed file runs over, for ``engine``. The model file of
    ZeRO 0-2 (``mp_rank_XX_model_states.pt``): the world without model parallelism, else the
    engine's data-parallel group (the ranks of one model-parallel rank). DeepSpeed 0.19.8's
    _load_checkpoint loads the model files on every rank, in an order set by the model-parallel
    rank alone (its SDLoader loads the first file to check the list, then the file of that rank,
    or those it merges or splits), so the ranks of one data-parallel group, which share it, load
    the same files in the same order. Any other file (ZeRO-3's per-rank model files, optimizer
    files, expert files), a pipeline engine's (its layer files), a universal checkpoint's: this
    rank alone."""
    ref = weakref.ref(engine)

    def group(path: str) -> Any:
        alive = ref()
        if (alive is None or not _MODEL_FILE.fullmatch(os.path.basename(path))
                or alive.zero_optimization_partition_weights()
                or getattr(alive, "pipeline_parallelism", True)
                or alive.load_universal_checkpoint()):
            return rank_alone_group()
        if getattr(alive, "mp_world_size", 1) == 1:  # every rank loads the same files
            return current_group()
        return alive.data_parallel_group  # the ranks of this model-parallel rank

    return group


_MP_RANK = re.compile(r"mp_rank_(\d+)_model_states\.pt")


def kept(engine: Any) -> Callable[[str], bool]:
    """Whether a file's first load within a ``load_checkpoint`` of ``engine`` is kept for a
    second load of it, for ``engine``. DeepSpeed 0.19.8's SDLoader loads the tag's first model
    file to check the list, then the file of this model-parallel rank: the same file on
    model-parallel rank 0 (kept: not read twice), another on the others, where the first is
    not loaded again and keeping it held a whole model shard through the rest of the load.
    A model file of another model-parallel rank: not kept; any other file, and any file of a
    universal checkpoint (whose ranks map onto the files otherwise): kept."""
    ref = weakref.ref(engine)

    def keep(path: str) -> bool:
        alive = ref()
        found = _MP_RANK.search(os.path.basename(path))
        if alive is None or found is None or alive.load_universal_checkpoint():
            return True
        return int(found.group(1)) == int(getattr(alive, "checkpoint_mp_rank", 0))

    return keep


def own_file(load: Callable[[], Any], path: str, allow_pickle: bool) -> Any:
    """A torch.save file DeepSpeed's own engine wrote (a job that switched engines between
    tags), read by ckptio (``load``); where ckptio's reader refuses its layout (ZeRO 1/2's
    model file: every parameter a view of one flat buffer, which DeepSpeed's own engine does
    not clone), read with torch.load as that engine reads it (``weights_only`` unless
    ``allow_pickle``). A damaged, cut or missing file is raised as ckptio found it."""
    try:
        return load()
    except CkptError as exc:
        if type(exc) is not CkptError:  # damaged, cut, missing, refused, unreadable: as found
            raise
        refused = exc  # a layout ckptio does not read (views of one storage): torch.load's
    try:
        return torch.load(path, map_location="cpu", weights_only=not allow_pickle)
    except pickle.UnpicklingError as exc:
        raise PickleRefusedError(
            f"{path}: this torch.save file, written by DeepSpeed's own engine, holds Python "
            "objects (ZeRO's loss scaler, ...) that load only unpickled: pass "
            "ckptio.deepspeed_engine.use(engine, allow_pickle=True) for files you trust") from exc
    except (RuntimeError, OSError, EOFError, ValueError) as exc:  # torch.load's own failures
        raise refused from exc


def placed(loaded: Any, map_location: Any) -> Any:
    """``loaded`` with its tensors moved to the device ``map_location`` names (kept on the CPU
    for the CPU and for anything else)."""
    device = _device(map_location)
    return loaded if device is None else moved(loaded, device)


def _device(map_location: Any) -> torch.device | None:
    """The device ``map_location`` names; None (CPU tensors) for the CPU and for anything else
    (None; DeepSpeed's ``lambda storage, loc: storage``, which keeps tensors on the CPU)."""
    if not isinstance(map_location, (str, int, torch.device)):
        return None
    device = torch.device(map_location)
    return None if device.type == "cpu" else device


class _TorchReadingCkptio:
    """torch, as DeepSpeed's zero_to_fp32 module sees it: ``load`` of a committed ckptio
    checkpoint goes to ``read``; every other name, and any other file, is torch's own."""

    def __init__(self, real: Any, read: Callable[[str], Any]) -> None:
        self._real = real
        self._read = read

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def load(self, f: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(f, (str, os.PathLike)) and is_committed(os.fspath(f)):
            return self._read(os.fspath(f))
        return self._real.load(f, *args, **kwargs)


@contextlib.contextmanager
def zero_to_fp32_reading(read: Callable[[str], Any], tag: str) -> Iterator[None]:
    """While it lasts, DeepSpeed's zero_to_fp32 reads a ckptio checkpoint through ``read``
    (path -> its state, CPU tensors), and the weights of ``tag``. DeepSpeed 0.19.8's ZeRO-3
    load_checkpoint without optimizer states rebuilds the weights with zero_to_fp32's
    ``get_fp32_state_dict_from_zero_checkpoint``, which calls ``torch.load`` on every rank's
    model and optimizer file itself, past the checkpoint engine; and DeepSpeed calls it without
    the tag asked for, so it read the tag ``latest`` names (another save's weights, silently,
    under any engine). For the call, that module's ``torch`` and the engine module's name of
    the function are replaced (any other file still goes to torch.load), then put back."""
    module = vars(importlib.import_module("deepspeed.utils.zero_to_fp32"))
    engine = vars(importlib.import_module("deepspeed.runtime.engine"))
    real, fp32 = module["torch"], engine["get_fp32_state_dict_from_zero_checkpoint"]

    def of_the_tag(checkpoint_dir: str, *args: Any, **kwargs: Any) -> Any:
        if not args and kwargs.get("tag") is None:
            kwargs["tag"] = tag
        return fp32(checkpoint_dir, *args, **kwargs)

    module["torch"] = _TorchReadingCkptio(real, read)
    engine["get_fp32_state_dict_from_zero_checkpoint"] = of_the_tag
    try:
        yield
    finally:
        module["torch"], engine["get_fp32_state_dict_from_zero_checkpoint"] = real, fp32
