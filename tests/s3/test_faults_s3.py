"""Faults between ckptio and a real SeaweedFS server: throttling and 5xx injected by a proxy,
connections reset mid-body, answers lost after the server acted, the server SIGKILLed
mid-upload (restarted in time, or not), and a saver SIGKILLed mid-upload. In every case: a
clear error or a success, nothing half-committed, the previous checkpoint loads bitwise, and
no multipart upload is left open after the next save."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any

import pytest
import torch

import ckptio
from ckptio.storage.select import store_for
from ckptio.storage.s3.s3path import S3Path
from ckptio.storage.s3.settings import S3Settings
from ckptio.storage.steps import named as names_in
from ckptio.storage.s3.store import S3Store

MiB = 1 << 20


def _state(seed: int, mib: int = 24) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(mib * MiB // 4, generator=g), "step": seed}


def _options(endpoint: str, **changes: Any) -> ckptio.Options:
    return ckptio.Options(buffer_bytes=5 * MiB, pool_bytes=20 * MiB, s3_endpoint_url=endpoint,
                          **changes)


def _open_uploads(client: Any, url: str) -> list[str]:
    where = S3Path.parse(url)
    answer = client.list_multipart_uploads(Bucket=where.bucket, Prefix=where.key + "/")
    return [u["Key"] for u in answer.get("Uploads", [])]


def _objects(client: Any, url: str) -> list[str]:
    where = S3Path.parse(url)
    answer = client.list_objects_v2(Bucket=where.bucket, Prefix=where.key + "/")
    return sorted(o["Key"].rsplit("/", 1)[1] for o in answer.get("Contents", []))


def _committed(url: str, options: ckptio.Options) -> dict[str, Any]:
    return ckptio.Checkpointer(options).load(url)


def _only_the_committed_files(client: Any, url: str, options: ckptio.Options) -> None:
    """No open upload, and every data object is one the committed manifest names."""
    assert _open_uploads(client, url) == []
    store = store_for(url, options)
    named = set(names_in(store.read_manifest()))
    assert set(store.names()) == named, (store.names(), named)


def test_throttling_resets_and_lost_answers_are_absorbed(s3_env, s3_proxy, s3_client):
    url = f"{s3_env}/absorbed"
    options = _options(s3_proxy.endpoint)
    throttled = s3_proxy.fail(503, "SlowDown", times=3, op="UploadPart")
    failing = s3_proxy.fail(500, "InternalError", times=2, op="CreateMultipartUpload")
    reset = s3_proxy.reset(times=2, after_bytes=MiB, op="UploadPart")
    lost_complete = s3_proxy.drop_response(times=1, op="CompleteMultipartUpload")
    lost_commit = s3_proxy.drop_response(times=1, op="PutObject", key=r"manifest\.json$")
    state = _state(1)
    checkpointer = ckptio.Checkpointer(options)
    checkpointer.save(state, url)
    for rule in (throttled, failing, reset, lost_complete, lost_commit):
        assert rule.times == 0 and rule.fired > 0, rule  # every fault happened
    s3_proxy.clear()
    s3_proxy.reset_counters()
    slow_reads = s3_proxy.fail(503, "SlowDown", times=2, op="GetObject")
    loaded = checkpointer.load(url)
    assert torch.equal(loaded["w"], state["w"]) and slow_reads.times == 0
    checkpointer.close()
    _only_the_committed_files(s3_client, url, options)


def test_get_bodies_cut_short_are_retried_or_resumed(s3_env, s3_proxy):
    """A GET whose connection is reset before the body's first byte is retried; one reset
    mid-body keeps what arrived and asks for the rest (bodies are read from the socket
    straight into the staging buffer: storage/s3/body.py read_body)."""
    url = f"{s3_env}/cut-bodies"
    options = _options(s3_proxy.endpoint)
    state = _state(3)
    checkpointer = ckptio.Checkpointer(options)
    checkpointer.save(state, url)
    at_start = s3_proxy.cut_response(times=2, after_bytes=0, op="GetObject",
                                     key=r"data-[^/]*$")
    mid_body = s3_proxy.cut_response(times=2, after_bytes=MiB + 123, op="GetObject",
                                     key=r"data-[^/]*$")
    loaded = checkpointer.load(url)
    checkpointer.close()
    assert at_start.fired == 2 and mid_body.fired == 2
    assert torch.equal(loaded["w"], state["w"]) and loaded["step"] == 3


def test_get_bodies_go_from_the_socket_into_the_callers_buffer(s3_env, s3_client):
    """The zero-copy read applies to the bodies botocore hands out today; if botocore or
    urllib3 change shape the read falls back to their readinto, and this test says so."""
    from ckptio.storage.s3 import body as s3_body

    where = S3Path.parse(f"{s3_env}/socket-read/blob")
    payload = os.urandom(3 * MiB + 7)
    s3_client.put_object(Bucket=where.bucket, Key=where.key, Body=payload)
    answer = s3_client.get_object(Bucket=where.bucket, Key=where.key, Range="bytes=5-")
    assert s3_body.socket_reader(answer["Body"]) is not None
    into = bytearray(len(payload) - 5)
    assert s3_body.read_body(answer["Body"], memoryview(into)) == len(into)
    assert bytes(into) == payload[5:]


def test_errors_past_the_deadline_fail_cleanly_and_keep_the_previous_checkpoint(
        s3_env, s3_proxy, s3_client):
    url = f"{s3_env}/deadline"
    options = _options(s3_proxy.endpoint, s3_retry_deadline_s=2.0)
    before = _state(1)
    checkpointer = ckptio.Checkpointer(options)
    checkpointer.save(before, url)
    s3_proxy.fail(500, "InternalError", times=None, op="UploadPart", part_number=3)
    with pytest.raises(ckptio.StorageIOError) as info:
        checkpointer.save(_state(2), url)
    message = str(info.value)
    assert "part 3" in message and url in message and "500" in message, message
    s3_proxy.clear()
    assert torch.equal(_committed(url, options)["w"], before["w"])
    checkpointer.close()
    _only_the_committed_files(s3_client, url, options)


def test_a_server_killed_mid_upload_and_restarted_in_time(s3_env, s3_proxy, s3_live, s3_client):
    url = f"{s3_env}/restarted"
    options = _options(s3_proxy.endpoint, s3_retry_deadline_s=60.0)
    restarted = threading.Event()

    def kill_then_restart(_request: Any) -> None:
        s3_live.kill(signal.SIGKILL)

        def later() -> None:
            time.sleep(1.0)
            s3_live.restart()
            restarted.set()

        threading.Thread(target=later, daemon=True).start()

    s3_proxy.on_request(kill_then_restart, times=1, op="UploadPart", part_number=3)
    state = _state(3)
    checkpointer = ckptio.Checkpointer(options)
    checkpointer.save(state, url)
    assert restarted.is_set()
    assert torch.equal(checkpointer.load(url)["w"], state["w"])
    checkpointer.close()
    _only_the_committed_files(s3_client, url, options)


def test_a_server_that_stays_down_fails_the_save_then_the_next_save_cleans_up(
        s3_env, s3_proxy, s3_live, s3_client):
    url = f"{s3_env}/down"
    # the failed save cannot release its lock (the server is down): the next one waits for
    # its lease to run out, 2 s here
    options = _options(s3_proxy.endpoint, s3_retry_deadline_s=3.0, s3_lock_lease_s=2.0)
    before = _state(4)
    checkpointer = ckptio.Checkpointer(options)
    checkpointer.save(before, url)
    s3_proxy.on_request(lambda _r: s3_live.kill(signal.SIGKILL), times=1, op="UploadPart",
                        part_number=2)
    with pytest.raises(ckptio.StorageIOError, match="failed after .* attempt"):
        checkpointer.save(_state(5), url)
    s3_live.restart()
    assert torch.equal(_committed(url, options)["w"], before["w"])
    checkpointer.close()
    # a restarted SeaweedFS may take seconds to answer its first writes; the deadline bounds
    # each answer's wait (storage/s3/timeouts.py), so this save gets a deadline that allows it
    checkpointer = ckptio.Checkpointer(_options(s3_proxy.endpoint, s3_retry_deadline_s=30.0,
                                                s3_lock_lease_s=2.0))
    after = _state(6)
    checkpointer.save(after, url)
    checkpointer.close()
    assert torch.equal(_committed(url, options)["w"], after["w"])
    _only_the_committed_files(s3_client, url, options)


SAVER = textwrap.dedent("""
    import sys, torch, ckptio
    state = {"w": torch.randn(24 << 18), "step": 9}
    options = ckptio.Options(buffer_bytes=5 << 20, pool_bytes=20 << 20,
                             s3_endpoint_url=sys.argv[2], s3_lock_lease_s=2.0)
    ckptio.save(state, sys.argv[1], options=options)
    print("saved: not killed", flush=True)
