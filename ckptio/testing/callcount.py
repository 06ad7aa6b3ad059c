"""Counting the Python a save runs, per thread: function calls (Python frames entered, and
calls of built-in functions) seen by the interpreter's profile hook, which a loaded machine
does not change, unlike a timer.

    calls = CallCounts()
    calls.install()                 # before the threads to count start (a Checkpointer's
    ...                             # workers start with its first save)
    before = calls.snapshot(); mgr.save(...); after = calls.snapshot()
    calls.uninstall()

Owns: the hook and its counters (one per thread, by its name then: ``MainThread``,
``ckptio-save``, ...). Test and benchmark support only: it sets the profile hook of this
thread and of threads started while installed (``threading.setprofile``).
"""

from __future__ import annotations

import sys
import threading
from collections import Counter
from types import FrameType
from typing import Any

__all__ = ["CallCounts", "Snapshot", "since"]

Snapshot = dict[tuple[str, str], int]  # (thread name, "ckptio" or "other") -> calls


class CallCounts:
    """Calls seen since install(), per thread name and by where the calling code lives (a
    file of the ckptio package, or anything else: torch, the standard library, the caller)."""

    def __init__(self, *, by_function: bool = False) -> None:
        self._counts: Counter[tuple[int, bool]] = Counter()
        self._names: dict[int, str] = {}
        self._functions: Counter[tuple[int, bool, str]] | None = (Counter() if by_function
                                                                  else None)
        self._ours: dict[str, bool] = {}
        self._reading: int | None = None  # the thread reading the counters: not counted then

    def install(self) -> None:
        """Count from now on, in this thread and in threads started from now on."""
        sys.setprofile(self._hook)
        threading.setprofile(self._hook)

    def uninstall(self) -> None:
        sys.setprofile(None)
        threading.setprofile(None)

    def _hook(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call" and event != "c_call":
            return
        tid = threading.get_ident()
        if tid == self._reading:
            return
        if tid not in self._names:
            self._names[tid] = threading.current_thread().name
        file = frame.f_code.co_filename
        if file == __file__:  # the counters' own reading
            return
        ours = self._ours.get(file)
        if ours is None:
            ours = self._ours[file] = "/ckptio/" in file.replace("\\", "/")
        self._counts[tid, ours] += 1
        if self._functions is not None:
            code, where = frame.f_code, file.rsplit("/", 1)[-1]
            name = (f"{where}:{code.co_name}:{code.co_firstlineno}" if event == "call" else
                    f"{getattr(arg, '__qualname__', arg)!s} (from {where}:{code.co_name})")
            self._functions[tid, ours, name] += 1

    def snapshot(self) -> Snapshot:
        """The calls so far: (thread name, "ckptio" / "other") -> count (threads of one name
        summed)."""
        self._reading = threading.get_ident()
        try:
            out: Snapshot = {}
            for (tid, ours), count in list(self._counts.items()):
                key = (self._names.get(tid, "?"), "ckptio" if ours else "other")
                out[key] = out.get(key, 0) + count
            return out
        finally:
            self._reading = None

    def functions(self) -> Counter[tuple[str, str, str]]:
        """(thread name, "ckptio" / "other", function) -> calls so far (``by_function=True``
        only; a function is ``file:name:line`` entered, or ``builtin (from file:caller)``)."""
        self._reading = threading.get_ident()
        try:
            out: Counter[tuple[str, str, str]] = Counter()
            for (tid, ours, name), count in list((self._functions or {}).items()):
                out[self._names.get(tid, "?"), "ckptio" if ours else "other", name] += count
            return out
        finally:
            self._reading = None


def since(before: Snapshot, after: Snapshot) -> Snapshot:
    """The calls between two snapshots."""
    return {key: after[key] - before.get(key, 0) for key in after
            if after[key] != before.get(key, 0)}
