"""A FUSE pass-through file system that fails or stalls chosen calls: faults from the kernel's
side of a save or load, not from inside the process.

    with FaultFS(tmp_path / "backing", tmp_path / "mnt") as fs:   # mnt shows backing's files
        fs.fail("fsyncdir", r"^/run/step-3$", after=("rename", r"/step-3/manifest\\.json$"))
        fs.fail("write", r"/data-", nth=2, error="enospc")    # the 2nd matching write: ENOSPC
        fs.stall("fsync", r"/step-4/data-")                   # blocks until release()
        fs.wait_stalled(10)        # -> the path of the call that is blocked now
        fs.release()               # it goes on (release("eio"): it fails)
        fs.fired()                 # [(op, path, what)] of every fault that fired

Operations: write, fsync, fsyncdir, rename (matched on its destination) and read. A rule counts
the calls whose path matches ``pattern`` (re.search on the path under the mount, "/" first),
from the moment it is set (with ``after``: from the first call of that op and pattern on) and
fires on the ``nth`` and the ``times - 1`` after it; then it passes calls through again.

The server runs in a process of its own (this file run as a script: the standard library and
mfusepy, no torch), so a fault is a real errno from a real system call, and a stalled call
blocks the caller in the kernel. Control is one socket, a JSON line per request and answer.
Owns: the mount, its pass-through and rules. Test support only.
"""

from __future__ import annotations

import errno
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

__all__ = ["FaultFS", "FaultFSUnavailable", "fuse_unusable"]

