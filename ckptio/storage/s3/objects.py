"""What is known of an S3 object being read (its size and ETag), and each GET's answer checked
against it.

A load's store has just looked its data objects up (S3Store.sizes), to refuse a missing or
truncated file before reading. It hands what it saw of ckptio's own data files (names unique to
one save, never rewritten in place) here (``remember``), and the backend's ``open_read`` takes
it (``take``) instead of sending a HEAD of its own (docs/BENCH_S3.md). It is used as that HEAD
would be: every GET is pinned to the ETag (If-Match), so an object replaced since fails the
read (412) instead of mixing two versions. Every GET's answer is checked (``check_answer``):
the size its Content-Range gives must be the size taken, its ETag the one pinned; a GET refused
because the object changed (412), is shorter (416) or is gone (404) fails naming the object
and the fix (``refusal``). An entry is taken once, for the same endpoint only, within SEEN_TTL_S; at most
SEEN_MAX are kept, the oldest dropped.

Owns: the hand-off between a store's look-ups and a backend's opens, the checks of a GET's
answer. Does not own: the requests (backend.py, client.py), when a store looks objects up
(store.py).
"""

from __future__ import annotations

import re
import threading
import time
from collections import OrderedDict
from typing import Any

from ckptio.errors import StorageIOError
from ckptio.storage.object_common import deleted_while_read

__all__ = ["SEEN_MAX", "SEEN_TTL_S", "check_answer", "refusal", "remember", "take"]

SEEN_TTL_S = 60.0  # an entry older than this is not taken (the open sends its own HEAD)
SEEN_MAX = 4096
_CONTENT_RANGE = re.compile(r"bytes \d+-\d+/(\d+)")
_seen: OrderedDict[tuple[str, str], tuple[int, str, float]] = OrderedDict()
_lock = threading.Lock()


def remember(endpoint: str, url: str, size: int, etag: str) -> None:
    """Record that object ``url`` at ``endpoint`` was just seen with ``size`` and ``etag``."""
    with _lock:
        _seen.pop((endpoint, url), None)
        _seen[endpoint, url] = (size, etag, time.monotonic())
        while len(_seen) > SEEN_MAX:
            _seen.popitem(last=False)


def take(endpoint: str, url: str) -> tuple[int, str] | None:
    """(size, ETag) of ``url`` as a store saw it within SEEN_TTL_S, forgotten here; or None."""
    with _lock:
        entry = _seen.pop((endpoint, url), None)
    if entry is None or time.monotonic() - entry[2] > SEEN_TTL_S:
        return None
    return entry[0], entry[1]


def check_answer(answer: dict[str, Any], url: str, size: int, etag: str) -> None:
    """StorageIOError unless a ranged GET's ``answer`` is of the object opened: the size in its
    Content-Range and its ETag (where the store sends them) are ``size`` and ``etag``."""
    found = _CONTENT_RANGE.fullmatch(str(answer.get("ContentRange") or ""))
    if found is not None and int(found.group(1)) != size:
        raise StorageIOError(
            f"reading {url} failed: the store says the object is {found.group(1)} bytes, but it "
            f"was {size} when opened (another writer replaced it, or the checkpoint is damaged): "
            "load it again, or load an earlier checkpoint")
    got = answer.get("ETag")
    if got is not None and etag and str(got) != etag:
        raise StorageIOError(
            f"reading {url} failed: the object's ETag is {got}, not {etag} as when it was opened "
            "(another writer replaced it while it was read): load it again")


def refusal(status: int | None, what: str, url: str) -> StorageIOError | None:
    """The error for a GET the store refused because the object is not as opened, or None."""
    if status == 412:
        return StorageIOError(
            f"{what} failed: {url} changed since it was opened (412: its ETag is no longer the "
            "one read so far; another writer replaced it): load it again, or load an earlier "
            "checkpoint")
    if status == 404:
        return deleted_while_read(what, url)
    if status == 416:
        return StorageIOError(
            f"{what} failed: {url} is shorter than when it was opened (416: the range asked is "
            "past its end; the object was truncated or replaced): the checkpoint is damaged: "
            "load an earlier one")
    return None
