"""How a ``ckptio`` command's output ends early: the signal a command raises when the reader
of stdout has left, caught by ``ckptio.cli.main`` (which exits quietly with its status).

Owns: that signal. Does not own: the commands (cli/commands.py) or main (cli/__init__.py).
"""

from __future__ import annotations

__all__ = ["OutputClosed"]


class OutputClosed(Exception):  # noqa: N818 - a signal to main, not an error
    """The reader of stdout left while a command whose exit status is already known (diff)
    was printing: main exits quietly with ``status``."""

    def __init__(self, status: int) -> None:
        super().__init__(status)
        self.status = status
