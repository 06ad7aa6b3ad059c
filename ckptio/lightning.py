"""Lightning's checkpoints through ckptio: ``Trainer(plugins=[ckptio.lightning.CheckpointIO()])``.

    trainer = lightning.Trainer(plugins=[ckptio.lightning.CheckpointIO()],
                                callbacks=[ModelCheckpoint(monitor="val_loss", save_top_k=2,
                                                           save_last=True)])
    trainer.fit(model, ckpt_path="last")       # resumes from ckpts/last.ckpt (a ckptio checkpoint)

Call order (Lightning's): ``save_checkpoint`` / ``load_checkpoint`` / ``remove_checkpoint`` as
ModelCheckpoint and the Trainer decide, ``teardown`` at the end of fit/validate/test. How file
paths map onto checkpoint directories, which values are stored without pickle, loading and
ranks: docs/BEHAVIOUR.md, "ckptio.lightning".

Owns: the two Lightning CheckpointIO plugins (``CheckpointIO``: the save returns once the
checkpoint is durable and committed; ``AsyncCheckpointIO``: the save returns once the tensors
are copied into ckptio's staging pool, the write and commit run in the background), and how
Lightning's file-oriented checkpoint paths map onto ckptio checkpoints, which are directories.
Does not own: the checkpoint format, the save and load (ckptio's Checkpointer), nor which
checkpoints to keep (Lightning's ModelCheckpoint).
Works with ``import lightning`` and with the standalone ``pytorch_lightning`` package (the
classes subclass one package's CheckpointIO and are registered with the other's). The random
generators, which Lightning's checkpoint lacks: ``RNGStateCallback`` (ckptio/lightning_rng.py).
"""

from __future__ import annotations

import abc
import contextlib
import importlib
import importlib.util
import os
import threading
from collections.abc import Iterator
from typing import Any, cast

import torch

from ckptio import (
    Checkpointer,
    CkptError,
    IncompleteCheckpointError,
    Options,
    RankFailedError,
    SaveHandle,
    SaveResult,
    StorageIOError,
    UnsupportedStateError,
)
from ckptio.devices import moved
from ckptio.dir_leases import DirectoryLeases
from ckptio.distributed.arrival import arrive
from ckptio.distributed.dist import current_group, rank_alone_group
from ckptio.lightning_paths import (
    check_path,
    committed_instead_of_last,
    refuse_in_fsspec,
    remove_directory,
    remove_remote,
)
from ckptio.lightning_rng import RNGStateCallback
from ckptio.storage.select import checkpoint_path, compared, scheme_of

__all__ = ["AsyncCheckpointIO", "CheckpointIO", "RNGStateCallback", "load_from_checkpoint"]

_BASES = ("lightning.fabric.plugins.io.checkpoint_io", "lightning_fabric.plugins.io.checkpoint_io")


def _lightning_bases() -> list[type]:
    """Lightning's CheckpointIO ABC from each installed package (``lightning``, then the
    standalone ``lightning_fabric`` that ``pytorch_lightning`` uses)."""
    found = []
    for name in _BASES:
        if importlib.util.find_spec(name.split(".")[0]) is not None:
            found.append(importlib.import_module(name).CheckpointIO)
    if not found:
        raise ImportError("ckptio.lightning needs Lightning: pip install lightning (or "
                          "pytorch_lightning; the lightning extra: pip install -e '.[lightning]' "
                          "in a checkout)")
    return found


_BASE, *_OTHERS = _lightning_bases()
refuse_in_fsspec()  # a dirpath of ckptio's own schemes: a CkptError saying what to pass


