"""Checking a load's bytes against the manifest's checksums, as read.py's loop hands them over.

A span (read.py) is either a whole stored entry, whose bytes may arrive over several reads and
are hashed in order against the entry's checksum (and against its block checksums: always under
xxh3_64_tree, whose whole checksum is made of them; under xxh3_64 with ``check_blocks``, as
verify asks), or whole checksum blocks of an entry within one read, each checked against
its block checksum. Every mismatch is a CorruptCheckpointError naming the key, the file and the
byte range.

Owns: the hashing and comparing. Does not own: which bytes are read or where they go (read.py),
the hash functions (format/checksum.py). Safe to call from several threads at once for distinct
spans (read.py checks reads on the I/O threads that made them).
"""

from __future__ import annotations

from typing import Protocol

from ckptio.errors import CorruptCheckpointError
from ckptio.format.checksum import TREE, BlockHasher, Hasher, crc32_by, new_hasher
from ckptio.format.types import TensorEntry
from ckptio.storage.files import StoreFiles

__all__ = ["Checker", "Span"]


class Span(Protocol):
    """Bytes [offset, offset + nbytes) of ``entry`` (file offsets) that one check covers."""

    entry: TensorEntry
    offset: int
    nbytes: int

    @property
    def end(self) -> int: ...


class Checker:
    """The checksums of spans as their bytes arrive, against the manifest's."""

    def __init__(self, source: StoreFiles, algorithm: str | None, block_nbytes: int,
                 check_blocks: bool) -> None:
        self.source, self.algorithm = source, algorithm
        self.block_nbytes, self.check_blocks = block_nbytes, check_blocks
        self.progress: dict[int, Hasher | BlockHasher] = {}  # id(whole span) -> its hash so far

    def path(self, entry: TensorEntry) -> str:
        return self.source.where(entry.file)

    @property
    def on_io_threads(self) -> bool:
        """Whether a read whose spans check alone is checked on the I/O thread that read it:
        always, except the CRC-32 records of DCP and torch.save files when ``crc32`` is zlib's.
        zlib's, several times slower than xxh3, kept that thread from its next read and made a
        2-rank cold DCP load slower than with the checks on the loop (docs/BENCH_INTEROP.md,
        "DCP directories on 2 ranks"); ISA-L's, releasing the GIL, is no slower on the I/O
        threads than on the loop (docs/BENCH_INTEROP.md, "CRC-32 by ISA-L")."""
        return self.algorithm != "crc32" or crc32_by() != "zlib"

    def whole(self, span: Span, view: memoryview, last: bool) -> None:
        """The next bytes of a whole-entry span; at its last, its checksum (and with
        ``check_blocks`` its block checksums) must match."""
        if self.algorithm is None:
            return
        hasher = self.progress.get(id(span))
        if hasher is None:
            hasher = self.progress[id(span)] = self._start(span.entry, self.algorithm)
        hasher.update(view)
        if not last:
            return
        del self.progress[id(span)]
        entry = span.entry
        if isinstance(hasher, BlockHasher):
            digest, blocks = hasher.digests()
            self._compare(entry, entry.offset, entry.nbytes, entry.checksum, digest)
            if entry.blocks:  # an index file read as an entry lists none
                self._compare_blocks(entry, blocks)
        else:
            self._compare(entry, entry.offset, entry.nbytes, entry.checksum, hasher.hexdigest())

    def _start(self, entry: TensorEntry, algorithm: str) -> Hasher | BlockHasher:
        """Under TREE the block checksums are the whole one's input: always computed (once)."""
        if (self.check_blocks and entry.blocks) or algorithm == TREE:
            return BlockHasher(algorithm, self.block_nbytes)
        return new_hasher(algorithm)

    def blocks(self, span: Span, view: memoryview) -> None:
        """A block span's bytes against its entry's block checksums (its whole checksum when
        the entry is one block: the span is then the whole entry)."""
        if self.algorithm is None:
            return
        entry = span.entry
        if not entry.blocks:
            expected = [(entry.offset, entry.nbytes, entry.checksum)]
        else:
            first = (span.offset - entry.offset) // self.block_nbytes
            count = -(-span.nbytes // self.block_nbytes)
            expected = [(entry.offset + i * self.block_nbytes,
                         min(self.block_nbytes, entry.nbytes - i * self.block_nbytes),
                         entry.blocks[i]) for i in range(first, first + count)]
        for offset, n, checksum in expected:
            hasher = new_hasher(self.algorithm)
            hasher.update(view[offset - span.offset:offset - span.offset + n])
            self._compare(entry, offset, n, checksum, hasher.hexdigest())

    def _compare(self, entry: TensorEntry, offset: int, nbytes: int, stored: str,
                 read: str) -> None:
        if read != stored:
            raise CorruptCheckpointError(
                f"checksum mismatch for key {entry.key!r} in {self.path(entry)} bytes [{offset}, "
                f"{offset + nbytes}): stored {stored}, read {read}. The data file is corrupt; "
                "load an earlier checkpoint (a load that stops here may have filled part of "
                "its destination tensors)")

    def _compare_blocks(self, entry: TensorEntry, digests: tuple[str, ...]) -> None:
        """The entry's block checksums (what a load of part of it checks) against its bytes,
        whose whole checksum has already matched."""
        if digests == entry.blocks:
            return
        i = next((i for i, pair in enumerate(zip(entry.blocks, digests)) if pair[0] != pair[1]),
                 min(len(digests), len(entry.blocks)))
        stored = entry.blocks[i] if i < len(entry.blocks) else "none"
        read = digests[i] if i < len(digests) else "none"
        raise CorruptCheckpointError(
            f"block checksum {i} of key {entry.key!r} in {self.path(entry)} (bytes from "
            f"{entry.offset + i * self.block_nbytes}) disagrees with its bytes: stored {stored}, "
            f"read {read}, though the entry's whole checksum matches. The manifest is damaged (a "
            "load of part of this tensor would fail); load an earlier checkpoint")
