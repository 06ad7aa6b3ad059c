"""Where a CheckpointManager keeps its steps: a StepRoot (base.py) for a local directory
(local.py) or an S3 prefix (s3.py), chosen by root_for().

Layer: the drivers' (with manager.py, which is its only user).

Internal: nothing here is public API. The public surface is ``ckptio`` itself
(ckptio/__init__.py's ``__all__``: CheckpointManager); these modules may change without notice.

Owns: choosing the root for a location. Does not own: the roots' operations (local.py, s3.py),
which steps to keep or restore (manager.py).
"""

from __future__ import annotations

import os

from ckptio.io.s3client import S3Settings, is_s3
from ckptio.options import Options
from ckptio.stepdir.base import Listing, Removal, StepRoot, step_of
from ckptio.stepdir.local import LocalRoot
from ckptio.stepdir.s3 import S3Root
from ckptio.storage.select import checkpoint_path

__all__ = ["Listing", "LocalRoot", "Removal", "S3Root", "StepRoot", "root_for", "step_of"]


def root_for(location: str | os.PathLike[str], options: Options) -> StepRoot:
    """The StepRoot of ``location``: an ``s3://bucket/prefix`` URL or a local directory
    (another URL scheme is refused with UnsupportedPathError)."""
    text = checkpoint_path(location)
    if is_s3(text):
        return S3Root(text, S3Settings.of(options))
    return LocalRoot(text)
