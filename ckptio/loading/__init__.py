"""The loading layer: one load, from a committed manifest to the caller's state.

Reading what a load wants, whole entries and resharded regions alike, in coalesced verified
reads (read), matching a manifest to the state a load produces (fill) and putting values back
into the caller's containers (merge).

Layer: above distributed; beside saving, which it does not import (nor saving it).

Internal: nothing here is public API. The public surface is ``ckptio`` itself
(ckptio/__init__.py's ``__all__``); these modules may change without notice. Each module's
``__all__`` lists what other modules may use; tests/test_layers.py enforces the layer order.
"""

__all__: list[str] = []
