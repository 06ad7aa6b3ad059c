"""A lost rank's step, received from its peers in a same-world recovery (rebuild.py), installed
into its memory tier: checked in memory as its chunks land (``StreamCheck``), then either
written before the load (``now``) or offered to the load from this process's memory while it
is written in the background (``later``).

- ``now``: written into ``r<rank>/.rebuild-step-N`` (where it was received in place,
  peers.landing_buffer, its manifest alone), verified there where its manifest needs more than
  the in-memory check (compressed or delta entries, bases: Checkpointer.verify), then moved to
  ``step-N`` (one rename): a delta step's bases and every step but the one loaded next;
- ``later``: the bytes received are adopted (no copy) as a checkpoint of this process's memory
  (``mem://``) that the load reads as they are (checked already), and once the load is done
  (``Landing.start``, the Guard's ``start_writes``) a thread installs them as ``now`` does;
  ``Landing.settle`` joins it (the Guard calls it before anything else reads or writes the
  tier: the next restore, save, wait or close) and raises its error, once.

A scratch directory that a kill left (a restore killed before its install: on tmpfs its data
file holds the step's pages) is removed at the next manager's start: each rank's own
(``drop_scratch``), and, by the first rank of each host, those of rank numbers the job no
longer has (``drop_scratch_beyond``: a restart on fewer ranks), unless a live process holds
that rank directory's run lease (storage/local/runlease.py). Only that exact name goes.

Owns: the fused check, the install, the background write, the removal of what a kill left.
Does not own: the transfers and the plan (rebuild.py, stripes.py), which entries a stream's
checksums cover (peers.py), the load (managing/agreed.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from ckptio.alignment import merged
from ckptio.errors import CheckpointLockedError, CkptError, CorruptCheckpointError, StorageIOError
from ckptio.format import checksum
from ckptio.format import manifest as manifest_format
from ckptio.storage.local import runlease
from ckptio.storage.memory.memory_store import MemoryStore
from ckptio.storage.select import scheme_of
from ckptio.storage.store_contract import TreeStore, new_save_id
from ckptio.redundancy import marks, peers

__all__ = ["Landing", "StreamCheck", "drop_scratch", "drop_scratch_beyond", "now"]

log = logging.getLogger("ckptio")


class StreamCheck:
    """A received step's entries checked against their checksums, fused with the receive:
    each entry hashed as its bytes land (``landed``, in any order; each entry's bytes hashed
    once, in order, as far as they are there), so the check ends with the last chunk. ``checked()``: whether every entry
    was checked (False where the manifest needs a full verify: peers.stream_entries);
    CorruptCheckpointError naming an entry that differs."""

    def __init__(self, manifest: bytes, files: list[tuple[str, int]], data: torch.Tensor,
                 where: str) -> None:
        self.where, self.data = where, data
        self.entries = peers.stream_entries(manifest, files, where)
        record = manifest_format.decode(manifest, where)
        self.algorithm, self.block_nbytes = record.checksum_algorithm, record.block_nbytes
        self.done = [0] * len(self.entries or [])  # bytes of each entry hashed so far
        self.hashers: dict[int, checksum.BlockHasher] = {}
        self.ranges: list[tuple[int, int]] = []
        self.error: CorruptCheckpointError | None = None
        self.bad: tuple[int, int] | None = None  # the stream's range of the entry that differs

    def landed(self, lo: int, hi: int) -> None:
        """Bytes [lo, hi) of the stream are in ``data``: hash what that completes."""
        if self.entries is None or hi <= lo:
            return
        self.ranges = merged(sorted([*self.ranges, (lo, hi)]))
        view = self.data.numpy().data.cast("B")
        for n, (at, entry) in enumerate(self.entries):
            start = at + self.done[n]
            if self.done[n] == entry.nbytes or not self._has(start):
                continue
            end = min(at + entry.nbytes, self._end(start))
            if end > start:
                hasher = self.hashers.setdefault(
                    n, checksum.BlockHasher(self.algorithm, self.block_nbytes))
                hasher.update(view[start:end])
                self.done[n] = end - at
                if self.done[n] == entry.nbytes:
                    got = self.hashers.pop(n).digests()[0]
                    if got != entry.checksum and self.error is None:
                        self.error = peers.stream_damage(self.where, entry, got)
                        self.bad = (at, at + entry.nbytes)

    def _has(self, point: int) -> bool:
        return any(a <= point < b for a, b in self.ranges)

    def _end(self, point: int) -> int:
        return next((b for a, b in self.ranges if a <= point < b), point)

    def checked(self) -> bool:
        """Every entry hashed and matched -> True; False: the manifest needs a full verify;
        CorruptCheckpointError: an entry differs (or never landed whole)."""
        if self.entries is None:
            return False
        if self.error is not None:
            raise self.error
        short = next((e for n, (_a, e) in enumerate(self.entries)
                      if self.done[n] != e.nbytes), None)
        if short is not None:
            raise peers.stream_damage(self.where, short, "(not all of it received)")
        return True


def now(final: TreeStore, scratch: TreeStore, manifest: bytes, files: list[tuple[str, int]],
        data: torch.Tensor, checked: bool, verify: Callable[[str], Any],
        placed: bool = False) -> None:
    """Write the step (checked in memory, or verified once written) and move it in place.
    ``placed``: ``data`` is ``scratch``'s file already (peers.landing_buffer): its manifest
    alone is written."""
    try:
        peers.write_checkpoint(scratch, manifest, files, data, placed=placed)
        if not checked:
            verify(scratch.location)
        scratch.move_to(final)
    finally:
        scratch.remove_tree()


class Landing:
    """A checked step offered to the load from memory (``location``), then written into the
    memory tier by a thread (``start``, after the load; module docstring)."""

    def __init__(self, step: int, final: TreeStore, scratch: TreeStore, manifest: bytes,
                 files: list[tuple[str, int]], data: torch.Tensor, placed: bool = False) -> None:
        self.step = step
        self.memory = MemoryStore(f"mem://ckptio-landing/step-{step}-{new_save_id()}")
        self.memory.prepare()
        view = data.numpy().data.cast("B") if data.numel() else memoryview(bytearray())
        at = 0
        for name, nbytes in files:
            self.memory.adopt_file(name, view[at:at + nbytes])
            at += nbytes
        self.memory.commit(manifest, new_save_id())
        self.location = self.memory.location
        self._args = (final, scratch, manifest, files, data)
        self._placed = placed
        self._pool: ThreadPoolExecutor | None = None
        self._write: Future[None] | None = None
        self._settled = False

    def start(self) -> None:
        """Start the write (once): after the load, so that the two do not share the cores."""
        if self._pool is None and not self._settled:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"ckptio-landing-{self.step}")
            self._write = self._pool.submit(now, *self._args, True, lambda _where: None,
                                            self._placed)

    def settle(self) -> None:
        """Wait for the write (started here if it was not); drop the in-memory copy; raise the
        write's error (once)."""
        self.start()
        write, self._write, self._settled = self._write, None, True
        if write is None:
            return
        assert self._pool is not None  # internal: started with its write
        error = write.exception()  # waits; its error is kept by the future, raised here once
        self._pool.shutdown()
        self.memory.remove_tree()
        if error is not None:
            raise StorageIOError(
                f"step {self.step}, restored from peers and loaded, could not be written into "
                f"this rank's memory tier ({type(error).__name__}: {error}): that tier lacks "
                "it until the next save; free space there (or check the tier's directory) and "
                "save again") from error


