"""Faults from outside the process on a tiered CheckpointManager's object-store tier: the fault
proxy (ckptio.testing.s3proxy) between the manager and a real SeaweedFS server black-holes,
resets or throttles the drain's uploads (or hangs one, and the job is killed), then
black-holes a fresh process's restore. What each
test checks: the time bound (the options' retry deadline and a slack), the error's class and
what it names (the bucket and key, the endpoint, the fix), and that what the tiers hold
afterwards agrees with it (the failed step not committed on S3, the others loadable bit for
bit, the memory tier's steps freed).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptio
from ckptio import Tier
from ckptio.storage.s3.s3path import S3Path
from ckptio.testing.s3proxy import FaultProxy

from s3.test_silent_s3 import DEADLINE_S, SLACK_S

MiB = 1 << 20


def _options(endpoint: str) -> ckptio.Options:
    """Through the proxy, each request retried for DEADLINE_S (seconds, not the default's)."""
    return ckptio.Options(buffer_bytes=5 * MiB, pool_bytes=20 * MiB, s3_endpoint_url=endpoint,
                          s3_retry_deadline_s=DEADLINE_S, s3_lock_lease_s=2.0)


def _state(value: float, mib: int = 12) -> dict[str, torch.Tensor]:
    return {"w": torch.full((mib * MiB // 4,), value), "b": torch.arange(16.0) + value}


def _zeros(mib: int = 12) -> dict[str, torch.Tensor]:
    return {"w": torch.zeros(mib * MiB // 4), "b": torch.zeros(16)}


def _assert_state(got: dict[str, torch.Tensor], value: float, mib: int = 12) -> None:
    want = _state(value, mib)
    assert all(torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8)) for k in want)


def _uploads(s3_client: Any, url: str) -> list[Any]:
    where = S3Path.parse(url)
    listed = s3_client.list_multipart_uploads(Bucket=where.bucket, Prefix=where.dir_prefix)
    return list(listed.get("Uploads") or [])


def _in_time(began: float) -> None:
    took = time.monotonic() - began
    assert took < DEADLINE_S + SLACK_S, f"took {took:.1f} s"


@pytest.mark.parametrize("fault", ["black_hole", "reset", "throttle"])
def test_a_drain_upload_cut_off_fails_in_time_and_the_next_step_lands(
        shm: str, s3_env: str, s3_proxy: FaultProxy, s3_client: Any, fault: str) -> None:
    """Memory first, S3 second: part 2 of step 2's data upload, from an async save, is
    black-holed, reset mid-body or throttled (SlowDown) for good. The drain's error comes
    within the retry deadline and a slack, naming the object, the endpoint and the fix; no
    multipart upload is left open, S3 lists step 2 neither committed nor incomplete; healed,
    step 3 lands, and S3's steps load bit for bit."""
    url = f"{s3_env}/run"
    options = _options(s3_proxy.endpoint)
    mgr = ckptio.CheckpointManager(tiers=[Tier("shm://r", keep_last=2), Tier(url, keep_last=2)],
                                   options=options)
    mgr.save(1, _state(1.0))
    assert mgr.drained(timeout=60)
    match = {"op": "UploadPart", "part_number": 2, "times": None}
    {"black_hole": lambda: s3_proxy.black_hole(**match),
     "reset": lambda: s3_proxy.reset(after_bytes=100_000, **match),
     "throttle": lambda: s3_proxy.fail(503, "SlowDown", **match)}[fault]()
    began = time.monotonic()
    mgr.save(2, _state(2.0), asynchronous=True)
    with pytest.raises(ckptio.StorageIOError) as caught:
        mgr.drained(timeout=60)
    _in_time(began)
    said = str(caught.value)
    assert re.search(rf"part 2 of \d+ of {re.escape(url)}/step-2/data-", said), said
    assert s3_proxy.endpoint in said and "check that it is up and reachable" in said, said
    assert _uploads(s3_client, url) == []
    s3_proxy.clear()
    with ckptio.CheckpointManager(url, options=options) as alone:
        assert alone.steps() == [1] and alone.incomplete() == []
    mgr.save(3, _state(3.0))
    assert mgr.drained(timeout=60)
    mgr.close()
    for step in (1, 3):
        state = _zeros()
        ckptio.load(f"{url}/step-{step}", state, options=options)
        _assert_state(state, float(step))


def test_a_fresh_restore_from_s3_with_its_reads_black_holed_fails_in_time_naming_the_key(
        shm: str, s3_env: str, s3_proxy: FaultProxy, tmp_path: Path) -> None:
    """Memory, a local disk every 2nd step, S3 every step; the memory is lost (its directory
    removed) and a fresh process restores while every GetObject is black-holed: a
    StorageIOError within the retry deadline and a slack, naming step 3's object on S3, the
    endpoint and the setting to raise; the disk's older step 2 is not loaded in its place
    (an unreachable store is not a damaged step). Healed, step 3 is restored from S3."""
    url, disk = f"{s3_env}/run", str(tmp_path / "disk")
    options = _options(s3_proxy.endpoint)
    tiers = [Tier("shm://r", keep_last=2), Tier(disk, every=2), Tier(url, keep_last=2)]
    with ckptio.CheckpointManager(tiers=tiers, options=options) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, _state(float(step)))
            assert mgr.drained(timeout=60)
    shutil.rmtree(shm)
    s3_proxy.black_hole(op="GetObject", times=None)
    state, began = _zeros(), time.monotonic()
    with ckptio.CheckpointManager(tiers=tiers, options=options) as again:
        with pytest.raises(ckptio.StorageIOError) as caught:
            again.restore(state)
        _in_time(began)
        said = str(caught.value)
        assert f"{url}/step-3/" in said and s3_proxy.endpoint in said, said
        assert "s3_retry_deadline_s" in said, said
        s3_proxy.clear()
        assert again.restore(state) == 3 and again.last_restore["location"] == url
    _assert_state(state, 3.0)


KILLED = r"""
import sys, time, torch, ckptio
from ckptio import Tier
url, endpoint = sys.argv[1], sys.argv[2]
options = ckptio.Options(buffer_bytes=5 << 20, pool_bytes=20 << 20, s3_endpoint_url=endpoint,
                         s3_retry_deadline_s=30.0)
mgr = ckptio.CheckpointManager(tiers=[Tier("shm://r", keep_last=2), Tier(url, keep_last=2)],
                               options=options)
def state(v):
    return {"w": torch.full((3 << 20,), v), "b": torch.arange(16.0) + v}
mgr.save(1, state(1.0))
mgr.drained(timeout=60)
mgr.save(2, state(2.0))
print("saved 2", flush=True)
time.sleep(60)
"""


def test_a_kill_during_a_black_holed_drain_upload_is_resumed_by_the_restart(
        shm: str, s3_env: str, s3_proxy: FaultProxy, s3_client: Any) -> None:
    """A job whose drain's upload of step 2 to S3 hangs (part 2 black-holed) is killed
    (SIGKILL): S3 holds step 1 committed, step 2 incomplete and its multipart upload open.
    The restart restores step 2 from memory bit for bit, its drain copies step 2 to S3, and
    once it saved on no upload is left open and S3 holds only committed steps."""
    url = f"{s3_env}/run"
    hole = s3_proxy.black_hole(op="UploadPart", part_number=2, key=r"/step-2/", times=None)
    started = time.monotonic()
    child = subprocess.Popen([sys.executable, "-c", KILLED, url, s3_proxy.endpoint],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline() == "saved 2\n"
        while not hole.fired:  # the upload hangs now
            assert time.monotonic() - started < 30, dict(s3_proxy.counts)
            time.sleep(0.05)
    finally:
        child.kill()
        child.wait()
    s3_proxy.clear()
    options = _options(s3_proxy.endpoint)
    with ckptio.CheckpointManager(url, options=options) as alone:
        assert alone.steps() == [1] and alone.incomplete() == [2]
    state = _zeros()
    with ckptio.CheckpointManager(tiers=[Tier("shm://r", keep_last=2), Tier(url, keep_last=2)],
                                  options=options) as mgr:
        assert mgr.restore(state) == 2 and mgr.last_restore["tier"] == 0
        assert mgr.drained(timeout=60)
        assert mgr.status()[1]["committed"] == [1, 2]
        for step in (3, 4):
            mgr.save(step, _state(float(step)))
            assert mgr.drained(timeout=60)
    _assert_state(state, 2.0)
    assert _uploads(s3_client, url) == []
    with ckptio.CheckpointManager(url, options=options) as alone:
        assert alone.steps() == [3, 4] and alone.incomplete() == []
    assert time.monotonic() - started < 60
