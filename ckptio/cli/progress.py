"""Progress bars of the ``ckptio`` command: tqdm on stderr, only when stderr is a terminal.

Owns: whether a bar is shown (``--no-progress``, a non-tty stderr: never) and its byte counts.
Does not own: what is counted (the commands call ``update`` with bytes done).
"""

from __future__ import annotations

import sys
from types import TracebackType
from typing import Any

__all__ = ["Bar"]


class Bar:
    """Bytes done out of ``total``; a no-op unless enabled and stderr is a terminal."""

    def __init__(self, total: int, desc: str, enabled: bool) -> None:
        self._bar: Any = None
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, unit="B", unit_scale=True,
                             unit_divisor=1024, file=sys.stderr, leave=False)

    @property
    def shown(self) -> bool:
        return self._bar is not None

    def update(self, nbytes: int) -> None:
        if self._bar is not None:
            self._bar.update(nbytes)

    def to(self, nbytes: int) -> None:
        """Set the bytes done (for counters that only grow)."""
        if self._bar is not None:
            self._bar.update(nbytes - self._bar.n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Bar:  # noqa: PYI034 - typing.Self needs Python 3.11
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
