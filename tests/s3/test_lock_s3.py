"""What keeps a save into s3:// safe against another save, against a real SeaweedFS server:
the lock object's lease renewed by a save that outlives it while a second saver waits, a saver
that waits for a live holder and goes on once it lets go, the probe that refuses a store
ignoring conditional writes (played by the fault proxy), and ``s3_conditional="off"``.

Each saver talks through its own FaultProxy, so the order of every request the two sent is
recorded (``Seen``); the first saver is held mid-save by a gate on its first data request, and
the test waits on what the proxies saw, never on the clock.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest
import torch

import ckptio
from ckptio.testing.s3proxy import FaultProxy, Request

MiB = 1 << 20
LOCK = ".ckptio.lock"

Log = list[tuple[str, Request]]


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(MiB // 4, generator=g), "step": seed}


def _checkpointer(endpoint: str, **changes: Any) -> ckptio.Checkpointer:
    return ckptio.Checkpointer(ckptio.Options(buffer_bytes=5 * MiB, pool_bytes=20 * MiB,
                                              s3_endpoint_url=endpoint, **changes))


def _name(req: Request) -> str:
    return req.key.rsplit("/", 1)[-1]


def _is_lock(req: Request) -> bool:
    return _name(req) == LOCK


def _is_data(req: Request) -> bool:
    return _name(req).startswith("data-")


def _conditional_lock_put(req: Request) -> bool:
    """A renewal by the holder, or a take-over by a waiter: a PutObject of the lock with If-Match."""
    return _is_lock(req) and req.op == "PutObject" and "if-match" in req.headers


class Seen:
    """Every request that went through the proxies it watches, in arrival order, tagged with the
    proxy's name; ``wait_until`` blocks until the log satisfies a predicate."""

    def __init__(self) -> None:
        self.log: Log = []
        self._changed = threading.Condition()

    def watch(self, proxy: FaultProxy, tag: str) -> None:
        proxy.on_request(lambda req: self._add(tag, req), times=None)

    def _add(self, tag: str, req: Request) -> None:
        with self._changed:
            self.log.append((tag, req))
            self._changed.notify_all()

    def count(self, tag: str, what: Callable[[Request], bool]) -> int:
        with self._changed:
            return sum(1 for t, r in self.log if t == tag and what(r))

    def index(self, tag: str, what: Callable[[Request], bool]) -> int:
        """Position of the first such request in the log (-1: none)."""
        with self._changed:
            return next((i for i, (t, r) in enumerate(self.log) if t == tag and what(r)), -1)

    def wait_until(self, done: Callable[[], bool], what: str, timeout_s: float = 120) -> None:
        """A guard against hanging, not a deadline the test races: every wait here ends on a
        request the proxies saw."""
        with self._changed:
            if not self._changed.wait_for(done, timeout_s):
                raise AssertionError(f"never saw {what}; requests: "
                                     f"{[(t, r.op, _name(r)) for t, r in self.log]}")


class Gate:
    """Holds the first request matching ``match`` in the proxy until ``open()``."""

    def __init__(self, proxy: FaultProxy, **match: Any) -> None:
        self.held = threading.Event()
        self._opened = threading.Event()
        proxy.on_request(self._hold, times=1, **match)

    def _hold(self, _req: Request) -> None:
        self.held.set()
        self._opened.wait(300)

    def open(self) -> None:
        self._opened.set()


@pytest.fixture
def second_proxy(s3_live: Any) -> Iterator[FaultProxy]:
    with FaultProxy(s3_live.host, s3_live.port) as proxy:
        yield proxy
    assert not proxy.errors, f"the proxy's threads failed: {proxy.errors!r}"


def _save_in_thread(pool: ThreadPoolExecutor, ck: ckptio.Checkpointer, state: dict[str, Any],
                    url: str) -> Future[Any]:
    # a save blocks its caller until it holds the lock (the capture runs on the caller)
    return pool.submit(ck.save, state, url)


def _stored(s3_client: Any, url: str) -> list[str]:
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    answer = s3_client.list_objects_v2(Bucket=bucket, Prefix=prefix + "/")
    return sorted(o["Key"].rsplit("/", 1)[1] for o in answer.get("Contents", []))


