"""The IOBackend of the ``s3://`` scheme: multipart uploads and ranged GETs.

A data file ``s3://bucket/key`` is one object. Writing it: a file of at most one part goes up
in one PutObject; a larger one is a multipart upload of parts of ``part_nbytes`` (the staging
buffer size, or a multiple keeping parts >= 5 MiB and at most 10,000 of them). A save writes in
buffer-sized, in-order pieces, so every write is one whole part uploaded straight from the
staging buffer (no copy); its future resolves when the store acknowledged the part. Any other
write is copied into its part's assembly buffer, uploaded once covered (or at close, zeros in
the gaps).

``close(sync=True)`` waits for every part and completes the upload (the object is whole and
durable); ``close(sync=False)`` aborts it. Reads are ranged GETs into the caller's buffer,
pinned to the ETag seen at open (what the store just saw opens it without a HEAD: objects.py);
a read larger than ``settings.read_bytes`` is split into GETs side by side. Every request goes
through client.call (retries). The client is made with the backend, so
``Checkpointer.prepare(s3 url)`` takes its cost off the first load.

Owns: S3Backend. Does not own: URLs, the client, retries (client.py), reading a GET's body
(body.py), which objects make a checkpoint and its commit (store.py), what is written (saving/).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ckptio.errors import StorageIOError
from ckptio.io.backend_contract import FileHandle, all_of, completed, started_pool
from ckptio.options import MiB
from ckptio.storage.object_common import OpenHandles
from ckptio.storage.s3 import objects as s3objects
from ckptio.storage.s3 import timeouts
from ckptio.storage.s3.body import read_body
from ckptio.storage.s3.client import call, client, code, failed, status
from ckptio.storage.s3.s3path import S3Path
from ckptio.storage.s3.settings import S3Settings

__all__ = ["MAX_PARTS", "MIN_PART", "S3Backend", "part_nbytes_for"]

MIN_PART = 5 * MiB  # S3: every part but the last is at least this
MAX_PART = 5 * 1024 * MiB
MAX_PARTS = 10_000


def part_nbytes_for(nbytes: int, buffer_nbytes: int) -> int:
    """The part size of a file of ``nbytes`` written in ``buffer_nbytes`` pieces: the buffer
    size when S3's limits allow (every write is then a whole part), else a multiple of it."""
    multiple = max(-(-MIN_PART // buffer_nbytes), -(-nbytes // (MAX_PARTS * buffer_nbytes)), 1)
    part = buffer_nbytes * multiple
    if part > MAX_PART:
        raise StorageIOError(f"a file of {nbytes} bytes needs parts over S3's 5 GiB limit; "
                             "lower Options.max_file_bytes")
    return part


@dataclass
class _Upload:
    """One object being written."""

    where: S3Path
    nbytes: int
    part_nbytes: int
    upload_id: str | None  # None: a single PutObject at the first whole write or at close
    etags: dict[int, str] = field(default_factory=dict)  # part number -> ETag
    inflight: list[Future[int]] = field(default_factory=list)
    assembly: dict[int, bytearray] = field(default_factory=dict)  # copy path, per part
    covered: dict[int, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def part_span(self, number: int) -> tuple[int, int]:
        start = (number - 1) * self.part_nbytes
        return start, min(self.part_nbytes, self.nbytes - start)

    @property
    def nparts(self) -> int:
        return max(1, -(-self.nbytes // self.part_nbytes))


@dataclass(frozen=True)
class _Object:
    """One object open for reading."""

    where: S3Path
    size: int
    etag: str


class S3Backend:
    """Positioned writes and reads of s3:// objects through one client: uploads on a thread pool
    of ``settings.concurrency``, ranged GETs on one of ``settings.readers``."""

    name = "s3"

    def __init__(self, settings: S3Settings, buffer_nbytes: int) -> None:
        self.settings, self.buffer_nbytes = settings, buffer_nbytes
        self._open: OpenHandles[_Upload | _Object] = OpenHandles("S3")
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._readers: ThreadPoolExecutor | None = None
        self.parts_uploaded_whole = 0  # writes sent straight from the caller's buffer
        client(settings)  # now, not at the first request: Checkpointer.prepare(url) pays for it

    def __getstate__(self) -> dict[str, Any]:
        return {"settings": self.settings, "buffer_nbytes": self.buffer_nbytes}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["settings"], state["buffer_nbytes"])  # type: ignore[misc]

    @property
    def _client(self) -> Any:
        return client(self.settings)

    def _submit(self, work: Any, *args: Any) -> Future[Any]:
        """``work`` on the upload threads (``settings.concurrency`` of them)."""
        with self._lock:
            if self._pool is None:
                self._pool = started_pool(self.settings.concurrency, "ckptio-s3")
            return self._pool.submit(work, *args)

    def _submit_get(self, work: Any, *args: Any) -> Future[Any]:
        """``work`` on the GET threads (``settings.readers``: a load's reads in flight, which
        the tuner chooses apart from the uploads; the upload threads when they are as many)."""
        if self.settings.readers == self.settings.concurrency:
            return self._submit(work, *args)
        with self._lock:
            if self._readers is None:
                self._readers = started_pool(self.settings.readers, "ckptio-s3-get")
            return self._readers.submit(work, *args)

    # ------------------------------------------------------------------------------- writes

    def open_write(self, path: str, nbytes: int) -> FileHandle:
        where = S3Path.parse(path)
        if self._head(where) is not None:
            raise StorageIOError(f"cannot create {path}: it exists (a data file is never "
                                 "overwritten); save into a new location")
        part = part_nbytes_for(nbytes, self.buffer_nbytes)
        upload_id = None
        if nbytes > part:
            created = self._call(f"starting the upload of {path}", lambda: self._client
                                 .create_multipart_upload(Bucket=where.bucket, Key=where.key))
            upload_id = created["UploadId"]
        return self._open.add(path, _Upload(where, nbytes, part, upload_id))

    def submit_write(self, fh: FileHandle, offset: int, data: memoryview) -> Future[int]:
        try:
            upload = self._open.get(fh)
            if not isinstance(upload, _Upload):
                raise StorageIOError(f"writing {fh.path} failed: it is open for reading")
            if offset < 0 or offset + len(data) > upload.nbytes:
                raise StorageIOError(f"writing {len(data)} bytes at {offset} of {fh.path} "
                                     f"failed: the file was opened for {upload.nbytes} bytes")
            number, rest = divmod(offset, upload.part_nbytes)
            if not rest and len(data) and upload.part_span(number + 1)[1] == len(data):
                return self._send_part(upload, number + 1, data)
            self._assemble(upload, offset, data)
            return completed(len(data))
        except Exception as exc:  # noqa: BLE001 - every failure goes to the future
            return completed(error=exc)

    def _send_part(self, upload: _Upload, number: int, data: memoryview) -> Future[int]:
        with self._lock:
            self.parts_uploaded_whole += 1
        future: Future[int] = self._submit(self._put_part, upload, number, data)
        with upload.lock:
            upload.inflight.append(future)
        return future

    def _put_part(self, upload: _Upload, number: int, data: memoryview | bytes) -> int:
        where, c = upload.where, self._client
        if upload.upload_id is None:
            self._call(f"uploading {where.url}", lambda: c.put_object(
                Bucket=where.bucket, Key=where.key, Body=data))
            return len(data)
        answer = self._call(f"uploading part {number} of {upload.nparts} of {where.url}",
                            lambda: c.upload_part(Bucket=where.bucket, Key=where.key,
                                                  UploadId=upload.upload_id, PartNumber=number,
                                                  Body=data))
        with upload.lock:
            upload.etags[number] = answer["ETag"]
        return len(data)

    def _assemble(self, upload: _Upload, offset: int, data: memoryview) -> None:
        """Copy a write that is not one whole part into its parts' assembly buffers; a part
        whose bytes are all there is uploaded."""
        done = 0
        while done < len(data):
            number = (offset + done) // upload.part_nbytes + 1
            start, length = upload.part_span(number)
            at = offset + done - start
            n = min(len(data) - done, length - at)
            with upload.lock:
                buffer = upload.assembly.setdefault(number, bytearray(length))
                buffer[at:at + n] = data[done:done + n]
                upload.covered[number] = upload.covered.get(number, 0) + n
                full = upload.covered[number] >= length
                if full:
                    del upload.assembly[number]
            if full:
                future = self._submit(self._put_part, upload, number, bytes(buffer))
                with upload.lock:
                    upload.inflight.append(future)
            done += n

    def close(self, fh: FileHandle, *, sync: bool) -> None:
        opened = self._open.pop(fh)
        if not isinstance(opened, _Upload):
            return
        if not sync:
            self._abandon(opened)
            return
        errors = [f.exception() for f in _wait(opened)]
        first_error = next((e for e in errors if e is not None), None)
        if first_error is not None:
            self._abandon(opened)
            raise first_error
        try:
            self._flush(opened)
            if opened.upload_id is not None:
                self._complete(opened)
        except BaseException:
            self._abandon(opened)
            raise

    def _flush(self, upload: _Upload) -> None:
        """Upload what the writes left: partly written parts (zeros in the gaps) and parts
        never written (zeros, as a preallocated file reads)."""
        if upload.upload_id is None:
            missing = [] if upload.inflight else [1]
        else:
            missing = [n for n in range(1, upload.nparts + 1) if n not in upload.etags]
        pending = []
        for number in missing:
            body = bytes(upload.assembly.pop(number, bytearray(upload.part_span(number)[1])))
            pending.append(self._submit(self._put_part, upload, number, body))
        for future in pending:
            future.result()

    def _complete(self, upload: _Upload) -> None:
        where, c = upload.where, self._client
        parts = [{"PartNumber": n, "ETag": upload.etags[n]} for n in sorted(upload.etags)]
        try:
            call(self.settings, f"completing the upload of {where.url}", lambda: c.complete_multipart_upload(
                Bucket=where.bucket, Key=where.key, UploadId=upload.upload_id,
                MultipartUpload={"Parts": parts}))
        except Exception as exc:  # noqa: BLE001 - a retried Complete may find its own result
            if code(exc) != "NoSuchUpload":
                raise failed(f"completing the upload of {where.url}", exc) from exc
            stored = self._head(where)
            if stored is None or stored[0] != upload.nbytes:
                raise failed(f"completing the upload of {where.url}", exc) from exc

    def _abandon(self, upload: _Upload) -> None:
        """Wait for parts in flight, then abort the upload (never raises: a failed save's
        cleanup also aborts uploads it finds)."""
        _wait(upload)
        if upload.upload_id is None or timeouts.hopeless(self.settings.endpoint()):
            return  # an endpoint in an outage: the next save's cleanup aborts it
        where, c = upload.where, self._client
        try:
            self._call(f"aborting the upload of {where.url}", lambda: c.abort_multipart_upload(
                Bucket=where.bucket, Key=where.key, UploadId=upload.upload_id))
        except StorageIOError:  # NoSuchUpload, or left for the next save's cleanup to abort
            pass

    # -------------------------------------------------------------------------------- reads

    def open_read(self, path: str, *, cached: bool = False) -> FileHandle:  # no page cache
        where = S3Path.parse(path)
        stored = s3objects.take(self.settings.endpoint(), where.url) or self._head(where)
        if stored is None:
            raise StorageIOError(f"cannot open {path} for reading: no such object")
        return self._open.add(path, _Object(where, *stored))

    def submit_read(self, fh: FileHandle, offset: int, into: memoryview) -> Future[int]:
        try:
            opened, into = self._open.reading(fh, _Object, offset, into)
        except StorageIOError as exc:
            return completed(error=exc)
        n = len(into)
        if n == 0:
            return completed(0)
        step = self.settings.read_bytes
        if not step or n <= step:
            return self._submit_get(self._get, opened, offset, into)
        return all_of([self._submit_get(self._get, opened, offset + at,
                                         into[at:min(n, at + step)])
                        for at in range(0, n, step)])

    def _get(self, opened: _Object, offset: int, into: memoryview) -> int:
        """Fill ``into`` from ``offset``; a body cut short resumes where it stopped."""
        got = 0
        where = opened.where
        what = f"reading bytes {offset}-{offset + len(into) - 1} of {where.url}"
        while got < len(into):
            first = offset + got

            def request() -> int:
                answer = self._client.get_object(
                    Bucket=where.bucket, Key=where.key, IfMatch=opened.etag,
                    Range=f"bytes={first}-{offset + len(into) - 1}")
                try:
                    s3objects.check_answer(answer, where.url, opened.size, opened.etag)
                except StorageIOError:
                    answer["Body"].close()
                    raise
                return read_body(answer["Body"], into[got:])

            n = self._call(what, request, pinned=where.url)
            if n == 0:
                raise StorageIOError(f"{what} failed: the store sent no bytes at {first} "
                                     f"though the object has {opened.size}")
            got += n
        return got

    def _head(self, where: S3Path) -> tuple[int, str] | None:
        """(size, ETag) of an object, or None if there is none."""
        c = self._client
        try:
            answer = call(self.settings, f"looking up {where.url}",
                          lambda: c.head_object(Bucket=where.bucket, Key=where.key))
        except Exception as exc:  # noqa: BLE001 - 404 is an answer; the rest is re-raised mapped
            if status(exc) == 404:
                return None
            raise failed(f"looking up {where.url}", exc) from exc
        return int(answer["ContentLength"]), str(answer["ETag"])

    def _call(self, what: str, request: Any, *, pinned: str | None = None) -> Any:
        """call() with every failure as StorageIOError naming ``what``; ``pinned``: the object
        a GET is pinned to (If-Match), whose 412 or 416 says it changed (s3objects.refusal)."""
        try:
            return call(self.settings, what, request)
        except Exception as exc:  # noqa: BLE001 - mapped, with the cause chained
            refused = None if pinned is None else s3objects.refusal(status(exc), what, pinned)
            raise (refused or failed(what, exc)) from exc

    def register_buffers(self, view: memoryview, *, part_bytes: int = 0) -> bool:
        """No fixed buffers here: every request maps its own."""
        return False

    def shutdown(self) -> None:
        with self._lock:
            pools, self._pool, self._readers = (self._pool, self._readers), None, None
        for pool in pools:
            if pool is not None:
                pool.shutdown(wait=True)


def _wait(upload: _Upload) -> list[Future[int]]:
    with upload.lock:
        futures = list(upload.inflight)
    for future in futures:
        future.exception()
    return futures
