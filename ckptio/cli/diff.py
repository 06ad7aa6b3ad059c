"""``ckptio diff A B [--data]``: what differs between two checkpoints.

Owns: comparing two manifests key by key (keys only in A or only in B; kind, dtype and shape
changes; changed inline values and alias targets), tensors by their stored checksums when both
use the same algorithm and the same chunks (no data read, no torch), and with ``--data``
reading every global tensor of both (checksums verified) and reporting the largest absolute
and relative differences. Does not own: opening manifests (cli/source.py) or reading data (ckptio.load).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ckptio.cli.pipe import OutputClosed
from ckptio.cli.source import Opened, Row, printed, rows, shown
from ckptio.format.checksum import NO_CHECKSUM
from ckptio.format.param_names import is_marker
from ckptio.format.types import Json

if TYPE_CHECKING:
    import torch

__all__ = ["AUTO_DATA_NBYTES", "Change", "Diff", "compare", "compared_how", "data_changes",
           "not_compared", "report"]

BATCH_NBYTES = 256 << 20  # --data reads this much of each side at a time
# tensors checksums cannot compare are read without --data up to this much a side (seconds)
AUTO_DATA_NBYTES = 1 << 30
SLICE = 1 << 22  # --data compares this many elements at a time (32 MiB per float64 operand)


@dataclass(frozen=True)
class Change:
    """One line of the diff: ``mark`` is - (only in A), + (only in B), ~ (differs) or ?
    (not settled without --data)."""

    mark: str
    key: str
    text: str


@dataclass
class Diff:
    changes: list[Change]
    unsettled: list[Row]  # A's rows of tensors the checksums cannot compare (--data reads them)


def _what(row: Row) -> str:
    if row.kind == "value":
        return "value " + "; ".join(shown(o.value) for o in row.objects)
    if row.kind == "alias":
        return f"alias of {row.alias_of}"
    return f"{row.kind} {row.dtype} {list(row.shape)}"


def _layout(row: Row) -> dict[tuple[object, ...], str]:
    """Each stored piece of a tensor row (rank, chunk) -> its checksum."""
    return {(e.rank, e.chunk.offsets, e.chunk.sizes, e.chunk.flat): e.checksum
            for e in row.chunks}


def _tensor_change(a: Row, b: Row, same_algorithm: bool, data: bool) -> Change | None | Row:
    """A change for two tensor rows of the same kind, dtype and shape; None if the same; the
    row itself if the checksums cannot tell, or ``data`` asks for every global tensor to be
    read (its checksums verified, so a damaged file is not "the same")."""
    if data and a.kind == "tensor" and a.ranks is None:
        return a
    la, lb = _layout(a), _layout(b)
    if not same_algorithm or la.keys() != lb.keys():
        return a
    differing = sum(la[piece] != lb[piece] for piece in la)
    if not differing:
        return None
    return Change("~", a.key, f"data differs ({differing} of {len(la)} chunks' checksums)")


def _pair(a: Row, b: Row, same_algorithm: bool, data: bool) -> Change | None | Row:
    key = a.key
    if a.kind != b.kind:
        return Change("~", key, f"kind {_what(a)} -> {_what(b)}")
    if a.kind == "value":
        va = [(o.rank, o.value) for o in a.objects]
        vb = [(o.rank, o.value) for o in b.objects]
        return None if va == vb else Change("~", key, f"{_what(a)} -> {_what(b)}")
    if a.kind == "alias":
        return None if a.alias_of == b.alias_of else Change(
            "~", key, f"alias of {a.alias_of} -> alias of {b.alias_of}")
    if a.dtype != b.dtype:
        return Change("~", key, f"dtype {a.dtype} -> {b.dtype}")
    if a.shape != b.shape:
        return Change("~", key, f"shape {list(a.shape)} -> {list(b.shape)}")
    if (a.ranks is None) != (b.ranks is None):
        return Change("~", key, "per-rank in one, one global tensor in the other")
    return _tensor_change(a, b, same_algorithm, data)


_NAMES = {"d": "dict", "l": "list", "t": "tuple", "s": "state_dict"}


def _nesting(tree: Json, above: tuple[str, ...] = ()) -> Iterator[tuple[str, tuple[str, ...]]]:
    """Each leaf key of a FORMAT.md tree with the containers holding it, outermost first."""
    (tag, body), = tree.items()
    if tag == "k":
        yield str(body), above
    elif tag == "s":
        yield from _nesting(body, (*above, _NAMES[tag]))
    elif tag == "c":  # a namedtuple or defaultdict: named by its type, not "tuple" or "dict"
        for key, inner in _nesting(body[1], above):
            yield key, (*above, body[0][0], *inner[len(above) + 1:])
    else:
        for _name, child in body if tag == "d" else enumerate(body):
            yield from _nesting(child, (*above, _NAMES[tag]))


def _nesting_changes(a: Opened, b: Opened) -> list[Change]:
    """Keys held in other containers (a tuple that became a list, a dict no longer saved
    through its state_dict()). Between formats (a checkpoint and its conversion) the
    state_dict() mark is not compared: only ckptio's format records it."""
    na, nb = dict(_nesting(a.record.tree)), dict(_nesting(b.record.tree))
    if a.format != b.format:
        na, nb = _unmarked(na), _unmarked(nb)
    return [Change("~", key, f"nesting {'/'.join(na[key])} -> {'/'.join(nb[key])}")
            for key in na if key in nb and na[key] != nb[key]]


