"""A save's claim on a local checkpoint directory: LocalClaim, the directory's lock and the
manifest committed when it was taken, which make its commit conditional.

Call order: LocalStore.exclusive() takes the lock (dirlock.py) and records the digest of the
manifest committed then (digest_of); LocalStore.commit(), just before its rename, calls
check_unchanged() with the manifest there now; the save calls release() last. A save that does
not honour the lock (a filesystem whose locks are local to one machine, a writer that is not
ckptio) and commits in between is caught here: this save is refused, the checkpoint there kept.

Owns: the claim, the manifest's digest, the refusal and its message. Does not own: the lock
itself (dirlock.py), the commit and its rename (local_store.py).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

from ckptio.errors import CheckpointLockedError
from ckptio.storage.local import dirlock

__all__ = ["LocalClaim", "digest_of"]


@dataclass
class LocalClaim:
    """LocalStore.exclusive()'s claim: the directory lock, and the manifest seen under it."""

    lock: dirlock.DirLock
    seen: bytes | None  # digest of the manifest committed when the lock was taken; None: none

    @property
    def location(self) -> str:
        return os.path.abspath(self.lock.path)

    def release(self, *, failed: bool = False) -> None:
        dirlock.unlock(self.lock, failed=failed)

    def check_unchanged(self, now: bytes | None, location: str) -> None:
        """Refuse if another save has committed at ``location`` since the lock was taken
        (``now``: the manifest there now), which only a save that does not honour the lock can
        have done."""
        if digest_of(now) != self.seen:
            raise CheckpointLockedError(
                f"another save committed {location} while this one was writing, so the "
                f"lock {os.path.join(self.lock.path, dirlock.LOCK_NAME)} is not honoured there "
                "(a filesystem whose locks are local to one machine, e.g. NFS mounted with "
                "local_lock, or a writer that is not ckptio); this save was not committed and "
                "the checkpoint there is kept: give each job its own path, or make them save "
                "one at a time")


def digest_of(manifest: bytes | None) -> bytes | None:
    """A manifest's digest (None for none: any manifest committed later differs from it)."""
    return None if manifest is None else hashlib.blake2b(manifest, digest_size=16).digest()
