"""The versioned on-disk manifest: encode and decode its bytes. See docs/FORMAT.md.

Owns: the byte format of manifest.json (a header line with the magic, the version, the body's
length and CRC-32, then the JSON body), the version check, and the JSON's nesting depth (checked
before parsing, so hostile depth never reaches json's recursion). decode then hands the parsed
body to validate.from_body, which checks every field (validate.py; chunk tiling in tiling.py), so
a manifest that decodes is one a load can carry out and is trusted by every later step;
bases_and_bytes reads only a step's bases and stored bytes (a manager's retention). Pure: bytes
in, Manifest out; no file access, no pickle. Does not own: the field checks (validate.py),
whether the data files hold the bytes the manifest claims (storage/steps.py, loading/read.py).
"""

from __future__ import annotations

import json
import operator
import re
import zlib
from itertools import accumulate
from typing import Any

from ckptio.errors import ManifestError
from ckptio.format import entryform, splice, validate
from ckptio.format.check import Check
from ckptio.format.gcpause import paused
from ckptio.format.tiling import tiling_problem
from ckptio.format.types import MAX_TREE_DEPTH, Manifest, TensorEntry, show
from ckptio.format.keyrules import check_keys
from ckptio.format.validate import MAX_NDIM, check_values

# The names callers use (decode, encode, check_keys, check_values, the constants, tiling_problem)
# stay importable from here; validate.py, keyrules.py and tiling.py hold the checks themselves.
__all__ = ["MAGIC", "MANIFEST_NAME", "MAX_JSON_DEPTH", "MAX_NDIM", "MAX_TREE_DEPTH", "VERSION",
           "VERSION_CODED", "Manifest", "bases_and_bytes", "bases_of", "check_keys",
           "check_values", "decode", "encode", "json_depth", "tiling_problem", "version_for"]

MAGIC = "ckptio-manifest"
# 2: many ranks (chunks per key, per-rank entries, flat chunks, block checksums)
# 3: regular layouts described per tensor, their chunks in per-rank index files (regular_section.py)
# 4: compressed entries, references to and XOR deltas against a base checkpoint (entryform.py);
#    written only by a save holding one of them, so a plain checkpoint stays readable at 3
VERSION = 3
VERSION_CODED = entryform.VERSION_CODED
READABLE = (2, 3, 4)  # the versions decode() reads
MANIFEST_NAME = "manifest.json"
MAX_JSON_DEPTH = 3 * MAX_TREE_DEPTH + 32  # a dict level of the tree is 3 brackets deep


def version_for(tensors: tuple[TensorEntry, ...]) -> int:
    """The version a save of these entries writes: 4 if one is compressed, referenced or an
    XOR delta, else 3 (an older ckptio reads it)."""
    coded = (list(map(_STORED, tensors)).count(None) < len(tensors)  # TensorEntry.coded,
             or list(map(_DELTA, tensors)).count(None) < len(tensors))  # by map
    return VERSION_CODED if coded else VERSION


_STORED, _DELTA = operator.attrgetter("stored"), operator.attrgetter("delta")


def bases_of(manifest: Manifest) -> tuple[str, ...]:
    """The sibling checkpoints (step names) this checkpoint's entries need: its ``bases``
    (empty for a self-contained checkpoint)."""
    return manifest.bases


def encode(manifest: Manifest, templates: splice.Templates | None = None) -> bytes:
    """The manifest's bytes. With ``templates`` (the saver's), a save of a layout seen before
    splices its per-save fields into that layout's template (splice.py): the same bytes as
    encoding it in full."""
    with paused():
        text = splice.body_text(manifest) if templates is None else templates.body_text(manifest)
        body = text.encode()
    header = {"magic": MAGIC, "version": manifest.version, "body_nbytes": len(body),
              "body_crc32": zlib.crc32(body)}
    return json.dumps(header).encode() + b"\n" + body + b"\n"


def decode(data: bytes, where: str) -> Manifest:
    """Parse and fully validate; ``where`` (the manifest path) goes into every error. Raises
    ManifestError and nothing else, in time and memory linear in ``data``."""
    version, raw = _body(data, where)
    with paused():
        return validate.from_body(raw, where, version)


