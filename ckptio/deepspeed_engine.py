"""DeepSpeed's checkpoints through ckptio: a DeepSpeed ``CheckpointEngine`` backed by ckptio.

    engine, *_ = deepspeed.initialize(model=model, config=config, ...)
    ckptio.deepspeed_engine.use(engine, allow_pickle=True)  # or also decoupled=True
    engine.save_checkpoint("ckpts")                      # files under ckpts/<tag>/ are ckptio's
    engine.load_checkpoint("ckpts")                      # the tag DeepSpeed's 'latest' names

Call order (DeepSpeed 0.19's): ``save_checkpoint`` calls ``create(info)``, ``save(state, path)``
once per file this rank writes, then ``commit(info)`` and writes ``latest`` itself; a decoupled
engine is committed at the next ``step()`` instead (before the optimizer changes anything) or by
``commit_now``; ``destroy()`` waits for its files but writes no ``latest`` (warned of).
``load_checkpoint`` calls ``load(path)`` per file: ZeRO 1/2's model file, which every
data-parallel rank loads, by those ranks together (each byte read by one of them), any other
file by this rank alone. docs/guides/deepspeed.md.

Owns: the engine (each DeepSpeed file becomes a ckptio checkpoint, a directory at the file's
path, written by this rank alone; tensors are never pickled), when a save is durable (sync: on
return; decoupled: once committed), that a tag's files loaded are of one save (each file
records the step it was saved at), and ``use`` which installs it on a DeepSpeed engine.
Does not own: which files and tags DeepSpeed writes, its ``latest`` file, the checks made
before a load (ckptio.deepspeed_guard), nor the format (the Checkpointer). DeepSpeed has no
configuration key for a third-party engine.
"""

from __future__ import annotations

import contextlib
import os
import re
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ckptio.api import Checkpointer, SaveHandle
from ckptio.convert_writers import write_torch_save
from ckptio.deepspeed_guard import guarded_load
from ckptio.deepspeed_tags import OVER, STANDS, other_save, recorded, to_torch_save
from ckptio.distributed.arrival import arrive
from ckptio.distributed.dist import Group, current_group, over_torch, rank_alone_group
from ckptio.errors import (
    CkptError,
    IncompleteCheckpointError,
    RankFailedError,
    UnsupportedStateError,
    restated,
)
from ckptio.format.types import Manifest
from ckptio.options import Options
from ckptio.storage.local.local_root import is_committed

try:
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import (
        CheckpointCommitInfo,
        CheckpointEngine,
    )
except ImportError as exc:  # pragma: no cover - the message is what a user without it sees
    raise ImportError("ckptio.deepspeed_engine needs DeepSpeed: pip install --no-deps "
                      "deepspeed==0.19.8 plus its needs (the deepspeed extra: pip install -e "
                      "'.[deepspeed]' in a checkout)") from exc

__all__ = ["CkptioCheckpointEngine", "commit_now", "to_torch_save", "use"]

ENGINE_NAME = "CkptioCheckpointEngine"


