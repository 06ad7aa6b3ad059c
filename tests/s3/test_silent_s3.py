"""A silent network between ckptio and a real SeaweedFS server: the fault proxy accepts the
connection, reads the request and answers nothing (a partition, a stuck load balancer).

Every save and load, its cleanup included, fails within ``s3_retry_deadline_s`` + 10 s with a
StorageIOError naming the object and the endpoint (storage/s3/timeouts.py); nothing partial
loads, the previous checkpoint stays whole, and the next save (network healed) succeeds and
removes what the failed one left. Short resets and SlowDown are absorbed; lasting ones fail in
time too. Deadlines here are a few seconds, so the whole file runs in well under a minute."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

import ckptio
from ckptio.format.manifest import MANIFEST_NAME
from ckptio.managing.manager import CheckpointManager
from ckptio.storage.local.dirlock import LOCK_NAME
from ckptio.storage.s3.s3path import S3Path
from ckptio.storage.s3.settings import S3Settings
from ckptio.storage.s3.store import S3Store
from ckptio.storage.select import store_for
from ckptio.storage.steps import named as names_in
from ckptio.testing.s3proxy import FaultProxy

MiB = 1 << 20
DEADLINE_S = 4.0
SLACK_S = 10.0  # the promise: failed within the deadline and this


def _state(seed: int, mib: int = 12) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(mib * MiB // 4, generator=g), "step": seed}


def _options(endpoint: str, **changes: Any) -> ckptio.Options:
    settings: dict[str, Any] = {"buffer_bytes": 5 * MiB, "pool_bytes": 20 * MiB,
                                "s3_endpoint_url": endpoint, "s3_retry_deadline_s": DEADLINE_S,
                                "s3_lock_lease_s": 2.0}
    return ckptio.Options(**{**settings, **changes})


def _fails_in_time(work: Callable[[], object], *phrases: str) -> str:
    """Run ``work``: it raises StorageIOError naming ``phrases`` within the deadline + slack."""
    began = time.monotonic()
    with pytest.raises(ckptio.StorageIOError) as info:
        work()
    took = time.monotonic() - began
    message = str(info.value)
    assert took < DEADLINE_S + SLACK_S, f"failed after {took:.1f} s: {message}"
    for phrase in phrases:
        assert phrase in message, (phrase, message)
    return message


def _only_the_committed_files(s3_client: Any, url: str, options: ckptio.Options) -> None:
    """No open upload, no lock, and every data object is one the committed manifest names."""
    where = S3Path.parse(url)
    uploads = s3_client.list_multipart_uploads(Bucket=where.bucket, Prefix=where.dir_prefix)
    assert not uploads.get("Uploads"), uploads.get("Uploads")
    store = store_for(url, options)
    assert set(store.names()) == set(names_in(store.read_manifest()))
    listed = s3_client.list_objects_v2(Bucket=where.bucket, Prefix=where.dir_prefix)
    assert LOCK_NAME not in {o["Key"].rsplit("/", 1)[-1] for o in listed.get("Contents", [])}


def test_a_silent_network_fails_a_save_and_a_load_in_time_and_keeps_the_checkpoint(
        s3_env: str, s3_proxy: FaultProxy, s3_client: Any) -> None:
    url = f"{s3_env}/silent"
    options = _options(s3_proxy.endpoint)
    before = _state(1)
    ckptio.Checkpointer(options).save(before, url)
    s3_proxy.partition()
    checkpointer = ckptio.Checkpointer(options)
    _fails_in_time(lambda: checkpointer.save(_state(2), url), url, s3_proxy.endpoint,
                   "did not answer in time")
    _fails_in_time(lambda: checkpointer.load(url), url, s3_proxy.endpoint)
    s3_proxy.clear()
    assert torch.equal(checkpointer.load(url)["w"], before["w"])
    after = _state(3)
    checkpointer.save(after, url)
    checkpointer.close()
    assert torch.equal(ckptio.Checkpointer(options).load(url)["w"], after["w"])
    _only_the_committed_files(s3_client, url, options)


LOADER = """
import sys, time, ckptio
options = ckptio.Options(s3_endpoint_url=sys.argv[2], s3_retry_deadline_s=float(sys.argv[3]))
began = time.monotonic()
try:
    ckptio.load(sys.argv[1], options=options)
except ckptio.StorageIOError as exc:
    print(f"{time.monotonic() - began:.1f} s: {exc}")
else:
    print("loaded")
