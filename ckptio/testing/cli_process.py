"""Run the ``ckptio`` command as ``python -m ckptio ARGS`` does (or a script as ``python SCRIPT
ARGS`` does), in a process forked from the warm forkserver of ckptio.testing.rank_processes
(torch and ckptio already imported), so a test that runs many commands does not pay an
interpreter start and torch's import per command.

    done = run_cli("verify", str(path))   # a subprocess.CompletedProcess[str], as subprocess.run
    done = run_script("job.py", "--steps", "3", cwd=str(tmp))   # the same for a script
    proc, out_r, err_r = start_script("child.py", env=env)   # started: read, kill, join

The child gets its own standard output and error (pipes, or a terminal the caller passes), the
caller's environment and working directory (or those given), and runs ckptio's ``__main__``
with that argv (a script: with its directory and the environment's PYTHONPATH first on
sys.path, as an interpreter puts them); at
its end it does what an interpreter's exit does (joins non-daemon threads, runs atexit
functions, flushes) before its exit status is taken. What only a fresh interpreter shows (which
modules a command imports, a closed pipe at interpreter exit, the installed entry point) is
tested with real ``python -m ckptio`` processes. Test support only.
"""

from __future__ import annotations

import atexit
import os
import runpy
import selectors
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from multiprocessing.connection import Connection
from typing import Any

from ckptio.testing.rank_processes import warm_context

__all__ = ["run_cli", "run_script", "start_cli", "start_script"]


def _child(argv: list[str], env: dict[str, str], cwd: str, out: Connection,
           err: Connection, script: str | None = None) -> None:
    """The forked command: its fds 1 and 2, environment and directory, then ckptio's main (or
    ``script``)."""
    os.dup2(out.fileno(), 1)
    os.dup2(err.fileno(), 2)
    out.close()
    err.close()
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.argv = ["ckptio" if script is None else script, *argv]
    if script is not None:
        sys.path[:0] = [os.path.dirname(os.path.abspath(script)),
                        *(p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p)]
    code: Any = 0
    try:
        if script is None:
            runpy.run_module("ckptio", run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(script, run_name="__main__")
    except SystemExit as done:
        code = done.code
    finally:  # what the interpreter's exit does: threading's exit hooks (a thread pool's
        # workers are told to stop) and a join of every non-daemon thread, then atexit functions
        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
    raise SystemExit(code)


def _pipe() -> tuple[int, Connection]:
    """(read fd for this process, write end as a Connection the forkserver passes on)."""
    r, w = os.pipe()
    return r, Connection(w, readable=False)


def start_script(script: str, *args: str, env: Mapping[str, str] | None = None,
                 cwd: str | None = None) -> tuple[Any, int, int]:
    """Start ``python SCRIPT ARGS`` (in ``cwd``, default this process's) -> (process, stdout
    read fd, stderr read fd)."""
    proc, out_r, err_r = start_cli(*args, env=env, script=script, cwd=cwd)
    assert err_r is not None  # internal: no stderr_fd given
    return proc, out_r, err_r


def start_cli(*args: str, env: Mapping[str, str] | None = None, stderr_fd: int | None = None,
              script: str | None = None, cwd: str | None = None) -> tuple[Any, int, int | None]:
    """Start ``ckptio ARGS`` (``python SCRIPT ARGS`` with ``script``) -> (process, stdout read
    fd, stderr read fd or None when ``stderr_fd`` — a terminal, say — was given)."""
    out_r, out_w = _pipe()
    if stderr_fd is None:
        err_r: int | None
        err_r, err_w = _pipe()
    else:
        err_r, err_w = None, Connection(os.dup(stderr_fd), readable=False)
    proc = warm_context().Process(
        target=_child, args=([*args], dict(os.environ if env is None else env),
                             os.getcwd() if cwd is None else cwd,
                             out_w, err_w, script), daemon=True)
    try:
        proc.start()
    finally:
        out_w.close()
        err_w.close()
    return proc, out_r, err_r


def run_cli(*args: str, env: Mapping[str, str] | None = None,
            timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``ckptio ARGS`` with stdout and stderr pipes -> its exit status and output, as
    ``subprocess.run(..., capture_output=True, text=True)`` gives them."""
    return _run(["ckptio", *args], start_cli(*args, env=env), timeout)


def run_script(script: str, *args: str, env: Mapping[str, str] | None = None,
               cwd: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``python SCRIPT ARGS`` as run_cli runs ``ckptio ARGS``."""
    return _run([script, *args], start_script(script, *args, env=env, cwd=cwd), timeout)


def _run(cmd: list[str], started: tuple[Any, int, int | None],
         timeout: float) -> subprocess.CompletedProcess[str]:
    """The started command's exit status and output, read to their end within ``timeout``."""
    proc, out_r, err_r = started
    assert err_r is not None  # internal: both callers start it with a stderr pipe
    deadline = time.monotonic() + timeout
    try:
        got = _read_all({out_r: b"", err_r: b""}, deadline, cmd, timeout)
        proc.join(max(0.0, deadline - time.monotonic()))
    finally:
        if proc.exitcode is None:  # past the deadline: killed, as subprocess.run(timeout=) does
            proc.kill()
            proc.join()
    if proc.exitcode < 0 and time.monotonic() >= deadline:
        raise subprocess.TimeoutExpired(cmd, timeout)
    return subprocess.CompletedProcess(cmd, proc.exitcode, got[out_r].decode(),
                                       got[err_r].decode())


def _read_all(got: dict[int, bytes], deadline: float, cmd: list[str],
              timeout: float) -> dict[int, bytes]:
    """Read each fd to its end (both at once, as subprocess.communicate does), then close it;
    subprocess.TimeoutExpired (fds closed) at the deadline."""
    with selectors.DefaultSelector() as sel:
        for fd in got:
            sel.register(fd, selectors.EVENT_READ)
        try:
            while sel.get_map():
                left = deadline - time.monotonic()
                ready = sel.select(left) if left > 0 else []
                if not ready:
                    raise subprocess.TimeoutExpired(cmd, timeout)
                for key, _ in ready:
                    chunk = os.read(key.fd, 65536)
                    if chunk:
                        got[key.fd] += chunk
                    else:
                        sel.unregister(key.fd)
                        os.close(key.fd)
        finally:
            for key in list(sel.get_map().values()):
                sel.unregister(key.fd)
                os.close(key.fd)
    return got
