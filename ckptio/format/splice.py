"""The manifest body's JSON text, and for saves of one layout a template of it spliced per save.

Owns: ``body_json`` (the body as JSON values: the one definition of its fields and their order),
``body_text`` (its compact JSON text), and ``Templates``: the text of a body whose per-save
fields (save id, file names, each entry's file, checksum and block checksums, the objects, meta)
are markers, split at them, held by the saver that encodes (no module state: collective.Memory
owns one per save group). manifest.encode calls ``Templates.body_text``; a layout's first save is
encoded in full and remembered by its key, the second makes the template (kept only if it
gives that save's full text), later ones only encode the per-save fields and join. The key is
marshal's bytes (exact in types, a copy no caller can change) of every other field the text
holds; a template serves only a manifest of equal key, proven for a reused plan without the
key: the same small fields' bytes and each entry's fields the very (immutable) objects the
template was made of. None is made for what it does not cover (version 4 entries, bases, a
regular section, a marker met in the text). Pure: no file access. Does not own: the framing
(manifest.py) or the checks (validate.py).
"""

from __future__ import annotations

import json
import marshal
import re
import threading
import dataclasses
from dataclasses import dataclass
from functools import partial
from itertools import chain
from json.encoder import encode_basestring_ascii as _quoted
from operator import attrgetter, is_, itemgetter
from typing import Any

from ckptio.format import entryform, regular_section
from ckptio.format.types import Manifest, ObjectEntry, TensorEntry

__all__ = ["Templates", "body_json", "body_text", "full_text"]

_SEPARATORS = (",", ":")
_MARK = "\x00ckptio-splice:"  # + one letter: S save id, N file name, F file, C checksum, B
_MARKED = re.compile(r'"\\u0000ckptio-splice:([SNFCBOM])"')  # blocks, O objects, M meta
_KEEP = 4  # templates kept (a process saving a few layouts in turn)

_ENTRY = attrgetter("key", "kind", "dtype", "shape", "chunk.offsets", "chunk.sizes", "chunk.flat",
                    "offset", "nbytes", "rank", "stored", "delta")
_FILE_SIZE = attrgetter("nbytes", "rank")
_NAME = attrgetter("name")
_FILE = attrgetter("file")
_CHECKSUM = attrgetter("checksum")
_BLOCKS = attrgetter("blocks")


def body_json(m: Manifest) -> dict[str, Any]:
    return {
        "format": "ckptio",
        "version": m.version,
        "save_id": m.save_id,
        "checksum_algorithm": m.checksum_algorithm,
        "world_size": m.world_size,
        "files": [{"name": f.name, "nbytes": f.nbytes, "rank": f.rank} for f in m.files],
        "tensors": [_tensor_json(t) for t in m.tensors],
        "objects": _objects_json(m.objects),
        "aliases": [list(pair) for pair in m.aliases],
        "tree": m.tree,
        "meta": m.meta,
        "block_nbytes": m.block_nbytes,
        **(regular_section.section_json(m) if m.version >= 3 else {}),
        **({"bases": list(m.bases)} if m.bases else {}),
    }


def _tensor_json(t: TensorEntry) -> dict[str, Any]:
    chunk: dict[str, Any] = {"offsets": list(t.chunk.offsets), "sizes": list(t.chunk.sizes)}
    if t.chunk.flat:
        chunk["flat"] = True
    out = {
        "key": t.key, "kind": t.kind, "dtype": t.dtype, "shape": list(t.shape), "chunk": chunk,
        "file": t.file, "offset": t.offset, "nbytes": t.nbytes, "checksum": t.checksum,
    }
    if t.rank is not None:
        out["rank"] = t.rank
    if t.blocks:
        out["blocks"] = list(t.blocks)
    out.update(entryform.entry_json(t))
    return out


def _objects_json(objects: tuple[ObjectEntry, ...]) -> list[dict[str, Any]]:
    out = []
    for o in objects:
        entry = {"key": o.key, "value": o.value}
        if o.rank is not None:
            entry["rank"] = o.rank
        out.append(entry)
    return out


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=_SEPARATORS, allow_nan=False)


