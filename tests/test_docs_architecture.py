"""docs/ARCHITECTURE.md's file paths and the names it gives beside them exist in the tree.

The page traces five paths through the package file by file (`ckptio/managing/guard.py`:
`Guard`). A module split, moved or renamed without the page following it leaves a newcomer
opening a file that is not there; this check finds each such reference. Historical mentions
of files that are gone on purpose are listed in GONE, each with the sentence that says so.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "ARCHITECTURE.md"
# a path, optionally followed by ": `name`" (the function or class the page points at)
REFERENCE = re.compile(r"`?((?:ckptio/)?[a-z_]+/[a-z_/]*\.py)`?\)?:? ?\(?(?:`([A-Za-z_][\w.]*)`)?")
GONE = {"tiering/manager.py": "the second manager (tiering/manager.py, with tiering/restore.py) "
                              "is gone",
        "tiering/restore.py": "the second manager (tiering/manager.py, with tiering/restore.py) "
                              "is gone"}


def _resolve(path: str) -> Path | None:
    for candidate in (ROOT / path, ROOT / "ckptio" / path):
        if candidate.is_file():
            return candidate
    hits = sorted((ROOT / "ckptio").glob(f"**/{path}"))
    return hits[0] if len(hits) == 1 else None


def _references(text: str) -> list[tuple[str, str | None]]:
    return [(m.group(1), m.group(2)) for m in REFERENCE.finditer(text)]


def test_every_file_the_page_names_exists() -> None:
    text = PAGE.read_text()
    missing = sorted({path for path, _ in _references(text)
                      if _resolve(path) is None and path not in GONE})
    assert not missing, f"docs/ARCHITECTURE.md names files that do not exist: {missing}"
    flat = " ".join(text.split())
    for path, sentence in GONE.items():
        assert sentence in flat, f"{path} is listed as gone, but the page no longer says so"


def test_every_name_beside_a_file_is_in_that_file() -> None:
    absent = []
    for path, name in _references(PAGE.read_text()):
        where = _resolve(path)
        if where is None or name is None:
            continue
        word = name.split(".")[-1]
        if not re.search(rf"\b{re.escape(word)}\b", where.read_text()):
            absent.append(f"{path}: {name}")
    assert not absent, f"docs/ARCHITECTURE.md points at names its files lack: {absent}"


def test_the_check_sees_the_page() -> None:
    refs = _references(PAGE.read_text())
    assert len({p for p, _ in refs}) >= 60, "the pattern no longer matches the page's paths"
    assert sum(name is not None for _, name in refs) >= 30
    assert _resolve("nothing/here.py") is None
