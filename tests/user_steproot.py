"""A user's own StepRoot, written against the protocol only (ckptio/storage/steproot.py), for
the tests that register a scheme of their own (tests/test_registry.py, tests/test_rt_leftovers4.py)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any


class Nothing(str):
    """A user root's nothing_here() answer for a root that holds nothing yet (``empty``)."""

    empty = True


class DirRoot:
    """A user's StepRoot, written against the protocol only (no ckptio internals): ``step-N``
    directories under the scheme's directory; a dropped step renamed out of the listing, then
    removed by the removal the manager runs."""

    def __init__(self, location: str, base: Path) -> None:
        self.location = location.rstrip("/")
        self.dir = base / self.location.split("://", 1)[1]
        self.hidden: list[int] = []

    def path(self, step: int) -> str:
        return f"{self.location}/step-{step}"

    def _steps(self) -> list[int]:
        if not self.dir.is_dir():
            return []
        return sorted(int(p.name[5:]) for p in self.dir.iterdir()
                      if p.is_dir() and p.name.startswith("step-") and p.name[5:].isdigit())

    def is_committed(self, step: int) -> bool:
        return (self.dir / f"step-{step}" / "manifest.json").is_file()

    def scan(self) -> dict[str, list[int]]:
        steps = self._steps()
        return {"committed": [s for s in steps if self.is_committed(s)],
                "incomplete": [s for s in steps if not self.is_committed(s)]}

    def hide(self, step: int) -> bool:
        try:
            os.rename(self.dir / f"step-{step}", self.dir / f".gone-{step}")
        except OSError:
            return False
        self.hidden.append(step)
        return True

    def removal(self, step: int | None = None) -> Any:
        gone = [p for p in self.dir.glob(".gone-*")] if step is None else []
        return (lambda: [shutil.rmtree(p) for p in gone]) if gone else None

    def nothing_here(self) -> str:
        return Nothing(f"no checkpoint to restore in {self.location}")