def _open_uploads(s3_client: Any, url: str) -> list[str]:
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    return [u["Key"] for u in s3_client.list_multipart_uploads(
        Bucket=bucket, Prefix=prefix + "/").get("Uploads", [])]


def _lock_body(s3_client: Any, url: str) -> dict[str, Any]:
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    return json.loads(s3_client.get_object(Bucket=bucket, Key=f"{prefix}/{LOCK}")["Body"].read())


def _only_its_files(s3_client: Any, url: str) -> None:
    """Nothing under the prefix but the committed manifest and the files it names."""
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    raw = s3_client.get_object(Bucket=bucket, Key=f"{prefix}/manifest.json")["Body"].read()
    named = {f["name"] for f in json.loads(raw.split(b"\n", 1)[1])["files"]}
    assert _stored(s3_client, url) == sorted({"manifest.json", *named})
    assert _open_uploads(s3_client, url) == []


def _equal(got: dict[str, Any], want: dict[str, Any]) -> bool:
    return got["step"] == want["step"] and torch.equal(got["w"].view(torch.int32),
                                                       want["w"].view(torch.int32))


def test_a_save_outliving_its_lease_keeps_the_lock_while_a_second_saver_waits(
        s3_env, s3_proxy, second_proxy, s3_client):
    """The first save is held mid-upload for longer than its 3 s lease: it renews the lock
    (every lease/3), so the second saver, polling, finds it live every time and never takes
    it over; once the first commits and lets go, the second saves. Without renewal the lock
    would look abandoned (older than the lease by the server's clock) and be taken over."""
    url, lease = f"{s3_env}/renewed", 3.0
    seen = Seen()
    seen.watch(s3_proxy, "first")
    seen.watch(second_proxy, "second")
    gate = Gate(s3_proxy, key=r"/data-")
    first_ck = _checkpointer(s3_proxy.endpoint, s3_lock_lease_s=lease)
    second_ck = _checkpointer(second_proxy.endpoint, s3_lock_lease_s=lease)
    polls = lambda: seen.count("second", lambda r: _is_lock(r) and r.op == "HeadObject")  # noqa: E731
    took_over = lambda: seen.count("second", _conditional_lock_put) > 0  # noqa: E731
    with ThreadPoolExecutor(2) as pool:
        try:
            first = _save_in_thread(pool, first_ck, _state(1), url)
            assert gate.held.wait(120), "the first save never reached its data upload"
            second = _save_in_thread(pool, second_ck, _state(2), url)
            # five renewals: the lock is older than lease + 1 s (Last-Modified's granularity)
            seen.wait_until(lambda: seen.count("first", _conditional_lock_put) >= 5
                            or took_over(), "five renewals of the first save's lock")
            # a poll after that found the lock live: the second saver polls once more
            after = polls()
            seen.wait_until(lambda: polls() >= after + 2 or took_over(),
                            "two more polls of the lock by the second saver")
            assert not took_over(), "the second saver took over a lock its holder renewed"
            assert not second.done() and not first.done()
            assert seen.count("second", _is_data) == 0, "the second saver uploaded meanwhile"
            assert _lock_body(s3_client, url)["renewed"] >= 5
        finally:
            gate.open()
        first.result(timeout=120)
        second.result(timeout=120)
    first_ck.close()
    second_ck.close()
    released = seen.index("first", lambda r: _is_lock(r) and r.op == "DeleteObject")
    assert 0 <= released < seen.index("second", _is_data), "the second uploaded before the " \
        "first let go of the lock"
    assert _equal(ckptio.load(url), _state(2))
    _only_its_files(s3_client, url)


