"""The Python code blocks of a Markdown page, and which of them a page marks as not run here
(``<!-- not run: why -->`` on the line before the block): shared by tests/test_docs_blocks.py
and tests/test_docs_guides.py."""

from __future__ import annotations

import re
from pathlib import Path

BLOCK = re.compile(r"^(?:<!-- not run: (?P<why>.+?) -->\n)?```python\n(?P<code>.*?)^```",
                   re.S | re.M)
NOT_RUN = "mark a block that cannot run here with <!-- not run: why --> on the line before it"


def marked_blocks(page: Path) -> list[tuple[str, str | None]]:
    """(code, why it is not run, or None) for each Python block of ``page``, in order."""
    return [(m["code"], m["why"]) for m in BLOCK.finditer(page.read_text())]
