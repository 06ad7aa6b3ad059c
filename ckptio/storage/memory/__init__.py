"""This process's host memory in one place: ``mem://`` locations.

Its registry entry (storage/select.py) names the parts, each importing the ones below it:

    host_memory.py   HOST, this process's memory files, locations and claims
    memory_store.py  MemoryStore, the Store of one checkpoint in memory, and the IOBackend that
                     reaches its files (storage/store_contract.py, io/backend_contract.py)
    memory_root.py   MemoryRoot, a CheckpointManager's steps in memory (storage/steproot.py)

Internal: nothing here is public API (the public surface is ``ckptio`` itself).

Owns: everything particular to mem://. Does not own: the contracts it implements, shm://
(a local directory on tmpfs: storage/local/).
"""

from __future__ import annotations

__all__ = ["host_memory", "memory_root", "memory_store"]
