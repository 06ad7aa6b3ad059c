#!/usr/bin/env python3
"""One name, one meaning, one place (issue 44): module renames and the staging pool's vocabulary.

Run once, from the repository root, on the merged tree (stdlib only; idempotent):

    python tools/rename_modules.py            # git mv + rewrite; exit 1 if an old name remains
    python tools/rename_modules.py --dry-run  # say what would change, change nothing

1. ``git mv`` each module of MODULES (a source that no longer exists is skipped with a note;
   one already moved counts as done; a source and a target that both exist is a conflict).
2. Rewrites every reference to a moved module in ckptio/, tests/, benchmarks/, docs/ (not
   docs/results/: recorded outputs), README.md and pyproject.toml: dotted paths anywhere
   (``ckptio.loading.session``, in imports, monkeypatch targets, ``-c`` code), file paths
   (``ckptio/loading/session.py``, ``loading/session.py``, ``loading/session.load``), short
   dotted paths (``loading.session``), ``from ckptio.loading import session`` (the local name
   follows the new one unless the file binds either name otherwise: then ``load_session as
   session``), relative imports, and, in docstrings and comments, a sibling's bare file name
   (``session.py`` inside loading/) and ``module.Name`` where Name is in that module's __all__.
3. Renames the identifiers of IDENTIFIERS (Python tokens, never inside other words).
4. Prints a summary; exits 1 if an old module path or identifier is still referenced, 2 on a
   conflict. Bare ``name.py`` mentions it cannot place are listed for a reader, not counted.
"""

from __future__ import annotations

import argparse
import ast
import io
import os
import re
import subprocess
import sys
import tokenize
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

# ------------------------------------------------------------------------------------------------
# the data

# old dotted module -> new dotted module (same package; every new file name unique in ckptio/).
# Not here, moved by other helpers: stepdir/* (-> storage/steproot.py, local_root.py,
# memory_root.py), S3 (-> storage/s3/), storage/local.py, storage/memory.py, manager.py,
# tiering/manager.py. ckptio/convert.py and ckptio/export.py keep their names (user-facing
# ``from ckptio.convert import convert``; test_layers' drivers list); format/safetensors.py and
# format/torchsave.py keep theirs (the formats themselves).
MODULES: dict[str, str] = {
    "ckptio.storage.base": "ckptio.storage.store_contract",      # the Store contract
    "ckptio.io.base": "ckptio.io.backend_contract",              # the IOBackend contract
    "ckptio.storage.coded": "ckptio.storage.entry_reader",       # EntryReader, Bases: v4 bytes
    "ckptio.loading.coded": "ckptio.loading.coded_reads",        # a load's reads of v4 entries
    "ckptio.cli.convert": "ckptio.cli.convert_cmd",              # `ckptio convert` / `export`
    "ckptio.cli.runs": "ckptio.cli.ls_run",                      # `ckptio ls RUN_DIR`
    "ckptio.demo.runs": "ckptio.demo.launch",                    # starting training processes
    "ckptio.planning.export": "ckptio.planning.export_plan",     # the HF export's plan (pure)
    "ckptio.loading.foreign": "ckptio.loading.foreign_common",   # what foreign formats share
    "ckptio.storage.foreign": "ckptio.storage.missing_manifest",  # no manifest: what is there
    "ckptio.tiering.hosts": "ckptio.tiering.topology",           # Topology, host_id
    "ckptio.testing.hosts": "ckptio.testing.multihost",          # N hosts for multi-host tests
    "ckptio.testing.ranks": "ckptio.testing.rank_processes",     # run_ranks
    "ckptio.managing.ranks": "ckptio.managing.agreement",        # how a manager's ranks agree
    "ckptio.format.regular": "ckptio.format.regular_section",    # v3 regular section, index files
    "ckptio.planning.regular": "ckptio.planning.regular_items",  # a rank's regular DTensor items
    "ckptio.loading.regular": "ckptio.loading.resolve_regular",  # v3 regular tensors -> entries
    "ckptio.loading.safetensors": "ckptio.loading.safetensors_manifest",
    "ckptio.loading.torchsave": "ckptio.loading.torchsave_manifest",
    "ckptio.saving.session": "ckptio.saving.save_session",       # one save, in order
    "ckptio.loading.session": "ckptio.loading.load_session",     # one load, in order
}

