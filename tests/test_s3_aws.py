"""The client an AWS user gets: no endpoint variable, a region and keys only. botocore resolves
AWS's regional endpoint itself; nothing leaves the process (a ``before-send`` hook records each
request's URL and answers it)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest

import ckptio
from ckptio.storage.s3 import client as s3client
from ckptio.storage.s3.settings import S3Settings

botocore = pytest.importorskip("botocore")
from botocore.awsrequest import AWSPreparedRequest, AWSResponse  # noqa: E402 - only once botocore is there

_EMPTY_LISTING = (b'<?xml version="1.0" encoding="UTF-8"?><ListBucketResult '
                  b'xmlns="http://s3.amazonaws.com/doc/2006-03-01/"><Name>my-bucket</Name>'
                  b"<KeyCount>0</KeyCount><IsTruncated>false</IsTruncated></ListBucketResult>")
_NO_SUCH_KEY = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>NoSuchKey</Code>'
                b"<Message>The specified key does not exist.</Message></Error>")


class _Body:
    """What AWSResponse reads a canned answer's body from."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def stream(self, **_kwargs: object) -> Iterator[bytes]:
        yield self.data

    def read(self, *_args: object, **_kwargs: object) -> bytes:
        data, self.data = self.data, b""
        return data


@pytest.fixture
def aws_user(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The environment of a user on AWS: a region and keys, no endpoint, no ~/.aws files."""
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_DEFAULT_PROFILE",
                 "AWS_SESSION_TOKEN", "AWS_DEFAULT_REGION", "CKPTIO_S3_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_REGION", "eu-west-1")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAIOSFODNN7EXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY")


def test_with_no_endpoint_set_the_client_targets_the_regions_aws_endpoint(aws_user: None):
    settings = S3Settings.of(ckptio.Options())
    made = s3client.client(settings)
    assert made.meta.region_name == "eu-west-1"
    sent: list[str] = []

    def answer(request: AWSPreparedRequest, **_kwargs: object) -> AWSResponse:
        url = str(request.url)
        sent.append(url)
        if "list-type=2" in url:  # ListObjectsV2: nothing under the prefix
            return AWSResponse(url, 200, {"Content-Type": "application/xml"},
                               _Body(_EMPTY_LISTING))
        return AWSResponse(url, 404, {"Content-Type": "application/xml"}, _Body(_NO_SUCH_KEY))

    made.meta.events.register("before-send.s3", answer)
    try:
        with pytest.raises(ckptio.CheckpointNotFoundError) as info:
            ckptio.load("s3://my-bucket/run-1/step-3")
    finally:
        made.meta.events.unregister("before-send.s3", answer)
    assert sent, "no request was made"
    hosts = {urlsplit(url).hostname for url in sent}
    assert hosts <= {"my-bucket.s3.eu-west-1.amazonaws.com", "s3.eu-west-1.amazonaws.com"}, sent
    assert all(url.startswith("https://") for url in sent), sent
    message = str(info.value)
    assert "s3://my-bucket/run-1/step-3" in message and "AWS S3" in message, message
    assert "http://AWS" not in message and "no scheme" not in message, message
