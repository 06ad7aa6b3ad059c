"""The format layer: what a checkpoint is, on disk and in memory, with no I/O.

The shared vocabulary (types: items, chunks, entries, the Manifest record, MAX_TREE_DEPTH), the
manifest's bytes (manifest: encode, decode), the checks on what a manifest claims (validate, with
tiling and geometry for chunk coverage), inline values (values), checksums (checksum), state
trees flattened to leaves and back (flatten), and pausing the garbage collector (gcpause).

Layer: above ckptio.errors and ckptio.options; imports nothing else of ckptio.

Internal: nothing here is public API. The public surface is ``ckptio`` itself
(ckptio/__init__.py's ``__all__``); these modules may change without notice. Each module's
``__all__`` lists what other modules may use; tests/test_layers.py enforces the layer order.
"""

__all__: list[str] = []
