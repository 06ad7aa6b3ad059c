"""``ckptio ls PATH [--json] [--depth N] [--values] [--flat] [--bytes] [--storage]``: the tree a
checkpoint holds, its logical and stored bytes and its bases (a delta checkpoint's; ``--storage``:
per key, the stored bytes and each chunk's codec or base reference, cli/chain.py).

Owns: walking the manifest's tree (format/FORMAT.md "Tree") into nodes with each leaf's kind,
dtype, shape, bytes, chunks or ranks and inline values, and printing them as text or as the
JSON of docs/CLI.md (schema ``ckptio.ls/1``), sizes as people read them (``human_size``; the
JSON and ``--bytes`` keep exact bytes). Does not own: opening the manifest (cli/source.py), which
reads a ckptio checkpoint without importing torch, nor a run directory's steps (cli/ls_run.py).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from typing import Any

from ckptio.cli.chain import entry_storage, stored_nbytes
from ckptio.cli.source import Opened, Row, printed, rows, shown
from ckptio.format.manifest import bases_of
from ckptio.format.types import Json

__all__ = ["SCHEMA", "as_json", "human_size", "run", "text_lines"]

SCHEMA = "ckptio.ls/1"
_CONTAINERS = {"d": "dict", "l": "list", "t": "tuple"}
_VALUE_WIDTH = 60  # text output cuts a value's repr here unless --values
_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def human_size(nbytes: int) -> str:
    """``nbytes`` as people read it: 48 B, 1.5 KiB, 12.4 MiB, 3.0 GiB (powers of 1024)."""
    size, unit = float(nbytes), 0
    while size >= 1024 and unit < len(_UNITS) - 1:
        size, unit = size / 1024, unit + 1
    return f"{nbytes} B" if unit == 0 else f"{size:.1f} {_UNITS[unit]}"


def _leaf(row: Row, exact: bool) -> dict[str, Any]:
    if row.kind == "alias":
        return {"key": row.key, "type": "alias", "alias_of": row.alias_of}
    if row.kind == "value":
        return {"key": row.key, "type": "value", "values": [
            {"rank": o.rank, "value": o.value, "repr": shown(o.value, exact)} for o in row.objects]}
    stored = [entry_storage(e) for e in row.chunks]
    return {"key": row.key, "type": row.kind, "dtype": row.dtype, "shape": list(row.shape),
            "nbytes": row.nbytes, "chunks": len(row.chunks), "ranks": row.ranks,
            "stored_nbytes": sum(s.stored for s in stored),
            "storage": sorted({s.describe() for s in stored})}


def _node(name: Json, tree: Json, table: dict[str, Row], depth: int, limit: int | None,
          exact: bool) -> dict[str, Any]:
    """The JSON node of ``tree`` (a FORMAT.md tree node) named ``name`` at ``depth``."""
    (tag, body), = tree.items()
    if tag == "k":
        return {"name": name, **_leaf(table[str(body)], exact)}
    if tag == "s":  # an object saved through its state_dict(): its state, marked
        return {**_node(name, body, table, depth, limit, exact), "stateful": True}
    if tag == "c":  # a namedtuple or defaultdict: its tuple or dict, typed
        return {**_node(name, body[1], table, depth, limit, exact), "type": body[0][0]}
    named = body if tag == "d" else list(enumerate(body))
    children = [_node(k, child, table, depth + 1, limit, exact) for k, child in named]
    node: dict[str, Any] = {"name": name, "type": _CONTAINERS[tag],
                            "leaves": sum(c.get("leaves", 1) for c in children),
                            "nbytes": sum(c.get("nbytes", 0) for c in children),
                            "stored_nbytes": sum(c.get("stored_nbytes", 0) for c in children)}
    if limit is not None and depth >= limit and children:
        node["truncated"] = True
    else:
        node["children"] = children
    return node


def as_json(opened: Opened, depth: int | None = None, exact: bool = False,
            table: dict[str, Row] | None = None) -> dict[str, Any]:
    """The ``ckptio ls --json`` document (docs/CLI.md); ``table``: ``rows(opened.record)``,
    when the caller has it."""
    record = opened.record
    return {"schema": SCHEMA, "path": opened.path, "format": opened.format,
            "save_id": record.save_id, "world_size": record.world_size,
            "checksum_algorithm": record.checksum_algorithm,
            "nbytes": sum(t.nbytes for t in record.tensors),
            "stored_nbytes": stored_nbytes(record), "bases": list(bases_of(record)),
            "files": [{"name": f.name, "nbytes": f.nbytes, "rank": f.rank} for f in record.files],
            "tree": _node(None, record.tree, rows(record) if table is None else table, 0, depth,
                          exact)}


def _header(opened: Opened, table: dict[str, Row], exact: bool) -> str:
    r = opened.record
    what = {"dcp": "DCP checkpoint", "torch.save": "torch.save file",
            "safetensors": "safetensors checkpoint",
            "torch_checkpointing": "torch_checkpointing checkpoint"}.get(
        opened.format, f"ckptio checkpoint (save {r.save_id}"
        + (", dcp.save through ckptio.DcpWriter)" if "dcp" in r.meta else ")"))
    nbytes, stored = sum(t.nbytes for t in r.tensors), stored_nbytes(r)
    ntensors = sum(1 for row in table.values() if row.chunks)
    size = (lambda n: f"{n} bytes") if exact else human_size
    bases = bases_of(r)
    return (f"{opened.path}: {what} by {r.world_size} rank(s), {ntensors} tensors in "
            f"{len(r.tensors)} chunks ({size(nbytes)}, {size(stored)} stored"
            + (f", a delta against {', '.join(bases)}" if bases else "")
            + f"), {len(r.objects)} values, "
            f"{len(r.aliases)} aliases, {len(r.files)} file(s), {r.checksum_algorithm}")


def _where(node: dict[str, Any], exact: bool) -> str:
    kind = node["type"]
    if kind == "alias":
        return f"same tensor as {node['alias_of']}"
    if kind == "value":
        texts = [v["repr"] if v["rank"] is None else f"rank {v['rank']}: {v['repr']}"
                 for v in node["values"]]
        text = "; ".join(texts)
        return text if exact or len(text) <= _VALUE_WIDTH else text[:_VALUE_WIDTH - 3] + "..."
    if "leaves" in node:
        return f"{node['leaves']} leaves" + (", not shown (--depth)" if "truncated" in node else "")
    if node["ranks"] is not None:
        return f"{len(node['ranks'])} per-rank"
    return f"{node['chunks']} chunks" if node["chunks"] > 1 else ""


def _flat(node: dict[str, Any], indent: int) -> Iterator[tuple[int, dict[str, Any]]]:
    yield indent, node
    for child in node.get("children", ()):
        yield from _flat(child, indent + 1)


def _label(indent: int, node: dict[str, Any], flat: bool) -> str:
    if flat:
        return printed(str(node["key"]))
    return "  " * (indent - 1) + printed(str(node["name"])) + (
        "*" if node.get("stateful") else "")


def text_lines(opened: Opened, depth: int | None = None, exact: bool = False,
               flat: bool = False, in_bytes: bool = False,
               storage: bool = False) -> Iterator[str]:
    """``ckptio ls`` as text: a header line, then one line per tree node, nested by indent
    (``flat``: one line per leaf, named by its dotted key, for grep; ``in_bytes``: sizes in
    bytes, else as people read them; ``storage``: a STORED column, and each leaf's codecs or
    base references first in DETAIL)."""
    table = rows(opened.record)
    doc = as_json(opened, None if flat else depth, exact, table)
    yield _header(opened, table, in_bytes)
    nodes = list(_flat(doc["tree"], 0))[1:]  # the root is the header
    if flat:
        nodes = [(i, n) for i, n in nodes if "key" in n]
    width = min(60, max([len(_label(i, n, flat)) for i, n in nodes] + [4]))
    dtype_width = max([len(n.get("dtype", "")) for _i, n in nodes] + [9])
    yield (f"  {'KEY' if flat else 'NAME':{width}s} {'KIND':8s} {'DTYPE':{dtype_width}s} "
           f"{'SHAPE':16s} {'BYTES' if in_bytes else 'SIZE':>12s} "
           + (f"{'STORED':>12s} " if storage else "") + "DETAIL")
    for indent, n in nodes:
        name = _label(indent, n, flat)
        shape = str(n["shape"]) if "shape" in n else ""
        nbytes = "" if "nbytes" not in n else (
            str(n["nbytes"]) if in_bytes else human_size(n["nbytes"]))
        dtype, detail = n.get("dtype", ""), _where(n, exact)
        if n["type"] == "torch_save":  # a DCP value's torch.save bytes (uint8 is how they are kept)
            dtype, shape, detail = "", "", "a value dcp.save serialised (ckptio.load decodes it)"
        stored = ""
        if storage:
            stored = "" if "stored_nbytes" not in n else (
                str(n["stored_nbytes"]) if in_bytes else human_size(n["stored_nbytes"]))
            stored = f"{stored:>12s} "
            detail = ", ".join([*n.get("storage", ()), *([detail] if detail else [])])
        yield (f"  {name:{width}s} {n['type']:8s} {dtype:{dtype_width}s} {shape:16s} "
               f"{nbytes:>12s} {stored}{detail}").rstrip()


def run(opened: Opened, *, as_json_doc: bool, depth: int | None, exact: bool,
        flat: bool = False, in_bytes: bool = False, storage: bool = False) -> int:
    if as_json_doc:
        json.dump(as_json(opened, depth, exact), sys.stdout, indent=1)
        sys.stdout.write("\n")
        return 0
    for line in text_lines(opened, depth, exact, flat, in_bytes, storage):
        sys.stdout.write(line + "\n")
    return 0
