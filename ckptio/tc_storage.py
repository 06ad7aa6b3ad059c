"""ckptio's storage under torch_checkpointing's API: a ``StorageConfig`` whose ``Storage`` keeps
torch_checkpointing's files wherever ckptio writes (a local directory, ``shm://NAME``,
``s3://bucket/prefix`` with ckptio's S3 client, its retries and its errors), so a user of
Meta's ``torch_checkpointing`` keeps its API (the ``[torch-checkpointing]`` extra):

    from ckptio.tc_storage import CkptioStorageConfig
    config = CheckpointManager.Config.with_sync_save()
    config.storage_config = CkptioStorageConfig("s3://bucket/run")
    config.build().save("step-100", {"model": model.state_dict()})  # s3://bucket/run/step-100/

The paths torch_checkpointing passes are names under the root (a leading "/" dropped; ".."
refused). Its commit, a directory renamed from its temporary name, follows its rename table
(Storage.rename): onto an absent or empty directory with the store's move (one rename on a
file system; on S3 each object copied server-side then the source removed, the copy marked
unfinished until whole: loading/tcdir.py MOVING_NAME), onto a populated
directory or a file OSError. Files are written whole (a reader sees the old bytes or the new);
a missing one is FileNotFoundError, another failure the store's CkptError (an OSError too,
where torch_checkpointing catches those). Written by hand (why): torch_checkpointing ships only
a local file-system backend. Differences from it: docs/BENCH_TORCH_CHECKPOINTING.md.

Owns: the mapping of its calls onto a TreeStore (storage/store_contract.py). Does not own: the
stores (storage/), torch_checkpointing itself.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from torch_checkpointing.storage.base_storage import ReadArgs, Storage, StorageConfig

from ckptio.errors import CkptError
from ckptio.loading.tcdir import MOVING_BODY, MOVING_NAME
from ckptio.options import Options
from ckptio.storage.select import store_for
from ckptio.storage.store_contract import TreeStore

__all__ = ["CkptioStorage", "CkptioStorageConfig"]


@dataclass
class CkptioStorageConfig(StorageConfig):
    """``root``: where the checkpoints go (a path, ``shm://NAME``, ``s3://bucket/prefix``);
    S3 settings come from the environment as for ckptio (AWS_ENDPOINT_URL, the keys)."""

    root: str = "."
    options: Options | None = None  # ckptio's (the S3 endpoint, retries); None: from the env

    def create_storage(self) -> CkptioStorage:
        return CkptioStorage(self.root, self.options)


class CkptioStorage(Storage):
    """torch_checkpointing's Storage over a ckptio TreeStore (module docstring)."""

    def __init__(self, root: str, options: Options | None = None) -> None:
        store = store_for(root, options or Options.from_env())
        if not isinstance(store, TreeStore):
            raise CkptError(f"{root}: torch_checkpointing keeps folders of files, which "
                            f"{type(store).__name__} cannot hold (a Store, not a TreeStore): "
                            "use a local directory, shm://NAME or s3://bucket/prefix")
        self._root = store

    # ------------------------------------------------------------------ paths

    def _parts(self, path: Path | str) -> list[str]:
        parts = [p for p in PurePosixPath(str(path)).parts if p not in ("/", ".")]
        if ".." in parts:
            raise CkptError(f"{path}: '..' is not a name under {self._root.location}")
        return parts

    def _dir(self, path: Path | str) -> TreeStore:
        store = self._root
        for part in self._parts(path):
            store = store.child(part)
        return store

    def _file(self, path: Path | str) -> tuple[TreeStore, str]:
        parts = self._parts(path)
        if not parts:
            raise IsADirectoryError(f"{self._root.location} is the root, not a file")
        return self._dir("/".join(parts[:-1])), parts[-1]

    def _size(self, path: Path | str) -> int | None:
        parent, name = self._file(path)
        return parent.sizes([name]).get(name)

    # ------------------------------------------------------------------ reads

    def stream_read(self, path: Path, read_args: ReadArgs | None = None) -> io.RawIOBase:
        """A seekable stream whose reads are ranged reads of the store (its parallel fill
        opens one per range and seeks)."""
        size = self._size(path)
        if size is None:
            raise FileNotFoundError(f"{self.remap_path(path)}: no such file")
        parent, name = self._file(path)
        return _Ranges(parent, name, size)

    def read(self, path: Path, read_args: ReadArgs | None = None) -> bytes:
        return self._read(path)

    def _read(self, path: Path | str) -> bytes:
        size = self._size(path)
        if size is None:
            raise FileNotFoundError(f"{self.remap_path(Path(path))}: no such file")
        parent, name = self._file(path)
        return parent.read_file(name, 0, size)

    def getsize(self, path: Path) -> int:
        size = self._size(path)
        if size is None:
            raise FileNotFoundError(f"{self.remap_path(path)}: no such file")
        return size

    def exists(self, path: Path) -> bool:
        return self.isdir(path) or self._size(path) is not None

    def isdir(self, path: Path) -> bool:
        """A directory of a file system (empty too), or a prefix holding an object of an object
        store (which has no folders: an emptied one is gone, whatever its listing keeps)."""
        parts = self._parts(path)
        if not parts:
            return True
        parent, name = self._file(path)
        if name not in parent.entries() or self._size(path) is not None:
            return False
        return not self._root.capabilities.remote or _holds_objects(self._dir(path))

    def ls(self, path: Path) -> list[str]:
        return self._dir(path).entries()

    def remap_path(self, path: Path) -> str:
        parts = self._parts(path)
        if not parts:
            return self._root.location
        parent, name = self._file(path)
        return parent.path_of(name)

    # ------------------------------------------------------------------ writes

    def stream_write(self, path: Path) -> io.IOBase:
        parent, name = self._file(path)
        return _WholeFile(parent, name)

    def write(self, path: Path, data: Any) -> None:
        parent, name = self._file(path)
        parent.write_file(name, memoryview(data).cast("B"))

    def delete(self, path: Path) -> None:
        parent, name = self._file(path)
        problems = parent.remove([name])
        if problems:
            raise OSError(f"deleting {self.remap_path(path)}: {problems[0]}")

    def mkdir(self, path: Path, recursive: bool = True) -> None:
        self._dir(path).prepare()

    def rmdir(self, path: Path) -> None:
        problems = self._dir(path).remove_tree()
        if problems:
            raise OSError(f"removing {self.remap_path(path)}: {problems[0]}")

    def rename(self, src_path: Path, dst_path: Path, is_directory: bool = False,
               background_cleanup: bool = False) -> None:
        """torch_checkpointing's rename table (Storage.rename): a directory onto an absent or
        empty one, a file onto an absent one or a file; anything else OSError."""
        if is_directory or self.isdir(src_path):
            if self._size(dst_path) is not None or (self.isdir(dst_path) and self.ls(dst_path)):
                raise OSError(f"renaming {self.remap_path(src_path)} onto "
                              f"{self.remap_path(dst_path)}: the destination is occupied")
            self._move(self._dir(src_path), self._dir(dst_path))
            return
        if self.isdir(dst_path):
            raise OSError(f"renaming file {self.remap_path(src_path)} onto directory "
                          f"{self.remap_path(dst_path)}")
        self.write(dst_path, self._read(src_path))
        self.delete(src_path)


    def _move(self, src: TreeStore, dst: TreeStore) -> None:
        """``src`` moved onto ``dst``; where that copies object by object (an object store), a
        checkpoint copied part way is marked so (tcdir.MOVING_NAME, copied first as its name
        begins with "." (TreeStore.move_to), removed last): ckptio.load refuses it rather than
        load the items that were copied."""
        marked = not src.capabilities.rename
        if marked:
            src.write_file(MOVING_NAME, MOVING_BODY)
        src.move_to(dst)
        problems = dst.remove([MOVING_NAME]) if marked else []
        if problems:
            raise OSError(f"removing {dst.path_of(MOVING_NAME)} after the commit: {problems[0]}")


def _holds_objects(store: TreeStore) -> bool:
    names = store.entries()
    files = store.sizes(names)
    return bool(files) or any(_holds_objects(store.child(n)) for n in names if n not in files)


class _Ranges(io.RawIOBase):
    """A file of a store read by ranges: each readinto one read of the store from the
    position."""

    def __init__(self, parent: TreeStore, name: str, size: int) -> None:
        super().__init__()
        self._parent, self._name, self._size, self._pos = parent, name, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        want = max(0, min(len(view), self._size - self._pos))
        got = self._parent.read_into(self._name, view[:want], self._pos) if want else 0
        self._pos += got
        return got


class _WholeFile(io.BytesIO):
    """A stream_write target: the bytes written, stored whole on close (not after an error)."""

    def __init__(self, parent: TreeStore, name: str) -> None:
        super().__init__()
        self._parent, self._name, self._failed = parent, name, False

    def write(self, data: Any) -> int:  # numpy arrays, tensors' numpy views, array.array
        return super().write(memoryview(data).cast("B"))

    def __exit__(self, *exc: Any) -> None:
        self._failed = exc[0] is not None
        super().__exit__(*exc)

    def close(self) -> None:
        if not self.closed and not self._failed:
            with self.getbuffer() as view:
                self._parent.write_file(self._name, view)
        super().close()
