"""What a path that a conversion or an export would write already holds.

``held_at(path)``: a ckptio, DCP, torch_checkpointing or Hugging Face checkpoint, a file, a
local run of steps (RUN: a CheckpointManager's ``step-N`` directories), or nothing; convert.py
and export.py refuse or replace by it. Owns: that classification and its wording. Does not
own: opening any of those formats (loading/opening.py and the loaders it dispatches to) or
what a conversion does with the answer.
"""

from __future__ import annotations

import os

from ckptio.loading import foreign_common, safetensors_manifest, tcdir
from ckptio.storage import steps
from ckptio.storage.s3.s3path import is_s3
from ckptio.storage.select import checkpoint_path, store_for
from ckptio.storage.steproot import step_of

__all__ = ["RUN", "held_at"]

RUN = "a run of steps (a CheckpointManager's step-N directories)"  # held_at()


def held_at(path: str) -> str | None:
    """What checkpoint ``path`` already holds ("a ckptio checkpoint", "a DCP checkpoint", "a
    Hugging Face folder", "a file", a local run of steps: RUN), or None."""
    text = checkpoint_path(path)
    if not is_s3(text) and os.path.isfile(text):
        return "a file"
    if not is_s3(text) and os.path.isdir(text) and any(
            step_of(name) is not None and os.path.isdir(os.path.join(text, name))
            for name in os.listdir(text)):
        return RUN
    store = store_for(text)
    for holds, what in ((steps.is_committed, "a ckptio checkpoint"),
                        (foreign_common.holds_dcp, "a DCP checkpoint"),
                        (tcdir.holds_tc, "a torch_checkpointing checkpoint"),
                        (safetensors_manifest.holds_hf, "a Hugging Face folder")):
        if holds(store):
            return what
    return None
