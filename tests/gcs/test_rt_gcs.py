"""Red-team checks of the gs:// store through the public API, against the gcp-storage-emulator
behind the fault proxy: what a demanding user meets when the network fails part way (a store
silent across saves, a dead HTTPS_PROXY, resets, throttling), no endpoint is set and Google
(or its token service) cannot be reached, another job works at the same prefix (its lock, a
data object deleted under a load), a bucket that does not exist, Ctrl-C, or a run of many step
prefixes. Each fault ends in a CkptError naming the location and the fix within a stated time,
commits nothing incomplete, and a later restore gets the last good step."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import pytest
import torch

import ckptio
from ckptio.managing.manager import CheckpointManager
from ckptio.storage.gcs import gcs_client
from ckptio.storage.gcs.gcs_client import GcsPath
from ckptio.storage.s3 import timeouts
from ckptio.testing.s3proxy import FaultProxy

from object_store_cases import raises_within, random_state, stderr_until, until
from gcs.conftest import Emulator, settings_at

MiB = 1 << 20
# a save that waits for another job's lock (if_locked="wait"), reporting when its caller is
# interrupted; the process must then exit
WAITER = """
import signal  # Ctrl-C raises, as in a terminal: a background job (CI's) ignores SIGINT
signal.signal(signal.SIGINT, signal.default_int_handler)
import sys, torch, ckptio
from ckptio.storage.gcs.gcs_settings import GcsSettings
settings = GcsSettings(endpoint_url=sys.argv[2], credentials="anonymous", conditional="off",
                       lock_lease_s=30.0)
print("saving", flush=True)
try:
    ckptio.Checkpointer(ckptio.Options(storage={"gs": settings})).save(
        {"w": torch.ones(8)}, sys.argv[1])
    print("saved", flush=True)
except KeyboardInterrupt:
    print("interrupted", flush=True)
