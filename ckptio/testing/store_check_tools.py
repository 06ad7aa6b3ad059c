"""The tools the Store checks share, and the data file helpers tests use: a data file name
as a save makes it, writing and reading a data file through the store's own backend, distinct
manifest-like bytes committed under a tag, and the rule that no message advises deleting.

Data files go through the store's own backend by name (storage/files.StoreFiles: the store
turns a name into what its backend opens), with page-aligned buffers and BLOCK-multiple sizes,
so an O_DIRECT backend passes too.

Call order: a check makes its store with the suite's ``make(key)``, writes with ``write_file``,
commits with ``commit_tagged``, reads back with ``read_file`` or the store's own reads.

Owns: these helpers and the options their backend is made with. Does not own: the checks
(store_checks_commit.py, store_checks_files.py), the suite's entry points
(store_conformance.py), the stores (ckptio/storage/).
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from ckptio.alignment import BLOCK, is_aligned
from ckptio.io.stage import StagingPool
from ckptio.options import MiB, Options
from ckptio.storage.files import StoreFiles
from ckptio.storage.store_contract import Store, new_save_id

Factory = Callable[[str], Store]
Refuser = Callable[[Store, str], AbstractContextManager[Any]]
TIMEOUT = 60.0  # seconds a claim or request may take before a check gives up (a hang)
OPTIONS = Options(buffer_bytes=MiB, pool_bytes=2 * MiB)

__all__ = [
    "OPTIONS", "TIMEOUT", "Factory", "Refuser", "assert_no_deletion_advice", "commit_tagged",
    "data_name", "manifest_bytes", "random_bytes", "read_file", "write_file",
]


def random_bytes(nbytes: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(nbytes)


def data_name(index: int = 0, save_id: str | None = None) -> str:
    """A data file name as a ckptio save makes it (layout.data_file_name)."""
    return f"data-{save_id or new_save_id()}-r00000-{index:04d}.bin"


def write_file(store: Store, name: str, data: bytes) -> None:
    """Write ``data`` (a multiple of BLOCK bytes) as file ``name`` through the store's backend."""
    if not is_aligned(len(data)):
        raise ValueError(f"write_file needs a multiple of {BLOCK} bytes, got {len(data)}")
    files = StoreFiles(store, store.backend(OPTIONS))
    pool = StagingPool(1, max(MiB, len(data)))
    try:
        fh = files.open_write(name, len(data))
        try:
            if data:
                buf = pool.acquire()
                buf.view[:len(data)] = data
                done = files.submit_write(fh, 0, buf.view[:len(data)]).result(TIMEOUT)
                assert done == len(data), f"a write of {len(data)} bytes reported {done}"
                pool.release(buf)
        finally:
            files.close(fh, sync=True)
    finally:
        files.backend.shutdown()


def read_file(store: Store, name: str, nbytes: int) -> bytes:
    """Up to ``nbytes`` (a multiple of BLOCK) of file ``name``, through the store's backend."""
    files = StoreFiles(store, store.backend(OPTIONS))
    pool = StagingPool(1, max(MiB, nbytes))
    try:
        fh = files.open_read(name)
        try:
            buf = pool.acquire()
            got = files.submit_read(fh, 0, buf.view[:nbytes]).result(TIMEOUT)
            data = bytes(buf.view[:got])
            pool.release(buf)
            return data
        finally:
            files.close(fh, sync=False)
    finally:
        files.backend.shutdown()


def manifest_bytes(tag: str, nbytes: int) -> bytes:
    """Distinct manifest-like bytes: every byte depends on ``tag``, so a mix is detectable."""
    fill = random_bytes(nbytes, zlib.crc32(tag.encode())).hex().encode()[:nbytes]
    return f'{{"tag": "{tag}", "fill": "'.encode() + fill + b'"}'


def commit_tagged(store: Store, tag: str, nbytes: int = 256) -> bytes:
    manifest = manifest_bytes(tag, nbytes)
    store.commit(manifest, new_save_id())
    return manifest


def assert_no_deletion_advice(error: BaseException) -> None:
    text = str(error).lower()
    for word in ("delete", "rm -", "remove it", "remove the"):
        assert word not in text, f"a message must never advise deleting: {error}"
