"""A GET's body read into the caller's buffer, straight from the socket where it can be.

botocore hands a GET's body out as a urllib3 response over http.client. urllib3's own
``readinto`` reads into a new bytes object and copies it; ``read_body`` reads the socket
through http.client's ``readinto`` into the caller's buffer instead (why:
docs/BENCH_S3.md), and falls back to the body's own ``readinto`` for any other shape
(content-encoded, another urllib3), which ``socket_reader`` tells apart.

Call order: backend.py's ranged GET (S3Backend's read) -> ``read_body`` once per answer; a
body cut short returns what arrived and the backend asks for the rest.

Owns: reading one body and giving its connection back (or closing it). Does not own: the
request, its retries and what its answer means (backend.py, client.py, objects.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["read_body", "socket_reader"]


def read_body(body: Any, into: memoryview) -> int:
    """Read a GET's body into ``into``; the bytes read (fewer if the body ended early).

    The bytes go from the socket straight into ``into`` (http.client's readinto) when botocore's
    body is the plain urllib3 response over http.client that it is today: urllib3 2.x's own
    readinto reads into a new bytes object and copies it, one extra copy of every byte and one
    temporary the size of the read per GET in flight, outside the staging pool
    (docs/BENCH_S3.md). Any other body (content-encoded, another urllib3) is read through its
    own readinto. A connection cut before the first byte raises ConnectionResetError (retried);
    one cut later returns the bytes that arrived (the caller asks for the rest)."""
    reader = socket_reader(body)
    if reader is None:
        return _read_through(body, into)
    try:
        got = _fill(reader.readinto, into)
    except BaseException:
        body.close()
        raise
    if got == len(into):
        body._raw_stream.release_conn()  # fully read: the connection goes back to the pool
        return got
    body.close()
    if got == 0:
        raise ConnectionResetError("the connection closed before the body's first byte")
    return got


def socket_reader(body: Any) -> Any:
    """The http.client response under botocore's body, or None where that is not the shape."""
    raw = getattr(body, "_raw_stream", None)
    fp = getattr(raw, "_fp", None)
    headers = getattr(raw, "headers", None)
    if fp is None or not hasattr(fp, "readinto") or not hasattr(raw, "release_conn"):
        return None
    if headers is None or headers.get("content-encoding"):
        return None  # urllib3 would decode it; the raw bytes are not the object's
    return fp


def _read_through(body: Any, into: memoryview) -> int:
    try:
        return _fill(body.readinto, into)
    finally:
        body.close()


def _fill(readinto: Callable[[memoryview], int], into: memoryview) -> int:
    """Read into ``into`` until it is full or the source ends; -> the bytes read."""
    got = 0
    while got < len(into):
        n = readinto(into[got:])
        if not n:
            break
        got += n
    return got
