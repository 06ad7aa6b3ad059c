"""Counting the bytes a process reads from storage through ckptio: every read a load submits
reaches a store through StoreFiles (storage/files.py), so wrapping its two submit methods counts
them all, whatever the store (a directory's O_DIRECT reads, S3's ranged GETs).

    count = count_store_reads()     # once per process, before the loads to count
    before = count(); ckptio.load(...); read = count() - before
    manifests = count_manifest_reads(); manifests.clear(); ckptio.load(...); manifests.total()

``count_manifest_reads`` counts the committed manifests read from local directories
(LocalStore.read_manifest), by directory.

Owns: the wrap and the counter. Does not own: the reads. Test and benchmark support only: it
replaces methods on the class for the rest of the process.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

from ckptio.storage.files import StoreFiles
from ckptio.storage.local.local_store import LocalStore

__all__ = ["count_manifest_reads", "count_store_reads"]

_counted = [0]
_wrapped = [False]
_manifests: Counter[str] = Counter()
_manifests_wrapped = [False]


def count_store_reads() -> Callable[[], int]:
    """Wrap StoreFiles' submits (once per process) -> a function giving the bytes submitted
    since the wrap."""
    if not _wrapped[0]:
        _wrapped[0] = True
        single, batch = StoreFiles.submit_read, StoreFiles.submit_reads

        def submit_read(self: StoreFiles, fh: Any, offset: int, into: memoryview) -> Any:
            _counted[0] += len(into)
            return single(self, fh, offset, into)

        def submit_reads(self: StoreFiles, fh: Any, reads: Any, each: Any) -> Any:
            _counted[0] += sum(len(into) for _offset, into in reads)
            return batch(self, fh, reads, each)

        StoreFiles.submit_read = submit_read  # type: ignore[method-assign]
        StoreFiles.submit_reads = submit_reads  # type: ignore[method-assign]
    return lambda: _counted[0]


def count_manifest_reads() -> Counter[str]:
    """Wrap LocalStore.read_manifest (once per process) -> the Counter of committed manifests
    read since the wrap, by directory; ``clear()`` it to count from now on."""
    if not _manifests_wrapped[0]:
        _manifests_wrapped[0] = True
        read_manifest = LocalStore.read_manifest

        def counted(self: LocalStore) -> bytes:
            _manifests[self.location] += 1
            return read_manifest(self)

        LocalStore.read_manifest = counted  # type: ignore[method-assign]
    return _manifests
