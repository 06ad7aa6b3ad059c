"""Red-team checks of the az:// store through the public API, against a real Azurite server
behind the fault proxy: what a demanding user meets when the network fails part way (a service
silent across saves, a dead HTTPS_PROXY, an account whose host does not resolve, a lease
renewal swallowed, resets, throttling, lost answers), another job works at the same prefix
(its lock, a data blob deleted under a load), a container that does not exist, Ctrl-C, or a run
of many step prefixes. Each fault ends in a CkptError naming the location and the fix within a
stated time, commits nothing incomplete, and a later restore gets the last good step."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

import ckptio
from ckptio.managing.manager import CheckpointManager
from ckptio.storage.azure import az_client
from ckptio.storage.azure.az_settings import CONNECTION_ENV, AzureSettings
from ckptio.storage.s3 import timeouts
from ckptio.testing.s3proxy import FaultProxy

from object_store_cases import raises_within, random_state, stderr_until, until
from azure_blob.conftest import through

MiB = 1 << 20
DEADLINE_S = 3.0
# a save that waits for another job's lock (if_locked="wait"), reporting when its caller is
# interrupted; the process must then exit
WAITER = """
import signal  # Ctrl-C raises, as in a terminal: a background job (CI's) ignores SIGINT
signal.signal(signal.SIGINT, signal.default_int_handler)
import sys, torch, ckptio
print("saving", flush=True)
try:
    ckptio.Checkpointer().save({"w": torch.ones(8)}, sys.argv[1])
    print("saved", flush=True)
except KeyboardInterrupt:
    print("interrupted", flush=True)
"""


def _options(connection: str, **changes: Any) -> ckptio.Options:
    given: dict[str, Any] = {"connection_string": connection, "retry_deadline_s": DEADLINE_S,
                             **changes}
    return ckptio.Options(storage={"az": AzureSettings(**given)})


def test_a_store_silent_across_saves_blocks_each_later_async_save_briefly_not_a_deadline(
        az_env: str, az_proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch) -> None:
    """The store silent from step 2 on: step 2 waits out its deadline; each later due save,
    the store still silent, is a short probe; healed, the next save commits and restores."""
    monkeypatch.setattr(timeouts, "WINDOW_S", 0.5)
    run = f"{az_env}/run"
    options = _options(through(az_proxy), retry_deadline_s=10.0)
    manager = CheckpointManager(run, keep_last=2, options=options)
    manager.save(1, random_state(1), asynchronous=True)
    manager.wait()
    az_proxy.partition()
    raises_within(10.0 + 6, lambda: manager.save(2, random_state(2), asynchronous=True))
    time.sleep(1.0)
    message = raises_within(timeouts.FLOOR_S + 2.5,
                             lambda: manager.save(3, random_state(3), asynchronous=True))
    assert "no request to it has succeeded since an earlier one gave up" in message, message
    assert f"{run}/step-3" in message, message
    az_proxy.clear()
    time.sleep(1.0)
    manager.save(4, random_state(4), asynchronous=True)
    manager.close()
    target = random_state(0)
    assert CheckpointManager(run, keep_last=2, options=options).restore(target) == 4
    assert torch.equal(target["w"], random_state(4)["w"])


def test_ctrl_c_while_a_save_waits_for_another_jobs_lock_lets_the_process_exit(
        az_env: str) -> None:
    """Another job's save holds the prefix's lease; this process's save waits. Ctrl-C: the
    process exits within seconds, writing nothing; the other job's lease is left alone."""
    from azure.storage.blob import BlobServiceClient

    url = f"{az_env}/waiting"
    box, name = url[len("az://"):].split("/", 1)
    service = BlobServiceClient.from_connection_string(os.environ[CONNECTION_ENV])
    blob = service.get_container_client(box).get_blob_client(f"{name}/.ckptio.lock")
    blob.upload_blob(json.dumps({"host": "other-host", "pid": 1, "save": "theirs"}).encode())
    lease = blob.acquire_lease(lease_duration=15)
    waiter = subprocess.Popen([sys.executable, "-c", WAITER, url], env=os.environ.copy(),
                              stdout=subprocess.PIPE, text=True)
    try:
        assert waiter.stdout is not None and waiter.stdout.readline().strip() == "saving"
        time.sleep(2.5)  # in the lock's wait
        waiter.send_signal(signal.SIGINT)
        out, _ = waiter.communicate(timeout=8)
        assert "interrupted" in out and waiter.returncode == 0, out
        names = [b.name for b in service.get_container_client(box).list_blobs(
            name_starts_with=f"{name}/")]
        assert names == [f"{name}/.ckptio.lock"], names
    finally:
        lease.release()
        if waiter.poll() is None:
            waiter.kill()
            waiter.wait()


