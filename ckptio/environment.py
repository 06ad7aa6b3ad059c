"""The CKPTIO_* environment variables read into Options' field values.

Call order: ``Options.from_env`` calls ``read`` (each variable parsed by its field's type),
``warn_misspelt`` (a variable that nearly names a field), and ``restated`` where the values
it built are refused (the refusal then names the variable that set the value).
Owns: the variables' spelling (CKPTIO_ and the field's name in capitals), their parsing and
those messages. Does not own: the fields, their defaults or their validation (ckptio/options.py).
"""

from __future__ import annotations

import difflib
import logging
import os
from collections.abc import Mapping

from ckptio.errors import CkptError

__all__ = ["read", "restated", "variable", "warn_misspelt"]

log = logging.getLogger("ckptio")

_seen: set[str] = set()  # the CKPTIO_* variables already looked at for a misspelling


def variable(name: str) -> str:
    """The environment variable of the field ``name``."""
    return "CKPTIO_" + name.upper()


def read(fields: Mapping[str, object]) -> dict[str, object]:
    """The value of each field (name -> its annotation) that a variable sets, parsed."""
    found: dict[str, object] = {}
    for name, annotation in fields.items():
        raw = os.environ.get(variable(name))
        if raw is not None:
            found[name] = _parse(name, raw, annotation)
    return found


def restated(exc: CkptError, spelt: list[str]) -> CkptError:
    """``exc`` (an invalid option) restated naming the variable that set it: the one its
    message names, else every variable of ``spelt`` (the fields the environment set)."""
    named = [n for n in spelt if str(exc).startswith(f"Options.{n}=")] or spelt
    if not named:
        return exc
    given = ", ".join(f"{variable(n)}={os.environ[variable(n)]!r}" for n in named)
    return CkptError(f"{exc} (set by the environment: {given}; change or unset it)")


def warn_misspelt(fields: Mapping[str, object]) -> None:
    """Warn, once per variable, of a CKPTIO_* variable that names no option but nearly spells
    one (CKPTIO_IO_DEPHT): it is ignored, which would otherwise go unnoticed."""
    names = {variable(name) for name in fields}
    for var in os.environ:
        if not var.startswith("CKPTIO_") or var in names or var in _seen:
            continue
        _seen.add(var)
        near = difflib.get_close_matches(var, names, n=1, cutoff=0.85)
        if near:
            log.warning("ckptio: the environment variable %s names no option and is ignored; "
                        "did you mean %s?", var, near[0])


def _parse(name: str, raw: str, annotation: object) -> object:
    kind = str(annotation)
    if kind == "int | None":
        if raw.lower() in ("", "none", "auto"):
            return None
        kind = "int"
    if kind == "int":
        try:
            return int(raw)
        except ValueError:
            raise CkptError(f"environment {variable(name)}={raw!r}: expected an integer") from None
    if kind == "float":
        try:
            return float(raw)
        except ValueError:
            raise CkptError(f"environment {variable(name)}={raw!r}: expected a number") from None
    if kind == "bool":
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off"):
            return False
        raise CkptError(f"environment {variable(name)}={raw!r}: expected 1/0 or true/false")
    return raw