def test_a_saver_waits_for_a_live_holder_then_saves_once_it_lets_go(
        s3_env, s3_proxy, second_proxy, s3_client):
    url = f"{s3_env}/waits"
    ckptio.save(_state(0), url)
    seen = Seen()
    seen.watch(s3_proxy, "first")
    seen.watch(second_proxy, "second")
    gate = Gate(s3_proxy, key=r"/data-")
    first_ck, second_ck = _checkpointer(s3_proxy.endpoint), _checkpointer(second_proxy.endpoint)
    polls = lambda: seen.count("second", lambda r: _is_lock(r) and r.op == "HeadObject")  # noqa: E731
    with ThreadPoolExecutor(2) as pool:
        try:
            first = _save_in_thread(pool, first_ck, _state(1), url)
            assert gate.held.wait(120), "the first save never reached its data upload"
            second = _save_in_thread(pool, second_ck, _state(2), url)
            seen.wait_until(lambda: polls() >= 2 or second.done(),
                            "the second saver finding the lock held twice")
            assert not second.done(), "the second save did not wait for the lock's holder"
            assert seen.count("second", _is_data) == 0
            assert _equal(ckptio.load(url), _state(0))  # nothing committed meanwhile
        finally:
            gate.open()
        first.result(timeout=120)
        second.result(timeout=120)  # it went on once the lock was let go
    first_ck.close()
    second_ck.close()
    released = seen.index("first", lambda r: _is_lock(r) and r.op == "DeleteObject")
    assert 0 <= released < seen.index("second", _is_data)
    assert seen.index("first", lambda r: _name(r) == "manifest.json" and r.op == "PutObject") \
        < released  # the first committed, then let go
    assert _equal(ckptio.load(url), _state(2))
    _only_its_files(s3_client, url)


def _ignore_if_none_match(proxy: FaultProxy, s3_client: Any) -> None:
    """Make the store behind ``proxy`` act as one that ignores If-None-Match: before a
    conditional create goes on, the object it names is deleted, so it always succeeds (and
    overwrites)."""
    def forget(req: Request) -> None:
        if "if-none-match" in req.headers:
            s3_client.delete_object(Bucket=req.bucket, Key=req.key)

    proxy.on_request(forget, times=None, op="PutObject")


def test_a_store_ignoring_conditional_writes_is_refused_before_anything_is_written(
        s3_env, s3_proxy, s3_client):
    url = f"{s3_env}/ignoring"
    ckptio.save(_state(1), url)  # straight to the server, which honours the conditions
    before = _stored(s3_client, url)
    _ignore_if_none_match(s3_proxy, s3_client)
    ck = _checkpointer(s3_proxy.endpoint)
    with pytest.raises(ckptio.StorageIOError, match="ignores conditional writes") as info:
        ck.save(_state(2), url)
    ck.close()
    assert "s3_conditional='off'" in str(info.value)
    probes = [r for r in s3_proxy.requests if _name(r).startswith(".ckptio-probe-")]
    assert [r.op for r in probes] == ["PutObject", "PutObject", "DeleteObject"]
    assert not [r for r in s3_proxy.requests if _is_data(r) or _is_lock(r)]
    assert _stored(s3_client, url) == before  # no data, no lock, no probe left; manifest kept
    assert _open_uploads(s3_client, url) == []
    assert _equal(ckptio.load(url), _state(1))


def test_conditional_off_commits_without_conditions_on_such_a_store(
        s3_env, s3_proxy, second_proxy, s3_client):
    """s3_conditional="require" (the default) commits with If-None-Match, then If-Match;
    "off" makes no probe and commits with neither, so a store ignoring them is usable."""
    url = f"{s3_env}/off"
    manifest_puts = lambda proxy: [r for r in proxy.requests  # noqa: E731
                                   if _name(r) == "manifest.json" and r.op == "PutObject"]
    required = _checkpointer(second_proxy.endpoint)
    required.save(_state(1), url)
    required.save(_state(2), url)
    required.close()
    conditions = [("if-none-match" in r.headers, "if-match" in r.headers)
                  for r in manifest_puts(second_proxy)]
    assert conditions == [(True, False), (False, True)]

    _ignore_if_none_match(s3_proxy, s3_client)
    off = _checkpointer(s3_proxy.endpoint, s3_conditional="off")
    off.save(_state(3), url)
    off.save(_state(4), url)
    off.close()
    puts = manifest_puts(s3_proxy)
    assert len(puts) == 2 and all(r.status == 200 for r in puts)
    assert not [r for r in puts if "if-match" in r.headers or "if-none-match" in r.headers]
    assert not [r for r in s3_proxy.requests if _name(r).startswith(".ckptio-probe-")]
    assert _equal(ckptio.load(url), _state(4))
    _only_its_files(s3_client, url)


