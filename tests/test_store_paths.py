"""Every byte of a checkpoint goes through its Store: outside storage/ and io/, no module that
reaches a checkpoint's files builds a file path or opens one itself. Checked from the source
(ast), as tests/test_layers.py checks imports.

The modules checked are those between a state and its bytes: the save and load paths (saving/,
loading/), the collective steps (distributed/), planning and the format (planning/, format/),
the DCP adapter (dcp/), the tiers with their drain and redundancy (managing/, redundancy/: copies, parity
pieces and markers go through the root's TreeStore, storage/store_contract.py) and the drivers that run
them (api, resources, shared, manager). They may
name a file in a message (``Store.path_of``, ``StoreFiles.where``) but never join a path,
open, stat, rename or delete one: a file is opened by name through ``StoreFiles`` (storage/
files.py), small metadata is read with ``Store.read_file``.

The modules let off, each with its reason (LET_OFF): saving/stream.py writes a Hugging Face
export's output file (a safetensors file in a folder export.py owns, truncated to its exact
size), not a file of a checkpoint store; managing/tier.py asks the filesystem under a memory
tier for its free space (statvfs) and sums the files of its step directories (the memory
budget: every file, the manifest and index files too).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "ckptio"
CHECKED = ["saving", "loading", "distributed", "planning", "format", "dcp", "redundancy", "api.py",
           "resources.py", "shared.py", "managing"]
LET_OFF = {"saving/stream.py": "a Hugging Face export's output file, owned by export.py",
           "managing/tier.py": "a memory tier's free space (statvfs) and its steps' sizes",
           "managing/restoring.py": "a run directory's siblings, listed for a 'did you mean' "
                                    "(never a checkpoint's file)"}
# os.path.<name>, os.<name>, builtins and modules that reach a file by its path
PATH_CALLS = {"join", "isfile", "isdir", "exists", "getsize", "abspath", "realpath"}
OS_CALLS = {"open", "stat", "lstat", "listdir", "scandir", "unlink", "remove", "rename",
            "replace", "makedirs", "mkdir", "rmdir", "truncate", "fsync"}
BUILTINS = {"open"}
MODULES = {"pathlib", "shutil", "glob", "tempfile"}


def _files() -> list[Path]:
    out: list[Path] = []
    for entry in CHECKED:
        path = ROOT / entry
        out += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    return [p for p in out if str(p.relative_to(ROOT)) not in LET_OFF]


def _problems(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    where = path.relative_to(ROOT.parent)
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            found += [f"{where}:{node.lineno} imports {n}" for n in names if n.split(".")[0] in MODULES]
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name) and func.id in BUILTINS:
            found.append(f"{where}:{node.lineno} calls {func.id}()")
        if isinstance(func, ast.Attribute):
            owner = ast.unparse(func.value)
            if owner == "os.path" and func.attr in PATH_CALLS:
                found.append(f"{where}:{node.lineno} calls os.path.{func.attr}()")
            if owner == "os" and func.attr in OS_CALLS:
                found.append(f"{where}:{node.lineno} calls os.{func.attr}()")
    return found


def test_only_storage_and_io_reach_files_by_path() -> None:
    files = _files()
    assert len(files) > 40, "the checked packages were not found"
    assert any(str(f.relative_to(ROOT)).startswith("redundancy/") for f in files), "redundancy/ checked"
    problems = [p for f in files for p in _problems(f)]
    assert not problems, ("outside storage/ and io/, files are reached through the Store "
                          "(storage/files.StoreFiles, Store.read_file):\n  " + "\n  ".join(problems))


def test_the_check_sees_a_path_join(tmp_path: Path) -> None:
    """The checker itself fails on the shapes it forbids (else the test above proves nothing)."""
    sample = tmp_path / "ckptio" / "sample.py"
    sample.parent.mkdir()
    sample.write_text("import os\nimport pathlib\n"
                      "def f(d, n):\n    return open(os.path.join(d, n)), os.stat(d)\n")
    global ROOT
    saved, ROOT = ROOT, tmp_path / "ckptio"
    try:
        problems = _problems(sample)
    finally:
        ROOT = saved
    assert {p.split(" ", 1)[1] for p in problems} == {
        "imports pathlib", "calls open()", "calls os.path.join()", "calls os.stat()"}
