"""The planning layer: pure decisions about bytes, no I/O.

One rank's save plan (plan; what kind each leaf is and its bytes: leaves), which part of a
global tensor a leaf holds (sharding; a DTensor's box on its mesh: mesh_layout), packing items
into files and coalescing a load's reads (layout), the coordinator's plan across ranks and the
manifest it builds (globalplan), and resharding reads (reshard).

Layer: above format; beside io, which it does not import (nor io it).

Internal: nothing here is public API. The public surface is ``ckptio`` itself
(ckptio/__init__.py's ``__all__``); these modules may change without notice. Each module's
``__all__`` lists what other modules may use; tests/test_layers.py enforces the layer order.
"""

__all__: list[str] = []