# ------------------------------------------------------------------------------------------------
# a holder that is provably dead (same host and boot, its process gone): no lease waited out

KILLED_SAVER = """
import os, signal, sys, torch, ckptio
from ckptio.saving import persist

def die(*_args, **_kwargs):  # writing its share, the lock taken and renewed: SIGKILL
    print("holding the lock", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)

persist.SaveJob.finish = die
ckptio.save({"w": torch.randn(1 << 16), "step": 9}, sys.argv[1])
"""


def test_a_save_after_a_killed_saver_takes_its_lock_over_at_once(s3_env, s3_client, caplog):
    """A real process takes the lock (its 30 s default lease) and is SIGKILLed mid-save; the
    next save on this host takes the lock over without waiting out the lease, saying whose it
    was, and commits."""
    import os
    import subprocess
    import sys
    import time
    from pathlib import Path

    url = f"{s3_env}/killed"
    ckptio.save(_state(0), url)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    killed = subprocess.run([sys.executable, "-c", KILLED_SAVER, url], env=env,
                            capture_output=True, text=True, timeout=120, check=False)
    assert killed.returncode == -9 and "holding the lock" in killed.stdout, killed.stderr[-2000:]
    dead = _lock_body(s3_client, url)  # left behind, its lease not run out
    assert dead["lease_s"] == 30.0 and dead["pid"] != os.getpid()
    began = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="ckptio"):
        ckptio.save(_state(1), url, options=ckptio.Options(if_locked="raise"))
    assert time.monotonic() - began < 10  # not the 30 s lease
    took = [r.getMessage() for r in caplog.records if "took over the lock" in r.getMessage()]
    assert len(took) == 1 and f"pid {dead['pid']} on host {dead['host']}" in took[0], took
    assert "has exited" in took[0]
    assert _equal(ckptio.load(url), _state(1))
    _only_its_files(s3_client, url)


def _planted_lock(s3_client: Any, url: str, **holder: Any) -> None:
    """The lock object a save on ``holder`` would have written (its lease fresh)."""
    from ckptio.storage import holder as holders

    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    body = {**holders.me(), "save": "planted", "lease_s": 30.0, **holder}
    s3_client.put_object(Bucket=bucket, Key=f"{prefix}/{LOCK}", Body=json.dumps(body).encode())


@pytest.mark.parametrize("who", ["live process here", "another host", "another boot"])
def test_a_live_or_unprovable_holder_keeps_its_lease(s3_env, s3_client, who):
    import subprocess
    import sys

    url = f"{s3_env}/held"
    ckptio.save(_state(0), url)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        from ckptio.storage import holder as holders

        dead_pid = {"pid": 2 ** 22 + 7}  # above pid_max's default: no such process here
        _planted_lock(s3_client, url, **{
            "live process here": {"pid": live.pid, "start": holders.started(live.pid)},
            "another host": {"host": "another-host", **dead_pid},
            "another boot": {"boot": "0" * 36, **dead_pid}}[who])
        with pytest.raises(ckptio.CheckpointLockedError, match="being saved by another save"):
            ckptio.save(_state(1), url, options=ckptio.Options(if_locked="raise"))
    finally:
        live.kill()
        live.wait()
    assert _equal(ckptio.load(url), _state(0))


def test_a_holder_whose_pid_now_belongs_to_another_process_is_dead(s3_env, s3_client, caplog):
    import subprocess
    import sys

    from ckptio.storage import holder as holders

    url = f"{s3_env}/reused"
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        start = holders.started(other.pid)
        assert start is not None
        _planted_lock(s3_client, url, pid=other.pid, start=start - 1)  # an earlier process
        with caplog.at_level(logging.WARNING, logger="ckptio"):
            ckptio.save(_state(1), url, options=ckptio.Options(if_locked="raise"))
    finally:
        other.kill()
        other.wait()
    assert any("belongs to another process" in r.getMessage() for r in caplog.records)
    assert _equal(ckptio.load(url), _state(1))
