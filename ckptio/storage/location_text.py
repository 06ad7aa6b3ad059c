"""A checkpoint location as the user wrote it, checked before any store is chosen.

``location_text`` turns a path or URL argument into its text (a state passed where the path
goes is refused, naming the argument order); ``refuse_unexpanded`` refuses a local path that
is empty or begins with '~' (no shell expanded it: a folder '~' would be made in the working
directory). Called by select.checkpoint_path for every location.

Owns: these checks and their messages. Does not own: schemes and their registry (select.py).
"""

from __future__ import annotations

import os

from ckptio.errors import CkptError, UnsupportedPathError

__all__ = ["location_text", "refuse_unexpanded"]


def location_text(path: str | os.PathLike[str]) -> str:
    """The text of a location argument (str, bytes or os.PathLike); CkptError otherwise."""
    if not isinstance(path, (str, bytes, os.PathLike)):
        raise CkptError(
            f"a checkpoint location is a path or URL (str or os.PathLike), not a "
            f"{type(path).__name__}: the state goes first in ckptio.save(state, path) and "
            "second in ckptio.load(path, state)")
    text = os.fspath(path)
    return os.fsdecode(text) if isinstance(text, bytes) else text


def refuse_unexpanded(text: str) -> None:
    """An empty path, or one beginning with '~' (which no shell expanded: ckptio would make a
    local folder '~' here), is refused naming what to write."""
    if not text:
        raise UnsupportedPathError("an empty path: name the checkpoint's directory (or file)")
    if text.startswith("~"):
        raise UnsupportedPathError(
            f"{text}: begins with '~', which ckptio does not expand (it would make a folder "
            f"'~' in the working directory); pass os.path.expanduser({text!r}), or ./{text} "
            "for a folder so named")
