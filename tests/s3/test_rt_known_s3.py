"""Known suspected S3 defects, reproduced against a real SeaweedFS server: the open multipart
uploads a killed save leaves are listed page after page (the server made to answer in small
pages) and every one is aborted, and a listing whose pages do not advance ends in an error
naming the prefix rather than looping forever."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import pytest
import torch

import ckptio
from ckptio.storage.s3 import client as s3client

PAGE = 2  # uploads per listing page the server is asked for
UPLOADS = 7  # open uploads a killed save left: several pages


def _small_pages(monkeypatch: pytest.MonkeyPatch, answer: Any = None) -> list[int]:
    """Every ListMultipartUploads ckptio sends asks for PAGE uploads (``answer``, if given,
    may change each parsed page); -> a list the pages' upload counts are appended to."""
    make, pages = s3client._make_client, []

    def ask_small(params: dict[str, Any], **_: Any) -> None:
        params["MaxUploads"] = PAGE

    def seen(parsed: dict[str, Any], **_: Any) -> None:
        pages.append(len(parsed.get("Uploads", [])))
        if answer is not None:
            answer(parsed)

    def hooked(settings: Any) -> Any:
        made = make(settings)
        made.meta.events.register("provide-client-params.s3.ListMultipartUploads", ask_small)
        made.meta.events.register("after-call.s3.ListMultipartUploads",
                                  lambda parsed, **kw: seen(parsed, **kw))
        return made

    monkeypatch.setattr(s3client, "_clients", {})
    monkeypatch.setattr(s3client, "_make_client", hooked)
    return pages


def _leave_uploads(s3_client: Any, url: str) -> str:
    """Open UPLOADS multipart uploads under ``url`` named as a save's data files -> prefix."""
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    for i in range(UPLOADS):
        s3_client.create_multipart_upload(
            Bucket=bucket, Key=f"{prefix}/data-{i:019x}-r00000-{i:04d}.bin")
    return prefix


def _open(s3_client: Any, url: str) -> list[str]:
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    got = s3_client.list_multipart_uploads(Bucket=bucket, Prefix=prefix + "/")
    return [u["Key"] for u in got.get("Uploads", [])]


def test_every_page_of_a_killed_saves_open_uploads_is_aborted(s3_env, s3_client, monkeypatch):
    url = s3_env + "/step-1"
    _leave_uploads(s3_client, url)
    assert len(_open(s3_client, url)) == UPLOADS
    pages = _small_pages(monkeypatch)
    began = time.monotonic()
    with ckptio.Checkpointer() as ck:  # its close() waits for the removal of what it
        ck.save({"w": torch.ones(1 << 16)}, url)  # does not name: the killed save's uploads
    assert time.monotonic() - began < 60
    assert max(pages) <= PAGE and sum(pages) >= UPLOADS, pages  # several pages were listed
    assert _open(s3_client, url) == []
    out = {"w": torch.zeros(1 << 16)}
    ckptio.load(url, out)
    assert torch.equal(out["w"], torch.ones(1 << 16))


def test_a_listing_of_uploads_that_does_not_advance_ends_naming_the_prefix(
        s3_env, s3_client, monkeypatch, caplog):
    """A server answering "truncated" with no next marker: the listing asked for the first
    page again for ever (the save never returned). It ends at once, the save commits, and
    the cleanup's warning names the prefix and why."""
    url = s3_env + "/step-1"
    ckptio.save({"w": torch.ones(1 << 16)}, url)
    _leave_uploads(s3_client, url)

    def stuck(parsed: dict[str, Any]) -> None:
        parsed["IsTruncated"] = True
        parsed.pop("NextKeyMarker", None)
        parsed.pop("NextUploadIdMarker", None)

    pages = _small_pages(monkeypatch, stuck)
    outcome: list[BaseException | None] = []

    def save_again() -> None:
        try:
            with ckptio.Checkpointer() as ck:
                ck.save({"w": torch.full((1 << 16,), 2.0)}, url)
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            outcome.append(exc)

    with caplog.at_level(logging.WARNING, logger="ckptio"):
        worker = threading.Thread(target=save_again, daemon=True)
        worker.start()
        worker.join(30)
        assert not worker.is_alive(), f"the save still lists uploads after {len(pages)} pages"
    assert outcome == [None] and len(pages) < 10, (outcome, pages)
    warned = [r.getMessage() for r in caplog.records if "does not advance" in r.getMessage()]
    assert warned and url.removeprefix("s3://") in warned[0], caplog.text
    out = {"w": torch.zeros(1 << 16)}
    ckptio.load(url, out)
    assert torch.equal(out["w"], torch.full((1 << 16,), 2.0))