def test_a_data_blob_deleted_while_a_load_reads_it_names_the_cause_and_the_fix(
        az_env: str, az_proxy: FaultProxy) -> None:
    """Another save replaced the checkpoint at this location (its cleanup deleted the old data
    blobs) while this load read them: Azure answers the ranged GET 404 (BlobNotFound). The load
    fails naming the blob, why it is gone and what to do, not a bare '404 BlobNotFound'."""
    url = f"{az_env}/replaced"
    options = _options(through(az_proxy))
    ckptio.Checkpointer(options).save(random_state(1), url)
    az_proxy.fail(404, "BlobNotFound", times=None, method="GET", key="/data-")
    with pytest.raises(ckptio.StorageIOError) as info:
        ckptio.Checkpointer(options).load(url, random_state(0))
    message = str(info.value)
    assert "/data-" in message and "no longer exists" in message, message
    assert "another save replaced this checkpoint" in message and "load it again" in message


def test_a_proxy_that_does_not_answer_fails_within_seconds_naming_the_proxy(
        az_env: str, az_proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch) -> None:
    """HTTP(S)_PROXY name a proxy nothing listens on: refused within seconds naming the
    proxy variables, not 'nothing answers at' the endpoint."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    for name in ("HTTPS_PROXY", "HTTP_PROXY", "https_proxy", "http_proxy"):
        monkeypatch.setenv(name, dead)
    options = _options(through(az_proxy), retry_deadline_s=30.0)
    message = raises_within(az_client.UNREACHED_S + 8, lambda: ckptio.Checkpointer(
        options).save(random_state(1, mib=1), f"{az_env}/proxied"))
    assert "proxy" in message and "HTTPS_PROXY" in message and dead in message, message


def test_an_account_url_that_cannot_be_reached_names_the_network_in_seconds(
        az_env: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A user gives an Azure account's URL (no emulator) and this machine cannot reach it: a
    CkptError within seconds naming the network, DNS and proxy."""
    for name in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy"):
        monkeypatch.delenv(name, raising=False)
    options = ckptio.Options(storage={"az": AzureSettings(
        account_url="https://ckptiortnowhere.blob.core.windows.net?sv=x&sig=y")})
    began = time.monotonic()
    with pytest.raises(ckptio.CkptError) as info:
        ckptio.Checkpointer(options).save(random_state(1, mib=1), "az://ckpt/run/a")
    took = time.monotonic() - began
    message = str(info.value)
    assert took < az_client.UNREACHED_S + 10, f"{took:.1f} s: {message}"
    assert "network" in message and "az://ckpt/run/a" in message, message



UPLOADER = """
import signal  # Ctrl-C raises, as in a terminal
signal.signal(signal.SIGINT, signal.default_int_handler)
import sys, torch, ckptio
from ckptio.storage.azure.az_settings import AzureSettings
options = ckptio.Options(storage={"az": AzureSettings(connection_string=sys.argv[2])})
print("saving", flush=True)
try:
    ckptio.Checkpointer(options).save({"w": torch.randn(16 << 20 >> 2)}, sys.argv[1])
    print("saved", flush=True)
except KeyboardInterrupt:
    print("interrupted", flush=True)
"""


def test_ctrl_c_twice_during_an_upload_exits_within_seconds_and_commits_nothing(
        az_env: str, az_proxy: FaultProxy) -> None:
    """Ctrl-C while a save's blocks go up slowly (each staged block delayed): the save raises
    KeyboardInterrupt; the exit then waits for the save in flight, saying so and that a second
    Ctrl-C exits now; a second one does, within seconds, nothing committed, and the next save
    there takes the dead process's lock at once (not after its lease)."""
    url = f"{az_env}/interrupted"
    held = az_proxy.delay(5.0, times=None, method="PUT", query={"comp": "block"})
    child = subprocess.Popen([sys.executable, "-c", UPLOADER, url, through(az_proxy)],
                             env=os.environ.copy(), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "saving"
        until(lambda: held.fired > 0, 60)  # blocks in flight (a loaded machine: not a sleep)
        child.send_signal(signal.SIGINT)
        assert child.stdout.readline().strip() == "interrupted"
        said = stderr_until(child, ("a second", "Ctrl-C"), 30)  # the exit's wait, said
        began = time.monotonic()
        child.send_signal(signal.SIGINT)
        _, err = child.communicate(timeout=15)
        took = time.monotonic() - began
        assert "a second" in said or "Ctrl-C" in said, said + err
        assert took < 5, f"exited {took:.1f} s after the second Ctrl-C"
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    az_proxy.clear()
    with pytest.raises(ckptio.IncompleteCheckpointError, match="no committed manifest"):
        ckptio.load(url, {"w": torch.zeros(4)})  # the lock blob the killed save left
    began = time.monotonic()
    ckptio.save({"w": torch.ones(4)}, url)
    assert time.monotonic() - began < 5, "the next save waited for the interrupted one's lock"


def test_many_step_prefixes_are_told_apart_by_few_listings_not_one_each(
        az_env: str, az_proxy: FaultProxy) -> None:
    """A run prefix holding 300 step prefixes (interrupted saves, never deleted): a restore and
    a save's retention tell them apart without a listing per step."""
    from azure.storage.blob import BlobServiceClient

    run = f"{az_env}/many"
    options = _options(through(az_proxy))
    with CheckpointManager(run, keep_last=2, options=options) as manager:
        manager.save(900, random_state(900, mib=1))
    box, name = run[len("az://"):].split("/", 1)
    service = BlobServiceClient.from_connection_string(os.environ[CONNECTION_ENV])
    keys = [f"{name}/step-{n}/data-x.bin" for n in range(1000, 1300)]
    keys += [f"{name}/step-1300/.deleting", f"{name}/step-1300/manifest.json", f"{name}/step-1301"]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda key: service.get_container_client(box).upload_blob(key, b"x"), keys))
    az_proxy.reset_counters()
    manager = CheckpointManager(run, keep_last=2, options=options)
    target = random_state(0, mib=1)
    began = time.monotonic()
    with pytest.warns(UserWarning, match="incomplete"):
        assert manager.restore(target) == 900
    manager.save(901, random_state(901, mib=1))
    took = time.monotonic() - began
    lists = sum(1 for r in az_proxy.requests if r.query.get("comp") == "list")
    assert lists < 40, f"{lists} listings in {took:.1f} s"
    assert manager.steps() == [900, 901]
    assert manager.incomplete() == list(range(1000, 1300))
    manager.close()


