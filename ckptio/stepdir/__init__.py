"""Where a CheckpointManager keeps its steps: a StepRoot (base.py) for a local directory
(local.py), an S3 prefix (s3.py) or a host-memory location (memory.py), chosen by root_for().

Layer: the drivers' (with manager.py, which is its only user).

Internal: nothing here is public API. The public surface is ``ckptio`` itself
(ckptio/__init__.py's ``__all__``: CheckpointManager); these modules may change without notice.

Owns: choosing the root for a location. Does not own: the roots' operations (local.py,
memory.py, s3.py), which steps to keep or restore (manager.py).
"""

from __future__ import annotations

import os

from ckptio.errors import UnsupportedPathError
from ckptio.io.s3client import S3Settings
from ckptio.options import Options
from ckptio.stepdir.base import Listing, Removal, StepRoot, is_empty, step_of
from ckptio.stepdir.local import LocalRoot
from ckptio.stepdir.memory import MemoryRoot
from ckptio.stepdir.s3 import S3Root
from ckptio.storage.select import checkpoint_path, scheme_of

__all__ = ["Listing", "LocalRoot", "MemoryRoot", "Removal", "S3Root", "StepRoot", "is_empty",
           "root_for", "step_of"]


def root_for(location: str | os.PathLike[str], options: Options) -> StepRoot:
    """The StepRoot of ``location``: a local directory (or ``file://`` URL, or ``shm://NAME``:
    a directory on the shared-memory tmpfs), an ``s3://bucket/prefix`` URL or a ``mem://...``
    location. Another scheme, even one a store is
    registered for (storage/select.py), is refused with UnsupportedPathError: steps need a
    root that lists and hides them, which a Store does not."""
    text = checkpoint_path(location)
    scheme = scheme_of(text)
    if scheme is None:
        return LocalRoot(text)
    if scheme == "s3":
        return S3Root(text, S3Settings.of(options))
    if scheme == "mem":
        return MemoryRoot(text)
    raise UnsupportedPathError(
        f"{text}: a CheckpointManager keeps its steps in a local directory, an s3:// prefix or "
        f"a mem:// location, not under {scheme}:// (ckptio.save and ckptio.load serve it, but "
        "steps need a root that lists and hides them): save each step with ckptio.save, or "
        "keep the steps in a directory")
