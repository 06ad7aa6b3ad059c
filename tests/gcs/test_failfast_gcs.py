"""gs:// fails fast, and within its deadline, against a real GCS server (the
gcp-storage-emulator) and the fault proxy: a closed port, a missing bucket and missing
credentials raise StorageIOError (a CkptError) naming the cause and the fix within seconds under
the default 120 s retry deadline; a black-holed connection (the proxy swallows every data
upload, the connection kept open) fails the save at its deadline, naming the location and the
setting, and the checkpoint saved there before is intact; a black-holed read fails the load so."""

from __future__ import annotations

import socket
import time

import pytest
import torch

import ckptio
from ckptio.storage.gcs.gcs_settings import GcsSettings

from gcs.conftest import settings_at

FAST_S = 10.0  # "within seconds": every refusal here comes well inside this


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # closed again on return: nothing listens there


def _refused(url: str, settings: GcsSettings, *phrases: str,
             within: float = FAST_S) -> ckptio.CkptError:
    """Save to ``url``: the StorageIOError it raises, checked to come within ``within`` and to
    name ``phrases``."""
    began = time.monotonic()
    with pytest.raises(ckptio.StorageIOError) as info:
        ckptio.save({"w": torch.ones(4)}, url, options=ckptio.Options(storage={"gs": settings}))
    elapsed = time.monotonic() - began
    assert elapsed < within, f"{elapsed:.1f} s: {info.value}"
    for phrase in phrases:
        assert phrase in str(info.value), str(info.value)
    return info.value


def test_a_closed_port_fails_at_once(gcs_url):
    endpoint = f"http://127.0.0.1:{_closed_port()}"
    settings = settings_at(endpoint)
    assert settings.retry_deadline_s >= 60  # the deadline is not what makes it fast
    _refused(f"{gcs_url}/c", settings, f"nothing answers at {endpoint}", "endpoint_url")


def test_a_missing_bucket_is_named(gcs_server):
    _refused("gs://no-such-bucket-ckptio/run/c", settings_at(gcs_server.endpoint),
             "'no-such-bucket-ckptio' does not exist", "create it")


def test_missing_credentials_fail_at_once(gcs_url, gcs_server, monkeypatch, tmp_path):
    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "no-such-key.json"))
    settings = settings_at(gcs_server.endpoint, credentials="default")
    _refused(f"{gcs_url}/c", settings, "cannot make a GCS client", "credentials='anonymous'")


def test_a_black_holed_upload_fails_at_its_deadline_and_keeps_the_checkpoint(
        gcs_url, gcs_server, gcs_proxy):
    url = f"{gcs_url}/c"
    settings = settings_at(gcs_proxy.endpoint, retry_deadline_s=2.0)
    options = ckptio.Options(storage={"gs": settings})
    before = {"w": torch.arange(1000.0)}
    ckptio.save(before, url, options=options)
    gcs_proxy.black_hole(query={"uploadType": "resumable"})  # the data upload: never answered
    error = _refused(url, settings, url, "retry_deadline_s", within=2.0 + FAST_S)
    assert "gs://" in str(error)
    gcs_proxy.clear()
    after = {"w": torch.zeros(1000)}
    ckptio.load(url, after, options=ckptio.Options(storage={"gs": settings_at(
        gcs_server.endpoint)}))
    assert torch.equal(after["w"], before["w"]), "the failed save damaged the checkpoint"


def test_a_black_holed_read_fails_the_load_at_its_deadline(gcs_url, gcs_server, gcs_proxy):
    url = f"{gcs_url}/c"
    ckptio.save({"w": torch.arange(1000.0)}, url, options=ckptio.Options(storage={
        "gs": settings_at(gcs_server.endpoint)}))
    settings = settings_at(gcs_proxy.endpoint, retry_deadline_s=2.0)
    gcs_proxy.black_hole(method="GET", key="data-")  # the data file's ranged GETs
    began = time.monotonic()
    with pytest.raises(ckptio.StorageIOError) as info:
        ckptio.load(url, {"w": torch.zeros(1000)}, options=ckptio.Options(storage={"gs": settings}))
    assert time.monotonic() - began < 2.0 + FAST_S, str(info.value)
    assert url in str(info.value) and "retry_deadline_s" in str(info.value), str(info.value)
