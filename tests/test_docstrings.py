"""ckptio's docstrings and comments, checked from its source (ast and tokenize only: nothing of
ckptio is imported).

Two rules (issue 44):

- A module docstring states role, call order and ownership: at most ``MAX_MODULE_LINES`` lines.
  Behaviour specifications live on the functions they govern or in docs/ (docs/BEHAVIOUR.md).
- No measured figure in a docstring or comment: no time (``0.78 s``, ``12 ms``), rate
  (``1.9 GB/s``), percentage (``87 %``), speed-up (``1.3x``) or benchmark round (``round six``),
  and no "measured here/slower/..." claim. A pointer to the page holding the figure is the way to
  cite it: ``docs/BENCH_TIERS.md`` or ``(docs/PROBES.md, "Compression")``.

Constants are not figures: sizes (``64 MiB``), defaults and bounds (``every 0.1 s``,
``timeout 10 s``, ``at least 1.1x``), and plain numbers (``nice 10``, ``O_DIRECT 4096``). A line
that still reads like a figure but is not one is listed in ``NOT_FIGURES`` with its reason.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "ckptio"
MAX_MODULE_LINES = 25

# Files (or folders) exempt while a rewrite is under way (none today): each named one must exist.
PENDING: frozenset[str] = frozenset()
PENDING_DIRS: tuple[str, ...] = ()

_NUM = r"(?<![\w.\-/])[~≈]?\d+(?:[.,]\d+)?(?:\s*[-–]\s*\d+(?:\.\d+)?)?"
# A constant's number follows one of these words: a default, a bound, a period, a multiplier.
_CONSTANT_BEFORE = (
    r"(?:every|timeout|timeout_s|interval|default|defaults\s+to|after|cap|floor|at\s+most|"
    r"at\s+least|up\s+to|within|=|>=|<=|>|<|x|×|\*)\s*$"
)
FIGURES: dict[str, re.Pattern[str]] = {
    "time": re.compile(
        _NUM + r"\s*(?:s|ms|us|µs|ns|sec|secs|seconds?|milliseconds?|microseconds?|"
        r"nanoseconds?|mins?|minutes?|h|hours?)(?![\w])",
        re.IGNORECASE,
    ),
    "rate": re.compile(
        _NUM + r"\s*(?:[kKMGT]i?)?(?:B|bytes?|b)?\s*(?:/\s*s|per\s+second|a\s+second)\b"
    ),
    "percentage": re.compile(_NUM + r"\s*(?:%|percent\b)"),
    "speed-up": re.compile(
        _NUM + r"(?:x|×)(?![\w])|\b\d+(?:\.\d+)?\s+times\s+(?:faster|slower)\b"
    ),
    "round": re.compile(
        r"\bround\s+(?:one|two|three|four|five|six|seven|eight|nine|ten|eleven|twelve|\d+)\b",
        re.IGNORECASE,
    ),
    "measured": re.compile(
        r"\bmeasured\s*(?::|\)|$)|\bmeasured\s+(?:here|at|slower|faster|no\s+(?:slower|faster)|"
        r"the\s+same|better|worse|\d)|\b(?:took|costs?|ran\s+at|spent)\s+[~≈]?\d",
        re.IGNORECASE,
    ),
}
# (file, text on the line, reason): lines whose number reads like a figure and is not one.
NOT_FIGURES: tuple[tuple[str, str, str], ...] = (
    ("ckptio/demo/model.py", "cosine decay to 10%", "the demo schedule's parameter"),
    ("ckptio/storage/local/dirlock.py", "x 10 ms", "the lock's poll pause, a constant"),
    (
        "ckptio/distributed/storegroup.py",
        "under 20k/s",
        "the bound the poll floor sets on purpose, not a measurement",
    ),
    (
        "ckptio/distributed/storegroup.py",
        "one per 0.2 s each",
        "the poll floor's arithmetic (ranks / polls per second), a bound not a measurement",
    ),
    (
        "ckptio/distributed/storegroup.py",
        "at most ~6 % of its wait late",
        "the bound doubling pauses guarantee, arithmetic not a measurement",
    ),
)


def _files() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _pending(rel: str) -> bool:
    return rel in PENDING or rel.startswith(PENDING_DIRS)


def _texts(source: str) -> Iterator[tuple[int, str]]:
    """Every docstring line and every comment of a module, with its line number."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        first = node.body[0] if node.body else None
        if (
            isinstance(first, ast.Expr)
            and isinstance(first.value, ast.Constant)
            and isinstance(first.value.value, str)
        ):
            for offset, line in enumerate(first.value.value.splitlines()):
                yield first.value.lineno + offset, line
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string


