"""The IOBackend of the ``gs://`` scheme: resumable uploads and ranged reads.

A data file ``gs://bucket/key`` is one object. Writing it: one resumable upload (the library's
BlobWriter, chunks of ``GcsSettings.chunk_bytes``), fed in file order; a save writes in
buffer-sized pieces in order, so each write goes straight on, and one that arrives ahead of
its turn is copied and held until the bytes before it came (gaps left at close are zeros, as a
preallocated file reads). The object appears only whole, at ``close(sync=True)``;
``close(sync=False)`` drops the upload (nothing becomes visible). Uploads of different files
run side by side on ``GcsSettings.concurrency`` threads; each file's chunks go one after the
other (a resumable upload is sequential).

Reads are ranged GETs of the object generation seen at open, on the same threads. Every
request goes through client.call (deadline, retries); the upload's chunks through the
library's retry, bounded by the same deadline.

Owns: GcsBackend. Does not own: URLs, the client, retries (gcs_client.py), which objects make a
checkpoint and its commit (gcs_store.py), what is written (saving/).
"""

from __future__ import annotations

import functools
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ckptio.errors import StorageIOError
from ckptio.io.backend_contract import FileHandle, completed, started_pool
from ckptio.storage.gcs.gcs_client import (
    GcsPath,
    call,
    client,
    errors,
    failed,
    missing,
    status,
)
from ckptio.storage.gcs.gcs_settings import GcsSettings
from ckptio.storage.object_common import OpenHandles, deleted_while_read

__all__ = ["GcsBackend"]

_ZEROS = bytes(1 << 20)


@dataclass
class _Upload:
    """One object being written, in order."""

    where: GcsPath
    nbytes: int
    writer: Any  # the library's BlobWriter
    done: int = 0  # bytes handed to the writer so far
    ahead: dict[int, bytes] = field(default_factory=dict)  # offset -> bytes not yet in turn
    error: BaseException | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass(frozen=True)
class _Object:
    """One object open for reading: the generation seen at open."""

    where: GcsPath
    size: int
    generation: int


