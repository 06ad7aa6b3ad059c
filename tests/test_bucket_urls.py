"""Object-store URLs (ckptio/storage/bucket_url.py): s3://, gs:// and az:// share one form,
parsing and messages, each scheme naming its own bucket rule and words (S3Path, GcsPath,
AzPath), and a user's odd key is either kept as written or refused at once, naming the URL and
the form to write. No server is needed: every refusal here comes before any client is made.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptio
from ckptio import CkptError
from ckptio.storage.azure.az_client import AzPath
from ckptio.storage.bucket_url import BucketUrl
from ckptio.storage.gcs.gcs_client import GcsPath
from ckptio.storage.s3.s3path import S3Path

SCHEMES = [(S3Path, "s3://"), (GcsPath, "gs://"), (AzPath, "az://")]
BOUND_S = 5.0  # a refused URL is refused before any request: anything slower tried a service


@pytest.mark.parametrize(("cls", "scheme"), SCHEMES)
def test_each_scheme_parses_joins_and_lists_the_same_way(cls: type[BucketUrl], scheme: str) -> None:
    where = cls.parse(f"{scheme}box-1/run 7/ü%+/")
    assert (where.bucket, where.key) == ("box-1", "run 7/ü%+")
    assert where == cls("box-1", "run 7/ü%+") and type(where) is cls
    assert where.url == f"{scheme}box-1/run 7/ü%+"
    assert where.child("step-3").url == f"{scheme}box-1/run 7/ü%+/step-3"
    assert where.dir_prefix == "run 7/ü%+/"
    whole = cls.parse(f"{scheme}box-1")
    assert (whole.url, whole.dir_prefix, whole.child("x").url) == (f"{scheme}box-1", "",
                                                                    f"{scheme}box-1/x")


def test_azure_keeps_its_own_names() -> None:
    where = AzPath.parse("az://box-1/run/step-3")
    assert (where.container, where.name, where.key) == ("box-1", "run/step-3", "run/step-3")
    assert repr(where) == "AzPath(container='box-1', name='run/step-3')"


@pytest.mark.parametrize(("cls", "url", "message"), [
    (S3Path, "gs://b/x", "'gs://b/x' is not an s3:// URL"),
    (S3Path, "s3://My-Bucket/x", "s3://My-Bucket/x: 'My-Bucket' is not an S3 bucket name; write "
     "s3://BUCKET/PREFIX, e.g. s3://my-bucket/run-7/step-100"),
    (S3Path, "s3://bkt/a/../b", "s3://bkt/a/../b: the key prefix 'a/../b' has an empty, '.' or "
     "'..' part; write s3://BUCKET/PREFIX with plain parts"),
    (GcsPath, "s3://b/x", "'s3://b/x' is not a gs:// URL"),
    (GcsPath, "gs://UP/x", "gs://UP/x: 'UP' is not a GCS bucket name; write gs://BUCKET/PREFIX, "
     "e.g. gs://my-bucket/run-7/step-100"),
    (GcsPath, "gs://bkt/a//b", "gs://bkt/a//b: the object prefix 'a//b' has an empty, '.' or "
     "'..' part; write gs://BUCKET/PREFIX with plain parts"),
    (AzPath, "s3://b/x", "'s3://b/x' is not an az:// URL"),
    (AzPath, "az://UP/x", "az://UP/x: 'UP' is not an Azure container name (3-63 lower-case "
     "letters, digits and single hyphens); write az://CONTAINER/PREFIX, e.g. "
     "az://checkpoints/run-7"),
    (AzPath, "az://box/./b", "az://box/./b: the prefix './b' has an empty, '.' or '..' part; "
     "write az://CONTAINER/PREFIX with plain parts"),
])
def test_each_schemes_messages_word_for_word(cls: type[BucketUrl], url: str, message: str) -> None:
    with pytest.raises(CkptError) as got:
        cls.parse(url)
    assert str(got.value) == message


@pytest.mark.parametrize(("cls", "scheme"), SCHEMES)
@pytest.mark.parametrize("odd", ["run-7\n", "run\x00x", "run\x01x/step-3", "tab\there", "del\x7f"])
def test_a_key_with_a_control_character_is_refused_naming_the_url_and_the_form(
        cls: type[BucketUrl], scheme: str, odd: str) -> None:
    """A run name read from a file and not stripped (``run-7\\n``), or a stray control
    character. Before: s3:// and gs:// wrote under that key, so the same URL written plainly
    found nothing; az:// on Azurite retried server errors for the whole retry deadline and
    blamed the service; a NUL on s3:// got ``400 400 (Bad Request)``. Now the URL is refused at
    once, shown with the character escaped, naming the form to write."""
    url = f"{scheme}bucket-1/{odd}"
    with pytest.raises(CkptError) as got:
        cls.parse(url)
    message = str(got.value)
    assert message.startswith(repr(url)), message
    assert "control character" in message and "with printable parts" in message, message


@pytest.mark.parametrize("scheme", ["s3://", "gs://", "az://"])
def test_save_and_manager_refuse_a_control_character_before_any_request(
        scheme: str, tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through ckptio.save, ckptio.load and a CheckpointManager, the way a training loop writes
    it: a CkptError naming the URL at once, with no endpoint configured (nothing is sent)."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens on port 9
    url = f"{scheme}bucket-1/run-7\n"
    for call in (lambda: ckptio.save({"w": torch.ones(4)}, url),
                 lambda: ckptio.load(url),
                 lambda: ckptio.CheckpointManager(url, keep_last=2)):
        started = time.monotonic()
        with pytest.raises(CkptError, match="control character") as got:
            call()
        assert repr(url) in str(got.value)
        assert time.monotonic() - started < BOUND_S


# ------------------------------------------------------- a bucket name the S3 service refuses


@pytest.fixture(scope="module")
def weed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A SeaweedFS S3 server of this module (bucket ``ckpt``); skipped where weed is missing."""
    pytest.importorskip("boto3")
    from ckptio.testing.s3server import SeaweedServer, ServerError, weed_binary
    try:
        weed_binary()
    except ServerError as exc:
        pytest.skip(str(exc))
    with SeaweedServer(tmp_path_factory.mktemp("weed")) as server:
        yield server


