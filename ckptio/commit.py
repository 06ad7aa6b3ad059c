"""When a checkpoint exists: the commit protocol on a local directory.

Protocol: data files get names unique to one save (data-<save_id>-...), are written and fsynced;
the manifest is written to a temporary name, fsynced and renamed over manifest.json (the atomic
commit point); the directory is fsynced. Only then are files no committed manifest names (an
older save's, or an interrupted save's) removed. So a save into a directory that holds a
checkpoint never harms it before the new one is committed, and a kill at any moment leaves the
last committed manifest and every file it names intact.

Owns: directory creation, the commit, finding a committed manifest, cleaning leftovers.
Does not own: the manifest's content (manifest.py) or data bytes (persist.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import threading
import time
from collections.abc import Iterator

from .errors import (CheckpointNotFoundError, CorruptCheckpointError, IncompleteCheckpointError,
                     StorageIOError)
from .manifest import MANIFEST_NAME
from .types import Manifest

log = logging.getLogger("ckptio")
_TMP_PREFIX = ".manifest-"
_DATA_PREFIX = "data-"


def new_save_id() -> str:
    """Time-ordered and unique: milliseconds since the epoch, then random bits."""
    return f"{int(time.time() * 1000):011x}{secrets.token_hex(4)}"


@contextlib.contextmanager
def attempt(path: str, names: list[str]) -> Iterator[None]:
    """Create the checkpoint directory; if the body fails, remove the save's files ``names``
    (and the directory, if this call created it and it is empty). Nothing else is touched."""
    created = not os.path.exists(path)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise StorageIOError(f"cannot create checkpoint directory {path}: {exc.strerror}") from None
    if not os.path.isdir(path):
        raise StorageIOError(f"checkpoint path {path} exists and is not a directory; "
                             "choose another path")
    try:
        yield
    except BaseException:
        if _references(path, names):
            raise  # renamed into place before the failure (e.g. a directory fsync): keep its files
        discard(path, names)
        if created:
            with contextlib.suppress(OSError):
                os.rmdir(path)
        raise


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _references(path: str, names: list[str]) -> bool:
    """Whether the committed manifest at ``path`` names any of ``names`` (unique per save)."""
    try:
        with open(os.path.join(path, MANIFEST_NAME), "rb") as f:
            text = f.read()
    except OSError:
        return False
    return any(name.encode() in text for name in names)


def commit(path: str, manifest_bytes: bytes, save_id: str) -> None:
    """Make the save durable and visible in one rename."""
    tmp = os.path.join(path, f"{_TMP_PREFIX}{save_id}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            view = memoryview(manifest_bytes)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, os.path.join(path, MANIFEST_NAME))
        _fsync_dir(path)
        _fsync_dir(os.path.dirname(os.path.abspath(path)))
    except OSError as exc:
        discard(path, [os.path.basename(tmp)])
        raise StorageIOError(f"committing the manifest of {path} failed: {exc.strerror or exc}; "
                             "the previous checkpoint there, if any, is untouched") from None


def read_committed(path: str) -> bytes:
    """The committed manifest's bytes, or an error saying why there is none."""
    if not os.path.exists(path):
        raise CheckpointNotFoundError(f"no checkpoint at {path}: the path does not exist")
    if not os.path.isdir(path):
        raise CheckpointNotFoundError(f"{path} is not a ckptio checkpoint directory")
    try:
        with open(os.path.join(path, MANIFEST_NAME), "rb") as f:
            return f.read()
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise StorageIOError(f"cannot read {os.path.join(path, MANIFEST_NAME)}: "
                             f"{exc.strerror or exc}") from None
    leftovers = [n for n in os.listdir(path) if n.startswith((_DATA_PREFIX, _TMP_PREFIX))]
    raise IncompleteCheckpointError(
        f"{path} holds no committed manifest ({MANIFEST_NAME}): a save there was interrupted"
        f" before its commit ({len(leftovers)} partial file(s) left). It never completed; "
        "load an earlier checkpoint, and delete this directory or save over it")


def discard(path: str, names: list[str]) -> None:
    """Remove files of a save that will not be committed."""
    for name in names:
        try:
            os.unlink(os.path.join(path, name))
        except FileNotFoundError:
            pass


def remove_unreferenced(path: str, keep: set[str], listed: threading.Event | None = None) -> list[str]:
    """After a commit: delete data and temporary files the committed manifest does not name.

    ``listed`` is set once the files to remove are chosen (a later save into the same directory
    may create files from then on: they are not on the list). Failures are logged, not raised:
    the checkpoint is already committed and whole; a leftover file is removed by the next save
    into this directory.
    """
    try:
        try:
            removed = [
                name for name in os.listdir(path)
                if name.startswith((_DATA_PREFIX, _TMP_PREFIX)) and name not in keep
            ]
        finally:
            if listed is not None:
                listed.set()
        discard(path, removed)
    except OSError as exc:
        log.warning("ckptio: could not remove superseded files in %s: %s", path, exc)
        return []
    return removed


def check_files(path: str, record: Manifest) -> None:
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