def figures_in(line: str) -> list[tuple[str, str]]:
    """(kind, text) of every measured figure on one line of a docstring or comment."""
    found = []
    for kind, pattern in FIGURES.items():
        for match in pattern.finditer(line):
            before = line[: match.start()]
            if kind in ("time", "rate", "speed-up") and re.search(_CONSTANT_BEFORE, before):
                continue
            found.append((kind, match.group(0).strip()))
    return found


def find_figures(path: Path) -> list[str]:
    rel = _rel(path)
    out = []
    for lineno, line in _texts(path.read_text(encoding="utf-8")):
        if any(rel == f and text in line for f, text, _ in NOT_FIGURES):
            continue
        for kind, text in figures_in(line):
            out.append(f"{rel}:{lineno}: {kind} {text!r} in {line.strip()!r}")
    return out


def module_docstring_lines(path: Path) -> int:
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
    return len(doc.splitlines()) if doc else 0


@pytest.mark.parametrize(
    "line, expected",
    [
        ("a 2 GB save took 0.74-0.80 s against 1.0-1.2 s", {"time", "measured"}),
        ("a wait of 0.11 s returned 41 ms late", {"time"}),
        ("measured here at ~15 GB/s on one core", {"rate", "measured"}),
        ("about 0.2 s/GB", {"time"}),
        ("(87 % median in the branch's run)", {"percentage"}),
        ("made loads 13 % slower", {"percentage"}),
        ("2.4x faster at 51,704 chunks", {"speed-up"}),
        ("docs/PROBES.md measured 1.45x on bf16 weights", {"speed-up", "measured"}),
        ('docs/BENCH_LIMIT.md "Round three"', {"round"}),
        ("(docs/BENCH_S3.md, round four)", {"round"}),
        ("about 5 microseconds instead of 13", {"time"}),
        ("opening them later measured slower", {"measured"}),
        ("(+25% step time measured).", {"percentage", "measured"}),
        ("imports torch (2 s)", {"time"}),
        # constants, sizes and pointers are not figures
        ("a 64 MiB buffer; O_DIRECT 4096; nice 10", set()),
        ("waits with timeout 10 s, then every 0.1 s until done", set()),
        ("shrinks by at least 1.1x", set()),
        ("a load keeps 2 x io_depth ranged GETs in flight", set()),
        ("their CRC-32s and float32s", set()),
        ('see docs/BENCH_TIERS.md and (docs/PROBES.md, "Compression")', set()),
        ("the store's measured write rate (the tuner's profile)", set()),
        ("no second round of reads; 4 hosts; 3 steps", set()),
    ],
)
def test_figure_patterns(line: str, expected: set[str]) -> None:
    assert {kind for kind, _ in figures_in(line)} == expected


def test_module_docstrings_are_short() -> None:
    long = [
        f"{_rel(p)}: {n} lines (at most {MAX_MODULE_LINES}: role, call order, owns / does not own)"
        for p in _files()
        if not _pending(_rel(p)) and (n := module_docstring_lines(p)) > MAX_MODULE_LINES
    ]
    hint = "module docstrings too long; move specs onto methods or docs/BEHAVIOUR.md:\n"
    assert not long, hint + "\n".join(long)


def test_no_measured_figures_in_docstrings_or_comments() -> None:
    found = [hit for p in _files() if not _pending(_rel(p)) for hit in find_figures(p)]
    hint = "measured figures in code; point to the docs page instead:\n"
    assert not found, hint + "\n".join(found)


def test_not_figures_entries_still_match() -> None:
    stale = [
        f"{f}: {text!r}"
        for f, text, _ in NOT_FIGURES
        if text not in (ROOT / f).read_text(encoding="utf-8")
    ]
    assert not stale, "NOT_FIGURES entries whose line is gone:\n" + "\n".join(stale)


def test_pending_files_exist() -> None:
    """The allow-list names real files, so emptying it is a visible step."""
    missing = [f for f in PENDING if not (ROOT / f).exists()]
    assert not missing, f"PENDING names files that are gone: {missing}"
