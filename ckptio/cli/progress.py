"""Progress bars of the ``ckptio`` command: tqdm on stderr, only when stderr is a terminal.

Owns: whether a bar is shown (``--no-progress``, a non-tty stderr: never), its byte counts,
and the hooks long commands report through: ``Bar.update`` (bytes done, per tensor or batch:
``progress=bar.update`` where a function takes a progress callback), ``Bar.set_total`` (when
the total is learnt late) and ``follow`` (an async save's bytes until it is done). Does not own:
what is counted (the commands and the functions they call).
"""

from __future__ import annotations

import sys
import time
from types import TracebackType
from typing import Any, Protocol, TypeVar

__all__ = ["Bar", "follow"]

R_co = TypeVar("R_co", covariant=True)
_POLL_S = 0.1


class Bar:
    """Bytes done out of ``total``; a no-op unless enabled and stderr is a terminal."""

    def __init__(self, total: int, desc: str, enabled: bool) -> None:
        self._bar: Any = None
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            # drawn at every update (callers report per batch or per tensor, not per byte: a
            # few hundred draws at most), so a short command shows its bar move too
            self._bar = tqdm(total=total, desc=desc, unit="B", unit_scale=True,
                             unit_divisor=1024, file=sys.stderr, leave=False, mininterval=0,
                             miniters=1)

    @property
    def shown(self) -> bool:
        return self._bar is not None

    def update(self, nbytes: int) -> None:
        if self._bar is not None:
            self._bar.update(nbytes)

    def set_total(self, nbytes: int) -> None:
        """The total, once known (a bar made with total 0 before the work was sized)."""
        if self._bar is not None:
            self._bar.total = nbytes
            self._bar.refresh()

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


class _Written(Protocol):
    nbytes_total: int
    nbytes_written: int


class _Saving(Protocol[R_co]):
    def progress(self) -> _Written: ...

    def done(self) -> bool: ...

    def wait(self) -> R_co: ...


def follow(handle: _Saving[R_co], desc: str, enabled: bool) -> R_co:
    """``handle.wait()`` (an async save's SaveHandle), drawing its bytes written meanwhile, to
    the end: ``result = follow(ckptio.async_save(state, dst), "convert", progress)``."""
    with Bar(handle.progress().nbytes_total, desc, enabled) as bar:
        while bar.shown and not handle.done():
            bar.to(handle.progress().nbytes_written)
            time.sleep(_POLL_S)
        result = handle.wait()
        bar.to(handle.progress().nbytes_written)
    return result