def _unmarked(nesting: dict[str, tuple[str, ...]]) -> dict[str, tuple[str, ...]]:
    """The nesting without the state_dict() marks."""
    return {key: tuple(n for n in above if n != _NAMES["s"]) for key, above in nesting.items()}


def compare(a: Opened, b: Opened, data: bool = False) -> Diff:
    """Every difference the manifests show; tensors whose checksums cannot be compared (another
    algorithm or chunking) are left in ``unsettled``, and with ``data`` those whose checksums
    differ too (data_changes reads them)."""
    ra, rb = ({k: r for k, r in rows(x.record).items() if not is_marker(k)}  # not state
              for x in (a, b))
    same_algorithm = (a.record.checksum_algorithm == b.record.checksum_algorithm
                      and a.record.checksum_algorithm != NO_CHECKSUM)  # safetensors: no checksums
    changes = [Change("-", k, f"only in A: {_what(r)}") for k, r in ra.items() if k not in rb]
    changes += [Change("+", k, f"only in B: {_what(r)}") for k, r in rb.items() if k not in ra]
    changes += _nesting_changes(a, b)
    unsettled: list[Row] = []
    for key in (k for k in ra if k in rb):
        found = _pair(ra[key], rb[key], same_algorithm, data)
        if isinstance(found, Change):
            changes.append(found)
        elif isinstance(found, Row):
            unsettled.append(found)
    return Diff(changes, unsettled)


def _batches(unsettled: list[Row]) -> Iterator[list[Row]]:
    batch: list[Row] = []
    held = 0
    for row in unsettled:
        if batch and held + row.nbytes > BATCH_NBYTES:
            yield batch
            batch, held = [], 0
        batch.append(row)
        held += row.nbytes
    if batch:
        yield batch


def _loaded(path: str, batch: list[Row]) -> dict[str, torch.Tensor]:
    """The tensors of ``batch`` read from ``path`` (plain tensors; other kinds as loaded)."""
    import torch

    import ckptio
    from ckptio.io.buffers import torch_dtype

    state = {r.key: torch.empty(r.shape, dtype=torch_dtype(r.dtype)) for r in batch}
    wanted = set(state)
    ckptio.load(path, state, keys=lambda key: key in wanted)
    return state


def _worse(x: float, y: float) -> float:
    return math.nan if math.isnan(x) or math.isnan(y) else max(x, y)


def _gaps(da: torch.Tensor, db: torch.Tensor) -> tuple[float, float, int]:
    """Largest |a - b|, largest |a - b| / |b| (inf where b is 0) and how many elements differ
    (NaN equals NaN)."""
    import torch

    differ = ~((da == db) | (torch.isnan(da) & torch.isnan(db)))
    count = int(differ.sum())
    if not count:
        return 0.0, 0.0, 0
    gap = (da[differ] - db[differ]).abs()
    scale = db[differ].abs()
    rel = torch.where(scale > 0, gap / scale, torch.full_like(gap, math.inf))
    return gap.max().item(), rel.max().item(), count


