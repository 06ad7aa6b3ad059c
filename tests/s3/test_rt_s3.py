"""Red-team checks of the S3 store through the public API, against a real SeaweedFS server
behind the fault proxy: what a demanding user meets when the network fails part way (a store
that stays silent across saves, ...). Each fault ends in a CkptError within a stated time,
commits nothing incomplete, and a later restore gets the last good step."""

from __future__ import annotations

import functools
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

import ckptio
from ckptio.managing.manager import CheckpointManager
from ckptio.storage.local.dirlock import LOCK_NAME
from ckptio.storage.object_common import MARKER
from ckptio.storage.s3 import client, timeouts
from ckptio.storage.s3.s3path import S3Path
from ckptio.testing.s3proxy import FaultProxy
from object_store_cases import raises_within, random_state
from s3.test_silent_s3 import DEADLINE_S, _options

_state = functools.partial(random_state, mib=6)  # these cases' states: 6 MiB

MiB = 1 << 20
# a save that waits for another save's lock (if_locked="wait"), reporting when its caller is
# interrupted; the process must then exit
WAITER = """
import signal  # Ctrl-C raises, as in a terminal: a background job (CI's) ignores SIGINT
signal.signal(signal.SIGINT, signal.default_int_handler)
import sys, time, torch, ckptio
options = ckptio.Options(s3_endpoint_url=sys.argv[2], s3_retry_deadline_s=4.0,
                         s3_lock_lease_s=2.0)
print("saving", flush=True)
try:
    ckptio.Checkpointer(options).save({"w": torch.ones(8)}, sys.argv[1])
    print("saved", flush=True)
except KeyboardInterrupt:
    print("interrupted", flush=True)
"""


@pytest.fixture
def _fresh_outages() -> Any:
    timeouts.reset()
    yield
    timeouts.reset()


def test_a_store_silent_across_saves_blocks_each_later_async_save_briefly_not_a_deadline(
        s3_env: str, s3_proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch,
        _fresh_outages: None) -> None:
    """S3 the only tier, async saves, the store silent from step 2 on: step 2's pre-save
    checks wait out the deadline (nothing tells silence from slowness yet); every later due
    save, the store still silent, is a probe of a tenth of it (at least FLOOR_S), not another
    whole deadline of the training loop. Healed, the next save commits; restore gets it."""
    monkeypatch.setattr(timeouts, "WINDOW_S", 0.5)  # the saves below come after the outage
    run = f"{s3_env}/run"
    manager = CheckpointManager(run, keep_last=2, options=_options(s3_proxy.endpoint))
    manager.save(1, _state(1), asynchronous=True)
    manager.wait()
    s3_proxy.partition()
    raises_within(DEADLINE_S + 3, lambda: manager.save(2, _state(2), asynchronous=True))
    time.sleep(1.0)
    message = raises_within(timeouts.FLOOR_S + 1.5,
                             lambda: manager.save(3, _state(3), asynchronous=True))
    assert "no request to it has succeeded since an earlier one gave up" in message, message
    assert f"{run}/step-3" in message and s3_proxy.endpoint in message, message
    s3_proxy.clear()
    time.sleep(1.0)
    manager.save(4, _state(4), asynchronous=True)  # the first answer ends the probes
    manager.close()
    target = _state(0)
    assert CheckpointManager(run, keep_last=2, options=_options(s3_proxy.endpoint)).restore(
        target) == 4
    assert torch.equal(target["w"], _state(4)["w"])


def test_ctrl_c_while_a_save_waits_for_another_jobs_lock_lets_the_process_exit(
        s3_env: str, s3_live: Any, s3_client: Any) -> None:
    """Another job's save holds the prefix's lock (renewed, on another host); this process's
    save waits for it. Ctrl-C: KeyboardInterrupt, and the process exits within seconds (its
    save stops waiting: an exit waits for the saves in flight), writing nothing; the other
    job's lock is left alone."""
    url = f"{s3_env}/waiting"
    where = S3Path.parse(url).child(LOCK_NAME)
    holder = {"host": "other-host", "pid": 1, "since": "now", "save": "theirs", "lease_s": 2.0}
    stop = threading.Event()

    def renew() -> None:
        while not stop.is_set():
            s3_client.put_object(Bucket=where.bucket, Key=where.key,
                                 Body=json.dumps({**holder, "at": time.time()}).encode())
            stop.wait(0.3)

    renewing = threading.Thread(target=renew, daemon=True)
    renewing.start()
    waiter = subprocess.Popen([sys.executable, "-c", WAITER, url, s3_live.endpoint],
                              env=os.environ.copy(), stdout=subprocess.PIPE, text=True)
    try:
        assert waiter.stdout is not None and waiter.stdout.readline().strip() == "saving"
        time.sleep(1.5)  # in the lock's wait
        waiter.send_signal(signal.SIGINT)
        out, _ = waiter.communicate(timeout=8)  # old code: waits as long as the lock is held
        assert "interrupted" in out and waiter.returncode == 0, out
        prefix = S3Path.parse(url).dir_prefix
        listed = s3_client.list_objects_v2(Bucket=where.bucket, Prefix=prefix)
        assert [o["Key"] for o in listed.get("Contents", [])] == [where.key]
        assert not s3_client.list_multipart_uploads(Bucket=where.bucket,
                                                    Prefix=prefix).get("Uploads")
    finally:
        stop.set()
        renewing.join()
        if waiter.poll() is None:
            waiter.kill()
            waiter.wait()


