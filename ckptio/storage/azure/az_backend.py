"""The IOBackend of the ``az://`` scheme: staged blocks and ranged reads.

A data file ``az://container/name`` is one block blob. Each write is staged as one block
(Put Block) straight from the caller's buffer, named by its offset (equal-length ids), on a pool
of ``settings.concurrency`` threads; its future resolves when the service acknowledged the
block, so memory stays the staging pool's. ``close(sync=True)`` waits for every block, stages
zeros where nothing was written (a preallocated file reads zeros there) and commits the block
list in offset order, on the condition that no blob of that name exists (If-None-Match: *):
the blob appears whole, never in part. ``close(sync=False)`` commits nothing (the service
drops uncommitted blocks). Reads are ranged GETs pinned to the ETag seen at open.

Owns: AzureBackend. Does not own: URLs, the client, retries (az_client.py), which blobs make a
checkpoint and its commit (az_store.py), what is written (saving/).
"""

from __future__ import annotations

import base64
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ckptio.errors import StorageIOError
from ckptio.io.backend_contract import FileHandle, completed
from ckptio.storage.azure.az_client import (
    AzPath,
    Timeouts,
    call,
    checked,
    container,
    failed,
    sdk_error,
    status,
)
from ckptio.storage.azure.az_settings import AzureSettings
from ckptio.storage.object_common import OpenHandles, deleted_while_read

__all__ = ["MAX_BLOCKS", "AzureBackend", "block_id", "head"]

MAX_BLOCKS = 50_000  # Azure: committed blocks of one blob at most


def block_id(offset: int) -> str:
    """The id of the block starting at ``offset`` (every id of a blob has one length)."""
    return base64.b64encode(f"{offset:020d}".encode()).decode()


def head(settings: AzureSettings, where: AzPath) -> tuple[int, str] | None:
    """(size, ETag) of a blob, or None if there is none."""
    blob = container(settings, where.container).get_blob_client(where.name)
    props = checked(settings, f"looking up {where.url}",
                    lambda t: blob.get_blob_properties(**t), none_on=(404,))
    return None if props is None else (int(props.size), str(props.etag))


