"""I/O backends behind one small contract (base.IOBackend), chosen by name.

Owns: the registry of backend names; a backend's module is imported only when asked for.
"""

from __future__ import annotations

from ..errors import CkptError
from .base import FileHandle, IOBackend

__all__ = ["FileHandle", "IOBackend", "create"]


def create(name: str, *, depth: int, direct_io: str) -> IOBackend:
    if name == "posix":
        from .posix import PosixBackend

        return PosixBackend(depth=depth, direct_io=direct_io)
    raise CkptError(f"io_backend {name!r} is unknown; available: 'posix'")
