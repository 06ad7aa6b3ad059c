"""The distributed layer: what ranks say to each other during a save and a load.

Process groups and their byte collectives (dist), the compact wire messages (wire), one collective
step: compute, decide on the coordinator, answer or fail on every rank (step), and the collective
steps of a save and a load: agreeing on a plan, committing the manifest, agreeing on what was
loaded (collective).

Layer: above storage, planning, io and format; below saving and loading.

Internal: nothing here is public API. The public surface is ``ckptio`` itself
(ckptio/__init__.py's ``__all__``); these modules may change without notice. Each module's
``__all__`` lists what other modules may use; tests/test_layers.py enforces the layer order.
"""

__all__: list[str] = []