@pytest.mark.parametrize("fault", ["reset", "throttle", "lost answers"])
def test_an_upload_reset_throttled_or_unanswered_part_way_is_retried_and_commits(
        az_env: str, az_proxy: FaultProxy, fault: str) -> None:
    """A connection reset in the middle of a staged block, the service answering 503 to blocks
    and the block list, or the block list's and the manifest's commits acted on but their
    answers lost: each is retried within the deadline, the save commits once, a load gets it."""
    url = f"{az_env}/{fault.replace(' ', '-')}"
    options = _options(through(az_proxy), retry_deadline_s=20.0)
    if fault == "reset":
        rules = [az_proxy.reset(after_bytes=300_000, times=2, method="PUT",
                                query={"comp": "block"})]
    elif fault == "throttle":
        rules = [az_proxy.fail(503, "ServerBusy", times=2, method="PUT", query={"comp": "block"}),
                 az_proxy.fail(503, "ServerBusy", times=1, method="PUT",
                               query={"comp": "blocklist"})]
    else:
        rules = [az_proxy.drop_response(method="PUT", query={"comp": "blocklist"}),
                 az_proxy.drop_response(method="PUT", key="manifest.json$")]
    ckptio.Checkpointer(options).save(random_state(3), url)
    assert all(rule.fired for rule in rules), [rule.fired for rule in rules]
    target = random_state(0)
    ckptio.Checkpointer(options).load(url, target)
    assert torch.equal(target["w"], random_state(3)["w"])


def test_a_manager_restore_on_a_container_that_does_not_exist_says_nothing_was_loaded(
        az_env: str) -> None:
    """restore() of a manager on az://no-such-container/run fails listing its steps: the error
    names the container and the fix, and does not claim the state may be partly filled."""
    manager = CheckpointManager("az://no-such-box-rt/run")
    target = random_state(0, mib=1)
    message = raises_within(5.0, lambda: manager.restore(target))
    assert "container does not exist: create it" in message, message
    assert "may hold some" not in message, message
    manager.close()


def test_a_lease_renewal_left_unanswered_does_not_hold_up_the_save_that_finished(
        az_env: str, az_proxy: FaultProxy) -> None:
    """The lock's lease renewal is swallowed by the network (the rest gets through) while a
    slow save runs: the save commits (its commit is conditional, not on the lease) and returns
    soon after its last write, not after the renewal's deadline (it waited for it)."""
    url = f"{az_env}/renewal"
    options = _options(through(az_proxy), retry_deadline_s=60.0, lock_lease_s=15)
    swallowed: list[Any] = []  # from the first block on (the lease is taken by then)
    az_proxy.on_request(lambda req: swallowed.append(az_proxy.black_hole(
        method="PUT", query={"comp": "lease"})), method="PUT", query={"comp": "block"})
    az_proxy.delay(7.0, times=1, method="PUT", query={"comp": "block"})
    began = time.monotonic()
    ckptio.Checkpointer(options).save(random_state(5), url)
    took = time.monotonic() - began
    assert swallowed and swallowed[0].fired, "no renewal was sent"
    assert took < 7.0 + 6, f"the save returned {took:.1f} s after it began"
    az_proxy.clear()
    target = random_state(0)
    ckptio.Checkpointer(options).load(url, target)
    assert torch.equal(target["w"], random_state(5)["w"])
