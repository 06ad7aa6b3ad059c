"""What a checkpoint holds, as the ``ckptio`` command shows it: its manifest and one row per key.

Owns: opening the manifest of a path for ls and diff (a ckptio checkpoint's own, read and
validated without importing torch, a version 3 one's index files too (``Store.read_file``); a DCP
directory's or a torch.save file's, made by ckptio's loader, which imports torch), and the
per-key summary (kind, dtype, shape, bytes, chunks, ranks, values) both commands use. Does not
own: validation (format/manifest.py, format/regular_section.py) or reading foreign formats (loading/).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ckptio.errors import CheckpointNotFoundError, PickleRefusedError
from ckptio.format import manifest, regular_section, values
from ckptio.format.allowlist import NO_ALLOW_PICKLE
from ckptio.format.types import Json, Manifest, ObjectEntry, TensorEntry
from ckptio.options import Options
from ckptio.storage.s3.s3path import is_s3
from ckptio.storage.select import checkpoint_path, store_for

if TYPE_CHECKING:  # imports torch: the commands that need it import it when they run
    from ckptio.api import Checkpointer

__all__ = ["Opened", "Row", "manifest_of", "open_manifest", "printed", "rows", "shown",
           "source_format"]


@dataclass(frozen=True)
class Opened:
    """A checkpoint's manifest and where it came from."""

    path: str
    record: Manifest
    format: str  # "ckptio", "dcp", "torch.save", "safetensors" or "torch_checkpointing"


@dataclass(frozen=True)
class Row:
    """One key of a checkpoint: a tensor-like entry (its chunks), a value or an alias."""

    key: str
    kind: str  # a tensor kind (tensor, numpy, numpy_scalar, bytes, pickle), "value" or "alias"
    dtype: str = ""
    shape: tuple[int, ...] = ()
    nbytes: int = 0
    chunks: tuple[TensorEntry, ...] = ()
    objects: tuple[ObjectEntry, ...] = ()
    alias_of: str = ""

    @property
    def ranks(self) -> list[int] | None:
        """The ranks of a per-rank key (saved differently by each rank), else None."""
        entries: tuple[TensorEntry | ObjectEntry, ...] = (*self.chunks, *self.objects)
        found = [e.rank for e in entries if e.rank is not None]
        return sorted(found) if found else None


def source_format(record: Manifest) -> str:
    """What the loader made ``record`` of: a DCP directory, a torch.save file, a
    torch_checkpointing directory, safetensors, or "ckptio"."""
    if "dcp" in record.meta and record.save_id == "dcp":  # DcpWriter's saves have a save id
        return "dcp"
    for foreign in ("torch.save", "safetensors", "torch_checkpointing"):
        if foreign in record.meta:
            return foreign
    return "ckptio"


def open_manifest(path: str) -> Opened:
    """The manifest of ``path``: a ckptio checkpoint's without torch (a version 3 one with a
    row for every chunk of its regular tensors, from its index files, each checked as a load
    checks it: format/regular_section.py); else a DCP directory's or a torch.save file's as
    ckptio.load reads it (imports torch). Raises CkptError."""
    text = checkpoint_path(path)
    if is_s3(text) or not os.path.isfile(text):
        store = store_for(text)
        try:
            body = store.read_manifest()
        except CheckpointNotFoundError:
            pass  # a DCP checkpoint, read below, or nothing (the loader says which)
        else:
            record = manifest.decode(body, store.path_of(manifest.MANIFEST_NAME))
            every = regular_section.expand_all(record, lambda files: [
                store.read_file(f.name, 0, f.nbytes) for f in files])
            return Opened(text, every, "ckptio")
    from ckptio.api import Checkpointer

    checkpointer = Checkpointer(Options(buffer_bytes=1 << 20, pool_bytes=4 << 20))
    try:
        record = manifest_of(checkpointer, text)
    finally:
        checkpointer.close()
    return Opened(text, record, source_format(record))


def manifest_of(checkpointer: Checkpointer, text: str) -> Manifest:
    """``checkpointer.manifest(text)``; a checkpoint that opens only by unpickling (a DCP value
    item) is refused with the commands' own fix, not the load's (allow_pickle); a
    torch_checkpointing file's refusal says its own (loading/tcdir.py)."""
    try:
        return checkpointer.manifest(text)
    except PickleRefusedError as exc:
        fix = "" if NO_ALLOW_PICKLE in str(exc) else (
            ". Open it in Python, only if you trust it: ckptio.load(..., allow_pickle=True), "
            "or torch.distributed.checkpoint.load")
        raise PickleRefusedError(
            f"{text} cannot be opened without unpickling, which ckptio's ls, diff and verify "
            f"never do: {exc}{fix}") from None


def rows(record: Manifest) -> dict[str, Row]:
    """Every key of ``record`` (tensors, values, aliases) -> its Row, in manifest order."""
    chunks: dict[str, list[TensorEntry]] = {}
    for t in record.tensors:
        chunks.setdefault(t.key, []).append(t)
    out = {key: Row(key, c[0].kind, c[0].dtype, c[0].shape, sum(e.nbytes for e in c), tuple(c))
           for key, c in chunks.items()}
    objects: dict[str, list[ObjectEntry]] = {}
    for o in record.objects:
        objects.setdefault(o.key, []).append(o)
    out.update((key, Row(key, "value", objects=tuple(o))) for key, o in objects.items())
    out.update((key, Row(key, "alias", alias_of=target)) for key, target in record.aliases)
    return out


_TORCH_TYPES = {"size": "torch.Size({})", "dtype": "torch.{}", "device": "device({!r})"}


def shown(tagged: Json, exact: bool = False) -> str:
    """An inline value as Python shows it. Sizes, dtypes and devices are written from their
    stored text without importing torch unless ``exact`` (then decoded by torch)."""
    if (not exact and isinstance(tagged, list) and len(tagged) == 2
            and tagged[0] in _TORCH_TYPES and isinstance(tagged[1], (str, list))):
        return _TORCH_TYPES[str(tagged[0])].format(tagged[1])
    try:
        return repr(values.decode(tagged))
    except ValueError:
        return f"<malformed {tagged!r:.40}>"


def printed(key: str) -> str:
    """A key or name as one visible word of a line: quoted as Python writes it when it is empty
    or holds a newline, tab or other character that would break the line or hide it."""
    return key if key.isprintable() and key else repr(key)