class GcsBackend:
    """Positioned writes and reads of gs:// objects through one client."""

    name = "gcs"

    def __init__(self, settings: GcsSettings) -> None:
        self.settings = settings
        self._open: OpenHandles[_Upload | _Object] = OpenHandles("GCS")
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        client(settings)  # now, not at the first request: Checkpointer.prepare(url) pays for it

    def __getstate__(self) -> dict[str, Any]:
        return {"settings": self.settings}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["settings"])  # type: ignore[misc]

    def _submit(self, work: Any, *args: Any) -> Future[int]:
        with self._lock:
            if self._pool is None:
                self._pool = started_pool(self.settings.concurrency, "ckptio-gcs")
            return self._pool.submit(work, *args)

    def _blob(self, where: GcsPath, generation: int | None = None) -> Any:
        return client(self.settings).bucket(where.bucket).blob(where.key, generation=generation)

    # ------------------------------------------------------------------------------- writes

    def open_write(self, path: str, nbytes: int) -> FileHandle:
        where = GcsPath.parse(path)
        if self._lookup(where) is not None:
            raise StorageIOError(f"cannot create {path}: it exists (a data file is never "
                                 "overwritten); save into a new location")
        from google.api_core.retry import Retry

        s = self.settings
        condition = {"if_generation_match": 0} if s.conditional == "require" else {}
        writer = _writer_class()(
            self._blob(where), chunk_size=s.chunk_bytes, ignore_flush=True,
            retry=Retry(predicate=_transient, timeout=s.retry_deadline_s),
            timeout=(s.connect_timeout_s, min(s.read_timeout_s, s.retry_deadline_s)),
            content_type="application/octet-stream", **condition)
        return self._open.add(path, _Upload(where, nbytes, writer))

    def submit_write(self, fh: FileHandle, offset: int, data: memoryview) -> Future[int]:
        try:
            upload = self._open.get(fh)
            if not isinstance(upload, _Upload):
                raise StorageIOError(f"writing {fh.path} failed: it is open for reading")
            if offset < 0 or offset + len(data) > upload.nbytes:
                raise StorageIOError(f"writing {len(data)} bytes at {offset} of {fh.path} "
                                     f"failed: the file was opened for {upload.nbytes} bytes")
        except StorageIOError as exc:
            return completed(error=exc)
        return self._submit(self._write, upload, offset, data)

    def _write(self, upload: _Upload, offset: int, data: memoryview) -> int:
        with upload.lock:
            if upload.error is not None:
                raise upload.error
            if offset != upload.done:
                upload.ahead[offset] = bytes(data)  # the caller's buffer is reused after this
                return len(data)
            self._feed(upload, data)
            while upload.done in upload.ahead:
                self._feed(upload, upload.ahead.pop(upload.done))
        return len(data)

    def _feed(self, upload: _Upload, data: memoryview | bytes) -> None:
        """Hand ``data`` to the writer (under upload.lock); a failure fails the upload."""
        try:
            upload.writer.write(data)
        except errors() as exc:
            _drop(upload.writer)
            upload.error = failed(f"uploading {upload.where.url}", exc, self.settings)
            raise upload.error from exc
        upload.done += len(data)

    def close(self, fh: FileHandle, *, sync: bool) -> None:
        opened = self._open.pop(fh)
        if not isinstance(opened, _Upload):
            return
        with opened.lock:
            if not sync or opened.error is not None:
                _drop(opened.writer)
            if not sync:
                return
            if opened.error is not None:
                raise opened.error
            while opened.done < opened.nbytes:  # gaps: zeros, as a preallocated file reads
                later = [o for o in opened.ahead if o > opened.done]
                upto = min(later, default=opened.nbytes)
                self._feed(opened, _ZEROS[:min(len(_ZEROS), upto - opened.done)])
                while opened.done in opened.ahead:
                    self._feed(opened, opened.ahead.pop(opened.done))
            try:
                opened.writer.close()
            except errors() as exc:
                _drop(opened.writer)
                raise failed(f"completing the upload of {opened.where.url}", exc,
                             self.settings) from exc

    # -------------------------------------------------------------------------------- reads

    def _lookup(self, where: GcsPath) -> tuple[int, int] | None:
        """(size, generation) of an object, or None if there is none."""
        bucket = client(self.settings).bucket(where.bucket)
        blob = missing(self.settings, f"looking up {where.url}",
                       lambda t: bucket.get_blob(where.key, timeout=t, retry=None))
        return None if blob is None else (int(blob.size), int(blob.generation))

    def open_read(self, path: str, *, cached: bool = False) -> FileHandle:  # no page cache
        where = GcsPath.parse(path)
        stored = self._lookup(where)
        if stored is None:
            raise StorageIOError(f"cannot open {path} for reading: no such object")
        return self._open.add(path, _Object(where, *stored))

    def submit_read(self, fh: FileHandle, offset: int, into: memoryview) -> Future[int]:
        try:
            opened, into = self._open.reading(fh, _Object, offset, into)
        except StorageIOError as exc:
            return completed(error=exc)
        if not into:
            return completed(0)
        return self._submit(self._get, opened, offset, into)

    def _get(self, opened: _Object, offset: int, into: memoryview) -> int:
        blob = self._blob(opened.where, opened.generation)
        end = offset + len(into) - 1
        what = f"reading bytes {offset}-{end} of {opened.where.url}"
        try:
            data = call(self.settings, what, lambda t: blob.download_as_bytes(
                start=offset, end=end, raw_download=True, checksum=None, timeout=t, retry=None))
        except errors() as exc:  # 404: that generation was deleted since opened
            if status(exc) == 404:
                raise deleted_while_read(what, opened.where.url) from exc
            raise failed(what, exc, self.settings) from exc
        if len(data) != len(into):
            raise StorageIOError(f"{what} failed: the store sent {len(data)} bytes though the "
                                 f"object had {opened.size} when opened (replaced or "
                                 "truncated since?): load it again, or an earlier checkpoint")
        into[:] = data
        return len(data)

    def register_buffers(self, view: memoryview, *, part_bytes: int = 0) -> bool:
        """No fixed buffers here: every request maps its own."""
        return False

    def shutdown(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)


def _drop(writer: Any) -> None:
    """Let an upload go unfinished: nothing becomes visible (GCS expires an unfinished
    resumable upload)."""
    writer.abandon()


@functools.cache
def _writer_class() -> type:
    """The library's BlobWriter (a resumable upload fed in order), able to be abandoned: it is
    an io object whose close() at garbage collection would finish the upload with what it
    holds, and its terminate() sends a DELETE with no timeout (which a partition hangs), so
    abandon() closes its buffer and sends nothing."""
    from google.cloud.storage.fileio import BlobWriter

    class Writer(BlobWriter):
        def abandon(self) -> None:
            self._buffer.close()

    return Writer


def _transient(exc: BaseException) -> bool:
    """What the upload's retry retries: 408, 429, 5xx, resets and timeouts."""
    import requests

    return status(exc) in (408, 429, 500, 502, 503, 504) or isinstance(
        exc, (requests.ConnectionError, requests.Timeout, ConnectionError, TimeoutError))
