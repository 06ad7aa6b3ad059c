"""``torch_save`` entries (DCP BYTE_IO items written through ``ckptio.DcpWriter``) turned into
the values and containers a load hands out.

A ``torch_save`` entry holds the bytes DCP's planner made with ``torch.save(value)``, kept
verbatim (a DCP reader gets them back as they were). A load reads every such entry up front
(they are small: optimizer hyper-parameters, Python numbers and containers), through the
caller's verified reads, decodes it with ``torch.load(weights_only=True)`` (``weights_only=False``
only with ``allow_pickle=True``), and expands it by ckptio's flatten rules
(``foreign_common.expand_value``): a DCP ``optim.param_groups.0.betas`` tuple becomes the keys
``...betas.0`` and ``...betas.1`` a caller's state flattens to. The result is a Manifest with
those values inline and the tree nodes replaced, so fill.py loads it unchanged. A value that
loads only by unpickling stays an entry (kind ``torch_pickle``), refused without allow_pickle
by the load that asks for its key, naming it: the other keys load.

Owns: the decoding and the rewrite of the manifest. Does not own: reading and checking bytes
(read.py, through ``read``), the expansion rules (foreign_common.py), matching keys (matching.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from ckptio.errors import ManifestError
from ckptio.format import keyrules, validate
from ckptio.format.types import Json, Manifest, ObjectEntry, Read, TensorEntry
from ckptio.loading.foreign_common import TORCH_PICKLE, torch_load_value, value_node

__all__ = ["TORCH_SAVE", "expand_torch_save", "replace_nodes"]

TORCH_SAVE = "torch_save"
ReadFn = Callable[[list[Read]], int]  # the load's reads: checksums verified


def expand_torch_save(record: Manifest, read: ReadFn, *, where: str,
                      allow_pickle: bool = False) -> Manifest:
    """``record`` with every ``torch_save`` entry read, decoded and expanded into inline
    values and tree nodes (``record`` itself when it has none). ``where`` names the checkpoint
    in errors."""
    stored = [e for e in record.tensors if e.kind == TORCH_SAVE]
    if not stored:
        return record
    per_rank = [e.key for e in stored if e.rank is not None]
    if per_rank:
        raise ManifestError(f"{where}: keys {per_rank[:5]} are per-rank torch_save values, which "
                            "no ckptio writer makes; the manifest is damaged or from a newer "
                            "ckptio: upgrade ckptio")
    reads = [Read.of(e, torch.empty(e.nbytes, dtype=torch.uint8)) for e in stored]
    read(reads)
    objects: list[ObjectEntry] = list(record.objects)
    nodes: dict[str, Json] = {}
    kept: dict[str, TensorEntry] = {}  # values that load only by unpickling: left to the load
    for entry, done in zip(stored, reads):
        what = f"{where}: key {entry.key!r} (torch.save bytes in {entry.file})"
        raw = done.dest.numpy().tobytes()
        node = value_node(lambda: torch_load_value(raw, what, allow_pickle), entry.key, objects,
                          allow_pickle)
        if node is None:
            kept[entry.key] = dataclasses.replace(entry, kind=TORCH_PICKLE)
        else:
            nodes[entry.key] = node
    expanded = dataclasses.replace(
        record, tensors=tuple(kept.get(e.key, e) for e in record.tensors
                              if e.kind != TORCH_SAVE or e.key in kept),
        objects=tuple(objects), tree=replace_nodes(record.tree, nodes))
    keyrules.check_keys(expanded, where)
    validate.check_values(expanded, where)
    return expanded


def replace_nodes(node: Json, nodes: dict[str, Json]) -> Json:
    """``node`` with each leaf ``{"k": key}`` of ``nodes`` replaced by ``nodes[key]``."""
    if not isinstance(node, dict) or len(node) != 1:
        return node  # keyrules.check_keys reports a malformed tree
    (tag, body), = node.items()
    if tag == "k":
        return nodes.get(body, node) if isinstance(body, str) else node
    if tag == "s":
        return {"s": replace_nodes(body, nodes)}
    if tag == "c" and isinstance(body, list) and len(body) == 2:
        return {"c": [body[0], replace_nodes(body[1], nodes)]}
    if tag == "d" and isinstance(body, list):
        return {"d": [[pair[0], replace_nodes(pair[1], nodes)] if isinstance(pair, list) and len(pair) == 2
                      else pair for pair in body]}
    if tag in ("l", "t") and isinstance(body, list):
        return {tag: [replace_nodes(child, nodes) for child in body]}
    return node
