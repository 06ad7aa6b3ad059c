"""The bits of HTTP/1.1 and S3 that testing/s3proxy.py needs to tell requests apart.

Owns: reading heads, lines and bodies (Content-Length, ``Transfer-Encoding: chunked``, or until
the connection ends) off a socket as the bytes that were sent, so they can be forwarded verbatim;
the Request record; naming a path-style request's S3 operation; the bytes a Range header asks for.
Does not own: forwarding, rules or faults (testing/s3proxy.py). Stdlib only; test support.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from urllib.parse import parse_qsl, unquote, urlsplit

__all__ = ["Request", "Stream", "operation", "parse_head", "parse_request", "range_nbytes"]

MAX_HEAD = 64 * 1024
PIECE = 256 * 1024


@dataclass
class Request:
    """One request as the proxy saw it (also what ``on_request`` callbacks get)."""

    method: str
    target: str
    bucket: str
    key: str
    query: dict[str, str]
    headers: dict[str, str]  # lower-case names
    op: str
    range: str | None = None
    status: int | None = None  # the answer's status (the proxy's own for ``fail``), None: none

    @property
    def part_number(self) -> int | None:
        value = self.query.get("partNumber", "")
        return int(value) if value.isdigit() else None

    @property
    def upload_id(self) -> str | None:
        return self.query.get("uploadId")


def operation(method: str, bucket: str, key: str, query: Mapping[str, str],
              headers: Mapping[str, str]) -> str:
    """The S3 operation name of a path-style request ("PutObject", "UploadPart", ...)."""
    if not bucket:
        return "ListBuckets" if method == "GET" else f"{method}Service"
    if not key:
        by_query = {"GET": [("uploads", "ListMultipartUploads"), ("versions", "ListObjectVersions"),
                            ("location", "GetBucketLocation")],
                    "POST": [("delete", "DeleteObjects")]}
        for name, op in by_query.get(method, []):
            if name in query:
                return op
        if method == "GET":
            return "ListObjectsV2" if query.get("list-type") == "2" else "ListObjects"
        return {"HEAD": "HeadBucket", "PUT": "CreateBucket", "DELETE": "DeleteBucket"}.get(
            method, f"{method}Bucket")
    copy = "x-amz-copy-source" in headers
    if method == "PUT":
        if "partNumber" in query and "uploadId" in query:
            return "UploadPartCopy" if copy else "UploadPart"
        if "tagging" in query:
            return "PutObjectTagging"
        return "CopyObject" if copy else "PutObject"
    if method == "POST":
        if "uploads" in query:
            return "CreateMultipartUpload"
        return "CompleteMultipartUpload" if "uploadId" in query else "PostObject"
    if method == "DELETE":
        return "AbortMultipartUpload" if "uploadId" in query else "DeleteObject"
    if method == "GET":
        return "ListParts" if "uploadId" in query else "GetObject"
    return "HeadObject" if method == "HEAD" else f"{method}Object"


def range_nbytes(value: str) -> int | None:
    """Bytes a ``Range: bytes=...`` header asks for; None when open-ended (``bytes=100-``)."""
    unit, _, spec = value.strip().partition("=")
    if unit.strip() != "bytes":
        raise ValueError(f"unsupported Range {value!r}")
    total = 0
    for part in spec.split(","):
        first, _, last = part.strip().partition("-")
        if not first:
            total += int(last)
        elif not last:
            return None
        else:
            total += int(last) - int(first) + 1
    return total


class Stream:
    """Buffered reads of heads, lines and counted pieces from a socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()

    def _fill(self) -> bool:
        data = self.sock.recv(PIECE)
        self.buf += data
        return bool(data)

    def _upto(self, mark: bytes, limit: int) -> bytes | None:
        while (i := self.buf.find(mark)) < 0:
            if len(self.buf) > limit:
                raise ValueError(f"no {mark!r} within {limit} bytes")
            if not self._fill():
                if not self.buf:
                    return None
                raise ConnectionError("connection closed mid-line")
        out = bytes(self.buf[:i + len(mark)])
        del self.buf[:i + len(mark)]
        return out

    def head(self) -> bytes | None:
        """The next head (through its blank line), or None at a clean end of the connection."""
        return self._upto(b"\r\n\r\n", MAX_HEAD)

    def line(self) -> bytes:
        line = self._upto(b"\r\n", 8192)
        if line is None:
            raise ConnectionError("connection closed mid-body")
        return line

    def take(self, n: int) -> Iterator[bytes]:
        while n > 0:
            if not self.buf and not self._fill():
                raise ConnectionError(f"connection closed with {n} body bytes to come")
            piece = bytes(self.buf[:n])
            del self.buf[:len(piece)]
            n -= len(piece)
            yield piece

    def rest(self) -> Iterator[bytes]:
        while self.buf or self._fill():
            piece = bytes(self.buf)
            self.buf.clear()
            yield piece

    def body(self, headers: Mapping[str, str], length: str | None) -> Iterator[bytes]:
        """The body's bytes as sent; ``length`` None: read until the connection ends."""
        if "chunked" in headers.get("transfer-encoding", "").lower():
            while True:
                line = self.line()
                yield line
                size = int(line.split(b";")[0].strip(), 16)
                if size == 0:
                    while (trailer := self.line()) != b"\r\n":
                        yield trailer
                    yield trailer
                    return
                yield from self.take(size + 2)
        elif length is not None:
            yield from self.take(int(length))
        else:
            yield from self.rest()


def parse_head(head: bytes) -> tuple[list[str], dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if line:
            name, sep, value = line.partition(":")
            if not sep:
                raise ValueError(f"bad header line {line!r}")
            headers[name.strip().lower()] = value.strip()
    return lines[0].split(" ", 2), headers


def parse_request(head: bytes) -> Request:
    """A path-style request head: ``/bucket/key?query``."""
    (method, target, _), headers = parse_head(head)
    url = urlsplit(target)
    bucket, _, key = unquote(url.path).lstrip("/").partition("/")
    query = dict(parse_qsl(url.query, keep_blank_values=True))
    return Request(method, target, bucket, key, query, headers,
                   operation(method, bucket, key, query, headers), headers.get("range"))
