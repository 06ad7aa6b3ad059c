"""Where a checkpoint's bytes go and how it is committed, listed and cleaned up.

The contract is ``base.Store`` (with ``base.Exclusive``); ``local.LocalStore`` (a directory:
O_DIRECT / io_uring backends), ``memory.MemoryStore`` (host memory) and ``s3.S3Store`` (a prefix
in a bucket) implement it; ``files`` binds a store to a backend (a file name in, a handle out:
the only way above storage/ reaches a file) and names its capabilities; ``select`` is the
registry of location schemes; ``steps`` builds the save's and load's whole-checkpoint steps
from any store. The conformance suite every store passes is ckptio/testing/store_conformance.py.

Layer: above planning, io and format; below distributed.

Internal: nothing here is public API. The public surface is ``ckptio`` itself
(ckptio/__init__.py's ``__all__``); these modules may change without notice. Each module's
``__all__`` lists what other modules may use; tests/test_layers.py enforces the layer order.
"""

from __future__ import annotations

from ckptio.storage.base import Exclusive, Store
from ckptio.storage.local import LocalStore
from ckptio.storage.memory import MemoryStore

__all__ = ["Exclusive", "LocalStore", "MemoryStore", "Store"]