ALL_CODE = ("ckptio", "tests", "benchmarks")


@dataclass(frozen=True)
class Ident:
    """An identifier renamed as a Python NAME token (never inside another word) in the files
    under ``roots``. ``where``: "any" token, "attr" (after a dot), "bare" (not after a dot),
    "method" (after a dot and called, or defined). ``text``: also as a word in strings,
    comments and docs. ``phrases``: exact replacements in strings, comments and docs."""

    old: str
    new: str
    roots: tuple[str, ...] = ALL_CODE
    where: str = "any"
    text: bool = False
    phrases: tuple[tuple[str, str], ...] = ()


# The staging pool's one vocabulary: "staging" is the pool only.
#   StagingPool        io/stage.py: the pool of aligned buffers (was BufferPool)
#   IOResources        storage/files.py: the Protocol a save or load borrows: the pool, a store's
#                      files through the backend of its kind, the lock, fit() (was Staging)
#   ReusedIOResources  ckptio/resources.py: the implementation a Checkpointer (and the drain)
#                      owns, reused by every save and load (was Resources)
#   resources          the name of such an object (was ``staging`` / ``_staging`` /
#                      ``Checkpointer.staging()``: now ``resources()``)
IDENTIFIERS: tuple[Ident, ...] = (
    Ident("BufferPool", "StagingPool", text=True),
    Ident("Resources", "ReusedIOResources", text=True),
    Ident("Staging", "IOResources", phrases=(
        ("files.Staging", "files.IOResources"), ("Staging protocol", "IOResources protocol"),
        ("Staging contract", "IOResources contract"), ("``Staging``", "``IOResources``"),
        ('"Staging"', '"IOResources"'))),
    Ident("staging", "resources", roots=("ckptio",), phrases=(("staging()", "resources()"),)),
    # tests and benchmarks: only the method (a test's ``staging`` counts pool bytes; a
    # benchmark's ``staging=`` is DCP's StagingOptions)
    Ident("staging", "resources", roots=("tests", "benchmarks"), where="method",
          phrases=(("staging()", "resources()"),)),
    Ident("_staging", "_resources", where="attr"),
    Ident("_staging", "_staging_pool", roots=("ckptio/testing/io_conformance.py",),
          where="bare"),
)

TEXT_ROOTS = ("ckptio", "tests", "benchmarks", "docs", "README.md", "pyproject.toml")
EXCLUDED = ("docs/results", "tools/rename_modules.py")  # recorded outputs; this file
SUFFIXES = {".py", ".md", ".sh", ".toml", ".txt", ".cfg", ".ini", ".yaml", ".yml"}
DOCS_FOR_IDENTIFIERS = ("docs", "README.md")
LINE = 100  # Python lines this run makes longer than this are listed (to wrap by hand)

# ------------------------------------------------------------------------------------------------
# modules and files


@dataclass(frozen=True)
class Move:
    old: str  # ckptio.loading.session
    new: str

    @property
    def package(self) -> str:  # ckptio.loading
        return self.old.rsplit(".", 1)[0]

    @property
    def pkg(self) -> str:  # loading (the part under ckptio)
        return self.package.split(".", 1)[1] if "." in self.package else ""

    @property
    def stem(self) -> str:
        return self.old.rsplit(".", 1)[1]

    @property
    def new_stem(self) -> str:
        return self.new.rsplit(".", 1)[1]

    def path(self, root: Path, new: bool = False) -> Path:
        return root / ((self.new if new else self.old).replace(".", "/") + ".py")


@dataclass
class Report:
    notes: list[str] = field(default_factory=list)
    conflicts: list[str] = field(default_factory=list)
    edits: Counter[str] = field(default_factory=Counter)
    changed: set[str] = field(default_factory=set)
    fallbacks: list[str] = field(default_factory=list)
    stale: list[str] = field(default_factory=list)
    unplaced: list[str] = field(default_factory=list)
    duplicates: list[str] = field(default_factory=list)
    long: list[str] = field(default_factory=list)


