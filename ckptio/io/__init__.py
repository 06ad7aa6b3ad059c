"""The io layer: I/O backends behind one small contract (backend_contract.IOBackend), chosen by
name, the staging pool (stage.py), a buffer's bytes as tensors and the copies into and out of
them (buffers.py), and the one background-worker thread class (worker.py).
Internal: the public surface is ``ckptio`` itself (ckptio/__init__.py's ``__all__``);
testing/io_conformance.py states the backend contract.

Owns: building a backend from its name (the names are options.IO_BACKENDS, re-exported here as
NAMES): "auto" is io_uring where this process can use it and POSIX otherwise; "uring" falls back
to POSIX where io_uring is unavailable (logged once per process); a backend's module is imported
only when asked for.
Layer: above format, options and errors; beside planning, which it does not import (nor planning
it). tests/test_layers.py enforces the layer order.
"""

from __future__ import annotations

import logging
import os
import resource

from ckptio.errors import CkptError
from ckptio.io.backend_contract import FileHandle, IOBackend
from ckptio.options import IO_BACKENDS as NAMES

__all__ = ["FileHandle", "IOBackend", "create", "uring_unavailable_reason", "NAMES"]

log = logging.getLogger("ckptio")
_reason: list[str | None] = []  # probed once per process
_warned: list[bool] = []  # the fallback of an explicit "uring" logged (once per process)
AUTO_MEMLOCK = 1 << 30  # "auto" takes io_uring where the pool may be pinned (see can_pin)


CAP_IPC_LOCK = 14  # capability bit: memory locking beyond RLIMIT_MEMLOCK


def can_pin() -> bool:
    """Whether io_uring may register a staging pool here: with CAP_IPC_LOCK (root outside a
    container), or under a memlock limit of AUTO_MEMLOCK or more. Elsewhere registration is
    refused and an unpinned io_uring is no faster than the POSIX pool (docs/BENCH_LIMIT.md,
    "the save's gap to the disk was page pinning")."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return soft == resource.RLIM_INFINITY or soft >= AUTO_MEMLOCK or _capable(CAP_IPC_LOCK)


def _capable(bit: int) -> bool:
    """This process holds capability ``bit`` (its effective set, /proc/self/status)."""
    try:
        with open("/proc/self/status") as f:
            line = next((ln for ln in f if ln.startswith("CapEff:")), "CapEff: 0")
    except OSError:
        return os.geteuid() == 0
    return bool(int(line.split()[1], 16) >> bit & 1)


def uring_unavailable_reason() -> str | None:
    """None if io_uring works here, else why not (probed once, then remembered)."""
    if not _reason:
        from ckptio.io.ring import unavailable_reason

        _reason.append(unavailable_reason())
    return _reason[0]


def create(name: str, *, depth: int, direct_io: str) -> IOBackend:
    """The backend called ``name``: "auto" is io_uring where it works here and may pin the
    staging pool (can_pin), else POSIX; "uring" falls back to "posix" where io_uring is
    unavailable, with a warning."""
    if name not in NAMES:
        raise CkptError(f"io_backend {name!r} is unknown; available: {', '.join(NAMES)}")
    reason = None if name == "posix" else uring_unavailable_reason()
    if (name == "uring" or (name == "auto" and can_pin())) and reason is None:
        from ckptio.io.uring import UringBackend

        return UringBackend(depth=depth, direct_io=direct_io)
    if name == "uring" and not _warned:
        _warned.append(True)
        log.warning("ckptio: io_uring is unavailable (%s); using the POSIX backend", reason)
    from ckptio.io.posix import PosixBackend

    return PosixBackend(depth=depth, direct_io=direct_io)
