"""FaultFS's server: the FUSE pass-through and its rules, in a process of its own.

faultfs.py's client runs this file as a script (the standard library and mfusepy, no torch,
nothing of ckptio): it mounts the backing directory at the mount point, passes every call
through to the backing directory, and checks the rules first on write, fsync, fsyncdir,
rename (its destination), read, open (a file's open or create), unlink and rmdir, so that a
fault is a real errno from a real system call and a stalled call blocks its caller in the
kernel.

Call order: the client starts the process with the backing directory, the mount point and
its end of a socket pair -> ``_serve`` mounts and says "ready" -> one JSON line per command
(rule, stalled, release, clear, fired) and one per answer -> at the client's end every
stalled call is released and the mount let go.

Owns: the pass-through, the rules' state (counts, stalled calls, faults fired) and the
control loop. Does not own: the client's API and the mount's lifetime (faultfs.py). Test
support only.
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
from collections.abc import Callable
from typing import Any

__all__ = ["ERRNOS", "OPS"]

OPS = ("write", "fsync", "fsyncdir", "rename", "read", "open", "unlink", "rmdir")
ERRNOS = {"eio": errno.EIO, "enospc": errno.ENOSPC}


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
            rules.check("open", path)
            return os.open(real(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)

        def open(self, path: str, flags: int) -> int:
            rules.check("open", path)
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
            rules.check("rmdir", path)
            os.rmdir(real(path))
            return 0

        def unlink(self, path: str) -> int:
            rules.check("unlink", path)
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
