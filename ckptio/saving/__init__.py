"""The saving layer: one save, from a flattened state to a committed checkpoint.

The save session in the order it happens (save_session), streaming items through the staging pool into
data files (persist), the eager capture handed to the caller's thread (handover), the handle an
asynchronous save returns (handle) and removing superseded files (cleanup).

Layer: above distributed; beside loading, which it does not import (nor loading it).

Internal: nothing here is public API. The public surface is ``ckptio`` itself
(ckptio/__init__.py's ``__all__``); these modules may change without notice. Each module's
``__all__`` lists what other modules may use; tests/test_layers.py enforces the layer order.
"""

__all__: list[str] = []