class CkptioCheckpointEngine(CheckpointEngine):
    """A DeepSpeed CheckpointEngine writing each file as a ckptio checkpoint (a directory).

    decoupled=False: ``save`` returns once the file is durable and committed (as DeepSpeed's
    torch engine, whose ``latest`` is written right after). decoupled=True: ``save`` returns
    once the tensors are copied into ckptio's staging pool; DeepSpeed commits the tag (waits
    for every file of this rank, then writes ``latest``) at the next ``step()`` (or
    ``commit_now``; ``destroy()`` writes no ``latest``, and cleanup warns of that tag);
    a second file of the same tag waits for the first one's write.
    options: ckptio.Options (default: the defaults and CKPTIO_* environment). allow_pickle
    (the caller's opt-in, off by default): values that are neither tensors nor plain Python
    values (ZeRO's loss scaler and param_slice_mappings) are stored pickled and unpickled on
    load, the trust DeepSpeed's own torch.load (weights_only=False) asks for; tensors are never
    pickled. Without it such a value is refused at save, naming the key and this switch.
    verify: check checksums on load (default Options.verify).
    """

    def __init__(self, config_params: Any = None, *, options: Options | None = None,
                 decoupled: bool = False, allow_pickle: bool = False,
                 verify: bool | None = None) -> None:
        super().__init__(config_params)
        self.name = ENGINE_NAME
        self.options = options if options is not None else Options.from_env()
        self.decoupled = decoupled
        self.allow_pickle = allow_pickle
        self.verify = verify
        self.checkpointer = Checkpointer(self.options)
        self.load_group: Callable[[str], Any] = lambda path: rank_alone_group()
        """The process group a load of a file within a ``load_checkpoint`` runs over (``use``
        sets it: ``_load_group``); this rank alone by default."""
        self.training: Callable[[], str | None] = lambda: None
        """Where training stands (``use`` sets it from the DeepSpeed engine): stored with each
        file, so that a tag whose files come from two saves is refused at load."""
        self._info: CheckpointCommitInfo | None = None
        self._handles: list[SaveHandle] = []
        self._stands: str | None = None
        self._over = False  # the save's tag folder existed before it (a save over that tag)
        self._seen: dict[str, tuple[str, str]] = {}  # tag folder -> (a file loaded, its stand)
        self._scanned: set[str] = set()  # tag folders whose files were all compared
        self._ranks: Group | None = None  # every rank, through the job's store (first save)
        self._written = False  # a file of the tag in hand was saved (a decoupled tag to commit)
        # within one load_checkpoint (loading()): each file's manifest, and a file loaded once
        # (until DeepSpeed loads it again); None outside
        self._opened: dict[str, Manifest | None] | None = None
        self._loaded: dict[str, Any] | None = None

    def create(self, info: CheckpointCommitInfo) -> None:
        """A tag starts: the previous tag's saves in flight are waited for first."""
        self._settle()
        self._info = info
        self._written = False
        self._stands = self.training()
        folder = os.path.abspath(os.path.join(info.save_dir, str(info.tag)))
        self._over = os.path.isdir(folder)
        self._seen.pop(folder, None)  # what loads of it saw is no longer there
        self._scanned.discard(folder)
        group = current_group()
        if self._ranks is None and info.save_latest and group is not None:
            self._ranks = over_torch(group, self.options)  # every rank beats from now on

    def save(self, state_dict: Any, path: str) -> None:
        """Write ``state_dict`` as the ckptio checkpoint ``path`` (this rank alone); a file
        outside the tag's folder (``save_16bit_model``'s ``pytorch_model.bin``, an export for
        torch.load and from_pretrained) as the torch.save file DeepSpeed's own engine writes."""
        if not self._in_tag(path):
            self._settle()
            write_torch_save(state_dict, os.fspath(path))
            return
        meta = None if self._stands is None else {STANDS: self._stands, OVER: self._over}
        try:
            if self.decoupled:
                self._handles.append(self.checkpointer.async_save(
                    state_dict, path, allow_pickle=self.allow_pickle,
                    process_group=rank_alone_group(), metadata=meta))
                self._written = True
            else:
                self.checkpointer.save(state_dict, path, allow_pickle=self.allow_pickle,
                                       process_group=rank_alone_group(), metadata=meta)
        except UnsupportedStateError as exc:
            raise UnsupportedStateError(
                f"{exc} (through DeepSpeed: ckptio.deepspeed_engine.use(engine, "
                "allow_pickle=True) stores ZeRO's loss scaler and param_slice_mappings pickled; "
                "loading them then unpickles, so only for checkpoints you trust)") from exc

    def _in_tag(self, path: str) -> bool:
        info = self._info
        if info is None:
            return True
        folder = os.path.abspath(os.path.join(info.save_dir, str(info.tag)))
        return os.path.abspath(os.fspath(path)).startswith(folder + os.sep)

    def load(self, path: str, map_location: Any = None) -> Any:
        """The state saved at ``path``: CPU tensors (moved to ``map_location`` when that names
        a device) and Python values. A file DeepSpeed's torch engine wrote (its default zip
        format) loads too, so a job can switch engines between two tags. Its manifest is read
        once; within one load_checkpoint a file loaded again (DeepSpeed loads the model file
        to check it, then to load it) is not read again: its first load's values are handed
        out again, in a new top-level dict. Within a load_checkpoint, the ZeRO 1/2 model file
        that every data-parallel rank loads is loaded by them together (``_load_group``): each
        of its bytes read from storage by one of them and sent to the others; any other file,
        and any load outside a load_checkpoint, by this rank alone."""
        self._settle()
        where = os.path.abspath(os.fspath(path))
        if self._loaded is not None and where in self._loaded:
            loaded = self._loaded.pop(where)
        else:
            record = self.manifest(where)
            group = rank_alone_group() if self._loaded is None else self._shared(where)
            loaded = self.checkpointer.load(path, verify=self.verify,
                                            allow_pickle=self.allow_pickle,
                                            process_group=group, record=record)
            self._check_one_save(where, record)
            if self._loaded is not None:
                self._loaded[where] = dict(loaded) if isinstance(loaded, dict) else loaded
        device = _device(map_location)
        return loaded if device is None else _to_device(loaded, device)

    def _shared(self, path: str) -> Any:
        """``load_group(path)`` once all its ranks have come to this load (within
        Options.rank_timeout_s: DeepSpeed's load_checkpoint may be called on some ranks only,
        a ZeRO 1/2 one has no collective of its own), else this rank alone, warned of."""
        group = self.load_group(path)
        if group is None or group is rank_alone_group():
            return group
        missing = arrive(group, "deepspeed-load", self.options.rank_timeout_s)
        if missing is None:
            return group
        warnings.warn(f"ckptio: {path} is loaded by this rank alone: rank(s) {list(missing)} of "
                      "the ranks that load it did not load it within Options.rank_timeout_s "
                      "(load_checkpoint called on some ranks only?)", UserWarning, stacklevel=4)
        return rank_alone_group()

    def manifest(self, path: str) -> Manifest | None:
        """The ckptio manifest of DeepSpeed file ``path`` (None: a torch.save file, as
        DeepSpeed's own engine writes), read once per load_checkpoint."""
        where = os.path.abspath(os.fspath(path))
        if self._opened is not None and where in self._opened:
            return self._opened[where]
        record = self.checkpointer.manifest(where) if is_committed(where) else None
        if self._opened is not None:
            self._opened[where] = record
        return record

    @contextlib.contextmanager
    def loading(self) -> Iterator[None]:
        """One ``load_checkpoint`` (deepspeed_guard opens it): what ``manifest`` and ``load``
        keep for it is let go when it ends (a later load reads a newer save afresh)."""
        self._opened, self._loaded = {}, {}
        try:
            yield
        finally:
            self._opened, self._loaded = None, None

    def commit(self, info: CheckpointCommitInfo) -> bool:
        """The tag's files of this rank are durable and committed when this returns (True);
        a failed background write is raised here (then DeepSpeed writes no ``latest``)."""
        if info is None:
            return False
        try:
            self._settle()
        except Exception as exc:  # noqa: BLE001 - told to the other ranks, then raised
            self._all_committed(info, exc)
            raise
        self._all_committed(info, None)
        self._info = None
        return True

    def is_decoupled(self) -> bool:
        return self.decoupled

    def get_commit_info(self) -> CheckpointCommitInfo | None:
        """The tag a decoupled save left to commit (DeepSpeed asks at each step)."""
        return self._info if self.decoupled else None

    def preserves_storage_sharing(self) -> bool:
        """False: ckptio stores a view's own bytes, so DeepSpeed need not clone the tensors
        first (as it does for torch.save, which would write a view's whole storage)."""
        return False

    def cleanup(self) -> None:
        """Wait for the saves in flight and free the staging pool (DeepSpeed's destroy()); a
        failed background write is raised after the pool and threads are freed. A decoupled tag
        left uncommitted (a save after the last step, no ``commit_now``) is warned of: DeepSpeed
        writes no ``latest`` here, so a resume would load the tag before it."""
        try:
            self._settle()
        finally:
            self.checkpointer.close()
        info, self._info = self._info, None
        if self.decoupled and info is not None and info.save_latest and self._written:
            warnings.warn(
                f"ckptio: DeepSpeed tag {info.tag!r} in {info.save_dir} is written but was not "
                "committed, so 'latest' does not name it and load_checkpoint resumes from the "
                "tag before; load it with load_checkpoint(load_dir, tag=...), and call "
                "ckptio.deepspeed_engine.commit_now(engine) before engine.destroy() after a "
                "decoupled save at the last step", UserWarning, stacklevel=2)

    def _all_committed(self, info: CheckpointCommitInfo, error: BaseException | None) -> None:
        """Before DeepSpeed's rank 0 writes ``latest``: every rank's files of the tag are
        committed, else a RankFailedError on every rank naming the ranks (one killed while it
        wrote is found dead by its stopped heartbeat), and ``latest`` keeps the tag before."""
        if self._ranks is None or not info.save_latest:
            return
        try:
            said = self._ranks.all_gather(b"" if error is None else
                                          f"{type(error).__name__}: {error}".encode()[:2000])
        except RankFailedError as exc:  # a rank died: say which tag 'latest' does not name
            raise restated(exc, f"DeepSpeed tag {info.tag!r} in {info.save_dir} is not whole, "
                                "and 'latest' still names the tag before, which a resume "
                                "loads: ") from exc
        failed = [(rank, text.decode(errors="replace")) for rank, text in enumerate(said) if text]
        if failed and error is None:
            raise RankFailedError(
                f"DeepSpeed tag {info.tag!r} in {info.save_dir}: rank(s) {[r for r, _ in failed]} "
                f"did not commit their files (rank {failed[0][0]}: {failed[0][1]}); 'latest' "
                "still names the tag before, which a resume loads", tuple(r for r, _ in failed))

    def _settle(self) -> None:
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.wait()

    def _check_one_save(self, path: str, record: Manifest | None) -> None:
        """Refuse a tag whose files two saves wrote: a save_checkpoint of an existing tag cut
        short replaces some of its files and leaves the others as the earlier save wrote them,
        and DeepSpeed's ``latest`` names that tag all along. The files this rank reads are
        compared; a file of a save over an existing tag has every file of the tag compared
        (once per folder), as a rank may read only files of one of the two saves."""
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


