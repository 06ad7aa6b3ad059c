"""Who holds a save's lock, and whether that holder is provably dead.

A lock records its holder (``me()``): host name, boot id (Linux's
``/proc/sys/kernel/random/boot_id``, new at every boot), PID namespace, process id and the
process's start time (``/proc/<pid>/stat``, in clock ticks since boot: a pid reused by another
process has another start time). ``dead(holder)`` says a holder is gone only when that can be
proved from here: the same host, boot and PID namespace, and no process with that pid (or one
started at another time). A holder on another host, from before a reboot of this one with no
boot id, or whose record lacks a field, is never called dead: the lock's lease decides
(storage/s3/lock.py). The ranks of a job prove their neighbours' deaths so too (liveness.py).

``running_here(holder)``: the holder named, when it is provably alive (this host and boot).
Also this process's host id (``host_id``: what tells the ranks of one host from another's)
and ``machine()`` (where its pids mean what they mean here).

Owns: the holder record and the proof of death, the host id. Does not own: the locks
(local/dirlock.py, s3/lock.py).
"""

from __future__ import annotations

import os
import socket
import time
from datetime import datetime
from typing import Any

__all__ = ["HOST_ID_ENV", "RECORD_MAX_NBYTES", "ago", "alive", "boot_id", "dead", "host_id",
           "is_me", "machine", "me", "pid_namespace", "running_here", "started"]

RECORD_MAX_NBYTES = 4096  # a holder record's JSON is read as up to this many bytes
HOST_ID_ENV = "CKPTIO_HOST_ID"


def pid_namespace() -> str:
    """This process's PID namespace ("" where /proc is missing or shows another namespace's
    pids): processes of one namespace see each other's pids."""
    try:
        ns = os.stat("/proc/self/ns/pid")
        ours = os.readlink("/proc/self") == str(os.getpid())
    except OSError:
        return ""
    return f"{ns.st_dev:x}:{ns.st_ino:x}" if ours else ""


def machine() -> str:
    """Where this process's pids mean what they mean here: host name, boot id and PID
    namespace ("" where that cannot be told: no /proc)."""
    boot, ns = boot_id(), pid_namespace()
    return f"{socket.gethostname()}:{boot}:{ns}" if boot and ns else ""


def boot_id() -> str:
    """This boot's id ("" where the system has none: not Linux)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def host_id() -> str:
    """This process's host id: ``$CKPTIO_HOST_ID`` (any string; tests give several groups of
    ranks on one machine their own ids, and their own ``$CKPTIO_SHM_DIR``, to play several
    hosts), else ``hostname:boot_id`` (two containers of one machine share a boot id but not a
    hostname)."""
    explicit = os.environ.get(HOST_ID_ENV, "").strip()
    return explicit or f"{socket.gethostname()}:{boot_id()}"


def _stat(pid: int) -> list[str]:
    """Fields 3... of ``/proc/<pid>/stat`` (state first; [] if none)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return []
    return stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "


def started(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (None: no such process, or no
    /proc)."""
    fields = _stat(pid)
    try:
        return int(fields[19])  # field 22, starttime
    except (IndexError, ValueError):
        return None


def me() -> dict[str, Any]:
    """This process as a lock's holder."""
    pid = os.getpid()
    return {"host": socket.gethostname(), "boot": boot_id(), "pidns": pid_namespace(),
            "pid": pid, "start": started(pid), "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def ago(record: dict[str, Any]) -> str:
    """When the holder ``record`` started: "N s ago" by this host's clock (its "since"), or
    its "since" as written where that cannot be read."""
    since = record.get("since")
    try:
        began = datetime.strptime(str(since), "%Y-%m-%dT%H:%M:%S%z").timestamp()
    except ValueError:
        return f"at {since}"
    return f"{max(0.0, time.time() - began):.0f} s ago"


def is_me(record: dict[str, Any] | None) -> bool:
    """Whether ``record`` (a holder read back) is this process."""
    mine = me()
    return isinstance(record, dict) and all(record.get(k) == mine[k] for k in ("host", "pid",
                                                                               "start"))


def alive(pid: int) -> bool:
    """Whether a process ``pid`` exists on this host (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def dead(holder: dict[str, Any] | None) -> str | None:
    """How ``holder`` (a record me() made, read back) is provably gone ("pid 123 on host h
    (this boot) has exited"), or None when it may be alive or cannot be checked from here."""
    if not isinstance(holder, dict):
        return None
    host, boot, pid = holder.get("host"), holder.get("boot"), holder.get("pid")
    ns = pid_namespace()
    if (not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0 or not boot
            or host != socket.gethostname() or boot != boot_id() or pid == os.getpid()
            or holder.get("pidns", ns) != ns):  # another PID namespace's pid says nothing
        return None  # here (older records name none)
    where = f"pid {pid} on host {host} (this boot)"
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return f"{where} has exited"
    except PermissionError:
        pass  # a process of another user has this pid: compare start times
    fields = _stat(pid)
    if fields[:1] in (["Z"], ["X"]):  # killed, not yet reaped by its parent
        return f"{where} has exited"
    start = holder.get("start")
    now = started(pid)
    if isinstance(start, int) and now is not None and now != start:
        return f"{where} has exited (its pid now belongs to another process)"
    return None


def running_here(holder: Any) -> str | None:
    """``holder`` (a record me() made, read back) as "host h, pid p, since s" when it is a
    process alive on this host and boot (this one included), else None: gone, or on another
    host or boot, where whether it runs cannot be told from here."""
    if (not isinstance(holder, dict) or holder.get("host") != socket.gethostname()
            or holder.get("boot") != boot_id() or dead(holder) is not None):
        return None
    this = " (this process)" if is_me(holder) else ""
    return f"host {holder.get('host')}, pid {holder.get('pid')}{this}, since {holder.get('since')}"
