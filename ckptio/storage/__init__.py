"""Where a checkpoint's bytes go, how it is committed, listed and cleaned up, and where a
CheckpointManager's steps live.

``select`` is the registry of storage schemes: one entry per scheme names its Store (the
contract: ``store_contract.Store``), the kind of I/O backend its stores make and its StepRoot (the
contract: ``steproot.StepRoot``), each scheme in its folder: local paths, file:// and shm://
the ``local/`` folder (LocalStore over io/'s O_DIRECT / io_uring backends, LocalRoot); mem://
the ``memory/`` folder; s3:// the ``s3/`` folder (client, backend, lock, store, root); gs:// and
az:// the ``gcs/`` and ``azure/`` folders, their Stores on one core (``object_tree``).
``files`` binds a store to a backend (the only way above storage/ reaches a file); ``steps``
builds a save's and load's whole-checkpoint steps from any store. Conformance suites:
ckptio/testing/store_conformance.py and steproot_conformance.py.

Layer: above planning, io and format; below distributed.

Internal: nothing here is public API. The public surface is ``ckptio`` itself
(ckptio/__init__.py's ``__all__``); these modules may change without notice. Each module's
``__all__`` lists what other modules may use; tests/test_layers.py enforces the layer order.
"""

from __future__ import annotations

from ckptio.storage.local.local_store import LocalStore
from ckptio.storage.memory.memory_store import MemoryStore
from ckptio.storage.store_contract import Exclusive, Store

__all__ = ["Exclusive", "LocalStore", "MemoryStore", "Store"]
