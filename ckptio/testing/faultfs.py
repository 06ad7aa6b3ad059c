"""A FUSE pass-through file system that fails or stalls chosen calls: faults from the kernel's
side of a save or load, not from inside the process.

    with FaultFS(tmp_path / "backing", tmp_path / "mnt") as fs:   # mnt shows backing's files
        fs.fail("fsyncdir", r"^/run/step-3$", after=("rename", r"/step-3/manifest\\.json$"))
        fs.fail("write", r"/data-", nth=2, error="enospc")    # the 2nd matching write: ENOSPC
        fs.stall("fsync", r"/step-4/data-")                   # blocks until release()
        fs.wait_stalled(10)        # -> the path of the call that is blocked now
        fs.release()               # it goes on (release("eio"): it fails)
        fs.fired()                 # [(op, path, what)] of every fault that fired

Operations: write, fsync, fsyncdir, rename (matched on its destination), read, open (a file's
open or create), unlink and rmdir. A rule counts
the calls whose path matches ``pattern`` (re.search on the path under the mount, "/" first),
from the moment it is set (with ``after``: from the first call of that op and pattern on) and
fires on the ``nth`` and the ``times - 1`` after it; then it passes calls through again.

The server runs in a process of its own (faultfs_server.py run as a script: the standard
library and mfusepy, no torch), so a fault is a real errno from a real system call, and a
stalled call blocks the caller in the kernel. Control is one socket, a JSON line per request
and answer. Owns: the client, the mount's lifetime and the rules' checks before they are sent.
Does not own: the pass-through and the rules' effect (faultfs_server.py). Test support only.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import Any

from ckptio.testing import faultfs_server
from ckptio.testing.faultfs_server import ERRNOS, OPS

__all__ = ["FaultFS", "FaultFSUnavailable", "fuse_unusable"]

START_S = 20.0  # mounting takes well under a second; a server that is not up by then is broken


class FaultFSUnavailable(RuntimeError):
    """The machine cannot mount a FUSE file system (the reason says why)."""


def fuse_unusable() -> str | None:
    """Why FUSE cannot be used here (no /dev/fuse, or it cannot be opened), or None."""
    try:
        fd = os.open("/dev/fuse", os.O_RDWR)
    except OSError as exc:
        return f"/dev/fuse is unusable here ({exc.strerror or exc}): no FUSE fault file system"
    os.close(fd)
    return None


class FaultFS:
    """The client: mounts ``backing`` at ``mountpoint`` in a server process (module docstring)."""

    def __init__(self, backing: str | os.PathLike[str], mountpoint: str | os.PathLike[str]) -> None:
        self.backing, self.mountpoint = Path(backing), Path(mountpoint)
        self._proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._lines: Any = None
        self._lock = threading.Lock()

    def __enter__(self) -> FaultFS:
        self.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def start(self) -> None:
        """Mount; FaultFSUnavailable if /dev/fuse is unusable, RuntimeError if the server fails."""
        why = fuse_unusable()
        if why is not None:
            raise FaultFSUnavailable(why)
        self.backing.mkdir(parents=True, exist_ok=True)
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        mine, theirs = socket.socketpair()
        self._proc = subprocess.Popen(
            [sys.executable, faultfs_server.__file__, str(self.backing), str(self.mountpoint),
             str(theirs.fileno())], pass_fds=[theirs.fileno()], stderr=subprocess.PIPE)
        theirs.close()
        self._sock, self._lines = mine, mine.makefile("r")
        mine.settimeout(START_S)
        try:
            ready = self._lines.readline()
        except OSError:
            ready = ""
        mine.settimeout(None)
        if ready.strip() != '"ready"':
            self.stop()
            raise RuntimeError(f"the FUSE fault server did not mount {self.mountpoint}: "
                               f"{self._stderr()}")

    def _stderr(self) -> str:
        proc = self._proc
        if proc is None or proc.stderr is None:
            return ""
        if proc.poll() is None:
            return "(still running)"
        return proc.stderr.read().decode(errors="replace")[-2000:]

    def _ask(self, request: dict[str, Any]) -> Any:
        assert self._sock is not None, "FaultFS is not started"
        with self._lock:
            self._sock.sendall((json.dumps(request) + "\n").encode())
            answer = json.loads(self._lines.readline() or "null")
        if isinstance(answer, dict) and "error" in answer:
            raise RuntimeError(f"FaultFS: {answer['error']}")
        return answer

    def fail(self, op: str, pattern: str = "", *, nth: int = 1, times: int = 1,
             error: str = "eio", after: tuple[str, str] | None = None) -> None:
        """Fail the ``nth`` matching ``op`` call (and ``times - 1`` after it) with ``error``
        ("eio", "enospc"); ``after``: count only once an (op, pattern) call was seen."""
        self._rule(op, pattern, nth, times, error, False, after)

    def stall(self, op: str, pattern: str = "", *, nth: int = 1, times: int = 1,
              after: tuple[str, str] | None = None) -> None:
        """Block the ``nth`` matching ``op`` call (and ``times - 1`` after it) until release()."""
        self._rule(op, pattern, nth, times, "eio", True, after)

    def _rule(self, op: str, pattern: str, nth: int, times: int, error: str, stall: bool,
              after: tuple[str, str] | None) -> None:
        if op not in OPS or (after is not None and after[0] not in OPS):
            raise ValueError(f"FaultFS: op must be one of {OPS}")
        if error not in ERRNOS:
            raise ValueError(f"FaultFS: error must be one of {sorted(ERRNOS)}")
        self._ask({"cmd": "rule", "op": op, "pattern": pattern, "nth": nth, "times": times,
                   "error": error, "stall": stall, "after": after})

    def wait_stalled(self, timeout: float) -> str:
        """Until a call is blocked by a stall rule -> its path; TimeoutError after ``timeout``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            stalled = self._ask({"cmd": "stalled"})
            if stalled:
                return str(stalled[0])
            time.sleep(0.02)
        raise TimeoutError(f"FaultFS: no call stalled within {timeout} s")

    def release(self, error: str | None = None) -> None:
        """Let every stalled call go on (``error``: fail them with it instead)."""
        self._ask({"cmd": "release", "error": error})

    def clear(self) -> None:
        """Drop every rule (stalled calls are released first)."""
        self._ask({"cmd": "clear"})

    def fired(self) -> list[tuple[str, str, str]]:
        """Every fault that fired: (op, path, "eio" / "enospc" / "stall")."""
        return [(str(op), str(path), str(what)) for op, path, what in self._ask({"cmd": "fired"})]

    def stop(self) -> None:
        """Release stalled calls, unmount, end the server."""
        proc, sock = self._proc, self._sock
        self._proc = self._sock = None
        if sock is not None:
            try:
                sock.sendall(b'{"cmd": "release", "error": null}\n')
            except OSError:
                pass
        if proc is not None and proc.poll() is None:
            subprocess.run(["umount", "-l", str(self.mountpoint)], capture_output=True, check=False)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if sock is not None:
            sock.close()
