"""The checks every part of a manifest shares: typed fields, shapes and checksums, each failure
a ManifestError naming the manifest and saying what to do.

Owns: Check (the error's wording and the basic field types), shape_of, checksum_of. Pure. Does
not own: what each part of a manifest holds (validate.py, regular_section.py).
"""

from __future__ import annotations

import builtins
import re
from collections.abc import Iterable
from typing import Any

from ckptio.errors import ManifestError
from ckptio.format.types import show

__all__ = ["MAX_INT", "MAX_NDIM", "Check", "Span", "checksum_of", "is_checksum", "shape_of",
           "shared_bytes"]

Span = tuple[str, int, int, str]  # (file, offset, nbytes, what claims it)
MAX_INT = 1 << 62
MAX_NDIM = 128
_CHECKSUM = re.compile(r"[0-9a-f]{16}")


class Check:
    def __init__(self, where: str) -> None:
        self.where = where

    def fail(self, what: str) -> ManifestError:
        return ManifestError(f"{self.where}: {what}; the checkpoint is damaged or was written "
                             "by something else: load an earlier one")

    def int(self, value: Any, what: str) -> int:
        if type(value) is not int or not 0 <= value < MAX_INT:
            raise self.fail(f"{what} must be an integer in [0, 2^62), got {show(value)}")
        return value

    def str(self, value: Any, what: builtins.str) -> builtins.str:
        if not isinstance(value, str):
            raise self.fail(f"{what} must be a string, got {show(value)}")
        return value

    def list(self, value: Any, what: builtins.str) -> builtins.list[Any]:
        if not isinstance(value, list):
            raise self.fail(f"{what} must be a list, got {show(value)}")
        return value

    def field(self, obj: Any, name: builtins.str, what: builtins.str) -> Any:
        if not isinstance(obj, dict) or name not in obj:
            raise self.fail(f"{what} lacks field {name!r}")
        return obj[name]


def shape_of(c: Check, raw: dict[str, Any], what: str) -> tuple[int, ...]:
    """At most MAX_NDIM dims, each in [0, 2^62), whose product (zero dims counted as 1, as
    torch's strides do) stays below 2^62: a shape torch can allocate without overflow."""
    dims = c.list(c.field(raw, "shape", what), f"{what} shape")
    if len(dims) > MAX_NDIM:
        raise c.fail(f"{what}: shape has {len(dims)} dimensions, more than {MAX_NDIM}")
    shape = tuple(c.int(d, f"{what} shape") for d in dims)
    product = 1
    for d in shape:
        product *= max(d, 1)
        if product >= MAX_INT:
            raise c.fail(f"{what}: shape {shape} is too large (2^62 elements or more)")
    return shape


def is_checksum(value: Any) -> bool:
    """Whether ``value`` is a stored checksum: a string of 16 lowercase hex digits."""
    return isinstance(value, str) and _CHECKSUM.fullmatch(value) is not None


def checksum_of(c: Check, value: Any, what: str) -> str:
    checksum = c.str(value, f"{what} checksum")
    if not is_checksum(checksum):
        raise c.fail(f"{what}: checksum {show(checksum)} is not 16 hex digits")
    return checksum


def shared_bytes(spans: Iterable[Span]) -> tuple[Span, Span] | None:
    """The first two spans of one file that claim the same bytes (empty spans claim none), or
    None: a save gives every entry bytes of its own, so what a load allocates is bounded by
    the size of the data files (the manifest's and a DCP directory's checks)."""
    by_file: dict[str, list[Span]] = {}
    for span in spans:
        if span[2]:
            by_file.setdefault(span[0], []).append(span)
    for of_file in by_file.values():
        of_file.sort(key=lambda span: span[1])
        for a, b in zip(of_file, of_file[1:]):
            if b[1] < a[1] + a[2]:
                return a, b
    return None