def bases_and_bytes(data: bytes, where: str) -> tuple[tuple[str, ...], int]:
    """A manifest's ``bases`` and the bytes its data and index files hold, with its header,
    version, length, CRC-32 and those two fields checked, and no entry validated: what a
    manager's retention asks of a step it did not save, for a fraction of decode()'s time on
    a manifest of many entries. ManifestError otherwise."""
    version, raw = _body(data, where)
    c = Check(where)
    if not isinstance(raw, dict) or raw.get("format") != "ckptio" or raw.get("version") != version:
        raise c.fail("the body is not a ckptio object of this version (format/version fields)")
    bases = tuple(c.str(b, "bases") for b in c.list(raw.get("bases", []), "bases"))
    sizes = [c.int(c.field(f, "nbytes", "file"), "file nbytes")
             for f in c.list(c.field(raw, "files", "manifest"), "files")]
    return bases, sum(sizes)


def _body(data: bytes, where: str) -> tuple[int, Any]:
    """The version and the parsed JSON body of a manifest's bytes, its header line, version,
    length, CRC-32 and nesting depth checked (ManifestError otherwise)."""
    newline = data.find(b"\n")
    header = _parse(data[:newline], 4) if newline > 0 else None
    if not isinstance(header, dict) or header.get("magic") != MAGIC:
        raise ManifestError(f"{where}: not a ckptio manifest (bad header line); the checkpoint "
                            "is damaged: load an earlier one")
    version = header.get("version")
    if version not in READABLE or type(version) is not int:
        fix = ("load it with the ckptio that wrote it and save it again"
               if type(version) is int and version < min(READABLE) else "upgrade ckptio")
        raise ManifestError(f"{where}: manifest version {show(version)}; this ckptio reads "
                            f"versions {', '.join(map(str, READABLE))}: {fix}")
    body = data[newline + 1:].rstrip(b"\n")
    if len(body) != header.get("body_nbytes") or zlib.crc32(body) != header.get("body_crc32"):
        raise ManifestError(f"{where}: manifest body is truncated or altered (length/CRC-32 "
                            "mismatch); the checkpoint is damaged: load an earlier one")
    if json_depth(body) > MAX_JSON_DEPTH:
        raise ManifestError(f"{where}: manifest body nests deeper than {MAX_JSON_DEPTH} levels, "
                            "more than a ckptio manifest can; the checkpoint is damaged or was "
                            "written by something else: load an earlier one")
    try:
        with paused():
            return version, json.loads(body)
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, an int of too many digits
        raise ManifestError(f"{where}: manifest body is not JSON ({exc}); the checkpoint is "
                            "damaged: load an earlier one") from None


def _parse(text: bytes, max_depth: int) -> Any:
    """JSON ``text`` if it is JSON nested at most ``max_depth`` deep, else None."""
    if json_depth(text) > max_depth:
        return None
    try:
        return json.loads(text)
    except ValueError:  # JSONDecodeError, UnicodeDecodeError, an int of too many digits
        return None


_NOT_MARK = bytes(b for b in range(256) if b not in b'"[]{}')
_QUOTED = re.compile(rb'"[^"]*"')
_BRACKET_STEP = tuple(1 if b in b"[{" else -1 if b in b"]}" else 0 for b in range(256))


def json_depth(text: bytes) -> int:
    """How deeply the arrays and objects of JSON ``text`` nest, found without parsing it (so a
    hostile depth never reaches json's recursion). Escaped backslashes, then escaped quotes,
    are dropped, so every quote left opens or closes a string; then all but quotes and
    brackets, then the strings (few are left that are not empty); then a running count of the
    brackets. Linear in ``text``; for text that is not JSON, a number json.loads then refuses."""
    if b"\\" in text:
        text = text.replace(b"\\\\", b"").replace(b'\\"', b"")
    marks = text.translate(None, _NOT_MARK).replace(b'""', b"")
    brackets = _QUOTED.sub(b"", marks)
    return max(accumulate(map(_BRACKET_STEP.__getitem__, brackets)), default=0)
