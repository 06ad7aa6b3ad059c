"""The S3 client layer without a server: URLs, the retry policy (what is retried, the deadline,
giving up fast once the store is known down), options, and the message without boto3."""

from __future__ import annotations

import sys

import pytest

import ckptio
from ckptio.errors import CkptError, StorageIOError
from ckptio.storage.s3 import client as s3client
from ckptio.storage.s3.client import call
from ckptio.storage.s3.s3path import S3Path
from ckptio.storage.s3.settings import S3Settings

botocore = pytest.importorskip("botocore")
from botocore.exceptions import ClientError, EndpointConnectionError  # noqa: E402 - only once botocore is there


def _error(http: int, code: str) -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": "m"},
                        "ResponseMetadata": {"HTTPStatusCode": http}}, "PutObject")


class _Flaky:
    """Fails with ``errors`` in turn, then returns "ok"."""

    def __init__(self, *errors: BaseException) -> None:
        self.errors, self.calls = list(errors), 0

    def __call__(self) -> str:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return "ok"


@pytest.fixture(autouse=True)
def _nothing_down():
    s3client.timeouts.reset()
    yield
    s3client.timeouts.reset()


def test_transient_failures_are_retried_until_success():
    settings = S3Settings(endpoint_url="http://a:1", retry_deadline_s=60)
    request = _Flaky(_error(503, "SlowDown"), _error(500, "InternalError"),
                     _error(409, "ConditionalRequestConflict"),
                     EndpointConnectionError(endpoint_url="http://a:1"))
    pauses: list[float] = []
    assert call(settings, "uploading x", request, sleep=pauses.append) == "ok"
    assert request.calls == 5 and len(pauses) == 4 and all(0 <= p <= 5 for p in pauses)


@pytest.mark.parametrize("http,code", [(403, "AccessDenied"), (404, "NoSuchKey"),
                                       (412, "PreconditionFailed"), (400, "EntityTooSmall")])
def test_answers_are_not_retried(http, code):
    request = _Flaky(_error(http, code))
    with pytest.raises(ClientError):
        call(S3Settings(endpoint_url="http://a:1"), "x", request, sleep=lambda s: None)
    assert request.calls == 1


def test_giving_up_names_the_object_the_cause_and_the_fix_then_others_give_up_fast():
    settings = S3Settings(endpoint_url="http://down:1", retry_deadline_s=0.05)
    always = _Flaky(*[_error(503, "SlowDown")] * 1000)
    with pytest.raises(StorageIOError) as info:
        call(settings, "uploading part 3 of s3://b/k", always)
    text = str(info.value)
    assert "part 3 of s3://b/k" in text and "503 SlowDown" in text
    assert "s3_retry_deadline_s" in text and "http://down:1" in text
    patient = S3Settings(endpoint_url="http://down:1", retry_deadline_s=60)
    cleanup = _Flaky(*[_error(500, "InternalError")] * 10)
    with pytest.raises(StorageIOError, match="1 attempt"):
        call(patient, "removing k", cleanup, sleep=lambda s: None)
    assert cleanup.calls == 1  # the store is known down: no deadline waited out again
    assert call(patient, "listing", _Flaky()) == "ok"  # a success clears it
    assert call(patient, "again", _Flaky(_error(500, "InternalError")),
                sleep=lambda s: None) == "ok"


def test_urls():
    assert S3Path.parse("s3://bucket/a/b/").key == "a/b"
    assert S3Path.parse("s3://bucket/a").child("x").url == "s3://bucket/a/x"
    assert S3Path.parse("s3://bucket").child("x").url == "s3://bucket/x"
    for bad in ("s3://", "s3://UPPER/x", "s3://b/a//b", "s3://b/./x", "http://b/x"):
        with pytest.raises(CkptError):
            S3Path.parse(bad)


def test_s3_options_are_checked_and_read_from_the_environment(monkeypatch):
    with pytest.raises(CkptError, match="s3_concurrency"):
        ckptio.Options(s3_concurrency=0)
    with pytest.raises(CkptError, match="s3_conditional"):
        ckptio.Options(s3_conditional="maybe")  # type: ignore[arg-type]
    for lease in (0, 0.5, 1.9):  # lock ages are 1-second HTTP dates: a live lock could look stale
        with pytest.raises(CkptError, match="s3_lock_lease_s.*>= 2"):
            ckptio.Options(s3_lock_lease_s=lease)
    assert ckptio.Options(s3_lock_lease_s=2).s3_lock_lease_s == 2
    monkeypatch.setenv("CKPTIO_S3_RETRY_DEADLINE_S", "7.5")
    monkeypatch.setenv("CKPTIO_S3_ENDPOINT_URL", "http://127.0.0.1:9")
    options = ckptio.Options.from_env()
    assert options.s3_retry_deadline_s == 7.5 and options.s3_endpoint_url == "http://127.0.0.1:9"


def test_without_boto3_an_s3_path_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "boto3", None)
    s3client._clients.clear()
    with pytest.raises(CkptError, match=r"pip install boto3 \(the s3 extra"):
        ckptio.load("s3://bucket/run/step-1")
    s3client._clients.clear()