"""


def test_a_fresh_process_loading_through_a_silent_network_fails_in_time(
        s3_env: str, s3_proxy: FaultProxy) -> None:
    url = f"{s3_env}/silent-load"
    ckptio.save(_state(4), url, options=_options(s3_proxy.endpoint))
    s3_proxy.partition()
    import os
    import subprocess
    import sys
    began = time.monotonic()
    done = subprocess.run([sys.executable, "-c", LOADER, url, s3_proxy.endpoint, str(DEADLINE_S)],
                          capture_output=True, text=True, timeout=120, env=os.environ.copy())
    took = time.monotonic() - began
    out = done.stdout.strip()
    assert done.returncode == 0 and " s: " in out, (done.returncode, out, done.stderr[-2000:])
    spent = float(out.split(" s: ")[0])
    assert spent < DEADLINE_S + SLACK_S, out
    assert url in out and s3_proxy.endpoint in out, out
    assert took < 60, took  # the interpreter exits: no thread left waiting on the network


def test_a_black_hole_during_the_manifest_put_commits_nothing_and_the_next_save_cleans(
        s3_env: str, s3_proxy: FaultProxy, s3_client: Any) -> None:
    url = f"{s3_env}/commit-silent"
    options = _options(s3_proxy.endpoint)
    before = _state(5)
    checkpointer = ckptio.Checkpointer(options)
    checkpointer.save(before, url)
    silence = s3_proxy.black_hole(op="PutObject", key=f"{MANIFEST_NAME}$", partition=True)
    _fails_in_time(lambda: checkpointer.save(_state(6), url), f"{url}/{MANIFEST_NAME}",
                   s3_proxy.endpoint)
    assert silence.fired >= 1
    s3_proxy.clear()
    assert torch.equal(checkpointer.load(url)["w"], before["w"])  # the old one, whole
    assert len(S3Store(url, S3Settings.of(options)).names()) > 1  # the failed save's files
    after = _state(7)
    checkpointer.save(after, url)  # waits out the failed save's lock lease (2 s) if left
    checkpointer.close()
    assert torch.equal(ckptio.Checkpointer(options).load(url)["w"], after["w"])
    _only_the_committed_files(s3_client, url, options)


def _for(seconds: float, proxy: FaultProxy) -> None:
    """End the proxy's faults after ``seconds`` (a short outage)."""
    timer = threading.Timer(seconds, proxy.clear)
    timer.daemon = True
    timer.start()


def test_short_resets_and_slowdown_are_absorbed_and_a_lasting_slowdown_fails_in_time(
        s3_env: str, s3_proxy: FaultProxy) -> None:
    url = f"{s3_env}/resets"
    checkpointer = ckptio.Checkpointer(_options(s3_proxy.endpoint))
    first = _state(8)
    ckptio.save(first, url, options=_options(s3_proxy.endpoint))  # the bucket is known: reached
    resets = s3_proxy.reset(times=None)
    _for(1.0, s3_proxy)
    second = _state(9)
    checkpointer.save(second, url)
    assert resets.fired >= 1
    slow = s3_proxy.fail(503, "SlowDown", times=None)
    _for(1.0, s3_proxy)
    assert torch.equal(checkpointer.load(url)["w"], second["w"])
    assert slow.fired >= 1
    s3_proxy.fail(503, "SlowDown", times=None)
    _fails_in_time(lambda: checkpointer.save(_state(10), url), url, s3_proxy.endpoint,
                   "503")
    s3_proxy.clear()
    assert torch.equal(checkpointer.load(url)["w"], second["w"])
    checkpointer.close()


def test_a_manager_under_a_silent_commit_fails_in_time_and_a_later_manager_goes_on(
        s3_env: str, s3_proxy: FaultProxy, s3_client: Any) -> None:
    """keep_last=2; step 3's manifest PUT meets a black hole. The save fails in time, the
    manager closes in time, its lock is not held forever: a new manager (network healed)
    restores step 2, saves step 3 over the leftovers, and keeps steps 2 and 3 only."""
    run = f"{s3_env}/run"
    options = _options(s3_proxy.endpoint)
    states = {step: _state(10 + step, mib=6) for step in (1, 2, 3)}
    manager = CheckpointManager(run, keep_last=2, options=options)
    for step in (1, 2):
        manager.save(step, states[step])
    s3_proxy.black_hole(op="PutObject", key=f"step-3/{MANIFEST_NAME}$", partition=True)
    _fails_in_time(lambda: manager.save(3, states[3]), f"{run}/step-3", s3_proxy.endpoint)
    began = time.monotonic()
    try:
        manager.close()
    except ckptio.CkptError:
        pass  # closing may report the same outage; it must not hang
    assert time.monotonic() - began < DEADLINE_S + SLACK_S
    s3_proxy.clear()
    later = CheckpointManager(run, keep_last=2, options=options)
    target = {"w": torch.zeros_like(states[3]["w"]), "step": 0}
    with pytest.warns(UserWarning, match="step 3: incomplete"):  # the failed save's leftovers
        assert later.restore(target) == 2
    assert torch.equal(target["w"], states[2]["w"])
    later.save(3, states[3])  # takes over the lock the failed save could not release
    later.close()
    assert sorted(CheckpointManager(run, keep_last=2, options=options).steps()) == [2, 3]
    _only_the_committed_files(s3_client, f"{run}/step-3", options)
