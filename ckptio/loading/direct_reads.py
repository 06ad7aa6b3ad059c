"""Whole entries read straight into their destinations: a memory tier's restore in one copy.

A store whose files are pages of host memory (StoreFiles.in_memory: a local directory on
tmpfs, the memory tier) is read with buffered reads, which take any address; there the staging
pool's copy is a pass over the bytes that the load can do without. A whole entry that one CPU
tensor wants, contiguous, of the entry's dtype and size, is read by the backend straight into
that tensor's bytes (the kernel's copy out of the tmpfs pages is the one copy) and hashed
there, on the I/O thread that read it. Its bytes land before their check: a mismatch raises
CorruptCheckpointError naming the key, as any load's does, and leaves the destination filled
in part, as a load that fails part-way does (a manager's restore then loads another copy).
Everything else goes through read.py's staging loop.

Call order (read.py's _read_plain, after planning spans): ``split`` -> ``read`` -> the loop
for the rest. Owns: which spans qualify, their reads, the order errors are raised in. Does not
own: the checks (checks.py), the I/O (the store's backend), the spans (read.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any, Protocol

import torch

from ckptio.errors import CorruptCheckpointError
from ckptio.format.types import DTYPE_ITEMSIZE, TensorEntry
from ckptio.io import FileHandle
from ckptio.io.stage import torch_dtype
from ckptio.loading.checks import Checker
from ckptio.storage.files import StoreFiles

__all__ = ["read", "split"]


class WholeSpan(Protocol):
    """A whole entry's span (read.py's _Span): its bytes and the tensors they go to."""

    entry: TensorEntry
    offset: int
    nbytes: int
    whole: bool
    dests: list[torch.Tensor]

    @property
    def file(self) -> str: ...

    @property
    def end(self) -> int: ...


def split(source: StoreFiles, spans: Sequence[Any]) -> tuple[list[Any], list[Any]]:
    """(the spans read straight into their destination, the rest), both in the given order."""
    if not spans or not source.in_memory():
        return [], list(spans)
    direct, rest = [], []
    for span in spans:
        (direct if _fits(span) else rest).append(span)
    return direct, rest


def _fits(span: WholeSpan) -> bool:
    if not span.whole or len(span.dests) != 1 or span.nbytes == 0 or span.entry.coded:
        return False
    dest, entry = span.dests[0], span.entry
    return (dest.device.type == "cpu" and dest.is_contiguous() and not entry.order
            and dest.dtype == torch_dtype(entry.dtype)
            and dest.numel() * DTYPE_ITEMSIZE[entry.dtype] == entry.nbytes)


def read(source: StoreFiles, spans: Sequence[WholeSpan], checker: Checker) -> int:
    """Read and check every span into its destination; the first failure, in span order, is
    raised once every read has finished. -> bytes read."""
    handles: dict[str, FileHandle] = {}
    checked: list[Future[int]] = []
    # every destination's bytes first: torch's calls release the GIL, and once reads are in
    # flight their threads' callbacks would hold each of them up
    views = [memoryview(s.dests[0].detach().reshape(-1).view(torch.uint8).numpy()) for s in spans]
    try:
        for span, view in zip(spans, views):
            if span.file not in handles:
                handles[span.file] = source.open_read(span.file, cached=True)
            done: Future[int] = Future()
            source.submit_read(handles[span.file], span.offset, view).add_done_callback(
                lambda got, span=span, view=view, done=done: _check(got, span, view, checker, done))
            checked.append(done)
    finally:
        errors = [f.exception() for f in checked]  # every read over before its file closes
        for fh in handles.values():
            source.close(fh, sync=False)
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    return sum(span.nbytes for span in spans)


def _check(got: Future[int], span: WholeSpan, view: memoryview, checker: Checker,
           done: Future[int]) -> None:
    """On the thread that completed the read: its length, then its checksum."""
    try:
        nbytes = got.result()
        if nbytes < span.nbytes:
            raise CorruptCheckpointError(
                f"data file {checker.path(span.entry)} is truncated: wanted bytes "
                f"[{span.offset}, {span.end}), file ends at {span.offset + nbytes}; the "
                "checkpoint is damaged: load an earlier one")
        checker.whole(span, view, last=True)
    except BaseException as exc:  # noqa: BLE001 - handed to read(), which raises it in order
        done.set_exception(exc)
    else:
        done.set_result(nbytes)
