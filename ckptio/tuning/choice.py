"""A measured I/O configuration (Candidate) and the best of several (best_of), as the
filesystem tuner (tune.py) and the S3 tuner (s3_tune.py) both choose.

A configuration scores the bytes of one save plus one load over their time (the harmonic mean
of write and read GB/s). Among scores within TIE of the best, the fewest threads (io_depth),
then the smallest buffer wins.

Owns: that record and that choice (pure). Does not own: measuring (tune.py, s3_tune.py,
io_cells.py) or the profile file (profile.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["TIE", "Candidate", "best_of"]

TIE = 0.03  # scores closer than this are equal on a shared VM (run-to-run drift is larger)


@dataclass(frozen=True)
class Candidate:
    engine: str  # ckptio io_backend name: "posix" | "uring" | "s3"
    mode: str  # "direct" | "buffered" | "s3"
    buffer_bytes: int
    io_depth: int
    write_gbps: float
    read_gbps: float

    @property
    def score(self) -> float:
        return 2 / (1 / self.write_gbps + 1 / self.read_gbps)


def best_of(candidates: Sequence[Candidate]) -> Candidate:
    """The highest score, ties (within TIE) broken toward fewer threads, then less memory."""
    top = max(c.score for c in candidates)
    near = [c for c in candidates if c.score >= top * (1 - TIE)]
    return min(near, key=lambda c: (c.io_depth, c.buffer_bytes, -c.score))
