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
return; decoupled: once committed) and fails (on every rank, at the tag's commit), the run
lease of save_dir, and ``use`` which installs it on a DeepSpeed engine. Does not own: which
files and tags DeepSpeed writes, its ``latest`` file, the checks made before a load
(ckptio.deepspeed_guard), that a tag's files are of one save (ckptio.deepspeed_tags), which
ranks load a file together (ckptio.deepspeed_reads), nor the format (the Checkpointer).
DeepSpeed has no configuration key for a third-party engine.
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any


from ckptio.api import Checkpointer, SaveHandle
from ckptio.convert_writers import write_torch_save
from ckptio.deepspeed_guard import exporting, guarded_load, local_only
from ckptio.deepspeed_reads import arrived, kept, load_group, own_file, placed
from ckptio.deepspeed_tags import OVER, STANDS, OneSave, absent_file, to_torch_save
from ckptio.dir_leases import DirectoryLeases, taken_on_rank_0
from ckptio.distributed.dist import Group, current_group, over_torch, rank_alone_group
from ckptio.errors import (
    CkptError,
    RankFailedError,
    UnsupportedStateError,
    restated,
)
from ckptio.format.types import Manifest
from ckptio.options import Options
from ckptio.storage.local.local_root import is_committed
from ckptio.storage.select import scheme_of

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
    verify: check checksums on load (default Options.verify). take_over: save into a save_dir
    whose run lease another job holds (its processes linger after it ended), with a warning; by
    default a second job saving into one save_dir is refused at its first save_checkpoint,
    naming the first, before any rank writes (ckptio/dir_leases.py; rank 0 holds the lease).
    """

    def __init__(self, config_params: Any = None, *, options: Options | None = None,
                 decoupled: bool = False, allow_pickle: bool = False,
                 verify: bool | None = None, take_over: bool = False) -> None:
        super().__init__(config_params)
        self.name = ENGINE_NAME
        self.options = options if options is not None else Options.from_env()
        self.decoupled = decoupled
        self.allow_pickle = allow_pickle
        self.verify = verify
        self.checkpointer = Checkpointer(self.options)
        self._leases = DirectoryLeases("this DeepSpeed job", "pass ckptio.deepspeed_engine."
                                       "use(engine, take_over=True)", take_over)
        self.load_group: Callable[[str], Any] = lambda path: rank_alone_group()
        """The process group a load of a file within a ``load_checkpoint`` runs over (``use``
        sets it: ``_load_group``); this rank alone by default."""
        self.kept: Callable[[str], bool] = lambda path: True
        """Whether a file's first load within a ``load_checkpoint`` is kept for DeepSpeed's
        second load of it (``use`` sets it: deepspeed_reads.kept); kept by default."""
        self.training: Callable[[], str | None] = lambda: None
        """Where training stands (``use`` sets it from the DeepSpeed engine): stored with each
        file, so that a tag whose files come from two saves is refused at load."""
        self._info: CheckpointCommitInfo | None = None
        self._handles: list[SaveHandle] = []
        self._stands: str | None = None
        self._over = False  # the save's tag folder existed before it (a save over that tag)
        self._tags = OneSave()  # the tag folders loaded, each checked as one save
        self._ranks: Group | None = None  # every rank, through the job's store (first save)
        self._written = False  # a file of the tag in hand was saved (a decoupled tag to commit)
        self._failed: CkptError | None = None  # a file of the tag in hand failed (for commit)
        self.exporting = False  # in save_16bit_model (use() sets it): an export, not leased
        # within one load_checkpoint (loading()): each file's manifest, and a file loaded once
        # (until DeepSpeed loads it again); None outside
        self._opened: dict[str, Manifest | None] | None = None
        self._loaded: dict[str, Any] | None = None
        self._missing: set[int] | None = None  # the ranks found missing in it

    def create(self, info: CheckpointCommitInfo) -> None:
        """A tag starts: the previous tag's saves in flight are waited for first; then the
        run lease of save_dir, on every rank or on none."""
        self._settle()
        local_only(os.fspath(info.save_dir), "save_checkpoint")  # every rank: the same refusal
        group = current_group()
        if self._ranks is None and group is not None:
            self._ranks = over_torch(group, self.options)  # every rank beats from now on
        self._lease(info)
        self._info = info
        self._written, self._failed = False, None
        self._stands = self.training()
        folder = os.path.abspath(os.path.join(info.save_dir, str(info.tag)))
        self._over = os.path.isdir(folder)
        self._tags.forget(folder)  # what loads of it saw is no longer there

    def _lease(self, info: CheckpointCommitInfo) -> None:
        """Rank 0 takes (or checks) the run lease of ``info.save_dir``; every rank raises its
        refusal (CheckpointLockedError), before any rank writes a file of the tag."""
        if not self.exporting:  # one file renamed into place, no run: not leased
            taken_on_rank_0(self._leases, self._ranks, os.fspath(info.save_dir),
                            f"tag {info.tag!r}")

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        """DeepSpeed's rank 0 makes save_dir before ``create``: a URL is left to ``create``'s
        refusal on every rank (made here, it became a local folder named ``s3:``)."""
        if scheme_of(os.fspath(path)) is None:
            os.makedirs(path, exist_ok=exist_ok)

    def save(self, state_dict: Any, path: str) -> None:
        """Write ``state_dict`` as the ckptio checkpoint ``path`` (this rank alone); a file
        outside the tag's folder (``save_16bit_model``'s ``pytorch_model.bin``, an export for
        torch.load and from_pretrained) as the torch.save file DeepSpeed's own engine writes."""
        if not self._in_tag(path):
            self._settle()
            write_torch_save(state_dict, os.fspath(path))
            return
        if self._failed is not None:  # a file of this tag failed: the tag is not written on
            return
        try:
            self._write(state_dict, path)
        except CkptError as exc:  # sync: raised by commit, once every rank knows (below)
            self._failed = exc
            if self.decoupled:  # said at the call; its commit tells the other ranks
                raise

    def _write(self, state_dict: Any, path: str) -> None:
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
        out again, in a new top-level dict (kept only where DeepSpeed loads it again:
        ``kept``; another model-parallel rank's file, loaded for the check, is let go).
        Within a load_checkpoint, the ZeRO 1/2 model file that every data-parallel rank loads
        is loaded by them together (``_load_group``): each of its bytes read from storage by
        one of them and sent to the others; any other file, and any load outside a
        load_checkpoint, by this rank alone."""
        self._settle()
        where = os.path.abspath(os.fspath(path))
        if self._loaded is not None and where in self._loaded:
            loaded = self._loaded.pop(where)
        else:
            if (absent := absent_file(where)) is not None:
                raise absent
            record = self.manifest(where)
            group = (rank_alone_group() if self._loaded is None else
                     arrived(self.load_group(where), where, self.options.rank_timeout_s,
                             self._missing))
            read = functools.partial(self.checkpointer.load, path, verify=self.verify,
                                     allow_pickle=self.allow_pickle, process_group=group,
                                     record=record)
            loaded = (own_file(read, where, self.allow_pickle)  # DeepSpeed's own engine's file
                      if record is None and os.path.isfile(where) else read())
            self._tags.check(where, record)
            if self._loaded is not None and self.kept(where):
                self._loaded[where] = dict(loaded) if isinstance(loaded, dict) else loaded
        return placed(loaded, map_location)

    def load_alone(self, path: str) -> Any:
        """The state saved at ``path`` (CPU tensors), read by this rank alone and not kept:
        DeepSpeed's zero_to_fp32 reads every rank's files once each, within a ZeRO-3
        load_checkpoint without optimizer states (deepspeed_reads.zero_to_fp32_reading)."""
        return self.checkpointer.load(path, verify=self.verify, allow_pickle=self.allow_pickle,
                                      process_group=rank_alone_group(),
                                      record=self.manifest(path))

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
        self._opened, self._loaded, self._missing = {}, {}, set()
        try:
            yield
        finally:
            self._opened, self._loaded, self._missing = None, None, None

    def missed(self, ranks: Iterable[int]) -> None:
        """Ranks (global) found not to have come to this load_checkpoint (deepspeed_guard's
        arrival check): a file they would load together with this rank is loaded by this rank
        alone, without waiting for them again."""
        if self._missing is not None:
            self._missing.update(int(r) for r in ranks)

    def commit(self, info: CheckpointCommitInfo) -> bool:
        """The tag's files of this rank are durable and committed when this returns (True);
        a failed write (a sync save's, or a background one) is raised here on this rank, and
        every other rank raises a RankFailedError naming it (then DeepSpeed writes no
        ``latest``). A decoupled save's error raised at its call is told, not raised again."""
        if info is None:
            return False
        error: BaseException | None = self._failed
        self._failed = None
        said = error is not None and self.decoupled
        try:
            self._settle()
        except Exception as exc:  # noqa: BLE001 - told to the other ranks, then raised
            error, said = (exc, False) if error is None else (error, said)
        self._all_committed(info, error)
        if error is None:
            self._info = None
            return True
        if said:
            return False
        raise error

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
            self._leases.release()
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


def _training(engine: Any) -> Callable[[], str | None]:
    ref = weakref.ref(engine)

    def stands() -> str | None:
        alive = ref()
        if alive is None:
            return None
        return (f"global_steps={getattr(alive, 'global_steps', '?')} "
                f"global_samples={getattr(alive, 'global_samples', '?')}")

    return stands


_GUARDED: weakref.WeakSet[Any] = weakref.WeakSet()  # engines whose load_checkpoint use() wrapped


def use(engine: Any, *, options: Options | None = None, decoupled: bool = False,
        allow_pickle: bool = False, verify: bool | None = None,
        take_over: bool = False) -> CkptioCheckpointEngine:
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
                                  decoupled=decoupled, allow_pickle=allow_pickle, verify=verify,
                                  take_over=take_over)
    ours.training = _training(engine)
    ours.load_group = load_group(engine)
    ours.kept = kept(engine)
    engine.checkpoint_engine = ours
    if engine not in _GUARDED:
        engine.load_checkpoint = guarded_load(engine.load_checkpoint, engine)
        engine.save_16bit_model = exporting(engine.save_16bit_model, engine)
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