""")


def test_a_saver_killed_mid_upload_leaves_the_previous_checkpoint_and_no_upload_behind(
        s3_env, s3_proxy, s3_client):
    url = f"{s3_env}/sigkill"
    options = _options(s3_proxy.endpoint)
    before = _state(7)
    ckptio.Checkpointer(options).save(before, url)
    s3_proxy.reset_counters()
    s3_proxy.delay(60.0, times=None, op="UploadPart", part_number=3)
    saver = subprocess.Popen([sys.executable, "-c", SAVER, url, s3_proxy.endpoint],
                             env=os.environ.copy())
    deadline = time.monotonic() + 60
    while s3_proxy.counts["UploadPart"] < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert s3_proxy.counts["UploadPart"] >= 3, s3_proxy.counts
    saver.send_signal(signal.SIGKILL)
    assert saver.wait(30) == -signal.SIGKILL
    s3_proxy.clear()
    assert _open_uploads(s3_client, url), "the killed save left no upload open: not mid-upload"
    assert torch.equal(_committed(url, options)["w"], before["w"])
    leftovers = S3Store(url, S3Settings.of(options)).names()
    assert len(leftovers) > 1  # the committed file and the killed save's upload
    checkpointer = ckptio.Checkpointer(options)  # waits out the killed saver's 2 s lease
    after = _state(8)
    checkpointer.save(after, url)
    checkpointer.close()
    assert torch.equal(_committed(url, options)["w"], after["w"])
    _only_the_committed_files(s3_client, url, options)