def rel(path: Path, root: Path) -> str:
    return path.relative_to(root).as_posix()


def text_files(root: Path) -> list[Path]:
    out: list[Path] = []
    for top in TEXT_ROOTS:
        base = root / top
        found = [base] if base.is_file() else sorted(base.rglob("*")) if base.is_dir() else []
        for p in found:
            r = rel(p, root)
            if (p.is_file() and p.suffix in SUFFIXES and "__pycache__" not in p.parts
                    and not any(r == e or r.startswith(e + "/") for e in EXCLUDED)):
                out.append(p)
    return out


def under(r: str, roots: tuple[str, ...]) -> bool:
    return any(r == x or r.startswith(x.rstrip("/") + "/") for x in roots)


def module_of(r: str) -> tuple[str, bool] | None:
    """The dotted module of a .py file under ckptio/ and whether it is a package __init__."""
    if not (r.startswith("ckptio/") and r.endswith(".py")):
        return None
    parts = r[:-3].split("/")
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


def exported(path: Path) -> set[str]:
    """The names a module's ``__all__`` lists (empty if it has none or does not parse)."""
    try:
        tree = ast.parse(path.read_text())
    except (OSError, SyntaxError, ValueError):
        return set()
    for node in tree.body:
        targets = (node.targets if isinstance(node, ast.Assign) else
                   [node.target] if isinstance(node, ast.AnnAssign) and node.value else [])
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            try:
                return set(ast.literal_eval(node.value))  # type: ignore[arg-type]
            except ValueError:
                return set()
    return set()


def git_mv(root: Path, src: Path, dst: Path, dry: bool) -> None:
    if dry:
        return
    tracked = subprocess.run(["git", "ls-files", "--error-unmatch", "--", str(src)], cwd=root,
                             capture_output=True).returncode == 0
    if tracked:
        subprocess.run(["git", "mv", "--", str(src), str(dst)], cwd=root, check=True)
    else:
        os.rename(src, dst)


def do_moves(root: Path, report: Report, dry: bool) -> list[Move]:
    active: list[Move] = []
    for old, new in MODULES.items():
        move = Move(old, new)
        src, dst = move.path(root), move.path(root, new=True)
        if src.exists() and dst.exists():
            report.conflicts.append(f"{rel(src, root)} and {rel(dst, root)} both exist: "
                                    f"merge them by hand, then run again")
        elif src.exists():
            git_mv(root, src, dst, dry)
            report.notes.append(f"{'move   ' if dry else 'moved  '} {rel(src, root)} -> "
                                f"{rel(dst, root)}")
            active.append(move)
        elif dst.exists():
            report.notes.append(f"done    {rel(dst, root)} (already moved)")
            active.append(move)
        else:
            report.notes.append(f"skipped {rel(src, root)}: it no longer exists (nor "
                                f"{rel(dst, root)}); its references are left alone")
    return active


# ------------------------------------------------------------------------------------------------
# editing text by position


