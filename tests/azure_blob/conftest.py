"""Fixtures for the tests against a real Azure Blob Storage server: Azurite's blob service
(npm ``azurite``) on loopback, in memory, started once per session
(ckptio/testing/azurite.py), and a fault proxy in front of it (ckptio/testing/s3proxy.py
forwards any HTTP/1.1).

Every test here is skipped, saying why, when azure-storage-blob or ``azurite-blob`` is missing
(``pip install -e '.[test]'`` installs the first; ``npm install -g azurite``, which .ci/run
runs, the second); an Azurite that is present but does not start is an error, not a skip.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckptio.storage.azure import az_client
from ckptio.storage.azure.az_settings import CONNECTION_ENV
from ckptio.storage.s3 import timeouts
from ckptio.testing.azurite import AzuriteServer, connection_string, missing
from ckptio.testing.s3proxy import FaultProxy

HERE = Path(__file__).resolve().parent


def through(proxy: FaultProxy) -> str:
    """The connection string of the server reached through ``proxy``."""
    return connection_string(int(proxy.endpoint.rsplit(":", 1)[1]))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    why = missing()
    if why is None:
        return
    skip = pytest.mark.skip(reason=f"Azure tests need a local Azurite server: {why}")
    for item in items:
        if HERE in item.path.resolve().parents:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def azurite(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AzuriteServer]:
    """One Azurite blob service for the session, container ``ckpt``."""
    why = missing()
    if why is not None:
        pytest.skip(f"Azure tests need a local Azurite server: {why}")
    with AzuriteServer(tmp_path_factory.mktemp("azurite")) as server:
        yield server


@pytest.fixture(autouse=True)
def _fresh_endpoints() -> Iterator[None]:
    """Endpoints answered or given up on by earlier tests do not carry over."""
    az_client._reached.clear()
    timeouts.reset()
    yield
    az_client._reached.clear()
    timeouts.reset()


@pytest.fixture
def az_env(azurite: AzuriteServer, monkeypatch: pytest.MonkeyPatch) -> str:
    """Points AZURE_STORAGE_CONNECTION_STRING at the server and returns a fresh prefix
    ``az://ckpt/t-<hex>``."""
    monkeypatch.setenv(CONNECTION_ENV, azurite.connection)
    return f"az://{azurite.container}/t-{uuid.uuid4().hex}"


@pytest.fixture
def az_proxy(azurite: AzuriteServer) -> Iterator[FaultProxy]:
    """A FaultProxy in front of the server, no rules yet (``through(proxy)`` reaches it)."""
    with FaultProxy("127.0.0.1", azurite.port) as proxy:
        yield proxy
    assert not proxy.errors, f"the proxy's threads failed: {proxy.errors!r}"