def _numbers(a: torch.Tensor, b: torch.Tensor) -> str | None:
    """None if ``a`` and ``b`` hold the same bits; else the largest differences, computed
    SLICE elements at a time (memory: a few times SLICE float64s, whatever the tensor)."""
    import torch

    fa, fb = a.reshape(-1), b.reshape(-1)
    if torch.equal(fa.view(torch.uint8), fb.view(torch.uint8)):  # bit for bit
        return None
    wide = torch.complex128 if fa.is_complex() else torch.float64
    worst_abs = worst_rel = 0.0
    count = 0
    for start in range(0, fa.numel(), SLICE):
        part = slice(start, start + SLICE)
        gap, rel, n = _gaps(fa[part].to(wide), fb[part].to(wide))
        worst_abs, worst_rel, count = _worse(worst_abs, gap), _worse(worst_rel, rel), count + n
    if not count:
        return "bits differ, values equal (0.0 and -0.0, or NaN payloads)"
    return (f"data differs: max abs diff {worst_abs:.6g}, max rel diff {worst_rel:.6g} "
            f"({count} of {fa.numel()} elements)")


def data_changes(a: Opened, b: Opened, unsettled: list[Row],
                 progress: Callable[[int], None]) -> list[Change]:
    """Read both sides of each unsettled tensor (a batch at a time) and compare them."""
    changes = [Change("?", r.key, f"not compared: --data reads global tensors, not a {r.kind}"
                      f"{' saved per rank' if r.ranks is not None else ''}")
               for r in unsettled if r.kind != "tensor" or r.ranks is not None]
    readable = [r for r in unsettled if r.kind == "tensor" and r.ranks is None]
    for batch in _batches(readable):
        nbytes = sum(r.nbytes for r in batch)
        la = _loaded(a.path, batch)
        progress(nbytes)
        lb = _loaded(b.path, batch)
        progress(nbytes)
        for row in batch:
            text = _numbers(la[row.key], lb[row.key])
            if text is not None:
                changes.append(Change("~", row.key, text))
    return changes


def _why(a: Opened, b: Opened) -> str:
    """Why checksums cannot compare the tensors of ``a`` and ``b``."""
    algorithms = {a.record.checksum_algorithm, b.record.checksum_algorithm}
    return ("no stored checksums" if NO_CHECKSUM in algorithms else
            f"other checksum algorithms ({' vs '.join(sorted(algorithms))})"
            if len(algorithms) > 1 else "other chunks")


def compared_how(a: Opened, b: Opened, read: int) -> str:
    """The summary's words for a diff that read ``read`` tensors checksums could not compare."""
    return (f"{read} tensor(s) compared by their data ({_why(a, b)}), the rest by stored "
            "checksums")


def not_compared(a: Opened, b: Opened, unsettled: list[Row]) -> list[Change]:
    """Tensors the checksums could not settle and too large to read without --data: one ``?``
    line for all of them, saying why and which flag compares them."""
    keys = [r.key for r in unsettled]
    some = ", ".join(keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")
    nbytes = sum(r.nbytes for r in unsettled)
    return [Change("?", some, f"{len(keys)} tensor(s), {nbytes / 2**30:.1f} GiB a side, not "
                   f"compared: {_why(a, b)}; ckptio diff --data reads and compares them")]


def report(a: Opened, b: Opened, changes: list[Change], how: str | None = None) -> int:
    """Print one line per change and a summary (``how``: what was read; None: stored checksums
    only); -> the exit status (0 the same, 1 not), also when the reader of stdout leaves early
    (OutputClosed)."""
    status = 1 if changes else 0
    width = min(60, max([len(printed(c.key)) for c in changes] + [3]))
    unsure = [c for c in changes if c.mark == "?"]
    how = how or "by stored checksums, data not read: --data reads and verifies it"
    settled = (f"the same ({how})" if not changes else f"{len(changes) - len(unsure)} "
               "difference(s)" + (", some tensors not compared (see the ? lines)" if unsure
                                  else ""))
    try:
        for c in changes:
            sys.stdout.write(f"{c.mark} {printed(c.key):{width}s} {c.text}\n")
        sys.stdout.write(f"{a.path} vs {b.path}: {settled}\n")
        sys.stdout.flush()
    except BrokenPipeError:
        raise OutputClosed(status) from None
    return status