"""


def _options(endpoint: str, **changes: Any) -> ckptio.Options:
    return ckptio.Options(storage={"gs": settings_at(endpoint, **changes)})


@pytest.fixture(autouse=True)
def _fresh_outages() -> Any:
    timeouts.reset()  # an outage an earlier test met does not carry over
    yield
    timeouts.reset()


def _anonymous_client(endpoint: str) -> Any:
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    return storage.Client(project="t", credentials=AnonymousCredentials(),
                          client_options={"api_endpoint": endpoint})


def test_a_store_silent_across_saves_blocks_each_later_async_save_briefly_not_a_deadline(
        gcs_url: str, gcs_proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch) -> None:
    """The store silent from step 2 on: step 2 waits out its deadline; each later due save,
    the store still silent, is a short probe (not another deadline); healed, the next save
    commits and a restore gets it."""
    monkeypatch.setattr(timeouts, "WINDOW_S", 0.5)
    run = f"{gcs_url}/run"
    options = _options(gcs_proxy.endpoint, retry_deadline_s=10.0)
    manager = CheckpointManager(run, keep_last=2, options=options)
    manager.save(1, random_state(1), asynchronous=True)
    manager.wait()
    gcs_proxy.partition()
    raises_within(10.0 + 6, lambda: manager.save(2, random_state(2), asynchronous=True))
    time.sleep(1.0)
    message = raises_within(timeouts.FLOOR_S + 2.5,
                             lambda: manager.save(3, random_state(3), asynchronous=True))
    assert "no request to it has succeeded since an earlier one gave up" in message, message
    assert f"{run}/step-3" in message, message
    gcs_proxy.clear()
    healed = time.monotonic() + 30  # the emulator answers again once the swallowed
    while True:                     # connections it waits on are given up
        try:
            manager.steps()
            break
        except ckptio.StorageIOError:
            assert time.monotonic() < healed, "the store never answered again"
            time.sleep(0.5)
    manager.save(4, random_state(4), asynchronous=True)
    manager.close()
    target = random_state(0)
    assert CheckpointManager(run, keep_last=2, options=options).restore(target) == 4
    assert torch.equal(target["w"], random_state(4)["w"])


def test_ctrl_c_while_a_save_waits_for_another_jobs_lock_lets_the_process_exit(
        gcs_url: str, gcs_server: Emulator) -> None:
    """Another job's save holds the prefix's lock (renewed, on another host); this process's
    save waits. Ctrl-C: the process exits within seconds, writing nothing; the other job's
    lock is left alone."""
    url = f"{gcs_url}/waiting"
    where = GcsPath.parse(url).child(".ckptio.lock")
    bucket = _anonymous_client(gcs_server.endpoint).bucket(where.bucket)
    holder = {"host": "other-host", "pid": 1, "since": "now", "save": "theirs", "lease_s": 30}
    stop = threading.Event()

    def renew() -> None:
        while not stop.is_set():
            bucket.blob(where.key).upload_from_string(json.dumps(holder))
            stop.wait(0.3)

    renewing = threading.Thread(target=renew, daemon=True)
    renewing.start()
    waiter = subprocess.Popen([sys.executable, "-c", WAITER, url, gcs_server.endpoint],
                              env=os.environ.copy(), stdout=subprocess.PIPE, text=True)
    try:
        assert waiter.stdout is not None and waiter.stdout.readline().strip() == "saving"
        time.sleep(2.5)  # in the lock's wait
        waiter.send_signal(signal.SIGINT)
        out, _ = waiter.communicate(timeout=8)
        assert "interrupted" in out and waiter.returncode == 0, out
        names = [b.name for b in bucket.list_blobs(prefix=GcsPath.parse(url).dir_prefix)]
        assert names == [where.key], names
    finally:
        stop.set()
        renewing.join()
        if waiter.poll() is None:
            waiter.kill()
            waiter.wait()


def test_a_data_object_deleted_while_a_load_reads_it_names_the_cause_and_the_fix(
        gcs_url: str, gcs_proxy: FaultProxy) -> None:
    """Another save replaced the checkpoint at this location (its cleanup deleted the old data
    objects) while this load read them: GCS answers the ranged GET of the generation opened
    404. The load fails naming the object, why it is gone and what to do."""
    url = f"{gcs_url}/replaced"
    options = _options(gcs_proxy.endpoint)
    ckptio.Checkpointer(options).save(random_state(1), url)
    gcs_proxy.fail(404, "NoSuchKey", times=None, method="GET", key="data-",
                   query={"alt": "media"})
    with pytest.raises(ckptio.StorageIOError) as info:
        ckptio.Checkpointer(options).load(url, random_state(0))
    message = str(info.value)
    assert "/data-" in message and "no longer exists" in message, message
    assert "another save replaced this checkpoint" in message and "load it again" in message


def test_a_proxy_that_does_not_answer_fails_within_seconds_naming_the_proxy(
        gcs_url: str, gcs_proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch) -> None:
    """HTTP(S)_PROXY name a proxy nothing listens on: refused within seconds naming the
    proxy variables, not 'nothing answers at' the endpoint."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    for name in ("HTTPS_PROXY", "HTTP_PROXY", "https_proxy", "http_proxy"):
        monkeypatch.setenv(name, dead)
    options = _options(gcs_proxy.endpoint, retry_deadline_s=30.0)
    message = raises_within(gcs_client.UNREACHED_S + 8, lambda: ckptio.Checkpointer(
        options).save(random_state(1, mib=1), f"{gcs_url}/proxied"))
    assert "proxy" in message and "HTTPS_PROXY" in message and dead in message, message


