"""liveness.py's neighbours' watch, in one process: a process listed on this machine in the
job's store whose death storage/holder.py proves is marked DIED (Watch names it at once, as
died), once; a rank a newer process took since is never marked. The ranks' view of it (a
killed rank named in seconds): tests/test_rank_death.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

import torch.distributed as dist

from ckptio.distributed import liveness
from ckptio.distributed.liveness import DIED, Watch, key_of
from ckptio.storage import holder


def _child() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def _listed(store: Any, key: str, rank: int, pid: int) -> None:
    """Process ``pid`` listed as ``rank`` on this machine, as Neighbours.of lists itself."""
    record = {**holder.me(), "pid": pid, "start": holder.started(pid)}
    store.append(key, json.dumps({"rank": rank, **record}) + "\n")


def _watch(store: Any, pid: int) -> liveness.Neighbours:
    """Rank 0's watch, with process ``pid`` listed as rank 7, which has beaten."""
    watch = liveness.Neighbours.of(store, 0)
    assert watch is not None  # Linux: /proc, and a store with append
    _listed(store, watch.key, 7, pid)
    store.add(key_of(7), 5)
    return watch


def test_a_killed_neighbour_is_marked_died_once_and_a_watch_names_it_at_once() -> None:
    store: Any = dist.HashStore()
    child = _child()
    try:
        neighbours = _watch(store, child.pid)
        neighbours.look()
        assert neighbours.watched[7]["pid"] == child.pid
        assert int(store.add(key_of(7), 0)) == 5  # alive: untouched
        child.kill()
        child.wait()
        neighbours.look()
        assert int(store.add(key_of(7), 0)) == DIED and not neighbours.watched
        watch = Watch(store, 3600.0)
        assert watch.stale([7]) == [7] and watch.died == {7} and watch.exited == {7}
    finally:
        child.kill()
        child.wait()


def test_a_rank_a_newer_process_took_is_not_marked() -> None:
    store: Any = dist.HashStore()
    child = _child()
    try:
        neighbours = _watch(store, child.pid)
        neighbours.look()
        _listed(store, neighbours.key, 7, os.getpid())  # a new process took rank 7 (listed
        child.kill()  # before its first beat)
        child.wait()
        neighbours.look()
        assert int(store.add(key_of(7), 0)) == 5
    finally:
        child.kill()
        child.wait()


def test_a_malformed_list_ends_the_watch_not_the_beats() -> None:
    """An entry the watch cannot read stops the watch (a warning), never the heartbeat: a
    rank that stopped beating would be taken for dead."""
    store: Any = dist.HashStore()
    store.append(f"ckptio/procs/{holder.machine()}", "not a record\n")
    liveness.beat(store, 9, 0.05)
    first = int(store.add(key_of(9), 0))
    deadline = time.monotonic() + 30
    while int(store.add(key_of(9), 0)) < first + 5 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert int(store.add(key_of(9), 0)) >= first + 5  # still beating
