"""A backend wrapper for tests that counts which file each write goes to (then does the write).

Used where a test must show a save wrote through the backend or did not (the memory tier's
mapped saves write no ``data-*`` file through it: tests/test_mapped_save.py,
tests/test_memory_tier_owner.py).
"""

from __future__ import annotations

import os
from typing import Any


class WriteCounting:
    """A backend that records the file of every write (then does it)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.written: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def submit_write(self, fh: Any, offset: int, data: memoryview) -> Any:
        self.written.append(os.path.basename(fh.path))
        return self.inner.submit_write(fh, offset, data)