def full_text(m: Manifest) -> str:
    """The body's JSON text, encoded in full."""
    return _dumps(body_json(m))


@dataclass(frozen=True)
class _Template:
    """A layout's body text split at its per-save fields: ``pieces`` around the slots, and
    ``order``, which value of those ``fill`` lists goes into each slot; ``small`` and ``fields``
    (immutable: str, int, bool, None, tuples of int), what the text was made of."""

    pieces: tuple[str, ...]
    order: itemgetter[Any]
    with_blocks: tuple[int, ...]  # the entries that have block checksums
    small: bytes  # _small of the manifest it was made of
    fields: list[Any]  # _fields of that manifest

    def holds(self, small: bytes, fields: list[Any]) -> bool:
        """Whether a manifest of these ``_small`` and ``_fields`` is of this template's layout,
        proven cheaply: the same small fields, and each entry field the very object the
        template was made of."""
        return (small == self.small and len(fields) == len(self.fields)
                and all(map(is_, fields, self.fields)))

    def fill(self, m: Manifest, objects: str | None = None) -> str | None:
        """This save's body text, or None where a per-save field is not a plain str.
        ``objects``: the JSON text of ``m.objects`` where the caller has it."""
        ts, at = m.tensors, self.with_blocks
        names, files, sums = list(map(_NAME, m.files)), list(map(_FILE, ts)), list(map(_CHECKSUM, ts))
        blocks = list(map(_BLOCKS, itemgetter(*at)(ts) if len(at) > 1 else [ts[i] for i in at]))
        kinds = set(map(type, chain(names, files, sums, chain.from_iterable(blocks))))
        if type(m.save_id) is not str or not kinds <= {str}:
            return None
        values = [_quoted(m.save_id), *map(_quoted, names), *map(_quoted, files),
                  *map(_quoted, sums), *map(",".join, map(partial(map, _quoted), blocks)),
                  _dumps(_objects_json(m.objects)) if objects is None else objects,
                  _dumps(m.meta)]
        out: list[str] = [""] * (2 * len(self.pieces) - 1)
        out[0::2] = self.pieces
        out[1::2] = self.order(values)
        return "".join(out)

    @classmethod
    def of(cls, m: Manifest, small: bytes, fields: list[Any]) -> _Template | None:
        """The template of ``m``'s layout, or None where its fields are not all immutable, a
        marker was met in its fixed text, or the template did not give ``m``'s full text."""
        kinds = set(map(type, fields))
        inner = set(map(type, chain.from_iterable(f for f in fields if type(f) is tuple)))
        if not kinds <= {str, int, bool, type(None), tuple} or not inner <= {int}:
            return None
        body = body_json(m)
        body["save_id"], body["objects"], body["meta"] = _MARK + "S", _MARK + "O", _MARK + "M"
        for f in body["files"]:
            f["name"] = _MARK + "N"
        with_blocks = []
        for i, t in enumerate(body["tensors"]):
            t["file"], t["checksum"] = _MARK + "F", _MARK + "C"
            if "blocks" in t:
                t["blocks"] = [_MARK + "B"]
                with_blocks.append(i)
        parts = _MARKED.split(_dumps(body))
        pieces, slots = parts[0::2], parts[1::2]
        # each entry's slots in the text's order: its file, its checksum, then its blocks
        files, n = len(m.files), len(m.tensors)
        blocks_at = dict(zip(with_blocks, range(len(with_blocks))))
        expected, order = ["S", *"N" * files], [0, *range(1, 1 + files)]
        for i in range(n):
            expected += ["F", "C"]
            order += [1 + files + i, 1 + files + n + i]
            if i in blocks_at:
                expected.append("B")
                order.append(1 + files + 2 * n + blocks_at[i])
        last = 1 + files + 2 * n + len(with_blocks)
        expected += ["O", "M"]
        order += [last, last + 1]
        if slots != expected:  # a marker's text in a key, the tree or elsewhere: no template
            return None
        made = cls(tuple(pieces), itemgetter(*order), tuple(with_blocks), small, fields)
        return made if made.fill(m) == full_text(m) else None


