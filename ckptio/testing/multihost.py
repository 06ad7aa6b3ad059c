"""N "hosts" on this machine for multi-host tests: each its own network namespace (own address,
own loopback, own hostname) with its own tmpfs as its memory tier, or, where namespaces are not
permitted (not root, no CAP_SYS_ADMIN), hosts simulated on 127.0.0.1 with separate directories.

    with Hosts(3, tmp_path) as hosts:            # hosts.mode: "netns" or "simulated"
        hosts.run(my_case, root, ranks_per_host=2)   # my_case(rank, world, root) on 6 ranks
        hosts.wipe(1)                            # host 1 lost: its memory is empty again
        hosts.run(my_restore, root, ranks_per_host=2)

Call order: ``Hosts(n, root)`` (sweeps what a killed run left, then makes the hosts) ->
``run`` / ``start`` and ``wipe`` as the test needs -> ``close()`` (also from ``__exit__`` and
on failure). How each mode builds a host, wipes it and tears it down: on ``Hosts``.

Owns: making, wiping and removing the hosts; which mode is possible here (``netns_possible``).
Does not own: launching ranks on the hosts (hostjob.py). Test support only.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from ckptio.errors import CkptError
from ckptio.storage.holder import alive

__all__ = ["MODES", "Host", "Hosts", "best_mode", "netns_possible", "sweep_stale"]

MODES = ("netns", "simulated")
PREFIX = "ckh"  # namespaces ckh<pid>-<tag>-h<i> / -sw, tmpfs sources ckh<pid>-<tag>-h<i>
SUBNET = "10.27.0"
TMPFS_SIZE = "256m"
_NAME = re.compile(rf"^{PREFIX}(\d+)-[0-9a-f]+-(?:h\d+|sw)$")


@dataclass
class Host:
    """One host: its index, name (its hostname in netns mode), address and memory directory."""

    index: int
    name: str
    addr: str
    shm_dir: str
    netns: str | None  # None in simulated mode


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def _limit(ns: str, bps: float) -> None:
    """Host ``ns``'s outgoing link held to ``bps`` bits per second: a token bucket whose burst
    is a hundredth of a second's bytes (at least 64 KiB, above one tick's worth at HZ=250)."""
    burst = max(64 * 1024, int(bps / 8 / 100))
    subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0", "root", "tbf",
                    "rate", f"{int(bps)}bit", "burst", str(burst), "latency", "200ms"],
                   capture_output=True, text=True, check=True, timeout=30)


def netns_possible() -> str | None:
    """None when this process may make namespaces and mount a tmpfs (netns mode works), else
    why not, in words."""
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        return "no `ip` or `unshare` command"
    if os.geteuid() != 0:
        return "not root (network namespaces and tmpfs mounts need CAP_SYS_ADMIN)"
    name = f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:6]}-h0"
    probe = _ip("netns", "add", name, check=False)
    if probe.returncode != 0:
        return f"`ip netns add` refused: {probe.stderr.strip()}"
    _ip("netns", "delete", name, check=False)
    return None


def best_mode() -> str:
    """``netns`` where possible, else ``simulated``; $CKPTIO_TEST_HOSTS=simulated forces it."""
    if os.environ.get("CKPTIO_TEST_HOSTS") == "simulated":
        return "simulated"
    return "netns" if netns_possible() is None else "simulated"



def sweep_stale() -> list[str]:
    """Remove the namespaces and tmpfs mounts left by a Hosts whose process is gone -> what was
    removed."""
    removed = []
    for source, target in _mounts():
        match = re.match(rf"^{PREFIX}(\d+)-", source)
        if match and not alive(int(match.group(1))):
            subprocess.run(["umount", "-l", target], capture_output=True, check=False)
            removed.append(f"{source} at {target}")
    if shutil.which("ip") is not None:
        names = _ip("netns", "list", check=False).stdout.split()
        for name in names:
            match = _NAME.match(name)
            if match and not alive(int(match.group(1))):
                _ip("netns", "delete", name, check=False)
                shutil.rmtree(Path("/etc/netns") / name, ignore_errors=True)
                removed.append(name)
    return removed


def _mounts() -> list[tuple[str, str]]:
    """(source, mount point) of this mount namespace's tmpfs mounts."""
    out = []
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        for line in f:
            left, right = line.split(" - ", 1)
            fstype, source = right.split()[:2]
            if fstype == "tmpfs":
                out.append((source, left.split()[4].replace("\\040", " ")))
    return out


