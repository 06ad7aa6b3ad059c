"""Every tunable of ckptio in one frozen dataclass, and the only reader of environment variables.

Owns: defaults, validation of option values, CKPTIO_* environment overrides, and the constants
every layer shares: the byte units (KiB, MiB, GiB), BLOCK (the O_DIRECT granularity), the I/O
backend names (IO_BACKENDS; ckptio.io builds them) and the direct_io modes (DIRECT_IO_MODES).
Does not own: what the options do (stage, io, layout and restore read them).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Literal, get_args

from ckptio.errors import CkptError

__all__ = ["BLOCK", "DIRECT_IO_MODES", "GiB", "IO_BACKENDS", "KiB", "MiB", "Options"]

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
BLOCK = 4096  # O_DIRECT granularity we use for offsets, lengths and buffer addresses
IO_BACKENDS = ("posix", "uring")  # Options.io_backend; ckptio.io.create builds each

DirectIO = Literal["auto", "on", "off"]
DIRECT_IO_MODES: tuple[str, ...] = get_args(DirectIO)
IfLocked = Literal["wait", "raise"]


@dataclass(frozen=True)
class Options:
    """How a save or load runs. Change with ``dataclasses.replace``.

    buffer_bytes: size of one staging buffer, and of one write or coalesced read.
    pool_bytes: total staging memory (buffer_bytes x number of buffers); allocated once, reused.
    io_depth: writes or reads in flight at once.
    max_file_bytes: a data file is closed and a new one begun past this size.
    direct_io: "auto" uses O_DIRECT where the filesystem accepts it, else buffered (logged once).
    verify: check every loaded byte against its checksum.
    checksum: the algorithm recorded in the manifest.
    io_backend: name of the IOBackend: "posix" (thread pool) or "uring" (io_uring; falls back
        to posix, logged once, where io_uring is unavailable).
    use_profile: let a tuned profile (``ckptio tune DIR``) of the target filesystem set
        io_backend, direct_io, buffer_bytes and io_depth where these are left at their defaults.
    if_locked: what a save does when another save (another process, job or machine sharing the
        filesystem) is saving into the same path: "wait" until it has finished (logged), or
        "raise" CheckpointLockedError at once (from wait() for an async save).
    """

    buffer_bytes: int = 16 * MiB
    pool_bytes: int = 256 * MiB
    io_depth: int = 4
    max_file_bytes: int = 16 * GiB
    direct_io: DirectIO = "auto"
    verify: bool = True
    checksum: str = "xxh3_64"
    io_backend: str = "posix"
    use_profile: bool = True
    if_locked: IfLocked = "wait"

    def __post_init__(self) -> None:
        if self.buffer_bytes < MiB or self.buffer_bytes % BLOCK:
            raise CkptError(
                f"Options.buffer_bytes={self.buffer_bytes}: must be >= 1 MiB and a multiple of "
                f"{BLOCK}; writes smaller than 1 MiB waste the disk's bandwidth"
            )
        if self.pool_bytes < 2 * self.buffer_bytes:
            raise CkptError(
                f"Options.pool_bytes={self.pool_bytes}: must hold at least two buffers of "
                f"buffer_bytes={self.buffer_bytes} so staging overlaps writing"
            )
        if self.io_depth < 1:
            raise CkptError(f"Options.io_depth={self.io_depth}: must be >= 1")
        if self.max_file_bytes < self.buffer_bytes:
            raise CkptError(
                f"Options.max_file_bytes={self.max_file_bytes}: must be >= buffer_bytes"
            )
        if self.io_backend not in IO_BACKENDS:
            raise CkptError(f"Options.io_backend={self.io_backend!r}: use "
                            + " or ".join(map(repr, IO_BACKENDS)))
        if self.direct_io not in DIRECT_IO_MODES:
            raise CkptError(f"Options.direct_io={self.direct_io!r}: use 'auto', 'on' or 'off'")
        if self.if_locked not in ("wait", "raise"):
            raise CkptError(f"Options.if_locked={self.if_locked!r}: use 'wait' (until the other "
                            "save into the path has finished) or 'raise'")

    @property
    def nbuffers(self) -> int:
        return self.pool_bytes // self.buffer_bytes

    @classmethod
    def from_env(cls, **overrides: object) -> Options:
        """Defaults, then CKPTIO_* environment variables, then explicit ``overrides``."""
        env: dict[str, object] = {}
        for field in dataclasses.fields(cls):
            raw = os.environ.get("CKPTIO_" + field.name.upper())
            if raw is None:
                continue
            env[field.name] = _parse(field.name, raw, field.type)
        env.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**env)  # type: ignore[arg-type]


def _parse(name: str, raw: str, annotation: object) -> object:
    kind = str(annotation)
    if kind == "int":
        try:
            return int(raw)
        except ValueError:
            raise CkptError(f"environment CKPTIO_{name.upper()}={raw!r}: expected an integer") from None
    if kind == "bool":
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off"):
            return False
        raise CkptError(f"environment CKPTIO_{name.upper()}={raw!r}: expected 1/0 or true/false")
    return raw