OPS = ("write", "fsync", "fsyncdir", "rename", "read")
ERRNOS = {"eio": errno.EIO, "enospc": errno.ENOSPC}
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
            [sys.executable, __file__, str(self.backing), str(self.mountpoint),
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


# ---------------------------------------------------------------------- the server process


class _Rule:
    def __init__(self, spec: dict[str, Any]) -> None:
        self.op, self.pattern = spec["op"], re.compile(spec["pattern"])
        self.nth, self.times = int(spec["nth"]), int(spec["times"])
        self.errno, self.stall = ERRNOS[spec["error"]], bool(spec["stall"])
        after = spec.get("after")
        self.after = None if after is None else (after[0], re.compile(after[1]))
        self.count = self.fired = 0


class _Rules:
    """The server's rules, stalled calls and faults fired (one lock)."""

    def __init__(self) -> None:
        self.lock = threading.Condition()
        self.rules: list[_Rule] = []
        self.stalled: list[str] = []
        self.fired: list[tuple[str, str, str]] = []
        self.release_epoch, self.release_errno = 0, 0

    def check(self, op: str, path: str) -> None:
        """Raise the errno a rule gives this call, or block while a stall rule holds it."""
        with self.lock:
            for rule in self.rules:
                if rule.after is not None and rule.after[0] == op and rule.after[1].search(path):
                    rule.after = None  # armed: counts from the next call on
                    if rule.op == op:
                        continue
                if rule.after is not None or rule.op != op or not rule.pattern.search(path):
                    continue
                rule.count += 1
                if rule.count >= rule.nth and rule.fired < rule.times:
                    rule.fired += 1
                    self.fired.append((op, path, "stall" if rule.stall else _name(rule.errno)))
                    if rule.stall:
                        self._block(path)
                    else:
                        raise OSError(rule.errno, os.strerror(rule.errno))

    def _block(self, path: str) -> None:
        epoch = self.release_epoch
        self.stalled.append(path)
        try:
            while self.release_epoch == epoch:
                self.lock.wait()
        finally:
            self.stalled.remove(path)
        if self.release_errno:
            raise OSError(self.release_errno, os.strerror(self.release_errno))

    def command(self, request: dict[str, Any]) -> Any:
        with self.lock:
            cmd = request["cmd"]
            if cmd == "rule":
                self.rules.append(_Rule(request))
            elif cmd == "stalled":
                return list(self.stalled)
            elif cmd in ("release", "clear"):
                self.release_epoch += 1
                self.release_errno = ERRNOS[request["error"]] if request.get("error") else 0
                self.lock.notify_all()
                if cmd == "clear":
                    self.rules = []
            elif cmd == "fired":
                return self.fired
            else:
                return {"error": f"unknown command {cmd!r}"}
            return True


def _name(code: int) -> str:
    return next(k for k, v in ERRNOS.items() if v == code)


def _serve(backing: str, mountpoint: str, control: socket.socket) -> None:
    import mfusepy  # the server's only dependency beyond the standard library

    rules = _Rules()
    send = threading.Lock()

    def say(answer: Any) -> None:
        with send:
            control.sendall((json.dumps(answer) + "\n").encode())

    def listen() -> None:
        for line in control.makefile("r"):
            say(rules.command(json.loads(line)))
        rules.command({"cmd": "release", "error": None})  # the client is gone: nothing blocks
        subprocess.run(["umount", "-l", mountpoint], capture_output=True, check=False)

    def mounted() -> None:
        threading.Thread(target=listen, daemon=True).start()
        say("ready")

    ops = _passthrough(mfusepy, backing, rules, mounted)
    mfusepy.FUSE(ops, mountpoint, foreground=True, nothreads=False)


def _passthrough(mfusepy: Any, root: str, rules: _Rules, on_mount: Callable[[], None]) -> Any:
    """The Operations: every call on the backing directory, the rules checked first."""

    def real(path: str) -> str:
        return os.path.join(root, path.lstrip("/"))

    class Passthrough(mfusepy.Operations):
        use_ns = True

        def init(self, path: str) -> None:
            on_mount()

        def getattr(self, path: str, fh: int | None = None) -> dict[str, Any]:
            st = os.lstat(real(path))
            keys = ("st_mode", "st_nlink", "st_uid", "st_gid", "st_size", "st_atime_ns",
                    "st_mtime_ns", "st_ctime_ns")
            out = {k.removesuffix("_ns"): getattr(st, k) for k in keys}
            return out

        def access(self, path: str, amode: int) -> int:
            if not os.access(real(path), amode):
                raise mfusepy.FuseOSError(errno.EACCES)
            return 0

        def chmod(self, path: str, mode: int) -> int:
            os.chmod(real(path), mode)
            return 0

        def chown(self, path: str, uid: int, gid: int) -> int:
            os.chown(real(path), uid, gid)
            return 0

        def create(self, path: str, mode: int, fi: Any = None) -> int:
            return os.open(real(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)

        def open(self, path: str, flags: int) -> int:
            return os.open(real(path), flags & ~os.O_DIRECT & ~os.O_CREAT & ~os.O_EXCL)

        def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
            rules.check("read", path)
            return os.pread(fh, size, offset)

        def write(self, path: str, data: bytes, offset: int, fh: int) -> int:
            rules.check("write", path)
            return os.pwrite(fh, data, offset)

        def truncate(self, path: str, length: int, fh: int | None = None) -> int:
            os.truncate(real(path) if fh is None else fh, length)
            return 0

        def fallocate(self, path: str, mode: int, offset: int, size: int, fh: int) -> int:
            if mode:
                raise mfusepy.FuseOSError(errno.EOPNOTSUPP)
            os.posix_fallocate(fh, offset, size)
            return 0

        def flush(self, path: str, fh: int) -> int:
            return 0

        def fsync(self, path: str, datasync: int, fh: int) -> int:
            rules.check("fsync", path)
            (os.fdatasync if datasync else os.fsync)(fh)
            return 0

        def fsyncdir(self, path: str, datasync: int, fh: int) -> int:
            rules.check("fsyncdir", path)
            fd = os.open(real(path), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            return 0

        def release(self, path: str, fh: int) -> int:
            os.close(fh)
            return 0

        def mkdir(self, path: str, mode: int) -> int:
            os.mkdir(real(path), mode)
            return 0

        def rmdir(self, path: str) -> int:
            os.rmdir(real(path))
            return 0

        def unlink(self, path: str) -> int:
            os.unlink(real(path))
            return 0

        def rename(self, old: str, new: str) -> int:
            rules.check("rename", new)
            os.rename(real(old), real(new))
            return 0

        def link(self, target: str, source: str) -> int:
            os.link(real(source), real(target))
            return 0

        def symlink(self, target: str, source: str) -> int:
            os.symlink(source, real(target))
            return 0

        def readlink(self, path: str) -> str:
            return os.readlink(real(path))

        def readdir(self, path: str, fh: int) -> list[str]:
            return [".", "..", *os.listdir(real(path))]

        def statfs(self, path: str) -> dict[str, int]:
            st = os.statvfs(real(path))
            return {k: getattr(st, k) for k in ("f_bavail", "f_bfree", "f_blocks", "f_bsize",
                                                "f_favail", "f_ffree", "f_files", "f_flag",
                                                "f_frsize", "f_namemax")}

        def utimens(self, path: str, times: tuple[int, int] | None = None) -> int:
            if times is None:
                os.utime(real(path))
            else:
                os.utime(real(path), ns=times)
            return 0

    return Passthrough()


if __name__ == "__main__":
    _serve(sys.argv[1], sys.argv[2], socket.socket(fileno=int(sys.argv[3])))
