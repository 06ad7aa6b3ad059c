"""Load data path: read coalesced aligned ranges into the pool, verify, scatter into tensors.

Owns: keeping reads in flight ahead of the copying, per-entry checksum verification (an entry
that fits one read is verified before a byte of it reaches its destination; a larger one is
verified when its last byte arrives; with ``block_nbytes``, as verify asks, each entry's block
checksums too), truncation checks. Does not own: which entries are wanted or where they go
(api.py), nor coalescing (layout.py).
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass


from ckptio.format.checksum import BlockHasher, Hasher, new_hasher
from ckptio.errors import CorruptCheckpointError
from ckptio.io import FileHandle, IOBackend
from ckptio.planning.layout import coalesce_reads
from ckptio.io.stage import Buffer, BufferPool, copy_in, torch_dtype, typed
from ckptio.format.types import DTYPE_ITEMSIZE, ReadRange, Target, TensorEntry

MAX_GAP = 512 << 10  # read through gaps up to this size rather than issue another request


@dataclass
class _Progress:
    """An entry being read: its checksum so far (entries may span several reads), and its
    block checksums so far when those are checked too."""

    hasher: Hasher | None
    blocks: BlockHasher | None = None


class _Reader:
    def __init__(self, directory: str, backend: IOBackend, algorithm: str | None,
                 block_nbytes: int | None = None) -> None:
        self.directory, self.backend, self.algorithm = directory, backend, algorithm
        self.block_nbytes = block_nbytes
        self.handles: dict[str, FileHandle] = {}
        self.progress: dict[int, _Progress] = {}

    def handle(self, name: str) -> FileHandle:
        if name not in self.handles:
            self.handles[name] = self.backend.open_read(os.path.join(self.directory, name))
        return self.handles[name]

    def close(self) -> None:
        for fh in self.handles.values():
            self.backend.close(fh, sync=False)
        self.handles.clear()

    def consume(self, rng: ReadRange, buffer: Buffer, got: int, dests: dict[int, Target]) -> None:
        if got < rng.nbytes:
            raise CorruptCheckpointError(
                f"data file {os.path.join(self.directory, rng.file)} is truncated: wanted bytes "
                f"[{rng.offset}, {rng.offset + rng.nbytes}), file ends at {rng.offset + got}; "
                "the checkpoint is damaged: load an earlier one"
            )
        for entry in rng.entries:
            self._piece(entry, rng, buffer, dests[id(entry)])

    def _start(self, entry: TensorEntry) -> _Progress:
        if self.algorithm is None:
            return _Progress(None)
        blocks = (BlockHasher(self.algorithm, self.block_nbytes)
                  if self.block_nbytes is not None and entry.blocks else None)
        return _Progress(new_hasher(self.algorithm), blocks)

    def _piece(self, entry: TensorEntry, rng: ReadRange, buffer: Buffer, target: Target) -> None:
        progress = self.progress.get(id(entry))
        if progress is None:
            progress = self.progress[id(entry)] = self._start(entry)
        lo = max(entry.offset, rng.offset)
        hi = min(entry.offset + entry.nbytes, rng.offset + rng.nbytes)
        start = lo - rng.offset
        last = hi == entry.offset + entry.nbytes
        if progress.hasher is not None:
            progress.hasher.update(buffer.view[start:start + hi - lo])
            if progress.blocks is not None:
                progress.blocks.update(buffer.view[start:start + hi - lo])
            if last:  # checked before the copy: a whole-in-one-read entry never lands corrupt
                self.verify(entry, progress.hasher.hexdigest())
                if progress.blocks is not None:
                    self.verify_blocks(entry, progress.blocks.digests()[1])
        itemsize = DTYPE_ITEMSIZE[entry.dtype]
        src = typed(buffer, start, hi - lo, torch_dtype(entry.dtype))
        for dest in target.dests:
            copy_in(src, dest, (lo - entry.offset) // itemsize, (hi - lo) // itemsize)
        if last:
            del self.progress[id(entry)]

    def verify(self, entry: TensorEntry, digest: str) -> None:
        if digest != entry.checksum:
            raise CorruptCheckpointError(
                f"checksum mismatch for key {entry.key!r} in {os.path.join(self.directory, entry.file)}"
                f" bytes [{entry.offset}, {entry.offset + entry.nbytes}): stored {entry.checksum}, "
                f"read {digest}. The data file is corrupt; load an earlier checkpoint (any "
                "destination tensors of this load may hold partial data)"
            )

    def verify_blocks(self, entry: TensorEntry, digests: tuple[str, ...]) -> None:
        """The entry's block checksums (what a load reading part of it checks) against its
        bytes, whose whole checksum has already matched."""
        if digests == entry.blocks:
            return
        i = next((i for i, pair in enumerate(zip(entry.blocks, digests)) if pair[0] != pair[1]),
                 min(len(digests), len(entry.blocks)))
        stored = entry.blocks[i] if i < len(entry.blocks) else "none"
        read = digests[i] if i < len(digests) else "none"
        raise CorruptCheckpointError(
            f"block checksum {i} of key {entry.key!r} in {os.path.join(self.directory, entry.file)}"
            f" (bytes from {entry.offset + i * (self.block_nbytes or 0)}) disagrees with its "
            f"bytes: stored {stored}, read {read}, though the entry's whole checksum matches. "
            "The manifest is damaged (a load of part of this tensor would fail); load an "
            "earlier checkpoint")


def read_targets(
    directory: str,
    targets: Sequence[Target],
    *,
    pool: BufferPool,
    backend: IOBackend,
    algorithm: str | None,
    depth: int,
    block_nbytes: int | None = None,
) -> int:
    """Fill every target's destinations; ``algorithm`` None skips verification, and with
    ``block_nbytes`` (Manifest.block_nbytes) each entry's block checksums are checked too, as
    verify does. -> bytes read."""
    reader = _Reader(directory, backend, algorithm, block_nbytes)
    by_entry = {id(t.entry): t for t in targets}
    for t in targets:
        if t.entry.nbytes == 0 and algorithm:
            reader.verify(t.entry, new_hasher(algorithm).hexdigest())
    ranges = deque(coalesce_reads((t.entry for t in targets), max_read=pool.buffer_bytes,
                                  max_gap=MAX_GAP))
    ahead = max(1, min(pool.nbuffers, 2 * depth))
    pending: deque[tuple[ReadRange, Buffer, Future[int]]] = deque()
    nbytes = 0
    try:
        while ranges or pending:
            while ranges and len(pending) < ahead:
                rng = ranges.popleft()
                fh = reader.handle(rng.file)
                buffer = pool.acquire()
                try:
                    future = backend.submit_read(fh, rng.offset, buffer.view[:rng.nbytes])
                except BaseException:
                    pool.release(buffer)
                    raise
                pending.append((rng, buffer, future))
            rng, buffer, future = pending.popleft()
            try:
                reader.consume(rng, buffer, future.result(), by_entry)
                nbytes += rng.nbytes
            finally:
                pool.release(buffer)
    finally:
        for _rng, buffer, future in pending:
            future.exception()  # the read must finish before its buffer is reused
            pool.release(buffer)
        reader.close()
    return nbytes
