"""The local directory a ``file://`` or ``shm://`` location names.

A ``file://`` URL names an absolute path (``file:///dir/ckpt``, or ``file://localhost/...``).
A ``shm://NAME`` location is the directory NAME under the shared-memory root: a tmpfs whose
files are host memory and outlive the process (``$CKPTIO_SHM_DIR``, else a folder of
/dev/shm). A name that is empty, absolute or climbs out of the root is refused.

Call order: storage/select.py's registry entries for ``file`` and ``shm`` hand these
functions in as their ``local``; select.py's checkpoint_path() and local_path() call them, and
the location is then served as that path (LocalStore, LocalRoot).

Owns: those two path forms, where the shared-memory root is and the way back from a
directory under it to its ``shm://NAME`` (shm_url, for messages). Does not own: the registry
and plain paths (storage/select.py), what is stored there (local_store.py, mapped.py).
"""

from __future__ import annotations

import os

from ckptio.errors import UnsupportedPathError

__all__ = ["SHM_ROOT", "file_path", "shm_path", "shm_root", "shm_url"]

SHM_ROOT = "/dev/shm/ckptio"  # tmpfs: host memory, kept after the process exits


def file_path(text: str) -> str:
    rest = text[len("file://"):]
    if rest.startswith("localhost/"):
        rest = rest[len("localhost"):]
    if not rest.startswith("/"):
        raise UnsupportedPathError(f"{text}: a file:// URL names an absolute path "
                                   "(file:///dir/ckpt); pass the path itself")
    return rest


def shm_root() -> str:
    """Where ``shm://`` locations live: ``$CKPTIO_SHM_DIR``, else /dev/shm/ckptio (a tmpfs on
    Linux: its files are host memory, they outlive the process and go with a reboot)."""
    return os.environ.get("CKPTIO_SHM_DIR") or SHM_ROOT


def shm_path(text: str) -> str:
    """The local directory of ``shm://NAME[/step-N]``: NAME under shm_root(). A name that is
    empty, absolute or climbs out (``..``) is refused."""
    rest = text[len("shm://"):].strip("/")
    parts = rest.split("/")
    if not rest or any(p in ("", ".", "..") for p in parts):
        raise UnsupportedPathError(f"{text}: a shm:// location is shm://NAME (e.g. "
                                   "shm://run-7), a relative name under the shared-memory "
                                   f"root {shm_root()} without '.' or '..' parts")
    root = shm_root()
    if not os.path.isdir(os.path.dirname(root.rstrip("/")) or "/"):
        raise UnsupportedPathError(f"{text}: the shared-memory root {root} cannot be made (its "
                                   "parent is not a directory; no /dev/shm here?): set "
                                   "CKPTIO_SHM_DIR to a directory on a tmpfs")
    return os.path.join(root, *parts)


def shm_url(directory: str) -> str:
    """``directory`` as a user names it in messages: ``shm://NAME[/...]`` for a directory
    under the shared-memory root (what shm_path() made of it), else ``directory`` itself."""
    root, path = os.path.abspath(shm_root()), os.path.abspath(directory)
    if path == root or os.path.commonpath([root, path]) != root:
        return directory
    return "shm://" + os.path.relpath(path, root).replace(os.sep, "/")
