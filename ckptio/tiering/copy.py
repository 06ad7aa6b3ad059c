"""Copy one committed checkpoint from a store to another, verified, committed manifest last:
what the drain does for each step it moves to a slower tier.

    nbytes = copy_checkpoint(staging, source, target, pace=throttle)

1. verify the source: every byte read back and checked against its checksums (a damaged copy
   in host memory is never propagated; loading/load_session.verify);
2. copy each file the manifest names (data and index files) through one staging buffer, the
   source's names kept, each file durable (fsync / completed upload) before the next;
3. commit the source's manifest bytes in the target (storage's atomic commit, under the
   target's claim). A failure before the commit removes the files this copy wrote
   (storage/steps.attempt), and a kill leaves the target without a manifest: incomplete, which
   restore never picks and the next copy of that step writes over (the files it names, and
   only those, are removed first, under the target's claim).

Files are copied as bytes rather than loaded and saved again: no tensors are made, host memory
stays one buffer, and the target holds exactly the bytes whose checksums were verified.

Owns: that copy. Does not own: which step to copy when (drain.py), the staging's lifetime
(ckptio/resources.py), the stores (storage/).
"""

from __future__ import annotations

from collections.abc import Callable

from ckptio.errors import CkptError, StorageIOError
from ckptio.loading import load_session
from ckptio.options import BLOCK
from ckptio.storage import steps
from ckptio.storage.store_contract import Store, new_save_id
from ckptio.storage.files import IOResources, StoreFiles

__all__ = ["Pace", "copy_checkpoint"]

Pace = Callable[[int], None]  # called with the bytes just copied; may sleep to hold a rate


def copy_checkpoint(resources: IOResources, source: Store, target: Store,
                    pace: Pace | None = None) -> int:
    """Copy the checkpoint committed in ``source`` to ``target`` (see the module docstring);
    -> bytes copied. CorruptCheckpointError if the source fails verification (nothing is
    written then)."""
    manifest = source.read_manifest()
    opened = load_session.open_checkpoint(resources, source, None, allow_pickle=False)
    load_session.verify(resources, opened)
    files = {f.name: f.nbytes for f in opened.record.files}
    for name, nbytes in files.items():
        if nbytes % BLOCK:
            raise CkptError(f"{source.path_of(name)}: {nbytes} bytes, not a multiple of {BLOCK}; "
                            "only checkpoints ckptio saved are copied between tiers")
    names = list(files)
    with steps.attempt(target, names):
        held = target.exclusive("raise")
        committed = False
        try:
            leftovers = list(target.sizes(names))  # of an interrupted copy of this step
            if leftovers and target.remove(leftovers):
                raise StorageIOError(f"{target.location}: could not remove the files an "
                                     f"interrupted copy left: {', '.join(leftovers)}")
            with resources.lock:
                _pool, reader = resources.files(source)
                pool, writer = resources.files(target)
                if pool is not _pool:  # a staging that remakes its pool per store cannot copy
                    raise CkptError("copy_checkpoint: the staging made another pool for "
                                    f"{target.location}; give it use_profile=False options")
                buffer = pool.acquire()
                try:
                    for name, nbytes in files.items():
                        _copy_file(reader, writer, name, nbytes, buffer.view, pace)
                finally:
                    pool.release(buffer)
            target.commit(manifest, new_save_id(), held)
            committed = True
        finally:
            held.release(failed=not committed)
    return sum(files.values())


def _copy_file(reader: StoreFiles, writer: StoreFiles, name: str, nbytes: int,
               view: memoryview, pace: Pace | None) -> None:
    src = reader.open_read(name)
    try:
        dst = writer.open_write(name, nbytes)
        closing = False
        try:
            offset = 0
            while offset < nbytes:
                piece = view[:min(len(view), nbytes - offset)]
                got = reader.submit_read(src, offset, piece).result()
                if got != len(piece):
                    raise StorageIOError(f"{reader.where(name)} ends at byte {offset + got}, "
                                         f"before the {nbytes} bytes its manifest names")
                writer.submit_write(dst, offset, piece).result()
                offset += len(piece)
                if pace is not None:
                    pace(len(piece))
            closing = True
            writer.close(dst, sync=True)
        finally:
            if not closing:
                writer.close(dst, sync=False)
    finally:
        reader.close(src, sync=False)
