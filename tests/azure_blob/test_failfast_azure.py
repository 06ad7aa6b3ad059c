"""az:// fails fast and within its deadline, as S3 does, against a real Azurite server: a
network gone silent in the middle of a save (the fault proxy swallows every request from the
first staged block on) ends the save, and then a load, in StorageIOError (a CkptError) naming the location and
the setting to raise, within the deadline and a short cleanup grace, and the checkpoint there
before is intact; a missing container, an endpoint where nothing listens, no account and a
malformed one each raise a CkptError naming the fix within seconds under the default 120 s
deadline. No other exception type escapes."""

from __future__ import annotations

import socket
import time

import pytest
import torch

import ckptio
from ckptio.storage.azure.az_settings import CONNECTION_ENV, AzureSettings
from ckptio.storage.s3.timeouts import FLOOR_S, GRACE_S

from azure_blob.conftest import through
from ckptio.testing.azurite import connection_string

FAST_S = 10.0  # "within seconds": every refusal here comes well inside this
DEADLINE_S = 2.0


def _refused(url: str, *phrases: str, options: ckptio.Options | None = None) -> str:
    """Save to ``url``: the CkptError it raises, checked to come within FAST_S under the
    default deadline and to name ``phrases``."""
    assert AzureSettings().retry_deadline_s >= 60  # the deadline is not what makes it fast
    began = time.monotonic()
    with pytest.raises(ckptio.CkptError) as info:
        ckptio.save({"w": torch.ones(4)}, url, options=options)
    elapsed = time.monotonic() - began
    assert elapsed < FAST_S, f"{elapsed:.1f} s: {info.value}"
    for phrase in phrases:
        assert phrase in str(info.value), str(info.value)
    return str(info.value)


def test_a_silent_network_mid_save_fails_within_the_deadline(az_env, az_proxy):
    url = f"{az_env}/ckpt"
    before = {"w": torch.arange(50_000.0)}
    ckptio.save(before, url)
    silent = ckptio.Options(storage={"az": AzureSettings(connection_string=through(az_proxy),
                                                         retry_deadline_s=DEADLINE_S)})
    az_proxy.black_hole(method="PUT", query={"comp": "block"}, partition=True)
    began = time.monotonic()
    with pytest.raises(ckptio.StorageIOError) as info:
        ckptio.save({"w": torch.ones(50_000)}, url, options=silent)
    elapsed = time.monotonic() - began
    message = str(info.value)
    assert DEADLINE_S <= elapsed < DEADLINE_S + FLOOR_S + GRACE_S + 5, f"{elapsed:.1f} s: {message}"
    assert url in message and "did not answer in time" in message, message
    assert "retry_deadline_s" in message, message
    restored = {"w": torch.zeros(50_000)}
    began = time.monotonic()
    with pytest.raises(ckptio.StorageIOError) as info:  # a load through it: the same bound
        ckptio.load(url, restored, options=silent)
    elapsed = time.monotonic() - began
    assert elapsed < DEADLINE_S + FLOOR_S + GRACE_S + 5, f"{elapsed:.1f} s: {info.value}"
    assert url in str(info.value), str(info.value)
    az_proxy.clear()
    ckptio.load(url, restored)
    assert torch.equal(restored["w"], before["w"]), "the checkpoint there before was changed"


def test_a_missing_container_is_named(az_env):
    _refused("az://no-such-box/run/ckpt", "'no-such-box' does not exist", "create it")
    with pytest.raises(ckptio.CkptError, match="container does not exist: create it") as info:
        ckptio.load("az://no-such-box/run/ckpt", {"w": torch.zeros(4)})
    assert "az://no-such-box/run" in str(info.value)


def test_an_endpoint_where_nothing_listens_fails_at_once(az_env, monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    monkeypatch.setenv(CONNECTION_ENV, connection_string(port))
    _refused(f"{az_env}/c", f"nothing answers at http://127.0.0.1:{port}", CONNECTION_ENV)


def test_no_account_names_the_variable(az_env, monkeypatch):
    monkeypatch.delenv(CONNECTION_ENV)
    _refused(f"{az_env}/c", CONNECTION_ENV, "AzureSettings")


def test_a_malformed_account_is_refused(az_env):
    bad = ckptio.Options(storage={"az": AzureSettings(connection_string="AccountName=x;junk")})
    _refused(f"{az_env}/c", "malformed", options=bad)