def _small(m: Manifest) -> bytes | None:
    """Every field of ``m``'s body text but the entries' and the per-save ones, as marshal's
    bytes (exact in types; format 0 shares no objects, so equal fields give equal bytes); None
    for a manifest no template covers (bases, a regular section, a tree marshal refuses)."""
    if m.bases or m.grids or m.regular or m.indexes:
        return None
    fields = (m.version, m.checksum_algorithm, m.world_size, m.block_nbytes, m.aliases, m.tree,
              tuple(map(_FILE_SIZE, m.files)), tuple(map(len, map(_BLOCKS, m.tensors))))
    try:
        return marshal.dumps(fields, 0)
    except ValueError:
        return None


def _fields(m: Manifest) -> list[Any]:
    """The fields of every entry the body text holds but for the per-save ones, in a row."""
    return list(chain.from_iterable(map(_ENTRY, m.tensors)))


def body_text(m: Manifest) -> str:
    """The body's JSON text, encoded in full (a caller with no Templates)."""
    return full_text(m)


class Templates:
    """The templates of the layouts one saver encodes (a save group's plan memory,
    collective.Memory, owns one): layouts seen once, templates by key, the one used last."""

    __slots__ = ("_lock", "_seen", "_templates", "_last", "_objects")

    def __init__(self) -> None:
        self._lock = threading.Lock()  # the tables, shared by the threads that encode
        self._seen: dict[bytes, None] = {}  # keys of layouts seen once, the oldest first
        self._templates: dict[bytes, _Template | None] = {}  # None: the layout has none
        self._last: _Template | None = None  # the template used last
        # the objects of the last body filled and their JSON text: a steady save's objects are
        # the very entries of the last one (the plan keeps them while equal, plan.PlanCache)
        self._objects: tuple[tuple[ObjectEntry, ...], str] = ((), "[]")

    def body_text(self, m: Manifest) -> str:
        """The body's JSON text: the template's of ``m``'s layout where there is one, else in
        full (a layout seen for the second time gets its template)."""
        small = _small(m)
        if small is None:
            return full_text(m)
        fields = _fields(m)
        template = self._last
        if template is None or not template.holds(small, fields):
            template = self._template(m, small, fields)
        text = template.fill(m, self._objects_text(m.objects)) if template is not None else None
        return full_text(m) if text is None else text

    def _objects_text(self, objects: tuple[ObjectEntry, ...]) -> str:
        """The JSON text of ``objects``: the last one's where they are the very same entries
        (compared by one ``map``), else encoded (and kept)."""
        last, text = self._objects
        if len(objects) != len(last) or not all(map(is_, objects, last)):
            text = _dumps(_objects_json(objects))
            self._objects = (tuple(objects), text)
        return text

    def _template(self, m: Manifest, small: bytes, fields: list[Any]) -> _Template | None:
        """The template of ``m``'s layout, by its key (``small`` and the entries' fields, as
        marshal's bytes), made on its second sight; None where there is none (yet)."""
        try:
            key = small + marshal.dumps(tuple(fields), 0)
        except ValueError:  # a field marshal refuses (a compressed entry, a delta)
            return None
        with self._lock:
            known = key in self._templates
            template = self._templates.get(key)
            if not known and key not in self._seen:
                _keep(self._seen, key, None)
                return None
        if not known:
            template = _Template.of(m, small, fields)
            with self._lock:
                self._seen.pop(key, None)
                _keep(self._templates, key, template)
        elif template is not None and template.fields is not fields:
            template = dataclasses.replace(template, fields=fields)  # this layout's objects now
            with self._lock:
                _keep(self._templates, key, template)
        self._last = template
        return template


def _keep(table: dict[bytes, Any], key: bytes, value: Any) -> None:
    """``table[key] = value``, the oldest entries dropped beyond _KEEP."""
    table.pop(key, None)
    while len(table) >= _KEEP:
        del table[next(iter(table))]
    table[key] = value
