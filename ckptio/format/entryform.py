"""Version 4's entry forms: compressed (``stored``), referenced (``ref``) and XOR-delta (``xor``)
tensor entries, and the body's ``bases``. See docs/FORMAT.md.

Owns: their JSON (written by manifest.encode and by a rank's result on the wire), their checks
on a hostile manifest (a reader refuses frames that do not sum to the stored length, a frame
longer than its logical bytes, a codec it does not know or whose byte groups do not fit the
dtype, a reference to a checkpoint not in ``bases``, ``bases`` not naming exactly the
checkpoints referenced, version 4 fields in an older version), and ``VERSION_CODED``: the version
a manifest holding any of them is written as. Pure and torch-free.
Does not own: the codecs (codec.py), the other fields' checks (validate.py), reading bytes.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from ckptio.format import codec
from ckptio.format.check import Check
from ckptio.format.types import DTYPE_ITEMSIZE, Delta, Stored, TensorEntry, show

__all__ = ["DELTA_KINDS", "STEP_NAME", "VERSION_CODED", "bases_in", "check_bases", "entry_json",
           "frame_count", "parse_entry"]

VERSION_CODED = 4  # a manifest with a compressed, referenced or XOR entry
DELTA_KINDS = ("ref", "xor")
STEP_NAME = re.compile(r"[A-Za-z0-9._-]{1,200}")  # a sibling checkpoint: a plain name


def frame_count(nbytes: int, block_nbytes: int) -> int:
    """How many frames an entry of ``nbytes`` logical bytes is cut into (0 for none)."""
    return -(-nbytes // block_nbytes)


def entry_json(t: TensorEntry) -> dict[str, Any]:
    """The version 4 fields of entry ``t`` (empty for a plain entry)."""
    out: dict[str, Any] = {}
    if t.stored is not None:
        out["stored"] = {"codec": t.stored.codec, "nbytes": t.stored.nbytes,
                         "frames": list(t.stored.frames)}
    if t.delta is not None:
        out[t.delta.kind] = {"checkpoint": t.delta.checkpoint}
    return out


def parse_entry(c: Check, raw: dict[str, Any], what: str, *, version: int, dtype: str,
                nbytes: int, block_nbytes: int) -> tuple[Stored | None, Delta | None]:
    """The entry's ``stored`` and ``ref`` / ``xor`` fields, checked (ManifestError otherwise)."""
    present = [name for name in ("stored", *DELTA_KINDS) if name in raw]
    if present and version < VERSION_CODED:
        raise c.fail(f"{what}: field {present[0]!r} exists from version {VERSION_CODED}, not in a "
                     f"version {version} manifest")
    deltas = [kind for kind in DELTA_KINDS if kind in raw]
    if len(deltas) > 1:
        raise c.fail(f"{what}: an entry is a 'ref' or an 'xor', not both")
    delta = None
    if deltas:
        body = raw[deltas[0]]
        if not isinstance(body, dict):
            raise c.fail(f"{what}: {deltas[0]!r} must be an object")
        name = c.str(c.field(body, "checkpoint", what), f"{what} {deltas[0]} checkpoint")
        if not STEP_NAME.fullmatch(name) or name in (".", ".."):
            raise c.fail(f"{what}: {deltas[0]} checkpoint {show(name)} is not a plain name")
        delta = Delta(deltas[0], name)
    stored = _stored(c, raw["stored"], what, dtype, nbytes, block_nbytes) if "stored" in raw else None
    return stored, delta


def _stored(c: Check, raw: Any, what: str, dtype: str, nbytes: int,
            block_nbytes: int) -> Stored:
    if not isinstance(raw, dict):
        raise c.fail(f"{what}: 'stored' must be an object")
    name = c.str(c.field(raw, "codec", what), f"{what} stored codec")
    if not codec.is_stored_name(name):
        raise c.fail(f"{what}: codec {show(name)} is unknown to this ckptio (it reads "
                     f"{', '.join(codec.CODECS)}): upgrade ckptio")
    group = codec.group_of(name)
    if group > 1 and group != DTYPE_ITEMSIZE[dtype]:
        raise c.fail(f"{what}: codec {name} groups {group} bytes, but {dtype} elements have "
                     f"{DTYPE_ITEMSIZE[dtype]}")
    total = c.int(c.field(raw, "nbytes", what), f"{what} stored nbytes")
    frames = tuple(c.int(f, f"{what} stored frames")
                   for f in c.list(c.field(raw, "frames", what), f"{what} stored frames"))
    if nbytes == 0 or len(frames) != frame_count(nbytes, block_nbytes):
        raise c.fail(f"{what}: {len(frames)} stored frames for {nbytes} bytes in frames of "
                     f"{block_nbytes}")
    for i, f in enumerate(frames):
        logical = min(block_nbytes, nbytes - i * block_nbytes)
        if not 0 < f <= logical:
            raise c.fail(f"{what}: stored frame {i} has {f} bytes for {logical} logical bytes")
    if sum(frames) != total:
        raise c.fail(f"{what}: stored frames sum to {sum(frames)} bytes, not stored nbytes "
                     f"{total}")
    return Stored(name, total, frames)


def bases_in(entries: Iterable[TensorEntry]) -> tuple[str, ...]:
    """The sorted, unique checkpoints ``entries`` reference (the body's ``bases``)."""
    return tuple(sorted({t.delta.checkpoint for t in entries if t.delta is not None}))


def check_bases(c: Check, raw: dict[str, Any], version: int,
                tensors: tuple[TensorEntry, ...]) -> tuple[str, ...]:
    """The body's ``bases``: sorted, unique, exactly the checkpoints the entries reference."""
    if "bases" not in raw:
        listed: tuple[str, ...] = ()
    elif version < VERSION_CODED:
        raise c.fail(f"field 'bases' exists from version {VERSION_CODED}, not in a version "
                     f"{version} manifest")
    else:
        listed = tuple(c.str(b, "bases") for b in c.list(raw["bases"], "bases"))
    if list(listed) != sorted(set(listed)):
        raise c.fail(f"bases {show(list(listed))} must be sorted and unique")
    used = bases_in(tensors)
    if listed != used:
        missing = sorted(set(used) - set(listed))
        if missing:
            raise c.fail(f"an entry references checkpoint {missing[0]!r}, which is not in bases")
        raise c.fail(f"bases lists {sorted(set(listed) - set(used))[0]!r}, which no entry "
                     "references")
    return listed