class Hosts:
    """``n`` hosts under ``root``. ``mode``: "netns", "simulated" or None (the best possible
    here, ``best_mode()``); asking for netns where it is impossible raises.

    netns mode: a "switch" namespace holds a bridge; each host namespace gets a veth pair
    (``eth0`` inside, 10.27.0.<i+1>/24) to it, so hosts reach each other only over their
    addresses, and the machine's own namespace is left untouched (no interface, no route is
    added there). Each host's ``CKPTIO_SHM_DIR`` is a tmpfs of its own (``size=`` bounded),
    mounted at ``<root>/h<i>/shm``; a wipe unmounts it and mounts a fresh, empty one. Ranks run
    in ``ip netns exec NS unshare --uts`` (hostjob.py), so each host also has its own
    hostname, ``h<i>``.

    simulated mode: every host is 127.0.0.1; ``<root>/h<i>/shm`` is a plain directory; a wipe
    empties it. The host's identity reaches ckptio through ``host_env`` (hostjob.py; by
    default ``CKPTIO_HOST_ID``, ckptio's host-id override: ckptio/redundancy/topology.py), which
    netns mode does not need: there ckptio tells the hosts apart by their hostnames, as on a
    cluster.

    Each host's name resolves to its address inside every host (``/etc/netns/NS/hosts``, which
    ``ip netns exec`` mounts over /etc/hosts)."""

    def __init__(self, n: int, root: str | os.PathLike[str], mode: str | None = None,
                 tmpfs_size: str = TMPFS_SIZE, link_bps: float | None = None) -> None:
        """``link_bps``: each host's outgoing link limited to this many bits per second (a
        token-bucket qdisc, ``tc ... tbf``, on its eth0: the rate a host's NIC gives); netns
        mode only, as loopback has no per-host link."""
        if n < 1:
            raise ValueError(f"Hosts({n}): at least one host")
        self.mode = mode or best_mode()
        if self.mode not in MODES:
            raise ValueError(f"Hosts(mode={mode!r}): one of {MODES}")
        if link_bps is not None and (self.mode != "netns" or not link_bps > 0):
            raise ValueError(f"Hosts(link_bps={link_bps!r}): a rate > 0, in netns mode only "
                             f"(this is {self.mode})")
        self.link_bps = link_bps
        if self.mode == "netns" and (why := netns_possible()) is not None:
            raise RuntimeError(f"Hosts(mode='netns'): not possible here: {why}")
        self.root = Path(root)
        self.tmpfs_size = tmpfs_size
        self.tag = f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.hosts: list[Host] = []
        self._undo: list[Callable[[], Any]] = []
        self._jobs: list[Any] = []  # hostjob.Job, killed on close
        self.closed = False
        sweep_stale()
        try:
            self._make(n)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ making

    def _make(self, n: int) -> None:
        netns = self.mode == "netns"
        if netns:
            switch = f"{self.tag}-sw"
            self._add_netns(switch)
            _ip("-n", switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", switch, "link", "set", "br0", "up")
        for i in range(n):
            shm = self.root / f"h{i}" / "shm"
            shm.mkdir(parents=True, exist_ok=True)
            if netns:
                ns = f"{self.tag}-h{i}"
                self._add_netns(ns)
                addr = f"{SUBNET}.{i + 1}"
                _ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name",
                    f"h{i}", "netns", switch)
                _ip("-n", switch, "link", "set", f"h{i}", "master", "br0", "up")
                _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                if self.link_bps:
                    _limit(ns, self.link_bps)
                self._mount(i, str(shm))
                self.hosts.append(Host(i, f"h{i}", addr, str(shm), ns))
            else:
                self.hosts.append(Host(i, f"h{i}", "127.0.0.1", str(shm), None))
        if netns:
            self._hosts_files()

    def _hosts_files(self) -> None:
        """/etc/netns/NS/hosts, which ``ip netns exec`` mounts over /etc/hosts: every host's
        name resolves to its address inside the hosts, as on a cluster."""
        text = "127.0.0.1 localhost\n" + "".join(f"{h.addr} {h.name}\n" for h in self.hosts)
        for host in self.hosts:
            etc = Path("/etc/netns") / str(host.netns)
            etc.mkdir(parents=True, exist_ok=True)
            self._undo.append(functools.partial(shutil.rmtree, etc, ignore_errors=True))
            (etc / "hosts").write_text(text)

    def _add_netns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._undo.append(lambda: _ip("netns", "delete", name, check=False))

    def _mount(self, i: int, target: str) -> None:
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.tmpfs_size},mode=0755",
                        f"{self.tag}-h{i}", target], check=True, capture_output=True, timeout=30)
        self._undo.append(lambda: _umount(target))

    # ------------------------------------------------------------------ using

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __len__(self) -> int:
        return len(self.hosts)

    def describe(self) -> str:
        """One line naming the mode and the hosts, for a test's output."""
        where = ", ".join(f"{h.name}={h.addr}" for h in self.hosts)
        what = ("network namespaces, each with its own tmpfs" if self.mode == "netns" else
                "simulated: 127.0.0.1, a plain directory per host")
        link = f", each sending at most {int(self.link_bps)} bit/s" if self.link_bps else ""
        return f"{len(self.hosts)} hosts ({what}{link}): {where}"

    def wipe(self, i: int) -> None:
        """Host ``i`` lost and replaced: its memory directory is empty (netns: a fresh tmpfs).
        Its ranks must not be running (a job ended or killed)."""
        host = self.hosts[i]
        if self.mode == "netns":
            _umount(host.shm_dir)
            self._mount(i, host.shm_dir)
        else:
            shutil.rmtree(host.shm_dir)
            os.makedirs(host.shm_dir)

    def start(self, fn: Callable[..., Any], *args: Any, ranks_per_host: int | list[int] = 1,
              timeout_s: float = 180, host_env: str | None = "CKPTIO_HOST_ID",
              env: dict[str, str] | None = None) -> Any:
        """Launch ``fn(rank, world_size, *args)`` on every rank of every host -> a running
        hostjob.Job (``.wait()``, ``.kill_host(i)``). ``fn`` is imported by each rank from
        its module, so it must be defined at the top level of an importable module."""
        from ckptio.testing.hostjob import Job

        module = getattr(fn, "__module__", None)
        if module == "__main__" or "<locals>" in getattr(fn, "__qualname__", "<locals>"):
            raise CkptError(
                f"Hosts.start({getattr(fn, '__qualname__', fn)!r}): each rank imports the "
                f"function by name from its module ({module}), which a rank cannot do for one "
                "defined in the script you run or inside another function: define it at the "
                "top level of a module the ranks can import (a file beside your script)")

        job = Job(self, fn, args, ranks_per_host, timeout_s, host_env, env or {})
        self._jobs.append(job)
        return job

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """``start(...).wait()``: every rank's returned value, in global rank order."""
        return self.start(fn, *args, **kwargs).wait()

    def close(self) -> None:
        """Kill the jobs, unmount, delete the namespaces. Idempotent.

        The ranks still running are killed, every tmpfs unmounted (lazily if busy), every
        namespace deleted (their veths and the bridge go with them) with its /etc/netns entry.
        Namespaces and mounts are named after the owning process id, so a run that was
        SIGKILLed leaves ones that the next ``Hosts`` removes (``sweep_stale``)."""
        if self.closed:
            return
        self.closed = True
        for job in self._jobs:
            job.kill()
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()

    def leftovers(self) -> list[str]:
        """This Hosts' namespaces, mounts and /etc/netns entries still present (empty after
        close())."""
        names = []
        if shutil.which("ip") is not None:
            names = [n for n in _ip("netns", "list", check=False).stdout.split()
                     if n.startswith(self.tag)]
        etc = [str(p) for p in Path("/etc/netns").glob(f"{self.tag}-*")]
        return names + etc + [t for s, t in _mounts() if s.startswith(self.tag)]


def _umount(target: str) -> None:
    """Unmount ``target`` (lazily where a dying process still holds it)."""
    if subprocess.run(["umount", target], capture_output=True, check=False).returncode != 0:
        subprocess.run(["umount", "-l", target], capture_output=True, check=False)