def _training(engine: Any) -> Callable[[], str | None]:
    ref = weakref.ref(engine)

    def stands() -> str | None:
        alive = ref()
        if alive is None:
            return None
        return (f"global_steps={getattr(alive, 'global_steps', '?')} "
                f"global_samples={getattr(alive, 'global_samples', '?')}")

    return stands


_MODEL_FILE = re.compile(r"mp_rank_\d+_model_states\.pt")  # ZeRO 0-2's; ZeRO-3's are per rank


def _load_group(engine: Any) -> Callable[[str], Any]:
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


_GUARDED: weakref.WeakSet[Any] = weakref.WeakSet()  # engines whose load_checkpoint use() wrapped


def use(engine: Any, *, options: Options | None = None, decoupled: bool = False,
        allow_pickle: bool = False, verify: bool | None = None) -> CkptioCheckpointEngine:
    """Make DeepSpeed ``engine`` (what deepspeed.initialize returned) save and load through
    ckptio from now on; returns the CkptioCheckpointEngine. Call it on every rank, before the
    first save_checkpoint or load_checkpoint. Arguments as CkptioCheckpointEngine's."""
    previous = getattr(engine, "checkpoint_engine", None)
    if previous is None or not hasattr(engine, "save_checkpoint"):
        raise CkptError(f"ckptio.deepspeed_engine.use() takes the engine deepspeed.initialize "
                        f"returned, not a {type(engine).__name__}")
    if previous.is_decoupled():  # a decoupled engine (DeepSpeed's, ours): its pending tag first
        engine._commit_decoupled_checkpoint()
    if previous.is_decoupled() or isinstance(previous, CkptioCheckpointEngine):
        previous.cleanup()  # ours: its staging pool and I/O threads, not left to the process
    ours = CkptioCheckpointEngine(getattr(engine, "_config", None), options=options,
                                  decoupled=decoupled, allow_pickle=allow_pickle, verify=verify)
    ours.training = _training(engine)
    ours.load_group = _load_group(engine)
    engine.checkpoint_engine = ours
    if engine not in _GUARDED:
        engine.load_checkpoint = guarded_load(engine.load_checkpoint, engine)
        _GUARDED.add(engine)
    return ours


def commit_now(engine: Any) -> None:
    """Commit a decoupled save now (every rank calls it): DeepSpeed commits one at the next
    step(), and its destroy() waits for the files but writes no ``latest``, so a save after
    the last step needs this to be the one a resume loads."""
    ours = getattr(engine, "checkpoint_engine", None)
    if not isinstance(ours, CkptioCheckpointEngine):
        raise CkptError("ckptio.deepspeed_engine.commit_now(): the engine does not save through "
                        "ckptio; call ckptio.deepspeed_engine.use(engine) first")
    if ours.is_decoupled():
        engine._commit_decoupled_checkpoint()


def _device(map_location: Any) -> torch.device | None:
    """The device ``map_location`` names; None (CPU tensors) for the CPU and for anything else
    (None; DeepSpeed's ``lambda storage, loc: storage``, which keeps tensors on the CPU)."""
    if not isinstance(map_location, (str, int, torch.device)):
        return None
    device = torch.device(map_location)
    return None if device.type == "cpu" else device


def _to_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return type(value)((k, _to_device(v, device)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return type(value)(_to_device(v, device) for v in value)
    return value