class CheckpointIO(_BASE):  # type: ignore[misc,valid-type]
    """A Lightning CheckpointIO that saves through ckptio (docs/BEHAVIOUR.md, "ckptio.lightning").

    options: ckptio.Options of the saves and loads (staging pool, I/O; default: the defaults
        and CKPTIO_* environment). allow_pickle: store (and load back) values that are neither
        tensors nor plain Python values, pickled; only for checkpoints you trust. verify: check
        checksums on load (default Options.verify, on). take_over: save into a directory whose
        run lease another job holds (its processes linger after it ended), with a warning; by
        default a second job saving into one directory is refused at its first save, naming
        the first (ckptio/lightning_paths.py). shared_loads (default True): with
        torch.distributed initialised on more than one rank, ``load_checkpoint`` is a
        collective of every rank (Lightning's resume, validate/test with ckpt_path and
        Fabric.load call it on each): each byte read from storage by one rank, sent to the
        others. A program that calls it on some ranks only (its own call on rank 0) passes
        shared_loads=False, each rank then loading alone; such a call with it on ends in a
        RankFailedError saying so within Options.rank_timeout_s.
    ``checkpointer``: the ckptio.Checkpointer behind it (its staging pool is freed at teardown).
    """

    def __init__(self, options: Options | None = None, *, allow_pickle: bool = False,
                 verify: bool | None = None, take_over: bool = False,
                 shared_loads: bool = True) -> None:
        super().__init__()
        self.options = options if options is not None else Options.from_env()
        self.shared_loads = shared_loads
        self.allow_pickle = allow_pickle
        self.verify = verify
        self.checkpointer = Checkpointer(self.options)
        self._leases = DirectoryLeases("this Lightning job",
                                       f"pass ckptio.lightning.{type(self).__name__}"
                                       "(take_over=True)",
                                       take_over)

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | os.PathLike[str],
                        storage_options: Any | None = None) -> None:
        """Save ``checkpoint`` as the ckptio checkpoint (a directory) ``path``; returns once it
        is durable and committed. A previous checkpoint at ``path`` (``last.ckpt`` each time)
        stays whole until then and is replaced as Lightning asks, logged at INFO."""
        target = self._prepare_save(path, storage_options)
        with _pickle_hint(self.allow_pickle, type(self).__name__):
            self.checkpointer.save(checkpoint, target, allow_pickle=self.allow_pickle,
                                   process_group=self._own_group(), overwrite=True)

    def load_checkpoint(self, path: str | os.PathLike[str], map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """Lightning's checkpoint dict from ``path``: fresh CPU tensors (moved to
        ``map_location`` when that is a device) and Python values. Errors are CkptErrors
        naming the file (CheckpointNotFoundError, CorruptCheckpointError, ...). With many
        ranks, a collective of them all unless shared_loads=False (class docstring)."""
        allow = self.allow_pickle and weights_only is not True
        group = self._load_group(os.fspath(path))
        try:
            loaded = self.checkpointer.load(os.fspath(path), verify=self.verify,
                                            allow_pickle=allow, process_group=group)
        except IncompleteCheckpointError:
            other = committed_instead_of_last(_location(path))
            if other is None:
                raise
            loaded = self.checkpointer.load(other, verify=self.verify, allow_pickle=allow,
                                            process_group=group)
        if not isinstance(loaded, dict):
            raise CkptError(f"{os.fspath(path)} holds a {type(loaded).__name__}, not a Lightning "
                            "checkpoint (a dict): load it with ckptio.load")
        device = _device(map_location)
        if device is None:
            return loaded
        return moved(loaded, device)

    def remove_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Remove the checkpoint at ``path`` crash-safely (docs/BEHAVIOUR.md, "ckptio.lightning");
        none there: no-op. At an object-store URL its manifest goes first (it is no checkpoint
        from then on), then its other objects."""
        target = _location(path)
        if scheme_of(target) is not None:
            remove_remote(target, self.options)
            return
        try:
            if os.path.islink(target) or os.path.isfile(target):
                os.remove(target)
            elif os.path.isdir(target):
                remove_directory(target)
        except OSError as exc:
            raise StorageIOError(f"cannot remove checkpoint {target}: {exc.strerror or exc}; "
                                 "check the directory's permissions") from None

    def teardown(self) -> None:
        """Free the staging pool and let go of the run leases (the plugin stays usable: a
        later fit makes them again)."""
        try:
            self.checkpointer.close()
        finally:
            self._leases.release()

    def _prepare_save(self, path: str | os.PathLike[str], storage_options: Any) -> str:
        """The path to save into, once the save is known to be possible: no storage_options,
        no symlink or file at the path (replaced, as Lightning's torch.save would: a file there
        is a ``last.ckpt`` of Lightning's own TorchCheckpointIO, from before a plugin switch)."""
        target = os.fspath(path)
        if storage_options is not None:
            raise CkptError(f"saving {target}: ckptio.lightning takes no storage_options; pass "
                            "ckptio.Options to the plugin (CheckpointIO(options=...)) instead")
        check_path(target)
        self._leases.take(os.path.dirname(checkpoint_path(target)), target)
        if os.path.islink(target) or os.path.isfile(target):
            try:
                os.remove(target)
            except OSError as exc:
                raise StorageIOError(f"cannot replace {target} (a symlink or file) by a "
                                     f"checkpoint: {exc.strerror or exc}; check the directory's "
                                     "permissions") from None
        return target

    def _load_group(self, path: str) -> Any:
        """The ranks a load of ``path`` runs over: with shared_loads and many ranks, all of
        them, once all have come (within Options.rank_timeout_s); else this rank alone."""
        group = current_group() if self.shared_loads else None
        if group is None:
            return rank_alone_group()
        missing = arrive(group, "lightning-load", self.options.rank_timeout_s)
        if missing is not None:
            raise RankFailedError(
                f"ckptio.lightning: load_checkpoint({path!r}) loads on every rank together "
                f"(shared_loads=True), and rank(s) {list(missing) or 'of the job'} did not call "
                f"it within {self.options.rank_timeout_s:g} s (Options.rank_timeout_s). To call "
                "it on some ranks only, pass CheckpointIO(shared_loads=False)", missing)
        return group

    def _own_group(self) -> Any:
        """None in one process. With several ranks Lightning calls the plugin on rank 0 only,
        while a ckptio save over the default group is a collective of every rank: the save runs
        on this rank alone (distributed/dist.py, rank_alone_group)."""
        return rank_alone_group()


class AsyncCheckpointIO(CheckpointIO):
    """CheckpointIO whose save returns once the tensors are copied into ckptio's staging pool;
    the write and the commit run in a background thread while training goes on.

    A save waits for the previous one (one in flight). A failed background save is raised
    once: by the next save, by ``wait()``, or at teardown (Lightning's end of fit/validate/
    test), which also waits for the save in flight. Removing the path being saved waits for
    that save first; a load waits for it too. Removing another checkpoint while a save is in
    flight (ModelCheckpoint dropping the one the new save replaces) is done once that save
    has committed, so a kill meanwhile leaves the older one; if that save fails, the older one
    is kept. Arguments as CheckpointIO's.
    """

    def __init__(self, options: Options | None = None, *, allow_pickle: bool = False,
                 verify: bool | None = None, take_over: bool = False,
                 shared_loads: bool = True) -> None:
        super().__init__(options, allow_pickle=allow_pickle, verify=verify, take_over=take_over,
                         shared_loads=shared_loads)
        self._handle: SaveHandle | None = None
        self._removals: list[str | os.PathLike[str]] = []  # once the save in flight commits

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | os.PathLike[str],
                        storage_options: Any | None = None) -> None:
        """Start saving ``checkpoint`` to ``path``; a previous save's unreported error is
        raised here (and this save is not started)."""
        target = self._prepare_save(path, storage_options)
        self._removals = [p for p in self._removals if not _same(p, target)]
        self.wait()
        with _pickle_hint(self.allow_pickle, type(self).__name__):
            self._handle = self.checkpointer.async_save(checkpoint, target,
                                                        allow_pickle=self.allow_pickle,
                                                        process_group=self._own_group(),
                                                        overwrite=True)

    def in_flight(self) -> str | None:
        """The path of the save still running, or None."""
        handle = self._handle
        return None if handle is None or handle.done() else handle.path

    def wait(self) -> SaveResult | None:
        """Wait for the save in flight (None if none); its error, if any, is raised here once
        (the removals waiting for it are then not done). Then the removals that waited."""
        handle, self._handle = self._handle, None
        removals, self._removals = self._removals, []
        result = None if handle is None else handle.wait()
        for path in removals:
            super().remove_checkpoint(path)
        return result

    def remove_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Remove ``path`` now, or once the save in flight commits (class docstring)."""
        handle = self._handle
        if handle is not None and _same(handle.path, path):
            self.wait()
        elif handle is not None:
            self._removals.append(path)
            return
        super().remove_checkpoint(path)

    def teardown(self) -> None:
        """Wait for the save in flight (then do the removals that waited for it) and free the
        staging pool; a background error nobody has seen is raised here."""
        try:
            self.wait()
        finally:
            super().teardown()


for _other in _OTHERS:  # the other package's Trainer accepts the plugins too
    cast(abc.ABCMeta, _other).register(CheckpointIO)


_PATCHING = threading.Lock()


def load_from_checkpoint(cls: type[Any], checkpoint_path: str | os.PathLike[str],
                         map_location: Any | None = None, *, allow_pickle: bool = False,
                         options: Options | None = None, **kwargs: Any) -> Any:
    """``cls.load_from_checkpoint(checkpoint_path, ...)`` for a ckptio checkpoint, the way to
    load a trained LightningModule (or LightningDataModule) for inference: Lightning's own
    steps (hyper-parameters and ``kwargs`` overriding them, ``strict``, the checkpoint's
    migration, ``on_load_checkpoint``) with the file read by this plugin's load instead of
    ``torch.load``, which cannot read a ckptio checkpoint (a directory). ``map_location``: a
    device (or its name) moves the tensors there; anything else loads them on the CPU.

        model = ckptio.lightning.load_from_checkpoint(MyModel, "ckpts/epoch=3-step=32.ckpt")

    Lightning reads files through ``core.saving.pl_load``; it is replaced for the call (one
    call at a time in a process). Each rank that calls it loads alone."""
    package = ("lightning.pytorch" if _is_subclass(cls, "lightning.pytorch", "LightningModule",
                                                    "LightningDataModule")
               else "pytorch_lightning")
    saving: Any = importlib.import_module(f"{package}.core.saving")
    io = CheckpointIO(options, allow_pickle=allow_pickle, shared_loads=False)  # any rank

    def read(path: Any, map_location: Any = None, weights_only: Any = None) -> dict[str, Any]:
        device = map_location if isinstance(map_location, (str, torch.device)) else None
        return io.load_checkpoint(path, device, weights_only=weights_only)

    with _PATCHING:
        original = saving.pl_load
        saving.pl_load = read
        try:
            return cls.load_from_checkpoint(checkpoint_path, map_location=map_location, **kwargs)
        finally:
            saving.pl_load = original
            io.teardown()


def _is_subclass(cls: type, package: str, *names: str) -> bool:
    if importlib.util.find_spec(package.split(".")[0]) is None:
        return False
    module = importlib.import_module(package)
    return any(isinstance(cls, type) and issubclass(cls, getattr(module, n)) for n in names)


@contextlib.contextmanager
def _pickle_hint(allowed: bool, plugin: str) -> Iterator[None]:
    """Adds the ``plugin`` class's own way to opt in to an UnsupportedStateError a save
    raised."""
    try:
        yield
    except UnsupportedStateError as exc:
        if allowed:
            raise
        raise UnsupportedStateError(
            f"{exc} (through Lightning: ckptio.lightning.{plugin}(allow_pickle=True) "
            "stores such values pickled, and loads them back)") from exc


def _location(path: str | os.PathLike[str]) -> str:
    """``path`` as ckptio saves it: a local path (``file://`` and ``shm://`` URLs become their
    directory), or the URL of another scheme ckptio serves (``s3://``); another scheme:
    UnsupportedPathError naming the ones served."""
    return checkpoint_path(os.fspath(path))


def _same(one: str | os.PathLike[str], other: str | os.PathLike[str]) -> bool:
    return compared(_location(one)) == compared(_location(other))


def _device(map_location: Any) -> torch.device | None:
    """The device a map_location names; None (stay on CPU) for None or a callable (Lightning's
    default is the identity); anything else: CkptError."""
    if map_location is None or callable(map_location):
        return None
    if isinstance(map_location, (str, int, torch.device)):
        return torch.device(map_location)
    raise CkptError(f"ckptio.lightning: map_location={map_location!r} is not supported; pass a "
                    "device (or None: CPU tensors, which Lightning moves to the module's device)")