def test_a_manager_on_a_bucket_name_s3_refuses_names_the_bucket_fix(
        weed: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """``s3://ckpt_under/run``: the form takes '_' (old buckets have it), the service refuses
    the name. Before: ckptio.save said the bucket does not exist (create it, or fix the name),
    but a CheckpointManager's first request said only ``400 InvalidBucketName``, with no fix.
    Now both name the URL and say to fix the bucket's name."""
    for name, value in weed.env().items():
        monkeypatch.setenv(name, value)
    url = "s3://ckpt_under/run-7"
    with pytest.raises(CkptError) as got:
        mgr = ckptio.CheckpointManager(url, keep_last=2)
        try:
            mgr.save(1, {"w": torch.ones(4)})
            mgr.wait()
        finally:
            mgr.close()
    message = str(got.value)
    assert url in message and "fix the bucket name" in message, message


def test_a_key_longer_than_s3_allows_says_to_shorten_the_prefix(
        weed: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefix past S3's key length (a run name made of a long config string). Before: ``400
    KeyTooLongError (Your key is too long.)`` about a probe object the user never named, no
    fix. Now the message names the URL and says to write a shorter prefix."""
    for name, value in weed.env().items():
        monkeypatch.setenv(name, value)
    url = f"s3://{weed.bucket}/{'k' * 1100}"
    with pytest.raises(CkptError) as got:
        ckptio.save({"w": torch.ones(4)}, url)
    message = str(got.value)
    assert url in message and "shorter s3:// prefix" in message, message


# ------------------------------------------------------- a URL with a slash missing


@pytest.mark.parametrize("typo", ["s3:/bucket-1/run", "gs:/bucket-1/run", "az:/bucket-1/run",
                                  "S3:/bucket-1/run", "s3:bucket-1/run"])
def test_a_url_missing_a_slash_is_refused_not_written_to_a_local_folder(
        typo: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``s3:/bucket/run`` (one slash): before, ckptio.save wrote the checkpoint into a local
    folder ``./s3:/bucket/run`` and the job went on, its checkpoints on the node's disk, not in
    the bucket. Now save, load and a manager refuse it naming the path, the scheme to write and
    the way to mean a local folder; nothing is made."""
    monkeypatch.chdir(tmp_path)
    scheme = typo.split(":")[0].lower()
    for call in (lambda: ckptio.save({"w": torch.ones(4)}, typo),
                 lambda: ckptio.load(typo),
                 lambda: ckptio.CheckpointManager(typo, keep_last=2)):
        with pytest.raises(CkptError) as got:
            call()
        message = str(got.value)
        assert message.startswith(typo) and f"{scheme}://" in message and "./" in message, message
    assert list(tmp_path.iterdir()) == []


def test_a_local_folder_named_like_a_scheme_is_still_served_with_dot_slash(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    ckptio.save({"w": torch.arange(4.0)}, "./s3:/run")
    assert torch.equal(ckptio.load("./s3:/run")["w"], torch.arange(4.0))
