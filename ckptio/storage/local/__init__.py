"""Local (and mounted) directories in one place: paths, ``file://`` and ``shm://`` locations.

Its registry entry (storage/select.py) names the parts, each importing the ones below it:

    local_urls.py   the directory a file:// or shm:// location names
    durable.py      a file written and fsynced, or a directory fsynced, by path
    mapped.py       tmpfs (shm://) files mapped and cached for reuse
    slots.py        a memory tier's slots: dropped steps' files (or files made ahead) reused
    dirlock.py      the lock that lets one save at a time commit into one directory
    local_claim.py  a save's claim: that lock and the manifest seen under it (the conditional
                    commit)
    runlease.py     one live job per run directory: a manager's lease on its root
    local_store.py  LocalStore, the Store of one checkpoint directory (storage/store_contract.py;
                    its bytes move through io/'s POSIX or io_uring backends)
    local_root.py   LocalRoot, a CheckpointManager's steps in a directory (storage/steproot.py)

Internal: nothing here is public API (the public surface is ``ckptio`` itself).

Owns: everything particular to a local file system. Does not own: the contracts it implements,
the I/O backends (io/).
"""

from __future__ import annotations

__all__ = ["dirlock", "durable", "local_claim", "local_root", "local_store", "local_urls",
           "mapped", "runlease", "slots"]