def test_with_no_endpoint_set_and_google_unreachable_the_save_fails_in_seconds(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A user sets no endpoint (anonymous: a public bucket); Google cannot be reached from
    here: refused within seconds naming the network, DNS and proxy, not 'check the endpoint
    and that the server is running'."""
    for name in ("STORAGE_EMULATOR_HOST", "HTTPS_PROXY", "https_proxy"):
        monkeypatch.delenv(name, raising=False)
    options = ckptio.Options(storage={"gs": {"credentials": "anonymous"}})
    message = raises_within(gcs_client.UNREACHED_S + 10, lambda: ckptio.Checkpointer(
        options).save(random_state(1, mib=1), "gs://ckptio-rtgcs-nowhere/run/a"))
    assert "Google Cloud Storage cannot be reached" in message, message
    assert "network" in message and "STORAGE_EMULATOR_HOST" in message, message


def test_with_default_credentials_and_google_unreachable_the_save_fails_in_seconds(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A service account key in GOOGLE_APPLICATION_CREDENTIALS, no endpoint, and Google's
    token service cannot be reached: refused within seconds naming the network, not retried
    for the whole deadline."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption()).decode()
    account = {"type": "service_account", "project_id": "p", "private_key_id": "k",
               "private_key": pem, "client_email": "a@p.iam.gserviceaccount.com",
               "client_id": "1", "token_uri": "https://oauth2.googleapis.com/token"}
    path = tmp_path / "key.json"
    path.write_text(json.dumps(account))
    for name in ("STORAGE_EMULATOR_HOST", "HTTPS_PROXY", "https_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(path))
    message = raises_within(gcs_client.UNREACHED_S + 10, lambda: ckptio.Checkpointer().save(
        random_state(1, mib=1), "gs://ckptio-rtgcs-nowhere/run/b"))
    assert "network" in message and "gs://ckptio-rtgcs-nowhere/run/b" in message, message


UPLOADER = """
import signal  # Ctrl-C raises, as in a terminal
signal.signal(signal.SIGINT, signal.default_int_handler)
import sys, torch, ckptio
from ckptio.storage.gcs.gcs_settings import GcsSettings
settings = GcsSettings(endpoint_url=sys.argv[2], credentials="anonymous", conditional="off",
                       chunk_bytes=1 << 20)
print("saving", flush=True)
try:
    ckptio.Checkpointer(ckptio.Options(storage={"gs": settings})).save(
        {"w": torch.randn(16 << 20 >> 2)}, sys.argv[1])
    print("saved", flush=True)
except KeyboardInterrupt:
    print("interrupted", flush=True)
"""


def test_ctrl_c_twice_during_an_upload_exits_within_seconds_and_commits_nothing(
        gcs_url: str, gcs_server: Emulator, gcs_proxy: FaultProxy) -> None:
    """Ctrl-C while a save's chunks go up slowly (each delayed): the save raises
    KeyboardInterrupt; the exit waits for the save in flight, saying a second Ctrl-C exits now;
    a second one does, within seconds, nothing committed, and the next save there takes the
    dead process's lock at once."""
    url = f"{gcs_url}/interrupted"
    held = gcs_proxy.delay(3.0, times=None, method="PUT")
    child = subprocess.Popen([sys.executable, "-c", UPLOADER, url, gcs_proxy.endpoint],
                             env=os.environ.copy(), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "saving"
        until(lambda: held.fired > 0, 60)  # chunks in flight (a loaded machine: not a sleep)
        child.send_signal(signal.SIGINT)
        assert child.stdout.readline().strip() == "interrupted"
        said = stderr_until(child, ("Ctrl-C",), 30)  # the exit's wait, said
        began = time.monotonic()
        child.send_signal(signal.SIGINT)
        _, err = child.communicate(timeout=15)
        took = time.monotonic() - began
        assert "Ctrl-C" in said, said + err
        assert took < 5, f"exited {took:.1f} s after the second Ctrl-C"
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    gcs_proxy.clear()
    options = _options(gcs_server.endpoint)
    with pytest.raises(ckptio.IncompleteCheckpointError, match="no committed manifest"):
        ckptio.load(url, {"w": torch.zeros(4)}, options=options)  # the lock object left
    began = time.monotonic()
    ckptio.save({"w": torch.ones(4)}, url, options=options)
    assert time.monotonic() - began < 5, "the next save waited for the interrupted one's lock"


def test_many_step_prefixes_are_told_apart_by_few_listings_not_one_each(
        gcs_url: str, gcs_server: Emulator, gcs_proxy: FaultProxy) -> None:
    """A run prefix holding 300 step prefixes (interrupted saves, never deleted): a restore and
    a save's retention tell them apart without a listing per step (each save waited seconds on
    a real service), as the look-ups would: committed, incomplete, marked (hidden), an object
    named like a step (no step)."""
    run = f"{gcs_url}/many"
    options = _options(gcs_proxy.endpoint)
    with CheckpointManager(run, keep_last=2, options=options) as manager:
        manager.save(900, random_state(900, mib=1))
    where = GcsPath.parse(run)
    bucket = _anonymous_client(gcs_server.endpoint).bucket(where.bucket)
    keys = [f"{where.dir_prefix}step-{n}/data-x.bin" for n in range(1000, 1300)]
    keys += [f"{where.dir_prefix}step-1300/.deleting", f"{where.dir_prefix}step-1300/manifest.json",
             f"{where.dir_prefix}step-1301"]
    for key in keys:  # the emulator serves one connection at a time
        bucket.blob(key).upload_from_string(b"x")
    gcs_proxy.reset_counters()
    manager = CheckpointManager(run, keep_last=2, options=options)
    target = random_state(0, mib=1)
    with pytest.warns(UserWarning, match="incomplete"):
        assert manager.restore(target) == 900
    assert torch.equal(target["w"], random_state(900, mib=1)["w"])
    manager.save(901, random_state(901, mib=1))
    lists = sum(1 for r in gcs_proxy.requests if r.method == "GET" and r.key.endswith("/o"))
    assert lists < 40, f"{lists} listings"
    assert manager.steps() == [900, 901]
    assert manager.incomplete() == list(range(1000, 1300))
    manager.close()


@pytest.mark.parametrize("fault", ["reset", "throttle"])
def test_an_upload_reset_or_throttled_part_way_is_retried_and_the_save_commits(
        gcs_url: str, gcs_proxy: FaultProxy, fault: str) -> None:
    """A connection reset in the middle of a resumable upload's chunk, or the store answering
    503/429 to it: the chunk is retried within the deadline, the save commits, a load gets it."""
    url = f"{gcs_url}/{fault}"
    options = _options(gcs_proxy.endpoint, retry_deadline_s=20.0, chunk_bytes=1 << 20)
    if fault == "reset":
        rules = [gcs_proxy.reset(after_bytes=300_000, times=2, method="PUT")]
    else:
        rules = [gcs_proxy.fail(503, "SlowDown", times=2, method="PUT"),
                 gcs_proxy.fail(429, "SlowDown", times=1, method="PUT")]
    ckptio.Checkpointer(options).save(random_state(3), url)
    assert all(rule.fired for rule in rules), [rule.fired for rule in rules]
    target = random_state(0)
    ckptio.Checkpointer(options).load(url, target)
    assert torch.equal(target["w"], random_state(3)["w"])


def test_a_manager_on_a_bucket_that_does_not_exist_names_it_and_the_fix(
        gcs_server: Emulator) -> None:
    """A CheckpointManager on gs://no-such-bucket/run: each save, restore and listing names the
    bucket and says to create it (not a bare '404 ... unknown error'); restore does not claim
    the state may be partly filled, as nothing was read."""
    options = _options(gcs_server.endpoint)
    manager = CheckpointManager("gs://ckptio-rt-no-such-bucket/run", options=options)
    for work in (lambda: manager.save(1, random_state(1, mib=1)), lambda: manager.steps(),
                 lambda: manager.restore(random_state(0, mib=1))):
        message = raises_within(5.0, work)
        assert "bucket 'ckptio-rt-no-such-bucket' does not exist" in message, message
        assert "create it" in message and "may hold some" not in message, message
    manager.close()