def test_a_data_object_deleted_while_a_load_reads_it_names_the_cause_and_the_fix(
        s3_env: str, s3_proxy: FaultProxy, s3_client: Any) -> None:
    """Another save replaces the checkpoint at the same location (its cleanup deletes the old
    data objects) while this load reads them: the GET finds nothing (404). The load fails,
    naming the object, why it is gone and what to do; nothing half-read is returned."""
    url = f"{s3_env}/replaced"
    options = _options(s3_proxy.endpoint)
    ckptio.Checkpointer(options).save(_state(1), url)
    s3_proxy.on_request(lambda req: s3_client.delete_object(Bucket=req.bucket, Key=req.key),
                        op="GetObject", key="/data-")
    target = _state(0)
    with pytest.raises(ckptio.StorageIOError) as info:
        ckptio.Checkpointer(options).load(url, target)
    message = str(info.value)
    assert "/data-" in message and "no longer exists" in message, message
    assert "another save replaced this checkpoint" in message and "load it again" in message


def test_many_step_prefixes_are_told_apart_by_one_listing_not_lookups_of_each(
        s3_env: str, s3_proxy: FaultProxy, s3_client: Any) -> None:
    """A run prefix holding 300 step prefixes (interrupted saves, never deleted; or a run
    keeping every step): a restore and each save's retention list them page by page instead of
    sending HEADs for every step (which made each save wait seconds), and tell them apart as
    the look-ups do: committed, incomplete, marked for removal (hidden), an object named like a
    step (no step). Restore gets the newest committed step, on the listing's last page."""
    run = f"{s3_env}/many"
    where = S3Path.parse(run)
    options = _options(s3_proxy.endpoint)
    with CheckpointManager(run, keep_last=2, options=options) as manager:
        manager.save(900, _state(900, mib=1))
    keys = [f"{where.dir_prefix}step-{n}/data-x.bin" for n in range(1000, 1300)]
    keys += [f"{where.dir_prefix}step-1300/{MARKER}", f"{where.dir_prefix}step-1300/manifest.json",
             f"{where.dir_prefix}step-1301"]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda key: s3_client.put_object(Bucket=where.bucket, Key=key, Body=b"x"),
                      keys))
    s3_proxy.reset_counters()
    manager = CheckpointManager(run, keep_last=2, options=options)
    target = _state(0, mib=1)
    with pytest.warns(UserWarning, match="incomplete"):
        assert manager.restore(target) == 900
    assert torch.equal(target["w"], _state(900, mib=1)["w"])
    manager.save(901, _state(901, mib=1))
    assert s3_proxy.counts["HeadObject"] < 40, dict(s3_proxy.counts)  # old: 2 per step, twice
    assert manager.steps() == [900, 901]
    assert manager.incomplete() == list(range(1000, 1300))
    manager.close()


def test_a_proxy_that_does_not_answer_fails_within_seconds_naming_the_proxy(
        s3_env: str, s3_proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch,
        _fresh_outages: None) -> None:
    """HTTPS_PROXY / HTTP_PROXY name a proxy nothing listens on (a cluster's stale setting):
    like an endpoint that never answered, the save is refused within seconds (UNREACHED_S and
    one attempt), naming the proxy variables, not retried for the whole deadline as a store
    'refusing or dropping requests'."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    for name in ("HTTPS_PROXY", "HTTP_PROXY", "https_proxy", "http_proxy"):
        monkeypatch.setenv(name, dead)
    options = _options(s3_proxy.endpoint, s3_retry_deadline_s=30.0)
    message = raises_within(client.UNREACHED_S + 8, lambda: ckptio.Checkpointer(options).save(
        _state(1, mib=1), f"{s3_env}/proxied"))
    assert "the proxy to" in message and "HTTPS_PROXY" in message and dead in message, message


def test_with_no_endpoint_set_and_aws_unreachable_the_save_fails_in_seconds_naming_the_network(
        s3_env: str, monkeypatch: pytest.MonkeyPatch, _fresh_outages: None) -> None:
    """An AWS user sets no endpoint; AWS's endpoint for the region cannot be reached (no
    network here, or a region whose host does not resolve): refused within seconds, naming the
    network, DNS, proxy and AWS_REGION, not 'check the endpoint URL, its port and that the
    server is running'."""
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "HTTPS_PROXY", "https_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_REGION", "xx-nowhere-9")  # s3.xx-nowhere-9.amazonaws.com: no host
    message = raises_within(client.UNREACHED_S + 10, lambda: ckptio.Checkpointer().save(
        _state(1, mib=1), "s3://ckptio-rts3-nowhere/run/a"))
    assert "AWS S3 cannot be reached" in message and "AWS_REGION" in message, message
    assert "network" in message and "AWS_ENDPOINT_URL" in message, message
