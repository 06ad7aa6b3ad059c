"""What a load pays once, before its first data byte (docs/BENCH_S3.md, round five): no HEAD of
a data object the store has just looked up, and the integrity that HEAD gave kept. Against the
real SeaweedFS (tests/s3/conftest.py)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch

import ckptio
from ckptio.storage.s3 import objects as s3objects
from ckptio.storage.s3.settings import S3Settings
from ckptio.options import MiB, Options
from ckptio.storage.s3.store import S3Store


def _data_requests(proxy: Any, op: str) -> list[str]:
    return [r.key for r in proxy.requests if r.op == op and "/data-" in f"/{r.key}"]


def _load_counted(proxy: Any, url: str, state: dict[str, torch.Tensor], options: Options) -> None:
    proxy.reset_counters()
    got = ckptio.load(url, options=options)
    assert all(torch.equal(got[k], v) for k, v in state.items())


def test_a_load_sends_no_head_of_its_own_for_the_data_objects_it_looked_up(s3_env, s3_proxy,
                                                                           s3_client):
    """One data object: the look-up that refuses a missing or short file (check_files) is the
    only HEAD of it; before, opening it for reading sent a second. Three data objects
    (multipart uploads): one listing looks them up, its ETags pin the GETs, and no HEAD of a
    data object is sent at all."""
    options = Options(s3_endpoint_url=s3_proxy.endpoint, use_profile=False, buffer_bytes=MiB,
                      pool_bytes=4 * MiB, max_file_bytes=MiB)
    one = {"a": torch.randn(MiB // 8)}
    ckptio.save(one, f"{s3_env}/one", options=options)
    _load_counted(s3_proxy, f"{s3_env}/one", one, options)
    heads = _data_requests(s3_proxy, "HeadObject")
    assert len(heads) == 1 and len(set(_data_requests(s3_proxy, "GetObject"))) == 1, heads
    three = {k: torch.randn(6 * MiB // 4) for k in "abc"}  # a file each, of two parts
    ckptio.save(three, f"{s3_env}/three", options=replace(options, max_file_bytes=7 * MiB))
    listed = s3_client.list_objects_v2(Bucket="ckpt", Prefix=f"{s3_env[10:]}/three/data-")
    assert [o["ETag"].count("-") for o in listed["Contents"]] == [1, 1, 1]  # "<md5>-<parts>"
    _load_counted(s3_proxy, f"{s3_env}/three", three, replace(options, max_file_bytes=7 * MiB))
    assert len(set(_data_requests(s3_proxy, "GetObject"))) == 3, s3_proxy.requests
    assert _data_requests(s3_proxy, "HeadObject") == [], _data_requests(s3_proxy, "HeadObject")
    assert s3_proxy.counts["ListObjectsV2"] == 1


def _opened_after_look_up(s3_env: str, s3_client: Any, replace: bytes | None) -> tuple[Any, Any, str]:
    """A saved one-object checkpoint, its data object looked up by its store (as a load does),
    then (``replace``) overwritten behind the store's back; -> (backend, handle, url)."""
    url = f"{s3_env}/replaced"
    ckptio.save({"a": torch.randn(MiB // 4)}, url, options=Options(use_profile=False))
    store = S3Store(url, S3Settings())
    name = next(n for n in store.names() if n.startswith("data-"))
    assert store.sizes([name])[name] == MiB
    where = store.where.child(name)
    if replace is not None:
        s3_client.put_object(Bucket=where.bucket, Key=where.key, Body=replace)
    backend = store.backend(Options(use_profile=False))
    return backend, backend.open_read(where.url), where.url


def test_an_object_replaced_after_its_look_up_fails_the_read_naming_it(s3_env, s3_client):
    """The open takes the store's look-up (size, ETag) instead of a HEAD; an object replaced
    after it (truncated here) fails the GET (412 on the pinned ETag) naming the object and
    the fix, as it did when the open sent its own HEAD."""
    backend, fh, url = _opened_after_look_up(s3_env, s3_client, b"\0" * 1000)
    try:
        with pytest.raises(ckptio.CkptError, match=rf"{url} changed since it was opened.*"
                           "load it again"):
            backend.submit_read(fh, 0, memoryview(bytearray(MiB))).result()
    finally:
        backend.shutdown()


def test_a_truncated_data_object_still_fails_the_load_naming_it(s3_env, s3_client):
    url = f"{s3_env}/short"
    ckptio.save({"a": torch.randn(MiB // 4)}, url, options=Options(use_profile=False))
    store = S3Store(url, S3Settings())
    name = next(n for n in store.names() if n.startswith("data-"))
    where = store.where.child(name)
    s3_client.put_object(Bucket=where.bucket, Key=where.key, Body=b"\0" * 1000)
    with pytest.raises(ckptio.CorruptCheckpointError, match=rf"{where.url} is truncated: 1000 of"):
        ckptio.load(url, options=Options(use_profile=False))


def test_a_look_up_opens_once_and_a_later_open_sends_its_head(s3_env, s3_proxy):
    """What a store saw of a data object is taken by one open; the next open of the object looks
    it up itself; what it saw of the manifest is not handed on at all."""
    url = f"{s3_env}/twice"
    ckptio.save({"a": torch.randn(MiB // 4)}, url, options=Options(use_profile=False))
    store = S3Store(url, S3Settings(endpoint_url=s3_proxy.endpoint))
    name = next(n for n in store.names() if n.startswith("data-"))
    backend = store.backend(Options(use_profile=False))
    try:
        s3_proxy.reset_counters()
        store.sizes([name, "manifest.json"])  # a manifest may be rewritten: never handed on
        assert s3objects.take(S3Settings(endpoint_url=s3_proxy.endpoint).endpoint(),
                              store.path_of("manifest.json")) is None
        backend.open_read(store.path_of(name))
        assert len(_data_requests(s3_proxy, "HeadObject")) == 1
        backend.open_read(store.path_of(name))
        assert len(_data_requests(s3_proxy, "HeadObject")) == 2
    finally:
        backend.shutdown()


def test_a_get_of_another_size_or_etag_than_opened_is_caught():
    """A GET whose Content-Range gives another object size, or another ETag, than the object
    had when opened fails naming the object (the store's look-up and the object disagree)."""
    url = "s3://b/k/data-1"
    ok = {"ContentRange": "bytes 0-99/4096", "ETag": '"e"'}
    s3objects.check_answer(ok, url, 4096, '"e"')
    with pytest.raises(ckptio.CkptError, match=rf"reading {url} failed: .* 1000 bytes, but it "
                       "was 4096 when opened"):
        s3objects.check_answer({**ok, "ContentRange": "bytes 0-99/1000"}, url, 4096, '"e"')
    with pytest.raises(ckptio.CkptError, match=rf"reading {url} failed: the object's ETag is"):
        s3objects.check_answer({**ok, "ETag": '"f"'}, url, 4096, '"e"')
    short = s3objects.refusal(416, "reading bytes 0-9 of " + url, url)
    assert short is not None and "truncated" in str(short) and url in str(short)


def test_a_look_up_is_forgotten_after_its_ttl(monkeypatch):
    s3objects.remember("e", "s3://b/k", 10, '"x"')
    clock = [s3objects.time.monotonic() + s3objects.SEEN_TTL_S + 1]
    monkeypatch.setattr(s3objects.time, "monotonic", lambda: clock[0])
    assert s3objects.take("e", "s3://b/k") is None
    s3objects.remember("e", "s3://b/k", 10, '"x"')
    assert s3objects.take("other endpoint", "s3://b/k") is None
    assert s3objects.take("e", "s3://b/k") == (10, '"x"')


@pytest.mark.parametrize("tuned", [False, True], ids=["untuned", "tuned"])
def test_prepare_makes_the_client_so_the_first_load_makes_none(s3_env, s3_proxy, monkeypatch,
                                                                tmp_path, tuned):
    """Checkpointer.prepare(s3 url) at a job's start makes the boto3 client (0.2-0.3 s of a
    fresh process's first load, docs/BENCH_S3.md round six) without sending anything; the load
    after it makes no client of its own and reads the state bitwise. Tuned: the endpoint's
    profile keeps fewer requests in flight than the store's defaults, and prepare makes the
    backend (tuned) before the load's store: the one client serves both."""
    from ckptio import Checkpointer
    from ckptio.storage.s3 import client as s3client
    from ckptio.tuning import profile

    monkeypatch.setenv(profile.PATH_ENV, str(tmp_path / "profiles.json"))
    if tuned:
        profile.store(profile.S3Profile(s3_proxy.endpoint, 2, 8 * MiB, "2026-11-25T00:00:00Z",
                                        0.1, 0.2, io_depth=1, read_bytes=4 * MiB))
    options = Options(s3_endpoint_url=s3_proxy.endpoint, use_profile=tuned)
    state = {"a": torch.randn(MiB // 4), "b": torch.arange(10)}
    url = f"{s3_env}/prepared"
    ckptio.save(state, url, options=options)
    made: list[str] = []
    make = s3client._make_client

    def counted(settings: S3Settings) -> Any:
        made.append(settings.endpoint())
        return make(settings)

    monkeypatch.setattr(s3client, "_clients", {})
    monkeypatch.setattr(s3client, "_make_client", counted)
    ck = Checkpointer(options)
    try:
        s3_proxy.reset_counters()
        ck.prepare(url)
        assert made == [s3_proxy.endpoint], made
        assert s3_proxy.requests == [], "prepare must not send requests"
        dest = {"a": torch.zeros(MiB // 4), "b": torch.zeros(10, dtype=torch.int64)}
        ck.load(url, dest)
        assert made == [s3_proxy.endpoint], made
        assert all(torch.equal(dest[k], v) for k, v in state.items())
    finally:
        ck.close()


def test_prepare_with_a_profile_that_does_not_exist_fails_at_once_naming_it(s3_env, monkeypatch):
    """A job learns of a wrong AWS profile when it prepares, not at its first checkpoint."""
    from ckptio import Checkpointer

    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/ckptio-test-config")
    ck = Checkpointer(Options(s3_profile="no-such-profile-ckptio", use_profile=False))
    with pytest.raises(ckptio.CkptError, match="no-such-profile-ckptio"):
        ck.prepare(f"{s3_env}/wrong-profile")
    ck.close()