class Lines:
    """Offsets into a text by (row from 1, column in characters)."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.starts = [0]
        for line in text.splitlines(keepends=True):
            self.starts.append(self.starts[-1] + len(line))

    def at(self, row: int, col: int) -> int:
        return self.starts[row - 1] + col

    def at_bytes(self, row: int, col_bytes: int) -> int:
        """An ast column (UTF-8 bytes) as a character offset."""
        start = self.starts[row - 1]
        line = self.text[start:self.starts[row] if row < len(self.starts) else len(self.text)]
        return start + len(line.encode()[:col_bytes].decode(errors="replace"))


def apply(text: str, edits: list[tuple[int, int, str]]) -> str:
    out, last = [], len(text)
    for start, end, new in sorted(set(edits), reverse=True):
        if end > last:
            continue  # overlapping: the later (rightmost) edit wins
        out.append(text[end:last])
        out.append(new)
        last = start
    out.append(text[:last])
    return "".join(reversed(out))


def tokens(text: str) -> list[tokenize.TokenInfo] | None:
    try:
        return list(tokenize.generate_tokens(io.StringIO(text).readline))
    except (tokenize.TokenError, SyntaxError, IndentationError):
        return None


def on_prose(text: str, is_py: bool, fn: Callable[[str], tuple[str, int]]) -> tuple[str, int]:
    """``fn`` (str -> (str, count)) over the strings and comments of Python source, or the
    whole of any other text."""
    if not is_py:
        return fn(text)
    toks = tokens(text)
    if toks is None:
        return text, 0
    lines, edits, count = Lines(text), [], 0
    for tok in toks:
        if tok.type in (tokenize.STRING, tokenize.COMMENT):
            new, n = fn(tok.string)
            if n:
                count += n
                edits.append((lines.at(*tok.start), lines.at(*tok.end), new))
    return apply(text, edits), count


def subn(pattern: str, repl: str, text: str) -> tuple[str, int]:
    return re.subn(pattern, repl, text)


# ------------------------------------------------------------------------------------------------
# module references


def path_re(move: Move) -> str:
    """``loading/session`` as a file path (``ckptio/loading/session.py``, ``loading/session.x``),
    not inside a longer path other than after ``ckptio/``."""
    return rf"(?:(?<=ckptio/)|(?<![\w/.-])){re.escape(move.pkg)}/{move.stem}(?![\w/-])"


def dotted_re(move: Move) -> str:
    return rf"(?<![\w.]){re.escape(move.old)}(?!\w)"


def short_re(move: Move) -> str:
    return rf"(?<![\w./]){re.escape(move.pkg)}\.{move.stem}(?!\w)"


def from_import_re(move: Move) -> str:
    """``from ckptio.loading import a, session as s`` on one line of text (code in a string)."""
    return rf"(from {re.escape(move.package)} import )([\w ,]*\b{move.stem}\b[\w ,]*)"


def rewrite_paths(text: str, moves: list[Move], report: Report) -> str:
    for m in moves:
        for kind, pattern, new in (
                ("dotted", dotted_re(m), m.new),
                ("path", path_re(m), f"{m.pkg}/{m.new_stem}"),
                ("short dotted", short_re(m), f"{m.pkg}.{m.new_stem}")):
            text, n = subn(pattern, new.replace("\\", "\\\\"), text)
            report.edits[kind] += n
    return text


def rewrite_import_text(text: str, moves: list[Move], report: Report) -> tuple[str, int]:
    """Imports written inside a string (subprocess code): ``from ckptio.format import regular``
    becomes ``... import regular_section`` and the string's other uses of the word ``regular``
    (not after a dot) follow; ``regular as r`` becomes ``regular_section as r``."""
    total = 0
    for m in moves:
        renamed = False

        def fix(match: re.Match[str], m: Move = m) -> str:
            nonlocal renamed
            items = []
            for item in match.group(2).split(","):
                words = item.split()
                if words and words[0] == m.stem:
                    lead = item[:len(item) - len(item.lstrip())]
                    trail = item[len(item.rstrip()):]
                    rest = words[1:]
                    renamed = renamed or not rest
                    item = lead + " ".join([m.new_stem, *rest]) + trail
                items.append(item)
            return match.group(1) + ",".join(items)

        new_text = re.sub(from_import_re(m), fix, text)
        if renamed:
            new_text = re.sub(rf"(?<![\w./]){m.stem}(?!\w)", m.new_stem, new_text)
        total += new_text != text
        text = new_text
    report.edits["import in a string"] += total
    return text, total


@dataclass
class Bound:
    """A ``from package import module`` alias that binds a moved module's old name."""

    move: Move
    start: int  # the alias name's span in the text
    end: int
    full_end: int  # the end of its ``as`` name
    asname: str | None