@dataclass
class _Blob:
    """One blob being written: its staged blocks (offset -> length) and their futures."""

    where: AzPath
    nbytes: int
    blocks: dict[int, int] = field(default_factory=dict)
    inflight: list[Future[int]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass(frozen=True)
class _Reading:
    where: AzPath
    size: int
    etag: str


class AzureBackend:
    """Positioned writes (blocks) and reads (ranged GETs) of az:// blobs."""

    name = "azure"

    def __init__(self, settings: AzureSettings, buffer_nbytes: int) -> None:
        self.settings, self.buffer_nbytes = settings, buffer_nbytes
        self._open: OpenHandles[_Blob | _Reading] = OpenHandles("Azure")
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"settings": self.settings, "buffer_nbytes": self.buffer_nbytes}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["settings"], state["buffer_nbytes"])  # type: ignore[misc]

    def _blob(self, where: AzPath) -> Any:
        return container(self.settings, where.container).get_blob_client(where.name)

    def _submit(self, work: Any, *args: Any) -> Future[int]:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.settings.concurrency, "ckptio-azure")
            return self._pool.submit(work, *args)

    # -- writes ---------------------------------------------------------------------------

    def open_write(self, path: str, nbytes: int) -> FileHandle:
        where = AzPath.parse(path)
        if -(-nbytes // max(1, self.buffer_nbytes)) > MAX_BLOCKS:
            raise StorageIOError(f"cannot write {path}: {nbytes} bytes in blocks of "
                                 f"{self.buffer_nbytes} exceed Azure's {MAX_BLOCKS} blocks of a "
                                 "blob; raise Options.buffer_bytes or lower Options.max_file_bytes")
        if head(self.settings, where) is not None:
            raise StorageIOError(f"cannot create {path}: it exists (a data file is never "
                                 "overwritten); save into a new location")
        return self._open.add(path, _Blob(where, nbytes))

    def submit_write(self, fh: FileHandle, offset: int, data: memoryview) -> Future[int]:
        try:
            blob = self._open.get(fh)
            if not isinstance(blob, _Blob):
                raise StorageIOError(f"writing {fh.path} failed: it is open for reading")
            if offset < 0 or offset + len(data) > blob.nbytes:
                raise StorageIOError(f"writing {len(data)} bytes at {offset} of {fh.path} "
                                     f"failed: the file was opened for {blob.nbytes} bytes")
            if not len(data):
                return completed(0)
            with blob.lock:
                if offset in blob.blocks:
                    raise StorageIOError(f"writing {fh.path} at {offset} twice: each byte of "
                                         "a blob is written once")
                blob.blocks[offset] = len(data)
            future = self._submit(self._stage, blob, offset, data)
            with blob.lock:
                blob.inflight.append(future)
            return future
        except StorageIOError as exc:
            return completed(error=exc)

    def _stage(self, blob: _Blob, offset: int, data: memoryview | bytes) -> int:
        client = self._blob(blob.where)
        what = f"staging {len(data)} bytes at {offset} of {blob.where.url}"
        checked(self.settings, what, lambda t: client.stage_block(
            block_id(offset), data, length=len(data), **t))
        return len(data)

    def close(self, fh: FileHandle, *, sync: bool) -> None:
        opened = self._open.pop(fh)
        if not isinstance(opened, _Blob):
            return
        with opened.lock:
            futures = list(opened.inflight)
        errors = [f.exception() for f in futures]
        first = next((e for e in errors if e is not None), None)
        if not sync:
            return  # uncommitted blocks are dropped by the service
        if first is not None:
            raise first
        gaps = self._gaps(opened)
        opened.blocks.update(gaps)
        for future in [self._submit(self._stage, opened, at, bytes(n)) for at, n in gaps]:
            future.result()
        self._commit(opened)

    def _gaps(self, blob: _Blob) -> list[tuple[int, int]]:
        """(offset, length) of the ranges no write covered, in pieces of a buffer at most."""
        gaps, at = [], 0
        for start in sorted([*blob.blocks, blob.nbytes]):
            if start < at:
                raise StorageIOError(f"{blob.where.url}: writes overlap at byte {start}")
            for piece in range(at, start, max(1, self.buffer_nbytes)):
                gaps.append((piece, min(self.buffer_nbytes, start - piece)))
            at = start + blob.blocks.get(start, 0)
        return gaps

    def _commit(self, blob: _Blob) -> None:
        from azure.core import MatchConditions

        client = self._blob(blob.where)
        ids = [block_id(at) for at in sorted(blob.blocks)]
        what = f"committing the {len(ids)} blocks of {blob.where.url}"
        try:
            call(self.settings, what, lambda t: client.commit_block_list(
                ids, match_condition=MatchConditions.IfMissing, **t))
        except sdk_error() as exc:  # 409/412: a retried commit that landed, or mapped
            stored = head(self.settings, blob.where) if status(exc) in (409, 412) else None
            if stored is None or stored[0] != blob.nbytes:
                raise failed(what, exc) from exc

    # -- reads ----------------------------------------------------------------------------

    def open_read(self, path: str, *, cached: bool = False) -> FileHandle:
        where = AzPath.parse(path)
        stored = head(self.settings, where)
        if stored is None:
            raise StorageIOError(f"cannot open {path} for reading: no such blob")
        return self._open.add(path, _Reading(where, *stored))

    def submit_read(self, fh: FileHandle, offset: int, into: memoryview) -> Future[int]:
        try:
            opened, into = self._open.reading(fh, _Reading, offset, into)
        except StorageIOError as exc:
            return completed(error=exc)
        if not into:
            return completed(0)
        return self._submit(self._get, opened, offset, into)

    def _get(self, opened: _Reading, offset: int, into: memoryview) -> int:
        from azure.core import MatchConditions

        client = self._blob(opened.where)
        what = f"reading bytes {offset}-{offset + len(into) - 1} of {opened.where.url}"

        def request(t: Timeouts) -> bytes:
            return bytes(client.download_blob(
                offset=offset, length=len(into), etag=opened.etag,
                match_condition=MatchConditions.IfNotModified, **t).readall())

        try:
            data = call(self.settings, what, request)
        except sdk_error() as exc:  # 412: replaced since opened; 404: deleted; the rest mapped
            if status(exc) == 412:
                raise StorageIOError(f"{what} failed: the blob was replaced while it was read; "
                                     "load it again, or load an earlier checkpoint") from exc
            if status(exc) == 404:
                raise deleted_while_read(what, opened.where.url) from exc
            raise failed(what, exc) from exc
        into[:len(data)] = data
        return len(data)

    def register_buffers(self, view: memoryview, *, part_bytes: int = 0) -> bool:
        return False

    def shutdown(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
