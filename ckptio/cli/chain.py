"""What the ``ckptio`` commands show of compression and delta chains (docs/FORMAT.md version 4):
each entry's codec or base reference, a checkpoint's stored and logical bytes, its bases and
where they are. Torch-free: manifests only.

- logical bytes: the tensors' own bytes (the entries' ``nbytes``), what a load returns;
- stored bytes: what this checkpoint's own files hold (its manifest's ``files``); a delta's
  referenced entries are stored in its base, so they count there;
- an entry is stored ``raw``, compressed (``stored.codec``), referenced (``ref``: its bytes are
  the base's entry) or XOR'ed against the base's entry (``xor``, maybe compressed too).

Owns: reading those fields for display, the base's location beside a checkpoint. Does not own:
the fields' format and checks (format/), the chains' retention (managing/chains.py).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ckptio.format.types import DTYPE_ITEMSIZE, Manifest, TensorEntry
from ckptio.storage.select import checkpoint_path

__all__ = ["EntryStorage", "base_location", "entry_storage", "logical_nbytes", "stored_nbytes"]


@dataclass(frozen=True)
class EntryStorage:
    """How one chunk is stored: its codec ("raw" when not compressed), the bytes it takes in
    this checkpoint's files, and the base it references or is XOR'ed against (a step name)."""

    codec: str
    stored: int
    ref: str | None = None
    xor: str | None = None

    def describe(self) -> str:
        if self.ref is not None:
            return f"ref {self.ref}"
        if self.xor is not None:
            return f"xor {self.xor}" + ("" if self.codec == "raw" else f" {self.codec}")
        return self.codec


def _field(entry: TensorEntry, name: str, sub: str) -> Any:
    """``entry.<name>.<sub>`` (a dataclass or a mapping), None if absent."""
    value = getattr(entry, name, None)
    if value is None:
        return None
    return value.get(sub) if isinstance(value, Mapping) else getattr(value, sub, None)


def entry_storage(entry: TensorEntry) -> EntryStorage:
    kind, base = _field(entry, "delta", "kind"), _field(entry, "delta", "checkpoint")
    if kind == "ref":
        return EntryStorage("ref", 0, ref=str(base))
    codec, nbytes = _field(entry, "stored", "codec"), _field(entry, "stored", "nbytes")
    return EntryStorage(str(codec) if codec is not None else "raw",
                        int(nbytes) if nbytes is not None else entry.nbytes,
                        xor=str(base) if kind == "xor" else None)


def logical_nbytes(record: Manifest) -> int:
    """The bytes of the tensors ``record`` holds: its listed chunks, and its regular tensors
    (version 3: described once each, their chunks in the index files) whole."""
    regular = sum(math.prod(r.shape) * DTYPE_ITEMSIZE[r.dtype] for r in record.regular)
    return sum(t.nbytes for t in record.tensors) + regular


def stored_nbytes(record: Manifest) -> int:
    """The bytes this checkpoint's own files hold."""
    return sum(f.nbytes for f in record.files)


def base_location(path: str, name: str) -> str:
    """Where base ``name`` (a sibling step name, ``step-100``) of the checkpoint at ``path``
    is: beside it, in the same directory or prefix."""
    text = checkpoint_path(path).rstrip("/")
    parent = text.rsplit("/", 1)[0] if "/" in text else "."
    return f"{parent}/{name}"