def resolve(importer: str, is_package: bool, module: str | None, level: int) -> str:
    if not level:
        return module or ""
    base = importer.split(".")
    base = base if is_package else base[:-1]
    base = base[:len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def import_aliases(text: str, tree: ast.AST, r: str, moves: list[Move]
                   ) -> tuple[list[Bound], list[tuple[int, int, str]], list[int]]:
    """The aliases of moved modules in ``from X import ...`` statements, and edits for
    relative ``from .session import x`` forms."""
    by_old = {m.old: m for m in moves}
    me = module_of(r)
    lines, bound, edits, unread = Lines(text), [], [], []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level and me is None:
            continue
        source = resolve(me[0], me[1], node.module, node.level) if me else node.module or ""
        hit = (node.level and source in by_old) or any(
            f"{source}.{alias.name}" in by_old for alias in node.names)
        if not hit:
            continue
        spans = _alias_tokens(text, lines, node)
        if spans is None:
            unread.append(node.lineno)
            continue
        if node.level and source in by_old:
            edits.append((spans[0][0], spans[0][1], by_old[source].new_stem))
        for alias, span in zip(node.names, spans[1:]):
            move = by_old.get(f"{source}.{alias.name}")
            if move is not None:
                bound.append(Bound(move, span[0], span[1], span[2], alias.asname))
    return bound, edits, unread


def _alias_tokens(text: str, lines: Lines, node: ast.ImportFrom
                  ) -> list[tuple[int, ...]] | None:
    """[span of the module's last name before ``import``, then per alias (start of its name,
    end of its name, end of its ``as`` name)]."""
    start = lines.at_bytes(node.lineno, node.col_offset)
    end = lines.at_bytes(node.end_lineno or node.lineno, node.end_col_offset or 0)
    toks = tokens(text[start:end] + "\n")
    if toks is None:
        return None
    sub = Lines(text[start:end] + "\n")
    spans: list[tuple[int, int]] = []
    ends: dict[int, int] = {}  # alias index -> end of its ``as name``
    seen_import, last_module, expect_name, expect_as = False, (start, start), True, False
    for tok in toks:
        span = (start + sub.at(*tok.start), start + sub.at(*tok.end))
        if not seen_import:
            if tok.type == tokenize.NAME and tok.string == "import":
                seen_import = True
                spans.append(last_module)
            elif tok.type == tokenize.NAME and tok.string != "from":
                last_module = span
            continue
        if tok.type == tokenize.NAME and tok.string == "as":
            expect_name, expect_as = False, True
        elif tok.type == tokenize.NAME:
            if expect_name:
                spans.append(span)
            elif expect_as:
                ends[len(spans) - 1] = span[1]
            expect_name = expect_as = False
        elif tok.type == tokenize.OP and tok.string == ",":
            expect_name = True
    if len(spans) != len(node.names) + 1:
        return None
    return [spans[0]] + [(a, b, ends.get(i, b)) for i, (a, b) in enumerate(spans[1:], 1)]


def bindings(tree: ast.AST, skip: set[int]) -> Counter[str]:
    """Every name bound in a module other than by the import aliases at ``skip`` (ids)."""
    out: Counter[str] = Counter()
    unbound = {id(n.target) for n in ast.walk(tree)  # ``x: int`` alone binds nothing
               if isinstance(n, ast.AnnAssign) and n.value is None}
    for node in ast.walk(tree):
        if id(node) in unbound:
            continue
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            out[node.id] += 1
        elif isinstance(node, ast.arg):
            out[node.arg] += 1
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out[node.name] += 1
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                if id(alias) not in skip:
                    out[(alias.asname or alias.name).split(".")[0]] += 1
        elif isinstance(node, ast.ExceptHandler) and node.name:
            out[node.name] += 1
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            out.update(node.names)
        elif isinstance(node, ast.MatchAs) and node.name:
            out[node.name] += 1
    return out


def rewrite_imports(text: str, r: str, moves: list[Move], report: Report) -> str:
    """``from package import module`` (and relative forms) in the code of one file."""
    try:
        tree = ast.parse(text)
    except SyntaxError as exc:
        report.notes.append(f"{r}: does not parse ({exc.msg}, line {exc.lineno}): only text "
                            f"rules applied")
        return text
    bound, edits, unread = import_aliases(text, tree, r, moves)
    report.conflicts += [f"{r}:{line}: an import of a moved module this script could not read"
                         for line in unread]
    report.edits["relative import"] += len(edits)
    if not bound:
        return apply(text, edits)
    skip = {id(a) for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
            for a in n.names if any(a.name == b.move.stem for b in bound) and not a.asname}
    taken = bindings(tree, skip)
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    lines = Lines(text)
    renamed: dict[str, str] = {}
    for b in bound:
        old, new = b.move.stem, b.move.new_stem
        if b.asname == new:  # ``session as load_session``: now ``load_session``
            edits.append((b.start, b.full_end, new))
        elif b.asname:
            edits.append((b.start, b.end, new))
        elif renamed.get(old) == new or (taken[old] == 0 and new not in used | set(taken)):
            renamed[old] = new
            edits.append((b.start, b.end, new))
        else:
            edits.append((b.start, b.end, f"{new} as {old}"))
            report.fallbacks.append(f"{r}: `{new} as {old}` (the file binds `{old}` or `{new}` "
                                    f"otherwise)")
        report.edits["from-import"] += 1
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id in renamed and isinstance(node.ctx, ast.Load):
            start = lines.at_bytes(node.lineno, node.col_offset)
            edits.append((start, start + len(node.id), renamed[node.id]))
            report.edits["local name"] += 1
    return apply(text, edits)


def sibling_rules(r: str, moves: list[Move], stems: dict[str, list[tuple[str, set[str]]]]
                  ) -> list[tuple[str, str]]:
    """(pattern, replacement) for the prose of file ``r``: a sibling's bare ``stem.py`` (or the
    parent package's, from a sub-package without a module of that name), a package __init__'s
    ``stem``/(stem), and ``stem.Name`` (Name in that module's __all__)."""
    me = module_of(r)
    package = (me[0] if me[1] else me[0].rsplit(".", 1)[0]) if me else None
    rules: list[tuple[str, str]] = []
    parent = package.rsplit(".", 1)[0] if package and package.count(".") >= 2 else None
    for m in moves:
        owners = stems.get(m.stem, [])
        own = package is not None and any(mod == f"{package}.{m.stem}" for mod, _ in owners)
        sibling = package == m.package or (parent == m.package and not own)  # storage/s3/: storage/
        if sibling:
            rules.append((rf"(?<![\w/.-]){m.stem}\.py\b", f"{m.new_stem}.py"))
            if me and me[1]:
                rules.append((rf"(?<=``){m.stem}(?=``)", m.new_stem))
                rules.append((rf"(?<=\(){m.stem}(?=[),])", m.new_stem))
        names = next((a for mod, a in owners if mod == m.old), set())
        for name in sorted(names):
            holders = [mod for mod, a in owners if name in a]
            if sibling or holders == [m.old]:
                rules.append((rf"(?<![\w./]){m.stem}\.{re.escape(name)}\b",
                              f"{m.new_stem}.{name}"))
    return rules


def rewrite_prose(text: str, is_py: bool, rules: list[tuple[str, str]], report: Report) -> str:
    def fn(s: str) -> tuple[str, int]:
        total = 0
        for pattern, new in rules:
            s, n = re.subn(pattern, new, s)
            total += n
        return s, total

    text, n = on_prose(text, is_py, fn)
    report.edits["sibling or module.Name in prose"] += n
    return text


# ------------------------------------------------------------------------------------------------
# identifiers


SKIPPED = (tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT, tokenize.INDENT, tokenize.DEDENT)


def _context_ok(ident: Ident, toks: list[tokenize.TokenInfo], i: int) -> bool:
    prev, j = None, i - 1
    while j >= 0 and prev is None:
        if toks[j].type not in SKIPPED:
            prev = toks[j]
        j -= 1
    after_dot = prev is not None and prev.type == tokenize.OP and prev.string == "."
    if ident.where == "attr":
        return after_dot
    if ident.where == "bare":
        return not after_dot
    if ident.where == "method":
        nxt = toks[i + 1] if i + 1 < len(toks) else None
        called = nxt is not None and nxt.type == tokenize.OP and nxt.string == "("
        defined = prev is not None and prev.type == tokenize.NAME and prev.string == "def"
        return (after_dot and called) or defined
    return True


def phrase_re(phrase: str) -> str:
    """An exact phrase, not inside a longer word (``staging()`` is not ``grow_staging()``)."""
    return ((r"(?<!\w)" if re.match(r"\w", phrase) else "") + re.escape(phrase)
            + (r"(?!\w)" if re.search(r"\w$", phrase) else ""))


def rename_identifiers(text: str, r: str, report: Report) -> str:
    is_py = r.endswith(".py")
    for ident in IDENTIFIERS:
        if is_py and under(r, ident.roots):
            toks = tokens(text)
            if toks is None:
                continue
            hits = [i for i, t in enumerate(toks) if t.type == tokenize.NAME
                    and t.string == ident.old and _context_ok(ident, toks, i)]
            same = Ident(ident.new, ident.old, where="bare" if ident.where == "any"
                         else ident.where)
            if hits and any(t.type == tokenize.NAME and t.string == ident.new
                            and _context_ok(same, toks, i) for i, t in enumerate(toks)):
                report.conflicts.append(f"{r}: `{ident.new}` is already a name here; "
                                        f"`{ident.old}` left as it is")
                continue
            lines = Lines(text)
            text = apply(text, [(lines.at(*toks[i].start), lines.at(*toks[i].end), ident.new)
                                for i in hits])
            report.edits[f"identifier {ident.old}"] += len(hits)
        in_docs = not is_py and under(r, DOCS_FOR_IDENTIFIERS)
        if (is_py and under(r, ident.roots)) or in_docs:
            rules = [(phrase_re(old), new) for old, new in ident.phrases]
            if ident.text:
                rules.append((rf"\b{ident.old}\b", ident.new))

            def fn(s: str, rules: list[tuple[str, str]] = rules) -> tuple[str, int]:
                total = 0
                for pattern, new in rules:
                    s, n = re.subn(pattern, new, s)
                    total += n
                return s, total

            text, n = on_prose(text, is_py, fn)
            report.edits[f"identifier {ident.old} in prose"] += n
    return text


# ------------------------------------------------------------------------------------------------
# what remains


def stale_refs(text: str, r: str, moves: list[Move]) -> list[str]:
    out: list[str] = []
    is_py = r.endswith(".py")
    for m in moves:
        for kind, pattern in (("dotted", dotted_re(m)), ("path", path_re(m)),
                              ("short dotted", short_re(m))):
            for match in re.finditer(pattern, text):
                line = text.count("\n", 0, match.start()) + 1
                out.append(f"{r}:{line}: {kind} {m.old}: {match.group(0)!r}")
        pattern = rf"from {re.escape(m.package)} import (?:\(([^)]*)\)|([\w ,]*))"
        for match in re.finditer(pattern, text):
            items = (match.group(1) or match.group(2) or "").split(",")
            if any(item.split()[:1] == [m.stem] for item in items):
                line = text.count("\n", 0, match.start()) + 1
                out.append(f"{r}:{line}: import of {m.old}: {match.group(0)!r}")
    if is_py:
        out += _stale_code(text, r, moves)
    return out


def _stale_code(text: str, r: str, moves: list[Move]) -> list[str]:
    out: list[str] = []
    try:
        tree = ast.parse(text)
    except SyntaxError:
        tree = None
    me = module_of(r)
    olds = {m.old for m in moves}
    for node in ast.walk(tree) if tree is not None else ():
        if isinstance(node, ast.ImportFrom) and (node.level == 0 or me):
            source = resolve(me[0], me[1], node.module, node.level) if me else node.module or ""
            for alias in node.names:
                if source in olds or f"{source}.{alias.name}" in olds:
                    out.append(f"{r}:{node.lineno}: import of {source}.{alias.name}")
    toks = tokens(text) or []
    for ident in IDENTIFIERS:
        if under(r, ident.roots):
            out += [f"{r}:{t.start[0]}: identifier {ident.old}" for i, t in enumerate(toks)
                    if t.type == tokenize.NAME and t.string == ident.old
                    and _context_ok(ident, toks, i)]
    return sorted(set(out))


def unplaced(text: str, r: str, gone: set[str]) -> list[str]:
    """Bare ``stem.py`` mentions in ckptio/ of a file name no module has any more."""
    if not r.startswith("ckptio/"):
        return []
    out = []
    for stem in sorted(gone):
        for match in re.finditer(rf"(?<![\w/.-]){stem}\.py\b", text):
            out.append(f"{r}:{text.count(chr(10), 0, match.start()) + 1}: {match.group(0)}")
    return out


def duplicate_names(root: Path) -> list[str]:
    seen: dict[str, list[str]] = defaultdict(list)
    for p in sorted((root / "ckptio").rglob("*.py")):
        if "__pycache__" not in p.parts and p.name not in ("__init__.py", "__main__.py"):
            seen[p.name].append(rel(p, root))
    return [f"{name}: {', '.join(paths)}" for name, paths in sorted(seen.items())
            if len(paths) > 1]


# ------------------------------------------------------------------------------------------------
# the run


def stems_index(root: Path, moves: list[Move]) -> dict[str, list[tuple[str, set[str]]]]:
    """stem -> [(dotted module, its __all__)] for every module of ckptio whose file name is a
    moved module's old stem (the moved ones under their old names)."""
    wanted = {m.stem for m in moves}
    found: dict[str, dict[str, set[str]]] = defaultdict(dict)
    for p in sorted((root / "ckptio").rglob("*.py")):
        me = module_of(rel(p, root))
        if me and not me[1] and p.stem in wanted and "__pycache__" not in p.parts:
            found[p.stem][me[0]] = exported(p)
    for m in moves:
        new = m.path(root, new=True)
        found[m.stem][m.old] = exported(new if new.exists() else m.path(root))
    return {stem: sorted(mods.items()) for stem, mods in found.items()}


def run(root: Path, dry: bool) -> int:
    report = Report()
    moves = do_moves(root, report, dry)
    stems = stems_index(root, moves)
    gone = {m.stem for m in moves} - {p.stem for p in (root / "ckptio").rglob("*.py")}
    for path in text_files(root):
        r = rel(path, root)
        try:
            before = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        text, is_py = before, r.endswith(".py")
        if is_py:
            text = rewrite_imports(text, r, moves, report)
            text, _ = on_prose(text, True, lambda s: rewrite_import_text(s, moves, report))
        text = rewrite_paths(text, moves, report)
        text = rewrite_prose(text, is_py, sibling_rules(r, moves, stems), report)
        text = rename_identifiers(text, r, report)
        if text != before:
            report.changed.add(r)
            if is_py:
                had = set(before.splitlines())
                report.long += [f"{r}:{i}" for i, line in enumerate(text.splitlines(), 1)
                                if len(line) > LINE and line not in had]
            if not dry:
                path.write_text(text)
        report.stale += stale_refs(text, r, moves)
        report.unplaced += unplaced(text, r, gone)
    report.duplicates = duplicate_names(root)
    return summary(report, dry)


def summary(report: Report, dry: bool) -> int:
    print("rename_modules:" + (" (dry run: nothing written, nothing moved)" if dry else ""))
    for line in report.notes:
        print("  " + line)
    print(f"  {len(report.changed)} file(s) {'would change' if dry else 'changed'}; edits: "
          + ", ".join(f"{k} {v}" for k, v in sorted(report.edits.items()) if v))
    for title, items in (("kept under the old local name", report.fallbacks),
                         (f"Python lines now over {LINE} characters (wrap them)", report.long),
                         ("bare file names no module has any more (read and fix by hand)",
                          report.unplaced),
                         ("file names still used by more than one module (not in this map)",
                          report.duplicates),
                         ("CONFLICTS", report.conflicts),
                         ("OLD NAMES STILL REFERENCED", report.stale)):
        if items:
            print(f"  {title}: {len(items)}")
            for item in items:
                print("    " + item)
    if report.conflicts:
        return 2
    return 1 if report.stale and not dry else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path.cwd(),
                        help="the repository root (default: the current directory)")
    parser.add_argument("--dry-run", action="store_true", help="change nothing; say what would")
    args = parser.parse_args(argv)
    root = args.root.resolve()
    if not (root / "ckptio" / "__init__.py").exists():
        parser.error(f"{root} is not the repository root (no ckptio/__init__.py)")
    return run(root, args.dry_run)


if __name__ == "__main__":
    sys.exit(main())