def drop_scratch(root: marks.Root, rank: int) -> list[str]:
    """The scratch directories of ``rank`` under ``root`` (``r<rank>/.rebuild-step-N``,
    marks.rebuild_dirs: no other name) removed, each logged -> their locations. The Guard's
    start: no restore of ``rank`` runs yet, and its manager holds the lease of ``r<rank>``."""
    return _drop(marks.tree_of(root).child(marks.rank_name(rank)), rank)


def drop_scratch_beyond(root: marks.Root, world: int) -> list[str]:
    """The scratch directories (as ``drop_scratch``'s) of every rank ``>= world`` under
    ``root``, a local directory (a job restarted on fewer ranks no longer has those ranks, so
    no rank of it removes them as its own) -> their locations. Called by one rank per host.
    A rank directory is touched only while this process holds its run lease (taken and let go
    here, never created): one whose lease a live process holds (a job of more ranks on this
    root, a lingering process of the old job), or whose lease cannot be taken, is left, logged;
    a root that is not a local directory (no lease can tell) is left whole."""
    if not isinstance(root, str) or scheme_of(root) is not None:
        return []
    removed: list[str] = []
    for rank, location in sorted(marks.rank_dirs(root).items()):
        if rank < world:
            continue
        where = marks.tree_of(location)
        if not marks.rebuild_dirs(where):
            continue
        lease = _lease(location, world)
        if lease is None:
            continue
        try:
            removed += _drop(where, rank)
        finally:
            lease.release()
    return removed


def _lease(directory: str, world: int) -> runlease.RunLease | None:
    """``directory``'s run lease, held by this process (its flock), or None: another process
    holds it, or the lease cannot tell (no file locks, read-only, full), logged; or the
    directory is gone."""
    try:
        lease = runlease.take(directory, False, create=False)
    except CheckpointLockedError:
        why = (f"a live process holds its run lease ({runlease.LEASE_NAME} there names it), so "
               "a job of more ranks may be restoring there")
    except StorageIOError as exc:
        why = f"its run lease cannot be taken ({exc})"
    else:
        if lease is None or lease.fd is not None:
            return lease  # gone meanwhile (nothing to remove), or held here
        why = ("its run lease cannot tell whether a live process uses it (no file locks, a "
               "read-only or full directory, or a manager of this process holds it)")
    log.warning("ckptio: the scratch directories of restores in %s (a rank this job of %d ranks "
                "does not have) are left: %s; remove them once no job uses that directory",
                directory, world, why)
    return None


def _drop(directory: TreeStore, rank: int) -> list[str]:
    """The ``.rebuild-step-N`` directories under ``directory`` (``r<rank>``) removed, each
    logged -> their locations."""
    removed: list[str] = []
    for where in marks.rebuild_dirs(directory).values():
        try:
            nbytes = sum(where.sizes(where.entries()).values())
        except CkptError:
            nbytes = 0  # unreadable: remove_tree names why, if it cannot either
        problems = where.remove_tree()
        if problems:
            log.warning("ckptio: %s, left by a restore that was killed, cannot be removed: %s",
                        where.location, problems[0])
            continue
        removed.append(where.location)
        log.warning("ckptio: removed %s (%d bytes): the scratch directory of a restore of rank "
                    "%d killed before its step was installed", where.location, nbytes, rank)
    return removed
