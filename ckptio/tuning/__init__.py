"""The tuning layer: measuring storage and choosing ckptio's I/O settings for it.

Per-filesystem profiles, looked up by every save and load (profile), ``ckptio tune`` (tune), the
checkpoint I/O study behind ``ckptio bench io`` (io_study, io_cells, io_report, io_plots), the
raw disk ceiling (ceiling) and GPT-shaped model state for measurements (state). Installed with
ckptio: it never imports the peer benchmarks of the repository's benchmarks/ folder (they import
it).

Layer: above saving and loading; below the drivers (api, cli, ...).

Internal: nothing here is public API. The public surface is ``ckptio`` itself
(ckptio/__init__.py's ``__all__``); these modules may change without notice. Each module's
``__all__`` lists what other modules may use; tests/test_layers.py enforces the layer order.
"""

__all__: list[str] = []
