"""Which Store serves a checkpoint path: an ``s3://`` prefix or a local (or mounted) directory.

Owns: turning a user's path (str, PathLike or bytes) into the checkpoint location string, the
refusal of URL schemes ckptio does not serve, and picking the Store by scheme. Torch-free, so
the ``ckptio`` command reads manifests without importing torch. Does not own: what a store
does (storage/base.py's contract) nor foreign formats (loading/foreign.py).
"""

from __future__ import annotations

import os
import re

from ckptio.errors import UnsupportedPathError
from ckptio.io.s3client import S3Settings, is_s3
from ckptio.options import Options
from ckptio.storage.base import Store
from ckptio.storage.local import LocalStore

__all__ = ["checkpoint_path", "is_checkpoint_id", "local_path", "store_for"]

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def local_path(path: str | os.PathLike[str]) -> str:
    """The checkpoint path as a local directory; a URL (``s3://...``) is refused rather than
    taken for a local folder named ``s3:``."""
    text = os.fspath(path)
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    scheme = _URL.match(text)
    if scheme:
        raise UnsupportedPathError(
            f"{text}: ckptio does not serve {scheme.group(1)}:// URLs (only s3:// and local or "
            "mounted filesystems); pass a directory path, e.g. a mounted bucket")
    return text


def checkpoint_path(path: str | os.PathLike[str]) -> str:
    """The checkpoint path as a string: an ``s3://`` URL, or a local directory (another URL
    scheme is refused rather than taken for a local folder named ``gs:``)."""
    text = os.fspath(path)
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    return text if is_s3(text) else local_path(text)


def store_for(path: str | os.PathLike[str], options: Options | None = None) -> Store:
    """The Store of checkpoint ``path``: a prefix in an S3 bucket (``s3://bucket/prefix``), or
    a local (or mounted) directory."""
    text = checkpoint_path(path)
    if is_s3(text):
        from ckptio.storage.s3 import S3Store

        return S3Store(text, S3Settings.of(options or Options.from_env()))
    return LocalStore(text)


def is_checkpoint_id(path: object) -> bool:
    """Whether ckptio serves ``path`` (a local path or an ``s3://`` URL; not another URL scheme
    nor a non-path): DCP's ``validate_checkpoint_id`` for ckptio's reader and writer."""
    try:
        checkpoint_path(path)  # type: ignore[arg-type]
    except (UnsupportedPathError, TypeError):
        return False
    return True
