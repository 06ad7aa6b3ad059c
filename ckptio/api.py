"""save / load as a handful of named steps, and the Checkpointer that owns reusable resources.

Owns: the order of steps and the lifetime of the staging pool and I/O backend (created on first
use, reused by every later save and load). The logic lives in the modules it calls.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from . import commit, io, manifest, persist, restore
from .errors import CorruptCheckpointError
from .flatten import flatten
from .layout import plan_files
from .options import Options
from .plan import build_plan
from .stage import BufferPool
from .fill import KeyFilter, LoadReport, fill_fresh, fill_in_place
from .types import Manifest

__all__ = ["Checkpointer", "SaveResult", "LoadReport", "save", "load", "verify"]


@dataclass(frozen=True)
class SaveResult:
    path: str
    nbytes: int  # tensor bytes written (aliases and inline values not counted)
    files: tuple[str, ...]
    seconds: float


class Checkpointer:
    """Saves and loads with one reused staging pool and I/O backend.

    Create one per training job (or use the module-level ckptio.save/load, which share one).
    Not safe for concurrent use from several threads; saves and loads run one at a time.
    """

    def __init__(self, options: Options | None = None) -> None:
        self.options = options or Options.from_env()
        self._pool: BufferPool | None = None
        self._backend: io.IOBackend | None = None
        self._lock = threading.Lock()
        self._cleanup: threading.Thread | None = None

    def _finish_cleanup(self) -> None:
        """Wait for the previous save's removal of superseded files (it runs in the background:
        deleting a multi-GB file costs ext4 ~0.2 s/GB, which need not block the caller)."""
        if self._cleanup is not None:
            self._cleanup.join()
            self._cleanup = None

    def _resources(self) -> tuple[BufferPool, io.IOBackend]:
        if self._pool is None:
            self._pool = BufferPool(self.options.nbuffers, self.options.buffer_bytes)
        if self._backend is None:
            self._backend = io.create(self.options.io_backend, depth=self.options.io_depth,
                                      direct_io=self.options.direct_io)
        return self._pool, self._backend

    def close(self) -> None:
        """Free the staging pool and stop I/O threads; the Checkpointer stays usable."""
        with self._lock:
            self._finish_cleanup()
            pool, backend = self._pool, self._backend
            self._pool, self._backend = None, None
            if backend is not None:
                backend.shutdown()
            if pool is not None:
                pool.close()

    def save(self, state: Any, path: str | os.PathLike[str], *, allow_pickle: bool = False) -> SaveResult:
        """Write ``state`` to directory ``path``; returns once every byte is durable and committed."""
        started = time.perf_counter()
        path = os.fspath(path)
        flat = flatten(state)
        plan, sources = build_plan(flat, allow_pickle=allow_pickle)
        save_id = commit.new_save_id()
        files = plan_files(plan.items, save_id=save_id, rank=0,
                           max_file_bytes=self.options.max_file_bytes)
        names = [f.name for f in files]
        with self._lock, commit.attempt(path, names):
            self._finish_cleanup()
            pool, backend = self._resources()
            entries, infos = persist.write_files(
                path, files, sources, pool=pool, backend=backend,
                algorithm=self.options.checksum, rank=0)
            record = Manifest(
                version=manifest.VERSION, save_id=save_id, checksum_algorithm=self.options.checksum,
                world_size=1, files=tuple(infos), tensors=tuple(entries), objects=plan.objects,
                aliases=plan.aliases, tree=flat.tree, meta=_meta(),
            )
            commit.commit(path, manifest.encode(record), save_id)
        self._cleanup = threading.Thread(target=commit.remove_unreferenced, args=(path, set(names)),
                                         name="ckptio-cleanup", daemon=True)
        self._cleanup.start()
        return SaveResult(path, sum(i.nbytes for i in plan.items), tuple(names),
                          time.perf_counter() - started)

    def verify(self, path: str | os.PathLike[str]) -> int:
        """Read every stored byte and check it against its checksum; -> bytes read.

        Nothing is copied out or unpickled; memory stays within the staging pool.
        """
        path = os.fspath(path)
        record = manifest.decode(commit.read_committed(path),
                                 os.path.join(path, manifest.MANIFEST_NAME))
        _check_files(path, record)
        with self._lock:
            pool, backend = self._resources()
            return restore.read_targets(
                path, [restore.Target(e) for e in record.tensors], pool=pool, backend=backend,
                algorithm=record.checksum_algorithm, depth=self.options.io_depth)

    def load(
        self,
        path: str | os.PathLike[str],
        state: Any = None,
        *,
        strict: bool = True,
        keys: KeyFilter = None,
        cast: bool = False,
        verify: bool | None = None,
        allow_pickle: bool = False,
    ) -> Any:
        """Load into ``state`` in place (returns a LoadReport), or, with no state, return a new one.

        strict: missing or unexpected keys raise (else they are only reported).
        keys: load only these keys (a key or a prefix of keys) or those a callable accepts.
        cast: allow a dtype conversion where the destination's dtype differs.
        verify: check checksums (default Options.verify).
        allow_pickle: unpickle objects saved with allow_pickle=True (only for trusted files).
        """
        started = time.perf_counter()
        path = os.fspath(path)
        where = os.path.join(path, manifest.MANIFEST_NAME)
        record = manifest.decode(commit.read_committed(path), where)
        _check_files(path, record)
        verify = self.options.verify if verify is None else verify
        with self._lock:
            pool, backend = self._resources()

            def read(targets: list[restore.Target]) -> int:
                return restore.read_targets(
                    path, targets, pool=pool, backend=backend, depth=self.options.io_depth,
                    algorithm=record.checksum_algorithm if verify else None)

            if state is None:
                return fill_fresh(record, read, keys=keys, allow_pickle=allow_pickle)
            report = fill_in_place(record, flatten(state), read, keys=keys, strict=strict,
                                   cast=cast, allow_pickle=allow_pickle)
        return dataclasses.replace(report, seconds=time.perf_counter() - started)


def _meta() -> dict[str, Any]:
    from . import __version__

    return {"ckptio_version": __version__, "torch_version": torch.__version__,
            "created_unix": time.time()}


def _check_files(path: str, record: Manifest) -> None:
    for info in record.files:
        file = os.path.join(path, info.name)
        try:
            size = os.stat(file).st_size
        except FileNotFoundError:
            raise CorruptCheckpointError(
                f"data file {file} named by the manifest is missing; the checkpoint is damaged: "
                "load an earlier one") from None
        if size < info.nbytes:
            raise CorruptCheckpointError(
                f"data file {file} is truncated: {size} of {info.nbytes} bytes; the checkpoint is "
                "damaged: load an earlier one")


_default: Checkpointer | None = None
_default_lock = threading.Lock()


def _checkpointer(options: Options | None) -> Checkpointer:
    """The shared Checkpointer; replaced (its pool freed) when called with different options."""
    global _default
    with _default_lock:
        if _default is None or (options is not None and options != _default.options):
            if _default is not None:
                _default.close()
            _default = Checkpointer(options)
        return _default


def save(state: Any, path: str | os.PathLike[str], *, allow_pickle: bool = False,
         options: Options | None = None) -> SaveResult:
    """Save with the shared Checkpointer (or a one-off one when ``options`` is given)."""
    return _checkpointer(options).save(state, path, allow_pickle=allow_pickle)


def verify(path: str | os.PathLike[str]) -> int:
    """Check every stored byte of a checkpoint against its checksum; see Checkpointer.verify."""
    return _checkpointer(None).verify(path)


def load(path: str | os.PathLike[str], state: Any = None, *, strict: bool = True,
         keys: KeyFilter = None, cast: bool = False, verify: bool | None = None,
         allow_pickle: bool = False, options: Options | None = None) -> Any:
    """Load with the shared Checkpointer; see Checkpointer.load."""
    return _checkpointer(options).load(path, state, strict=strict, keys=keys, cast=cast,
                                       verify=verify, allow_pickle=allow_pickle)
