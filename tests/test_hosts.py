"""Real hosts on one machine (ckptio/testing/hosts.py, hostjob.py) and the memory tier's
protection across them.

The harness itself, in each mode possible here (netns: network namespaces with their own
address, hostname and tmpfs; simulated: 127.0.0.1 and plain directories): ranks on two hosts
form one gloo group across the hosts' addresses; a wiped host's memory is empty while the
others keep theirs; a rank's error comes back with its traceback and host; teardown (also with a
job still running, and after a failure inside the ``with``) leaves no namespace, mount or
process behind; leftovers of a killed run are swept.

Test ids carry the mode the test ran in (``[netns]`` / ``[simulated]``); where namespaces are
not permitted (not root) the netns cases are skipped with the reason and the simulated ones run.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from typing import Any

import pytest

from ckptio.testing.hostjob import RanksFailed
from ckptio.testing.hosts import Hosts, best_mode, netns_possible, sweep_stale

WHY_NOT_NETNS = netns_possible()


def _mode_param(mode: str) -> Any:
    skip = mode == "netns" and WHY_NOT_NETNS is not None
    return pytest.param(mode, id=mode, marks=pytest.mark.skipif(
        skip, reason=f"netns mode not possible here: {WHY_NOT_NETNS}"))


BOTH = [_mode_param("netns"), _mode_param("simulated")]


@pytest.fixture(params=BOTH)
def two_hosts(request: pytest.FixtureRequest, tmp_path: Any) -> Any:
    with Hosts(2, tmp_path, mode=request.param) as hosts:
        print(hosts.describe())
        request.node.user_properties.append(("hosts_mode", hosts.mode))
        yield hosts


# ------------------------------------------------------------------ per-rank bodies


def who_am_i(rank: int, world: int, peer_addr: str) -> dict[str, Any]:
    """What a rank sees of its host, and an all_gather across all ranks."""
    import torch
    import torch.distributed as dist

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((peer_addr, 9))  # no packet sent: picks the route -> this host's address
        own = s.getsockname()[0]
    got = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(got, torch.tensor([float(rank + 1)]))
    return {"hostname": socket.gethostname(), "resolved": _resolve(["h0", "h1"]), "netns": os.readlink("/proc/self/ns/net"),
            "addr": own, "gathered": [float(t) for t in got],
            "shm": os.environ["CKPTIO_SHM_DIR"], "local_rank": int(os.environ["LOCAL_RANK"]),
            "group_rank": int(os.environ["GROUP_RANK"])}


def _resolve(names: list[str]) -> list[str | None]:
    out: list[str | None] = []
    for name in names:
        try:
            out.append(socket.gethostbyname(name))
        except OSError:
            out.append(None)
    return out


def fill_memory(rank: int, world: int) -> dict[str, Any]:
    shm = os.environ["CKPTIO_SHM_DIR"]
    with open(os.path.join(shm, f"rank-{rank}.bin"), "wb") as f:
        f.write(os.urandom(1 << 20))
    return {"dev": os.stat(shm).st_dev, "files": sorted(os.listdir(shm))}


def list_memory(rank: int, world: int) -> list[str]:
    return sorted(os.listdir(os.environ["CKPTIO_SHM_DIR"]))


def fail_on_rank_1(rank: int, world: int) -> int:
    if rank == 1:
        raise ValueError("rank 1 says no")
    return rank


def hang(rank: int, world: int, pid_dir: str) -> None:
    with open(os.path.join(pid_dir, f"pid-{rank}"), "w", encoding="utf-8") as f:
        f.write(str(os.getpid()))
    time.sleep(600)


# ------------------------------------------------------------------ the harness


def test_two_hosts_talk_gloo(two_hosts: Hosts) -> None:
    a, b = two_hosts.hosts
    values = two_hosts.run(who_am_i, b.addr, ranks_per_host=[1, 2], timeout_s=120)
    assert [v["gathered"] for v in values] == [[1.0, 2.0, 3.0]] * 3
    assert [v["group_rank"] for v in values] == [0, 1, 1]
    assert [v["local_rank"] for v in values] == [0, 0, 1]
    assert [v["shm"] for v in values] == [a.shm_dir, b.shm_dir, b.shm_dir]
    if two_hosts.mode == "netns":
        mine = os.readlink("/proc/self/ns/net")
        assert values[0]["netns"] != values[1]["netns"] == values[2]["netns"] != mine
        assert [v["hostname"] for v in values] == ["h0", "h1", "h1"]
        assert {tuple(v["resolved"]) for v in values} == {(a.addr, b.addr)}
        assert a.addr != b.addr and not a.addr.startswith("127.")
        assert values[0]["addr"] == a.addr and values[1]["addr"] == b.addr
        assert socket.gethostname() not in ("h0", "h1")  # the machine's hostname untouched
    else:
        assert {v["addr"] for v in values} == {"127.0.0.1"}


def test_wiped_host_memory_is_empty(two_hosts: Hosts) -> None:
    before = two_hosts.run(fill_memory, timeout_s=120)
    assert before[0]["files"] == ["rank-0.bin"] and before[1]["files"] == ["rank-1.bin"]
    if two_hosts.mode == "netns":  # each host's memory is a tmpfs of its own
        devs = {v["dev"] for v in before}
        assert len(devs) == 2 and os.stat("/dev/shm").st_dev not in devs
        with open("/proc/self/mountinfo", encoding="utf-8") as f:
            mounts = f.read()
        for host in two_hosts.hosts:
            assert f" {host.shm_dir} " in mounts and f"tmpfs {two_hosts.tag}-h{host.index} " \
                in mounts
    two_hosts.wipe(1)
    after = two_hosts.run(list_memory, timeout_s=120)
    assert after == [["rank-0.bin"], []]
    assert os.listdir(two_hosts.hosts[1].shm_dir) == []


def test_rank_error_names_rank_and_host(two_hosts: Hosts) -> None:
    with pytest.raises(RanksFailed, match=r"(?s)rank 1 \(host 1\).*ValueError: rank 1 says no"):
        two_hosts.run(fail_on_rank_1, timeout_s=120)


@pytest.mark.parametrize("mode", BOTH)
def test_teardown_leaves_nothing(mode: str, tmp_path: Any) -> None:
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    with pytest.raises(KeyError):  # a failure inside the with: torn down all the same
        with Hosts(2, tmp_path / "hosts", mode=mode) as hosts:
            hosts.start(hang, str(pid_dir), timeout_s=600)
            deadline = time.monotonic() + 60
            while len(os.listdir(pid_dir)) < 2 and time.monotonic() < deadline:
                time.sleep(0.2)
            pids = [int((pid_dir / f"pid-{r}").read_text()) for r in range(2)]
            if mode == "netns":
                assert len(hosts.leftovers()) == 2 + 3 + 2  # mounts, hosts + switch, /etc/netns
            raise KeyError("the test fails while the ranks run")
    assert hosts.leftovers() == []
    deadline = time.monotonic() + 10  # SIGKILLed: gone once the kernel has torn them down
    while not all(_gone(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [pid for pid in pids if not _gone(pid)] == [], "rank processes still alive"


def _gone(pid: int) -> bool:
    """No such process, or only its zombie."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.skipif(WHY_NOT_NETNS is not None, reason=f"needs namespaces: {WHY_NOT_NETNS}")
def test_leftovers_of_a_killed_run_are_swept(tmp_path: Any) -> None:
    """A Hosts in a process SIGKILLed before its teardown: the next one removes what it left."""
    script = ("import sys, time; from ckptio.testing.hosts import Hosts; "
              "h = Hosts(2, sys.argv[1], mode='netns'); print(h.tag, flush=True); "
              "time.sleep(600)")
    proc = subprocess.Popen([os.sys.executable, "-c", script, str(tmp_path)],
                            stdout=subprocess.PIPE, text=True)
    try:
        tag = proc.stdout.readline().strip()  # type: ignore[union-attr]
        assert tag, "the child made no hosts"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert tag in listed  # left behind by the killed process
    removed = sweep_stale()
    assert len([r for r in removed if tag in r]) == 5  # 2 mounts, 2 hosts + the switch
    assert not [p for p in os.listdir("/etc/netns") if p.startswith(tag)]
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        assert tag not in listed and tag not in f.read()


def test_best_mode_says_why() -> None:
    assert best_mode() == ("netns" if WHY_NOT_NETNS is None else "simulated")
    if WHY_NOT_NETNS is not None:
        assert WHY_NOT_NETNS  # the reason, in words
